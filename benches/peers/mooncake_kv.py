"""rdma_bench kv's workload on Mooncake's Transfer Engine (`pip install
mooncake-transfer-engine-non-cuda`; P2PHANDSHAKE metadata, the tcp
protocol): prefill's request is one `batch_transfer_sync` WRITE of N
buffers with a `TransferNotify`, decode polls `get_notifies`. The time runs
from the call to decode seeing the notification. Decode polls, sleeping
20 µs between polls (KV_PEER_POLL_US in kv_peer.py).

    python mooncake_kv.py --link tcp 256:16384 64:1048576
"""

import importlib.metadata
import json

from kv_peer import main


class Backend:
    def __init__(self, role, args):
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

        self.Notify, self.Write = TransferNotify, TransferOpcode.Write
        self.role = role
        self.te = TransferEngine()
        if self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("TransferEngine.initialize failed")
        self.name = "127.0.0.1:%d" % self.te.get_rpc_port()
        ver = importlib.metadata.version("mooncake-transfer-engine-non-cuda")
        self.label = "mooncake %s (tcp)" % ver
        self.until = "notification at decode"
        self.seen = set()

    def register(self, buf):
        self.buf = buf
        if self.te.register_memory(int(buf.ctypes.data), buf.nbytes) != 0:
            raise RuntimeError("register_memory failed")

    def metadata(self):
        return self.name

    def add_peer(self, meta):
        self.peer = meta

    def request(self, local_addrs, remote_addrs, length, tag):
        n = len(local_addrs)
        r = self.te.batch_transfer_sync(self.peer, local_addrs, remote_addrs, [length] * n, self.Write,
                                        self.Notify(self.name, tag.decode()))
        if r != 0:
            raise RuntimeError("batch_transfer_sync returned %d" % r)

    def poll_notification(self, tag):
        for n in self.te.get_notifies():
            self.seen.add(n.msg.encode() if isinstance(n.msg, str) else n.msg)
        if tag in self.seen:
            self.seen.discard(tag)
            return True
        return False


if __name__ == "__main__":
    main(Backend)
