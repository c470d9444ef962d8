//! The conformance suite on the soft shm link with the posting-thread copy
//! disabled, so that every same-host operation goes through the progress
//! engine's direct-placement path, and with the engine busy-polling.

mod conformance;

use ibverbx::soft::{SoftConfig, SoftLink, SoftProvider};

fn device() -> ibverbx::Device {
    SoftProvider::new(SoftConfig {
        link: SoftLink::Shm,
        inline_copy_max: 0,
        busy_poll: std::time::Duration::from_micros(200),
        ..SoftConfig::default()
    })
    .device()
}

conformance_suite!(device());
