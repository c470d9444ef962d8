//! Source-GID choice for RoCE: which entry of a port's GID table a QP sends
//! from.
//!
//! RoCE ports list every IP address of the netdev twice (RoCE v1 and v2)
//! plus link-local entries. The rule, as NCCL's: prefer RoCE v2, then the
//! wanted IP family (IPv4 unless `RMACOMM_IB_ADDR_FAMILY` says otherwise),
//! then non-link-local addresses, then the lowest index.
//! `RMACOMM_IB_GID_INDEX` overrides the choice. InfiniBand ports use index 0.
//!
//! Pure selection over a table; the context reads the table.

use crate::device::{Gid, LinkLayer};

/// RoCE version / GID type (`enum ibv_gid_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GidType {
    /// InfiniBand GID.
    Ib,
    /// RoCE v1 (Ethernet, no IP header).
    RoceV1,
    /// RoCE v2 (UDP/IP): routable.
    RoceV2,
}

/// One non-empty GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the port's table.
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub ty: GidType,
}

/// Which IP family a RoCE GID should carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AddrFamily {
    /// IPv4-mapped GIDs (`::ffff:a.b.c.d`) first.
    #[default]
    Ipv4,
    /// IPv6 GIDs first.
    Ipv6,
}

impl AddrFamily {
    /// Parses `AF_INET`, `AF_INET6`, `ipv4`, `ipv6`, `4`, `6`.
    pub fn parse(s: &str) -> Option<AddrFamily> {
        match s.trim().to_ascii_lowercase().as_str() {
            "af_inet" | "ipv4" | "inet" | "4" => Some(AddrFamily::Ipv4),
            "af_inet6" | "ipv6" | "inet6" | "6" => Some(AddrFamily::Ipv6),
            _ => None,
        }
    }
}

/// The GID policy from the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GidPolicy {
    /// `RMACOMM_IB_GID_INDEX`: use this index, whatever its type.
    pub index: Option<u32>,
    /// `RMACOMM_IB_ADDR_FAMILY`.
    pub family: AddrFamily,
}

impl GidPolicy {
    /// Reads `RMACOMM_IB_GID_INDEX` and `RMACOMM_IB_ADDR_FAMILY`.
    pub fn from_env() -> Result<GidPolicy, String> {
        let index = match std::env::var("RMACOMM_IB_GID_INDEX") {
            Err(_) => None,
            Ok(v) if v.trim().is_empty() => None,
            Ok(v) => Some(
                v.trim().parse::<u32>().map_err(|_| format!("RMACOMM_IB_GID_INDEX={v:?} is not a GID table index"))?,
            ),
        };
        let family = match std::env::var("RMACOMM_IB_ADDR_FAMILY") {
            Err(_) => AddrFamily::default(),
            Ok(v) => AddrFamily::parse(&v)
                .ok_or_else(|| format!("RMACOMM_IB_ADDR_FAMILY={v:?} is not one of AF_INET, AF_INET6"))?,
        };
        Ok(GidPolicy { index, family })
    }
}

fn is_ipv4_mapped(g: &Gid) -> bool {
    g.0[..10] == [0; 10] && g.0[10] == 0xff && g.0[11] == 0xff
}

fn is_link_local(g: &Gid) -> bool {
    g.0[0] == 0xfe && (g.0[1] & 0xc0) == 0x80
}

/// Chooses the source GID index for a port. `entries` holds the non-empty
/// entries of its table. Errors say what is wrong in words a user can act on.
pub fn select_gid_index(entries: &[GidEntry], link: LinkLayer, policy: &GidPolicy) -> Result<u32, String> {
    if let Some(i) = policy.index {
        return match entries.iter().find(|e| e.index == i) {
            Some(_) => Ok(i),
            None => Err(format!("RMACOMM_IB_GID_INDEX={i}: that GID table entry is empty or out of range")),
        };
    }
    if link != LinkLayer::Ethernet {
        return Ok(0);
    }
    let best = entries.iter().filter(|e| !e.gid.is_zero()).min_by_key(|e| {
        let v4 = is_ipv4_mapped(&e.gid);
        let family_rank = match (policy.family, v4) {
            (AddrFamily::Ipv4, true) | (AddrFamily::Ipv6, false) => 0,
            _ => 1,
        };
        let type_rank = match e.ty {
            GidType::RoceV2 => 0,
            GidType::RoceV1 => 1,
            GidType::Ib => 2,
        };
        (type_rank, family_rank, is_link_local(&e.gid) as u8, e.index)
    });
    best.map(|e| e.index).ok_or_else(|| {
        "the port's GID table is empty: give the netdev an IP address (RoCE needs one) or set RMACOMM_IB_GID_INDEX"
            .to_owned()
    })
}

/// The GID type sysfs names in `ports/N/gid_attrs/types/I`.
pub(crate) fn parse_sysfs_gid_type(s: &str) -> Option<GidType> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("RoCE v2") {
        Some(GidType::RoceV2)
    } else if s.eq_ignore_ascii_case("IB/RoCE v1") || s.eq_ignore_ascii_case("RoCE v1") {
        Some(GidType::RoceV1)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    fn v6(s: &str) -> Gid {
        Gid(s.parse::<Ipv6Addr>().unwrap().octets())
    }

    fn v4(s: &str) -> Gid {
        Gid::from_ipv4(s.parse::<Ipv4Addr>().unwrap())
    }

    /// A typical mlx5 RoCE table: link-local v1/v2, then IPv4 v1/v2, then a
    /// global IPv6 v1/v2.
    fn roce_table() -> Vec<GidEntry> {
        let e = |index, gid, ty| GidEntry { index, gid, ty };
        vec![
            e(0, v6("fe80::1"), GidType::RoceV1),
            e(1, v6("fe80::1"), GidType::RoceV2),
            e(2, v4("10.0.0.5"), GidType::RoceV1),
            e(3, v4("10.0.0.5"), GidType::RoceV2),
            e(4, v6("2001:db8::5"), GidType::RoceV1),
            e(5, v6("2001:db8::5"), GidType::RoceV2),
        ]
    }

    #[test]
    fn roce_v2_ipv4_by_default() {
        assert_eq!(select_gid_index(&roce_table(), LinkLayer::Ethernet, &GidPolicy::default()), Ok(3));
    }

    #[test]
    fn ipv6_family_picks_global_v6_over_link_local() {
        let p = GidPolicy { family: AddrFamily::Ipv6, index: None };
        assert_eq!(select_gid_index(&roce_table(), LinkLayer::Ethernet, &p), Ok(5));
    }

    #[test]
    fn only_link_local_v6_when_nothing_else() {
        let t: Vec<_> = roce_table().into_iter().take(2).collect();
        assert_eq!(select_gid_index(&t, LinkLayer::Ethernet, &GidPolicy::default()), Ok(1));
    }

    #[test]
    fn roce_v1_only_table_falls_back_to_v1() {
        let t: Vec<_> = roce_table().into_iter().filter(|e| e.ty == GidType::RoceV1).collect();
        assert_eq!(select_gid_index(&t, LinkLayer::Ethernet, &GidPolicy::default()), Ok(2));
    }

    #[test]
    fn override_wins_but_must_exist() {
        let p = GidPolicy { index: Some(0), ..GidPolicy::default() };
        assert_eq!(select_gid_index(&roce_table(), LinkLayer::Ethernet, &p), Ok(0));
        let p = GidPolicy { index: Some(9), ..GidPolicy::default() };
        assert!(select_gid_index(&roce_table(), LinkLayer::Ethernet, &p)
            .unwrap_err()
            .contains("RMACOMM_IB_GID_INDEX=9"));
    }

    #[test]
    fn infiniband_uses_index_0() {
        let t = [GidEntry { index: 0, gid: v6("fe80::2"), ty: GidType::Ib }];
        assert_eq!(select_gid_index(&t, LinkLayer::InfiniBand, &GidPolicy::default()), Ok(0));
    }

    #[test]
    fn empty_roce_table_is_an_error() {
        assert!(select_gid_index(&[], LinkLayer::Ethernet, &GidPolicy::default()).unwrap_err().contains("IP address"));
    }

    #[test]
    fn parsing() {
        assert_eq!(AddrFamily::parse("AF_INET6"), Some(AddrFamily::Ipv6));
        assert_eq!(AddrFamily::parse("af_inet"), Some(AddrFamily::Ipv4));
        assert_eq!(AddrFamily::parse("x"), None);
        assert_eq!(parse_sysfs_gid_type("RoCE v2\n"), Some(GidType::RoceV2));
        assert_eq!(parse_sysfs_gid_type("IB/RoCE v1\n"), Some(GidType::RoceV1));
        assert_eq!(parse_sysfs_gid_type(""), None);
    }
}
