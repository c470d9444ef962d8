//! One open device and protection domain per (provider, device), shared by
//! every transport and every registration in the process: memory registered
//! once is usable on every connection to every peer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

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

type Key = (ProviderKind, Option<String>);

fn table() -> &'static Mutex<HashMap<Key, Arc<Domain>>> {
    static T: OnceLock<Mutex<HashMap<Key, Arc<Domain>>>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The shared domain for `provider` and `device` (opened on first use).
pub(crate) fn domain(provider: ProviderKind, device: Option<&str>) -> Result<Arc<Domain>, TransportError> {
    let key = (provider, device.map(str::to_owned));
    let mut t = table().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = t.get(&key) {
        return Ok(d.clone());
    }
    let devs = ibverbx::devices_of(provider)?;
    let dev = match device {
        None => devs.into_iter().next(),
        Some(name) => devs.into_iter().find(|d| d.name() == name),
    }
    .ok_or_else(|| TransportError::Unsupported(format!("no device {device:?} for provider {provider:?}")))?;
    let ctx = dev.open()?;
    let pd = ctx.alloc_pd()?;
    let d = Arc::new(Domain { provider: dev.info().provider, device: dev.name().to_owned(), ctx, pd });
    t.insert(key, d.clone());
    Ok(d)
}
