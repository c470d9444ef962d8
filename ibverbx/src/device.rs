//! Devices, their attributes and port attributes.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::provider::Provider;
use crate::{Context, Result};

/// A 128-bit global identifier (`union ibv_gid`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The GID of an IPv4 address in RoCE v2 form (`::ffff:a.b.c.d`).
    pub fn from_ipv4(ip: std::net::Ipv4Addr) -> Gid {
        Gid(ip.to_ipv6_mapped().octets())
    }

    /// True for the all-zero GID (an empty table slot).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", std::net::Ipv6Addr::from(self.0))
    }
}

/// Path MTU (`enum ibv_mtu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

/// Port state (`enum ibv_port_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortState {
    /// Link down.
    Down,
    /// Initialising.
    Init,
    /// Armed.
    Armed,
    /// Active: usable.
    Active,
    /// Other state (raw value).
    Other(u32),
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    /// InfiniBand.
    InfiniBand,
    /// Ethernet (RoCE).
    Ethernet,
    /// The soft provider: shared memory within a host, TCP between hosts.
    Soft,
}

/// What a port reports (`struct ibv_port_attr`, the fields rmacomm uses).
#[derive(Debug, Clone, PartialEq)]
pub struct PortAttr {
    /// Port state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU in use.
    pub active_mtu: Mtu,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Local identifier (InfiniBand).
    pub lid: u16,
    /// Entries in the GID table.
    pub gid_tbl_len: u32,
    /// Link speed in Gb/s per lane times the width, when known.
    pub rate_gbps: Option<f64>,
}

/// Device capabilities (`struct ibv_device_attr`, the fields rmacomm uses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Largest single registration.
    pub max_mr_size: u64,
    /// Most QPs.
    pub max_qp: u32,
    /// Most outstanding WRs per queue.
    pub max_qp_wr: u32,
    /// Most SGEs per WR.
    pub max_sge: u32,
    /// Most entries per CQ.
    pub max_cqe: u32,
    /// Most MRs.
    pub max_mr: u32,
    /// Most outstanding RDMA READs/atomics a QP can be target of.
    pub max_qp_rd_atom: u32,
    /// Ports on the device.
    pub phys_port_cnt: u8,
    /// Largest message (`max_msg_sz` of the port).
    pub max_msg_sz: u32,
    /// Most bytes of inline data per send WR.
    pub max_inline_data: u32,
}

/// A device as listed by its provider (`struct ibv_device` plus what
/// device selection needs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `mlx5_0`, or `soft0`.
    pub name: String,
    /// The provider that lists it: `"verbs"` or `"soft"`.
    pub provider: &'static str,
    /// Node GUID (0 where unknown).
    pub guid: u64,
    /// NUMA node of the device, when known.
    pub numa_node: Option<u32>,
    /// PCI address (`0000:3b:00.0`), when known.
    pub pci_addr: Option<String>,
}

/// A device ready to be opened.
#[derive(Clone)]
pub struct Device {
    pub(crate) info: DeviceInfo,
    pub(crate) provider: Arc<dyn Provider>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device").field("info", &self.info).finish()
    }
}

impl Device {
    /// What the provider reported about the device.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// Opens the device (`ibv_open_device`).
    pub fn open(&self) -> Result<Context> {
        let ops = self.provider.open_device(&self.info)?;
        Ok(Context::from_ops(ops, self.info.clone()))
    }
}
