//! `RMACOMM_TIMEOUT_SECONDS` as the transport reads it. A binary of its
//! own: it sets the variable (and `RMACOMM_PROVIDER`), which every other
//! test leaves alone.

use rmacomm_transport::{RdmaTransport, TransportConfig, TransportError};

/// `RMACOMM_TIMEOUT_SECONDS` that is no timeout (`inf` and `1e20` panicked
/// in `TransportConfig::default()`; `abc`, `-5` and `0` meant none at all):
/// `default()` leaves the timeout unset and `new()` refuses the value,
/// naming it, unless code set a timeout itself.
#[test]
fn an_invalid_rmacomm_timeout_seconds_fails_new_unless_code_set_a_timeout() {
    std::env::set_var("RMACOMM_PROVIDER", "soft");
    for v in ["inf", "1e20", "18446744073709551616", "NaN", "abc", "-5", "0"] {
        std::env::set_var("RMACOMM_TIMEOUT_SECONDS", v);
        let cfg = TransportConfig::default();
        assert_eq!(cfg.timeout, None, "{v}");
        let e = RdmaTransport::new(cfg).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, TransportError::InvalidArgument { .. }), "{v}: {e}");
        assert!(m.contains(&format!("RMACOMM_TIMEOUT_SECONDS='{v}'")), "{m}");
        let chosen = TransportConfig::default().with_timeout(Some(std::time::Duration::from_secs(5)));
        RdmaTransport::new(chosen).unwrap();
    }
    std::env::set_var("RMACOMM_TIMEOUT_SECONDS", "2.5");
    assert_eq!(TransportConfig::default().timeout, Some(std::time::Duration::from_millis(2500)));
    RdmaTransport::new(TransportConfig::default()).unwrap();
    std::env::remove_var("RMACOMM_TIMEOUT_SECONDS");

    // RMACOMM_IB_TIMEOUT (in this one test: one variable at a time, one
    // thread): NCCL's 20 by default, a valid value taken, an invalid one
    // refused by new() naming it.
    assert_eq!(TransportConfig::default().ack_timeout, rmacomm_transport::DEFAULT_ACK_TIMEOUT);
    assert_eq!(rmacomm_transport::DEFAULT_ACK_TIMEOUT, 20);
    std::env::set_var("RMACOMM_IB_TIMEOUT", " 18 ");
    assert_eq!(TransportConfig::default().ack_timeout, 18);
    assert_eq!(TransportConfig::default().virtual_qp_config().ack_timeout, 18);
    RdmaTransport::new(TransportConfig::default()).unwrap();
    for v in ["0", "32", "abc", "-1"] {
        std::env::set_var("RMACOMM_IB_TIMEOUT", v);
        let e = RdmaTransport::new(TransportConfig::default()).unwrap_err();
        assert!(e.to_string().contains(&format!("RMACOMM_IB_TIMEOUT='{v}'")), "{e}");
    }
    std::env::remove_var("RMACOMM_IB_TIMEOUT");
    let e = RdmaTransport::new(TransportConfig::default().with_ack_timeout(0)).unwrap_err();
    assert!(e.to_string().contains("ack_timeout"), "{e}");
}
