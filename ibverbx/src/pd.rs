//! Protection domains.

use std::fmt;
use std::sync::Arc;

use crate::provider::PdOps;
use crate::{CompletionQueue, Context, QpInitAttr, QueuePair, Result};

/// A protection domain. Memory regions and QPs keep it (and its context)
/// alive.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    pub(crate) ops: Arc<dyn PdOps>,
    pub(crate) ctx: Context,
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain").field("ops", &self.inner.ops).finish()
    }
}

impl ProtectionDomain {
    pub(crate) fn new(ops: Arc<dyn PdOps>, ctx: Context) -> Self {
        ProtectionDomain { inner: Arc::new(PdInner { ops, ctx }) }
    }

    /// The context the PD belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Creates an RC queue pair whose send and receive completions go to the
    /// given CQs (which may be the same). The QP keeps both CQs and this PD
    /// alive.
    pub fn create_qp(
        &self,
        attr: &QpInitAttr,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
    ) -> Result<QueuePair> {
        let ops = self.inner.ops.create_qp(attr, &send_cq.inner.ops, &recv_cq.inner.ops)?;
        Ok(QueuePair::new(ops, self.clone(), send_cq.clone(), recv_cq.clone()))
    }

    /// The provider's PD object.
    pub fn ops(&self) -> &Arc<dyn PdOps> {
        &self.inner.ops
    }
}
