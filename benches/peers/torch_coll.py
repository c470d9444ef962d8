"""torch.distributed (gloo, the CPU backend) collectives baseline for benches/compare.sh.

Timed as rdma_bench times rmacomm's (nccl-tests' method): per size, a barrier, the warm-up, a
barrier, ITERS calls back to back on every rank (time.perf_counter); the per-iteration time
averaged over the ranks (and the slowest rank's); then one call on a known pattern whose result
every rank checks element by element (the wrong count is summed over the ranks).

Sizes mean what they mean in rdma_bench and nccl-tests (all_gather's output, reduce_scatter's
input and all_to_all's buffers are SIZE bytes). f32, SUM. Iterations: about 256 MiB per size
(20 ..= 1000), warm-up a tenth (5 ..= 100).

Run under torchrun:
    python -m torch.distributed.run --nproc-per-node 2 torch_coll.py LABEL OP SIZE...
OP: all_reduce (all_reduce), all_gather (all_gather_into_tensor), reduce_scatter
(reduce_scatter_tensor), all_to_all (all_to_all_single), broadcast (from rank 0).
Prints one JSON line per size from rank 0 in rdma_bench's collective record form plus "peer".
Exit 1 if a check fails.
"""
import json
import sys
import time

import torch
import torch.distributed as dist


def bus_factor(op, n):
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def pattern(rank, start, count):
    k = torch.arange(start, start + count, dtype=torch.int64)
    return (1 + (k * 7 + rank * 3) % 5).to(torch.float32)


def main():
    label, op, sizes = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3:]]
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    blocked = op in ("all_gather", "reduce_scatter", "all_to_all")
    failed = False
    for size in sizes:
        unit = 4 * n if blocked else 4
        size = max(unit, size - size % unit)
        elems = size // 4
        block = elems // n if blocked else elems
        iters = min(max((256 << 20) // size, 20), 1000)
        warm = min(max(iters // 10, 5), 100)
        if op == "all_reduce":
            x, out = torch.zeros(elems), None
            call = lambda: dist.all_reduce(x)
        elif op == "all_gather":
            x, out = pattern(rank, 0, block), torch.zeros(elems)
            call = lambda: dist.all_gather_into_tensor(out, x)
        elif op == "reduce_scatter":
            x, out = pattern(rank, 0, elems), torch.zeros(block)
            call = lambda: dist.reduce_scatter_tensor(out, x)
        elif op == "all_to_all":
            x, out = pattern(rank, 0, elems), torch.zeros(elems)
            call = lambda: dist.all_to_all_single(out, x)
        elif op == "broadcast":
            x, out = pattern(rank, 0, elems), None
            call = lambda: dist.broadcast(x, 0)
        else:
            raise SystemExit("torch_coll: unknown operation %s" % op)
        dist.barrier()
        for _ in range(warm):
            call()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        per = (time.perf_counter() - t0) / iters
        ts = torch.tensor([per, per], dtype=torch.float64)
        dist.all_reduce(ts[0:1], op=dist.ReduceOp.SUM)
        dist.all_reduce(ts[1:2], op=dist.ReduceOp.MAX)
        t, slowest = ts[0].item() / n, ts[1].item()

        # The check (in place: copy_ keeps the tensors the lambdas hold).
        if op == "all_reduce":
            x.copy_(pattern(rank, 0, elems))
            want = sum(pattern(r, 0, elems) for r in range(n))
        elif op == "all_gather":
            x.copy_(pattern(rank, 0, block))
            want = torch.cat([pattern(r, 0, block) for r in range(n)])
        elif op == "reduce_scatter":
            x.copy_(pattern(rank, 0, elems))
            want = sum(pattern(r, rank * block, block) for r in range(n))
        elif op == "all_to_all":
            x.copy_(pattern(rank, 0, elems))
            want = torch.cat([pattern(r, rank * block, block) for r in range(n)])
        else:
            x.copy_(pattern(0, 0, elems) if rank == 0 else torch.full((elems,), -1.0))
            want = pattern(0, 0, elems)
        if out is not None:
            out.fill_(-7.0)
        call()
        got = x if out is None else out
        wrong = torch.tensor([int((got != want).sum().item())], dtype=torch.int64)
        dist.all_reduce(wrong)
        if rank == 0:
            algbw = size / t / 1e9
            print(json.dumps({
                "peer": label, "op": op, "bytes": size, "count": block, "type": "f32",
                "redop": "sum" if op in ("all_reduce", "reduce_scatter") else None,
                "root": 0 if op == "broadcast" else None, "ranks": n, "iterations": iters,
                "time_us": round(t * 1e6, 3), "time_max_us": round(slowest * 1e6, 3),
                "algbw_GBps": round(algbw, 4), "busbw_GBps": round(algbw * bus_factor(op, n), 4),
                "wrong": int(wrong.item())}), flush=True)
            if wrong.item():
                print("torch_coll: %s of %d B: %d wrong elements" % (op, size, wrong.item()), file=sys.stderr)
                failed = True
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
