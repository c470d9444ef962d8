//! Who this host is (for choosing the shared-memory link) and which
//! addresses the TCP listener advertises.

use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::MetadataExt;

use super::address::HostId;

/// This process's host identity: boot id, IPC namespace, network namespace.
pub(crate) fn host_id() -> HostId {
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".to_owned());
    let ns = |p: &str| std::fs::metadata(p).map(|m| m.ino()).unwrap_or(0);
    HostId { boot_id, ipc_ns: ns("/proc/self/ns/ipc"), net_ns: ns("/proc/self/ns/net") }
}

/// IPv4 addresses of the interfaces that are up, non-loopback first, the
/// loopback last (so a same-namespace peer can always connect).
pub(crate) fn local_ipv4_addrs() -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = Vec::new();
    for (_, ip) in ipv4_interfaces() {
        if !out.contains(&ip) {
            out.push(ip);
        }
    }
    out.sort_by_key(|ip| ip.is_loopback());
    if !out.iter().any(|ip| ip.is_loopback()) {
        out.push(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    out
}

/// (interface name, IPv4 address) of every interface that is up.
pub(crate) fn ipv4_interfaces() -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills ifap with a list we free below.
    if unsafe { libc::getifaddrs(&mut ifap) } == 0 {
        let mut cur = ifap;
        while !cur.is_null() {
            // SAFETY: cur is a node of the list getifaddrs returned.
            let ifa = unsafe { &*cur };
            cur = ifa.ifa_next;
            let up = ifa.ifa_flags & (libc::IFF_UP as u32) != 0;
            if !up || ifa.ifa_addr.is_null() {
                continue;
            }
            // SAFETY: ifa_addr points to a sockaddr whose family we check.
            let fam = unsafe { (*ifa.ifa_addr).sa_family } as i32;
            if fam != libc::AF_INET {
                continue;
            }
            // SAFETY: the family is AF_INET, so this is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            // SAFETY: ifa_name is a NUL-terminated string owned by the list.
            let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
            out.push((name, IpAddr::V4(ip)));
        }
        // SAFETY: ifap came from getifaddrs.
        unsafe { libc::freeifaddrs(ifap) };
    }
    out
}

/// The addresses of the interfaces `filter` selects, non-loopback first;
/// an error naming the interfaces there are when it selects none.
pub(crate) fn selected_ipv4_addrs(filter: &super::ifname::IfnameFilter, spec: &str) -> Result<Vec<IpAddr>, String> {
    let all = ipv4_interfaces();
    let mut out: Vec<IpAddr> = Vec::new();
    for (name, ip) in &all {
        if filter.matches(name) && !out.contains(ip) {
            out.push(*ip);
        }
    }
    out.sort_by_key(|ip| ip.is_loopback());
    if out.is_empty() {
        let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
        return Err(format!(
            "RMACOMM_SOCKET_IFNAME={spec:?} selects no interface with an IPv4 address that is up (there are: {})",
            names.join(", ")
        ));
    }
    Ok(out)
}
