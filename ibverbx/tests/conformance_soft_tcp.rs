//! The conformance suite on the soft provider's TCP link.

mod conformance;

use ibverbx::soft::{SoftConfig, SoftLink, SoftProvider};

fn device() -> ibverbx::Device {
    SoftProvider::new(SoftConfig { link: SoftLink::Tcp, ..SoftConfig::default() }).device()
}

conformance_suite!(device());
