//! The conformance suite on the soft provider's same-host link (shared
//! memory + unix socket).

mod conformance;

use ibverbx::soft::{SoftConfig, SoftLink, SoftProvider};

fn device() -> ibverbx::Device {
    SoftProvider::new(SoftConfig { link: SoftLink::Shm, ..SoftConfig::default() }).device()
}

conformance_suite!(device());
