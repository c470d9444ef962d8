"""rmacomm.nixl: a NIXL connector-style program (nixl_connector.py, NIXL's
API only) in two processes; and in one process the descriptor shapes and
the errors."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import rmacomm
from rmacomm.nixl import nixl_agent, nixl_agent_config, nixlRegDList, nixlXferDList

from conftest import requires_torch

SCRIPT = Path(__file__).resolve().with_name("nixl_connector.py")


def test_connector_script_unchanged(tmp_path: Path) -> None:
    run_connector(tmp_path, [[], []], [None, None])


def run_connector(tmp_path: Path, prefixes: list[list[str]], envs: list[dict[str, str] | None]) -> None:
    procs = [subprocess.Popen([*pre, sys.executable, str(SCRIPT), role, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=env)
             for role, pre, env in zip(("target", "initiator"), prefixes, envs)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            pytest.fail(f"{p.args} did not finish:\n{out.decode(errors='replace')}")
        outs.append(out.decode(errors="replace"))
        assert p.returncode == 0, f"{p.args} exited with {p.returncode}:\n{outs[-1]}"
    assert "TARGET OK" in outs[0] and "INITIATOR OK" in outs[1], outs


def ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def test_connector_script_across_two_network_namespaces(tmp_path: Path) -> None:
    """The same script, target and initiator in two network namespaces
    joined by a veth pair (as two hosts): metadata through a file, the data
    and notifications over the soft provider's TCP link."""
    import os
    import shutil

    if os.geteuid() != 0:
        pytest.skip("not root: cannot create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    n = os.getpid() % 10000
    ns, dev = [f"rmp{n}a", f"rmp{n}b"], [f"rmpv{n}a", f"rmpv{n}b"]
    net = n % 250 + 1
    try:
        for x in ns:
            ip("netns", "add", x)
        ip("link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for i in (0, 1):
            ip("link", "set", dev[i], "netns", ns[i])
            ip("-n", ns[i], "addr", "add", f"10.214.{net}.{i + 1}/24", "dev", dev[i])
            ip("-n", ns[i], "link", "set", dev[i], "up")
            ip("-n", ns[i], "link", "set", "lo", "up")
        envs = [dict(os.environ, RMACOMM_PROVIDER="soft", RMACOMM_SOCKET_IFNAME=f"={d}") for d in dev]
        run_connector(tmp_path, [["ip", "netns", "exec", x] for x in ns], list(envs))
    finally:
        for x in ns:
            subprocess.run(["ip", "netns", "del", x], capture_output=True)


def test_descriptors_and_errors() -> None:
    conf = nixl_agent_config(backends=["UCX"], timeout=10)
    a, b = nixl_agent("na", conf), nixl_agent("nb", nixl_agent_config())
    assert a.get_plugin_list()[0] == "UCX" and a.get_backend_mem_types("UCX") == ["DRAM", "VRAM"]
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, np.uint8)
    reg_a = a.register_memory(src)  # an array: registered zero-copy, kept alive
    assert isinstance(reg_a, nixlRegDList) and reg_a.descCount() == 1
    reg_b = b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    name = a.add_remote_agent(b.get_agent_metadata())
    assert name == b"nb" and a.check_remote_metadata("nb") and not a.check_remote_metadata("nobody")

    # Descriptor shapes: tuples, an (N, 3) array, an array as memory.
    d1 = a.get_xfer_descs([(src.ctypes.data, 16, 0)], "DRAM")
    d2 = a.get_xfer_descs(np.array([[src.ctypes.data, 16, 0]], dtype=np.uint64), "DRAM")
    d3 = a.get_xfer_descs([src[:16]])
    assert d1 == d2 == d3 and isinstance(d1, nixlXferDList) and len(d1) == 1
    assert pickle.loads(a.get_serialized_descs(d1)) == d1
    assert a.check_remote_metadata(name, [(dst.ctypes.data, 16, 0)])
    assert not a.check_remote_metadata(name, [(dst.ctypes.data + dst.nbytes, 16, 0)])

    # A remote descriptor outside the peer's regions: refused, naming it.
    with pytest.raises(rmacomm.ArgumentError, match="no region agent 'nb' published"):
        a.initialize_xfer("WRITE", d1, [(dst.ctypes.data - 16, 16, 0)], name)
    with pytest.raises(rmacomm.ArgumentError, match="no memory registered with agent 'na'"):
        a.initialize_xfer("WRITE", [(dst.ctypes.data, 16, 0)], [(dst.ctypes.data, 16, 0)], name)
    with pytest.raises(rmacomm.ArgumentError, match="pair one to one"):
        a.initialize_xfer("WRITE", d1, [], name)
    with pytest.raises(rmacomm.UnavailableError, match="file, block and object memory are not supported"):
        a.prep_xfer_dlist(name, [(1, 1, 0)], "FILE")
    with pytest.raises(rmacomm.UnavailableError, match="not supported"):
        a.register_memory([(1, 1, 0, "")], "OBJ")
    with pytest.raises(ValueError, match="mem_type"):
        a.get_xfer_descs([(1, 1, 0)])

    # A write with its notification, the notification replaced per post.
    h = a.initialize_xfer("WRITE", [(src.ctypes.data + 100, 64, 0)], [(dst.ctypes.data + 1000, 64, 0)], name, b"n1")
    with pytest.raises(rmacomm.ArgumentError, match="not posted"):
        a.check_xfer_state(h)
    for tag in (b"", b"n2"):
        state = a.transfer(h, tag)
        end = time.monotonic() + 20
        while state == "PROC" and time.monotonic() < end:
            state = a.check_xfer_state(h)
        assert state == "DONE" and a.get_xfer_error(h) is None
    assert (dst[1000:1064] == src[100:164]).all()
    end = time.monotonic() + 10
    got: dict = {}
    while sum(len(v) for v in got.values()) < 2 and time.monotonic() < end:
        for k, v in b.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
    assert got == {"na": [b"n1", b"n2"]}
    a.release_xfer_handle(h)

    a.deregister_memory(reg_a)
    with pytest.raises(rmacomm.ArgumentError, match="not registered"):
        a.deregister_memory(reg_a)
    b.deregister_memory(reg_b)
    for f in (a.send_local_metadata, a.invalidate_local_metadata):
        with pytest.raises(rmacomm.UnavailableError):
            f()
    a.remove_remote_agent(name)
    assert not a.check_remote_metadata(name)


@requires_torch
def test_torch_tensors_as_memory() -> None:
    import torch

    a, b = nixl_agent("ta"), nixl_agent("tb")
    src = torch.arange(256, dtype=torch.int32)
    dst = torch.zeros(256, dtype=torch.int32)
    a.register_memory([src])
    b.register_memory(dst)
    name = a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([src]), b.get_xfer_descs(dst), name, b"t")
    state = a.transfer(h)
    while state == "PROC":
        state = a.check_xfer_state(h)
    assert state == "DONE" and torch.equal(src, dst)


STANDIN = Path(__file__).resolve().parents[2] / "target" / "release" / "librmacomm_cuda_standin.so"

VRAM_SCRIPT = r"""
import ctypes, os, time
import numpy as np
import rmacomm
from rmacomm.nixl import nixl_agent, nixl_agent_config

cu = ctypes.CDLL(os.environ["RMACOMM_CUDA_LIB"])
assert cu.cuInit(0) == 0
# Device 0's primary context current on this thread, as torch makes it:
# allocations and copies need one (the driver's rule, the stand-in's too).
ctx = ctypes.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cu.cuCtxSetCurrent(ctx) == 0

def dev_alloc(n):
    p = ctypes.c_uint64()
    assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)) == 0
    return p.value

def upload(dst, a):
    assert cu.cuMemcpyHtoD_v2(ctypes.c_uint64(dst), a.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(a.nbytes)) == 0

def download(a, src):
    assert cu.cuMemcpyDtoH_v2(a.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(src), ctypes.c_size_t(a.nbytes)) == 0

def run(a, op, local, remote, peer, tag):
    h = a.initialize_xfer(op, local, remote, peer, tag)
    state, end = a.transfer(h), time.monotonic() + 30
    while state == "PROC" and time.monotonic() < end:
        state = a.check_xfer_state(h)
    assert state == "DONE", (state, a.get_xfer_error(h))
    a.release_xfer_handle(h)

N = (1 << 20) + 5
conf = nixl_agent_config(timeout=30)
a, b = nixl_agent("va", conf), nixl_agent("vb", conf)
vram_b, vram_a = dev_alloc(N), dev_alloc(N)
host = (np.arange(N) * 7 % 251).astype(np.uint8)
a.register_memory(host)
a.register_memory([(vram_a, N, 0, "")], "VRAM")
b.register_memory([(vram_b, N, 0, "")], "VRAM")
name = a.add_remote_agent(b.get_agent_metadata())
remote = b.get_xfer_descs([(vram_b, N, 0)], "VRAM")

# DRAM -> a peer's VRAM.
run(a, "WRITE", [(host.ctypes.data, N, 0)], remote, name, b"dram")
got = np.zeros(N, np.uint8)
download(got, vram_b)
assert (got == host).all(), "DRAM to VRAM"
# VRAM -> the peer's VRAM, at an offset.
mine = (np.arange(N) * 13 % 241).astype(np.uint8)
upload(vram_a, mine)
run(a, "WRITE", a.get_xfer_descs([(vram_a + 3, 4096, 0)], "VRAM"), [(vram_b + 1000, 4096, 0)], name, b"vram")
download(got, vram_b)
assert (got[1000:5096] == mine[3:4099]).all() and (got[:1000] == host[:1000]).all(), "VRAM to VRAM"
# READ the peer's VRAM into host memory.
back = np.zeros(N, np.uint8)
a.register_memory(back)
run(a, "READ", [(back.ctypes.data, N, 0)], remote, name, b"")
assert (back == got).all(), "VRAM read into DRAM"
# The peer's notifications came.
end, notes = time.monotonic() + 10, []
while len(notes) < 2 and time.monotonic() < end:
    notes += b.get_new_notifs().get("va", [])
assert sorted(notes) == [b"dram", b"vram"], notes
# A "VRAM" descriptor of host memory: refused, naming the driver's check.
try:
    a.register_memory([(host.ctypes.data, 64, 0, "")], "VRAM")
    raise AssertionError("host memory registered as VRAM")
except rmacomm.CommError as e:
    assert "not CUDA memory" in str(e), str(e)
print("vram ok")
"""


def test_vram_descriptors_against_the_cuda_standin() -> None:
    """"VRAM" descriptors by address (device memory of the CUDA stand-in,
    which faults on any host access): DRAM and VRAM written into a peer
    agent's VRAM, its VRAM read back into DRAM, host memory refused as
    VRAM. Runs in a child process with RMACOMM_CUDA_LIB set."""
    if not STANDIN.exists():
        pytest.skip(f"the CUDA stand-in is not built ({STANDIN}: cargo build --release -p rmacomm-cuda-standin)")
    env = dict(os.environ, RMACOMM_CUDA_LIB=str(STANDIN))
    out = subprocess.run([sys.executable, "-c", VRAM_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "vram ok" in out.stdout, out.stdout + out.stderr


def test_bad_handles_indices_and_lists_are_refused_and_change_nothing() -> None:
    a, b = nixl_agent("ha", nixl_agent_config(timeout=10)), nixl_agent("hb", nixl_agent_config(timeout=10))
    src = np.arange(4 * 64, dtype=np.uint8)
    dst = np.zeros(4 * 64, np.uint8)
    a.register_memory(src)
    b.register_memory(dst)
    name = a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("", [(src.ctypes.data + 64 * i, 64, 0) for i in range(4)], "DRAM")
    remote = a.prep_xfer_dlist(name, [(dst.ctypes.data + 64 * i, 64, 0) for i in range(4)], "DRAM")
    # Python's negative indices would pick descriptors from the end (local
    # block 3 into remote block 0): NIXL's indices are unsigned.
    for li, ri in (([-1], [0]), ([0], [-4]), ([4], [0]), ([0.0], [0]), ([True], [0])):
        with pytest.raises(rmacomm.ArgumentError, match="not an index into the"):
            a.make_prepped_xfer("WRITE", local, li, remote, ri)
    h = a.make_prepped_xfer("WRITE", local, [np.int64(3)], remote, [0])
    state = a.transfer(h)
    end = time.monotonic() + 20
    while state == "PROC" and time.monotonic() < end:
        state = a.check_xfer_state(h)
    assert state == "DONE" and (dst[:64] == src[192:]).all() and not dst[64:].any()

    # Released handles: an ArgumentError naming the call and the handle,
    # not a bare KeyError; a second release too.
    a.release_xfer_handle(h)
    for f in (a.transfer, a.check_xfer_state, a.get_xfer_error, a.release_xfer_handle):
        with pytest.raises(rmacomm.ArgumentError, match=rf"{f.__name__}: transfer handle {h} is unknown"):
            f(h)
    a.release_dlist_handle(local)
    with pytest.raises(rmacomm.ArgumentError, match=rf"make_prepped_xfer: prepared list handle {local} is unknown"):
        a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    with pytest.raises(rmacomm.ArgumentError, match="release_dlist_handle"):
        a.release_dlist_handle(local)

    # Negative addresses and lengths are refused where the list is made.
    with pytest.raises(rmacomm.ArgumentError, match="none may be negative"):
        a.initialize_xfer("WRITE", [(src.ctypes.data, -16, 0)], [(dst.ctypes.data, -16, 0)], name)
    with pytest.raises(rmacomm.ArgumentError, match="none may be negative"):
        a.prep_xfer_dlist(name, [(-1, 16, 0)], "DRAM")

    # A deregistration list naming memory that is not registered is
    # refused whole: the registered entry before it stays registered.
    other = np.zeros(64, np.uint8)
    both = nixlRegDList("DRAM", [(src.ctypes.data, src.nbytes, 0, ""), (other.ctypes.data, 64, 0, "")])
    before = a.agent.regions()
    with pytest.raises(rmacomm.ArgumentError, match="nothing was deregistered"):
        a.deregister_memory(both)
    assert a.agent.regions() == before
    twice = nixlRegDList("DRAM", [(src.ctypes.data, src.nbytes, 0, "")] * 2)
    with pytest.raises(rmacomm.ArgumentError, match="as often as listed"):
        a.deregister_memory(twice)
    assert a.agent.regions() == before


def test_the_same_object_registered_twice_stays_until_deregistered_twice() -> None:
    """The agent answers the same array registered again with its region:
    the facade counts its holds, so one deregistration of two keeps it, and
    a failed registration list drops only what it added."""
    a = nixl_agent("twice", nixl_agent_config(timeout=10))
    buf = np.zeros(256, np.uint8)
    first = a.register_memory([buf])
    a.register_memory([buf])
    regions = a.agent.regions()
    assert len(regions) == 1
    a.deregister_memory(first)
    assert a.agent.regions() == regions, "one of two registrations dropped the region"
    a.deregister_memory(first)
    assert a.agent.regions() == []

    # [buf (already registered), fresh, read-only]: the third fails; the
    # call rolls back fresh, and buf stays registered once.
    a.register_memory([buf])
    regions = a.agent.regions()
    fresh = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="read-only"):
        a.register_memory([buf, fresh, np.frombuffer(bytes(64), np.uint8)])
    assert a.agent.regions() == regions, "a failed registration dropped a region registered before it"
    a.deregister_memory(nixlRegDList("DRAM", [(buf.ctypes.data, buf.nbytes, 0, "")]))
    assert a.agent.regions() == []


def test_strided_views_and_descriptor_arrays() -> None:
    """A strided view is not one range (its descriptor covered other
    elements: a READ through it overwrote them); an (N, 3) integer array
    with a mem_type is descriptors, not memory to register."""
    a = nixl_agent("desc", nixl_agent_config(timeout=10))
    kv = np.zeros((4, 2, 256), np.uint8)
    for bad in (kv[:, 0], kv.reshape(4, 512)[:, :128], kv.T):
        with pytest.raises(rmacomm.ArgumentError, match="non-contiguous"):
            a.get_xfer_descs(bad)
        with pytest.raises(rmacomm.ArgumentError, match="non-contiguous"):
            a.get_reg_descs([bad])
    assert a.get_xfer_descs(kv[1]).descs == [(kv.ctypes.data + 512, 512, 0)]
    buf = np.zeros(4096, np.uint8)
    for width in (3, 4):
        arr = np.array([[buf.ctypes.data, 4096, 0] + [0] * (width - 3)], np.uint64)
        assert a.get_reg_descs(arr, "DRAM").descs == [(buf.ctypes.data, 4096, 0, "0" if width == 4 else "")]
        with pytest.raises(ValueError, match="give mem_type"):
            a.get_reg_descs(arr)
    a.register_memory(np.array([[buf.ctypes.data, 4096, 0]], np.uint64), "DRAM")
    assert [(addr, n) for _, addr, n in a.agent.regions()] == [(buf.ctypes.data, 4096)]


def test_read_only_memory_is_not_registered() -> None:
    # A numpy array over bytes: peers (and local READs) would write an
    # immutable object.
    frozen = bytes(4096)
    a = nixl_agent("ro", nixl_agent_config(timeout=10))
    with pytest.raises(ValueError, match="read-only"):
        a.register_memory(np.frombuffer(frozen, np.uint8))
    assert a.agent.regions() == [] and frozen == bytes(4096)


def test_requests_of_a_restarted_peer_fail_instead_of_moving_elsewhere() -> None:
    # A request prepared toward buffer 2 of peer "rb"; "rb" restarts (a new
    # incarnation) registering two other buffers. Reposting the old request
    # must not write the new buffer that happens to be registered second.
    a = nixl_agent("ra", nixl_agent_config(timeout=10))
    src = np.full(4096, 7, np.uint8)
    a.register_memory(src)
    b = nixl_agent("rb", nixl_agent_config(timeout=10))
    buf_a, buf_b = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    b.register_memory(buf_a)
    b.register_memory(buf_b)
    peer = a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer("WRITE", [src], [buf_b], peer)
    state = a.transfer(h)
    end = time.monotonic() + 20
    while state == "PROC" and time.monotonic() < end:
        state = a.check_xfer_state(h)
    assert state == "DONE" and (buf_b == 7).all()
    del b
    b2 = nixl_agent("rb", nixl_agent_config(timeout=10))
    buf_c, buf_d = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    b2.register_memory(buf_c)
    b2.register_memory(buf_d)
    a.add_remote_agent(b2.get_agent_metadata())
    with pytest.raises(rmacomm.ArgumentError, match="publishes no region"):
        a.transfer(h)
    assert not buf_c.any() and not buf_d.any()
