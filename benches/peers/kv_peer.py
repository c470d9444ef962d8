"""The KV-cache workload of `rdma_bench kv`, for a peer library: a prefill
process (this one) and a decode process (started as a child of it, talking
over its stdin/stdout), one request of N blocks of B bytes into shuffled,
never adjacent slots of a 2N-slot cache, one notification. The time runs
from the request's creation (the call that names the blocks) to decode
seeing the notification, read on CLOCK_MONOTONIC in both processes (one
host: one clock), as rdma_bench kv reads it. Between requests the pipe's
traffic (decode told to wait, its arrival time back) is not timed. The
last request of each shape is checked at decode: every block in its slot,
no other slot changed.

A driver (nixl_kv.py, mooncake_kv.py) supplies a `Backend` class:
  Backend(role, args)            role "prefill" or "decode"
  .register(buf: numpy uint8)    once per process
  .metadata() -> str             decode's, handed to prefill (JSON-able)
  .add_peer(meta: str)           prefill
  .request(local_addrs, remote_addrs, length, tag: bytes)
                                 prefill: post the request with its
                                 notification, return when it completed
  .poll_notification(tag) -> bool  decode: True once `tag` arrived
  .label -> str                  e.g. "nixl 1.5.1 (UCX, UCX_TLS=all)"
  .until -> str                  "notification at decode" (or, where the
                                 library has no notification, "transfer
                                 completed")

Prints one JSON object per shape, as benches/compare.sh reads them.
"""

import json
import os
import random
import subprocess
import sys
import time

import numpy as np

UNTOUCHED = 0xEE

# Between two polls of a library's state (decode: its notifications;
# prefill: its transfer's state, where the library is polled), sleep this
# long (KV_PEER_POLL_US, µs; 0: spin). Two spinning Python threads take the
# cores the library's own threads need on a small machine: on this 2-core
# host NIXL's 256 x 16 KiB request took 20 ms spinning, 2 ms with 20 µs
# sleeps (rdma_bench kv sleeps in its waits too).
POLL_S = float(os.environ.get("KV_PEER_POLL_US", "20")) / 1e6


def pause():
    if POLL_S > 0:
        time.sleep(POLL_S)


def slots(n, seed):
    """Even slots of 0 .. 2n, shuffled: no two blocks touch."""
    s = [2 * i for i in range(n)]
    random.Random(seed).shuffle(s)
    return s


def pattern(base, rnd, b):
    return base ^ np.uint8((b * 13 + rnd * 7 + 1) & 0xFF)


def pct(sorted_v, p):
    """Nearest rank, as rdma_bench's."""
    import math
    k = max(1, min(len(sorted_v), math.ceil(p * len(sorted_v))))
    return sorted_v[k - 1]


def decode(Backend, args, out):
    cache = np.full(2 * args["max_bytes"], UNTOUCHED, dtype=np.uint8)
    be = Backend("decode", args)
    be.register(cache)
    print(json.dumps({"meta": be.metadata(), "cache": int(cache.ctypes.data)}), file=out, flush=True)
    shape = None
    for line in sys.stdin:
        m = json.loads(line)
        if "shape" in m:
            n, size, sl, seed = m["shape"]
            cache[: 2 * n * size] = UNTOUCHED
            base = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
            shape = (n, size, sl, base)
            reply = {"ok": 1}
        elif "wait" in m:
            tag = ("kv %d" % m["wait"]).encode()
            deadline = time.monotonic() + 60
            while not be.poll_notification(tag):
                pause()
                if time.monotonic() > deadline:
                    reply = {"error": "no notification %r within 60 s" % tag}
                    break
            else:
                reply = {"t_ns": time.monotonic_ns()}
        elif "check" in m:
            n, size, sl, base = shape
            rnd = m["check"]
            reply = {"ok": 1}
            of_slot = {s: b for b, s in enumerate(sl)}
            for s in range(2 * n):
                got = cache[s * size:(s + 1) * size]
                if s in of_slot:
                    if not np.array_equal(got, pattern(base, rnd, of_slot[s])):
                        reply = {"error": "block %d in slot %d differs" % (of_slot[s], s)}
                        break
                elif not (got == UNTOUCHED).all():
                    reply = {"error": "slot %d, which no block names, changed" % s}
                    break
        else:
            break
        print(json.dumps(reply), file=out, flush=True)
    out.flush()
    # NIXL 1.5.1 crashes tearing its agent down at exit: skip the teardown.
    os._exit(0)


def prefill(Backend, args, out):
    me = os.path.abspath(sys.argv[0])
    child = subprocess.Popen(
        [sys.executable, me, "--decode", json.dumps(args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(m):
        child.stdin.write(json.dumps(m) + "\n")
        child.stdin.flush()
        r = json.loads(child.stdout.readline())
        if "error" in r:
            raise RuntimeError("decode: " + r["error"])
        return r

    hello = json.loads(child.stdout.readline())
    local = np.zeros(args["max_bytes"], dtype=np.uint8)
    be = Backend("prefill", args)
    be.register(local)
    be.add_peer(hello["meta"])
    cache = hello["cache"]
    laddr = int(local.ctypes.data)
    for n, size in args["shapes"]:
        seed = n * 1000003 + size
        sl = slots(n, seed)
        ask({"shape": [n, size, sl, seed]})
        base = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        la = [laddr + b * size for b in range(n)]
        ra = [cache + s * size for s in sl]
        iters, warm = args["iters"], args["warmup"]
        times, local_times = [], []
        for rnd in range(warm + iters):
            last = rnd + 1 == warm + iters
            if last:
                for b in range(n):
                    local[b * size:(b + 1) * size] = pattern(base, rnd, b)
            if be.until == "notification at decode":
                child.stdin.write(json.dumps({"wait": rnd}) + "\n")
                child.stdin.flush()
            t0 = time.monotonic_ns()
            be.request(la, ra, size, ("kv %d" % rnd).encode())
            t1 = time.monotonic_ns()
            t_local = (t1 - t0) / 1e3
            if be.until == "notification at decode":
                r = json.loads(child.stdout.readline())
                if "error" in r:
                    raise RuntimeError("decode: " + r["error"])
                t1 = r["t_ns"]
            if rnd >= warm:
                times.append((t1 - t0) / 1e3)
                local_times.append(t_local)
            if last:
                ask({"check": rnd})
        v = sorted(times)
        med = v[len(v) // 2]
        print(json.dumps({
            "peer": be.label, "test": "kv", "link": args["link"], "blocks": n, "block_bytes": size,
            "bytes": n * size, "iterations": len(v), "until": be.until,
            "t_min_us": v[0], "t_median_us": med, "t_p90_us": pct(v, 0.9), "t_p99_us": pct(v, 0.99),
            "t_max_us": v[-1], "t_local_median_us": sorted(local_times)[len(v) // 2], "GBps": n * size / med / 1e3, "us_per_block": med / n,
        }), file=out, flush=True)
    child.stdin.write(json.dumps({"bye": 1}) + "\n")
    child.stdin.close()
    child.wait(timeout=30)
    # Keep the backend alive until decode is gone (its teardown may crash).
    del be


def main(Backend):
    """`DRIVER --link shm|tcp [-n ITERS] [--warmup W] N:B [N:B ...]`."""
    # The libraries log to stdout: keep it for them (sent to stderr) and
    # write this protocol's lines to a copy of the real one.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    if len(sys.argv) > 2 and sys.argv[1] == "--decode":
        decode(Backend, json.loads(sys.argv[2]), out)
        return
    argv = sys.argv[1:]
    args = {"link": "shm", "iters": None, "warmup": None, "shapes": []}
    while argv:
        a = argv.pop(0)
        if a == "--link":
            args["link"] = argv.pop(0)
        elif a == "-n":
            args["iters"] = int(argv.pop(0))
        elif a == "--warmup":
            args["warmup"] = int(argv.pop(0))
        else:
            n, b = a.split(":")
            args["shapes"].append((int(n), int(b)))
    if not args["shapes"]:
        sys.exit("usage: %s --link shm|tcp [-n ITERS] [--warmup W] N:B [N:B ...]" % sys.argv[0])
    args["max_bytes"] = max(n * b for n, b in args["shapes"])
    # rdma_bench kv's defaults: about 1 GiB a shape, 20 ..= 500; a tenth to
    # warm up, 2 ..= 50 (per shape below when not given).
    shapes = args["shapes"]
    for n, b in shapes:
        a = dict(args, shapes=[(n, b)])
        a["iters"] = args["iters"] or max(20, min(500, (1 << 30) // (n * b)))
        a["warmup"] = args["warmup"] if args["warmup"] is not None else max(2, min(50, a["iters"] // 10))
        prefill(Backend, a, out)
    out.flush()
    os._exit(0)
