"""Bad inputs raise before anything moves, with messages naming the argument."""

import re
import sys
from datetime import timedelta

import numpy as np
import pytest

import rmacomm
from conftest import launch
from rmacomm import ReduceOp


@pytest.fixture(scope="module")
def comm():
    store = rmacomm.TcpStore("127.0.0.1", 0, 1, True)
    c = rmacomm.new_comm(store=store, rank=0, world_size=1, timeout=10)
    yield c
    c.finalize()


def test_non_contiguous_is_a_value_error_naming_the_argument(comm) -> None:
    x = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError, match=r"tensor is not contiguous.*np.ascontiguousarray"):
        comm.all_reduce(x[:, ::2], ReduceOp.SUM)
    with pytest.raises(ValueError, match="input is not contiguous"):
        comm.all_gather_single(np.zeros(8, np.float32), x[::2, 0])


def test_conjugate_and_negative_views_are_refused_naming_the_fix(comm) -> None:
    # Contiguous, but their memory holds the values before torch's lazy
    # conjugation or negation: moved as bytes they were silently wrong.
    torch = pytest.importorskip("torch", reason="torch is not installed")
    c = torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64).conj()
    with pytest.raises(ValueError, match=r"tensor is a conjugate view .*tensor.resolve_conj\(\)"):
        comm.broadcast(c, 0)
    n = torch._neg_view(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"is a negative view .*resolve_neg\(\)"):
        comm.all_reduce(n, ReduceOp.SUM)
    win = comm.new_window()
    with pytest.raises(ValueError, match="conjugate view"):
        win.tensor_register(c)
    # Resolved, they move the values they show.
    r = c.resolve_conj()
    comm.broadcast(r, 0)
    assert r.tolist() == [1 - 2j, 3 - 4j]
    m = n.resolve_neg()
    comm.all_reduce(m, ReduceOp.SUM)
    assert m.tolist() == [-1.0, -2.0]


def test_wrong_dtype_is_a_type_error_naming_both_arguments(comm) -> None:
    with pytest.raises(TypeError, match="output has dtype int32, but input has float32"):
        comm.all_gather_single(np.zeros(4, np.int32), np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="reductions support .* not bool"):
        comm.all_reduce(np.zeros(4, bool), ReduceOp.SUM)
    with pytest.raises(TypeError, match="must be a numpy array or a torch tensor, not list"):
        comm.all_reduce([1.0, 2.0], ReduceOp.SUM)
    with pytest.raises(TypeError, match="byte order"):
        comm.broadcast(np.zeros(4, ">f4"), 0)
    # Each input of a list all_to_all against the first (rank 1's int32
    # bytes read as another rank's float32 output).
    with pytest.raises(TypeError, match=r"input_tensor_list\[1\] has dtype int32, but input_tensor_list\[0\] has float32"):
        comm.all_to_all([np.zeros(4, np.float32)], [np.zeros(4, np.float32), np.zeros(4, np.int32)])


def test_wrong_size_read_only_and_bad_op(comm) -> None:
    with pytest.raises(ValueError, match=r"output has 20 bytes; all_gather_single needs size × input \(12 bytes\)"):
        comm.all_gather_single(np.zeros(5, np.float32), np.zeros(3, np.float32))
    ro = np.zeros(4, np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="tensor is read-only"):
        comm.all_reduce(ro, ReduceOp.SUM)
    with pytest.raises(rmacomm.ArgumentError, match="bitwise ops need an integer dtype"):
        comm.all_reduce(np.zeros(4, np.float32), ReduceOp.BAND)
    with pytest.raises(rmacomm.ArgumentError, match="not another rank"):
        comm.send(np.zeros(4), 0)
    with pytest.raises(ValueError):  # ArgumentError is a ValueError
        comm.broadcast(np.zeros(4), 3)


def test_an_async_wait_signal_times_out_when_polled_or_waited_in_slices(comm) -> None:
    # Its timeout runs from the first poll or wait, not from each wait: a
    # handle polled with is_completed() used to stay pending for good, and
    # one waited for in slices shorter than the timeout never failed.
    import time

    win = comm.new_window()
    win.tensor_register(comm.empty(8, np.float32))
    cw = comm.window_allocate(64, signal_size=2)
    waits = [
        (lambda: win.wait_signal(0, async_op=True, timeout=0.5), "wait_signal with rank 0: no signal within 500ms"),
        (lambda: cw.wait_signal(1, 1, async_op=True, timeout=0.5), "wait_signal: slot 1 .* did not hold within 500ms"),
    ]
    for make, says in waits:
        w = make()
        t0 = time.monotonic()
        while not w.is_completed():
            assert time.monotonic() - t0 < 10, f"still pending after 10 s: {says}"
            time.sleep(0.02)
        with pytest.raises(rmacomm.TimeoutError, match=says):
            w.wait()
        w = make()
        t0 = time.monotonic()
        for _ in range(40):
            try:
                w.wait(timeout=0.2)
                pytest.fail("a wait for a signal nobody sends returned")
            except rmacomm.TimeoutError as e:
                if "Work.wait" in str(e):
                    # The slice's own timeout names the operation waited for.
                    assert re.search(r"Work\.wait of wait_signal (from rank 0|on slot 1): not complete", str(e)), str(e)
                    continue
                if "Work.wait: not complete" not in str(e):
                    assert re.search(says, str(e)), str(e)
                    break
        else:
            pytest.fail(f"waited in 0.2 s slices for 8 s: still pending ({says})")
        assert time.monotonic() - t0 < 5
    win.tensor_deregister()


def test_window_errors(comm) -> None:
    win = comm.new_window()
    with pytest.raises(ValueError, match="call tensor_register first"):
        win.map_remote_tensor(0)
    buf = comm.empty(8, np.int64)
    win.tensor_register(buf)
    with pytest.raises(ValueError, match="registered already"):
        win.tensor_register(buf)
    with pytest.raises(rmacomm.ArgumentError, match=r"put with rank 0: out of bounds.*nothing was moved"):
        win.put(np.arange(9), 0, 0)
    with pytest.raises(rmacomm.ArgumentError, match="out of bounds"):
        win.put(comm.empty(2, np.int64), 0, 7)
    # Another dtype than the registered tensor's: refused naming both (the
    # offset counts the registered tensor's elements: a uint8 put at 1
    # landed at byte 8, where torchcomms' NCCLX window writes byte 1).
    buf[:] = 0
    with pytest.raises(TypeError, match="put with rank 0: tensor has dtype uint8, but rank 0 registered int64"):
        win.put(np.full(4, 255, np.uint8), 0, 1)
    with pytest.raises(TypeError, match="get with rank 0: tensor has dtype int32"):
        win.get(np.zeros(2, np.int32), 0, 0)
    assert not buf.any()
    with pytest.raises(rmacomm.ArgumentError, match="not in this window"):
        win.wait_signal(1)
    with pytest.raises(rmacomm.TimeoutError, match="no signal within"):
        win.wait_signal(0, timeout=0.05)
    w = win.wait_signal(0, async_op=True, timeout=0.05)
    assert not w.is_completed()
    win.signal(0)
    w.wait()
    # torchcomms' keyword names.
    win.signal(peer_rank=0, async_op=False)
    win.wait_signal(peer_rank=0, async_op=False)
    assert win.get_attr(peer_rank=0).access_type == rmacomm.WinAccessType.UNIFIED
    win.put(np.arange(2), dst_rank=0, target_offset_nelems=1, async_op=False)
    win.get(np.zeros(2, np.int64), src_rank=0, source_offset_nelems=1)
    with pytest.raises(TypeError, match="timeout must be"):
        win.signal(0, timeout="soon")
    win.tensor_deregister()
    cw = comm.window_allocate(64, signal_size=2)
    with pytest.raises(rmacomm.ArgumentError, match="signal slot 5"):
        cw.wait_signal(5, 1)
    with pytest.raises(rmacomm.TimeoutError, match="slot 0 Ge 1 did not hold"):
        cw.wait_signal(0, 1, timeout=0.05)
    with pytest.raises(ValueError, match="end past"):
        cw.get_tensor(0, 100, np.uint8)
    assert cw.get_attr(peer_rank=0).access_type == rmacomm.WinAccessType.UNIFIED


def test_sizes_that_overflow_are_value_errors(comm) -> None:
    # Offsets and shapes whose byte counts pass 2**64 once wrapped to a
    # small number that looked in bounds (a view before the buffer, or at
    # the wrong place): refused, naming the call.
    cw = comm.window_allocate(64, signal_size=1)
    with pytest.raises(ValueError, match="get_tensor"):
        cw.get_tensor(0, 1, np.uint8, offset=2**64 - 1)
    with pytest.raises(ValueError, match="get_tensor"):
        cw.get_tensor(0, 1, np.float32, offset=2**62 + 1)
    with pytest.raises(ValueError, match="get_tensor"):
        cw.get_tensor(0, [2**62 + 1, 4], np.float32)
    assert cw.get_tensor(0, 16, np.float32, offset=0).shape == (16,)
    # Split sizes count rows; rows × row bytes past 2**64 wrapped to a
    # valid-looking 4 bytes.
    out, inp = np.zeros(1, np.float32), np.ones(1, np.float32)
    with pytest.raises(ValueError, match="input_split_sizes"):
        comm.all_to_all_v_single(out, inp, [1], [2**62 + 1])
    # Not a Rust panic (PanicException is a BaseException: it would pass
    # through `Exception`).
    with pytest.raises(Exception) as e:
        comm.all_to_all_v_single(out, inp, [2**64 - 1, 1], [1, 1])
    assert "output_split_sizes" in str(e.value), e.value


def test_a_peer_descriptor_whose_size_overflows_is_refused(tmp_path) -> None:
    out = launch(2, "peer_shape", env={"RMACOMM_TEST_STORE_DIR": str(tmp_path)})
    assert out.count("peer_shape ok") == 2, out


def test_a_huge_timeout_means_no_deadline(comm) -> None:
    # sys.maxsize seconds is a common "forever": past what the clock can
    # add, so it is no deadline (not a panic).
    win = comm.new_window()
    win.tensor_register(comm.empty(4, np.int64))
    w = win.wait_signal(0, timeout=sys.maxsize, async_op=True)
    win.signal(0)
    w.wait(timeout=sys.maxsize)
    win.signal(0)
    win.wait_signal(0, timeout=sys.maxsize)
    win.put(np.arange(2), 0, 0, timeout=sys.maxsize)
    win.signal(0, timeout=timedelta.max)
    win.wait_signal(0, timeout=timedelta.max)
    win.tensor_deregister()
    cw = comm.window_allocate(64, signal_size=1)
    cw.signal(0, 1, 0)
    cw.wait_signal(0, 1, timeout=sys.maxsize, async_op=True).wait(timeout=sys.maxsize)
    comm.all_reduce(np.ones(4, np.float32), ReduceOp.SUM, timeout=sys.maxsize)
    comm.barrier(async_op=True).wait(timeout=sys.maxsize)


def test_a_forever_timeout_reads_back_as_timedelta_max() -> None:
    store = rmacomm.TcpStore("127.0.0.1", 0, 1, True)
    c = rmacomm.new_comm(store=store, rank=0, world_size=1, timeout=sys.maxsize)
    assert c.get_timeout() == timedelta.max  # raised OverflowError
    c.finalize()


def test_an_earlier_async_failure_is_its_work_s_not_the_next_call_s(comm) -> None:
    # The failed send is reported by its Work; the barrier issued after it
    # runs (it raised the send's error instead, and its peers waited).
    for _ in range(5):
        big = comm.all_reduce(np.ones(1 << 22, np.float32), ReduceOp.SUM, async_op=True)
        bad = comm.send(np.ones(4, np.float32), 5, async_op=True)
        comm.barrier()
        big.wait()
        with pytest.raises(rmacomm.ArgumentError, match="send"):
            bad.wait()


def test_unavailable_backend_and_device() -> None:
    store = rmacomm.TcpStore("127.0.0.1", 0, 1, True)
    # Here NCCL (from torch's wheels) or the CUDA driver is missing: the
    # error names the backend, the rank and what is not available.
    with pytest.raises(rmacomm.UnavailableError, match=r'new_comm\("nccl"\): rank 0 cannot use it: .*not available'):
        rmacomm.new_comm("nccl", store=store, rank=0, world_size=1)
    with pytest.raises(rmacomm.ArgumentError, match="cuda:N"):
        rmacomm.new_comm("nccl", "cpu", store=store, rank=0, world_size=1)
    with pytest.raises(rmacomm.UnavailableError, match="CPU memory only"):
        rmacomm.new_comm("rdma", "cuda", store=store, rank=0, world_size=1)


def test_empty_on_a_device() -> None:
    assert rmacomm.empty(3, device="cpu").shape == (3,)
    with pytest.raises(ValueError, match="cpu.*cuda"):
        rmacomm.empty(3, device="tpu")


def test_store_objects_need_set_get_wait() -> None:
    with pytest.raises(TypeError, match="has no get, wait method"):
        rmacomm.new_comm(store=type("S", (), {"set": lambda *a: None})(), rank=0, world_size=1)


def test_tcp_store_values_are_bytes_or_str() -> None:
    """As torch's Store: compare_set takes str (it raised TypeError: Can't
    extract str to Vec)."""
    store = rmacomm.TcpStore("127.0.0.1", 0, 1, True)
    assert store.compare_set("k", "", "v1") == b"v1"
    assert store.compare_set("k", b"v1", "v2") == b"v2"
    assert store.compare_set("k", "nope", "v3") == b"v2"
    store.set("s", "text")
    assert store.get("s") == b"text"
    with pytest.raises(TypeError, match="compare_set: desired must be bytes or str, not float"):
        store.compare_set("k", "v2", 1.5)


def test_empty_and_dtypes() -> None:
    a = rmacomm.empty((2, 3), "int16")
    assert a.shape == (2, 3) and a.dtype == np.int16 and not a.any()
    assert rmacomm.empty(5).dtype == np.float32
    with pytest.raises(TypeError, match="numpy has no bfloat16"):
        rmacomm.empty(4, "bfloat16")
    with pytest.raises(TypeError, match="not a type rmacomm moves"):
        rmacomm.empty(4, "float128x")
    assert ReduceOp.PREMUL_SUM(0.5).factor == 0.5 and ReduceOp.SUM.name == "sum"
    assert ReduceOp.SUM == ReduceOp.SUM and ReduceOp.SUM != ReduceOp.MAX
    assert rmacomm.WinAccessType.UNIFIED != rmacomm.WinAccessType.SEPARATE
    assert issubclass(rmacomm.TimeoutError, TimeoutError) and issubclass(rmacomm.TimeoutError, rmacomm.CommError)
