//! ibverbx: a verbs layer with a provider seam.
//!
//! The same safe API ([`Context`], [`ProtectionDomain`], [`MemoryRegion`],
//! [`CompletionQueue`], [`QueuePair`], work requests and completions) runs on
//! two providers: **verbs** (rdma-core's libibverbs, loaded at run time, for
//! InfiniBand and RoCE HCAs) and **soft**, a userspace reliable-connected
//! implementation over shared memory (same host) and TCP (other hosts) that
//! needs no RDMA hardware and is the default where no HCA exists.
//!
//! # Quick start
//! Two QPs in one process, an RDMA WRITE from one region to the other:
//! ```
//! use ibverbx::{AccessFlags, MemoryRegion, QpInitAttr, SendFlags, SendOp, SendWr};
//!
//! # fn main() -> ibverbx::Result<()> {
//! let ctx = ibverbx::soft_device().open()?;
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(64)?;
//! let (a, b) = (pd.create_qp(&QpInitAttr::default(), &cq, &cq)?, pd.create_qp(&QpInitAttr::default(), &cq, &cq)?);
//! a.connect(&b.endpoint()?)?;
//! b.connect(&a.endpoint()?)?;
//!
//! let src = MemoryRegion::alloc(&pd, 4096, AccessFlags::LOCAL_WRITE)?;
//! let dst = MemoryRegion::alloc(&pd, 4096, AccessFlags::all_remote())?;
//! src.write(0, b"hello")?;
//! let sge = [src.sge(0, 5)?];
//! a.post_send(&[SendWr {
//!     wr_id: 1,
//!     op: SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() },
//!     sg_list: &sge,
//!     flags: SendFlags::SIGNALED,
//! }])?;
//! let mut wc = [ibverbx::WorkCompletion::empty(); 1];
//! let n = cq.wait(&mut wc, Some(std::time::Duration::from_secs(5)), std::time::Duration::ZERO)?;
//! assert_eq!(n, 1);
//! assert!(wc[0].is_ok());
//! let mut out = [0u8; 5];
//! dst.read(0, &mut out)?;
//! assert_eq!(&out, b"hello");
//! # Ok(()) }
//! ```
//!
//! # Features
//! - RC queue pairs: SEND (+imm), RDMA WRITE (+imm), RDMA READ, fetch-and-add,
//!   compare-and-swap; signaled/unsignaled, inline, scatter/gather.
//! - Verbs' completion statuses, QP state machine and error flushing.
//! - Completion channels as file descriptors for async runtimes.
//! - `RMACOMM_PROVIDER=auto|verbs|soft` picks the provider ([`devices`]);
//!   the verbs provider ([`verbs`]) loads libibverbs at run time, so a machine
//!   without RDMA simply lists no hardware device.
//! - [`VirtualQp`] / [`VirtualCq`]: one message striped over several QPs
//!   (DQPLB or spray), one completion, the user's immediate delivered; the
//!   state machines behind them are public in [`vqp_proto`].
//!
//! # Thread safety
//! Every handle is `Send + Sync`. Posting to one QP from several threads is
//! allowed (WRs are ordered as the calls are); completions of one CQ should
//! be polled by one thread at a time to keep their order meaningful.
//!
//! # Resource cleanup
//! Handles are reference counted: an MR or QP keeps its PD and context
//! alive, a QP keeps its CQs alive, and a posted WR keeps the regions it
//! names (and memory they own) alive until its completion. Dropping a
//! `MemoryRegion` revokes its keys at once. Dropping a `QueuePair` resets it:
//! its outstanding WRs are dropped without completions.
//!
//! # Organization
//! One type per module: `device`, `context`, `pd`, `mr`, `cq`, `qp`,
//! `qp_attr`, `wr`, `wc`, `endpoint`, `shm`; the seam in `provider`; the
//! providers in [`soft`] and [`verbs`]; virtual QPs in `vqp`.

#![warn(missing_docs)]

mod access;
mod context;
mod cq;
mod deadline;
mod device;
mod device_mem;
mod endpoint;
mod error;
mod mr;
mod pd;
pub mod provider;
mod qp;
mod qp_attr;
mod remote_map;
mod shm;
pub mod soft;
pub mod verbs;
mod vqp;
mod wc;
mod wr;

use std::sync::Arc;

pub use access::AccessFlags;
pub use context::Context;
pub use cq::CompletionQueue;
pub use deadline::deadline_after;
pub use device::{Device, DeviceAttr, DeviceInfo, Gid, LinkLayer, Mtu, PortAttr, PortState};
pub use device_mem::{set_device_ipc, DeviceIpc, DeviceMemory, PeerDevice, IPC_EXPORT_MAX};
#[doc(inline)]
pub use endpoint::{HostId, QpEndpoint, SoftAddress};
pub use error::{Error, Result};
pub use mr::{MemoryRegion, OwnedBuffer};
pub use pd::ProtectionDomain;
pub use provider::Placement;
pub use qp::QueuePair;
pub use qp_attr::{
    ack_timeout_duration, rnr_timer_duration, InitAttr, QpCaps, QpInitAttr, QpState, QpTransition, RtrAttr, RtsAttr,
};
pub use remote_map::RemoteMapping;
pub use shm::ShmBuffer;
pub use vqp::{
    proto as vqp_proto, LoadBalancing, VirtualCq, VirtualQp, VirtualQpConfig, VirtualQpEndpoint, VirtualQpStats,
};
pub use wc::{WcOpcode, WcStatus, WorkCompletion};
pub use wr::{AtomicOp, RecvWr, SendFlags, SendOp, SendWr, Sge};

/// Which provider [`devices`] lists (`RMACOMM_PROVIDER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ProviderKind {
    /// Hardware when a verbs device exists, soft otherwise.
    #[default]
    Auto,
    /// Hardware only.
    Verbs,
    /// Soft only.
    Soft,
}

impl ProviderKind {
    /// Parses `auto`, `verbs` or `soft`.
    pub fn parse(s: &str) -> Option<ProviderKind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(ProviderKind::Auto),
            "verbs" => Some(ProviderKind::Verbs),
            "soft" => Some(ProviderKind::Soft),
            _ => None,
        }
    }

    /// From `RMACOMM_PROVIDER` (default `auto` when unset). Any other value
    /// than `auto`, `verbs`, `soft` or empty is an error naming the
    /// variable: a typo must not silently pick a provider.
    pub fn from_env() -> Result<ProviderKind> {
        match std::env::var("RMACOMM_PROVIDER") {
            Err(std::env::VarError::NotPresent) => Self::from_env_value(None),
            Err(std::env::VarError::NotUnicode(v)) => Self::from_env_value(Some(&v.to_string_lossy())),
            Ok(v) => Self::from_env_value(Some(&v)),
        }
    }

    /// [`from_env`](Self::from_env) for a given value of the variable
    /// (`None`: unset), for tools that read it themselves.
    pub fn from_env_value(value: Option<&str>) -> Result<ProviderKind> {
        match value {
            None => Ok(ProviderKind::Auto),
            Some(v) => ProviderKind::parse(v).ok_or_else(|| {
                Error::invalid(
                    "RMACOMM_PROVIDER",
                    format!("{v:?} is not a provider; expected auto|verbs|soft (or unset RMACOMM_PROVIDER for auto)"),
                )
            }),
        }
    }
}

/// The soft provider's one device, configured from the environment.
pub fn soft_device() -> Device {
    let provider: Arc<dyn provider::Provider> = soft::SoftProvider::from_env();
    let info = provider.devices().expect("the soft provider always lists soft0").remove(0);
    Device { info, provider }
}

/// The devices of the provider chosen by `kind`.
///
/// `Auto` lists hardware devices when the verbs provider finds any (nearest
/// to the calling thread first, filtered by `RMACOMM_IB_HCA`), else the soft
/// device, logging why verbs was passed over. `Verbs` without a device is
/// [`Error::Unavailable`] with the reason, e.g. [`verbs::NO_KERNEL_RDMA`].
///
/// Only a verbs provider that is *unavailable* (no library, no kernel
/// support, no device) makes `Auto` the soft provider: a malformed
/// `RMACOMM_IB_HCA`, a filter that matches none of the devices there are,
/// or a failing device scan is an error (each moved everything to TCP
/// without a word above `info`).
pub fn devices_of(kind: ProviderKind) -> Result<Vec<Device>> {
    match kind {
        ProviderKind::Soft => Ok(vec![soft_device()]),
        ProviderKind::Verbs => verbs::devices(),
        ProviderKind::Auto => {
            // Checked whether or not there is a library to filter for.
            verbs::HcaFilter::from_env().map_err(|e| Error::invalid("devices", e))?;
            match verbs::devices() {
                Ok(devs) => Ok(devs),
                Err(e @ Error::Unavailable { .. }) => {
                    tracing::info!("{e}; using the soft provider");
                    Ok(vec![soft_device()])
                }
                Err(e) => Err(e),
            }
        }
    }
}

/// The devices of the provider `RMACOMM_PROVIDER` names (default `auto`).
pub fn devices() -> Result<Vec<Device>> {
    devices_of(ProviderKind::from_env()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_names_parse_and_anything_else_is_an_error_naming_the_variable() {
        assert_eq!(ProviderKind::from_env_value(None), Ok(ProviderKind::Auto));
        for (v, k) in [
            ("auto", ProviderKind::Auto),
            ("", ProviderKind::Auto),
            ("verbs", ProviderKind::Verbs),
            (" Soft ", ProviderKind::Soft),
        ] {
            assert_eq!(ProviderKind::from_env_value(Some(v)), Ok(k), "{v:?}");
        }
        for v in ["foo", "rxe", "soft0", "verbs,soft"] {
            let e = ProviderKind::from_env_value(Some(v)).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
            let m = e.to_string();
            assert!(m.contains("RMACOMM_PROVIDER") && m.contains("auto|verbs|soft") && m.contains(v), "{m}");
        }
    }
}
