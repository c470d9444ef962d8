//! An open device.

use std::fmt;
use std::sync::Arc;

use crate::device::{DeviceAttr, DeviceInfo, Gid, PortAttr};
use crate::provider::ContextOps;
use crate::{CompletionQueue, ProtectionDomain, Result};

/// An open device (`ibv_context`). Cheap to clone; the device closes when the
/// last clone and every object made from it are gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

pub(crate) struct ContextInner {
    pub(crate) ops: Arc<dyn ContextOps>,
    pub(crate) info: DeviceInfo,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context").field("device", &self.inner.info.name).field("ops", &self.inner.ops).finish()
    }
}

impl Context {
    pub(crate) fn from_ops(ops: Arc<dyn ContextOps>, info: DeviceInfo) -> Self {
        Context { inner: Arc::new(ContextInner { ops, info }) }
    }

    /// The device this context was opened on.
    pub fn device(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// Device capabilities.
    pub fn query_device(&self) -> Result<DeviceAttr> {
        self.inner.ops.query_device()
    }

    /// Port attributes (ports are 1-based).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        self.inner.ops.query_port(port)
    }

    /// One GID table entry.
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        self.inner.ops.query_gid(port, index)
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        Ok(ProtectionDomain::new(self.inner.ops.alloc_pd()?, self.clone()))
    }

    /// Creates a completion queue of at least `cqe` entries, with its own
    /// completion channel.
    pub fn create_cq(&self, cqe: usize) -> Result<CompletionQueue> {
        Ok(CompletionQueue::new(self.inner.ops.create_cq(cqe)?, self.clone()))
    }

    /// The provider's context object (for provider-specific extensions).
    pub fn ops(&self) -> &Arc<dyn ContextOps> {
        &self.inner.ops
    }
}
