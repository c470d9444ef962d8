"""rmacomm.TransferAgent: two processes (agent_peers.py) moving scattered
blocks with a tag, reading them back, a refused request that moves
nothing, a killed peer named in the error; and in one process the asyncio
forms, registration kinds and argument errors."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import numpy as np
import pytest

import rmacomm

from conftest import requires_torch

PEERS = Path(__file__).resolve().with_name("agent_peers.py")


def start(role: str, d: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PEERS), role, str(d)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def finish(p: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"{p.args} did not finish:\n{out.decode(errors='replace')}")
    text = out.decode(errors="replace")
    assert p.returncode == 0, f"{p.args} exited with {p.returncode}:\n{text}"
    return text


def test_scattered_blocks_with_a_tag_then_read_back(tmp_path: Path) -> None:
    procs: List[subprocess.Popen] = [start("decode", tmp_path), start("prefill", tmp_path)]
    outs = [finish(p) for p in procs]
    assert "DECODE OK" in outs[0], outs[0]
    assert "PREFILL OK" in outs[1] and "refused:" in outs[1], outs[1]


def test_a_killed_peer_is_named(tmp_path: Path) -> None:
    sleeper = start("sleeper", tmp_path)
    orphan = start("orphan", tmp_path)
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "prefill.connected").exists():
            assert time.monotonic() < end and orphan.poll() is None, "the prefill never connected"
            time.sleep(0.01)
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait(timeout=10)
        (tmp_path / "decode.killed").write_text("")
        out = finish(orphan, timeout=60)
    finally:
        for p in (sleeper, orphan):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "PEER ERROR" in out and '"decode"' in out, out


def pair(**kw: object) -> tuple:
    a = rmacomm.TransferAgent("a", timeout=10, **kw)  # type: ignore[arg-type]
    b = rmacomm.TransferAgent("b", timeout=10, **kw)  # type: ignore[arg-type]
    a.add_peer(b.metadata().encode())
    return a, b


def test_in_process_forms_and_errors() -> None:
    a, b = pair(qps=2)
    src = np.arange(8192, dtype=np.uint8)
    dst = np.zeros(8192, np.uint8)
    mem = rmacomm.RdmaMemory(src)
    mine = a.register(mem)
    assert a.register(mem) == mine and [r for r, _, _ in a.regions()] == [mine]
    region = b.register(dst)
    a.add_peer(b.metadata())  # refreshed: the new region is visible
    [(rid, addr, length)] = a.peer_regions("b")
    assert (rid, addr, length) == (region, dst.ctypes.data, 8192)

    async def go() -> tuple:
        t = a.transfer("write", b"b", [(src[:4096], (region, 4096, 4096))], notify=b"async")
        await t
        return t.status(), await b.wait_notification_async()

    assert asyncio.run(go()) == ("DONE", ("a", b"async"))

    async def cancelled() -> list:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(b.wait_notification_async(), 0.05)
        a.notify("b", b"late").wait(timeout=10)
        end = time.monotonic() + 10
        got: list = []
        while not got and time.monotonic() < end:
            await asyncio.sleep(0.01)
            got = b.get_notifications()
        return got

    # The cancelled wait's task took it: kept for the next taker.
    assert asyncio.run(cancelled()) == [("a", b"late")]
    assert (dst[4096:] == src[:4096]).all() and not dst[:4096].any()
    assert b.get_notifications() == [] and b.pending_notifications() == 0

    # A cancelled wait stops waiting: the next notification goes to the
    # wait running then, async or not (the cancelled one's task took it,
    # and the running waits waited on).
    async def cancelled_then_async() -> tuple:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(b.wait_notification_async(), 0.05)
        fut = asyncio.ensure_future(b.wait_notification_async())
        await asyncio.sleep(0.05)
        a.notify("b", b"next").wait(timeout=10)
        return await asyncio.wait_for(fut, 5)

    assert asyncio.run(cancelled_then_async()) == ("a", b"next")

    async def cancel_one() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(b.wait_notification_async(), 0.05)

    import threading

    loop = asyncio.new_event_loop()
    loop.run_until_complete(cancel_one())  # the loop stays open
    timer = threading.Timer(0.2, lambda: a.notify("b", b"sync").wait(timeout=10))
    timer.start()
    t0 = time.monotonic()
    assert b.wait_notification(timeout=5) == ("a", b"sync")
    assert time.monotonic() - t0 < 3
    timer.join()
    loop.close()
    assert b.get_notifications() == [] and b.pending_notifications() == 0

    # Arguments: nothing moves, the errors say what.
    with pytest.raises(ValueError, match="WRITE.*READ"):
        a.transfer("PUT", "b", [])
    with pytest.raises(TypeError, match="pieces\\[0\\]"):
        a.transfer("WRITE", "b", [src])
    with pytest.raises(rmacomm.ArgumentError, match="lies in no region registered"):
        a.transfer("WRITE", "b", [(np.zeros(16, np.uint8), (region, 0, 16))])
    with pytest.raises(rmacomm.ArgumentError, match="piece 0.*region 9"):
        a.transfer("WRITE", "b", [(src[:16], (9, 0, 16))])
    with pytest.raises(ValueError, match="read-only"):
        ro = src[:16].copy()
        a.register(ro)
        ro.flags.writeable = False
        a.transfer("READ", "b", [(ro, (region, 0, 16))])
    with pytest.raises(rmacomm.ArgumentError, match="4096"):
        a.notify("b", b"x" * 5000)
    # Named once, by the agent's own error.
    with pytest.raises(rmacomm.ArgumentError, match='^WRITE: transfer: invalid argument: with peer "b": the notification') as ei:
        a.transfer("WRITE", "b", [], notify=b"x" * 5000)
    assert str(ei.value).count('"b"') == 1, ei.value
    with pytest.raises(rmacomm.TimeoutError):
        b.wait_notification(timeout=0.05)
    assert not dst[:4096].any()

    # By address; deregistered memory is refused.
    raw = np.full(4096, 9, np.uint8)
    rid2 = a.register_address(raw.ctypes.data, raw.nbytes)
    a.transfer("WRITE", "b", [((raw.ctypes.data, 4096), (region, 0, 4096))]).wait(timeout=10)
    assert (dst[:4096] == 9).all()
    assert a.deregister(rid2) and not a.deregister(rid2)
    with pytest.raises(rmacomm.ArgumentError):
        a.transfer("WRITE", "b", [((raw.ctypes.data, 4096), (region, 0, 4096))])
    assert a.deregister(mem)

    # remove_peer: the next request names the unknown peer.
    assert a.remove_peer("b") and a.peers() == []
    with pytest.raises(rmacomm.ArgumentError, match='unknown peer "b"'):
        a.notify("b", b"gone")
    assert "TransferAgent" in repr(a) and a.stats()["connections"] >= 1



def landed(a: rmacomm.TransferAgent, b: rmacomm.TransferAgent, src: np.ndarray, rid: int) -> str:
    """A's write of src[:64] into b's region rid (with a notification), as
    "DONE" or the error's text."""
    t = a.transfer("WRITE", "b", [(src[:64], (rid, 0, 64))], notify=b"late")
    try:
        t.wait(timeout=10)
        return "DONE"
    except rmacomm.CommError as e:
        return str(e)


def test_a_deregistered_region_takes_no_more_writes() -> None:
    # Several rounds: the refusal's report once raced the failure of the
    # notification posted behind the write (reported as the peer lost).
    for _ in range(8):
        deregistered_region_round()


def deregistered_region_round() -> None:
    a, b = pair()
    src = np.full(256, 5, np.uint8)
    a.register(src)
    # (1) An RdmaMemory the caller still holds; (2) an array with a slice
    # of it registered too (the slice's region held the array's
    # registration, and with it its key).
    dst1 = np.zeros(256, np.uint8)
    mem = rmacomm.RdmaMemory(dst1)
    dst2 = np.zeros(256, np.uint8)
    r1, r2 = b.register(mem), b.register(dst2)
    r2_tail = b.register(dst2[128:])
    a.add_peer(b.metadata())
    assert landed(a, b, src, r1) == "DONE" and landed(a, b, src, r2) == "DONE"
    assert b.wait_notification(timeout=10) == ("a", b"late") and b.wait_notification(timeout=10) == ("a", b"late")
    dst1[:] = 0
    dst2[:] = 0
    assert b.deregister(mem) and b.deregister(r2)
    assert [r for r, _, _ in b.regions()] == [r2_tail]
    for rid in (r1, r2):
        err = landed(a, b, src, rid)
        assert err.startswith('WRITE: peer "b" refused the write: '), err
    assert not dst1.any() and not dst2.any(), "a deregistered region was written"
    assert b.get_notifications() == []


def test_deregister_takes_an_id_only_as_an_int() -> None:
    # A 0-d array (or a one-element tensor) converts to an int: it is the
    # object registered, not the id of another region.
    a = rmacomm.TransferAgent("solo", timeout=10)
    big = np.zeros(4096, np.uint8)
    r_big = a.register(big)
    one = np.array(r_big, dtype=np.int64)  # the 0-d array's value is big's id
    r_one = a.register(one)
    assert a.deregister(one)
    assert [r for r, _, _ in a.regions()] == [r_big] and r_one != r_big
    assert a.deregister(r_big) and a.regions() == []


DEADLOCK = """
import threading, time
import numpy as np
import rmacomm
a = rmacomm.TransferAgent("a", timeout=10)
b = rmacomm.TransferAgent("b", timeout=10)
src, dst = np.arange(512, dtype=np.uint8), np.zeros(512, np.uint8)
a.register(src)
rid = b.register(dst)
a.add_peer(b.metadata())
stop = threading.Event()
def other():
    while not stop.is_set():
        a.regions()
th = threading.Thread(target=other)
th.start()
def pieces():
    for i in range(8):
        time.sleep(0.02)  # lets the other thread run
        yield (src[i * 64:(i + 1) * 64], (rid, i * 64, 64))
a.transfer("WRITE", "b", pieces()).wait(timeout=10)
stop.set()
th.join()
assert (dst == src).all()
print("no deadlock")
"""


def test_pieces_from_a_generator_while_another_thread_uses_the_agent() -> None:
    # transfer() held the agent's region lock while the generator ran;
    # a thread calling a.regions() meanwhile waited for it holding the GIL.
    p = subprocess.run([sys.executable, "-c", DEADLOCK], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "no deadlock" in p.stdout, p.stdout + p.stderr


def test_read_only_memory_is_refused() -> None:
    a = rmacomm.TransferAgent("ro", timeout=10)
    frozen = bytes(64)
    with pytest.raises(ValueError, match="read-only"):
        a.register(np.frombuffer(frozen, np.uint8))
    assert a.regions() == []


@requires_torch
def test_torch_tensors() -> None:
    import torch

    a, b = pair()
    src = torch.arange(1024, dtype=torch.float32)
    dst = torch.zeros(1024, dtype=torch.float32)
    a.register(src)
    region = b.register(dst)
    a.add_peer(b.metadata())
    a.transfer("WRITE", "b", [(src[256:512], (region, 0, 1024))], notify=b"t").wait(timeout=10)
    assert b.wait_notification(timeout=10) == ("a", b"t")
    assert torch.equal(dst[:256], src[256:512])
