//! The requesting side of a peer QP's doorbell ([`TxDoorbell`]): opening
//! it, publishing records from the posting thread, completing claimed ones,
//! settling unclaimed ones through the connection, and the watcher.
//!
//! The protocol on one slot lives in `doorbell_proto.rs`; the receiving
//! side in the QP (`qp/doorbell_rx.rs`).

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::fast_notify::FastNotify;
use super::inflight::{Expect, Inflight};
use super::{Link, Shared};
use crate::qp_attr::QpState;
use crate::soft::address::SoftAddress;
use crate::soft::peer::PeerMap;
use crate::soft::qp::SoftQp;
use crate::soft::raw_io::send_frame;
use crate::soft::wire::Frame;
use crate::wc::{WcOpcode, WcStatus};

/// The requesting side of a peer QP's doorbell.
pub(super) struct TxDoorbell {
    slot: crate::soft::doorbell::SlotRef,
    /// The peer's receive CQ event fd (duplicated).
    rx_waker: Arc<OwnedFd>,
    /// The peer QP's life this doorbell was opened in (its records carry it).
    gen: u32,
}

impl Shared {
    /// Completes doorbell WRs whose record the peer has claimed.
    pub(super) fn check_db(&self) {
        if self.qp.db_tx_pending.load(Ordering::Acquire) == 0 {
            return;
        }
        let Some(db) = self.db.get() else { return };
        let slot = db.slot.get();
        let mut q = self.lock();
        let mut done = false;
        for f in q.inflight.iter_mut().filter(|f| f.status.is_none()) {
            if let Some((k, _)) = f.db {
                if crate::soft::doorbell_proto::claimed(slot, k) {
                    f.db = None;
                    f.status = Some(WcStatus::Success);
                    self.qp.db_tx_pending.fetch_sub(1, Ordering::AcqRel);
                    done = true;
                }
            }
        }
        if done {
            self.emit(&mut q);
        }
    }
}

impl FastNotify {
    /// Whether the next WR may go through the peer's doorbell: one is set
    /// up, the peer QP is open with a receive posted, nothing of ours is
    /// pending there, and the peer can ring us.
    pub(crate) fn doorbell_ready(&self) -> bool {
        let Some(db) = self.sh.db.get() else { return false };
        let s = db.slot.get();
        s.open.load(Ordering::Acquire) == 1
            && s.gen.load(Ordering::Acquire) == db.gen
            && s.rq_len.load(Ordering::Acquire) > 0
            && s.no_tx_wake.load(Ordering::Relaxed) == 0
            && crate::soft::doorbell::is_free(s.state.load(Ordering::Acquire))
            && self.sh.qp.db_tx_pending.load(Ordering::Acquire) == 0
    }

    /// Publishes a WRITE_WITH_IMM's notification (its data is placed
    /// already) in the peer's doorbell; rings the peer if it sleeps. The
    /// caller holds the QP's only outstanding-WR slot.
    pub(crate) fn post_doorbell(&self, wr_id: u64, opcode: WcOpcode, signaled: bool, len: u32, imm: u32) -> bool {
        let sh = &self.sh;
        let Some(db) = sh.db.get() else { return false };
        let slot = db.slot.get();
        // The wire's turn: an engine WR posted concurrently either settles
        // this record before its own frame, or is queued ahead of it.
        if sh.wire_busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return false;
        }
        use crate::soft::doorbell_proto::{publish, ring_rx, Published};
        let done = |r: bool| {
            sh.wire_busy.store(false, Ordering::Release);
            r
        };
        // Queued before the record is visible, so that a claim finds it.
        let enqueue = |k: u64| {
            let mut q = sh.lock();
            if q.broken.is_some() {
                return false;
            }
            q.inflight.push_back(Inflight { db: Some((k, imm)), ..Inflight::new(wr_id, opcode, signaled, len) });
            sh.qp.db_tx_pending.fetch_add(1, Ordering::AcqRel);
            true
        };
        let dequeue = |k: u64| {
            let mut q = sh.lock();
            if q.inflight.back().is_some_and(|f| f.db.is_some_and(|d| d.0 == k)) {
                q.inflight.pop_back();
                sh.qp.db_tx_pending.fetch_sub(1, Ordering::AcqRel);
            }
        };
        // A record voided because the peer QP closed meanwhile is left to
        // the watcher, which fails the WR.
        match publish(slot, imm, len, db.gen, enqueue, dequeue) {
            Published::No => return done(false),
            Published::Posted(_) | Published::Voided(_) => {}
        }
        done(true);
        if ring_rx(slot) {
            crate::soft::doorbell::ring(&db.rx_waker);
            sh.qp.ctx.db_rings.fetch_add(1, Ordering::Relaxed);
        }
        sh.db_posts.fetch_add(1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        if sh.db_watch_idle.load(Ordering::SeqCst) && sh.db_watch_idle.swap(false, Ordering::AcqRel) {
            sh.db_wake.notify_one();
        }
        true
    }

    /// Completes doorbell WRs the peer has claimed.
    pub(crate) fn check_doorbell(&self) {
        self.sh.check_db();
    }

    /// Our send CQ is being armed: the peer rings it when it claims (the
    /// caller polls once more after arming).
    pub(crate) fn arm_doorbell(&self) {
        if let Some(db) = self.sh.db.get() {
            crate::soft::doorbell_proto::arm_tx(db.slot.get());
        }
    }
}

impl TxDoorbell {
    /// Maps the peer QP's slot, obtains its receive CQ's event fd and gives
    /// it ours (both over the attach socket). Fails (and the QP notifies
    /// through the connection only) when the peer has no slot or will not
    /// exchange event fds.
    pub(super) async fn open(
        qp: &SoftQp,
        peer: &PeerMap,
        remote: &SoftAddress,
        remote_qpn: u32,
    ) -> Result<TxDoorbell, String> {
        let slot = peer.doorbell(remote).map_err(|e| e.to_string())?;
        let s = slot.get();
        let rx_cq = s.rx_cq.load(Ordering::Acquire);
        let rx_waker = match qp.ctx.wakers.lookup(peer.pid(), rx_cq) {
            Some(w) => w,
            None => {
                let fd = peer
                    .recv_cq_waker(remote_qpn, remote.token)
                    .await
                    .map_err(|e| format!("cannot reach the peer's CQ: {e}"))?;
                qp.ctx.wakers.insert(peer.pid(), rx_cq, fd)
            }
        };
        let (efd, cq) = qp.send_cq_fd();
        peer.give_send_cq_waker(remote_qpn, remote.token, cq, efd)
            .await
            .map_err(|e| format!("the peer did not take our CQ's event fd: {e}"))?;
        s.tx_cq.store(cq, Ordering::Release);
        s.tx_armed.store(0, Ordering::Release);
        s.no_tx_wake.store(0, Ordering::Release);
        let gen = s.gen.load(Ordering::Acquire);
        Ok(TxDoorbell { slot, rx_waker, gen })
    }

    /// Takes record `k` back if the peer has not claimed it: `Ok` when
    /// retracted, `Err(true)` when it was claimed, `Err(false)` otherwise.
    pub(super) fn retract(&self, k: u64) -> Result<(), bool> {
        crate::soft::doorbell_proto::retract(self.slot.get(), k)
    }
}

/// Resolves a pending doorbell WR from the requester task: completed if
/// the peer claimed it, else retracted and sent as a notify on the
/// connection (so that it stays ahead of everything sent after it).
pub(super) async fn settle_db(sh: &Arc<Shared>, link: &mut Option<Link>) {
    if sh.qp.db_tx_pending.load(Ordering::Acquire) == 0 {
        return;
    }
    while sh.wire_busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        tokio::task::yield_now().await;
    }
    settle_db_held(sh, link).await;
    sh.wire_busy.store(false, Ordering::Release);
}

/// [`settle_db`] with `wire_busy` held by the caller (so that no record can
/// be published between this and the caller's own frame).
pub(super) async fn settle_db_held(sh: &Arc<Shared>, link: &mut Option<Link>) {
    if sh.qp.db_tx_pending.load(Ordering::Acquire) == 0 {
        return;
    }
    sh.check_db();
    let Some(db) = sh.db.get() else { return };
    loop {
        let pending = sh.lock().inflight.iter().find_map(|f| f.db.filter(|_| f.status.is_none()));
        let Some((k, imm)) = pending else { return };
        match db.retract(k) {
            Ok(()) => {}
            Err(true) => {
                sh.check_db();
                continue;
            }
            Err(false) => {
                // Voided by the peer: its QP left service (or was reset)
                // before claiming it. As a request to a vanished QP on
                // hardware: RETRY_EXC_ERR, the QP goes to ERR.
                sh.fail_link(WcStatus::RetryExcErr, "the peer QP left service before claiming a doorbell record");
                sh.flush();
                return;
            }
        }
        sh.qp.ctx.db_retracted.fetch_add(1, Ordering::Relaxed);
        let psn = sh.next_psn.load(Ordering::Relaxed);
        let len = {
            let mut q = sh.lock();
            // A connection failure may have resolved it meanwhile.
            let Some(f) = q.inflight.iter_mut().find(|f| f.db.is_some_and(|d| d.0 == k)) else { continue };
            f.db = None;
            f.awaiting = Some((psn, Expect::Ack));
            f.sent_at = Instant::now();
            sh.qp.db_tx_pending.fetch_sub(1, Ordering::AcqRel);
            f.byte_len
        };
        sh.next_psn.store((psn + 1) & 0x00ff_ffff, Ordering::Relaxed);
        let frame = Frame::Notify { psn, len, imm };
        sh.qp.ctx.engine_frames.fetch_add(1, Ordering::Relaxed);
        let sent = match link.as_mut() {
            // SAFETY: no payload.
            Some(l) => unsafe { send_frame(&mut l.writer, &frame, &[]).await },
            None => Err(std::io::Error::new(std::io::ErrorKind::NotConnected, "no connection")),
        };
        if let Err(err) = sent {
            sh.fail_link(WcStatus::RetryExcErr, &format!("write to peer: {err}"));
            sh.flush();
            return;
        }
    }
}

/// The requester is reset: its doorbell records are dropped with every
/// other outstanding WR (verbs' RESET), and taken back from the slot.
pub(super) fn abandon_db(sh: &Shared) {
    let Some(db) = sh.db.get() else { return };
    let mut q = sh.lock();
    for f in q.inflight.iter_mut() {
        if let Some((k, _)) = f.db.take() {
            let _ = db.retract(k);
            sh.qp.db_tx_pending.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Watches a connection's doorbell: a record the peer leaves unclaimed for
/// [`STALE`](crate::soft::doorbell::STALE), or one whose QP closed, is handed to
/// the requester task to go through the connection. Sleeps while the
/// doorbell is unused.
pub(super) async fn db_watch(sh: std::sync::Weak<Shared>) {
    use crate::soft::doorbell::STALE;
    let mut idle_ticks = 0u32;
    let mut last_posts = 0u64;
    loop {
        tokio::time::sleep(STALE).await;
        let Some(s) = sh.upgrade() else { return };
        if matches!(*s.qp.state_tx.borrow(), QpState::Reset) {
            return;
        }
        let posts = s.db_posts.load(Ordering::Relaxed);
        if posts != last_posts {
            last_posts = posts;
            idle_ticks = 0;
        } else {
            idle_ticks += 1;
        }
        if s.qp.db_tx_pending.load(Ordering::Acquire) > 0 {
            s.check_db();
            let closed = s.db.get().is_some_and(|db| db.slot.get().open.load(Ordering::Acquire) == 0);
            let old = s.lock().inflight.iter().any(|f| f.db.is_some() && f.sent_at.elapsed() >= STALE);
            if closed || old {
                s.db_settle.notify_one();
            }
            continue;
        }
        if idle_ticks < 50 {
            continue;
        }
        // Unused for 50 ticks: sleep until the next record (a post after
        // the flag is set wakes us) or the QP leaves service.
        idle_ticks = 0;
        let mut state_rx = s.qp.state_tx.subscribe();
        let notified = s.db_wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        s.db_watch_idle.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        if s.db_posts.load(Ordering::SeqCst) != last_posts {
            s.db_watch_idle.store(false, Ordering::Release);
            continue;
        }
        tokio::select! {
            _ = notified => {}
            _ = state_rx.changed() => {}
        }
        s.db_watch_idle.store(false, Ordering::Release);
    }
}
