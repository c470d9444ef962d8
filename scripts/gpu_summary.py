#!/usr/bin/env python3
"""Tables of a GPU suite run's figures, each beside the copy ceiling of the
same run (`bash scripts/gpu_suite.sh run` writes them to $OUT; this reads
that folder): window puts and the transport's device paths against
cuMemcpyDtoD, all_reduce beside NCCL's single rank, and the stages that
failed. Markdown on stdout, ready for docs/gpu.md. Standard library only
(the GPU machines have python3 but no network).

    python3 scripts/gpu_summary.py RESULTS_DIR
"""

import json
import os
import re
import sys

MIB = 1 << 20
# rdma_bench reports MB/s with perftest's MB (2^20 bytes); GB/s here is 1e9 B/s.
RDMA_MB = 1_048_576


def lines(path, *need):
    """The JSON objects of a JSON-lines file that have the fields `need`
    (other lines skipped); [] if absent."""
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = re.sub(r"^\[\d+\] ", "", line.strip())
                if line.startswith("{"):
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(r, dict) and all(r.get(k) is not None for k in need):
                        out.append(r)
    except FileNotFoundError:
        pass
    return out


def size(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def num(x, digits=1):
    return "–" if x is None else f"{x:,.{digits}f}"


def ratio(a, b):
    return None if a is None or not b else a / b


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def ceiling_of(d):
    """cuMemcpyDtoD GB/s by size, from copy_ceiling.jsonl."""
    recs = lines(os.path.join(d, "copy_ceiling.jsonl"), "bytes", "GBps")
    return {r["bytes"]: r["GBps"] for r in recs if r.get("test") == "cuMemcpyDtoD"}


def at(ceil, n):
    """The ceiling at n bytes; None where copy_ceiling measured no such size
    (small copies are bound by their per-call cost: no size stands in for
    another)."""
    return ceil.get(n)


def machine(d):
    p = os.path.join(d, "machine.txt")
    if os.path.exists(p):
        with open(p, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[:12]).rstrip()
    return None


# What a failing stage prints (cargo test, Rust panics, Python, the
# suite's own `# FAILED` lines); passing output names errors it expects.
FAILURE = re.compile(r"test result: FAILED|panicked at|Traceback \(most recent call last\)|\bFAILED\b|timed out")


def failed_stages(d):
    """The stages whose output shows a failure, and the suite's last line:
    from suite.log (the run's whole output, `# ... (at Ns)` stage headers)
    where the caller kept one, else from every stage's own log."""
    p = os.path.join(d, "suite.log")
    bad, stage, done = [], None, None
    if os.path.exists(p):
        with open(p, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("# done at"):
                    done = line[2:].strip()
                elif line.startswith("# ") and "(at " in line:
                    stage = line[2:].split(" (at ")[0].strip()
                    if "FAILED" in stage and stage not in bad:
                        bad.append(stage)
                elif stage and FAILURE.search(line) and stage not in bad:
                    bad.append(stage)
        return bad, done
    for name in sorted(os.listdir(d)):
        if name.endswith((".log", ".jsonl")) and name != "summary.md":
            with open(os.path.join(d, name), encoding="utf-8", errors="replace") as f:
                if any(FAILURE.search(line) for line in f):
                    bad.append(name)
    return bad, None


def main(d):
    out = []
    m = machine(d)
    if m:
        out += ["```", m, "```", ""]
    ceil = ceiling_of(d)
    if ceil:
        out += ["**Copy ceiling** (`cuMemcpyDtoD`, same run), GB/s:", ""]
        out += [table(["size", "GB/s"], [[size(n), num(g)] for n, g in sorted(ceil.items())]), ""]
    else:
        out += ["No copy_ceiling.jsonl: ratios below are missing.", ""]

    w = [r for r in lines(os.path.join(d, "window_device_bw.jsonl"), "bytes") if r.get("test") == "window_device_put"]
    if w:
        rows = []
        for r in sorted(w, key=lambda r: r["bytes"]):
            c = at(ceil, r["bytes"])
            q = ratio(r.get("stream_GBps"), c)
            mark = "" if r["bytes"] < MIB or q is None else (" ✓" if q >= 0.9 else " ✗")
            rows.append([size(r["bytes"]), num(r.get("stream_GBps")), num(r.get("local_GBps")), num(c), num(q, 2) + mark])
        out += ["**Window put, device to device** (queued on a stream; target ≥ 0.9× the ceiling from 1 MiB):", ""]
        out += [table(["size", "put GB/s", "own-memory copies GB/s", "ceiling GB/s", "put / ceiling"], rows), ""]

    runs = [("transport_cuda_ipc_write", "same host (CUDA IPC), write"),
            ("transport_cuda_ipc_read", "same host (CUDA IPC), read"),
            ("transport_cuda_ipc_write_frag16M", "same host (CUDA IPC), write, 16 MiB fragments"),
            ("transport_cuda_write", "tcp (pinned staging), write"),
            ("transport_cuda_read", "tcp (pinned staging), read"),
            ("transport_host_write", "tcp, host memory, write"),
            ("transport_host_read", "tcp, host memory, read")]
    rows = []
    for name, what in runs:
        for r in sorted(lines(os.path.join(d, name + ".jsonl"), "bytes", "bw_avg_MBps"), key=lambda r: r["bytes"]):
            if r["bytes"] < 64 << 10:
                continue
            g = r["bw_avg_MBps"] * RDMA_MB / 1e9
            c = at(ceil, r["bytes"])
            # Device-to-device runs record the engine's waits for the device
            # (rdma_bench from 2026-11-27 on): MiB moved per wait.
            waits, moved = r.get("device_copy_waits"), r.get("peer_device_bytes")
            per_wait = moved / waits / MIB if waits and moved is not None else None
            rows.append([what, size(r["bytes"]), num(g, 2), num(c), num(ratio(g, c), 3), num(per_wait, 2)])
    if rows:
        out += ["**Transport on device memory** (`rdma_bench --use-cuda 0`, soft provider; average, GB/s; "
                "MiB per wait: device-to-device bytes per wait of the engine for the device):", ""]
        out += [table(["path", "size", "GB/s", "ceiling GB/s", "/ ceiling", "MiB per wait"], rows), ""]

    st = lines(os.path.join(d, "staging_copies.jsonl"), "test", "bytes")
    if st:
        rows = [[r["test"], size(r["bytes"]), num(r.get("us_per_call"), 2), num(r.get("GBps"))]
                for r in sorted(st, key=lambda r: (r["test"], r["bytes"]))]
        out += ["**Staged copies** (per call, `copy_ceiling --staging`):", ""]
        out += [table(["copy", "size", "µs/call", "GB/s"], rows), ""]

    pr = lines(os.path.join(d, "window_proxy.jsonl"))
    for r in pr:
        if r.get("test") == "window_proxy_put" and all(r.get(k) is not None for k in ("bytes", "stream_MBps", "host_MBps")):
            out += [f"Stream proxy: {size(r['bytes'])} puts queued on a stream {num(r['stream_MBps'] / 1000)} GB/s, "
                    f"from the host {num(r['host_MBps'] / 1000)} GB/s "
                    f"({num(ratio(r['stream_MBps'], r['host_MBps']), 2)}×)."]
        elif r.get("test") == "window_proxy_signal_rtt" and all(r.get(k) is not None for k in ("stream_queued_us", "host_us")):
            out += [f"Proxied signal round trip: stream {num(r['stream_queued_us'])} µs, host {num(r['host_us'])} µs."]
    for r in lines(os.path.join(d, "window_device_lat.jsonl")):
        out += [f"Window signal round trip: host {num(r.get('host_us'), 2)} µs, stream queued "
                f"{num(r.get('stream_queued_us'), 1)} µs, stream synchronized {num(r.get('stream_synced_us'), 1)} µs."]
    if pr:
        out += [""]

    ar = {}
    # Runs before 2026-12-01 had device flags by default and a host-flags
    # stage; later ones host words by default and a device-flags stage.
    heads = {
        "native_all_reduce": "native (IPC)",
        "native_all_reduce_hostflags": "native, host flags",
        "native_all_reduce_deviceflags": "native, device flags",
        "native_all_reduce_transport": "native, transport mode",
        "nccl_all_reduce": "NCCL, 1 rank",
    }
    for name in heads:
        for r in lines(os.path.join(d, name + ".jsonl"), "bytes", "us", "algbw_GBps"):
            ar.setdefault(r["bytes"], {})[name] = r
    if ar:
        cols = [c for c in heads if any(c in v for v in ar.values())]
        rows = []
        for n in sorted(ar):
            cells = []
            for c in cols:
                r = ar[n].get(c)
                cells.append("–" if r is None else f"{num(r['us'])} µs ({num(r['algbw_GBps'], 2)} GB/s)")
            rows.append([size(n)] + cells)
        out += ["**all_reduce** (µs per call, algorithm bandwidth; NCCL: one rank, the machine has one GPU):", ""]
        out += [table(["size"] + [heads[c] for c in cols], rows), ""]

    # A rank that dies: how long the watchdog took to release the waiting
    # stream (an eager all_reduce; a CUDA graph's replay).
    released = []
    for name, what in (("native_gpu_killed", "an all_reduce"), ("native_gpu_killed_replay", "a graph replay")):
        try:
            with open(os.path.join(d, name + ".log"), encoding="utf-8", errors="replace") as f:
                m = re.search(r"error after ([0-9.]+)(ns|µs|us|ms|s):", f.read())
        except FileNotFoundError:
            m = None
        if m:
            released.append(f"{what} {m.group(1)} {m.group(2)}")
    if released:
        out += ["A rank that dies: the peer's waiting stream released after " + ", ".join(released) + ".", ""]

    bad, done = failed_stages(d)
    if done:
        out += [f"Suite: {done}."]
    if bad:
        out += ["Stages whose output shows a failure:", ""] + [f"- {s}" for s in bad]
    else:
        out += ["No stage's output shows a failure."]
    print("\n".join(out))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: gpu_summary.py RESULTS_DIR (the folder gpu_suite.sh run wrote)")
    main(sys.argv[1])
