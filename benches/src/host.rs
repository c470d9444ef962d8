//! Which host a process is on, as the soft provider decides between its
//! shared-memory and TCP links: same boot id, IPC and network namespace.
//! `rdma_bench` uses it to state the link a soft `auto` run really used.

use std::os::unix::fs::MetadataExt;

use serde::{Deserialize, Serialize};

/// This process's host identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostInfo {
    /// `/proc/sys/kernel/random/boot_id`.
    pub boot_id: String,
    /// Inode of `/proc/self/ns/ipc` (0 when unreadable).
    pub ipc_ns: u64,
    /// Inode of `/proc/self/ns/net` (0 when unreadable).
    pub net_ns: u64,
}

impl HostInfo {
    /// Reads it from `/proc`.
    pub fn current() -> HostInfo {
        let ino = |p: &str| std::fs::metadata(p).map(|m| m.ino()).unwrap_or(0);
        HostInfo {
            boot_id: std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .map(|s| s.trim().to_owned())
                .unwrap_or_default(),
            ipc_ns: ino("/proc/self/ns/ipc"),
            net_ns: ino("/proc/self/ns/net"),
        }
    }

    /// Whether the soft provider's `auto` link would use shared memory
    /// between the two.
    pub fn same_host(&self, other: &HostInfo) -> bool {
        !self.boot_id.is_empty() && self == other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_on_its_own_host() {
        let h = HostInfo::current();
        assert!(h.same_host(&h.clone()));
        let other_ns = HostInfo { net_ns: h.net_ns.wrapping_add(1), ..h.clone() };
        assert!(!h.same_host(&other_ns));
        let unknown = HostInfo { boot_id: String::new(), ipc_ns: 0, net_ns: 0 };
        assert!(!unknown.same_host(&unknown.clone()));
    }
}
