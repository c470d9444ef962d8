//! Device-to-device copies with same-host peers, batched.
//!
//! A WRITE (with or without an immediate) or READ between this process's
//! device memory and a same-host
//! peer's device region (opened through its IPC export) is one copy on the
//! device. Done one WR at a time — queue the copy, wait for the device —
//! every WR pays a device round trip (tens of µs with processes sharing a
//! GPU: ~20 GB/s for 1 MiB fragments on an H200 whose copy engine does
//! 2 TB/s). So the engine queues the copies of consecutive such WRs
//! without waiting ([`DeviceMemory::copy_device_queue`]), merges copies
//! that continue each other (a fragmented message's pieces become one
//! copy, queued once it reaches [`RUN_MAX`] so the device starts while
//! the engine goes on), and waits once when the run ends: the next WR is of another
//! kind, no further WR is posted yet, or [`MAX_BATCH`] WRs (or
//! [`MAX_BATCH_BYTES`]) wait. Their completions then go out, in posting
//! order, before anything later happens on the QP (flushed instead if an
//! earlier WR failed meanwhile); a WRITE_WITH_IMM's notification goes to
//! the peer then, after the wait (its bytes placed), as a lone one placed
//! directly sends it, and it completes when the peer answers (a
//! notifying message's last fragment, or every fragment of DQPLB over
//! several QPs, no longer waits for the device alone). Until then they count as not yet
//! executed, so no posting thread's fast path overtakes them, and each
//! holds its peer region's deregistration fence — so a WR joining an open
//! run is checked without waiting for anything (a segment still to map
//! ends the run).
//!
//! When a queued copy or the wait fails, every WR of the batch is executed
//! again one by one ([`execute_one`]): device to device once more, through
//! host memory or through the connection, as a lone WR would be. That is
//! the same as executing them once because no copy of a run writes bytes
//! that it or an earlier copy of the run reads: a WR that would ends the
//! run instead of joining it. Copies on one queue run in order, so then
//! every copy reads, the second time as the first, the bytes the earlier
//! copies of the run left (or what was there before the run, which no
//! copy of it changed), and the last write of a byte stays (the WRs
//! executed again are fenced, so a READ that goes through the connection
//! then still lands before a later WR reads its bytes). Before the
//! completions, though, a byte written twice in the run may show its
//! earlier value again while the run is executed again (verbs leaves
//! target bytes undefined until the completion; a device copy failed, so
//! the run is on its error path). Writes over
//! the same bytes do join (a benchmark, like perftest, writes one buffer
//! again and again: a run that ended at each of them waited once per WR),
//! and so does a WR that reads what the run wrote (a READ into a buffer,
//! then a WRITE of it to another peer).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::execute::{execute_one, finish, place, send_request};
use super::inflight::Inflight;
use super::{Link, Shared};
use crate::device_mem::{DeviceMemory, PeerDevice};
use crate::qp_attr::QpState;
use crate::soft::mr::Target;
use crate::soft::peer::{Direct, Held};
use crate::soft::qp::SqEntry;
use crate::soft::wire::Frame;
use crate::wc::WcStatus;
use crate::wr::SendOp;
use crate::AccessFlags;

/// Most WRs one wait covers.
pub(super) const MAX_BATCH: usize = 64;
/// Most bytes one wait covers (a run holds its peers' deregistration
/// fences until its wait: ~10 ms at PCIe speed, far below the owner's
/// bound on waiting for them).
const MAX_BATCH_BYTES: u64 = 256 << 20;
/// A merged copy is queued once it reaches this many bytes, so the device
/// copies while the engine takes the next WRs.
const RUN_MAX: usize = 8 << 20;

/// A queued WR: its entry (to execute again if the batch fails), its
/// immediate (a WRITE_WITH_IMM: notified once its bytes are placed) and
/// what keeps the peer's region while its copy may run.
struct Pending {
    e: SqEntry,
    imm: Option<u32>,
    _dev: Arc<dyn PeerDevice>,
    _held: Held,
}

/// One requester task's batch (empty between bursts of posted WRs).
pub(super) struct DeviceBatch {
    /// The local device memory whose queue holds the copies.
    mem: Option<Arc<dyn DeviceMemory>>,
    /// The copy being extended (dst, src, len), not yet queued.
    run: Option<(u64, u64, usize)>,
    wrs: Vec<Pending>,
    /// Bytes the run's WRs move.
    bytes: u64,
    /// A copy failed to queue: the batch is executed again at the drain.
    failed: Option<String>,
    /// Device ranges the run's copies read (start, end).
    reads: Vec<(u64, u64)>,
    /// The requester's count of WRs posted and not yet executed: queued
    /// WRs stay in it until the drain.
    backlog: Arc<AtomicU32>,
    sh: Arc<Shared>,
}

impl DeviceBatch {
    pub(super) fn new(sh: Arc<Shared>, backlog: Arc<AtomicU32>) -> DeviceBatch {
        DeviceBatch { mem: None, run: None, wrs: Vec::new(), bytes: 0, failed: None, reads: Vec::new(), backlog, sh }
    }

    /// Whether another WR could join (the run loop takes the next posted
    /// WR at once while it could).
    pub(super) fn open(&self) -> bool {
        !self.wrs.is_empty() && self.wrs.len() < MAX_BATCH && self.failed.is_none()
    }

    /// Queues `e`'s copies when it is a plain WRITE or READ between local
    /// device memory (all of its segments, on this batch's memory) and a
    /// same-host peer's device region this process opened; gives `e` back
    /// otherwise (nothing done).
    pub(super) async fn offer(&mut self, link: &mut Option<Link>, e: SqEntry) -> Result<(), SqEntry> {
        let sh = &self.sh.clone();
        let (raddr, rkey, write, imm) = match e.op {
            SendOp::RdmaWrite { remote_addr, rkey } => (remote_addr, rkey, true, None),
            SendOp::RdmaWriteWithImm { remote_addr, rkey, imm } => (remote_addr, rkey, true, Some(imm)),
            SendOp::RdmaRead { remote_addr, rkey } => (remote_addr, rkey, false, None),
            _ => return Err(e),
        };
        // Host memory (the common case) never joins: nothing more to check.
        let device = |s: &crate::soft::mr::LocalSeg| s.mr.as_ref().is_some_and(|m| m.device.is_some());
        let full = self.wrs.len() >= MAX_BATCH || (!self.wrs.is_empty() && self.bytes + e.len > MAX_BATCH_BYTES);
        if !e.segs.iter().all(device) || e.fence || e.inline.is_some() || e.len == 0 || full || self.failed.is_some() {
            return Err(e);
        }
        // Every local segment in device memory, on one memory (the batch's).
        let mut locals = Vec::with_capacity(e.segs.len());
        for s in &e.segs {
            match s.target(sh.qp.pd, e.op.local_access()) {
                Ok(Target::Device(d, a)) if self.mem.as_ref().is_none_or(|m| Arc::ptr_eq(m, &d)) => {
                    if self.mem.is_none() {
                        self.mem = Some(d);
                    }
                    locals.push((a, s.len as usize));
                }
                _ => break,
            }
        }
        if locals.len() != e.segs.len() {
            return Err(self.give_back(e));
        }
        // A doorbell record still pending is settled by execute_one first.
        let db_pending = sh.qp.db_tx_pending.load(Ordering::Acquire) > 0;
        if *sh.qp.state_tx.borrow() != QpState::Rts || sh.lock().broken.is_some() || db_pending {
            return Err(self.give_back(e));
        }
        let Some(l) = link.as_ref() else { return Err(self.give_back(e)) };
        let Some(peer) = l.peer.as_deref() else { return Err(self.give_back(e)) };
        let need = if write { AccessFlags::REMOTE_WRITE } else { AccessFlags::REMOTE_READ };
        let pd = l.remote_pd;
        let placed = if self.wrs.is_empty() {
            // The first WR of a run: mapped if need be, after every earlier
            // staged request (nothing of the batch's is held yet).
            place(sh, Some(peer), (l.peer_qpn, l.token), pd, rkey, raddr, e.len, need).await
        } else {
            // The run holds its WRs' fences: nothing may wait now (a
            // segment to map is the lone path's, after the drain). Nothing
            // staged was sent since the run's first WR waited for the
            // earlier ones.
            peer.resolve(pd, rkey, raddr, e.len, need)
        };
        let (dev, off, held) = match placed {
            Ok(Direct::Device(dev, off, held)) => match dev.device_addr() {
                Some(base) => (dev, base + off, held),
                None => return Err(self.give_back(e)),
            },
            _ => return Err(self.give_back(e)),
        };
        let mut at = off;
        let copies: Vec<(u64, u64, usize)> = locals
            .into_iter()
            .map(|(a, n)| {
                let c = if write { (at, a, n) } else { (a, at, n) };
                at += n as u64;
                c
            })
            .collect();
        if !admit(&mut self.reads, &copies) {
            return Err(self.give_back(e));
        }
        for (dst, src, n) in copies {
            self.add(dst, src, n);
        }
        self.bytes += e.len;
        self.wrs.push(Pending { e, imm, _dev: dev, _held: held });
        Ok(())
    }

    /// `e` did not join: the batch forgets its memory if it is empty.
    fn give_back(&mut self, e: SqEntry) -> SqEntry {
        if self.wrs.is_empty() {
            self.mem = None;
        }
        e
    }

    /// Extends the run with a copy, or queues the run and starts anew.
    fn add(&mut self, dst: u64, src: u64, len: usize) {
        if len == 0 {
            return;
        }
        if let Some((d, s, n)) = &mut self.run {
            let merged = (*n + len) as u64;
            // Merged only where the one copy reads nothing it writes (as
            // the two in order would not, unless they overlap).
            let apart = *d + merged <= *s || *s + merged <= *d;
            if *d + *n as u64 == dst && *s + *n as u64 == src && apart {
                *n += len;
                if *n >= RUN_MAX {
                    let r = self.run.take().expect("extended above");
                    self.queue(r);
                }
                return;
            }
        }
        if let Some(r) = self.run.replace((dst, src, len)) {
            self.queue(r);
        }
    }

    /// Queues one copy on the batch's memory (copies it at once where the
    /// memory has no queue).
    fn queue(&mut self, (dst, src, len): (u64, u64, usize)) {
        if self.failed.is_some() {
            return;
        }
        let Some(mem) = &self.mem else { return };
        // SAFETY: both ranges were checked (the local segments at post
        // time, held by their entries; the peer's against its key, its
        // fence held by the pending WR) and stay live until the drain's
        // wait.
        let r = unsafe { mem.copy_device_queue(dst, src, len) }.unwrap_or_else(|| {
            // Not queued: copied now, after what was queued before it.
            mem.copy_device_wait()?;
            // SAFETY: as above.
            unsafe { mem.copy_device(dst, src, len) }
                .unwrap_or_else(|| Err(format!("{} copies nothing device to device", mem.describe())))
        });
        match r {
            Ok(()) => {
                self.sh.qp.ctx.device_copies.fetch_add(1, Ordering::Relaxed);
            }
            Err(why) => self.failed = Some(why),
        }
    }

    /// Ends the batch: queues the last run, waits for the device, and
    /// completes every WR (or executes them again one by one when a copy
    /// failed). Nothing is left pending when this returns.
    pub(super) async fn drain(&mut self, link: &mut Option<Link>) {
        let sh = &self.sh.clone();
        if self.wrs.is_empty() {
            self.mem = None;
            return;
        }
        if let Some(r) = self.run.take() {
            self.queue(r);
        }
        // Whatever was queued has run (or failed) before a fence is let go.
        let waited = match self.mem.take() {
            Some(mem) => {
                sh.qp.ctx.device_copy_waits.fetch_add(1, Ordering::Relaxed);
                mem.copy_device_wait()
            }
            None => Ok(()),
        };
        let waited = match self.failed.take() {
            Some(why) => Err(why),
            None => waited,
        };
        let wrs = std::mem::take(&mut self.wrs);
        let bytes = std::mem::take(&mut self.bytes);
        self.reads.clear();
        match waited {
            Ok(()) => {
                sh.qp.ctx.peer_device_bytes.fetch_add(bytes, Ordering::Relaxed);
                for p in wrs {
                    let e = p.e;
                    let inf = Inflight::new(e.wr_id, e.op.wc_opcode(), e.signaled, e.len as u32);
                    // An earlier WR failed meanwhile (its error is out, or
                    // on its way; a notification of this run's included):
                    // the rest of the run is flushed behind it, as each of
                    // its WRs would have been alone.
                    let failed = sh.lock().broken.is_some() || *sh.qp.state_tx.borrow() == QpState::Err;
                    match p.imm {
                        // Placed: the peer is told, as a lone WRITE_WITH_IMM
                        // placed directly tells it (completed when the peer
                        // answers).
                        Some(imm) if !failed => {
                            let notify = Frame::Notify { psn: 0, len: e.len as u32, imm };
                            send_request(sh, link, inf, notify, &[], e.segs).await;
                        }
                        _ => {
                            let status = if failed { WcStatus::WrFlushErr } else { WcStatus::Success };
                            finish(sh, inf, status).await;
                        }
                    }
                    self.backlog.fetch_sub(1, Ordering::AcqRel);
                }
            }
            Err(why) => {
                tracing::info!(
                    "soft QP {:#x}: {} queued copies with a peer's device memory failed ({why}); each WR again",
                    sh.qp.qpn,
                    wrs.len()
                );
                // The wait above ended the copies: every region and fence
                // is let go before any WR runs again (which may wait).
                let entries: Vec<SqEntry> = wrs.into_iter().map(|p| p.e).collect();
                for (i, mut e) in entries.into_iter().enumerate() {
                    // Fenced: a READ executed again may go through the
                    // connection (its answer landing later), and a WR
                    // behind it in the run may read what it writes, as the
                    // run's copies did in order.
                    e.fence |= i > 0;
                    execute_one(sh, link, e).await;
                    self.backlog.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
    }
}

/// Whether the ranges `[a.0, a.1)` and `[b.0, b.1)` share a byte.
fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// Takes a WR's copies `(dst, src, len)` into a run whose copies read
/// `reads` (start, end), adding what they read; false (`reads` as it
/// was) when one of them writes what the run reads, its own copies and
/// itself included: the WR ends the run instead. Then running the run's
/// WRs again after a failure (the drain) gives what running them once
/// would have (the module's doc says why; `tests::a_run_runs_again_as_once`
/// checks it).
fn admit(reads: &mut Vec<(u64, u64)>, copies: &[(u64, u64, usize)]) -> bool {
    let r0 = reads.len();
    for &(dst, src, n) in copies {
        let w = (dst, dst + n as u64);
        reads.push((src, src + n as u64));
        if reads.iter().any(|&r| overlaps(r, w)) {
            reads.truncate(r0);
            return false;
        }
    }
    true
}

impl Drop for DeviceBatch {
    fn drop(&mut self) {
        // Drained at the end of every burst; a task dropped inside one
        // (runtime shutdown) still lets no fence go while a copy runs.
        if !self.wrs.is_empty() {
            if let Some(mem) = &self.mem {
                let _ = mem.copy_device_wait();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::admit;
    use proptest::prelude::*;

    /// A copy: (dst, src, len).
    type Copy = (u64, u64, usize);

    /// One copy of a model memory, in order, byte by byte; `torn`: only
    /// the bytes it marks (a copy the device left half done).
    fn copy(m: &mut [u8], (dst, src, n): Copy, torn: Option<&[bool]>) {
        let bytes: Vec<u8> = m[src as usize..src as usize + n].to_vec();
        for (i, b) in bytes.into_iter().enumerate() {
            if torn.is_none_or(|t| t[i % t.len()]) {
                m[dst as usize + i] = b;
            }
        }
    }

    fn wr() -> impl Strategy<Value = Vec<Copy>> {
        prop::collection::vec((0u64..48, 0u64..48, 1usize..16), 1..4)
    }

    proptest! {
        /// WRs grouped into runs by `admit`, as the engine does; each run
        /// fails somewhere (some copies done, the next ones torn) and is
        /// executed again from its start: the memory ends as if every WR
        /// ran once.
        #[test]
        fn a_run_runs_again_as_once(
            wrs in prop::collection::vec(wr(), 1..24),
            fails in prop::collection::vec((0usize..64, prop::collection::vec(any::<bool>(), 1..9)), 24),
        ) {
            let start: Vec<u8> = (0..64u32).map(|i| (i * 37 + 11) as u8).collect();
            let mut once = start.clone();
            for w in &wrs {
                for &c in w {
                    copy(&mut once, c, None);
                }
            }
            let mut m = start;
            // (whether the run may fail and run again, its copies)
            let mut runs: Vec<(bool, Vec<Copy>)> = Vec::new();
            let mut reads = Vec::new();
            for w in &wrs {
                // As `execute`: a WR the open run refuses ends it and is
                // executed alone (the lone path: once), and so is one whose
                // copy reads what it writes; the next one opens a run.
                let open = runs.last().is_some_and(|r| r.0);
                if !open {
                    reads.clear();
                }
                match admit(&mut reads, w) {
                    true if open => runs.last_mut().unwrap().1.extend_from_slice(w),
                    true => runs.push((true, w.clone())),
                    false => runs.push((false, w.clone())),
                }
            }
            for ((batched, run), (done, torn)) in runs.iter().zip(fails.iter().cycle()) {
                if !batched {
                    for &c in run {
                        copy(&mut m, c, None);
                    }
                    continue;
                }
                let done = (*done).min(run.len());
                for (i, &c) in run.iter().enumerate() {
                    match i {
                        _ if i < done => copy(&mut m, c, None),
                        _ if i < done + 2 => copy(&mut m, c, Some(torn)),
                        _ => {}
                    }
                }
                for &c in run {
                    copy(&mut m, c, None);
                }
            }
            prop_assert_eq!(m, once);
        }
    }

    /// What the rule refuses: a copy writing what the run reads, or what
    /// it reads itself; what it takes: writes over written bytes, reads of
    /// written bytes.
    #[test]
    fn admit_refuses_only_writes_over_what_is_read() {
        let mut reads = Vec::new();
        assert!(admit(&mut reads, &[(100, 0, 10)]));
        assert!(admit(&mut reads, &[(100, 20, 10)]), "a write over written bytes");
        assert!(admit(&mut reads, &[(200, 105, 10)]), "a read of written bytes");
        assert!(!admit(&mut reads, &[(300, 50, 4), (5, 60, 4)]), "the second copy writes what the run reads");
        assert_eq!(reads.len(), 3, "a refused WR adds nothing");
        assert!(!admit(&mut Vec::new(), &[(10, 5, 10)]), "a copy that reads what it writes");
        assert!(!admit(&mut Vec::new(), &[(0, 50, 8), (50, 70, 8)]), "a WR's copy writing what its first reads");
    }
}
