//! Executing one posted send WR on the progress engine: direct placement
//! into a same-host peer's memory when it is mapped here (after every
//! earlier staged request), else a request frame on the connection.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::device_batch::DeviceBatch;
use super::doorbell_tx::{settle_db, settle_db_held};
use super::inflight::{Expect, Inflight};
use super::{with_psn, Link, Shared};
use crate::qp_attr::QpState;
use crate::soft::device_io::{read_device, write_device, Failed};
use crate::soft::mr::{LocalSeg, Target};
use crate::soft::peer::{Direct, Held, PeerMap};
use crate::soft::qp::SqEntry;
use crate::soft::raw_io::send_frame;
use crate::soft::wire::Frame;
use crate::wc::WcStatus;
use crate::wr::{AtomicOp, SendOp};
use crate::AccessFlags;

/// Finds where a same-host access goes: a mapped segment (mapped first if
/// it is not yet), the peer's other memory, or the connection. A direct
/// path is returned only once every earlier staged request is answered,
/// and the key is checked again after that wait: the region may have been
/// revoked meanwhile, and nothing is copied into a revoked region.
#[allow(clippy::too_many_arguments)]
pub(super) async fn place(
    sh: &Shared,
    peer: Option<&PeerMap>,
    (peer_qpn, token): (u32, [u8; 16]),
    pd: u32,
    rkey: u32,
    raddr: u64,
    len: u64,
    need: AccessFlags,
) -> Result<Direct, WcStatus> {
    let Some(p) = peer else { return Ok(Direct::Staged) };
    if len == 0 {
        // Zero bytes: nothing to place and, as in verbs, no key check.
        return Ok(Direct::Vm(raddr, Held::default()));
    }
    let mut d = p.resolve(pd, rkey, raddr, len, need)?;
    if let Direct::Unmapped(uid) = d {
        let (mapped, pruned) = p.map_segment(uid, peer_qpn, token).await;
        sh.qp.ctx.segs_mapped.fetch_add(u64::from(mapped), Ordering::Relaxed);
        sh.qp.ctx.segs_unmapped.fetch_add(pruned as u64, Ordering::Relaxed);
        d = p.resolve(pd, rkey, raddr, len, need)?;
    }
    if matches!(d, Direct::Staged | Direct::Unmapped(_)) {
        return Ok(Direct::Staged);
    }
    drop(d);
    if !memory_ordered(sh).await {
        return Err(WcStatus::WrFlushErr);
    }
    match p.resolve(pd, rkey, raddr, len, need)? {
        Direct::Unmapped(_) => Ok(Direct::Staged),
        d => Ok(d),
    }
}

/// What a WR's local memory needs beside its host pieces (which
/// [`local_ptrs`] returns with it). Where a segment lies in device
/// memory, the pieces are one host buffer instead: filled from the
/// segments by [`Local::gather`] when the WR reads them (WRITE, SEND) and a
/// path needs host bytes, copied out to them by [`Local::scatter_back`]
/// when it writes them (READ, atomic) and the bytes landed in the buffer.
/// A copy with a same-host peer's device region ([`device_copy`]) uses the
/// segments themselves, device to device where it can.
struct Local {
    staged: Option<Staged>,
    /// The WR reads its segments (gathered once, when needed).
    reads: bool,
    gathered: bool,
}

/// The host buffer of [`Local`] and the segments it stands for.
type Staged = (Vec<u8>, Vec<(Target, usize)>);

impl Local {
    /// Fills the host buffer from the segments (once), where the WR reads
    /// device segments.
    fn gather(&mut self) -> Result<(), WcStatus> {
        let Some((buf, targets)) = &mut self.staged else { return Ok(()) };
        if !self.reads || self.gathered {
            return Ok(());
        }
        let mut off = 0;
        for (t, n) in targets.iter() {
            match t {
                // SAFETY: a checked local registration of n bytes, held by
                // the WR's segments; the buffer has room (its heap block
                // does not move: the pieces point into it).
                Target::Host(p) => unsafe {
                    std::ptr::copy_nonoverlapping(*p as *const u8, buf[off..].as_mut_ptr(), *n)
                },
                Target::Device(dev, a) => {
                    // SAFETY: a checked local segment, held by the WR.
                    let v = unsafe { read_device(&**dev, *a, *n) }.map_err(|e| local_copy_failed("gather", e))?;
                    buf[off..off + n].copy_from_slice(&v);
                }
            }
            off += n;
        }
        self.gathered = true;
        Ok(())
    }

    /// After a direct READ or atomic: the staged bytes to the segments.
    fn scatter_back(&self) -> Result<(), WcStatus> {
        let Some((buf, targets)) = &self.staged else { return Ok(()) };
        let mut off = 0;
        for (t, n) in targets {
            match t {
                // SAFETY: a checked local registration of n bytes, held by
                // the WR's segments.
                Target::Host(p) => unsafe { std::ptr::copy_nonoverlapping(buf[off..].as_ptr(), *p as *mut u8, *n) },
                Target::Device(dev, a) => {
                    // SAFETY: a checked local segment, held by the WR.
                    unsafe { write_device(&**dev, *a, &buf[off..off + n]) }
                        .map_err(|e| local_copy_failed("scatter", e))?
                }
            }
            off += n;
        }
        Ok(())
    }
}

fn local_copy_failed(what: &str, e: Failed) -> WcStatus {
    tracing::warn!("soft WR: {what} of local device memory failed: {e:?}");
    WcStatus::LocProtErr
}

fn local_ptrs(sh: &Shared, e: &SqEntry) -> Result<(Vec<(usize, usize)>, Local), WcStatus> {
    let reads = e.op.local_access().is_empty();
    if let Some(d) = &e.inline {
        return Ok((vec![(d.as_ptr() as usize, d.len())], Local { staged: None, reads, gathered: true }));
    }
    let need = e.op.local_access();
    if !e.segs.iter().any(|s| s.mr.as_ref().is_some_and(|m| m.device.is_some())) {
        // Host memory only (the common case): the pieces, as they are.
        let host = |s: &LocalSeg| match s.target(sh.qp.pd, need)? {
            Target::Host(p) => Ok((p, s.len as usize)),
            Target::Device(..) => Err(WcStatus::LocProtErr),
        };
        let pieces = e.segs.iter().map(host).collect::<Result<_, _>>()?;
        return Ok((pieces, Local { staged: None, reads, gathered: true }));
    }
    let targets: Vec<(Target, usize)> =
        e.segs.iter().map(|s| s.target(sh.qp.pd, need).map(|t| (t, s.len as usize))).collect::<Result<_, _>>()?;
    let total: usize = targets.iter().map(|t| t.1).sum();
    let mut buf = vec![0u8; total];
    // Written through (READ results, gathers): a mutable pointer.
    let at = buf.as_mut_ptr() as usize;
    Ok((vec![(at, total)], Local { staged: Some((buf, targets)), reads, gathered: false }))
}

/// Copies the WR's local memory to (`write`) or from a same-host peer's
/// device region at byte `off` of it: a local device segment device to
/// device where both sides' memory allows it, else through host memory.
/// False (logged) when a copy fails: the WR then goes through the
/// connection, which writes or reads all of it again, and so do later ones
/// (the peer map forgets the opened region).
fn device_copy(
    sh: &Shared,
    dev: &dyn crate::PeerDevice,
    off: u64,
    (pieces, local): (&[(usize, usize)], &Local),
    write: bool,
) -> bool {
    let r = (|| -> Result<u64, String> {
        let mut at = off;
        let host = |at: u64, p: usize, n: usize| {
            // SAFETY: p..p+n lies in a live, checked local registration (or
            // the staging buffer); at..at+n lies in the peer's region (its
            // key was checked against these bounds, and the fence is held).
            unsafe {
                if write {
                    dev.write(at, p as *const u8, n)
                } else {
                    dev.read(at, p as *mut u8, n)
                }
            }
        };
        match &local.staged {
            None => {
                for &(p, n) in pieces {
                    host(at, p, n)?;
                    at += n as u64;
                }
            }
            Some((_, targets)) => {
                for (t, n) in targets {
                    match t {
                        Target::Host(p) => host(at, *p, *n)?,
                        Target::Device(d, a) => {
                            let peer = dev.device_addr().map(|base| base + at);
                            let (dst, src) = if write { (peer, Some(*a)) } else { (Some(*a), peer) };
                            match (dst, src) {
                                // SAFETY: a checked local segment (held by the
                                // WR) and the peer's checked range, opened
                                // here (fence held).
                                (Some(dst), Some(src)) if *n > 0 => match unsafe { d.copy_device(dst, src, *n) } {
                                    Some(r) => {
                                        r?;
                                        sh.qp.ctx.device_copies.fetch_add(1, Ordering::Relaxed);
                                        sh.qp.ctx.device_copy_waits.fetch_add(1, Ordering::Relaxed);
                                    }
                                    // SAFETY: the checked local segment.
                                    None => unsafe { via_host(d, *a, *n, |p| host(at, p, *n), write)? },
                                },
                                // SAFETY: as above.
                                _ => unsafe { via_host(d, *a, *n, |p| host(at, p, *n), write)? },
                            }
                        }
                    }
                    at += *n as u64;
                }
            }
        }
        Ok(at - off)
    })();
    match r {
        Ok(n) => {
            sh.qp.ctx.peer_device_bytes.fetch_add(n, Ordering::Relaxed);
            true
        }
        Err(e) => {
            tracing::info!("soft QP {:#x}: copy with a peer's device memory failed ({e}); staging", sh.qp.qpn);
            false
        }
    }
}

/// One local device segment through a host buffer: read out of it and
/// handed to `peer` (`write`), or filled by `peer` and written into it.
///
/// # Safety
/// `a..a + n` is a checked local segment on `d`, held by the WR.
unsafe fn via_host(
    d: &std::sync::Arc<dyn crate::DeviceMemory>,
    a: u64,
    n: usize,
    peer: impl FnOnce(usize) -> Result<(), String>,
    write: bool,
) -> Result<(), String> {
    if write {
        // SAFETY: the caller's segment.
        let v = unsafe { read_device(&**d, a, n) }.map_err(|e| format!("{e:?}"))?;
        peer(v.as_ptr() as usize)
    } else {
        let mut v = vec![0u8; n];
        peer(v.as_mut_ptr() as usize)?;
        // SAFETY: the caller's segment.
        unsafe { write_device(&**d, a, &v) }.map_err(|e| format!("{e:?}"))
    }
}

/// Copies the local pieces to `dst` (gather); `stream`: past the cache.
fn gather_to(dst: usize, local: &[(usize, usize)], stream: bool) {
    let mut off = 0;
    for &(p, l) in local {
        // SAFETY: p..p+l lies in a live, checked local registration (or the
        // inline copy); dst..dst+total was checked against the peer's MR and
        // lies in a live mapping.
        unsafe { crate::soft::copy::copy((dst + off) as *mut u8, p as *const u8, l, stream) };
        off += l;
    }
}

/// Copies from `src` into the local pieces (scatter).
fn scatter_from(src: usize, local: &[(usize, usize)], stream: bool) {
    let mut off = 0;
    for &(p, l) in local {
        // SAFETY: as in gather_to, directions swapped.
        unsafe { crate::soft::copy::copy(p as *mut u8, (src + off) as *const u8, l, stream) };
        off += l;
    }
}

/// Waits until no earlier staged request that touches target memory is
/// still unanswered, so that a direct placement cannot overtake it: the
/// responder executes requests in order, and so must the two paths together.
/// Returns false when the QP failed meanwhile (the WR is then flushed, not
/// placed).
async fn memory_ordered(sh: &Shared) -> bool {
    loop {
        let progressed = sh.progress.notified();
        tokio::pin!(progressed);
        progressed.as_mut().enable();
        {
            let q = sh.lock();
            let pending = q.inflight.iter().any(|f| f.awaiting.is_some() && f.touches_memory);
            if q.broken.is_some() || *sh.qp.state_tx.borrow() == QpState::Err {
                return false;
            }
            if !pending {
                return true;
            }
        }
        progressed.await;
    }
}

/// Completes a WR that needs no response. An error waits until every
/// earlier request has been answered: as a NAK acknowledges everything
/// before it on hardware, earlier WRs still complete normally.
pub(super) async fn finish(sh: &Arc<Shared>, mut inf: Inflight, status: WcStatus) {
    if status != WcStatus::Success && status != WcStatus::WrFlushErr {
        loop {
            let progressed = sh.progress.notified();
            tokio::pin!(progressed);
            progressed.as_mut().enable();
            {
                let q = sh.lock();
                let earlier_pending = q.inflight.iter().any(|f| f.awaiting.is_some());
                if !earlier_pending || q.broken.is_some() || *sh.qp.state_tx.borrow() == QpState::Err {
                    break;
                }
            }
            progressed.await;
        }
    }
    // The QP is in ERR before the error completion can be seen.
    if status != WcStatus::Success {
        sh.qp.set_error_in(sh.life, &format!("send WR failed: {status}"));
    }
    inf.status = Some(status);
    let mut q = sh.lock();
    q.inflight.push_back(inf);
    sh.emit(&mut q);
    drop(q);
    if status != WcStatus::Success {
        sh.flush();
    }
}

/// Executes one posted WR: it joins the engine's batch of device copies
/// ([`DeviceBatch`]) if it can (true), else the batch ends (its WRs
/// finish) and the WR runs alone.
pub(super) async fn execute(sh: &Arc<Shared>, link: &mut Option<Link>, e: SqEntry, batch: &mut DeviceBatch) -> bool {
    let e = match batch.offer(link, e).await {
        Ok(()) => return true,
        Err(e) => e,
    };
    batch.drain(link).await;
    execute_one(sh, link, e).await;
    false
}

/// Executes one WR by itself: direct placement or a request frame.
pub(super) async fn execute_one(sh: &Arc<Shared>, link: &mut Option<Link>, e: SqEntry) {
    // A doorbell record still pending goes first: claimed, or retracted and
    // put on the wire ahead of this WR.
    settle_db(sh, link).await;
    let inf = Inflight::new(e.wr_id, e.op.wc_opcode(), e.signaled, e.len as u32);
    if sh.qp.state_tx.borrow().eq(&QpState::Err) {
        return finish(sh, inf, WcStatus::WrFlushErr).await;
    }
    let (local, mut staging) = match local_ptrs(sh, &e) {
        Ok(l) => l,
        Err(st) => return finish(sh, inf, st).await,
    };
    let local = &local[..];
    let broken = sh.lock().broken;
    let Some(l) = link.as_mut().filter(|_| broken.is_none()) else {
        // Never connected: this WR finds out (RETRY_EXC_ERR) and takes the
        // QP to ERR. Broken later: an earlier WR carries the error, and
        // this one is flushed, as behind the QP's ERR (which may be a
        // moment away, set by the response reader on another thread).
        let st = if link.is_none() { broken.unwrap_or(WcStatus::RetryExcErr) } else { WcStatus::WrFlushErr };
        return finish(sh, inf, st).await;
    };
    if e.fence {
        // Until every earlier READ and atomic is answered — or the link
        // breaks or the QP fails, after which none is answered (the first
        // unanswered WR carries the error, the rest are flushed, and so is
        // this one).
        let closed = loop {
            let notified = sh.progress.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (closed, pending) = {
                let q = sh.lock();
                let closed = q.broken.is_some() || *sh.qp.state_tx.borrow() == QpState::Err;
                (closed, q.inflight.iter().any(|f| matches!(f.awaiting, Some((_, Expect::Read(_) | Expect::Atomic)))))
            };
            if closed || !pending {
                break closed;
            }
            notified.await;
        };
        if closed {
            return finish(sh, inf, WcStatus::WrFlushErr).await;
        }
    }
    let len = e.len;
    let pd = l.remote_pd;
    // Direct placement where the peer's memory is mapped here (after every
    // earlier staged request, and checked again after that wait).
    let (peer, at) = (l.peer.clone(), (l.peer_qpn, l.token));
    let direct = |rkey: u32, raddr: u64, need: AccessFlags| place(sh, peer.as_deref(), at, pd, rkey, raddr, len, need);
    let frame = match e.op {
        SendOp::RdmaWrite { remote_addr, rkey } | SendOp::RdmaWriteWithImm { remote_addr, rkey, .. } => {
            let imm = match e.op {
                SendOp::RdmaWriteWithImm { imm, .. } => Some(imm),
                _ => None,
            };
            let placed = match direct(rkey, remote_addr, AccessFlags::REMOTE_WRITE).await {
                Err(st) => return finish(sh, inf, st).await,
                Ok(Direct::Ptr(p, _keep)) => {
                    if let Err(st) = staging.gather() {
                        return finish(sh, inf, st).await;
                    }
                    gather_to(p, local, sh.qp.stream.observe(remote_addr, len));
                    true
                }
                Ok(Direct::Vm(a, _held)) => {
                    if let Err(st) = staging.gather() {
                        return finish(sh, inf, st).await;
                    }
                    let r = l.peer.as_ref().expect("vm implies a peer").vm_copy(true, local, a, len as usize);
                    match r {
                        Ok(done) => done,
                        Err(st) => return finish(sh, inf, st).await,
                    }
                }
                Ok(Direct::Device(dev, off, _held)) => {
                    let done = device_copy(sh, &*dev, off, (local, &staging), true);
                    if !done {
                        l.peer.as_ref().expect("a device region implies a peer").device_failed(&dev);
                    }
                    done
                }
                Ok(Direct::Staged | Direct::Unmapped(_)) => false,
            };
            match (placed, imm) {
                (true, None) => return finish(sh, inf, WcStatus::Success).await,
                (true, Some(imm)) => Frame::Notify { psn: 0, len: len as u32, imm },
                (false, imm) => Frame::Write { psn: 0, raddr: remote_addr, rkey, len: len as u32, imm },
            }
        }
        SendOp::Send => Frame::Send { psn: 0, len: len as u32, imm: None },
        SendOp::SendWithImm { imm } => Frame::Send { psn: 0, len: len as u32, imm: Some(imm) },
        SendOp::RdmaRead { remote_addr, rkey } => match direct(rkey, remote_addr, AccessFlags::REMOTE_READ).await {
            Err(st) => return finish(sh, inf, st).await,
            Ok(Direct::Ptr(p, _keep)) => {
                scatter_from(p, local, sh.qp.stream.observe(remote_addr, len));
                let st = staging.scatter_back().err().unwrap_or(WcStatus::Success);
                return finish(sh, inf, st).await;
            }
            Ok(Direct::Vm(a, _held)) => {
                match l.peer.as_ref().expect("vm implies a peer").vm_copy(false, local, a, len as usize) {
                    Ok(true) => {
                        let st = staging.scatter_back().err().unwrap_or(WcStatus::Success);
                        return finish(sh, inf, st).await;
                    }
                    Ok(false) => Frame::ReadReq { psn: 0, raddr: remote_addr, rkey, len: len as u32 },
                    Err(st) => return finish(sh, inf, st).await,
                }
            }
            Ok(Direct::Device(dev, off, _held)) => {
                if device_copy(sh, &*dev, off, (local, &staging), false) {
                    return finish(sh, inf, WcStatus::Success).await;
                }
                l.peer.as_ref().expect("a device region implies a peer").device_failed(&dev);
                Frame::ReadReq { psn: 0, raddr: remote_addr, rkey, len: len as u32 }
            }
            Ok(Direct::Staged | Direct::Unmapped(_)) => {
                Frame::ReadReq { psn: 0, raddr: remote_addr, rkey, len: len as u32 }
            }
        },
        SendOp::Atomic { remote_addr, rkey, op } => {
            let (cmp_swap, a, b) = match op {
                AtomicOp::FetchAdd { add } => (false, add, 0),
                AtomicOp::CompareSwap { compare, swap } => (true, compare, swap),
            };
            match direct(rkey, remote_addr, AccessFlags::REMOTE_ATOMIC).await {
                Err(st) => return finish(sh, inf, st).await,
                Ok(Direct::Ptr(p, _keep)) => {
                    // SAFETY: p is 8-byte aligned (checked at post) and inside
                    // the peer's mapped MR; other processes use atomics on it too.
                    let cell = unsafe { &*(p as *const std::sync::atomic::AtomicU64) };
                    let orig = if cmp_swap {
                        match cell.compare_exchange(a, b, Ordering::AcqRel, Ordering::Acquire) {
                            Ok(v) | Err(v) => v,
                        }
                    } else {
                        cell.fetch_add(a, Ordering::AcqRel)
                    };
                    write_u64(local[0].0, orig);
                    let st = staging.scatter_back().err().unwrap_or(WcStatus::Success);
                    return finish(sh, inf, st).await;
                }
                Ok(_) => Frame::Atomic { psn: 0, raddr: remote_addr, rkey, cmp_swap, a, b },
            }
        }
    };
    // A payload from device memory is gathered into host memory first.
    if frame.payload_len() > 0 {
        if let Err(st) = staging.gather() {
            return finish(sh, inf, st).await;
        }
    }
    send_request(sh, link, inf, frame, local, e.segs).await;
}

/// Sends `frame`, the request of the WR `inf`, on the connection: PSN,
/// queue entry and bytes on the wire in one turn; the WR then waits for
/// the answer. `local`: the pieces a payload comes from; `segs`: the local
/// segments it holds until then.
pub(super) async fn send_request(
    sh: &Arc<Shared>,
    link: &mut Option<Link>,
    mut inf: Inflight,
    frame: Frame,
    local: &[(usize, usize)],
    segs: Vec<LocalSeg>,
) {
    while sh.wire_busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        tokio::task::yield_now().await;
    }
    // A doorbell record published since the check at the top (by another
    // posting thread) goes before this frame.
    settle_db_held(sh, link).await;
    if sh.lock().broken.is_some() {
        sh.wire_busy.store(false, Ordering::Release);
        return finish(sh, inf, WcStatus::WrFlushErr).await;
    }
    let Some(l) = link.as_mut() else {
        sh.wire_busy.store(false, Ordering::Release);
        return finish(sh, inf, WcStatus::RetryExcErr).await;
    };
    let psn = sh.next_psn.load(Ordering::Relaxed);
    sh.next_psn.store((psn + 1) & 0x00ff_ffff, Ordering::Relaxed);
    let frame = with_psn(frame, psn);
    let expect = match frame {
        Frame::ReadReq { len, .. } => Expect::Read(len),
        Frame::Atomic { .. } => Expect::Atomic,
        _ => Expect::Ack,
    };
    inf.awaiting = Some((psn, expect));
    inf.touches_memory = !matches!(frame, Frame::Notify { .. });
    inf.segs = segs;
    inf.sent_at = Instant::now();
    {
        let mut q = sh.lock();
        q.inflight.push_back(inf);
    }
    let payload: &[(usize, usize)] = if frame.payload_len() > 0 { local } else { &[] };
    sh.qp.ctx.engine_frames.fetch_add(1, Ordering::Relaxed);
    // SAFETY: the pieces are the WR's checked local segments (or its
    // staging buffer or inline copy), kept alive by the WR until its
    // completion, which comes after this returns.
    let sent = unsafe { send_frame(&mut l.writer, &frame, payload).await };
    sh.wire_busy.store(false, Ordering::Release);
    if let Err(err) = sent {
        sh.fail_link(WcStatus::RetryExcErr, &format!("write to peer: {err}"));
        sh.flush();
    }
}

pub(super) fn write_u64(p: usize, v: u64) {
    // SAFETY: p is a checked 8-byte local SGE of an atomic WR.
    unsafe { std::ptr::write_unaligned(p as *mut u64, v) };
}
