//! `map_remote`: a same-host peer's buffer mapped here (the UNIFIED path):
//! copies and atomics by the calling thread, every copy checked against the
//! peer's key table, nothing moved once the owner deregistered.

mod common;

use std::sync::atomic::Ordering;

use common::{contents, pattern};
use rmacomm_transport::{RdmaMemory, RdmaRemoteBuffer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_peers_buffer_is_mapped_and_checked_on_every_copy() {
    common::link("shm");
    let (a, b) = common::pair().await;
    let dst = RdmaMemory::alloc_for(&b, 1 << 20).unwrap();
    let src = RdmaMemory::alloc_for(&a, 1 << 20).unwrap();
    src.write_from(0, &pattern(1 << 20, 7)).unwrap();
    // A slice of the peer's buffer: offsets count from its start.
    let rb = dst.remote_buffer().slice(4096, 64 << 10).unwrap();
    let m = a.map_remote(&rb).await.unwrap().expect("same host, shared segment: mapped");
    assert_eq!(m.len(), 64 << 10);
    assert!(m.is_registered());

    // put (registered source) and plain bytes, then get, all by this thread.
    m.put(src.view(100, 1000).unwrap(), 8).unwrap();
    assert_eq!(contents(&dst, 4096 + 8, 1000), pattern(1 << 20, 7)[100..1100]);
    m.write_from(2000, b"hello").unwrap();
    assert_eq!(contents(&dst, 4096 + 2000, 5), b"hello");
    let back = RdmaMemory::alloc_for(&a, 4096).unwrap();
    m.get(back.view_mut(0, 1000).unwrap(), 8).unwrap();
    assert_eq!(contents(&back, 0, 1000), pattern(1 << 20, 7)[100..1100]);

    // Bounds: the mapped slice, not the peer's whole buffer.
    assert!(m.write_from((64 << 10) - 4, b"12345").is_err());
    assert!(m.put(src.view(0, 16).unwrap(), usize::MAX - 8).is_err());
    assert_eq!(contents(&dst, 4096 + (64 << 10) - 4, 4), [0u8; 4], "a refused copy moved nothing");

    // Atomics are shared with the owner's view of the same word.
    m.atomic_u64(8192).unwrap().fetch_add(5, Ordering::AcqRel);
    assert_eq!(dst.atomic_u64(4096 + 8192).unwrap().load(Ordering::Acquire), 5);
    assert!(m.atomic_u64(3).is_err(), "unaligned");

    // Once the owner drops its memory, copies fail and move nothing.
    drop(dst);
    assert!(!m.is_registered());
    let e = m.write_from(0, b"late").unwrap_err().to_string();
    assert!(e.contains("no longer registers"), "{e}");
    let mut out = [0u8; 4];
    assert!(m.read_into(0, &mut out).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistered_keys_fail_and_private_memory_is_not_mapped() {
    common::link("shm");
    let (a, b) = common::pair().await;
    let dst = RdmaMemory::alloc_for(&b, 8192).unwrap();
    let mut bad = dst.remote_buffer();
    bad.key ^= 0x5a5a_0000;
    let e = a.map_remote(&bad).await.unwrap_err().to_string();
    assert!(e.contains("does not register"), "{e}");
    let beyond = RdmaRemoteBuffer { len: dst.remote_buffer().len + 4096, ..dst.remote_buffer() };
    assert!(a.map_remote(&beyond).await.is_err(), "past the end of the peer's region");
    // Memory outside a shared segment (a registered Vec) has no mapping:
    // the caller uses write/read.
    let private = RdmaMemory::register_for(&b, vec![0u8; 8192]).unwrap();
    assert!(a.map_remote(&private.remote_buffer()).await.unwrap().is_none());
}
