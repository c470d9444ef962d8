//! `RMACOMM_PROVIDER` as the transport reads it. A binary of its own: it
//! sets the variable, which every other test leaves to `common::link`.

use ibverbx::ProviderKind;
use rmacomm_transport::{RdmaTransport, TransportConfig, TransportError};

#[test]
fn an_invalid_rmacomm_provider_fails_new_unless_code_chose_the_provider() {
    std::env::set_var("RMACOMM_PROVIDER", "foo");
    let cfg = TransportConfig::default();
    assert_eq!(cfg.provider, ProviderKind::Auto, "default() cannot fail, so it falls back to Auto");
    // ... and new() reports the bad value instead of running on auto.
    let e = RdmaTransport::new(cfg).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, TransportError::InvalidArgument { .. }), "{e}");
    assert!(m.contains("RMACOMM_PROVIDER") && m.contains("\"foo\"") && m.contains("auto|verbs|soft"), "{m}");
    // Code that names the provider does not depend on the variable.
    RdmaTransport::new(TransportConfig::default().with_provider(ProviderKind::Soft)).unwrap();
    std::env::set_var("RMACOMM_PROVIDER", "soft");
    assert_eq!(TransportConfig::default().provider, ProviderKind::Soft);
    RdmaTransport::new(TransportConfig::default()).unwrap();
}
