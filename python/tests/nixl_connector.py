"""A KV-connector-style program written against NIXL's Python API, run by
test_nixl.py against rmacomm.nixl. Apart from the import below it uses
nothing but NIXL's API (with NIXL installed, NIXL_REAL=1 runs it on NIXL).

    python nixl_connector.py target DIR      # owns a KV cache (prefill side)
    python nixl_connector.py initiator DIR   # writes into it, reads from it

Metadata and base addresses travel through files in DIR, as a connector's
side channel would carry them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

if os.environ.get("NIXL_REAL"):
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]
else:
    from rmacomm.nixl import nixl_agent, nixl_agent_config

SLOTS = 32
BLOCK = 8192
WRITE_SLOTS = [5, 17, 2, 30, 11, 23, 8, 0]  # initialize_xfer WRITE, tag b"write-1"
PREP_SLOTS = [1, 3, 4, 9]  # make_prepped_xfer WRITE, tag b"prepped-2"
READ_SLOTS = [20, 21, 22, 25]  # the target fills these; the initiator READs them


def pattern(seed: int) -> np.ndarray:
    return ((np.arange(BLOCK, dtype=np.uint32) * 13 + seed * 101 + 7) % 253).astype(np.uint8)


def publish(d: Path, name: str, data: bytes) -> None:
    (d / f".{name}").write_bytes(data)
    (d / f".{name}").rename(d / name)


def fetch(d: Path, name: str) -> bytes:
    end = time.monotonic() + 60
    while not (d / name).exists():
        assert time.monotonic() < end, f"no {name}"
        time.sleep(0.01)
    return (d / name).read_bytes()


def target(d: Path) -> None:
    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    cache = np.zeros((SLOTS, BLOCK), np.uint8)
    for i, s in enumerate(READ_SLOTS):
        cache[s] = pattern(100 + i)
    base = cache.ctypes.data
    reg_descs = agent.get_reg_descs([(base, cache.nbytes, 0, "")], "DRAM")
    agent.register_memory(reg_descs)
    publish(d, "target.meta", agent.get_agent_metadata())
    publish(d, "target.json", json.dumps({"base": base, "block": BLOCK, "slots": SLOTS}).encode())

    seen: list[bytes] = []
    end = time.monotonic() + 60
    while b"bye" not in seen:
        assert time.monotonic() < end, f"notifications so far: {seen}"
        notifs = agent.get_new_notifs()
        for msg in notifs.get("initiator", []):
            seen.append(msg)
            # A notification arrives after every byte of its request.
            if msg == b"write-1":
                for i, s in enumerate(WRITE_SLOTS):
                    assert (cache[s] == pattern(i)).all(), f"slot {s}"
            elif msg == b"prepped-2":
                for i, s in enumerate(PREP_SLOTS):
                    assert (cache[s] == pattern(50 + i)).all(), f"slot {s}"
        time.sleep(0.001)
    assert seen == [b"write-1", b"prepped-2", b"read-3", b"bye"], seen
    untouched = [s for s in range(SLOTS) if s not in WRITE_SLOTS + PREP_SLOTS + READ_SLOTS]
    assert not cache[untouched].any()
    agent.send_notif("initiator", b"bye-back")
    publish(d, "target.done", b"")
    fetch(d, "initiator.done")
    agent.deregister_memory(reg_descs)
    print("TARGET OK", flush=True)


def wait_done(agent: nixl_agent, handle: int) -> None:
    state = agent.transfer(handle)
    end = time.monotonic() + 30
    while state != "DONE":
        assert state == "PROC", f"transfer state {state}"
        assert time.monotonic() < end, "transfer did not complete"
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)


def initiator(d: Path) -> None:
    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    src = np.stack([pattern(i) for i in range(len(WRITE_SLOTS))] + [pattern(50 + i) for i in range(4)])
    dst = np.zeros((len(READ_SLOTS), BLOCK), np.uint8)
    regs = [
        agent.register_memory(agent.get_reg_descs([(a.ctypes.data, a.nbytes, 0, "")], "DRAM")) for a in (src, dst)
    ]
    name = agent.add_remote_agent(fetch(d, "target.meta"))
    assert name == b"target", name
    assert agent.check_remote_metadata(name)
    info = json.loads(fetch(d, "target.json"))
    base, block = info["base"], info["block"]

    # initialize_xfer: lists of (addr, len, devId) tuples.
    local = agent.get_xfer_descs([(src.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(len(WRITE_SLOTS))], "DRAM")
    remote = agent.get_xfer_descs([(base + s * block, block, 0) for s in WRITE_SLOTS], "DRAM")
    wait_done(agent, agent.initialize_xfer("WRITE", local, remote, name, b"write-1"))

    # vLLM's path: every block of both sides prepared once, requests by index.
    local_blocks = np.array([(src.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(len(src))]
                            + [(dst.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(len(dst))], dtype=np.int64)
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(local_blocks, "DRAM"))
    remote_h = agent.prep_xfer_dlist(name, [(base + s * block, block, 0) for s in range(info["slots"])], "DRAM")
    w = agent.make_prepped_xfer("WRITE", local_h, list(range(8, 12)), remote_h, PREP_SLOTS, b"prepped-2")
    wait_done(agent, w)
    r = agent.make_prepped_xfer("READ", local_h, list(range(12, 16)), remote_h, READ_SLOTS, b"read-3")
    wait_done(agent, r)
    for i in range(len(READ_SLOTS)):
        assert (dst[i] == pattern(100 + i)).all(), f"read block {i}"
    agent.release_dlist_handle(local_h)
    agent.release_dlist_handle(remote_h)

    agent.send_notif(name, b"bye")
    end = time.monotonic() + 30
    while not agent.check_remote_xfer_done("target", b"bye-back"):
        assert time.monotonic() < end, "no bye-back"
        time.sleep(0.001)
    fetch(d, "target.done")
    for reg in regs:
        agent.deregister_memory(reg)
    agent.remove_remote_agent(name)
    publish(d, "initiator.done", b"")
    print("INITIATOR OK", flush=True)


if __name__ == "__main__":
    {"target": target, "initiator": initiator}[sys.argv[1]](Path(sys.argv[2]))
