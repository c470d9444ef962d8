//! An open verbs device: `ibv_context`, its port and GID queries, and the
//! source-GID choice per port.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::io;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use super::cq::{CqShared, VerbsCq};
use super::ffi::*;
use super::gid::{parse_sysfs_gid_type, select_gid_index, GidEntry, GidPolicy, GidType};
use super::loader::IbvLib;
use super::pd::{PdShared, VerbsPd};
use crate::device::{DeviceAttr, Gid, LinkLayer, Mtu, PortAttr, PortState};
use crate::provider::{ContextOps, CqOps, PdOps};
use crate::{Error, Result};

/// A port's source GID index and GID, or why there is none.
type SourceGid = std::result::Result<(u8, Gid), String>;

/// State shared by a context and everything made from it; closes the device
/// when the last of them goes.
pub(crate) struct CtxShared {
    pub(crate) lib: Arc<IbvLib>,
    pub(crate) ctx: NonNull<ibv_context>,
    pub(crate) name: String,
    pub(crate) attr: ibv_device_attr,
    /// Ports `RMACOMM_IB_HCA` names for this device (`None`: any).
    pub(crate) allowed_ports: Option<Vec<u8>>,
    pub(crate) gid_policy: GidPolicy,
    sgid: Mutex<HashMap<u8, SourceGid>>,
}

// SAFETY: libibverbs contexts are thread-safe (rdma-core documents every
// verb as callable from any thread); the raw pointer is only passed to them.
unsafe impl Send for CtxShared {}
// SAFETY: as above.
unsafe impl Sync for CtxShared {}

impl Drop for CtxShared {
    fn drop(&mut self) {
        // SAFETY: the context is open and every child object (PD, CQ, QP,
        // MR) holds an Arc of this value, so all of them are gone.
        let r = unsafe { (self.lib.close_device)(self.ctx.as_ptr()) };
        if r != 0 {
            tracing::warn!(device = %self.name, "ibv_close_device failed: {}", io::Error::last_os_error());
        }
    }
}

fn port_state(v: u32) -> PortState {
    match v {
        IBV_PORT_DOWN => PortState::Down,
        IBV_PORT_INIT => PortState::Init,
        IBV_PORT_ARMED => PortState::Armed,
        IBV_PORT_ACTIVE => PortState::Active,
        other => PortState::Other(other),
    }
}

fn mtu(v: u32) -> Mtu {
    match v {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// Link rate from `active_width` × `active_speed` (IB encodings).
pub(crate) fn rate_gbps(width: u8, speed: u8) -> Option<f64> {
    let lanes = match width {
        1 => 1.0,
        2 => 4.0,
        4 => 8.0,
        8 => 12.0,
        16 => 2.0,
        _ => return None,
    };
    let per_lane = match speed {
        1 => 2.5,
        2 => 5.0,
        4 => 10.0,
        8 => 10.3125,
        16 => 14.0625,
        32 => 25.78125,
        64 => 50.0,
        128 => 100.0,
        _ => return None,
    };
    Some(lanes * per_lane)
}

impl CtxShared {
    pub(crate) fn open(
        lib: Arc<IbvLib>,
        ctx: NonNull<ibv_context>,
        name: String,
        filter: &super::hca_filter::HcaFilter,
        gid_policy: GidPolicy,
    ) -> Result<Arc<CtxShared>> {
        // SAFETY: ibv_device_attr is plain data; zero is a valid value.
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is an open context; attr is a valid out-pointer.
        let r = unsafe { (lib.query_device)(ctx.as_ptr(), &mut attr) };
        let allowed_ports = filter.port_list(&name, attr.phys_port_cnt);
        let shared = CtxShared { lib, ctx, name, attr, allowed_ports, gid_policy, sgid: Mutex::new(HashMap::new()) };
        if r != 0 {
            return Err(Error::os("query_device", io::Error::from_raw_os_error(r)));
        }
        Ok(Arc::new(shared))
    }

    pub(crate) fn raw_port(&self, port: u8) -> Result<ibv_port_attr> {
        let mut a = ibv_port_attr::default();
        // SAFETY: ctx is open; `a` is a full-size ibv_port_attr, larger than
        // the compat struct the exported symbol fills.
        let r = unsafe { (self.lib.query_port)(self.ctx.as_ptr(), port, &mut a) };
        if r != 0 {
            return Err(Error::os("query_port", io::Error::from_raw_os_error(r)));
        }
        Ok(a)
    }

    pub(crate) fn link_layer(a: &ibv_port_attr) -> LinkLayer {
        match a.link_layer {
            IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
            _ => LinkLayer::InfiniBand,
        }
    }

    pub(crate) fn port_attr(&self, port: u8) -> Result<PortAttr> {
        let a = self.raw_port(port)?;
        Ok(PortAttr {
            state: port_state(a.state),
            max_mtu: mtu(a.max_mtu),
            active_mtu: mtu(a.active_mtu),
            link_layer: Self::link_layer(&a),
            lid: a.lid,
            gid_tbl_len: a.gid_tbl_len.max(0) as u32,
            rate_gbps: rate_gbps(a.active_width, a.active_speed),
        })
    }

    pub(crate) fn gid(&self, port: u8, index: u32) -> Result<Gid> {
        let mut g = ibv_gid::default();
        let idx = i32::try_from(index).map_err(|_| Error::invalid("query_gid", "index out of range"))?;
        // SAFETY: ctx is open; g is a valid out-pointer.
        let r = unsafe { (self.lib.query_gid)(self.ctx.as_ptr(), port, idx, &mut g) };
        if r != 0 {
            return Err(Error::os("query_gid", io::Error::last_os_error()));
        }
        Ok(Gid(g.raw))
    }

    /// The non-empty GID table entries of a port, with their types.
    fn gid_table(&self, port: u8, len: u32) -> Vec<GidEntry> {
        let mut out = Vec::new();
        for index in 0..len {
            if let Some(query_ex) = self.lib.query_gid_ex {
                let mut e = ibv_gid_entry::default();
                // SAFETY: ctx is open; e is a valid ibv_gid_entry of the size passed.
                let r = unsafe {
                    query_ex(self.ctx.as_ptr(), port as u32, index, &mut e, 0, std::mem::size_of::<ibv_gid_entry>())
                };
                if r != 0 {
                    continue; // ENODATA: empty slot
                }
                let ty = match e.gid_type {
                    IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
                    IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
                    _ => GidType::Ib,
                };
                out.push(GidEntry { index, gid: Gid(e.gid.raw), ty });
            } else {
                let Ok(gid) = self.gid(port, index) else { continue };
                if gid.is_zero() {
                    continue;
                }
                let types = Path::new("/sys/class/infiniband")
                    .join(&self.name)
                    .join(format!("ports/{port}/gid_attrs/types/{index}"));
                let ty =
                    std::fs::read_to_string(types).ok().and_then(|s| parse_sysfs_gid_type(&s)).unwrap_or(GidType::Ib);
                out.push(GidEntry { index, gid, ty });
            }
        }
        out
    }

    /// The source GID index and GID a QP on `port` uses (cached per port).
    pub(crate) fn source_gid(&self, port: u8) -> Result<(u8, Gid)> {
        let mut cache = self.sgid.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = cache.get(&port) {
            return r.clone().map_err(|reason| Error::Unavailable { provider: "verbs", reason });
        }
        let a = self.raw_port(port)?;
        let link = Self::link_layer(&a);
        let table = self.gid_table(port, a.gid_tbl_len.max(0) as u32);
        let r = select_gid_index(&table, link, &self.gid_policy)
            .and_then(|i| u8::try_from(i).map_err(|_| format!("GID index {i} does not fit the 8-bit sgid_index")))
            .map(|i| (i, table.iter().find(|e| e.index == i as u32).map(|e| e.gid).unwrap_or_default()))
            .map_err(|e| format!("verbs: {} port {port}: {e}", self.name));
        if let Ok((i, g)) = &r {
            tracing::debug!(device = %self.name, port, index = i, gid = ?g, "source GID chosen");
        }
        cache.insert(port, r.clone());
        r.map_err(|reason| Error::Unavailable { provider: "verbs", reason })
    }

    /// Checks a port against `RMACOMM_IB_HCA`'s port list.
    pub(crate) fn check_port(&self, port: u8) -> Result<()> {
        match &self.allowed_ports {
            Some(ports) if !ports.contains(&port) => Err(Error::invalid(
                "modify_qp",
                format!(
                    "RMACOMM_IB_HCA allows ports {ports:?} of {}; set InitAttr::port_num to one of them",
                    self.name
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The port QPs default to: the first port `RMACOMM_IB_HCA` names, else 1.
    pub(crate) fn default_port(&self) -> u8 {
        self.allowed_ports.as_ref().and_then(|p| p.first().copied()).unwrap_or(1)
    }
}

/// The verbs provider's [`ContextOps`].
pub(crate) struct VerbsContext {
    pub(crate) shared: Arc<CtxShared>,
}

impl fmt::Debug for VerbsContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsContext").field("device", &self.shared.name).finish()
    }
}

impl ContextOps for VerbsContext {
    fn query_device(&self) -> Result<DeviceAttr> {
        let a = &self.shared.attr;
        let max_msg_sz = self.shared.raw_port(self.shared.default_port()).map(|p| p.max_msg_sz).unwrap_or(1 << 30);
        let u = |v: i32| v.max(0) as u32;
        Ok(DeviceAttr {
            max_mr_size: a.max_mr_size,
            max_qp: u(a.max_qp),
            max_qp_wr: u(a.max_qp_wr),
            max_sge: u(a.max_sge),
            max_cqe: u(a.max_cqe),
            max_mr: u(a.max_mr),
            max_qp_rd_atom: u(a.max_qp_rd_atom),
            phys_port_cnt: a.phys_port_cnt,
            max_msg_sz,
            // ibv_query_device does not report it; QpCaps::max_inline_data
            // of a created QP is what the HCA granted.
            max_inline_data: 0,
        })
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        self.shared.port_attr(port)
    }

    fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        self.shared.gid(port, index)
    }

    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>> {
        Ok(Arc::new(VerbsPd { shared: PdShared::alloc(self.shared.clone())? }))
    }

    fn create_cq(&self, cqe: usize) -> Result<Arc<dyn CqOps>> {
        Ok(Arc::new(VerbsCq { shared: CqShared::create(self.shared.clone(), cqe)? }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_rates() {
        assert_eq!(rate_gbps(2, 64), Some(200.0), "4x HDR");
        assert_eq!(rate_gbps(2, 128), Some(400.0), "4x NDR");
        assert_eq!(rate_gbps(1, 32), Some(25.78125), "1x EDR (25G RoCE)");
        assert_eq!(rate_gbps(3, 1), None);
    }

    #[test]
    fn enums() {
        assert_eq!(port_state(4), PortState::Active);
        assert_eq!(port_state(9), PortState::Other(9));
        assert_eq!(mtu(3), Mtu::Mtu1024);
    }
}
