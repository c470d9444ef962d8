//! Reliable-connected queue pairs.

use std::fmt;
use std::sync::Arc;

use crate::provider::QpOps;
use crate::qp_attr::{InitAttr, QpCaps, QpState, QpTransition, RtrAttr, RtsAttr};
use crate::wr::{RecvWr, SendWr};
use crate::{CompletionQueue, ProtectionDomain, QpEndpoint, Result};

/// An RC queue pair. It keeps its PD and both CQs alive. Dropping it
/// destroys the QP: WRs still outstanding are dropped without completions
/// (as `ibv_destroy_qp` does), but the memory they name stays alive until the
/// provider has let go of them.
pub struct QueuePair {
    ops: Arc<dyn QpOps>,
    pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair").field("qp_num", &self.ops.qp_num()).field("state", &self.ops.state()).finish()
    }
}

impl QueuePair {
    pub(crate) fn new(
        ops: Arc<dyn QpOps>,
        pd: ProtectionDomain,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
    ) -> Self {
        QueuePair { ops, pd, send_cq, recv_cq }
    }

    /// QP number.
    pub fn qp_num(&self) -> u32 {
        self.ops.qp_num()
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        self.ops.state()
    }

    /// Queue sizes.
    pub fn caps(&self) -> QpCaps {
        self.ops.caps()
    }

    /// What the peer needs to connect to this QP: serialise it and send it.
    pub fn endpoint(&self) -> Result<QpEndpoint> {
        self.ops.endpoint()
    }

    /// `ibv_modify_qp`.
    pub fn modify(&self, transition: &QpTransition) -> Result<()> {
        self.ops.modify(transition)
    }

    /// RESET → INIT → RTR → RTS against `remote` with default attributes.
    pub fn connect(&self, remote: &QpEndpoint) -> Result<()> {
        self.connect_with(InitAttr::default(), RtrAttr::new(remote.clone()), RtsAttr::default())
    }

    /// RESET → INIT → RTR → RTS with the given attributes.
    pub fn connect_with(&self, init: InitAttr, rtr: RtrAttr, rts: RtsAttr) -> Result<()> {
        if self.state() == QpState::Reset {
            self.modify(&QpTransition::Init(init))?;
        }
        self.modify(&QpTransition::Rtr(rtr))?;
        self.modify(&QpTransition::Rts(rts))
    }

    /// Posts send WRs. Malformed WRs (too many SGEs, inline too long, an
    /// inline SGE outside the registered region its lkey names, an atomic
    /// without one 8-byte SGE, a full send queue) fail the call and post
    /// nothing; other key, bounds and access errors come back as completions.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.ops.post_send(wrs)
    }

    /// Posts receive WRs.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.ops.post_recv(wrs)
    }

    /// Maps `len` bytes at `addr` of the connected peer's region `rkey`
    /// into this process, for loads, stores and atomics by the calling
    /// thread ([`RemoteMapping`](crate::RemoteMapping): the UNIFIED path of
    /// windows). Resolves once the connection is up (run it on a tokio
    /// runtime: the soft provider asks the peer's attach socket for the
    /// segment). `Ok(None)` where no mapping is possible: a peer on another
    /// host, a region outside a shared segment, the verbs provider. An error
    /// when the peer does not register the range under `rkey`.
    pub fn map_remote(&self, rkey: u32, addr: u64, len: u64) -> crate::provider::MapRemoteFuture {
        self.ops.map_remote(rkey, addr, len)
    }

    /// [`map_remote`](Self::map_remote) of the whole region the peer
    /// registers under `rkey`, found through `addr` (a byte in it): the
    /// mapping's [`remote_addr`](crate::RemoteMapping::remote_addr) and
    /// [`len`](crate::RemoteMapping::len) say where it starts and how long
    /// it is.
    pub fn map_remote_region(&self, rkey: u32, addr: u64) -> crate::provider::MapRemoteFuture {
        self.ops.map_remote_region(rkey, addr)
    }

    /// The PD.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// The send CQ.
    pub fn send_cq(&self) -> &CompletionQueue {
        &self.send_cq
    }

    /// The receive CQ.
    pub fn recv_cq(&self) -> &CompletionQueue {
        &self.recv_cq
    }

    /// The provider's QP object.
    pub fn ops(&self) -> &Arc<dyn QpOps> {
        &self.ops
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // Destroying a QP stops its engine; RESET drops outstanding work.
        let _ = self.ops.modify(&QpTransition::Reset);
    }
}
