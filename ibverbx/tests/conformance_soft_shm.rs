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

/// `map_remote_region` maps the whole region a key registers, found through
/// any byte of it (the transport's direct copies then need one mapping per
/// key); a byte the key does not cover, or a key the peer does not have, is
/// an error naming the key.
#[test]
fn a_peers_whole_region_is_mapped_through_any_byte_of_it() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let dev = device();
    let (ca, cb) = (dev.open().unwrap(), dev.open().unwrap());
    let (pa, pb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
    let (qa_cq, qb_cq) = (ca.create_cq(16).unwrap(), cb.create_cq(16).unwrap());
    let attr = ibverbx::QpInitAttr::default();
    let qa = pa.create_qp(&attr, &qa_cq, &qa_cq).unwrap();
    let qb = pb.create_qp(&attr, &qb_cq, &qb_cq).unwrap();
    qa.connect(&qb.endpoint().unwrap()).unwrap();
    qb.connect(&qa.endpoint().unwrap()).unwrap();
    let len = 3 << 16;
    let mr = ibverbx::MemoryRegion::alloc(&pb, len, ibverbx::AccessFlags::all_remote()).unwrap();
    mr.write(len - 4, b"tail").unwrap();

    let m = rt.block_on(qa.map_remote_region(mr.rkey(), mr.addr() + 70_000)).unwrap().expect("same host: mapped");
    assert_eq!((m.remote_addr(), m.len(), m.rkey()), (mr.addr(), len, mr.rkey()));
    let mut got = [0u8; 4];
    m.read(len - 4, &mut got).unwrap();
    assert_eq!(&got, b"tail");
    m.write(0, b"head").unwrap();
    let mut head = [0u8; 4];
    mr.read(0, &mut head).unwrap();
    assert_eq!(&head, b"head");

    for (key, addr) in [(mr.rkey(), mr.addr() + len as u64), (mr.rkey() ^ 0x5a5a, mr.addr())] {
        let e = rt.block_on(qa.map_remote_region(key, addr)).unwrap_err().to_string();
        assert!(e.contains("map_remote") && e.contains(&format!("{key:#x}")), "{e}");
    }
}
