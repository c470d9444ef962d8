"""RdmaTransport between processes (URLs and pickled remote buffers
exchanged by a collective; blocking and asyncio), and in one process."""

import asyncio
import pickle
import time

import numpy as np
import pytest

import rmacomm
from conftest import launch


def test_transport_between_two_ranks_with_pickled_remote_buffers() -> None:
    out = launch(2, "transport")
    assert out.count("transport ok") == 2


def test_remote_buffer_pickles_and_parses() -> None:
    mem = rmacomm.RdmaMemory(np.zeros(64, np.float32))
    rb = mem.to_remote_buffer()
    assert pickle.loads(pickle.dumps(rb)) == rb
    assert rmacomm.RdmaRemoteBuffer.parse(str(rb)) == rb
    assert rb.len == 256 and len(mem) == 256
    sub = rb.slice(16, 32)
    assert (sub.addr, sub.len, sub.key) == (rb.addr + 16, 32, rb.key)
    with pytest.raises(ValueError, match="outside"):
        rb.slice(250, 10)
    with pytest.raises(ValueError, match="not a remote buffer"):
        rmacomm.RdmaRemoteBuffer.parse("nonsense")
    assert hash(rb) == hash(pickle.loads(pickle.dumps(rb)))


def test_transport_pair_in_one_process_blocking_and_asyncio() -> None:
    a, b = rmacomm.RdmaTransport(timeout=10), rmacomm.RdmaTransport(timeout=10)
    ua, ub = a.bind(), b.bind()

    async def connect() -> None:
        await asyncio.gather(a.connect_async(ub), b.connect_async(ua))

    asyncio.run(connect())
    assert a.connected() and b.connected()
    src = np.arange(1000, dtype=np.int32)
    dst = rmacomm.empty(1000, np.int32)
    ms, md = rmacomm.RdmaMemory(src), rmacomm.RdmaMemory(dst)
    a.write(ms.to_view(), md.to_remote_buffer(), notify=True)
    b.wait_for_write()
    assert (dst == src).all()
    back = np.zeros(1000, np.int32)
    b.read(rmacomm.RdmaMemory(back).to_view(), ms.to_remote_buffer())
    assert (back == src).all()

    async def notify_twice() -> None:
        await a.write_async(ms.to_view(0, 40), md.to_remote_buffer(), notify=True)
        await a.write_async(ms.to_view(0, 40), md.to_remote_buffer(), notify=True)
        await b.wait_for_write_async()
        await b.wait_for_write_async(timeout=5)

    asyncio.run(notify_twice())
    with pytest.raises(rmacomm.TimeoutError):
        b.wait_for_write(timeout=0.1)
    with pytest.raises(rmacomm.ArgumentError, match="already connected"):
        a.connect(ub)
    with pytest.raises(RuntimeError, match="asyncio"):
        a.write_async(ms.to_view(), md.to_remote_buffer())
    # An async wait refused for want of a running loop takes no
    # notification (it took the one waiting, then failed).
    a.write(ms.to_view(0, 4), md.to_remote_buffer(), notify=True)
    time.sleep(0.1)
    with pytest.raises(RuntimeError, match="asyncio"):
        b.wait_for_write_async()
    b.wait_for_write(timeout=5)


def test_read_only_memory_is_not_registered() -> None:
    # Peers write a registration, and so do this side's reads: a numpy
    # array over bytes was written through (the bytes object changed).
    frozen = bytes(64)
    with pytest.raises(ValueError, match="read-only"):
        rmacomm.RdmaMemory(np.frombuffer(frozen, np.uint8))
    assert frozen == bytes(64)


def test_a_cancelled_async_wait_loses_no_notification() -> None:
    a, b = rmacomm.RdmaTransport(timeout=10), rmacomm.RdmaTransport(timeout=10)
    ua, ub = a.bind(), b.bind()

    async def run() -> None:
        await asyncio.gather(a.connect_async(ub), b.connect_async(ua))
        ms = rmacomm.RdmaMemory(np.arange(16, dtype=np.int32))
        md = rmacomm.RdmaMemory(rmacomm.empty(16, np.int32))
        for _ in range(3):
            # Cancelled by wait_for's timeout, with nothing to take: it
            # must not stay first in the queue and take the next one.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(b.wait_for_write_async(), 0.05)
            await a.write_async(ms.to_view(0, 4), md.to_remote_buffer(), notify=True)
            await b.wait_for_write_async(timeout=2)
        # Cancelled after its notification arrived but before the loop
        # set its result (the loop is held meanwhile): the notification
        # goes to the next wait.
        w = b.wait_for_write_async()
        a.write(ms.to_view(0, 4), md.to_remote_buffer(), notify=True)
        time.sleep(0.3)
        assert not w.done()
        w.cancel()
        await b.wait_for_write_async(timeout=2)

    asyncio.run(run())
