//! One open device and protection domain per (provider, device), shared by
//! every transport and every registration in the process: memory registered
//! once is usable on every connection to every peer.
//!
//! The table holds domains weakly: a device (for the soft provider, a
//! context with its progress thread, listeners and key table) closes when
//! its last transport and registration are gone, so transports made with
//! many different settings do not pile up open devices.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use ibverbx::soft::SoftConfig;
use ibverbx::{Context, ProtectionDomain, ProviderKind};

use crate::TransportError;

/// An open device with its PD.
#[derive(Debug)]
pub(crate) struct Domain {
    pub(crate) ctx: Context,
    pub(crate) pd: ProtectionDomain,
    pub(crate) provider: &'static str,
    pub(crate) device: String,
}

/// Provider, device, and the soft settings (as text: they hold no secret).
type Key = (ProviderKind, Option<String>, String);

fn table() -> &'static Mutex<HashMap<Key, Weak<Domain>>> {
    static T: OnceLock<Mutex<HashMap<Key, Weak<Domain>>>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The shared domain for `provider`, `device` and soft settings (opened on
/// first use).
pub(crate) fn domain(
    provider: ProviderKind,
    device: Option<&str>,
    soft: Option<&SoftConfig>,
) -> Result<Arc<Domain>, TransportError> {
    let key = (provider, device.map(str::to_owned), format!("{soft:?}"));
    let mut t = table().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = t.get(&key).and_then(Weak::upgrade) {
        return Ok(d);
    }
    t.retain(|_, d| d.strong_count() > 0);
    let mut devs = ibverbx::devices_of(provider)?;
    if let Some(cfg) = soft {
        // Code wins over the environment: the soft device with these settings.
        for d in devs.iter_mut().filter(|d| d.info().provider == "soft") {
            *d = ibverbx::soft::SoftProvider::new(cfg.clone()).device();
        }
    }
    let dev = match device {
        None => devs.into_iter().next(),
        Some(name) => devs.into_iter().find(|d| d.name() == name),
    }
    .ok_or_else(|| TransportError::Unsupported(format!("no device {device:?} for provider {provider:?}")))?;
    let ctx = dev.open()?;
    let pd = ctx.alloc_pd()?;
    let d = Arc::new(Domain { provider: dev.info().provider, device: dev.name().to_owned(), ctx, pd });
    t.insert(key, Arc::downgrade(&d));
    Ok(d)
}
