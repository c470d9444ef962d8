"""Rank programs the tests run under the launcher:
``python -m rmacomm.run --nproc-per-node N tests/scenarios.py NAME [KIND]``.

Each scenario raises (exit code 1) when a check fails and prints ``ok``
lines the tests look for. KIND is ``numpy`` or ``torch``: which tensors
the scenario moves. Checks follow torchcomms' tests (inputs are
ones × (rank + 1), the ring puts full(count, rank) into the right
neighbour).
"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict

import numpy as np

import rmacomm
from rmacomm import ReduceOp

RANK = int(os.environ.get("RANK", "0"))


def log(*a: Any) -> None:
    print(*a, flush=True)


class Kind:
    """Tensor construction for numpy or torch, so one scenario checks both."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.torch = None
        if name == "torch":
            import torch

            self.torch = torch

    def dtype(self, name: str) -> Any:
        return getattr(self.torch, name) if self.torch is not None else np.dtype(name)

    def full(self, n: int, v: float, dtype: str) -> Any:
        if self.torch is not None:
            return self.torch.full((n,), v, dtype=self.dtype(dtype))
        return np.full(n, v, dtype=dtype)

    def zeros(self, n: int, dtype: str) -> Any:
        return self.full(n, 0, dtype)

    def arange(self, n: int, dtype: str) -> Any:
        if self.torch is not None:
            return self.torch.arange(n, dtype=self.dtype(dtype))
        return np.arange(n, dtype=dtype)

    def np(self, t: Any) -> np.ndarray:
        if self.torch is not None:
            assert isinstance(t, self.torch.Tensor), type(t)
            return t.float().numpy() if t.dtype == self.torch.bfloat16 else t.numpy()
        assert isinstance(t, np.ndarray), type(t)
        return t


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {RANK}: {what}")


def same(t: Any, want: Any, what: str, kind: Kind) -> None:
    got = kind.np(t)
    if not np.array_equal(got, np.asarray(want, dtype=got.dtype)):
        raise AssertionError(f"rank {RANK}: {what}: got {got[:8]}..., want {np.asarray(want).ravel()[:8]}...")


# --- windows ---------------------------------------------------------------

DTYPES = ["float32", "int32", "int8"]
COUNTS = [4, 1024]
ITERS = 3


def window_ring(arg: str) -> None:
    """torchcomms' window ring in both forms: counts 4 and 1024 × f32, i32,
    i8 × async put yes/no × async signal yes/no, 3 iterations with new values
    each; every rank puts full(count, value) into its right neighbour at
    offset rank × count, signals, waits for its left neighbour and checks
    map_remote_tensor(rank)[left × count:] (ctran: get_tensor).

    `arg` is the kind (numpy, torch), with ":separate" for windows whose
    same-host peers are reached through the transport (SEPARATE: puts are
    RDMA writes whose Work may still be pending; peers' memory is not
    mapped, so the check through the peer's view is a get)."""
    kind_name, _, path = arg.partition(":")
    unified = path != "separate"
    kind = Kind(kind_name)
    comm = rmacomm.new_comm("rdma", timeout=60)
    r, n = comm.get_rank(), comm.get_size()
    right, left = (r + 1) % n, (r - 1) % n
    access = rmacomm.WinAccessType.UNIFIED if unified else rmacomm.WinAccessType.SEPARATE
    for count in COUNTS:
        for dt in DTYPES:
            # torchcomms form.
            win = comm.new_window(unified=unified)
            buf = comm.empty(n * count, kind.dtype(dt))
            win.tensor_register(buf)
            expect(win.get_attr(peer_rank=right).access_type == access, f"the right neighbour is {access}")
            for async_put in (False, True):
                for async_signal in (False, True):
                    for it in range(ITERS):
                        v = r + 10 * it + 1
                        src = kind.full(count, v, dt)
                        pw = win.put(src, right, r * count, async_op=async_put)
                        sw = win.signal(peer_rank=right, async_op=async_signal)
                        win.wait_signal(left)
                        pw.wait()
                        sw.wait()
                        mine = win.map_remote_tensor(r)
                        expect(mine is buf, "map_remote_tensor(own rank) is the registered tensor")
                        same(mine[left * count:(left + 1) * count], [left + 10 * it + 1] * count,
                             f"torchcomms ring {dt} count {count} put async {async_put} signal async {async_signal}",
                             kind)
                        # The right neighbour's buffer, mapped here: what
                        # this rank put there.
                        if unified:
                            theirs = win.map_remote_tensor(right)
                            expect(tuple(theirs.shape) == (n * count,), f"peer view shape {tuple(theirs.shape)}")
                            same(theirs[r * count:(r + 1) * count], [v] * count, "peer view", kind)
                        comm.barrier()
            # get from the right neighbour (what this rank put there), into
            # unregistered memory and into shared memory.
            out = kind.zeros(count, dt)
            win.get(out, right, r * count)
            same(out, [r + 10 * (ITERS - 1) + 1] * count, f"get {dt}", kind)
            out2 = comm.empty(count, kind.dtype(dt))
            win.get(out2, right, r * count, async_op=True).wait()
            same(out2, [r + 10 * (ITERS - 1) + 1] * count, f"get into shared memory {dt}", kind)
            if not unified:
                try:
                    win.map_remote_tensor(right)
                    raise AssertionError("map_remote_tensor of a SEPARATE peer must fail")
                except rmacomm.UnavailableError as e:
                    expect("SEPARATE" in str(e), str(e))
            comm.barrier()
            # An async put whose Work is never waited for, one dropped at
            # once: tensor_deregister finishes both first.
            kept = win.put(kind.full(count, -1, dt), right, r * count, async_op=True)
            win.put(kind.full(count, -1, dt), right, r * count, async_op=True)
            comm.barrier()
            win.tensor_deregister()
            expect(kept.is_completed(), "a Work pending at tensor_deregister is complete after it")
            kept.wait()

            # ctran form.
            esize = np.dtype(dt).itemsize
            cw = comm.window_allocate(n * count * esize, signal_size=4, unified=unified)
            expect(cw.get_size() == n * count * esize, "ctran get_size")
            for async_put in (False, True):
                for async_signal in (False, True):
                    for it in range(ITERS):
                        v = r + 10 * it + 1
                        pw = cw.put(kind.full(count, v, dt), right, r * count * esize, async_op=async_put)
                        op = rmacomm.SignalOp.ADD if async_signal else rmacomm.SignalOp.SET
                        want = (it + 1) if op == rmacomm.SignalOp.ADD else 100 + it
                        sw = cw.signal(1, 1 if op == rmacomm.SignalOp.ADD else want, right, async_op=async_signal, op=op)
                        cw.wait_signal(1, want, rmacomm.SignalCmpOp.GE)
                        pw.wait()
                        sw.wait()
                        mine = cw.get_tensor(r, n * count, kind.dtype(dt))
                        same(mine[left * count:(left + 1) * count], [left + 10 * it + 1] * count,
                             f"ctran ring {dt} count {count} put async {async_put} signal async {async_signal}", kind)
                        if unified:
                            theirs = cw.get_tensor(right, count, kind.dtype(dt), offset=r * count)
                        else:
                            theirs = kind.zeros(count, dt)
                            cw.get(theirs, right, r * count * esize)
                        same(theirs, [v] * count, "ctran peer view", kind)
                        comm.barrier()
                    cw.reset_signal(1)
                    comm.barrier()
            del cw
    comm.finalize()
    log(f"window_ring {arg} ok")



# --- collectives -----------------------------------------------------------

def collectives(kind_name: str) -> None:
    """Collectives with torchcomms' conventions (input = ones × (rank + 1))."""
    kind = Kind(kind_name)
    comm = rmacomm.new_comm("rdma", timeout=60)
    r, n = comm.get_rank(), comm.get_size()
    tri = n * (n + 1) // 2
    for dt in ("float32", "int32", "int8"):
        for count in (4, 1024):
            x = kind.full(count, r + 1, dt)
            comm.all_reduce(x, ReduceOp.SUM)
            same(x, [tri] * count, f"all_reduce SUM {dt} {count}", kind)
            x = kind.full(count, r + 1, dt)
            comm.all_reduce(x, ReduceOp.MAX)
            same(x, [n] * count, f"all_reduce MAX {dt}", kind)
            x = kind.full(count, r + 1, dt)
            comm.all_reduce(x, ReduceOp.AVG)
            avg = (n + 1) / 2 if dt == "float32" else (n + 1) // 2
            same(x, [avg] * count, f"all_reduce AVG {dt}", kind)
    x = kind.full(300000, r + 1, "float32")
    w = comm.all_reduce(x, ReduceOp.PREMUL_SUM(2.0), async_op=True)
    w.wait()
    expect(w.is_completed(), "async all_reduce completed")
    same(x, [2 * tri] * 300000, "all_reduce PREMUL_SUM(2) async, 1.2 MB", kind)
    for algo in ("ring", "direct", "oneshot"):
        c2 = comm.split(list(range(n)), hints={"rmacomm::algo": algo})
        expect(c2 is not None, "split of every rank")
        x = kind.full(1000, r + 1, "float32")
        c2.all_reduce(x, ReduceOp.SUM)
        same(x, [tri] * 1000, f"all_reduce SUM on a split with algo {algo}", kind)
    # A split's own name, timeout and hints (they were ignored: the
    # parent's timeout, a bogus hint accepted).
    c3 = comm.split(list(range(n)), name="sub", timeout=timedelta(seconds=7))
    expect(c3.get_name() == "sub" and c3.get_timeout() == timedelta(seconds=7), "split's name and timeout")
    expect(comm.split(list(range(n))).get_name() == comm.get_name() + "/split", "a split's default name")
    try:
        comm.split(list(range(n)), hints={"rmacomm::algo": "bogus"})
    except ValueError as e:
        expect("rmacomm::algo" in str(e), f"bogus hint: {e}")
    else:
        raise AssertionError(f"rank {RANK}: a split with a bogus algorithm hint must fail")
    if kind.torch is not None:
        x = kind.full(64, r + 1, "bfloat16")
        comm.all_reduce(x, ReduceOp.SUM)
        same(x, [tri] * 64, "all_reduce SUM bfloat16", kind)

    # all_gather: list, single, single in place (input is a slice of the output).
    outs = [kind.zeros(5, "int32") for _ in range(n)]
    comm.all_gather(outs, kind.full(5, r + 1, "int32"))
    for i, o in enumerate(outs):
        same(o, [i + 1] * 5, f"all_gather slot {i}", kind)
    out = kind.zeros(n * 5, "int32")
    comm.all_gather_single(out, kind.full(5, r + 1, "int32"))
    same(out, np.repeat(np.arange(1, n + 1), 5), "all_gather_single", kind)
    out = kind.zeros(n * 5, "int32")
    out[r * 5:(r + 1) * 5] = r + 1
    comm.all_gather_single(out, out[r * 5:(r + 1) * 5])
    same(out, np.repeat(np.arange(1, n + 1), 5), "all_gather_single in place", kind)
    # uneven: all_gather_v, rank i contributes i + 1 elements.
    outs = [kind.zeros(i + 1, "float32") for i in range(n)]
    comm.all_gather_v(outs, kind.full(r + 1, r + 1, "float32"))
    for i, o in enumerate(outs):
        same(o, [i + 1] * (i + 1), f"all_gather_v slot {i}", kind)

    # reduce_scatter: list and single.
    o = kind.zeros(6, "float32")
    comm.reduce_scatter(o, [kind.full(6, r + 1, "float32") for _ in range(n)], ReduceOp.SUM)
    same(o, [tri] * 6, "reduce_scatter", kind)
    o = kind.zeros(6, "float32")
    comm.reduce_scatter_single(o, kind.full(6 * n, r + 1, "float32"), ReduceOp.SUM, async_op=True).wait()
    same(o, [tri] * 6, "reduce_scatter_single", kind)

    # broadcast from the first and the last rank.
    for root in (0, n - 1):
        b = kind.full(7, 99 if r == root else 0, "int64")
        comm.broadcast(b, root)
        same(b, [99] * 7, f"broadcast from {root}", kind)

    # all_to_all_single: block j of rank r's input = 100 r + j.
    inp = kind.zeros(3 * n, "int32")
    for j in range(n):
        inp[j * 3:(j + 1) * 3] = 100 * r + j
    out = kind.zeros(3 * n, "int32")
    comm.all_to_all_single(out, inp)
    same(out, np.repeat([100 * i + r for i in range(n)], 3), "all_to_all_single", kind)
    # Blocks are whole rows, as torch splits: 3 elements over 2 ranks cut
    # one in two, 3 rows of 2 split a row (both moved silently before).
    if n == 2:
        for shape in ((3,), (3, 2)):
            bad = kind.zeros(6, "float32")[: shape[0] * (shape[1] if len(shape) > 1 else 1)].reshape(shape)
            try:
                comm.all_to_all_single(bad.copy() if kind.torch is None else bad.clone(), bad)
            except ValueError as e:
                expect("equal parts of whole rows" in str(e), f"all_to_all_single {shape}: {e}")
            else:
                raise AssertionError(f"rank {RANK}: all_to_all_single of shape {shape} over 2 ranks must fail")
    # v: rank r sends r + j + 1 elements to j.
    ins = [r + j + 1 for j in range(n)]
    outs_n = [i + r + 1 for i in range(n)]
    inp = kind.zeros(sum(ins), "float32")
    at = 0
    for j in range(n):
        inp[at:at + ins[j]] = 10 * r + j
        at += ins[j]
    out = kind.zeros(sum(outs_n), "float32")
    comm.all_to_all_v_single(out, inp, outs_n, ins)
    want = np.concatenate([np.full(outs_n[i], 10 * i + r) for i in range(n)])
    same(out, want, "all_to_all_v_single", kind)
    outs = [kind.zeros(2, "int8") for _ in range(n)]
    comm.all_to_all(outs, [kind.full(2, 10 * r + j, "int8") for j in range(n)])
    for i, o in enumerate(outs):
        same(o, [10 * i + r] * 2, f"all_to_all slot {i}", kind)

    # reduce, gather, scatter to / from the last rank.
    root = n - 1
    x = kind.full(4, r + 1, "float64")
    comm.reduce(x, root, ReduceOp.SUM)
    if r == root:
        same(x, [tri] * 4, "reduce at the root", kind)
    outs = [kind.zeros(3, "int32") for _ in range(n)] if r == root else None
    comm.gather(outs, kind.full(3, r + 1, "int32"), root)
    if outs is not None:
        for i, o in enumerate(outs):
            same(o, [i + 1] * 3, f"gather slot {i}", kind)
    o = kind.zeros(3, "int32")
    comm.scatter(o, [kind.full(3, j + 1, "int32") for j in range(n)] if r == root else None, root)
    same(o, [r + 1] * 3, "scatter", kind)

    # send / recv in a ring: even ranks send first.
    right, left = (r + 1) % n, (r - 1) % n
    got = kind.zeros(8, "float32")
    if r % 2 == 0:
        comm.send(kind.full(8, r, "float32"), right)
        comm.recv(got, left)
    else:
        comm.recv(got, left)
        comm.send(kind.full(8, r, "float32"), right)
    same(got, [left] * 8, "send/recv ring", kind)
    # the same as one batch, both directions.
    a, b = kind.zeros(8, "float32"), kind.zeros(8, "float32")
    batch = comm.batch_op_create()
    batch.send(kind.full(8, r, "float32"), right)
    batch.send(kind.full(8, -r, "float32"), left)
    batch.recv(a, left)
    batch.recv(b, right)
    batch.issue()
    same(a, [left] * 8, "batch from the left", kind)
    same(b, [-right] * 8, "batch from the right", kind)

    # async ones in flight together, then a sync one after them.
    xs = [kind.full(16, r + 1, "float32") for _ in range(4)]
    works = [comm.all_reduce(x, ReduceOp.SUM, async_op=True) for x in xs]
    comm.barrier()
    for w, x in zip(works, xs):
        w.wait()
        same(x, [tri] * 16, "async all_reduce", kind)

    # split: the even ranks.
    evens = list(range(0, n, 2))
    sub = comm.split(evens)
    expect((sub is not None) == (r in evens), "split membership")
    if sub is not None:
        x = kind.full(4, 1, "int32")
        sub.all_reduce(x, ReduceOp.SUM)
        same(x, [len(evens)] * 4, "split all_reduce", kind)
        expect(sub.get_rank() == evens.index(r) and sub.get_size() == len(evens), "split rank and size")
    comm.finalize()
    try:
        comm.barrier()
        raise AssertionError("an operation after finalize must fail")
    except rmacomm.CommError as e:
        expect("finalize" in str(e), f"after finalize: {e}")
    log(f"collectives {kind_name} ok")


# --- the GIL ---------------------------------------------------------------

def gil(_: str) -> None:
    """A Python thread keeps running while this rank blocks in wait_signal,
    in a collective and in Work.wait."""
    comm = rmacomm.new_comm("rdma", timeout=60)
    r = comm.get_rank()
    win = comm.new_window()
    win.tensor_register(comm.empty(16, np.float32))
    comm.barrier()
    counter = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            counter[0] += 1

    for what in ("wait_signal", "all_reduce", "Work.wait"):
        if r == 0:
            t = threading.Thread(target=spin)
            t.start()
            time.sleep(0.05)
            before = counter[0]
            t0 = time.monotonic()
            if what == "wait_signal":
                win.wait_signal(1)
            elif what == "all_reduce":
                comm.all_reduce(np.ones(4, np.float32), ReduceOp.SUM)
            else:
                win.wait_signal(1, async_op=True).wait()
            waited = time.monotonic() - t0
            ran = counter[0] - before
            stop.set()
            t.join()
            stop.clear()
            log(f"gil {what}: waited {waited:.2f} s, the other thread counted {ran}")
            expect(waited > 0.5, f"{what} waited for the peer ({waited:.2f} s)")
            expect(ran > 10000, f"the thread ran during the blocking {what} ({ran} increments)")
        else:
            time.sleep(1.0)
            if what == "all_reduce":
                comm.all_reduce(np.ones(4, np.float32), ReduceOp.SUM)
            else:
                win.signal(0)
        comm.barrier()
    comm.barrier()
    win.tensor_deregister()
    log("gil ok")



def _stop(pid: int) -> None:
    """SIGSTOPs `pid` and returns once every thread of it has stopped: with
    the soft provider's TCP link (RMACOMM_SOFT_LINK=tcp) its responder then
    places nothing and acknowledges nothing, so no operation to it can
    complete until SIGCONT, however long the caller takes."""
    import signal

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while True:
        states = []
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass
        if all(s in "tT" for s in states):
            return
        expect(time.monotonic() < deadline, f"rank with pid {pid} stopped within 10 s ({states})")
        time.sleep(0.001)


def _cont_later(pid: int, secs: float) -> Any:
    """SIGCONT to `pid` after `secs`, from another process: it comes even
    while this one holds the GIL."""
    import subprocess

    return subprocess.Popen(["sh", "-c", f"sleep {secs}; kill -CONT {pid}"])


def gil_put(case: str) -> None:
    """A Python thread keeps running while rank 0 is in an async put that
    waits in the call. `case` "plain": from plain numpy memory (no
    registration: staged through the window's bounce buffer, complete when
    it returns) to a SEPARATE peer, stopped for 0.7 s meanwhile (run with
    RMACOMM_SOFT_LINK=tcp: nothing to it completes). "mapped": from shared
    memory to a same-host peer whose tensor is SEPARATE (an ordinary numpy
    array) while its signals are mapped: the window completes such a put
    before it returns, so that a later signal follows it; 512 MiB, so that
    it takes a while. The thread must count at least a quarter of its own
    rate over the call: with the GIL held, it gets one switch interval."""
    comm = rmacomm.new_comm("rdma", timeout=30)
    r = comm.get_rank()
    pids = _exchange(comm, os.getpid())
    if case == "plain":
        n = 4 << 20
        win = comm.new_window(unified=False)
        win.tensor_register(comm.empty(n, np.uint8))
        src = np.full(n, 7, np.uint8)
    else:
        n = 512 << 20
        win = comm.new_window()
        win.tensor_register(np.zeros(n, np.uint8))
        src = comm.empty(n, np.uint8)
        src[:] = 7
    comm.barrier()
    if r == 0:
        counter = [0]
        stop = threading.Event()

        def spin() -> None:
            while not stop.is_set():
                counter[0] += 1

        t = threading.Thread(target=spin)
        t.start()
        time.sleep(0.05)
        c0, t0 = counter[0], time.monotonic()
        time.sleep(0.2)
        rate = (counter[0] - c0) / (time.monotonic() - t0)
        resume = None
        if case == "plain":
            _stop(pids[1])
            resume = _cont_later(pids[1], 0.7)
        before, t0 = counter[0], time.monotonic()
        w = win.put(src, 1, 0, async_op=True)
        waited = time.monotonic() - t0
        ran = counter[0] - before
        stop.set()
        t.join()
        w.wait()
        if resume is not None:
            resume.wait()
        log(f"gil put ({case}): in the call {waited:.3f} s, the other thread counted {ran} (alone {rate:.0f}/s)")
        expect(waited > 0.02, f"the put ({case}) waited in the call ({waited:.3f} s)")
        expect(ran > 0.25 * rate * waited, f"the thread ran during the put ({case}): {ran} increments")
        win.signal(1)
    else:
        win.wait_signal(0)
        got = win.get_tensor()
        expect(bool((got == 7).all()), f"the put's data arrived ({case})")
    comm.barrier()
    win.tensor_deregister()
    comm.finalize()
    log(f"gil_put {case} ok")


def op_timeout(_: str) -> None:
    """A synchronous put, get or signal with `timeout=` raises
    rmacomm.TimeoutError naming the operation and the peer when it is not
    complete in time (rank 1 stopped, TCP link: it cannot be), and the
    operation goes on: its data lands once the peer runs again."""
    from datetime import timedelta

    comm = rmacomm.new_comm("rdma", timeout=10)
    r = comm.get_rank()
    pids = _exchange(comm, os.getpid())
    n = 1 << 20
    win = comm.new_window(unified=False)
    win.tensor_register(comm.empty(4 * n, np.uint8))
    cw = comm.window_allocate(2 * n, signal_size=2, unified=False)
    comm.barrier()
    tiny = timedelta(microseconds=1)
    if r == 0:
        shared = comm.empty(n, np.uint8)
        shared[:] = 2
        cases = [
            ("put", lambda: win.put(np.full(n, 1, np.uint8), 1, 0, timeout=tiny)),
            ("put", lambda: win.put(shared, 1, n, timeout=0.05)),
            ("get", lambda: win.get(np.zeros(n, np.uint8), 1, 2 * n, timeout=tiny)),
            ("signal", lambda: win.signal(1, timeout=tiny)),
            ("put", lambda: cw.put(np.full(n, 3, np.uint8), 1, 0, timeout=tiny)),
            ("get", lambda: cw.get(np.zeros(n, np.uint8), 1, n, timeout=tiny)),
            ("signal", lambda: cw.signal(0, 1, 1, timeout=tiny)),
        ]
        _stop(pids[1])
        try:
            for op, call in cases:
                t0 = time.monotonic()
                try:
                    call()
                    raise AssertionError(f"{op} to a stopped peer returned (timeout=)")
                except rmacomm.TimeoutError as e:
                    took = time.monotonic() - t0
                    log(f"{op}: TimeoutError after {took:.2f} s: {e}")
                    expect(str(e).startswith(f"{op} with rank 1:"), f"the error names {op} and the peer: {e}")
                    expect(took < 5, f"{op} raised within its timeout, not the window's ({took:.2f} s)")
        finally:
            import signal

            os.kill(pids[1], signal.SIGCONT)
        # The timed-out operations went on: the signals arrive after the
        # puts, the puts' data with them.
        win.signal(1)
        cw.signal(1, 1, 1)
    else:
        win.wait_signal(0)
        win.wait_signal(0)
        mine = win.get_tensor()
        expect(bool((mine[:n] == 1).all()) and bool((mine[n:2 * n] == 2).all()), "the timed-out puts landed")
        cw.wait_signal(0, 1)
        cw.wait_signal(1, 1)
        expect(bool((cw.get_tensor(1, n) == 3).all()), "the timed-out ctran put landed")
    comm.barrier()
    win.tensor_deregister()
    comm.finalize()
    log("op_timeout ok")


def op_interrupt(_: str) -> None:
    """Ctrl-C interrupts a synchronous put, get or signal (no timeout of its
    own) to a SEPARATE peer that cannot complete it (rank 1 stopped, TCP
    link): it waited inside one call until the window's timeout (60 s
    here). The interrupted operations go on and end once the peer runs."""
    import signal
    import threading

    comm = rmacomm.new_comm("rdma", timeout=60)
    r = comm.get_rank()
    pids = _exchange(comm, os.getpid())
    n = 1 << 20
    win = comm.new_window(unified=False)
    win.tensor_register(comm.empty(4 * n, np.uint8))
    cw = comm.window_allocate(2 * n, signal_size=2, unified=False)
    comm.barrier()
    if r == 0:
        shared = comm.empty(n, np.uint8)
        shared[:] = 5
        cases = [
            ("put", lambda: win.put(shared, 1, 0)),
            ("get", lambda: win.get(np.zeros(n, np.uint8), 1, 2 * n)),
            ("signal", lambda: win.signal(1)),
            ("put", lambda: cw.put(shared, 1, 0)),
            ("get", lambda: cw.get(np.zeros(n, np.uint8), 1, n)),
            ("signal", lambda: cw.signal(0, 1, 1)),
        ]
        _stop(pids[1])
        try:
            for op, call in cases:
                threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
                t0 = time.monotonic()
                try:
                    call()
                    raise AssertionError(f"{op} to a stopped peer returned")
                except KeyboardInterrupt:
                    took = time.monotonic() - t0
                    log(f"{op}: interrupted after {took:.2f} s")
                    expect(took < 5, f"{op} was interrupted within a slice, not the window's timeout ({took:.2f} s)")
            # Silent for longer than verbs' usual ACK timeout (2.1 s).
            time.sleep(2.5)
        finally:
            os.kill(pids[1], signal.SIGCONT)
        # The peer was silent for seconds, not dead: the connection holds
        # (it broke after 2.1 s of silence, verbs' usual ACK timeout), the
        # interrupted operations end, and a signal behind them follows.
        win.signal(1)
    else:
        win.wait_signal(0)
        win.wait_signal(0)
        expect(bool((win.get_tensor()[:n] == 5).all()), "the interrupted put landed")
    comm.barrier()
    win.tensor_deregister()
    comm.finalize()
    log("op_interrupt ok")


def queued_signal_timeout(_: str) -> None:
    """Value signals to one peer run one after another; a signal queued
    behind others to a stopped peer fails within its own timeout from the
    call (the waits for the ones before it added up: 3 queued made the
    next one take ~4 timeouts), and the values sent later still land in
    call order once the peer runs again."""
    comm = rmacomm.new_comm("rdma", timeout=2)
    r = comm.get_rank()
    pids = _exchange(comm, os.getpid())
    cw = comm.window_allocate(64, signal_size=1, unified=False)
    comm.barrier()
    if r == 0:
        _stop(pids[1])
        try:
            works = [cw.signal(0, v, 1, async_op=True) for v in (1, 2, 3)]
            t0 = time.monotonic()
            try:
                cw.signal(0, 4, 1)
                raise AssertionError("a signal to a stopped peer returned")
            except rmacomm.TimeoutError as e:
                took = time.monotonic() - t0
                log(f"queued signal: TimeoutError after {took:.2f} s: {e}")
                expect(took < 3.5, f"the queued signal took {took:.2f} s, past its 2 s timeout")
            for w in works:
                try:
                    w.wait()
                except rmacomm.TimeoutError:
                    pass
        finally:
            import signal

            os.kill(pids[1], signal.SIGCONT)
        cw.signal(0, 5, 1)
    else:
        # Stopped meanwhile: a wait longer than the window's timeout.
        cw.wait_signal(0, 5, timeout=30)
        expect(cw.read_signal(0) == 5, f"the last value landed last (slot holds {cw.read_signal(0)})")
    comm.barrier()
    comm.finalize()
    log("queued_signal_timeout ok")


def window_allocate_sizes(_: str) -> None:
    """A rank whose window_allocate cannot have its buffer raises the
    reason, and its peer a PeerError naming it at once (it waited for that
    rank until the timeout); a window_size of 0 registers no bytes (peers'
    puts of one byte into it are refused; it used to register one); a
    tensor_register refused on one rank fails its peer at once too."""
    comm = rmacomm.new_comm("rdma", timeout=60)
    r = comm.get_rank()
    t0 = time.monotonic()
    try:
        comm.window_allocate(1 << 62 if r == 0 else 64, signal_size=1)
        raise AssertionError("a window whose buffer cannot be allocated was made")
    except rmacomm.CommError as e:
        took = time.monotonic() - t0
        log(f"window_allocate of 2^62 bytes on rank 0: {type(e).__name__} after {took:.2f} s: {e}")
        expect(took < 30, f"rank {r} waited {took:.1f} s for the failed rank")
        if r == 1:
            expect(isinstance(e, rmacomm.PeerError) and "rank 0" in str(e), f"rank 1 heard: {e!r}")
    for unified in (True, False):
        cw = comm.window_allocate(0 if r == 0 else 64, signal_size=1, unified=unified)
        expect(cw.get_size() == (0 if r == 0 else 64), f"get_size {cw.get_size()}")
        if r == 1:
            one = np.ones(1, dtype=np.uint8)
            for call in (lambda: cw.put(one, 0, 0), lambda: cw.get(one, 0, 0)):
                try:
                    call()
                    raise AssertionError("a byte moved to or from a window of 0 bytes")
                except rmacomm.ArgumentError as e:
                    expect("rank 0" in str(e), f"the error names the peer: {e}")
        else:
            cw.put(np.full(64, 7, dtype=np.uint8), 1, 0)
        comm.barrier()
        if r == 1:
            expect(bool((cw.get_tensor(1, [64]) == 7).all()) if unified else True, "rank 0's put landed")
        comm.barrier()
        del cw
    # A rank whose tensor_register is refused before the exchange (read-only
    # memory, an empty tensor) still takes its part: its peer hears why.
    win = comm.new_window()
    for bad in (np.frombuffer(b"\0" * 64, dtype=np.uint8), np.zeros(0, dtype=np.uint8)):
        t0 = time.monotonic()
        try:
            win.tensor_register(bad if r == 0 else np.zeros(64, dtype=np.uint8))
            raise AssertionError("a refused registration was made")
        except (rmacomm.CommError, ValueError) as e:
            took = time.monotonic() - t0
            log(f"tensor_register of {bad.size} read-only={not bad.flags.writeable} bytes on rank 0: "
                f"{type(e).__name__} after {took:.2f} s: {e}")
            expect(took < 30, f"rank {r} waited {took:.1f} s for the refused rank")
            if r == 1:
                expect(isinstance(e, rmacomm.PeerError) and "rank 0" in str(e), f"rank 1 heard: {e!r}")
            else:
                expect(isinstance(e, ValueError), f"rank 0 raised {e!r}")
    mine = np.zeros(8, dtype=np.int32)
    win.tensor_register(mine)
    win.put(np.full(8, r + 1, dtype=np.int32), 1 - r, 0)
    win.signal(1 - r)
    win.wait_signal(1 - r)
    expect(bool((mine == 2 - r).all()), f"the peer's put after the refusals landed: {mine}")
    win.tensor_deregister()
    # A 0-d array's descriptor says shape () (numpy exports no shape for
    # it: peers saw (1,)).
    win.tensor_register(comm.empty((), np.float64))
    peer_view = win.map_remote_tensor(1 - r)
    expect(peer_view.shape == (), f"the peer's 0-d array maps as shape {peer_view.shape}")
    del peer_view
    win.tensor_deregister()
    comm.finalize()
    log("window_allocate_sizes ok")


def split_after_async(_: str) -> None:
    """split() right after an async collective, the ranks at different
    moments: it waits for the async one first, as every rank runs them in
    issue order (it took the communicator while this rank's worker waited
    in the barrier for the other: both waited until the timeout)."""
    comm = rmacomm.new_comm("rdma", timeout=5)
    r = comm.get_rank()
    for _ in range(3):
        if r == 1:
            time.sleep(0.2)
        w = comm.barrier(async_op=True)
        if r == 1:
            time.sleep(0.1)
        t0 = time.monotonic()
        sub = comm.split([0, 1])
        w.wait()
        took = time.monotonic() - t0
        expect(sub is not None and took < 4, f"split after an async barrier took {took:.1f} s")
        sub.barrier()
        sub.finalize()
    comm.finalize()
    log("split_after_async ok")


# --- transport -------------------------------------------------------------

def _exchange(comm: rmacomm.Comm, obj: Any) -> list:
    """All-gather of picklable objects: their lengths, then the bytes
    (all_gather_v, uneven)."""
    blob = np.frombuffer(pickle.dumps(obj), np.uint8)
    n = comm.get_size()
    lens = np.zeros(n, np.int64)
    comm.all_gather_single(lens, np.array([blob.size], np.int64))
    outs = [np.zeros(int(k), np.uint8) for k in lens]
    comm.all_gather_v(outs, blob)
    return [pickle.loads(o.tobytes()) for o in outs]


def transport(_: str) -> None:
    """Two ranks connect RdmaTransports through URLs and pickled remote
    buffers exchanged by a collective; write with notify, read, and the
    asyncio forms."""
    comm = rmacomm.new_comm("rdma", timeout=60)
    r = comm.get_rank()
    peer = 1 - r
    t = rmacomm.RdmaTransport(timeout=30)
    private = np.zeros(4096, np.uint8)              # ordinary memory
    shared = comm.empty(4096, np.uint8)             # a shared segment
    mp, ms = rmacomm.RdmaMemory(private), rmacomm.RdmaMemory(shared)
    mine = {"url": t.bind(), "private": mp.to_remote_buffer(), "shared": ms.to_remote_buffer()}
    theirs = _exchange(comm, mine)[peer]
    expect(isinstance(theirs["private"], rmacomm.RdmaRemoteBuffer), "unpickled a remote buffer")
    expect(rmacomm.RdmaRemoteBuffer.parse(str(theirs["shared"])) == theirs["shared"], "str/parse round trip")
    t.connect(theirs["url"])
    src = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096].copy()
    ms_src = rmacomm.RdmaMemory(src)
    if r == 0:
        t.write(ms_src.to_view(0, 1024), theirs["private"], notify=True)
        t.write(ms_src.to_view(1024, 1024), theirs["shared"].slice(1024, 1024), notify=True)
    else:
        t.wait_for_write()
        t.wait_for_write()
        expect(np.array_equal(private[:1024], src[:1024]), "write into private memory")
        expect(np.array_equal(shared[1024:2048], src[1024:2048]), "write into shared memory")
        got = np.zeros(512, np.uint8)
        t.read(rmacomm.RdmaMemory(got).to_view(), theirs["private"].slice(0, 512))
        expect(not got.any(), "read rank 0's (untouched) memory")
    comm.barrier()

    async def both() -> None:
        if r == 1:
            await t.write_async(ms_src.to_view(0, 2048), theirs["shared"], notify=True)
        else:
            await t.wait_for_write_async(timeout=30)
            expect(np.array_equal(shared[:2048], src[:2048]), "write_async")
            back = np.zeros(2048, np.uint8)
            await t.read_async(rmacomm.RdmaMemory(back).to_view(), theirs["shared"].slice(0, 2048))
            # Rank 1's shared memory: untouched, then what rank 0 wrote.
            expect(not back[:1024].any(), "read_async of rank 1's shared memory (zeroed part)")
            expect(np.array_equal(back[1024:], src[1024:2048]), "read_async of what rank 0 wrote there")

    asyncio.run(both())
    comm.barrier()
    if r == 0:
        try:
            t.wait_for_write(timeout=0.2)
            raise AssertionError("wait_for_write without a write must time out")
        except rmacomm.TimeoutError as e:
            expect(isinstance(e, TimeoutError), "rmacomm.TimeoutError is a TimeoutError")
    comm.barrier()
    log("transport ok")


# --- stores ----------------------------------------------------------------

class FileStore:
    """A plain Python store: one file per key in a shared directory."""

    def __init__(self, path: str, minimal: bool) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)
        if not minimal:
            self.add = self._add
            self.check = self._check
            self.delete_key = self._delete_key

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key.replace("/", "%2F"))

    def set(self, key: str, value: bytes) -> None:
        tmp = self._file(key) + f".tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(bytes(value))
        os.replace(tmp, self._file(key))

    def get(self, key: str) -> bytes:
        self.wait([key], None)
        with open(self._file(key), "rb") as f:
            return f.read()

    def wait(self, keys: list, timeout: Any) -> None:
        secs = 60.0 if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + secs
        while not all(os.path.exists(self._file(k)) for k in keys):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timeout waiting for {keys}")
            time.sleep(0.001)

    def _check(self, keys: list) -> bool:
        return all(os.path.exists(self._file(k)) for k in keys)

    def _add(self, key: str, amount: int) -> int:
        import fcntl

        with open(os.path.join(self.path, ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            v = int(self.get(key)) if os.path.exists(self._file(key)) else 0
            self.set(key, str(v + amount).encode())
            return v + amount

    def _delete_key(self, key: str) -> bool:
        try:
            os.remove(self._file(key))
            return True
        except FileNotFoundError:
            return False


class LyingStore(FileStore):
    """Rank 1's descriptor of its registration claims a shape whose byte
    count overflows 64 bits (2**62 + 1 rows of 4 float32: it wraps to 16
    bytes), as a broken or hostile peer could send."""

    def set(self, key: str, value: bytes) -> None:
        # The descriptor of `comm.empty(16, np.float32)` (dtype, shape,
        # memory kind), sent by tensor_register (at the end of the group's
        # record of the exchange, after what the rank called).
        tail = b"float32\n16\ncpu"
        if RANK == 1 and bytes(value).endswith(tail):
            value = bytes(value)[: -len(tail)] + b"float32\n4611686018427387905,4\ncpu"
        super().set(key, value)


def peer_shape(_: str) -> None:
    """A peer's registration descriptor whose size overflows is refused at
    tensor_register, naming the peer, on every rank."""
    store = LyingStore(os.environ["RMACOMM_TEST_STORE_DIR"], minimal=False)
    comm = rmacomm.new_comm("rdma", store=store, timeout=60)
    win = comm.new_window()
    try:
        win.tensor_register(comm.empty(16, np.float32))
        # Unfixed: registered; the peer's view is then made from the
        # wrapped size.
        win.map_remote_tensor(1 - comm.get_rank())
        raise AssertionError("a peer's shape whose size overflows was accepted")
    except ValueError as e:
        log(f"tensor_register: {type(e).__name__}: {e}")
        expect("rank 1" in str(e) and "tensor_register" in str(e), f"the error names the peer: {e}")
    comm.barrier()
    comm.finalize()
    log("peer_shape ok")


def _use_store(comm: rmacomm.Comm, what: str) -> None:
    r, n = comm.get_rank(), comm.get_size()
    x = np.full(32, r + 1, np.float32)
    comm.all_reduce(x, ReduceOp.SUM)
    expect((x == n * (n + 1) / 2).all(), f"all_reduce over a {what}")
    win = comm.new_window()
    win.tensor_register(comm.empty(n, np.int64))
    win.put(np.array([r], np.int64), (r + 1) % n, r)
    win.signal((r + 1) % n)
    win.wait_signal((r - 1) % n)
    expect(win.map_remote_tensor(r)[(r - 1) % n] == (r - 1) % n, f"window over a {what}")
    win.tensor_deregister()
    comm.finalize()


def python_store(variant: str) -> None:
    """A plain Python object as the store: with add/check/delete_key
    ("full") or with only set/get/wait ("minimal", add emulated)."""
    path = os.environ["RMACOMM_TEST_STORE_DIR"]
    store = FileStore(os.path.join(path, variant), minimal=variant == "minimal")
    comm = rmacomm.new_comm("rdma", store=store, timeout=60)
    _use_store(comm, f"{variant} Python store")
    log(f"python_store {variant} ok")


def tcp_store(variant: str) -> None:
    """rmacomm.TcpStore, or torch.distributed.TCPStore, as the store (on
    MASTER_PORT, which nothing else uses in this scenario)."""
    from datetime import timedelta

    r, n = RANK, int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if variant == "torch":
        import torch.distributed as dist

        store: Any = dist.TCPStore(addr, port, n, r == 0, timeout=timedelta(seconds=60))
    else:
        store = rmacomm.TcpStore(addr, port, n, r == 0, timeout=60)
    comm = rmacomm.new_comm("rdma", store=store, timeout=60)
    _use_store(comm, f"{variant} TCP store")
    log(f"tcp_store {variant} ok")


# --- failures --------------------------------------------------------------

def rank_dies(how: str) -> None:
    """Rank 1 goes away after the setup: "kill" (SIGKILL itself), "exit"
    (exits at once, no cleanup, code 0 so that a launcher lets the others
    go on) or "hang" (stays alive, takes no part). The others' window wait
    and collective raise within the communicator's timeout: PeerError for a
    dead peer, TimeoutError for a silent one."""
    import signal

    timeout = 3.0
    comm = rmacomm.new_comm("rdma", timeout=timeout)
    r = comm.get_rank()
    win = comm.new_window()
    win.tensor_register(comm.empty(4, np.float32))
    comm.barrier()
    if r == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":
            time.sleep(2 * timeout + 3)
        os._exit(0)
    time.sleep(0.5)
    want = rmacomm.TimeoutError if how == "hang" else rmacomm.PeerError
    for what in ("wait_signal", "all_reduce"):
        t0 = time.monotonic()
        try:
            if what == "wait_signal":
                win.wait_signal(1)
            else:
                comm.all_reduce(np.ones(1024, np.float32), ReduceOp.SUM)
            raise AssertionError(f"{what} with a rank gone must fail")
        except rmacomm.CommError as e:
            took = time.monotonic() - t0
            log(f"{what}: {type(e).__name__} after {took:.2f} s: {e}")
            expect(took < timeout + 2, f"{what} failed within the timeout ({took:.2f} s)")
            expect(isinstance(e, want), f"{what}: {want.__name__} expected")
    log(f"rank_dies {how} ok")
    os._exit(0)


def nccl_init(how: str) -> None:
    """new_comm("nccl") on the NCCL and CUDA stand-ins (the test sets
    RMACOMM_CUDA_LIB and RMACOMM_NCCL_LIB), timeout 4 s. "ok": both ranks
    join. "exit": rank 1 dies as it enters NCCL's init (the stand-in's
    RMACOMM_STANDIN_NCCL_EXIT_AT_INIT=1), after the unique id's exchange:
    rank 0 raises TimeoutError naming rank 1 within the timeout plus the
    report's grace, instead of waiting in NCCL forever. "fail": rank 1's
    init fails after joining (RMACOMM_STANDIN_NCCL_FAIL_INIT=1): rank 0's
    succeeded, yet both raise UnavailableError naming rank 1 at once.
    "drop": NCCL's finalize never completes; dropping the communicator
    takes its timeout with the GIL released."""
    timeout = 4.0
    t0 = time.monotonic()
    try:
        comm = rmacomm.new_comm("nccl", device="cuda:0", timeout=timeout)
    except rmacomm.CommError as e:
        took = time.monotonic() - t0
        log(f"new_comm: {type(e).__name__} after {took:.2f} s: {e}")
        expect(how != "ok", "new_comm failed")
        expect("rank 1" in str(e), "the error names rank 1")
        if how == "exit":
            expect(isinstance(e, rmacomm.TimeoutError), "TimeoutError for a rank that died in init")
            expect("rank 1 did not join the NCCL communicator within 4s" in str(e), "says rank 1 never joined")
            expect("ncclCommInitRankConfig did not complete within 4s" in str(e), "and this rank's own timeout")
            # The timeout, then the others' reports' grace (min(timeout, 5 s));
            # the rest is new_comm's own bootstrap on a loaded machine.
            expect(timeout <= took < 2 * timeout + 6, f"within the timeout and the grace ({took:.2f} s)")
        else:
            expect(isinstance(e, rmacomm.UnavailableError), "UnavailableError for a failed init")
            expect("rank 1's NCCL init failed" in str(e) and "ncclCommInitRankConfig" in str(e), "names the call")
            expect(took < timeout, f"at once, not after the timeout ({took:.2f} s)")
        log(f"nccl_init {how} ok")
        return
    expect(how in ("ok", "drop"), f"new_comm succeeded with {how}")
    expect(comm.get_backend() == "nccl" and comm.get_device() == "cuda:0", comm.get_device())
    x = np.ones(16, np.float32)
    comm.all_reduce(x, ReduceOp.SUM)
    expect(bool((x == comm.get_size()).all()), "a CPU all_reduce on the nccl communicator")
    comm.finalize()
    if how == "drop":
        # NCCL's finalize never completes (RMACOMM_STANDIN_NCCL_FINALIZE_HANGS=1):
        # dropping the communicator waits out its timeout, then aborts —
        # with the GIL released, so another thread runs meanwhile.
        ticks = [0]
        stop = threading.Event()

        def tick() -> None:
            while not stop.is_set():
                ticks[0] += 1
                time.sleep(0.01)

        ticker = threading.Thread(target=tick)
        ticker.start()
        time.sleep(0.2)
        before, t0 = ticks[0], time.monotonic()
        del comm
        gc.collect()
        took, during = time.monotonic() - t0, ticks[0] - before
        stop.set()
        ticker.join()
        log(f"nccl drop took {took:.2f} s, the other thread ticked {during} times meanwhile")
        expect(took >= timeout * 0.9, f"the drop waited for NCCL's finalize ({took:.2f} s)")
        expect(during >= took * 100 * 0.2, f"another thread ran during the drop ({during} ticks in {took:.2f} s)")
    log(f"nccl_init {how} ok")


def bench(algo: str) -> None:
    """Timing (not a test; python/bench.sh runs it): 8-byte put+signal ->
    wait_signal ping-pong between ranks 0 and 1 (half round trip) and
    all_reduce 4 KiB / 1 MiB with all_reduce algorithm `algo`, from Python,
    the loops of the Rust helpers (py-reference, coll-scenario time).
    Prints one line per figure on rank 0."""
    comm = rmacomm.new_comm("rdma", timeout=60, hints={"rmacomm::algo": algo})
    r, n = comm.get_rank(), comm.get_size()
    win = comm.new_window()
    win.tensor_register(comm.empty(16, np.float64))
    src = comm.empty(1, np.float64)
    peer = 1 - r
    iters = int(os.environ.get("BENCH_ITERS", "20000"))
    for phase in ("warm", "run"):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters if phase == "run" else 2000):
            if r == 0:
                win.put(src, peer, 0)
                win.signal(peer)
                win.wait_signal(peer)
            else:
                win.wait_signal(peer)
                win.put(src, peer, 0)
                win.signal(peer)
        dt = time.perf_counter() - t0
    if r == 0:
        log(f"put8_half_rtt_us {dt / iters / 2 * 1e6:.2f}")
    for size in (4096, 1 << 20):
        x = np.ones(size // 4, np.float32)
        # coll-scenario's count: 200 MB worth, 5 to 2000 calls, 20 warm-up.
        its = min(max(200_000_000 // max(size, 4096), 5), 2000)
        for phase in ("warm", "run"):
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(its if phase == "run" else min(its, 20)):
                comm.all_reduce(x, ReduceOp.SUM)
            dt = time.perf_counter() - t0
        if r == 0:
            log(f"all_reduce_{algo}_{size}_us {dt / its * 1e6:.2f}")
    comm.barrier()
    win.tensor_deregister()


def bench_self(iters: str) -> None:
    """Timing (not a test): one rank alone — put + signal + wait_signal to
    itself, all_reduce of 4 KiB and 1 MiB — the loops of `py-reference
    self`, so that the difference is the bindings' cost per call."""
    n = int(iters)
    comm = rmacomm.new_comm("rdma", timeout=60)
    win = comm.new_window()
    win.tensor_register(comm.empty(16, np.float64))
    src = comm.empty(1, np.float64)

    def time_it(k: int, f: Callable[[], object]) -> float:
        for _ in range(k // 10):
            f()
        t0 = time.perf_counter()
        for _ in range(k):
            f()
        return (time.perf_counter() - t0) / k * 1e6

    def psw() -> None:
        win.put(src, 0, 0)
        win.signal(0)
        win.wait_signal(0)

    log(f"self_put_signal_wait_us {time_it(n, psw):.3f}")
    for size in (4096, 1 << 20):
        x = np.zeros(size // 4, np.float32)
        k = n if size == 4096 else n // 100
        log(f"self_all_reduce_{size}_us {time_it(k, lambda: comm.all_reduce(x, ReduceOp.SUM)):.3f}")
    win.tensor_deregister()


def cuda_lists(_: str) -> None:
    """The list and _v forms as CUDA tensors get them on an rdma
    communicator (rmacomm._cuda_lists: one staging tensor, one single-form
    collective, copies out), run here on CPU torch tensors, which the
    single forms take too: all_gather (even and _v), reduce_scatter (even
    and _v, SUM and MAX), all_to_all (even and uneven), gather and scatter
    to every root, and the errors for uneven plain forms and wrong list
    lengths."""
    import torch

    from rmacomm import _cuda_lists as L

    comm = rmacomm.new_comm("rdma", timeout=60)
    r, n = comm.get_rank(), comm.get_size()
    val = lambda k, m, shift=0: torch.arange(m, dtype=torch.float32) + 1000 * k + shift  # noqa: E731
    # all_gather, shapes kept (2-D blocks).
    outs = [torch.zeros(3, 5) for _ in range(n)]
    L.all_gather(comm, outs, val(r, 15).view(3, 5), False)
    expect(all(torch.equal(o.view(-1), val(k, 15)) for k, o in enumerate(outs)), "all_gather")
    # all_gather_v: rank k gives k + 2 elements.
    outs = [torch.zeros(k + 2) for k in range(n)]
    L.all_gather(comm, outs, val(r, r + 2), True)
    expect(all(torch.equal(o, val(k, k + 2)) for k, o in enumerate(outs)), "all_gather_v")
    # reduce_scatter: rank j gets the sum (max) over ranks of their block j.
    for op, fold in ((ReduceOp.SUM, sum), (ReduceOp.MAX, max)):
        ins = [val(r, 7, j) for j in range(n)]
        out = torch.zeros(7)
        L.reduce_scatter(comm, out, ins, op, False)
        want = torch.stack([val(k, 7, r) for k in range(n)])
        want = want.sum(0) if fold is sum else want.max(0).values
        expect(torch.equal(out, want), f"reduce_scatter {op}")
    # reduce_scatter_v: block j has j + 1 elements everywhere.
    ins = [val(r, j + 1, j) for j in range(n)]
    out = torch.zeros(r + 1)
    L.reduce_scatter(comm, out, ins, ReduceOp.SUM, True)
    expect(torch.equal(out, sum(val(k, r + 1, r) for k in range(n))), "reduce_scatter_v")
    # all_to_all of lists: rank r's block j is val(10 r + j).
    outs = [torch.zeros(2, 2) for _ in range(n)]
    L.all_to_all(comm, outs, [val(10 * r + j, 4).view(2, 2) for j in range(n)])
    expect(all(torch.equal(o.view(-1), val(10 * k + r, 4)) for k, o in enumerate(outs)), "all_to_all")
    # all_to_all of uneven blocks: rank r sends r + j + 1 elements to rank j.
    outs = [torch.zeros(r + k + 1) for k in range(n)]
    L.all_to_all(comm, outs, [val(10 * r + j, r + j + 1) for j in range(n)])
    expect(all(torch.equal(o, val(10 * k + r, r + k + 1)) for k, o in enumerate(outs)), "uneven all_to_all")
    # Uneven away from rank 0: rank 1 sends the last rank 5 elements, all
    # other blocks are 4, so rank 0's own are even (it skipped the padding's
    # all_reduce that the others ran: different collectives).
    size = lambda src, dst: 5 if (src, dst) == (1, n - 1) and n > 2 else 4  # noqa: E731
    outs = [torch.zeros(size(k, r)) for k in range(n)]
    L.all_to_all(comm, outs, [val(10 * r + j, size(r, j)) for j in range(n)])
    expect(all(torch.equal(o, val(10 * k + r, size(k, r))) for k, o in enumerate(outs)), "all_to_all uneven elsewhere")
    # gather and scatter, every root.
    for root in range(n):
        outs = [torch.zeros(6) for _ in range(n)] if r == root else None
        L.gather(comm, outs, val(r, 6, root), root)
        if outs is not None:
            expect(all(torch.equal(o, val(k, 6, root)) for k, o in enumerate(outs)), f"gather to {root}")
        out = torch.zeros(6)
        L.scatter(comm, out, [val(100 + j, 6, root) for j in range(n)] if r == root else None, root)
        expect(torch.equal(out, val(100 + r, 6, root)), f"scatter from {root}")
    # Refused at once, naming the argument (every rank alike: nothing runs).
    for call, what in (
        (lambda: L.all_gather(comm, [torch.zeros(k + 1) for k in range(n)], torch.zeros(r + 1), False), "_v form"),
        (lambda: L.all_gather(comm, [torch.zeros(3)], torch.zeros(3), False), "ranks"),
    ):
        try:
            call()
            raise AssertionError(f"accepted: {what}")
        except rmacomm.ArgumentError as e:
            expect(what in str(e), str(e))
    comm.barrier()
    comm.finalize()
    log("cuda_lists ok")


SCENARIOS: Dict[str, Callable[[str], None]] = {
    "cuda_lists": cuda_lists,
    "bench_self": bench_self,
    "window_ring": window_ring,
    "collectives": collectives,
    "gil": gil,
    "gil_put": gil_put,
    "op_timeout": op_timeout,
    "op_interrupt": op_interrupt,
    "queued_signal_timeout": queued_signal_timeout,
    "window_allocate_sizes": window_allocate_sizes,
    "split_after_async": split_after_async,
    "peer_shape": peer_shape,
    "transport": transport,
    "python_store": python_store,
    "tcp_store": tcp_store,
    "rank_dies": rank_dies,
    "nccl_init": nccl_init,
    "bench": bench,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](sys.argv[2] if len(sys.argv) > 2 else "numpy")
