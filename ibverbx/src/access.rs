//! Memory-region access flags (`IBV_ACCESS_*`).

use bitflags::bitflags;
use serde::{Deserialize, Serialize};

bitflags! {
    /// What a memory region allows. Values are those of `enum ibv_access_flags`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
    pub struct AccessFlags: u32 {
        /// The local HCA may write (needed for receives and RDMA READ targets).
        const LOCAL_WRITE = 1;
        /// Peers may RDMA WRITE into the region.
        const REMOTE_WRITE = 1 << 1;
        /// Peers may RDMA READ from the region.
        const REMOTE_READ = 1 << 2;
        /// Peers may run atomics on the region.
        const REMOTE_ATOMIC = 1 << 3;
    }
}

impl AccessFlags {
    /// Every access: what one-sided communication buffers usually want.
    pub fn all_remote() -> Self {
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC
    }

    /// Verbs requires LOCAL_WRITE whenever REMOTE_WRITE or REMOTE_ATOMIC is asked for.
    pub(crate) fn is_consistent(self) -> bool {
        self.contains(AccessFlags::LOCAL_WRITE)
            || !self.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
    }
}
