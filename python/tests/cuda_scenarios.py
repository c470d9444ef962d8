"""Rank programs on CUDA tensors (issue 13), run under the launcher:
``python -m rmacomm.run --nproc-per-node N tests/cuda_scenarios.py NAME``.
They need only rmacomm and torch (no numpy, no pytest), so that the GPU
suite runs them as they are on a machine with a GPU and nothing else.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict

import rmacomm


def log(*a: Any) -> None:
    print(*a, flush=True)


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def window_ring_cuda(_: str) -> None:
    """The window ring on CUDA tensors (two or more processes on one GPU:
    CUDA IPC): f32, bf16 and i32 × counts 1, 1000 and 1 Mi; puts, signals
    and waits queued on torch's current stream (sync and async put), then on
    a side stream passed as stream=; map_remote_tensor of the right
    neighbour (IPC), get, bounds, a mismatch of CPU and CUDA registrations."""
    import torch

    comm = rmacomm.new_comm("rdma", timeout=60)
    r, n = comm.get_rank(), comm.get_size()
    right, left = (r + 1) % n, (r - 1) % n
    torch.cuda.set_device(0)
    side = torch.cuda.Stream()
    for dt in (torch.float32, torch.bfloat16, torch.int32):
        for count in (1, 1000, 1 << 20):
            buf = torch.zeros(n * count, dtype=dt, device="cuda")
            win = comm.new_window()
            win.tensor_register(buf)
            expect(win.get_device() == "cuda", "get_device of a CUDA window")
            expect(win.get_attr(right).access_type == rmacomm.WinAccessType.UNIFIED, "CUDA peers are UNIFIED")
            for it in range(4):
                v = r * 100 + it + 1
                src = torch.full((count,), v, dtype=dt, device="cuda")
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
                expect(torch.equal(buf[left * count:(left + 1) * count], want), f"ring {dt} count {count} it {it}")
                comm.barrier()
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



SCENARIOS: Dict[str, Callable[[str], None]] = {"window_ring_cuda": window_ring_cuda}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](sys.argv[2] if len(sys.argv) > 2 else "")
