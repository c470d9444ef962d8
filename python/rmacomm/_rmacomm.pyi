"""Type stubs of the extension module (hand-written; checked by
``python -m mypy.stubtest rmacomm`` in the test suite)."""

import builtins
from collections.abc import Awaitable, Generator, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, ClassVar, Optional, Union, final

from typing_extensions import Self

# A numpy.ndarray or a CPU torch._Tensor (contiguous). Results come back as
# the same kind as the tensors that went in.
_Tensor = Any
# A numpy dtype or scalar type, a torch dtype, or a name ("float32").
_DTypeLike = Any
# A datetime.timedelta or a number of seconds.
_Timeout = Union[timedelta, float, None]
_Hints = Optional[Mapping[str, str]]
# A torch.cuda.Stream or a raw CUstream handle; None: torch's current stream.
_Stream = Any

__version__: str

class CommError(Exception):
    """An rmacomm operation failed; subclasses say which kind of failure."""

class TimeoutError(CommError, builtins.TimeoutError):
    """An operation did not complete within its timeout."""

class ArgumentError(CommError, ValueError):
    """An argument was wrong on this rank; nothing was moved."""

class MismatchError(CommError):
    """Ranks called different operations, or with different arguments."""

class PeerError(CommError):
    """A peer's process exited or its connection broke."""

class UnavailableError(CommError):
    """A backend or feature this build or machine does not provide."""

@final
class ReduceOp:
    """A reduction op (torchcomms' ReduceOp)."""

    SUM: ClassVar[ReduceOp]
    PRODUCT: ClassVar[ReduceOp]
    MIN: ClassVar[ReduceOp]
    MAX: ClassVar[ReduceOp]
    BAND: ClassVar[ReduceOp]
    BOR: ClassVar[ReduceOp]
    BXOR: ClassVar[ReduceOp]
    AVG: ClassVar[ReduceOp]
    @staticmethod
    def PREMUL_SUM(factor: Any) -> ReduceOp:
        """Each input multiplied by ``factor`` before the sum."""
    @property
    def name(self) -> str: ...
    @property
    def factor(self) -> Optional[float]: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self, /) -> int: ...

@final
class WinAccessType:
    """How this rank reaches a peer's window memory."""

    UNIFIED: ClassVar[WinAccessType]
    SEPARATE: ClassVar[WinAccessType]
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self, /) -> int: ...
    def __int__(self) -> int: ...

@final
class WindowAttr:
    """What ``get_attr(peer_rank)`` returns."""

    @property
    def access_type(self) -> WinAccessType: ...

@final
class SignalOp:
    """What a ctran-form value signal does: SET or ADD."""

    SET: ClassVar[SignalOp]
    ADD: ClassVar[SignalOp]
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self, /) -> int: ...
    def __int__(self) -> int: ...

@final
class SignalCmpOp:
    """How a ctran-form wait compares its slot with the value."""

    EQ: ClassVar[SignalCmpOp]
    NE: ClassVar[SignalCmpOp]
    GE: ClassVar[SignalCmpOp]
    GT: ClassVar[SignalCmpOp]
    LE: ClassVar[SignalCmpOp]
    LT: ClassVar[SignalCmpOp]
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self, /) -> int: ...
    def __int__(self) -> int: ...

@final
class Work:
    """The handle of an operation (torchcomms' TorchWork)."""

    def is_completed(self) -> bool:
        """True once the operation has finished; never blocks."""
    def wait(self, timeout: _Timeout = None) -> None:
        """Blocks until done (GIL released, Ctrl-C interrupts); raises its error."""

@final
class BatchSendRecv:
    """Point-to-point operations issued together (``comm.batch_op_create()``)."""

    def send(self, tensor: _Tensor, dst: int) -> None: ...
    def recv(self, tensor: _Tensor, src: int) -> None: ...
    def issue(self, async_op: bool = False, hints: _Hints = None, timeout: _Timeout = None) -> Work: ...

@final
class Comm:
    """A communicator (torchcomms' TorchComm), made by ``new_comm``."""

    def get_rank(self) -> int: ...
    def get_size(self) -> int: ...
    def get_name(self) -> str: ...
    def get_backend(self) -> str: ...
    def get_device(self) -> str: ...
    def get_timeout(self) -> timedelta: ...
    def finalize(self) -> None: ...
    def split(
        self, ranks: Sequence[int], name: Optional[str] = None, hints: _Hints = None, timeout: _Timeout = None
    ) -> Optional[Comm]: ...
    def batch_op_create(self) -> BatchSendRecv: ...
    def new_window(self, tensor: Optional[_Tensor] = None, *, unified: bool = True) -> Window: ...
    def window_allocate(
        self, window_size: int, cpu_buf: bool = True, signal_size: int = 64, *, unified: bool = True
    ) -> CtranWindow: ...
    def empty(
        self,
        shape: Union[int, Sequence[int]],
        dtype: _DTypeLike = None,
        *,
        like: Optional[_Tensor] = None,
        device: Any = None,
    ) -> Any: ...
    def send(
        self, tensor: _Tensor, dst: int, async_op: bool = False, hints: _Hints = None, timeout: _Timeout = None
    ) -> Work: ...
    def recv(
        self, tensor: _Tensor, src: int, async_op: bool = False, hints: _Hints = None, timeout: _Timeout = None
    ) -> Work: ...
    def broadcast(
        self, tensor: _Tensor, root: int, async_op: bool = False, hints: _Hints = None, timeout: _Timeout = None
    ) -> Work: ...
    def all_reduce(
        self, tensor: _Tensor, op: ReduceOp, async_op: bool = False, hints: _Hints = None, timeout: _Timeout = None
    ) -> Work: ...
    def reduce(
        self,
        tensor: _Tensor,
        root: int,
        op: ReduceOp,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def all_gather(
        self,
        tensor_list: Sequence[_Tensor],
        tensor: _Tensor,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def all_gather_v(
        self,
        tensor_list: Sequence[_Tensor],
        tensor: _Tensor,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def all_gather_single(
        self, output: _Tensor, input: _Tensor, async_op: bool = False, hints: _Hints = None, timeout: _Timeout = None
    ) -> Work: ...
    def reduce_scatter(
        self,
        output: _Tensor,
        input_list: Sequence[_Tensor],
        op: ReduceOp,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def reduce_scatter_v(
        self,
        output: _Tensor,
        input_list: Sequence[_Tensor],
        op: ReduceOp,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def reduce_scatter_single(
        self,
        output: _Tensor,
        input: _Tensor,
        op: ReduceOp,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def all_to_all_single(
        self, output: _Tensor, input: _Tensor, async_op: bool = False, hints: _Hints = None, timeout: _Timeout = None
    ) -> Work: ...
    def all_to_all_v_single(
        self,
        output: _Tensor,
        input: _Tensor,
        output_split_sizes: Optional[Sequence[int]],
        input_split_sizes: Optional[Sequence[int]],
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def all_to_all(
        self,
        output_tensor_list: Sequence[_Tensor],
        input_tensor_list: Sequence[_Tensor],
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def barrier(self, async_op: bool = False, hints: _Hints = None, timeout: _Timeout = None) -> Work: ...
    def scatter(
        self,
        output_tensor: _Tensor,
        input_tensor_list: Optional[Sequence[_Tensor]],
        root: int,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def gather(
        self,
        output_tensor_list: Optional[Sequence[_Tensor]],
        input_tensor: _Tensor,
        root: int,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...

@final
class Window:
    """torchcomms' one-sided window (``comm.new_window()``)."""

    def tensor_register(self, tensor: _Tensor) -> None: ...
    def tensor_deregister(self) -> None: ...
    def put(
        self,
        tensor: _Tensor,
        dst_rank: int,
        target_offset_nelems: int,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
        stream: _Stream = None,
    ) -> Work: ...
    def signal(
        self,
        peer_rank: int,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
        stream: _Stream = None,
    ) -> Work: ...
    def wait_signal(
        self,
        peer_rank: int,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
        stream: _Stream = None,
    ) -> Work: ...
    def get(
        self,
        tensor: _Tensor,
        src_rank: int,
        source_offset_nelems: int,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
        stream: _Stream = None,
    ) -> Work: ...
    def map_remote_tensor(self, rank: int) -> Any: ...
    def get_attr(self, peer_rank: int) -> WindowAttr: ...
    def get_size(self) -> int: ...
    def get_device(self) -> str: ...
    def get_tensor(self) -> Optional[Any]: ...

@final
class CtranWindow:
    """The ctran form of the window (``comm.window_allocate(size)``)."""

    def put(
        self,
        tensor: _Tensor,
        dst_rank: int,
        target_disp: int,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def get(
        self,
        tensor: _Tensor,
        src_rank: int,
        source_disp: int,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def signal(
        self,
        signal_disp: int,
        signal_val: int,
        dst_rank: int,
        async_op: bool = False,
        op: SignalOp = ...,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def wait_signal(
        self,
        signal_disp: int,
        signal_val: int,
        cmp_op: SignalCmpOp = ...,
        async_op: bool = False,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> Work: ...
    def read_signal(self, signal_disp: int) -> int: ...
    def reset_signal(self, signal_disp: int, value: int = 0) -> None: ...
    def get_tensor(
        self, rank: int, sizes: Union[int, Sequence[int]], dtype: _DTypeLike = None, offset: int = 0
    ) -> Any: ...
    def get_attr(self, peer_rank: int) -> WindowAttr: ...
    def get_size(self) -> int: ...
    def get_device(self) -> str: ...

@final
class TcpStore:
    """A TCP key-value store, as torch's TCPStore."""

    def __new__(
        cls,
        host: str,
        port: int,
        world_size: Optional[int] = None,
        is_master: bool = False,
        timeout: _Timeout = None,
    ) -> Self: ...
    @property
    def port(self) -> int: ...
    def set(self, key: str, value: Union[bytes, str]) -> None: ...
    def get(self, key: str) -> bytes: ...
    def wait(self, keys: Sequence[str], timeout: _Timeout = None) -> None: ...
    def check(self, keys: Sequence[str]) -> bool: ...
    def add(self, key: str, amount: int) -> int: ...
    def multi_get(self, keys: Sequence[str]) -> list[bytes]: ...
    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes: ...
    def delete_key(self, key: str) -> bool: ...

@final
class RdmaRemoteBuffer:
    """A peer's registered memory (address, length, key); picklable."""

    def __new__(cls, addr: int, len: int, key: int) -> Self: ...
    @classmethod
    def parse(cls, s: str) -> RdmaRemoteBuffer: ...
    @property
    def addr(self) -> int: ...
    @property
    def len(self) -> int: ...
    @property
    def key(self) -> int: ...
    def slice(self, offset: int, length: int) -> RdmaRemoteBuffer: ...
    def __reduce__(self) -> tuple[type[RdmaRemoteBuffer], tuple[int, int, int]]: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self, /) -> int: ...

@final
class RdmaView:
    """A byte range of an RdmaMemory (``to_view``)."""

    @property
    def offset(self) -> int: ...
    def __len__(self, /) -> int: ...

@final
class RdmaMemory:
    """A tensor registered for RDMA (zero-copy)."""

    def __new__(cls, tensor: _Tensor) -> Self: ...
    def to_view(self, offset: int = 0, length: Optional[int] = None) -> RdmaView: ...
    def to_remote_buffer(self) -> RdmaRemoteBuffer: ...
    @property
    def tensor(self) -> Any: ...
    def __len__(self, /) -> int: ...

@final
class RdmaTransport:
    """An RDMA connection to one peer (torchcomms' RdmaTransport)."""

    def __new__(cls, timeout: _Timeout = None, busy_poll: _Timeout = None) -> Self: ...
    @staticmethod
    def supported() -> bool: ...
    def bind(self) -> str: ...
    def connect(self, url: str) -> None: ...
    def connect_async(self, url: str) -> Awaitable[None]: ...
    def write(self, view: RdmaView, remote: RdmaRemoteBuffer, notify: bool = False) -> None: ...
    def write_async(self, view: RdmaView, remote: RdmaRemoteBuffer, notify: bool = False) -> Awaitable[None]: ...
    def read(self, view: RdmaView, remote: RdmaRemoteBuffer) -> None: ...
    def read_async(self, view: RdmaView, remote: RdmaRemoteBuffer) -> Awaitable[None]: ...
    def wait_for_write(self, timeout: _Timeout = None) -> None: ...
    def wait_for_write_async(self, timeout: _Timeout = None) -> Awaitable[None]: ...
    def connected(self) -> bool: ...

@final
class _MemoryHolder:
    @property
    def __array_interface__(self) -> dict[str, Any]: ...

# A piece of a TransferAgent request: (local, (region, offset, length)),
# local being an array / tensor in registered memory or (address, length).
_Piece = tuple[Union[_Tensor, tuple[int, int]], tuple[int, int, int]]

@final
class AgentTransfer:
    """One request of a TransferAgent; runs on its own ("PROC", "DONE", "ERR")."""

    def status(self) -> str: ...
    def done(self) -> bool: ...
    def error(self) -> Optional[BaseException]: ...
    def wait(self, timeout: _Timeout = None) -> None: ...
    def __await__(self) -> Generator[Any, None, None]: ...
    @property
    def peer(self) -> str: ...
    @property
    def op(self) -> str: ...
    @property
    def ops(self) -> int: ...

@final
class TransferAgent:
    """A transfer agent: one per process, many peers, memory registered once."""

    def __new__(
        cls,
        name: str,
        *,
        qps: Optional[int] = None,
        timeout: _Timeout = None,
        connect_timeout: _Timeout = None,
        notification_slots: Optional[int] = None,
        listen_addr: Optional[str] = None,
        frag_size: Optional[int] = None,
        max_in_flight: Optional[int] = None,
        busy_poll: _Timeout = None,
    ) -> Self: ...
    @property
    def name(self) -> str: ...
    def metadata(self) -> str: ...
    def register(self, memory: Union[_Tensor, RdmaMemory]) -> int: ...
    def register_address(self, addr: int, length: int, device: Optional[int] = None) -> int: ...
    def deregister(self, region: Any) -> bool: ...
    def regions(self) -> list[tuple[int, int, int]]: ...
    def add_peer(self, metadata: Union[str, bytes]) -> str: ...
    def remove_peer(self, name: Union[str, bytes]) -> bool: ...
    def peers(self) -> list[str]: ...
    def peer_regions(self, name: Union[str, bytes]) -> list[tuple[int, int, int]]: ...
    def is_connected(self, name: Union[str, bytes]) -> bool: ...
    def connect(self, name: Union[str, bytes]) -> None: ...
    def transfer(
        self, op: str, peer: Union[str, bytes], pieces: Iterable[_Piece], notify: Optional[bytes] = None
    ) -> AgentTransfer: ...
    def notify(self, peer: Union[str, bytes], message: bytes) -> AgentTransfer: ...
    def get_notifications(self) -> list[tuple[str, bytes]]: ...
    def wait_notification(self, timeout: _Timeout = None) -> tuple[str, bytes]: ...
    def wait_notification_async(self) -> Awaitable[tuple[str, bytes]]: ...
    def pending_notifications(self) -> int: ...
    def stats(self) -> dict[str, int]: ...

def empty(
    shape: Union[int, Sequence[int]], dtype: _DTypeLike = None, *, like: Optional[_Tensor] = None, device: Any = None
) -> Any:
    """A zero-filled array or tensor in shared memory (device="cuda[:N]": a CUDA torch tensor)."""

def new_comm(
    backend: str = "rdma",
    device: Any = None,
    *,
    store: Any = None,
    name: Optional[str] = None,
    timeout: _Timeout = None,
    hints: _Hints = None,
    abort_process_on_timeout_or_error: Optional[bool] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> Comm:
    """Creates a communicator (collective), torchcomms' new_comm."""
