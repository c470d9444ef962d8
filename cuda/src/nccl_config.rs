//! `ncclConfig_t`, the argument of `ncclCommInitRankConfig` (NCCL 2.14+,
//! RCCL alike), laid out as the header of the loaded library's version
//! lays it out. Changes when a new NCCL release appends fields (add a row
//! to `LAYOUTS`).
//!
//! NCCL only ever appends fields, and reads a caller's config as
//! `NCCL_CONFIG_INITIALIZER` of its own header overwritten by the first
//! `size` bytes the caller passes, then resets the fields the caller's
//! `version` did not know (src/init.cc, `parseCommConfig`). So a config is
//! sound for any library when `size` and `version` describe the same
//! header: here the loaded library's own (2.28.9 on the lent machines),
//! or the newest this file knows for a newer library.

use std::ffi::{c_char, c_int, c_uint};
use std::mem::{offset_of, size_of};

use crate::nccl::Version;

/// `NCCL_API_MAGIC` (2.29; the same literal since 2.14).
const MAGIC: c_uint = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`: "NCCL's default".
const UNDEF_INT: c_int = c_int::MIN;

/// The first version with `ncclConfig_t` and `ncclCommInitRankConfig`.
pub(crate) const CONFIG_API: Version = v(2, 14, 0);

const fn v(major: u32, minor: u32, patch: u32) -> Version {
    Version { major, minor, patch }
}

/// `ncclConfig_t` with every field NCCL has had, in its order (nccl.h up
/// to 2.30.7). Only the first [`Config::size`] bytes are passed as the
/// loaded version's struct.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Config {
    size: usize,
    magic: c_uint,
    version: c_uint,
    // 2.14
    blocking: c_int,
    // 2.17
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    // 2.18
    split_share: c_int,
    // 2.26
    traffic_class: c_int,
    // 2.27
    comm_name: *const c_char,
    collnet_enable: c_int,
    cta_policy: c_int,
    shrink_share: c_int,
    nvls_ctas: c_int,
    // 2.28
    n_channels_per_net_peer: c_int,
    nvlink_centric_sched: c_int,
    // 2.29
    graph_usage_mode: c_int,
    num_rma_ctx: c_int,
    // 2.30
    max_p2p_peers: c_int,
    // 2.30.5 (NCCL's parseCommConfig gates it there; first in 2.30.7's header)
    graph_stream_ordering: c_int,
}

/// Per release that appended fields: the version, and where its struct's
/// last field ends. The struct's `sizeof` is that rounded up to the
/// alignment of its pointers.
const LAYOUTS: &[(Version, usize)] = &[
    (v(2, 14, 0), offset_of!(Config, blocking) + size_of::<c_int>()),
    (v(2, 17, 0), offset_of!(Config, net_name) + size_of::<*const c_char>()),
    (v(2, 18, 0), offset_of!(Config, split_share) + size_of::<c_int>()),
    (v(2, 26, 0), offset_of!(Config, traffic_class) + size_of::<c_int>()),
    (v(2, 27, 0), offset_of!(Config, nvls_ctas) + size_of::<c_int>()),
    (v(2, 28, 0), offset_of!(Config, nvlink_centric_sched) + size_of::<c_int>()),
    (v(2, 29, 0), offset_of!(Config, num_rma_ctx) + size_of::<c_int>()),
    (v(2, 30, 0), offset_of!(Config, max_p2p_peers) + size_of::<c_int>()),
    (v(2, 30, 5), offset_of!(Config, graph_stream_ordering) + size_of::<c_int>()),
];

/// The newest header this file knows, as a version a config may claim.
const NEWEST: Version = v(2, 30, 7);

/// `sizeof(ncclConfig_t)` in nccl.h of `version`; `None` before 2.14.
pub(crate) fn size_for(version: Version) -> Option<usize> {
    let end = LAYOUTS.iter().rev().find(|(since, _)| *since <= version)?.1;
    Some(end.next_multiple_of(std::mem::align_of::<Config>()))
}

/// `NCCL_VERSION(major, minor, patch)` of nccl.h: the code `ncclGetVersion`
/// gives and a config's `version` field holds.
pub(crate) fn version_code(v: Version) -> c_uint {
    if v.major <= 2 && v.minor <= 8 {
        v.major * 1000 + v.minor * 100 + v.patch
    } else {
        v.major * 10000 + v.minor * 100 + v.patch
    }
}

impl Config {
    /// `NCCL_CONFIG_INITIALIZER` of nccl.h of `library` (capped at the
    /// newest header known here) with `blocking = 0`; `None` for a library
    /// older than 2.14, which has no config.
    pub(crate) fn nonblocking(library: Version) -> Option<Config> {
        let header = library.min(NEWEST);
        let size = size_for(header)?;
        let u = UNDEF_INT;
        let null = std::ptr::null();
        Some(Config {
            size,
            magic: MAGIC,
            version: version_code(header),
            blocking: 0,
            cga_cluster_size: u,
            min_ctas: u,
            max_ctas: u,
            net_name: null,
            split_share: u,
            traffic_class: u,
            comm_name: null,
            collnet_enable: u,
            cta_policy: u,
            shrink_share: u,
            nvls_ctas: u,
            n_channels_per_net_peer: u,
            nvlink_centric_sched: u,
            graph_usage_mode: u,
            num_rma_ctx: u,
            max_p2p_peers: u,
            graph_stream_ordering: u,
        })
    }

    /// The bytes NCCL is told it has (`size`).
    #[cfg(test)]
    fn size(&self) -> usize {
        self.size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes x86-64 and aarch64 compilers give each header's struct
    /// (the fields above, in nccl.h's order).
    #[test]
    fn each_headers_struct_has_its_c_size() {
        assert_eq!(size_for(v(2, 13, 4)), None);
        assert_eq!(size_for(v(2, 14, 3)), Some(24));
        assert_eq!(size_for(v(2, 17, 1)), Some(40));
        assert_eq!(size_for(v(2, 21, 5)), Some(48));
        assert_eq!(size_for(v(2, 26, 2)), Some(48));
        assert_eq!(size_for(v(2, 27, 7)), Some(72));
        assert_eq!(size_for(v(2, 28, 9)), Some(80));
        assert_eq!(size_for(v(2, 29, 7)), Some(88));
        assert_eq!(size_for(v(2, 30, 4)), Some(96));
        assert_eq!(size_for(v(2, 30, 7)), Some(96));
        assert_eq!(size_of::<Config>(), 96);
        assert_eq!(offset_of!(Config, magic), 8);
        assert_eq!(offset_of!(Config, version), 12);
        assert_eq!(offset_of!(Config, blocking), 16);
        assert_eq!(offset_of!(Config, net_name), 32);
        assert_eq!(offset_of!(Config, comm_name), 48);
        assert_eq!(offset_of!(Config, num_rma_ctx), 84);
    }

    #[test]
    fn a_config_claims_the_loaded_header_or_the_newest_known() {
        let c = Config::nonblocking(v(2, 28, 9)).unwrap();
        assert_eq!((c.size(), c.version, c.magic, c.blocking), (80, 22809, 0xcafebeef, 0));
        let c = Config::nonblocking(v(2, 29, 7)).unwrap();
        assert_eq!((c.size(), c.version), (88, 22907));
        let c = Config::nonblocking(v(2, 31, 0)).unwrap();
        assert_eq!((c.size(), c.version), (96, 23007));
        assert!(Config::nonblocking(v(2, 13, 4)).is_none());
        assert_eq!(version_code(v(2, 8, 4)), 2804);
    }
}
