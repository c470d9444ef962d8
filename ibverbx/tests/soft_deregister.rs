//! Deregistration never lets a same-host peer touch the memory afterwards:
//! a write that waited (behind an RNR-stalled SEND) re-checks its key after
//! the wait, and a copy already in progress is fenced (the owner's
//! deregistration waits for it). The owner fills the memory with a sentinel
//! the moment deregistration returns; no byte of it may change.

use std::time::Duration;

use ibverbx::soft::{SoftConfig, SoftLink, SoftProvider};
use ibverbx::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, Placement, ProtectionDomain, QpInitAttr, QueuePair, RecvWr,
    SendFlags, SendOp, SendWr, WcStatus, WorkCompletion,
};

const LEN: usize = 1 << 20;

struct Side {
    _ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn side(dev: &ibverbx::Device) -> Side {
    let ctx = dev.open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4096).unwrap();
    let qp = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    Side { _ctx: ctx, pd, cq, qp }
}

fn pair() -> (Side, Side) {
    let dev = SoftProvider::new(SoftConfig { link: SoftLink::Shm, ..SoftConfig::default() }).device();
    let (a, b) = (side(&dev), side(&dev));
    a.qp.connect(&b.qp.endpoint().unwrap()).unwrap();
    b.qp.connect(&a.qp.endpoint().unwrap()).unwrap();
    (a, b)
}

/// Memory the test owns (heap, so peers reach it with process_vm_writev)
/// registered for remote writes.
fn heap_region(pd: &ProtectionDomain, buf: &mut [u8]) -> MemoryRegion {
    // SAFETY: `buf` outlives the region (each test drops the region first)
    // and every WR naming it completes before `buf` is dropped.
    let mr = unsafe { MemoryRegion::register_raw(pd, buf.as_mut_ptr(), buf.len(), AccessFlags::all_remote()) }.unwrap();
    assert_eq!(mr.placement(), Placement::ProcessVm);
    mr
}

fn wait_n(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut wc = [WorkCompletion::empty(); 64];
    while out.len() < n {
        let k = cq.wait(&mut wc, Some(Duration::from_secs(30)), Duration::ZERO).unwrap();
        assert!(k > 0, "completions stopped at {} of {n}", out.len());
        out.extend_from_slice(&wc[..k]);
    }
    out
}

#[test]
fn a_write_that_waited_rechecks_its_key() {
    let (a, b) = pair();
    let mut buf = vec![0u8; LEN];
    let dst = heap_region(&b.pd, &mut buf);
    let src = MemoryRegion::alloc(&a.pd, LEN, AccessFlags::LOCAL_WRITE).unwrap();
    src.write(0, &vec![0x11; LEN]).unwrap();
    // A SEND with no receive posted at B stalls in RNR; the WRITE behind it
    // waits for it before it may copy.
    let s = [src.sge(0, 4).unwrap()];
    let w = [src.sge(0, 65536).unwrap()];
    a.qp.post_send(&[
        SendWr { wr_id: 1, op: SendOp::Send, sg_list: &s, flags: SendFlags::SIGNALED },
        SendWr {
            wr_id: 2,
            op: SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() },
            sg_list: &w,
            flags: SendFlags::SIGNALED,
        },
    ])
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    drop(dst);
    buf.fill(0xEE);
    let scratch = MemoryRegion::alloc(&b.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    b.qp.post_recv(&[RecvWr { wr_id: 9, sg_list: &[scratch.sge(0, 4096).unwrap()] }]).unwrap();
    let wcs = wait_n(&a.cq, 2);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (1, WcStatus::Success), "{wcs:?}");
    assert_eq!(wcs[1].wr_id, 2);
    assert_ne!(wcs[1].status, WcStatus::Success, "the write into a deregistered region succeeded: {wcs:?}");
    std::thread::sleep(Duration::from_millis(50));
    let changed = buf.iter().filter(|b| **b != 0xEE).count();
    assert_eq!(changed, 0, "{changed} bytes written after deregistration");
}

#[test]
fn deregistration_waits_for_copies_in_progress() {
    // Each write fills a quarter of the region with its own byte; copies go
    // front to back, so the last byte of a quarter changes at the end of a
    // copy. Once deregistration has returned, those bytes must never change
    // again: a copy still running then would change one.
    let mut damaged_rounds = 0;
    for round in 0..12u64 {
        let (a, b) = pair();
        let mut buf = vec![0u8; LEN];
        let dst = heap_region(&b.pd, &mut buf);
        let (dst_addr, dst_rkey) = (dst.addr(), dst.rkey());
        let src = MemoryRegion::alloc(&a.pd, LEN, AccessFlags::LOCAL_WRITE).unwrap();
        let q = LEN / 4;
        let base = buf.as_ptr() as usize;
        let last = |k: usize| {
            // SAFETY: in bounds of `buf`, read as a volatile byte: peers
            // write it concurrently (that is what is being tested).
            unsafe { std::ptr::read_volatile((base + k * q + q - 1) as *const u8) }
        };
        let changed_after = std::thread::scope(|s| {
            let writer = s.spawn(|| {
                for i in 0u64.. {
                    let k = (i % 4) as usize;
                    src.write(k * q, &vec![(i % 250 + 1) as u8; q]).unwrap();
                    let sg = [src.sge(k * q, q).unwrap()];
                    let op = SendOp::RdmaWrite { remote_addr: dst_addr + (k * q) as u64, rkey: dst_rkey };
                    if a.qp.post_send(&[SendWr { wr_id: i, op, sg_list: &sg, flags: SendFlags::SIGNALED }]).is_err() {
                        return i;
                    }
                    if !wait_n(&a.cq, 1)[0].is_ok() {
                        return i;
                    }
                }
                unreachable!()
            });
            std::thread::sleep(Duration::from_millis(20 + round * 7));
            drop(dst);
            let before: Vec<u8> = (0..4).map(last).collect();
            let mut changed = false;
            let t = std::time::Instant::now();
            while t.elapsed() < Duration::from_millis(5) {
                changed |= (0..4).map(last).ne(before.iter().copied());
            }
            let writes = writer.join().unwrap();
            eprintln!("round {round}: {writes} writes; memory changed after deregistration: {changed}");
            changed
        });
        damaged_rounds += usize::from(changed_after);
    }
    assert_eq!(damaged_rounds, 0, "memory changed after deregistration returned in {damaged_rounds} of 12 rounds");
}

/// Mapped `rmacomm-seg` segments of this process (both sides of the pair
/// live here).
fn seg_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains("rmacomm-seg")).count()
}

/// A peer that registers and frees memory over and over does not have it
/// all kept mapped (and so kept allocated) by the side that writes into it.
#[test]
fn freed_peer_memory_is_not_kept_mapped() {
    let (a, b) = pair();
    let src = MemoryRegion::alloc(&a.pd, 65536, AccessFlags::LOCAL_WRITE).unwrap();
    let sg = [src.sge(0, 65536).unwrap()];
    let mut counts = Vec::new();
    for i in 0..20u64 {
        let dst = MemoryRegion::alloc(&b.pd, LEN, AccessFlags::all_remote()).unwrap();
        let op = SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() };
        a.qp.post_send(&[SendWr { wr_id: i, op, sg_list: &sg, flags: SendFlags::SIGNALED }]).unwrap();
        assert!(wait_n(&a.cq, 1)[0].is_ok());
        drop(dst);
        counts.push(seg_mappings());
    }
    let s = ibverbx::soft::stats(&a._ctx).unwrap();
    eprintln!(
        "segment mappings after each cycle: {counts:?}; mapped {} unmapped {}",
        s.peer_segments_mapped, s.peer_segments_unmapped
    );
    assert_eq!(s.peer_segments_mapped, 20, "every region was written directly");
    assert!(s.peer_segments_unmapped >= 19, "stale mappings were kept: {s:?}");
    assert!(counts[19] <= counts[1] + 1, "mappings grow with every freed region: {counts:?}");
}
