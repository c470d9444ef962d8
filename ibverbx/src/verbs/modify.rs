//! `ibv_qp_attr` + attribute mask for each QP transition (pure: no FFI
//! calls, so the attribute construction is unit-tested).

use std::os::raw::c_int;

use super::ffi::*;
use crate::device::{LinkLayer, Mtu};
use crate::qp_attr::{InitAttr, RtrAttr, RtsAttr};

/// What the RTR transition needs to know about the local port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LocalPort {
    /// 1-based port number.
    pub(crate) port_num: u8,
    /// Link layer: RoCE always needs a GRH.
    pub(crate) link_layer: LinkLayer,
    /// Active MTU of the port.
    pub(crate) active_mtu: Mtu,
    /// Source GID index chosen for the port (see `gid.rs`).
    pub(crate) sgid_index: u8,
}

/// Device limits the attributes are clamped to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// `max_qp_rd_atom`: READs/atomics a QP can serve as responder.
    pub(crate) max_qp_rd_atom: u8,
    /// `max_qp_init_rd_atom`: READs/atomics a QP can have outstanding.
    pub(crate) max_qp_init_rd_atom: u8,
}

const PSN_MASK: u32 = 0x00ff_ffff;

/// The largest MTU not above `bytes` (an endpoint carries bytes).
pub(crate) fn mtu_from_bytes(bytes: u32) -> Option<Mtu> {
    [Mtu::Mtu4096, Mtu::Mtu2048, Mtu::Mtu1024, Mtu::Mtu512, Mtu::Mtu256].into_iter().find(|m| m.bytes() <= bytes)
}

/// RESET → INIT.
pub(crate) fn init_attr(a: &InitAttr) -> Result<(ibv_qp_attr, c_int), String> {
    if a.port_num == 0 {
        return Err("port_num is 1-based".into());
    }
    let attr = ibv_qp_attr {
        qp_state: IBV_QPS_INIT,
        pkey_index: a.pkey_index,
        port_num: a.port_num,
        qp_access_flags: a.access.bits(),
        ..ibv_qp_attr::default()
    };
    Ok((attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
}

/// INIT → RTR: path MTU (the smaller of the two ports' unless given),
/// address vector (GRH on RoCE or when the peer has no LID), receive PSN,
/// responder resources and RNR timer.
pub(crate) fn rtr_attr(a: &RtrAttr, port: &LocalPort, limits: &Limits) -> Result<(ibv_qp_attr, c_int), String> {
    if a.min_rnr_timer > 31 {
        return Err(format!("min_rnr_timer {} is not a 5-bit IB encoding", a.min_rnr_timer));
    }
    let remote = &a.remote;
    if remote.soft.is_some() {
        return Err("the peer endpoint belongs to a soft-provider QP; connect verbs QPs to verbs QPs".into());
    }
    let path_mtu = match a.path_mtu {
        Some(m) => m,
        None => {
            let peer = mtu_from_bytes(remote.mtu)
                .ok_or_else(|| format!("peer MTU {} bytes is below the smallest IB MTU", remote.mtu))?;
            peer.min(port.active_mtu)
        }
    };
    let global = port.link_layer == LinkLayer::Ethernet || remote.lid == 0;
    if global && remote.gid.is_zero() {
        return Err("the peer endpoint has no GID, which RoCE (or a peer without LID) needs".into());
    }
    let sgid_index = if a.sgid_index != 0 { a.sgid_index } else { port.sgid_index };
    let ah_attr = ibv_ah_attr {
        grh: ibv_global_route {
            dgid: ibv_gid { raw: remote.gid.0 },
            flow_label: 0,
            sgid_index,
            hop_limit: if global { a.hop_limit.max(1) } else { 0 },
            traffic_class: 0,
        },
        dlid: if port.link_layer == LinkLayer::Ethernet { 0 } else { remote.lid },
        sl: a.sl,
        src_path_bits: 0,
        static_rate: 0,
        is_global: global as u8,
        port_num: port.port_num,
    };
    let attr = ibv_qp_attr {
        qp_state: IBV_QPS_RTR,
        path_mtu: path_mtu as u32,
        dest_qp_num: remote.qpn,
        rq_psn: remote.psn & PSN_MASK,
        max_dest_rd_atomic: a.max_dest_rd_atomic.min(limits.max_qp_rd_atom),
        min_rnr_timer: a.min_rnr_timer,
        ah_attr,
        ..ibv_qp_attr::default()
    };
    let mask = IBV_QP_STATE
        | IBV_QP_AV
        | IBV_QP_PATH_MTU
        | IBV_QP_DEST_QPN
        | IBV_QP_RQ_PSN
        | IBV_QP_MAX_DEST_RD_ATOMIC
        | IBV_QP_MIN_RNR_TIMER;
    Ok((attr, mask))
}

/// RTR → RTS: ACK timeout, retry counts, send PSN (`sq_psn`, or the PSN this
/// QP advertised in its endpoint when `sq_psn` is 0), initiator depth.
pub(crate) fn rts_attr(a: &RtsAttr, own_psn: u32, limits: &Limits) -> Result<(ibv_qp_attr, c_int), String> {
    if a.timeout > 31 {
        return Err(format!("timeout {} is not a 5-bit IB encoding", a.timeout));
    }
    if a.retry_cnt > 7 || a.rnr_retry > 7 {
        return Err(format!("retry_cnt {} / rnr_retry {} must be 0..=7", a.retry_cnt, a.rnr_retry));
    }
    let attr = ibv_qp_attr {
        qp_state: IBV_QPS_RTS,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        sq_psn: if a.sq_psn != 0 { a.sq_psn & PSN_MASK } else { own_psn & PSN_MASK },
        max_rd_atomic: a.max_rd_atomic.min(limits.max_qp_init_rd_atom),
        ..ibv_qp_attr::default()
    };
    let mask =
        IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
    Ok((attr, mask))
}

/// A state-only transition (ERR, RESET).
pub(crate) fn state_attr(state: u32) -> (ibv_qp_attr, c_int) {
    (ibv_qp_attr { qp_state: state, ..ibv_qp_attr::default() }, IBV_QP_STATE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AccessFlags, Gid, QpEndpoint};

    const LIMITS: Limits = Limits { max_qp_rd_atom: 16, max_qp_init_rd_atom: 8 };

    fn endpoint(lid: u16, mtu: u32) -> QpEndpoint {
        QpEndpoint {
            qpn: 0x1234,
            psn: 0x0abc_def1,
            lid,
            gid: Gid::from_ipv4("10.0.0.7".parse().unwrap()),
            mtu,
            soft: None,
        }
    }

    fn roce_port() -> LocalPort {
        LocalPort { port_num: 1, link_layer: LinkLayer::Ethernet, active_mtu: Mtu::Mtu1024, sgid_index: 3 }
    }

    #[test]
    fn init() {
        let (a, m) = init_attr(&InitAttr { port_num: 2, pkey_index: 1, access: AccessFlags::REMOTE_WRITE }).unwrap();
        assert_eq!((a.qp_state, a.port_num, a.pkey_index, a.qp_access_flags), (IBV_QPS_INIT, 2, 1, 2));
        assert_eq!(m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
        assert!(init_attr(&InitAttr { port_num: 0, ..InitAttr::default() }).is_err());
    }

    #[test]
    fn rtr_on_roce_uses_grh_port_mtu_and_chosen_gid() {
        let (a, m) = rtr_attr(&RtrAttr::new(endpoint(0, 4096)), &roce_port(), &LIMITS).unwrap();
        assert_eq!(a.qp_state, IBV_QPS_RTR);
        assert_eq!(a.path_mtu, Mtu::Mtu1024 as u32, "min(port 1024, peer 4096)");
        assert_eq!(a.dest_qp_num, 0x1234);
        assert_eq!(a.rq_psn, 0xbc_def1, "24-bit PSN");
        assert_eq!(a.ah_attr.is_global, 1);
        assert_eq!(a.ah_attr.grh.sgid_index, 3);
        assert_eq!(a.ah_attr.grh.hop_limit, 64);
        assert_eq!(a.ah_attr.grh.dgid.raw, endpoint(0, 0).gid.0);
        assert_eq!(a.ah_attr.dlid, 0);
        assert_eq!(a.ah_attr.port_num, 1);
        assert_eq!(a.max_dest_rd_atomic, 16);
        assert_eq!(a.min_rnr_timer, 12);
        assert_eq!(m & IBV_QP_AV, IBV_QP_AV);
        assert_eq!(m & IBV_QP_MIN_RNR_TIMER, IBV_QP_MIN_RNR_TIMER);
    }

    #[test]
    fn rtr_explicit_values_win() {
        let r = RtrAttr {
            path_mtu: Some(Mtu::Mtu512),
            sgid_index: 1,
            max_dest_rd_atomic: 200,
            ..RtrAttr::new(endpoint(0, 4096))
        };
        let (a, _) = rtr_attr(&r, &roce_port(), &LIMITS).unwrap();
        assert_eq!(a.path_mtu, Mtu::Mtu512 as u32);
        assert_eq!(a.ah_attr.grh.sgid_index, 1);
        assert_eq!(a.max_dest_rd_atomic, 16, "clamped to the device");
    }

    #[test]
    fn rtr_on_infiniband_uses_lid() {
        let port = LocalPort { link_layer: LinkLayer::InfiniBand, active_mtu: Mtu::Mtu4096, ..roce_port() };
        let (a, _) = rtr_attr(&RtrAttr::new(endpoint(7, 2048)), &port, &LIMITS).unwrap();
        assert_eq!(a.ah_attr.is_global, 0);
        assert_eq!(a.ah_attr.dlid, 7);
        assert_eq!(a.path_mtu, Mtu::Mtu2048 as u32);
    }

    #[test]
    fn rtr_refuses_bad_input() {
        let mut e = endpoint(0, 4096);
        e.gid = Gid::default();
        assert!(rtr_attr(&RtrAttr::new(e), &roce_port(), &LIMITS).unwrap_err().contains("no GID"));
        let r = RtrAttr { min_rnr_timer: 40, ..RtrAttr::new(endpoint(0, 4096)) };
        assert!(rtr_attr(&r, &roce_port(), &LIMITS).is_err());
        assert!(rtr_attr(&RtrAttr::new(endpoint(0, 100)), &roce_port(), &LIMITS).is_err());
    }

    #[test]
    fn rts() {
        let (a, m) = rts_attr(&RtsAttr::default(), 0x55, &LIMITS).unwrap();
        assert_eq!((a.qp_state, a.timeout, a.retry_cnt, a.rnr_retry), (IBV_QPS_RTS, 16, 7, 7));
        assert_eq!(a.sq_psn, 0x55, "the advertised PSN when sq_psn is 0");
        assert_eq!(a.max_rd_atomic, 8, "clamped to max_qp_init_rd_atom");
        assert_eq!(m & IBV_QP_SQ_PSN, IBV_QP_SQ_PSN);
        let (a, _) = rts_attr(&RtsAttr { sq_psn: 9, ..RtsAttr::default() }, 0x55, &LIMITS).unwrap();
        assert_eq!(a.sq_psn, 9);
        assert!(rts_attr(&RtsAttr { retry_cnt: 8, ..RtsAttr::default() }, 0, &LIMITS).is_err());
        assert!(rts_attr(&RtsAttr { timeout: 32, ..RtsAttr::default() }, 0, &LIMITS).is_err());
    }

    #[test]
    fn mtus() {
        assert_eq!(mtu_from_bytes(4096), Some(Mtu::Mtu4096));
        assert_eq!(mtu_from_bytes(9000), Some(Mtu::Mtu4096));
        assert_eq!(mtu_from_bytes(1500), Some(Mtu::Mtu1024));
        assert_eq!(mtu_from_bytes(255), None);
    }
}
