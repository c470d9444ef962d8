//! The verbs provider: rdma-core's libibverbs, opened at run time.
//!
//! Nothing links against libibverbs: the `loader` module `dlopen`s `libibverbs.so.1`
//! and resolves versioned symbols the first time the provider is asked for,
//! so one binary runs on machines with and without RDMA. Every way of not
//! having RDMA — no library, an old library, a kernel without RDMA
//! (`ibv_get_device_list` fails with `ENOSYS`), no device, a
//! `RMACOMM_IB_HCA` that excludes every device — becomes
//! [`Error::Unavailable`] with the reason, and `RMACOMM_PROVIDER=auto` then
//! uses the soft provider.
//!
//! # Environment
//! - `RMACOMM_IB_HCA`: devices and ports to use, `NCCL_IB_HCA` syntax
//!   ([`HcaFilter`]);
//! - `RMACOMM_IB_GID_INDEX`: source GID index (RoCE), else chosen by
//!   [`select_gid_index`]; `RMACOMM_IB_ADDR_FAMILY=AF_INET|AF_INET6`.
//!
//! # Organization
//! - `ffi`: `#[repr(C)]` mirrors of verbs.h; `loader`: dlopen + symbols
//! - `hca_filter`, `gid`, `topology` (+ `topology_hwloc`), `modify`,
//!   `wr_ring`: pure logic, unit-tested without hardware
//! - `context`, `pd`, `mr`, `cq`, `qp`: the seam's traits over libibverbs

pub mod ffi;
mod gid;
mod hca_filter;
mod loader;
mod modify;
mod topology;
#[cfg(feature = "hwloc")]
mod topology_hwloc;
mod wr_ring;

mod context;
mod cq;
mod mr;
mod pd;
mod qp;

use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

pub use gid::{select_gid_index, AddrFamily, GidEntry, GidPolicy, GidType};
pub use hca_filter::{HcaEntry, HcaFilter};
pub use loader::{load, IbvLib, LoadError, LIBIBVERBS_SONAME};
pub use pd::VerbsPd;
pub use topology::{rank, tree_distance, Locality, Near};

use crate::device::DeviceInfo;
use crate::provider::{ContextOps, MrOps, Provider};
use crate::{AccessFlags, Device, Error, ProtectionDomain, Result};

/// The reason text for a kernel without RDMA support.
pub const NO_KERNEL_RDMA: &str = "verbs: no RDMA devices (kernel has no RDMA support)";

fn unavailable(reason: impl Into<String>) -> Error {
    Error::Unavailable { provider: "verbs", reason: reason.into() }
}

/// What `ibv_get_device_list` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scan {
    /// The devices, in libibverbs' order, before `RMACOMM_IB_HCA`.
    pub devices: Vec<DeviceInfo>,
    /// Why there are none, when there are none.
    pub why_none: Option<String>,
}

/// The verbs provider over one loaded libibverbs.
#[derive(Debug)]
pub struct VerbsProvider {
    lib: Arc<IbvLib>,
}

impl VerbsProvider {
    /// A provider over an already loaded library (tests load other sonames).
    pub fn new(lib: IbvLib) -> Arc<VerbsProvider> {
        Arc::new(VerbsProvider { lib: Arc::new(lib) })
    }

    /// The process-wide provider over `libibverbs.so.1`, loaded on first use.
    pub fn get() -> std::result::Result<Arc<VerbsProvider>, LoadError> {
        static PROVIDER: OnceLock<std::result::Result<Arc<VerbsProvider>, LoadError>> = OnceLock::new();
        PROVIDER.get_or_init(|| load(LIBIBVERBS_SONAME).map(VerbsProvider::new)).clone()
    }

    /// The loaded library.
    pub fn lib(&self) -> &IbvLib {
        &self.lib
    }

    /// Calls `ibv_get_device_list`. `NULL` with `ENOSYS` (a kernel without
    /// RDMA) is zero devices with [`NO_KERNEL_RDMA`] as the reason.
    pub fn scan(&self) -> Result<Scan> {
        let lib = &*self.lib;
        let mut n: i32 = 0;
        // SAFETY: errno is thread-local; clearing it lets a NULL return
        // without errno be told apart.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: `n` is a valid out-pointer.
        let list = unsafe { (lib.get_device_list)(&mut n) };
        if list.is_null() {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOSYS) | Some(0) | None => Ok(Scan {
                    devices: Vec::new(),
                    why_none: Some(format!(
                        "{NO_KERNEL_RDMA}: ibv_get_device_list: {e}; load the RDMA kernel modules \
                         (e.g. ib_uverbs and the HCA driver) or use RMACOMM_PROVIDER=soft"
                    )),
                }),
                _ => Err(Error::os("get_device_list", e)),
            };
        }
        let mut devices = Vec::with_capacity(n.max(0) as usize);
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` device pointers.
            let dev = unsafe { *list.add(i) };
            if dev.is_null() {
                break;
            }
            // SAFETY: `dev` is a listed device; the name is a NUL-terminated
            // string inside it.
            let name = unsafe { loader::c_str((lib.get_device_name)(dev)) };
            // SAFETY: as above; the GUID comes back in network order.
            let guid = u64::from_be(unsafe { (lib.get_device_guid)(dev) });
            let loc = topology::probe_rdma_device(&name);
            devices.push(DeviceInfo {
                pci_addr: topology::rdma_device_pci_addr(&name),
                numa_node: loc.numa_node,
                name,
                provider: "verbs",
                guid,
            });
        }
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { (lib.free_device_list)(list) };
        let why_none = devices.is_empty().then(|| {
            if std::path::Path::new("/sys/class/infiniband").exists() {
                "verbs: no RDMA devices (libibverbs lists none: is the HCA's provider library, e.g. libmlx5 \
                 from ibverbs-providers, installed?)"
                    .to_owned()
            } else {
                format!("{NO_KERNEL_RDMA}: /sys/class/infiniband does not exist")
            }
        });
        Ok(Scan { devices, why_none })
    }

    /// The devices `RMACOMM_IB_HCA` admits, nearest to `near` first, as
    /// openable [`Device`]s; an error that says why when there are none.
    pub fn devices_near(self: &Arc<Self>, near: &Near) -> Result<Vec<Device>> {
        let filter = HcaFilter::from_env().map_err(|e| Error::invalid("devices", e))?;
        let scan = self.scan()?;
        if let Some(why) = scan.why_none {
            return Err(unavailable(why));
        }
        let all: Vec<String> = scan.devices.iter().map(|d| d.name.clone()).collect();
        let kept: Vec<DeviceInfo> = scan.devices.into_iter().filter(|d| filter.allows_device(&d.name)).collect();
        if kept.is_empty() {
            // Devices there are, and the setting names none: a mistake, not
            // a machine without RDMA (auto must not go soft over it).
            return Err(Error::invalid(
                "devices",
                format!("no RDMA device matches RMACOMM_IB_HCA={filter} (devices: {})", all.join(", ")),
            ));
        }
        let order = rank_devices(&kept, near);
        let provider: Arc<dyn Provider> = self.clone();
        Ok(order.into_iter().map(|i| Device { info: kept[i].clone(), provider: provider.clone() }).collect())
    }
}

/// Orders devices by nearness (hwloc with the `hwloc` feature, else sysfs);
/// falls back to name order when the target cannot be located.
fn rank_devices(devs: &[DeviceInfo], near: &Near) -> Vec<usize> {
    #[cfg(feature = "hwloc")]
    {
        match topology_hwloc::topology().and_then(|t| {
            let target = topology_hwloc::target_locality(&t, near)?;
            let cands: Vec<(String, Locality)> = devs
                .iter()
                .map(|d| {
                    let l = d.pci_addr.as_deref().and_then(|a| topology_hwloc::pci_locality(&t, a));
                    (d.name.clone(), l.unwrap_or_else(|| topology::probe_rdma_device(&d.name)))
                })
                .collect();
            Ok(rank(&cands, &target, &topology::sysfs_numa_distance))
        }) {
            Ok(order) => return order,
            Err(e) => tracing::debug!("hwloc ranking unavailable ({e}); using sysfs"),
        }
    }
    let target = topology::probe_target_sysfs(near).unwrap_or_else(|e| {
        tracing::warn!("cannot locate {near:?}: {e}; devices stay in name order");
        Locality::default()
    });
    let cands: Vec<(String, Locality)> =
        devs.iter().map(|d| (d.name.clone(), topology::probe_rdma_device(&d.name))).collect();
    rank(&cands, &target, &topology::sysfs_numa_distance)
}

impl Provider for VerbsProvider {
    fn name(&self) -> &'static str {
        "verbs"
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        let filter = HcaFilter::from_env().map_err(|e| Error::invalid("devices", e))?;
        Ok(self.scan()?.devices.into_iter().filter(|d| filter.allows_device(&d.name)).collect())
    }

    fn open_device(&self, device: &DeviceInfo) -> Result<Arc<dyn ContextOps>> {
        let filter = HcaFilter::from_env().map_err(|e| Error::invalid("open_device", e))?;
        let policy = GidPolicy::from_env().map_err(|e| Error::invalid("open_device", e))?;
        let lib = &*self.lib;
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer.
        let list = unsafe { (lib.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(unavailable(NO_KERNEL_RDMA));
        }
        let mut ctx = std::ptr::null_mut();
        let mut found = false;
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: `dev` is a listed device.
            if !dev.is_null() && unsafe { loader::c_str((lib.get_device_name)(dev)) } == device.name {
                found = true;
                // SAFETY: `dev` is a listed device; the opened context holds
                // its own reference, so freeing the list afterwards is fine.
                ctx = unsafe { (lib.open_device)(dev) };
                break;
            }
        }
        let err = std::io::Error::last_os_error();
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { (lib.free_device_list)(list) };
        if !found {
            return Err(Error::invalid("open_device", format!("no verbs device {:?}", device.name)));
        }
        let ctx = NonNull::new(ctx).ok_or_else(|| Error::os("open_device", err))?;
        let shared = context::CtxShared::open(self.lib.clone(), ctx, device.name.clone(), &filter, policy)?;
        Ok(Arc::new(context::VerbsContext { shared }))
    }
}

/// The verbs devices, nearest to the calling thread first, or
/// [`Error::Unavailable`] saying why there are none (the text contains
/// [`NO_KERNEL_RDMA`] on a kernel without RDMA).
pub fn devices() -> Result<Vec<Device>> {
    devices_near(&Near::CurrentThread)
}

/// The verbs devices, nearest to `near` (a thread or a GPU's PCI bus id) first.
pub fn devices_near(near: &Near) -> Result<Vec<Device>> {
    VerbsProvider::get().map_err(|e| unavailable(e.to_string()))?.devices_near(near)
}

/// Registers GPU memory exported as a DMA-BUF (`ibv_reg_dmabuf_mr`) in a
/// verbs PD; see [`VerbsPd::reg_dmabuf_mr`].
///
/// # Safety
/// The DMA-BUF's memory must stay allocated until the returned region is
/// deregistered (dropped) and every WR naming it has completed.
pub unsafe fn reg_dmabuf_mr(
    pd: &ProtectionDomain,
    fd: BorrowedFd<'_>,
    offset: u64,
    len: usize,
    iova: u64,
    access: AccessFlags,
) -> Result<Arc<dyn MrOps>> {
    let vpd = pd
        .ops()
        .as_any()
        .downcast_ref::<VerbsPd>()
        .ok_or_else(|| Error::invalid("reg_dmabuf_mr", "the PD does not belong to the verbs provider"))?;
    // SAFETY: forwarded to the caller.
    unsafe { vpd.reg_dmabuf_mr(fd, offset, len, iova, access) }
}
