"""Rank programs on CUDA tensors (issue 13), run under the launcher:
``python -m rmacomm.run --nproc-per-node N tests/cuda_scenarios.py NAME``.
They need only rmacomm and torch (no numpy, no pytest), so that the GPU
suite runs them as they are on a machine with a GPU and nothing else.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict

import rmacomm


def log(*a: Any) -> None:
    print(*a, flush=True)


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def legacy_ipc_capable(t: Any) -> bool:
    """Whether the CUDA driver can export `t`'s memory with a CUDA IPC handle
    (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE); False for cuMem/VMM
    memory (PyTorch's expandable segments)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    v = ctypes.c_int(-1)
    st = cuda.cuPointerGetAttribute(ctypes.byref(v), 10, ctypes.c_uint64(t.data_ptr()))
    expect(st == 0, f"cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE) failed: {st}")
    return v.value != 0


def allowed_handle_types(t: Any) -> int:
    """The handle types `t`'s cuMem/VMM allocation may be exported as
    (CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: 0x1 a POSIX file
    descriptor, what rmacomm passes between processes; 0x8 FABRIC)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    v = ctypes.c_uint64(0)
    st = cuda.cuPointerGetAttribute(ctypes.byref(v), 14, ctypes.c_uint64(t.data_ptr()))
    expect(st == 0, f"cuPointerGetAttribute(ALLOWED_HANDLE_TYPES) failed: {st}")
    return int(v.value)


def register_mapped(win: Any, buf: Any) -> None:
    """`win.tensor_register(buf)`, failing with the reason when the tensor
    could not be mapped by some peer and went through the transport instead
    (rmacomm warns, then stages it)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        win.tensor_register(buf)
    for w in caught:
        expect("cannot map a peer's device memory" not in str(w.message), f"staged instead of mapped: {w.message}")


def send_recv_ring(comm: Any, x: Any, y: Any) -> None:
    """One ring step of native send/recv: `x` to the right neighbour, `y`
    from the left one (even ranks send first, odd ranks receive first)."""
    r, n = comm.get_rank(), comm.get_size()
    if r % 2 == 0:
        comm.send(x, (r + 1) % n)
        comm.recv(y, (r - 1) % n)
    else:
        comm.recv(y, (r - 1) % n)
        comm.send(x, (r + 1) % n)


def ring_rounds(comm: Any, win: Any, buf: Any, count: int, side: Any, what: str) -> Any:
    """Four ring rounds on `win` (registered `buf`, `count` elements per
    rank): each rank puts into its right neighbour at its own slot, signals
    it and waits for its left one, then checks what the left one put; puts
    sync and async on torch's current stream, then on `side` (stream=).
    Returns the last source tensor."""
    import torch

    r, n = comm.get_rank(), comm.get_size()
    right, left = (r + 1) % n, (r - 1) % n
    dt = buf.dtype
    src = None
    for it in range(4):
        src = torch.full((count,), r * 100 + it + 1, dtype=dt, device="cuda")
        if it < 2:
            win.put(src, right, r * count, async_op=it == 1)
            win.signal(right)
            win.wait_signal(left)
        else:
            side.wait_stream(torch.cuda.current_stream())
            win.put(src, right, r * count, async_op=True, stream=side)
            win.signal(right, stream=side)
            win.wait_signal(left, stream=side)
            torch.cuda.current_stream().wait_stream(side)
        want = torch.full((count,), left * 100 + it + 1, dtype=dt, device="cuda")
        expect(torch.equal(buf[left * count:(left + 1) * count], want), f"{what} {dt} count {count} it {it}")
        comm.barrier()
    return src


def window_ring_cuda(_: str) -> None:
    """The window ring on CUDA tensors (two or more processes on one GPU:
    CUDA IPC): f32, bf16 and i32 × counts 1, 1000 and 1 Mi; puts, signals
    and waits queued on torch's current stream (sync and async put), then on
    a side stream passed as stream=; map_remote_tensor of the right
    neighbour (IPC), get, bounds; a ring step (put, signal, wait) captured
    in a CUDA graph and replayed 10 times; a mismatch of CPU and CUDA
    registrations."""
    import torch

    comm = rmacomm.new_comm("rdma", timeout=60)
    r, n = comm.get_rank(), comm.get_size()
    right, left = (r + 1) % n, (r - 1) % n
    torch.cuda.set_device(0)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    for dt in (torch.float32, torch.bfloat16, torch.int32):
        for count in (1, 1000, 1 << 20):
            buf = comm.empty(n * count, dt, device="cuda")
            expect(buf.is_cuda and buf.dtype == dt and not buf.any(), "comm.empty(device=cuda)")
            if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
                # The stage is about VMM memory: make sure that is what it is.
                expect(not legacy_ipc_capable(buf), "expandable segments gave memory with a CUDA IPC handle")
                kinds = allowed_handle_types(buf)
                if count == 1 and dt == torch.float32:
                    log(f"[{r}] expandable segments: cuMem/VMM memory (no CUDA IPC handle), handle types {kinds:#x}")
                expect(kinds & 0x1 != 0, f"the VMM memory cannot be exported as a file descriptor (types {kinds:#x})")
            win = comm.new_window()
            register_mapped(win, buf)
            expect(win.get_device() == "cuda", "get_device of a CUDA window")
            expect(win.get_attr(right).access_type == rmacomm.WinAccessType.UNIFIED, "CUDA peers are UNIFIED")
            src = ring_rounds(comm, win, buf, count, side, "ring")
            theirs = win.map_remote_tensor(right)
            expect(tuple(theirs.shape) == (n * count,) and theirs.dtype == dt, f"peer view {theirs.shape}")
            expect(torch.equal(theirs[r * count:(r + 1) * count], src), f"peer view {dt} count {count}")
            back = torch.zeros(count, dtype=dt, device="cuda")
            win.get(back, right, r * count)
            expect(torch.equal(back, src), f"get {dt} count {count}")
            try:
                win.put(src, right, n * count)
                raise AssertionError("a put past the end must fail")
            except rmacomm.ArgumentError as e:
                expect("out of bounds" in str(e) and f"rank {right}" in str(e), str(e))
            comm.barrier()
            win.tensor_deregister()
    # A ring step captured whole in a CUDA graph (torch.cuda.graph) and
    # replayed 10 times: the put, the signal and the wait run again on every
    # replay (the signals as kernels once captured).
    count = 4096
    buf = comm.empty(n * count, torch.float32, device="cuda")
    win = comm.new_window()
    register_mapped(win, buf)
    src = torch.zeros(count, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a first round outside the graph
        win.put(src, right, r * count, async_op=True)
        win.signal(right)
        win.wait_signal(left)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    comm.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        win.put(src, right, r * count, async_op=True)
        win.signal(right)
        win.wait_signal(left)
    for i in range(10):
        src.fill_(float(5000 + r * 100 + i))
        graph.replay()
        torch.cuda.synchronize()
        want = torch.full((count,), float(5000 + left * 100 + i), device="cuda")
        expect(torch.equal(buf[left * count:(left + 1) * count], want), f"graph replay {i}")
        comm.barrier()
    del graph
    torch.cuda.synchronize()
    comm.barrier()
    win.tensor_deregister()
    # Every rank registers, but rank 0 a CPU tensor: a mismatch, everywhere.
    win = comm.new_window()
    t = torch.zeros(8) if r == 0 else torch.zeros(8, device="cuda")
    try:
        win.tensor_register(t)
        raise AssertionError("mixed CPU and CUDA registrations must fail")
    except rmacomm.MismatchError as e:
        expect("rank 0: cpu" in str(e) and "cuda" in str(e), str(e))
    comm.finalize()
    log("window_ring_cuda ok")




def window_ring_cuda_staged(_: str) -> None:
    """The window ring on CUDA tensors through the transport (staged: what a
    peer on another host gets; here forced with unified=False): f32 and
    i32 x counts 1, 1000 and 1 Mi + 3; puts sync and async, on torch's
    current stream and a side stream, signals and waits ordered on the
    stream by the window's stream proxy (a put behind a busy GPU carries
    what the kernel queued just before it wrote), get, map_remote_tensor
    of a peer refused naming it, bounds."""
    import torch

    comm = rmacomm.new_comm("rdma", timeout=60)
    r, n = comm.get_rank(), comm.get_size()
    right, left = (r + 1) % n, (r - 1) % n
    torch.cuda.set_device(0)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    for dt in (torch.float32, torch.int32):
        for count in (1, 1000, (1 << 20) + 3):
            buf = torch.zeros(n * count, dtype=dt, device="cuda")
            win = comm.new_window(unified=False)
            win.tensor_register(buf)
            expect(win.get_device() == "cuda", "get_device of a staged CUDA window")
            expect(win.get_attr(right).access_type == rmacomm.WinAccessType.SEPARATE, "staged peers are SEPARATE")
            src = ring_rounds(comm, win, buf, count, side, "staged ring")
            # Stream order through the proxy: the GPU is busy when put
            # returns; the put still carries what the fill queued before it
            # wrote, and the check queued after the wait sees the peer's.
            torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]
            late = torch.full((count,), r * 100 + 77, dtype=dt, device="cuda")
            win.put(late, right, r * count, async_op=True)
            win.signal(right)
            win.wait_signal(left)
            want = torch.full((count,), left * 100 + 77, dtype=dt, device="cuda")
            expect(torch.equal(buf[left * count:(left + 1) * count], want), f"staged stream order {dt} count {count}")
            comm.barrier()
            # The get is queued behind the late put on this rank's proxy:
            # it reads what that put placed.
            back = torch.zeros(count, dtype=dt, device="cuda")
            win.get(back, right, r * count)
            expect(torch.equal(back, late), f"staged get {dt} count {count}")
            try:
                win.map_remote_tensor(right)
                raise AssertionError("a staged peer's tensor must not map")
            except rmacomm.UnavailableError as e:
                expect(f"rank {right}" in str(e), str(e))
            try:
                win.put(src, right, n * count)
                raise AssertionError("a put past the end must fail")
            except rmacomm.ArgumentError as e:
                expect(f"rank {right}" in str(e), str(e))
            comm.barrier()
            win.tensor_deregister()
    comm.finalize()
    log("window_ring_cuda_staged ok")


def agent_cuda(_: str) -> None:
    """KV-cache blocks in CUDA tensors between two TransferAgents (rank 0
    decode, rank 1 prefill, one GPU: the transport's same-host path opens
    the peer's memory through CUDA IPC): 16 blocks of 1 MiB written into
    scattered slots of the decode's cache with one notification, checked
    there, then read back into another CUDA tensor; the metadata through a
    TcpStore on MASTER_PORT + 1."""
    import os

    import torch

    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    expect(n == 2, "agent_cuda runs 2 ranks")
    store = rmacomm.TcpStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, n, r == 0, timeout=60)
    torch.cuda.set_device(0)
    slots_n, block, blocks = 64, 1 << 20, 16
    slots = [(7 * b + 3) % slots_n for b in range(blocks)]

    def data(b: int) -> Any:
        return ((torch.arange(block, device="cuda") * 31 + b * 7 + 1) % 251).to(torch.uint8)

    if r == 0:
        agent = rmacomm.TransferAgent("decode", timeout=30)
        cache = torch.zeros((slots_n, block), dtype=torch.uint8, device="cuda")
        region = agent.register(cache)
        store.set("decode.meta", agent.metadata())
        store.set("decode.region", str(region))
        peer, tag = agent.wait_notification(timeout=60)
        expect((peer, tag) == ("prefill", b"kv"), f"notification {peer!r} {tag!r}")
        for b, s in enumerate(slots):
            expect(torch.equal(cache[s], data(b)), f"slot {s} holds block {b}")
        others = [s for s in range(slots_n) if s not in slots]
        expect(not cache[others].any(), "a slot outside the request changed")
        store.set("decode.checked", "1")
        store.wait(["prefill.done"], timeout=60)
    else:
        agent = rmacomm.TransferAgent("prefill", timeout=30)
        store.wait(["decode.meta"], timeout=60)
        agent.add_peer(store.get("decode.meta"))
        region = int(store.get("decode.region"))
        kv = torch.stack([data(b) for b in range(blocks)])
        back = torch.zeros_like(kv)
        agent.register(kv)
        agent.register(back)
        torch.cuda.synchronize()
        pieces = [(kv[b], (region, s * block, block)) for b, s in enumerate(slots)]
        agent.transfer("WRITE", "decode", pieces, notify=b"kv").wait(timeout=60)
        store.wait(["decode.checked"], timeout=60)
        reads = [(back[b], (region, s * block, block)) for b, s in enumerate(slots)]
        agent.transfer("READ", "decode", reads).wait(timeout=60)
        expect(torch.equal(back, kv), "blocks read back")
        # The same CUDA tensor again is its region; deregister(tensor)
        # finds it (two regions were made, and deregister found neither).
        ids = [rid for rid, _, _ in agent.regions()]
        expect(agent.register(back) in ids and len(agent.regions()) == 2, f"back registered again: {agent.regions()}")
        expect(agent.deregister(back) and agent.deregister(kv) and agent.regions() == [], "deregister(tensor)")
        store.set("prefill.done", "1")
    log("agent_cuda ok")


def bench_all_reduce(comm: Any, test: str) -> None:
    """all_reduce's time and bandwidth of f32 CUDA tensors from 64 KiB to 256 MiB as
    JSON lines (rank 0), nccl-tests' way: algbw = bytes / time, busbw =
    algbw × 2(n-1)/n."""
    import json
    import time

    import torch

    r, n = comm.get_rank(), comm.get_size()
    size = 64 << 10
    while size <= 256 << 20:
        x = torch.ones(size // 4, device=comm_device(comm))
        iters = max(5, min(200, (4 << 30) // size))
        for _ in range(3):
            comm.all_reduce(x, rmacomm.ReduceOp.SUM)
        torch.cuda.synchronize()
        comm.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x, rmacomm.ReduceOp.SUM)
        queued = (time.perf_counter() - t) / iters
        torch.cuda.synchronize()
        dt_s = (time.perf_counter() - t) / iters
        alg = size / dt_s / 1e9
        if r == 0:
            log(json.dumps({"test": test, "ranks": n, "bytes": size, "us": round(dt_s * 1e6, 1),
                            "host_us": round(queued * 1e6, 1),
                            "algbw_GBps": round(alg, 2), "busbw_GBps": round(alg * 2 * (n - 1) / n, 2),
                            "device": torch.cuda.get_device_name()}))
        size *= 4


def comm_device(comm: Any) -> str:
    d: str = comm.get_device()
    return d if d.startswith("cuda") else "cuda"


def nccl_collectives(arg: str) -> None:
    """new_comm("nccl") on the ranks given (one per GPU: NCCL refuses two
    ranks on one GPU): every collective it routes to NCCL on CUDA tensors,
    checked; CPU tensors still go through rmacomm; an op NCCL lacks raises
    UnavailableError naming it. With arg "bench", NCCL's all_reduce
    bandwidth (the peer of the native backend's)."""
    import torch

    # device="cuda" is torch's current device (as torch.device("cuda")
    # means), not GPU 0: each rank of a host on its own GPU.
    comm = rmacomm.new_comm("nccl", device="cuda", timeout=60)
    r, n = comm.get_rank(), comm.get_size()
    expect(comm.get_backend() == "nccl" and comm.get_device().startswith("cuda:"), comm.get_device())
    expect(comm.get_device() == f"cuda:{torch.cuda.current_device()}", f"device=cuda gave {comm.get_device()}")
    dev = comm.get_device()
    for dt in (torch.float32, torch.bfloat16, torch.int32, torch.float64):
        x = torch.full((1000,), r + 1, dtype=dt, device=dev)
        comm.all_reduce(x, rmacomm.ReduceOp.SUM)
        expect(torch.equal(x, torch.full_like(x, n * (n + 1) // 2)), f"all_reduce {dt}")
        x = torch.full((1000,), r + 1, dtype=dt, device=dev)
        comm.all_reduce(x, rmacomm.ReduceOp.MAX)
        expect(torch.equal(x, torch.full_like(x, n)), f"all_reduce max {dt}")
        x = torch.full((1000,), r + 1, dtype=dt, device=dev)
        comm.reduce(x, 0, rmacomm.ReduceOp.SUM)
        if r == 0:
            expect(torch.equal(x, torch.full_like(x, n * (n + 1) // 2)), f"reduce {dt}")
        x = torch.full((1000,), r + 7, dtype=dt, device=dev)
        comm.broadcast(x, 0)
        expect(torch.equal(x, torch.full_like(x, 7)), f"broadcast {dt}")
        inp = torch.full((100,), r, dtype=dt, device=dev)
        out = torch.zeros(100 * n, dtype=dt, device=dev)
        comm.all_gather_single(out, inp)
        want = torch.cat([torch.full((100,), p, dtype=dt, device=dev) for p in range(n)])
        expect(torch.equal(out, want), f"all_gather_single {dt}")
        # Small integers: exact in every dtype (bf16 up to 256).
        inp = (torch.arange(100 * n, device=dev) % 16).to(dt)
        out = torch.zeros(100, dtype=dt, device=dev)
        comm.reduce_scatter_single(out, inp, rmacomm.ReduceOp.SUM)
        want = ((torch.arange(100 * r, 100 * (r + 1), device=dev) % 16) * n).to(dt)
        expect(torch.equal(out, want), f"reduce_scatter_single {dt}")
        inp = torch.full((10 * n,), r, dtype=dt, device=dev)
        out = torch.zeros(10 * n, dtype=dt, device=dev)
        comm.all_to_all_single(out, inp)
        want = torch.cat([torch.full((10,), p, dtype=dt, device=dev) for p in range(n)])
        expect(torch.equal(out, want), f"all_to_all_single {dt}")
    if n > 1:
        t = torch.full((64,), r, dtype=torch.float32, device=dev)
        if r == 0:
            comm.send(t, 1)
        elif r == 1:
            comm.recv(t, 0)
            expect(torch.equal(t, torch.zeros_like(t)), "recv")
    # The list forms of CUDA tensors: composed of NCCL's single forms.
    outs = [torch.zeros(100, device=dev) for _ in range(n)]
    comm.all_gather(outs, torch.full((100,), float(r), device=dev))
    expect(all(torch.equal(o, torch.full_like(o, float(k))) for k, o in enumerate(outs)), "nccl all_gather list")
    # CPU tensors on an nccl communicator: rmacomm's own collectives.
    c = torch.full((10,), float(r + 1))
    comm.all_reduce(c, rmacomm.ReduceOp.SUM)
    expect(torch.equal(c, torch.full((10,), float(n * (n + 1) // 2))), "CPU all_reduce on an nccl comm")
    try:
        comm.all_reduce(torch.ones(4, dtype=torch.int32, device=dev), rmacomm.ReduceOp.BAND)
        raise AssertionError("BAND on NCCL must fail")
    except rmacomm.UnavailableError as e:
        expect("NCCL" in str(e) and "all_reduce" in str(e), str(e))
    torch.cuda.synchronize()
    if arg == "bench":
        bench_all_reduce(comm, "nccl_all_reduce")
    comm.finalize()
    log(f"nccl_collectives ok ({n} rank(s))")


def captured(what: str, body: Callable[[], None]) -> Any:
    """`body` captured with torch.cuda.graph: the graph in IPC mode; None
    in transport mode, where the capture must be refused (the stream proxy
    is not capturable) before anything was queued."""
    import torch

    g = torch.cuda.CUDAGraph()
    refused = ""
    try:
        with torch.cuda.graph(g):
            body()
    except Exception as e:  # noqa: BLE001 - the error's text is what is checked
        refused = str(e)
    if os.environ.get("RMACOMM_GPU_TRANSPORT") == "1":
        expect("capturing a CUDA graph" in refused, f"native {what} under capture refused ({refused!r})")
        return None
    expect(refused == "", f"native {what} captured ({refused!r})")
    return g


def native_collectives(arg: str) -> None:
    """Collectives of CUDA tensors on an rdma communicator: the native
    backend (two processes on one GPU through CUDA IPC, the NVRTC kernels,
    stream-ordered signals). f32, bf16, i32 × counts 1, 1000, 1 Mi and 20 M
    (80 MB of f32: two chunks of the 64 MiB slots) × SUM, MAX, AVG,
    PREMUL_SUM(2), checked against torch; broadcast, reduce, all_gather_single,
    all_to_all_single, reduce_scatter_single, the list and _v forms, send/recv;
    then, with arg "bench", the
    bus bandwidth from 1 MiB to 256 MiB as JSON lines."""
    import torch

    comm = rmacomm.new_comm("rdma", timeout=120)
    r, n = comm.get_rank(), comm.get_size()
    torch.cuda.set_device(0)
    R = rmacomm.ReduceOp
    for dt in (torch.float32, torch.bfloat16, torch.int32):
        ops = [("SUM", R.SUM), ("MAX", R.MAX)]
        if dt.is_floating_point:
            ops += [("AVG", R.AVG), ("PREMUL_SUM", R.PREMUL_SUM(2.0))]
        for count in (1, 1000, 1 << 20, 20_000_000):
            base = torch.arange(count, device="cuda") % 13
            inputs = [(base + p + 1).to(torch.float64) for p in range(n)]
            for name, op in ops:
                x = (base + r + 1).to(dt)
                comm.all_reduce(x, op)
                stack = torch.stack(inputs)
                want = {
                    "SUM": stack.sum(0),
                    "MAX": stack.max(0).values,
                    "AVG": stack.sum(0) / n,
                    "PREMUL_SUM": (stack * 2).sum(0),
                }[name].to(dt)
                expect(torch.equal(x, want), f"native all_reduce {name} {dt} count {count}")
            comm.barrier()
    # The other collectives the native backend runs on CUDA tensors.
    for dt in (torch.float32, torch.int32):
        b = 300_000
        x = torch.full((b,), r + 5, dtype=dt, device="cuda")
        comm.broadcast(x, n - 1)
        expect(torch.equal(x, torch.full_like(x, n + 4)), f"native broadcast {dt}")
        inp = torch.arange(b, device="cuda").to(dt) + r
        out = torch.zeros(n * b, dtype=dt, device="cuda")
        comm.all_gather_single(out, inp)
        want = torch.cat([torch.arange(b, device="cuda").to(dt) + p for p in range(n)])
        expect(torch.equal(out, want), f"native all_gather_single {dt}")
        inp = torch.cat([torch.full((b,), 10 * r + j, dtype=dt, device="cuda") for j in range(n)])
        out = torch.zeros(n * b, dtype=dt, device="cuda")
        comm.all_to_all_single(out, inp)
        want = torch.cat([torch.full((b,), 10 * p + r, dtype=dt, device="cuda") for p in range(n)])
        expect(torch.equal(out, want), f"native all_to_all_single {dt}")
        x = torch.full((b,), r + 1, dtype=dt, device="cuda")
        comm.reduce(x, n - 1, R.SUM)
        want_r = n * (n + 1) // 2 if r == n - 1 else r + 1
        expect(torch.equal(x, torch.full_like(x, want_r)), f"native reduce {dt}")
        out = torch.zeros(b, dtype=dt, device="cuda")
        comm.reduce_scatter_single(out, inp, R.SUM)
        expect(torch.equal(out, torch.full_like(out, sum(10 * p + r for p in range(n)))), f"native reduce_scatter {dt}")
        comm.barrier()
    # The list and _v forms of CUDA tensors (composed of the single forms:
    # rmacomm._cuda_lists).
    outs = [torch.zeros(1000, device="cuda") for _ in range(n)]
    comm.all_gather(outs, torch.full((1000,), float(r), device="cuda"))
    expect(all(torch.equal(o, torch.full_like(o, float(k))) for k, o in enumerate(outs)), "native all_gather list")
    outs = [torch.zeros(k + 1, device="cuda") for k in range(n)]
    comm.all_gather_v(outs, torch.full((r + 1,), float(r), device="cuda"))
    expect(all(torch.equal(o, torch.full_like(o, float(k))) for k, o in enumerate(outs)), "native all_gather_v")
    out = torch.zeros(500, device="cuda")
    comm.reduce_scatter(out, [torch.full((500,), float(10 * r + j), device="cuda") for j in range(n)], R.SUM)
    expect(torch.equal(out, torch.full_like(out, float(sum(10 * p + r for p in range(n))))), "native reduce_scatter list")
    outs = [torch.zeros(300, device="cuda") for _ in range(n)]
    comm.all_to_all(outs, [torch.full((300,), float(10 * r + j), device="cuda") for j in range(n)])
    expect(all(torch.equal(o, torch.full_like(o, float(10 * k + r))) for k, o in enumerate(outs)), "native all_to_all list")
    outs = [torch.zeros(r + k + 1, device="cuda") for k in range(n)]
    comm.all_to_all(outs, [torch.full((r + j + 1,), float(10 * r + j), device="cuda") for j in range(n)])
    expect(all(torch.equal(o, torch.full_like(o, float(10 * k + r))) for k, o in enumerate(outs)), "native uneven all_to_all")
    gathered = [torch.zeros(200, device="cuda") for _ in range(n)] if r == 0 else None
    comm.gather(gathered, torch.full((200,), float(r), device="cuda"), 0)
    if gathered is not None:
        expect(all(torch.equal(o, torch.full_like(o, float(k))) for k, o in enumerate(gathered)), "native gather")
    out = torch.zeros(200, device="cuda")
    comm.scatter(out, [torch.full((200,), float(j + 7), device="cuda") for j in range(n)] if r == 0 else None, 0)
    expect(torch.equal(out, torch.full_like(out, float(r + 7))), "native scatter")
    comm.barrier()
    # send / recv of CUDA tensors (native: through the ranks' inboxes, in
    # chunks of 4 MiB; even ranks send first, odd ranks receive first).
    for count in (1, 1000, 3 << 20):
        x = torch.arange(count, device="cuda", dtype=torch.float32) + 100 * r
        y = torch.empty_like(x)
        send_recv_ring(comm, x, y)
        want = torch.arange(count, device="cuda", dtype=torch.float32) + 100 * ((r - 1) % n)
        expect(torch.equal(y, want), f"native send/recv of {count}")
        comm.barrier()
    if arg == "bench":
        bench_all_reduce(comm, "native_all_reduce")
    # (After the bench: from the first capture on, eager calls signal with
    # kernels too.)
    # CUDA graphs: in IPC mode an all_reduce captured with torch.cuda.graph
    # replays correctly (the signal kernels count on the device); in
    # transport mode (the stream proxy is not capturable) it is refused
    # before anything is queued, and the communicator goes on.
    x = torch.zeros(1000, device="cuda")
    g = captured("all_reduce", lambda: comm.all_reduce(x, R.SUM))
    for k in range(5 if g is not None else 0):
        x.fill_(float(r + 1 + k))
        g.replay()
        torch.cuda.synchronize()
        want = float(n * (n + 1) // 2 + n * k)
        expect(torch.equal(x, torch.full_like(x, want)), f"native all_reduce graph replay {k}")
    # send/recv in a graph (the pair communicators exist: made by the eager
    # send/recv above), a ring of one chunk.
    a = torch.zeros(1000, device="cuda")
    b = torch.zeros(1000, device="cuda")

    g2 = captured("send/recv", lambda: send_recv_ring(comm, a, b))
    for k in range(3 if g2 is not None else 0):
        a.fill_(float(100 * r + k))
        g2.replay()
        torch.cuda.synchronize()
        want = float(100 * ((r - 1) % n) + k)
        expect(torch.equal(b, torch.full_like(b, want)), f"native send/recv graph replay {k}")
    x = torch.full((1000,), float(r + 1), device="cuda")
    comm.all_reduce(x, R.SUM)
    expect(torch.equal(x, torch.full_like(x, float(n * (n + 1) // 2))), "native all_reduce after the capture")
    # The graphs go before the communicator whose memory they use.
    del g, g2
    torch.cuda.synchronize()
    comm.barrier()
    comm.finalize()
    log("native_collectives ok")


SCENARIOS: Dict[str, Callable[[str], None]] = {
    "native_collectives": native_collectives,
    "window_ring_cuda": window_ring_cuda,
    "window_ring_cuda_staged": window_ring_cuda_staged,
    "agent_cuda": agent_cuda,
    "nccl_collectives": nccl_collectives,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](sys.argv[2] if len(sys.argv) > 2 else "")
