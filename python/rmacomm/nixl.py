"""A NIXL-compatible facade over ``rmacomm.TransferAgent``, for host and GPU memory.

The calls KV-cache connectors make of NIXL's Python API (``nixl._api``:
vLLM's NixlConnector, Dynamo) with NIXL's argument shapes and return
values, so that such code runs unchanged with ``from rmacomm.nixl import
nixl_agent, nixl_agent_config``::

    agent = nixl_agent("decode", nixl_agent_config(backends=["UCX"]))
    reg = agent.register_memory([(addr, size, 0, "")], "DRAM")   # or tensors
    meta = agent.get_agent_metadata()                 # bytes, to the peer
    ...
    peer = agent.add_remote_agent(peer_meta)          # bytes name
    local = agent.get_xfer_descs([(addr, 4096, 0)], "DRAM")
    remote = agent.get_xfer_descs([(peer_addr, 4096, 0)], "DRAM")
    h = agent.initialize_xfer("WRITE", local, remote, peer, b"req-1")
    state = agent.transfer(h)
    while state == "PROC":
        state = agent.check_xfer_state(h)             # "DONE" or "ERR"
    agent.release_xfer_handle(h)

Descriptors name memory by absolute address, as NIXL's do: local ones
must lie in memory this agent registered, remote ones in regions the peer
published (its metadata lists each region's address and length); a
request becomes one ``TransferAgent.transfer`` of (local, (region, offset,
length)) pieces with the notification. Backends are accepted and ignored
(everything goes through rmacomm's transport). Host memory ("DRAM", "cpu")
and CUDA device memory ("VRAM", "cuda": torch CUDA tensors, or descriptors
``(addr, len, devId)`` naming device memory of GPU ``devId``) are
supported; a GPU block moves device to device through CUDA IPC with a peer
on this host and staged through pinned host memory with one on another
(soft provider), and a transfer does not wait for torch's streams
(synchronize first, as NIXL's users do). What is not covered is listed in
docs/python.md.
"""

from __future__ import annotations

import bisect
import itertools
import pickle
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

from ._rmacomm import AgentTransfer, ArgumentError, TransferAgent, UnavailableError

__all__ = [
    "DEFAULT_COMM_PORT",
    "NIXL_INIT_AGENT",
    "nixlRegDList",
    "nixlXferDList",
    "nixl_agent",
    "nixl_agent_config",
]

NIXL_INIT_AGENT = "NIXL_INIT_AGENT"
"""The agent name ``prep_xfer_dlist`` takes for the local side."""

DEFAULT_COMM_PORT = 8888
"""NIXL's default metadata port (metadata exchange by listener is not supported)."""

_HOST = ("DRAM", "cpu")
_DEVICE = ("VRAM", "cuda")
_NIXL_MEM_TYPES = ("DRAM", "VRAM", "FILE", "BLOCK", "OBJ", "cpu", "cuda")
_OPS = ("WRITE", "READ")

# nixl's opaque handle types
nixl_xfer_handle = int
nixl_prepped_dlist_handle = int


def _name(agent: Union[str, bytes]) -> str:
    return agent.decode() if isinstance(agent, (bytes, bytearray)) else str(agent)


def _message(msg: Union[bytes, str, None]) -> Optional[bytes]:
    if msg is None:
        return None
    b = msg.encode() if isinstance(msg, str) else bytes(msg)
    return b or None


def _check_mem_type(mem_type: str) -> None:
    if mem_type in _HOST or mem_type in _DEVICE:
        return
    if mem_type in _NIXL_MEM_TYPES:
        raise UnavailableError(
            f"memory type {mem_type!r}: rmacomm.nixl moves host (\"DRAM\") and GPU (\"VRAM\") memory; file, "
            "block and object memory are not supported"
        )
    raise ValueError(f"unknown memory type {mem_type!r}; NIXL's are {', '.join(_NIXL_MEM_TYPES)}")


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _is_numpy(obj: Any) -> bool:
    return type(obj).__module__ == "numpy" and hasattr(obj, "__array_interface__")


def _memory_desc(obj: Any) -> tuple[tuple[int, int, int], str]:
    """(addr, len, devId) and the memory type of an array or tensor, which
    must be contiguous (as NIXL's): one descriptor covers one range, and a
    strided view's range holds other elements than the view's."""
    contiguous = obj.is_contiguous() if _is_torch(obj) else (obj.flags.c_contiguous if _is_numpy(obj) else True)
    if not contiguous:
        raise ArgumentError(
            f"a non-contiguous {type(obj).__name__} of shape {tuple(obj.shape)} is not one range of memory: "
            "give a list of contiguous tensors or arrays (or .contiguous() / np.ascontiguousarray copies)"
        )
    if _is_torch(obj):
        dev = str(obj.device)
        mem = "cuda" if dev.startswith("cuda") else "cpu"
        gpu = obj.get_device()
        return (int(obj.data_ptr()), int(obj.numel() * obj.element_size()), 0 if gpu < 0 else int(gpu)), mem
    if _is_numpy(obj):
        return (int(obj.__array_interface__["data"][0]), int(obj.nbytes), 0), "DRAM"
    raise TypeError(f"not a tensor or numpy array: {type(obj).__name__}")


def _is_desc_array(obj: Any, width: int) -> bool:
    """A numpy array of descriptors, shape (N, width), of integers (NIXL
    takes (N, 3) arrays for transfer descriptors)."""
    return _is_numpy(obj) and obj.ndim == 2 and obj.shape[1] == width and obj.dtype.kind in "iu"


def _desc(d: Sequence[Any], width: int) -> tuple[Any, ...]:
    """A descriptor's address, length and device id as ints, refused when
    one is negative (NIXL's are unsigned)."""
    a, n, dev = (int(d[0]), int(d[1]), int(d[2]))
    if a < 0 or n < 0 or dev < 0:
        raise ArgumentError(f"descriptor (addr={a:#x}, len={n}, devId={dev}): none may be negative")
    return (a, n, dev, str(d[3]) if len(d) > 3 else "") if width == 4 else (a, n, dev)


class _DList:
    """What both descriptor lists offer: a memory type and a list of tuples."""

    mem_type: str
    descs: list[Any]

    def getType(self) -> str:
        """The memory type."""
        return self.mem_type

    def descCount(self) -> int:
        """How many descriptors."""
        return len(self.descs)

    def isEmpty(self) -> bool:
        """Whether there are none."""
        return not self.descs

    def __len__(self) -> int:
        return len(self.descs)

    def __iter__(self) -> Any:
        return iter(self.descs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mem_type!r}, {len(self.descs)} descriptors)"


class nixlXferDList(_DList):
    """A transfer descriptor list: a memory type and (addr, len, devId) tuples."""

    def __init__(self, mem_type: str, descs: Iterable[tuple[int, int, int]] = (), is_sorted: bool = False) -> None:
        self.mem_type = mem_type
        self.descs: list[tuple[int, int, int]] = [_desc(d, 3) for d in descs]
        self.is_sorted = is_sorted

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        return self.descs[i]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, nixlXferDList) and (self.mem_type, self.descs) == (other.mem_type, other.descs)


class nixlRegDList(_DList):
    """A registration descriptor list: a memory type and (addr, len, devId,
    meta) tuples, with the arrays or tensors they came from (registered
    zero-copy and kept alive while registered)."""

    def __init__(
        self,
        mem_type: str,
        descs: Iterable[Sequence[Any]] = (),
        is_sorted: bool = False,
        objects: Optional[list[Any]] = None,
    ) -> None:
        self.mem_type = mem_type
        self.descs: list[tuple[int, int, int, str]] = [_desc(d, 4) for d in descs]
        self.is_sorted = is_sorted
        self.objects = objects

    def trim(self) -> nixlXferDList:
        """The transfer descriptors of the same memory."""
        return nixlXferDList(self.mem_type, [(a, n, d) for a, n, d, _ in self.descs], self.is_sorted)

    def __getitem__(self, i: int) -> tuple[int, int, int, str]:
        return self.descs[i]

    def __getstate__(self) -> dict[str, Any]:
        # The arrays stay in this process.
        return {"mem_type": self.mem_type, "descs": self.descs, "is_sorted": self.is_sorted, "objects": None}


class nixl_agent_config:
    """NIXL's agent configuration. Backends are accepted and ignored (all go
    through rmacomm); keyword arguments NIXL does not have are passed to
    ``rmacomm.TransferAgent`` (``timeout``, ``qps``, ``connect_timeout``,
    ``notification_slots``, ``listen_addr``, ...)."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = 0,
        backends: Optional[list[str]] = None,
        num_threads: int = 0,
        **rmacomm_options: Any,
    ) -> None:
        self.backends = list(backends) if backends is not None else ["UCX"]
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.num_threads = num_threads
        self.rmacomm_options = rmacomm_options


class _Spans:
    """Regions (address, length, id) sorted by address, to find the one
    holding a range: the nearest start below it, else (nested or
    overlapping regions) any."""

    def __init__(self, regions: Iterable[tuple[int, int, int]]) -> None:
        self.regions = sorted(regions)
        self.starts = [a for a, _, _ in self.regions]

    def find(self, addr: int, length: int) -> Optional[tuple[int, int]]:
        """(region start, region id) of a region holding addr..addr+length."""
        k = bisect.bisect_right(self.starts, addr) - 1
        if k >= 0:
            a, n, rid = self.regions[k]
            if addr + length <= a + n:
                return a, rid
        for a, n, rid in self.regions[:k]:
            if a <= addr and addr + length <= a + n:
                return a, rid
        return None


class _Prepped:
    """A prepared descriptor list: local (address, length) pairs, or a
    peer's (region, offset, length) blocks."""

    def __init__(self, peer: Optional[str], entries: list[Any], lengths: list[int]) -> None:
        self.peer = peer
        self.entries = entries
        self.lengths = lengths


class _Xfer:
    """A transfer request: what ``transfer`` posts, and its last posting."""

    def __init__(self, op: str, peer: str, pieces: list[Any], notif: Optional[bytes]) -> None:
        self.op = op
        self.peer = peer
        self.pieces = pieces
        self.notif = notif
        self.running: Optional[AgentTransfer] = None


class nixl_agent:
    """NIXL's ``nixl_agent`` for host memory, on ``rmacomm.TransferAgent``.

    Args:
        agent_name: unique among the agents that talk to each other.
        nixl_conf: a ``nixl_agent_config`` (backends are ignored).
        instantiate_all: accepted and ignored.
    """

    def __init__(
        self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all: bool = False
    ) -> None:
        conf = nixl_conf or nixl_agent_config()
        self.name = agent_name
        self.agent = TransferAgent(agent_name, **conf.rmacomm_options)
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, int] = {}
        self.plugin_list = ["UCX"] + [b for b in conf.backends if b != "UCX"]
        for b in conf.backends:
            self.create_backend(b)
        self._registered: dict[tuple[int, int], list[int]] = {}
        # How many registrations of this facade hold each agent region: the
        # agent answers the same object registered again with its region.
        self._region_refs: dict[int, int] = {}
        self._dlists: dict[int, _Prepped] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._handles = itertools.count(1)

    # Backends: one, rmacomm's, whatever the name.

    def get_plugin_list(self) -> list[str]:
        """The backend names this agent accepts (all served by rmacomm)."""
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        """["DRAM", "VRAM"]: host and CUDA device memory."""
        return ["DRAM", "VRAM"]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        """{}: rmacomm's options go in nixl_agent_config's keyword arguments."""
        return {}

    def get_backend_mem_types(self, backend: str) -> list[str]:
        """["DRAM", "VRAM"]: host and CUDA device memory."""
        return ["DRAM", "VRAM"]

    def get_backend_params(self, backend: str) -> dict[str, str]:
        """{}."""
        return {}

    def create_backend(self, backend: str, initParams: Optional[dict[str, str]] = None) -> None:
        """Records the backend name (every backend is rmacomm's transport)."""
        if backend not in self.backends:
            self.backends[backend] = len(self.backends) + 1
        if backend not in self.plugin_list:
            self.plugin_list.append(backend)

    # Descriptors.

    def get_xfer_descs(
        self, descs: Any, mem_type: Optional[str] = None, is_sorted: bool = False
    ) -> nixlXferDList:
        """A transfer descriptor list from a list of (addr, len, devId)
        tuples (with ``mem_type``), an (N, 3) integer numpy array of them,
        a tensor or numpy array, or a list of tensors / arrays."""
        if isinstance(descs, nixlXferDList):
            return descs
        if isinstance(descs, nixlRegDList):
            raise TypeError("get_xfer_descs: a nixlRegDList was given; use its trim() or get_xfer_descs of tuples")
        if _is_desc_array(descs, 3):
            if mem_type is None:
                raise ValueError("get_xfer_descs: give mem_type with an array of descriptors")
            return nixlXferDList(mem_type, (tuple(row) for row in descs.tolist()), is_sorted)
        if _is_torch(descs) or _is_numpy(descs):
            d, m = _memory_desc(descs)
            return nixlXferDList(m, [d], is_sorted)
        items = list(descs)
        if not items:
            return nixlXferDList(mem_type or "DRAM", [], is_sorted)
        if isinstance(items[0], (tuple, list)):
            if mem_type is None:
                raise ValueError("get_xfer_descs: give mem_type with a list of (addr, len, devId) tuples")
            if any(len(t) != 3 for t in items):
                raise ValueError("get_xfer_descs: every descriptor must be a 3-tuple (addr, len, devId)")
            return nixlXferDList(mem_type, items, is_sorted)
        found = [_memory_desc(t) for t in items]
        types = {m for _, m in found}
        if len(types) != 1:
            raise ValueError(f"get_xfer_descs: tensors on different devices ({sorted(types)})")
        return nixlXferDList(types.pop(), [d for d, _ in found], is_sorted)

    def get_reg_descs(
        self, descs: Any, mem_type: Optional[str] = None, is_sorted: bool = False
    ) -> nixlRegDList:
        """A registration descriptor list from a list of (addr, len, devId,
        meta) tuples (with ``mem_type``), a tensor or numpy array, or a list
        of tensors / arrays (registered zero-copy and kept alive)."""
        if isinstance(descs, nixlRegDList):
            return descs
        if isinstance(descs, nixlXferDList):
            raise TypeError("get_reg_descs: a nixlXferDList was given; registration takes a nixlRegDList")
        # An (N, 3) or (N, 4) integer array is descriptors (NIXL's form,
        # with a mem_type); `[array]` registers such an array itself.
        if _is_desc_array(descs, 4) or _is_desc_array(descs, 3):
            if mem_type is None:
                raise ValueError(
                    "get_reg_descs: give mem_type with an array of descriptors (or [array] to register the "
                    "array itself)"
                )
            return nixlRegDList(mem_type, descs.tolist(), is_sorted)
        if _is_torch(descs) or _is_numpy(descs):
            d, m = _memory_desc(descs)
            return nixlRegDList(m, [(*d, "")], is_sorted, [descs])
        items = list(descs)
        if not items:
            return nixlRegDList(mem_type or "DRAM", [], is_sorted)
        if isinstance(items[0], (tuple, list)):
            if mem_type is None:
                raise ValueError("get_reg_descs: give mem_type with a list of (addr, len, devId, meta) tuples")
            if any(len(t) not in (3, 4) for t in items):
                raise ValueError("get_reg_descs: every descriptor must be a 4-tuple (addr, len, devId, meta)")
            return nixlRegDList(mem_type, items, is_sorted)
        found = [_memory_desc(t) for t in items]
        types = {m for _, m in found}
        if len(types) != 1:
            raise ValueError(f"get_reg_descs: tensors on different devices ({sorted(types)})")
        return nixlRegDList(types.pop(), [(*d, "") for d, _ in found], is_sorted, items)

    def get_serialized_descs(self, descs: Any) -> bytes:
        """Pickles a descriptor list."""
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        """Unpickles a descriptor list."""
        return pickle.loads(serialized_descs)

    # Registration.

    def register_memory(
        self,
        reg_list: Any,
        mem_type: Optional[str] = None,
        is_sorted: bool = False,
        backends: Optional[list[str]] = None,
    ) -> nixlRegDList:
        """Registers memory (what ``get_reg_descs`` takes) and returns its
        nixlRegDList. Arrays and tensors (CUDA ones too) are registered
        zero-copy and kept alive; memory given by address must stay
        allocated until ``deregister_memory`` (as with NIXL). "VRAM"
        descriptors name CUDA device memory of GPU ``devId`` (checked with
        the driver: device memory of that GPU, inside one allocation)."""
        descs = self.get_reg_descs(reg_list, mem_type, is_sorted)
        _check_mem_type(descs.mem_type)
        done: list[tuple[tuple[int, int], int]] = []
        try:
            for i, (addr, length, dev, _meta) in enumerate(descs.descs):
                if descs.objects is not None:
                    region = self.agent.register(descs.objects[i])
                elif descs.mem_type in _DEVICE:
                    region = self.agent.register_address(addr, length, device=int(dev))
                else:
                    region = self.agent.register_address(addr, length)
                self._region_refs[region] = self._region_refs.get(region, 0) + 1
                done.append(((addr, length), region))
        except BaseException:
            # Only what this call added goes: a region registered before it
            # (the same object again) stays.
            for _, region in done:
                self._release(region)
            raise
        for key, region in done:
            self._registered.setdefault(key, []).append(region)
        return descs

    def _release(self, region: int) -> None:
        """Drops one hold on an agent region, deregistering it with the last."""
        left = self._region_refs.get(region, 1) - 1
        if left > 0:
            self._region_refs[region] = left
        else:
            self._region_refs.pop(region, None)
            self.agent.deregister(region)

    def deregister_memory(self, dereg_list: nixlRegDList, backends: Optional[list[str]] = None) -> None:
        """Deregisters memory registered with ``register_memory``. A list
        naming memory that is not registered is refused whole (nothing is
        deregistered)."""
        wanted: dict[tuple[int, int], int] = {}
        for addr, length, _dev, _meta in dereg_list.descs:
            wanted[(addr, length)] = wanted.get((addr, length), 0) + 1
            if wanted[(addr, length)] > len(self._registered.get((addr, length), ())):
                raise ArgumentError(
                    f"deregister_memory: {length} bytes at {addr:#x} were not registered by agent {self.name!r}"
                    + (" (as often as listed)" if wanted[(addr, length)] > 1 else "")
                    + "; nothing was deregistered"
                )
        for addr, length, _dev, _meta in dereg_list.descs:
            regions = self._registered[(addr, length)]
            self._release(regions.pop())
            if not regions:
                del self._registered[(addr, length)]

    # Metadata and peers.

    def get_agent_metadata(self) -> bytes:
        """This agent's metadata, to give to peers (``add_remote_agent``).
        Take it again after registering more memory."""
        return self.agent.metadata().encode()

    def get_partial_agent_metadata(
        self, descs: Any = None, inc_conn_info: bool = False, backends: Optional[list[str]] = None
    ) -> bytes:
        """The full metadata (rmacomm's metadata is not split into parts)."""
        return self.get_agent_metadata()

    def add_remote_agent(self, metadata: Union[bytes, str]) -> bytes:
        """Adds a peer from its metadata; returns its name (bytes, as NIXL)."""
        return self.agent.add_peer(metadata).encode()

    def remove_remote_agent(self, agent: Union[str, bytes]) -> None:
        """Forgets a peer and closes the connection to it."""
        self.agent.remove_peer(_name(agent))

    def check_remote_metadata(self, agent: Union[str, bytes], descs: Any = None) -> bool:
        """Whether the peer's metadata was added (and, with ``descs``,
        whether every descriptor lies in a region it published)."""
        name = _name(agent)
        if name not in self.agent.peers():
            return False
        if descs is None:
            return True
        try:
            self._remote_blocks(name, self.get_xfer_descs(descs, "DRAM").descs)
        except ArgumentError:
            return False
        return True

    def make_connection(self, remote_agent: Union[str, bytes], backends: Optional[list[str]] = None) -> None:
        """Connects to the peer now (optional: the first transfer does)."""
        self.agent.connect(_name(remote_agent))

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Not supported: pass ``get_agent_metadata()`` to peers yourself."""
        raise UnavailableError("send_local_metadata: exchange get_agent_metadata() out of band (no metadata listener)")

    def send_partial_agent_metadata(self, *args: Any, **kwargs: Any) -> None:
        """Not supported: pass ``get_agent_metadata()`` to peers yourself."""
        raise UnavailableError("send_partial_agent_metadata: exchange get_agent_metadata() out of band")

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Not supported: add peers with ``add_remote_agent(metadata)``."""
        raise UnavailableError("fetch_remote_metadata: add peers with add_remote_agent(their metadata)")

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Not supported (no metadata listener)."""
        raise UnavailableError("invalidate_local_metadata: there is no metadata listener to invalidate")

    # Descriptor mapping.

    def _local_entries(self, descs: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        spans = _Spans((a, n, rid) for rid, a, n in self.agent.regions())
        for i, (addr, length, _dev) in enumerate(descs):
            if spans.find(addr, length) is None:
                raise ArgumentError(
                    f"descriptor {i}: {length} bytes at {addr:#x} lie in no memory registered with agent "
                    f"{self.name!r} (register_memory first)"
                )
        return [(addr, length) for addr, length, _ in descs]

    def _remote_blocks(self, peer: str, descs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        spans = _Spans((a, n, rid) for rid, a, n in self.agent.peer_regions(peer))
        out = []
        for i, (addr, length, _dev) in enumerate(descs):
            hit = spans.find(addr, length)
            if hit is None:
                raise ArgumentError(
                    f"descriptor {i}: {length} bytes at {addr:#x} lie in no region agent {peer!r} published; if it "
                    "registered memory since, add its current metadata again (add_remote_agent)"
                )
            start, rid = hit
            out.append((rid, addr - start, length))
        return out

    # Requests.

    def prep_xfer_dlist(
        self,
        agent_name: Union[str, bytes],
        xfer_list: Any,
        mem_type: Optional[str] = None,
        is_sorted: bool = False,
        backends: Optional[list[str]] = None,
    ) -> nixl_prepped_dlist_handle:
        """Prepares descriptors once, to pick from by index in
        ``make_prepped_xfer``: ``agent_name`` "NIXL_INIT_AGENT" (or "") for
        this agent's memory, a peer's name for the peer's."""
        descs = self.get_xfer_descs(xfer_list, mem_type, is_sorted)
        _check_mem_type(descs.mem_type)
        name = _name(agent_name)
        lengths = [n for _, n, _ in descs.descs]
        if name in (NIXL_INIT_AGENT, ""):
            prepped = _Prepped(None, list(self._local_entries(descs.descs)), lengths)
        elif name == self.name:
            raise UnavailableError("prep_xfer_dlist: loopback transfers (to this agent itself) are not supported")
        else:
            prepped = _Prepped(name, list(self._remote_blocks(name, descs.descs)), lengths)
        h = next(self._handles)
        self._dlists[h] = prepped
        return h

    def _xfer(self, op: str, handle: nixl_xfer_handle) -> _Xfer:
        x = self._xfers.get(handle)
        if x is None:
            raise ArgumentError(f"{op}: transfer handle {handle!r} is unknown to agent {self.name!r} (or released)")
        return x

    def _dlist(self, op: str, handle: nixl_prepped_dlist_handle) -> _Prepped:
        d = self._dlists.get(handle)
        if d is None:
            raise ArgumentError(
                f"{op}: prepared list handle {handle!r} is unknown to agent {self.name!r} (or released)"
            )
        return d

    def _new_xfer(self, operation: str, peer: str, pieces: list[Any], notif_msg: Union[bytes, str, None]) -> int:
        if operation not in _OPS:
            raise ValueError(f"operation must be \"WRITE\" or \"READ\", not {operation!r}")
        h = next(self._handles)
        self._xfers[h] = _Xfer(operation, peer, pieces, _message(notif_msg))
        return h

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: Sequence[int],
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: Sequence[int],
        notif_msg: Union[bytes, str] = b"",
        backends: Optional[list[str]] = None,
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """A request from prepared lists: local descriptor
        ``local_indices[i]`` with remote descriptor ``remote_indices[i]``."""
        local = self._dlist("make_prepped_xfer", local_xfer_side)
        remote = self._dlist("make_prepped_xfer", remote_xfer_side)
        if local.peer is not None:
            raise ArgumentError("make_prepped_xfer: the local side must be prepared with NIXL_INIT_AGENT")
        if remote.peer is None:
            raise ArgumentError("make_prepped_xfer: the remote side must be prepared with the peer's name")
        li, ri = list(local_indices), list(remote_indices)
        if len(li) != len(ri):
            raise ArgumentError(
                f"make_prepped_xfer: {len(li)} local indices but {len(ri)} remote ones; they pair one to one"
            )
        for side, idx, n in (("local", li, len(local.entries)), ("remote", ri, len(remote.entries))):
            for k, i in enumerate(idx):
                # No negative indices (Python's from-the-end): NIXL's are unsigned.
                if isinstance(i, bool) or not hasattr(i, "__index__") or not 0 <= i.__index__() < n:
                    raise ArgumentError(
                        f"make_prepped_xfer: {side} index {k} is {i!r}, not an index into the {side} list "
                        f"of {n} descriptors (0 to {n - 1})"
                    )
        pieces = [(local.entries[i.__index__()], remote.entries[j.__index__()]) for i, j in zip(li, ri)]
        return self._new_xfer(operation, remote.peer, pieces, notif_msg)

    def initialize_xfer(
        self,
        operation: str,
        local_descs: Any,
        remote_descs: Any,
        remote_agent: Union[str, bytes],
        notif_msg: Union[bytes, str] = b"",
        backends: Optional[list[str]] = None,
    ) -> nixl_xfer_handle:
        """A request moving local descriptor i to (WRITE) or from (READ)
        remote descriptor i of ``remote_agent``."""
        # Lists of tuples are taken as host memory (NIXL wants descriptor lists).
        local = self.get_xfer_descs(local_descs, "DRAM")
        remote = self.get_xfer_descs(remote_descs, "DRAM")
        _check_mem_type(local.mem_type)
        _check_mem_type(remote.mem_type)
        if len(local) != len(remote):
            raise ArgumentError(
                f"initialize_xfer: {len(local)} local descriptors but {len(remote)} remote ones; they pair one to one"
            )
        peer = _name(remote_agent)
        pieces = list(zip(self._local_entries(local.descs), self._remote_blocks(peer, remote.descs)))
        return self._new_xfer(operation, peer, pieces, notif_msg)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: Union[bytes, str] = b"") -> str:
        """Posts the request (again, once the previous posting ended);
        ``notif_msg`` replaces its notification. Returns "PROC", "DONE" or
        "ERR". A request the peer's metadata refuses raises (nothing moved)."""
        x = self._xfer("transfer", handle)
        if x.running is not None and not x.running.done():
            raise ArgumentError(f"transfer: request {handle} with {x.peer!r} is still in progress (repost after DONE)")
        notif = _message(notif_msg) or x.notif
        x.running = self.agent.transfer(x.op, x.peer, x.pieces, notif)
        return x.running.status()

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """"PROC", "DONE" or "ERR" (``get_xfer_error`` says why)."""
        x = self._xfer("check_xfer_state", handle)
        if x.running is None:
            raise ArgumentError(f"check_xfer_state: request {handle} was not posted (call transfer first)")
        return x.running.status()

    def get_xfer_error(self, handle: nixl_xfer_handle) -> Optional[BaseException]:
        """The exception a failed request ended with (it names the peer),
        else None (an rmacomm extension)."""
        x = self._xfer("get_xfer_error", handle)
        return x.running.error() if x.running is not None else None

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """The backend name (the first configured; all are rmacomm's)."""
        return next(iter(self.backends), "UCX")

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        """Releases a request. One still in progress is not cancelled: its
        pieces land and its notification is sent. An unknown (or already
        released) handle is an ArgumentError."""
        self._xfer("release_xfer_handle", handle)
        del self._xfers[handle]

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        """Releases a prepared descriptor list (requests made from it stay
        usable). An unknown (or already released) handle is an
        ArgumentError."""
        self._dlist("release_dlist_handle", handle)
        del self._dlists[handle]

    # Notifications.

    def get_new_notifs(self, backends: Optional[list[str]] = None) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by peer name."""
        out: dict[str, list[bytes]] = {}
        for peer, msg in self.agent.get_notifications():
            out.setdefault(peer, []).append(msg)
        return out

    def update_notifs(self, backends: Optional[list[str]] = None) -> dict[str, list[bytes]]:
        """Adds new notifications to ``self.notifs`` and returns it."""
        for peer, msgs in self.get_new_notifs().items():
            self.notifs.setdefault(peer, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(
        self,
        remote_agent_name: Union[str, bytes],
        lookup_tag: bytes,
        backends: Optional[list[str]] = None,
        tag_is_prefix: bool = True,
    ) -> bool:
        """Whether a notification from the peer matches ``lookup_tag`` (a
        prefix, or a substring); removes the one found."""
        msgs = self.update_notifs().get(_name(remote_agent_name), [])
        for m in msgs:
            if (tag_is_prefix and m.startswith(lookup_tag)) or (not tag_is_prefix and lookup_tag in m):
                msgs.remove(m)
                return True
        return False

    def send_notif(
        self, remote_agent_name: Union[str, bytes], notif_msg: Union[bytes, str], backend: Optional[str] = None
    ) -> None:
        """Sends the peer a notification that moves no data."""
        self.agent.notify(_name(remote_agent_name), _message(notif_msg) or b"")
