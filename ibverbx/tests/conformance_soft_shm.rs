//! The conformance suite on the soft provider's same-host link (shared
//! memory + unix socket).

mod conformance;

use ibverbx::soft::{SoftConfig, SoftLink, SoftProvider};

fn device() -> ibverbx::Device {
    SoftProvider::new(SoftConfig { link: SoftLink::Shm, ..SoftConfig::default() }).device()
}

conformance_suite!(device());

/// DMA-BUF registration is a verbs-provider feature: the soft provider
/// refuses it with an error rather than pretending.
#[test]
fn dmabuf_registration_is_refused_by_soft() {
    let ctx = device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let f = std::fs::File::open("/dev/null").unwrap();
    use std::os::fd::AsFd;
    // SAFETY: nothing is registered (the call fails), so no memory is named.
    let r = unsafe {
        ibverbx::MemoryRegion::register_dmabuf(&pd, f.as_fd(), 0, 4096, 0, ibverbx::AccessFlags::LOCAL_WRITE)
    };
    let e = r.unwrap_err();
    assert!(e.to_string().contains("verbs"), "{e}");
}
