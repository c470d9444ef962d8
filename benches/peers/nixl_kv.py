"""rdma_bench kv's workload on NIXL (`pip install nixl-cu12`; UCX backend,
host memory "DRAM"): prefill's request is `initialize_xfer("WRITE", N
local descriptors, N remote descriptors, "decode", notif)` + `transfer`,
polled with `check_xfer_state` until DONE; decode polls `get_new_notifs`
(both sleeping 20 µs between polls: KV_PEER_POLL_US in kv_peer.py).
The time runs from `initialize_xfer` (where the request's blocks are
named, as in rdma_bench's `transfer`) to decode seeing the notification.
UCX's transports come from the environment (compare.sh: UCX_TLS=all, or
tcp).

    UCX_TLS=all python nixl_kv.py --link shm 256:16384 64:1048576
"""

import importlib.metadata
import json
import os

from kv_peer import main, pause


class Backend:
    def __init__(self, role, args):
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.role = role
        # NIXL's UCX backend asks UCX for peer failure handling by default,
        # which UCX's shared-memory transports lack: with it, UCX_TLS=all
        # still runs over tcp on one host. NIXL_KV_ERR_MODE=none (what
        # compare.sh sets for its same-host rows) lets UCX pick shared
        # memory (cma, posix).
        mode = os.environ.get("NIXL_KV_ERR_MODE", "peer")
        self.agent = nixl_agent(role, nixl_agent_config(backends=[]))
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": mode})
        ver = importlib.metadata.version("nixl-cu12")
        self.label = "nixl %s (UCX, UCX_TLS=%s%s)" % (
            ver, os.environ.get("UCX_TLS", "default"), "" if mode == "peer" else ", error handling " + mode)
        self.until = "notification at decode"
        self.seen = set()

    def register(self, buf):
        self.buf = buf
        descs = self.agent.get_reg_descs([(int(buf.ctypes.data), buf.nbytes, 0, "")], "DRAM")
        self.reg = self.agent.register_memory(descs)

    def metadata(self):
        return self.agent.get_agent_metadata().hex()

    def add_peer(self, meta):
        self.peer = self.agent.add_remote_agent(bytes.fromhex(meta))
        if isinstance(self.peer, bytes):
            self.peer = self.peer.decode()

    def request(self, local_addrs, remote_addrs, length, tag):
        a = self.agent
        local = a.get_xfer_descs([(x, length, 0) for x in local_addrs], "DRAM")
        remote = a.get_xfer_descs([(x, length, 0) for x in remote_addrs], "DRAM")
        h = a.initialize_xfer("WRITE", local, remote, self.peer, tag)
        st = a.transfer(h)
        while st not in ("DONE", "ERR"):
            pause()
            st = a.check_xfer_state(h)
        a.release_xfer_handle(h)
        if st == "ERR":
            raise RuntimeError("NIXL transfer failed")

    def poll_notification(self, tag):
        for msgs in self.agent.get_new_notifs().values():
            self.seen.update(msgs)
        if tag in self.seen:
            self.seen.discard(tag)
            return True
        return False


if __name__ == "__main__":
    main(Backend)
