//! Which "host" this process is on, in the sense the soft provider and the
//! window's shared-memory path need.

use std::fs;

/// This process's host identity: the kernel boot id and the inodes of its IPC
/// and network namespaces (DESIGN.md). Two processes can share memory
/// segments and talk over loopback exactly when these match, so two
/// containers on one machine count as two hosts.
///
/// Outside Linux (no `/proc`), the host name stands in.
pub fn host_id() -> String {
    let boot = fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string());
    let ns = |n: &str| fs::read_link(format!("/proc/self/ns/{n}")).map(|p| p.display().to_string());
    match (boot, ns("ipc"), ns("net")) {
        (Ok(b), Ok(i), Ok(n)) => format!("{b}/{i}/{n}"),
        _ => {
            let name = fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()).unwrap_or_default();
            format!("host:{name}")
        }
    }
}
