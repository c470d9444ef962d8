"""rmacomm: torchcomms' communicator, one-sided windows and RDMA transport.

CPU numpy arrays and torch tensors move zero-copy between the ranks of a
job, over rmacomm's soft provider (shared memory between processes of one
host, TCP between hosts) or RDMA verbs.

Quick start (run with ``python -m rmacomm.run --nproc-per-node 2 prog.py``)::

    import numpy as np
    import rmacomm

    comm = rmacomm.new_comm("rdma")           # rank, size from the launcher
    x = np.full(1024, comm.get_rank(), np.float32)
    comm.all_reduce(x, rmacomm.ReduceOp.SUM)  # x == 0 + 1 on both ranks

    win = comm.new_window()
    buf = comm.empty(2 * 1024, np.float32)    # shared memory: peers map it
    win.tensor_register(buf)
    right = (comm.get_rank() + 1) % comm.get_size()
    win.put(x, right, comm.get_rank() * 1024)
    win.signal(right)
    win.wait_signal((comm.get_rank() - 1) % comm.get_size())
    win.tensor_deregister()
    comm.finalize()

Contents:

- ``new_comm(backend, device, *, store, name, timeout, hints, ...)`` ->
  ``Comm``: every collective (``send``, ``recv``, ``broadcast``,
  ``all_reduce``, ``reduce``, ``all_gather[_single|_v]``,
  ``reduce_scatter[_single|_v]``, ``all_to_all[_single|_v_single]``,
  ``scatter``, ``gather``, ``barrier``), ``split``, ``batch_op_create``,
  each returning a ``Work`` (``is_completed()``, ``wait()``).
- ``ReduceOp``: ``SUM``, ``PRODUCT``, ``MIN``, ``MAX``, ``BAND``, ``BOR``,
  ``BXOR``, ``AVG``, ``PREMUL_SUM(factor)``.
- Windows: ``comm.new_window()`` -> ``Window`` (torchcomms' form:
  ``tensor_register``, ``put``, ``signal``, ``wait_signal``, ``get``,
  ``map_remote_tensor``, ``get_attr``), ``comm.window_allocate(size)`` ->
  ``CtranWindow`` (ctran's form: value signals ``SignalOp`` and
  comparisons ``SignalCmpOp``, ``get_tensor``).
- ``empty(shape, dtype, like=None)``: shared memory to register in windows.
- Transport: ``RdmaTransport``, ``RdmaMemory``, ``RdmaView``,
  ``RdmaRemoteBuffer`` (picklable); blocking and ``*_async`` methods.
- Transfer agent (KV-cache style: one agent per process, many peers):
  ``TransferAgent`` (``register``, ``metadata``/``add_peer``,
  ``transfer("WRITE"|"READ", peer, pieces, notify)`` -> ``AgentTransfer``,
  ``get_notifications``, ``wait_notification``), and ``rmacomm.nixl``, a
  NIXL-compatible facade over it (``nixl_agent``).
- Stores: ``TcpStore``, or any object with ``set``/``get``/``wait``.
- Errors: ``CommError`` and its subclasses ``TimeoutError`` (also
  ``builtins.TimeoutError``), ``ArgumentError`` (also ``ValueError``),
  ``MismatchError``, ``PeerError``, ``UnavailableError``.
- ``python -m rmacomm.run --nproc-per-node N prog.py`` (or ``rmacomm-run``):
  a one-host launcher with torchrun's variables.

CUDA (loaded at run time; docs/gpu.md): windows take CUDA torch tensors
(same-host peers through CUDA IPC, others through the transport;
``stream=`` orders operations either way); an ``rdma`` communicator runs
the collectives and send/recv of CUDA tensors natively (across hosts
too); ``new_comm("nccl")`` adds an NCCL communicator for CUDA tensors; the
transfer agent and ``rmacomm.nixl`` take CUDA memory ("VRAM").

The full reference is docs/python.md in the repository.
"""

import glob as _glob
import os as _os
import sys as _sys


def _wheel_lib_dirs() -> str:
    """The PyPI wheels' library directories (site-packages/nvidia/*/lib) of
    this interpreter's path: where torch's CUDA wheels put NCCL and NVRTC,
    for rmacomm's run-time loader."""
    dirs = []
    for p in _sys.path:
        if p and _os.path.isdir(_os.path.join(p, "nvidia")):
            dirs.extend(sorted(_glob.glob(_os.path.join(p, "nvidia", "*", "lib"))))
    return ":".join(dirs)


if "RMACOMM_CUDA_LIB_DIRS" not in _os.environ:
    _dirs = _wheel_lib_dirs()
    if _dirs:
        _os.environ["RMACOMM_CUDA_LIB_DIRS"] = _dirs

from ._rmacomm import (
    AgentTransfer,
    ArgumentError,
    BatchSendRecv,
    Comm,
    CommError,
    CtranWindow,
    MismatchError,
    PeerError,
    RdmaMemory,
    RdmaRemoteBuffer,
    RdmaTransport,
    RdmaView,
    ReduceOp,
    SignalCmpOp,
    SignalOp,
    TcpStore,
    TimeoutError,
    TransferAgent,
    UnavailableError,
    WinAccessType,
    Window,
    WindowAttr,
    Work,
    __version__,
    empty,
    new_comm,
)

__all__ = [
    "AgentTransfer",
    "ArgumentError",
    "BatchSendRecv",
    "Comm",
    "CommError",
    "CtranWindow",
    "MismatchError",
    "PeerError",
    "RdmaMemory",
    "RdmaRemoteBuffer",
    "RdmaTransport",
    "RdmaView",
    "ReduceOp",
    "SignalCmpOp",
    "SignalOp",
    "TcpStore",
    "TimeoutError",
    "TransferAgent",
    "UnavailableError",
    "WinAccessType",
    "Window",
    "WindowAttr",
    "Work",
    "__version__",
    "empty",
    "new_comm",
]
