"""The list and ``_v`` forms of the collectives on CUDA tensors for an
``rdma`` communicator, composed of the native single forms.

Each call stages through one contiguous tensor on the tensors' device —
``torch.cat`` of the inputs (each padded to the largest block for the
``_v`` forms), one native single-form collective, then a copy of each block
into its output — all queued on torch's current stream, as the native
collectives are. Every rank gives the same list shapes (as torch requires),
so the padded block size agrees everywhere. Extra memory: one staging
tensor of the collective's whole size (n blocks).

The functions take any tensors the single forms take (so the tests run
them on CPU tensors too); the communicator calls them for CUDA tensors.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ._rmacomm import ArgumentError


def _flat(t: Any) -> Any:
    return t.reshape(-1).contiguous()


def _padded(t: Any, m: int) -> Any:
    """`t` flattened and padded with zeros to `m` elements."""
    import torch

    f = _flat(t)
    return f if f.numel() == m else torch.cat([f, f.new_zeros(m - f.numel())])


def _check(op: str, ts: Sequence[Any], n: int, what: str, dtype: Any, device: Any) -> None:
    if len(ts) != n:
        raise ArgumentError(f"{op}: {what} has {len(ts)} tensors; the communicator has {n} ranks")
    for k, t in enumerate(ts):
        if t.dtype != dtype or t.device != device:
            raise ArgumentError(
                f"{op}: {what}[{k}] is {t.dtype} on {t.device}; every tensor must be {dtype} on {device}"
            )


def _sizes(op: str, ts: Sequence[Any], mine: int, rank: int, v: bool, what: str) -> tuple[list[int], int]:
    """Each tensor's element count and the block size: all equal to `mine`
    (the plain form), or any, rank's own equal to `mine` (`_v`)."""
    sizes = [int(t.numel()) for t in ts]
    if v:
        if sizes[rank] != mine:
            raise ArgumentError(f"{op}: {what}[{rank}] has {sizes[rank]} elements, this rank's tensor {mine}")
        return sizes, max(sizes)
    for k, s in enumerate(sizes):
        if s != mine:
            raise ArgumentError(
                f"{op}: {what}[{k}] has {s} elements, the tensor {mine}; uneven sizes need the _v form"
            )
    return sizes, mine


def all_gather(comm: Any, tensor_list: Sequence[Any], tensor: Any, v: bool) -> None:
    """all_gather / all_gather_v: every rank's `tensor` into `tensor_list`."""
    op = "all_gather_v" if v else "all_gather"
    n, r = comm.get_size(), comm.get_rank()
    _check(op, tensor_list, n, "tensor_list", tensor.dtype, tensor.device)
    sizes, m = _sizes(op, tensor_list, int(tensor.numel()), r, v, "tensor_list")
    out = tensor.new_empty(n * m)
    comm.all_gather_single(out, _padded(tensor, m))
    for k, t in enumerate(tensor_list):
        t.copy_(out[k * m : k * m + sizes[k]].view(t.shape))


def reduce_scatter(comm: Any, output: Any, input_list: Sequence[Any], op: Any, v: bool) -> None:
    """reduce_scatter / reduce_scatter_v: `input_list[j]` of every rank,
    reduced with `op`, into rank j's `output`."""
    name = "reduce_scatter_v" if v else "reduce_scatter"
    n, r = comm.get_size(), comm.get_rank()
    _check(name, input_list, n, "input_list", output.dtype, output.device)
    _, m = _sizes(name, input_list, int(output.numel()), r, v, "input_list")
    import torch

    inp = torch.cat([_padded(t, m) for t in input_list])
    out = output.new_empty(m)
    comm.reduce_scatter_single(out, inp, op)
    output.copy_(out[: output.numel()].view(output.shape))


def all_to_all(comm: Any, output_list: Sequence[Any], input_list: Sequence[Any]) -> None:
    """all_to_all of lists: `input_list[j]` to rank j, rank i's into
    `output_list[i]`. Blocks of uneven sizes are padded to the largest
    block of any rank (agreed with one small all_reduce MAX of host
    memory), then moved by one all_to_all_single."""
    n = comm.get_size()
    if not input_list:
        raise ArgumentError("all_to_all: input_tensor_list is empty")
    first = input_list[0]
    _check("all_to_all", input_list, n, "input_tensor_list", first.dtype, first.device)
    _check("all_to_all", output_list, n, "output_tensor_list", first.dtype, first.device)
    import torch

    ins = [int(t.numel()) for t in input_list]
    outs = [int(t.numel()) for t in output_list]
    # Every rank agrees on the padded size, whatever its own sizes (a rank
    # whose sizes were all equal skipped this collective while its peers
    # ran it: the ranks then called different collectives).
    from ._rmacomm import ReduceOp

    mx = torch.tensor([max(ins + outs)], dtype=torch.int64)
    comm.all_reduce(mx, ReduceOp.MAX)
    m = int(mx.item())
    out = first.new_empty(n * m)
    comm.all_to_all_single(out, torch.cat([_padded(t, m) for t in input_list]))
    for k, t in enumerate(output_list):
        t.copy_(out[k * m : k * m + outs[k]].view(t.shape))


def gather(comm: Any, output_list: Optional[Sequence[Any]], tensor: Any, root: int) -> None:
    """gather: every rank's `tensor` into `root`'s `output_list` (an
    all_gather into a staging tensor; the root copies it out)."""
    n, r = comm.get_size(), comm.get_rank()
    m = int(tensor.numel())
    out = tensor.new_empty(n * m)
    comm.all_gather_single(out, _flat(tensor))
    if r != root:
        return
    if output_list is None:
        raise ArgumentError(f"gather: the root (rank {root}) needs output_tensor_list")
    _check("gather", output_list, n, "output_tensor_list", tensor.dtype, tensor.device)
    _sizes("gather", output_list, m, r, False, "output_tensor_list")
    for k, t in enumerate(output_list):
        t.copy_(out[k * m : (k + 1) * m].view(t.shape))


def scatter(comm: Any, output: Any, input_list: Optional[Sequence[Any]], root: int) -> None:
    """scatter: `root`'s `input_list[j]` into rank j's `output` (the root's
    blocks broadcast in one staging tensor; each rank copies its own)."""
    n, r = comm.get_size(), comm.get_rank()
    m = int(output.numel())
    if r == root:
        if input_list is None:
            raise ArgumentError(f"scatter: the root (rank {root}) needs input_tensor_list")
        _check("scatter", input_list, n, "input_tensor_list", output.dtype, output.device)
        _sizes("scatter", input_list, m, r, False, "input_tensor_list")
        import torch

        buf = torch.cat([_flat(t) for t in input_list])
    else:
        buf = output.new_empty(n * m)
    comm.broadcast(buf, root)
    output.copy_(buf[r * m : (r + 1) * m].view(output.shape))
