"""The processes of test_agent.py: a decode and a prefill TransferAgent
exchanging metadata through files in a directory.

    python agent_peers.py decode DIR        # owns the KV cache, receives
    python agent_peers.py prefill DIR       # writes blocks, reads them back
    python agent_peers.py sleeper DIR       # a decode that only waits (to be killed)
    python agent_peers.py orphan DIR        # a prefill whose decode gets killed
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

import rmacomm

SLOTS = 64
BLOCK = 4096
BLOCKS = 16
# Scattered slots of the good request, and of the refused one (which must
# leave its slots untouched).
GOOD = [(7 * b + 3) % SLOTS for b in range(BLOCKS)]
REFUSED = [s for s in range(SLOTS) if s not in GOOD][:4]


def block(b: int) -> np.ndarray:
    return ((np.arange(BLOCK) * 31 + b * 7 + 1) % 251).astype(np.uint8)


def publish(d: Path, name: str, text: str) -> None:
    tmp = d / f".{name}.tmp"
    tmp.write_text(text)
    tmp.rename(d / name)


def fetch(d: Path, name: str, timeout: float = 60) -> str:
    end = time.monotonic() + timeout
    while not (d / name).exists():
        if time.monotonic() > end:
            raise SystemExit(f"no {name} in {d} after {timeout} s")
        time.sleep(0.01)
    return (d / name).read_text()


def decode(d: Path) -> None:
    agent = rmacomm.TransferAgent("decode", timeout=20)
    cache = np.zeros((SLOTS, BLOCK), np.uint8)
    region = agent.register(cache)
    publish(d, "decode.meta", agent.metadata())
    peer, tag = agent.wait_notification(timeout=60)
    assert (peer, tag) == ("prefill", b"req-7"), (peer, tag)
    # The notification comes after every block is placed.
    for b, s in enumerate(GOOD):
        assert (cache[s] == block(b)).all(), f"slot {s} does not hold block {b}"
    others = [s for s in range(SLOTS) if s not in GOOD]
    assert not cache[others].any(), "a slot outside the request changed (the refused request moved something?)"
    # The prefill came in by its handshake: decode never added it.
    assert agent.peers() == ["prefill"], agent.peers()
    assert [r for r, _, _ in agent.regions()] == [region], (agent.regions(), region)
    peer, msg = agent.wait_notification(timeout=60)
    assert (peer, msg) == ("prefill", b"bye"), (peer, msg)
    # And decode reaches it back.
    agent.notify("prefill", b"bye-back").wait(timeout=20)
    print("DECODE OK", flush=True)
    fetch(d, "prefill.done")


def prefill(d: Path) -> None:
    agent = rmacomm.TransferAgent("prefill", timeout=20)
    kv = np.stack([block(b) for b in range(BLOCKS)])
    agent.register(kv)
    assert agent.add_peer(fetch(d, "decode.meta")) == "decode"
    [(region, _addr, length)] = agent.peer_regions("decode")
    assert length == SLOTS * BLOCK

    # A request with one block out of bounds: refused whole, nothing moves.
    bad = [(kv[i], (region, s * BLOCK, BLOCK)) for i, s in enumerate(REFUSED)]
    bad.append((kv[5], (region, SLOTS * BLOCK, BLOCK)))
    try:
        agent.transfer("WRITE", "decode", bad, notify=b"never")
        raise SystemExit("an out-of-bounds block was accepted")
    except rmacomm.ArgumentError as e:
        m = str(e)
        assert "WRITE" in m and '"decode"' in m and "piece 4" in m and "nothing was transferred" in m, m
        print("refused:", m, flush=True)
    try:
        agent.transfer("WRITE", "nobody", [(kv[0], (region, 0, BLOCK))])
        raise SystemExit("an unknown peer was accepted")
    except rmacomm.ArgumentError as e:
        assert '"nobody"' in str(e), str(e)

    # Scattered blocks, one tag. Local sides: rows of the registered array,
    # one as an (address, length) pair.
    pieces: list = [(kv[b], (region, s * BLOCK, BLOCK)) for b, s in enumerate(GOOD)]
    pieces[3] = ((kv.ctypes.data + 3 * BLOCK, BLOCK), pieces[3][1])
    t = agent.transfer("WRITE", "decode", pieces, notify=b"req-7")
    assert t.peer == "decode" and t.op == "WRITE"
    t.wait(timeout=30)
    assert t.status() == "DONE" and t.error() is None

    # Read them back, completing by polling status() alone.
    back = np.zeros((BLOCKS, BLOCK), np.uint8)
    agent.register(back)
    r = agent.transfer("READ", "decode", [(back[b], (region, s * BLOCK, BLOCK)) for b, s in enumerate(GOOD)])
    end = time.monotonic() + 30
    while r.status() == "PROC":
        assert time.monotonic() < end, "the read did not complete"
        time.sleep(0.001)
    assert r.status() == "DONE", r.error()
    assert (back == kv).all(), "read back different bytes"
    s = agent.stats()
    assert s["transfers"] == 2 and s["pieces"] == 2 * BLOCKS, s
    agent.notify("decode", b"bye").wait(timeout=20)
    assert agent.wait_notification(timeout=30) == ("decode", b"bye-back")
    print("PREFILL OK", flush=True)
    publish(d, "prefill.done", "")


def sleeper(d: Path) -> None:
    agent = rmacomm.TransferAgent("decode", timeout=3)
    cache = np.zeros(16 << 20, np.uint8)
    agent.register(cache)
    publish(d, "decode.meta", agent.metadata())
    print("SLEEPING", flush=True)
    time.sleep(300)


def orphan(d: Path) -> None:
    agent = rmacomm.TransferAgent("prefill", timeout=3, connect_timeout=3)
    src = np.ones(16 << 20, np.uint8)
    agent.register(src)
    agent.add_peer(fetch(d, "decode.meta"))
    [(region, _, _)] = agent.peer_regions("decode")
    agent.transfer("WRITE", "decode", [(src[:BLOCK], (region, 0, BLOCK))], notify=b"first").wait(timeout=20)
    publish(d, "prefill.connected", "")
    fetch(d, "decode.killed")
    start = time.monotonic()
    pieces = [(src[i << 20:(i + 1) << 20], (region, i << 20, 1 << 20)) for i in range(16)]
    for _ in range(100):
        try:
            agent.transfer("WRITE", "decode", pieces, notify=b"lost").wait(timeout=15)
        except rmacomm.PeerError as e:
            m = str(e)
            assert '"decode"' in m and "WRITE" in m, m
            print(f"PEER ERROR after {time.monotonic() - start:.2f} s: {m}", flush=True)
            return
    raise SystemExit("transfers to a killed peer kept succeeding")


if __name__ == "__main__":
    role, where = sys.argv[1], Path(sys.argv[2])
    {"decode": decode, "prefill": prefill, "sleeper": sleeper, "orphan": orphan}[role](where)
