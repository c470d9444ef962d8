//! The soft completion queue: a bounded queue plus an eventfd channel.

use std::any::Any;
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use super::doorbell::{SlotRef, POSTED};

use super::qp::SoftQp;

use crate::provider::CqOps;
use crate::wc::WorkCompletion;
use crate::{Error, Result};

#[derive(Debug)]
pub(crate) struct SoftCq {
    cap: usize,
    q: Mutex<CqState>,
    armed: AtomicBool,
    efd: OwnedFd,
    pub(crate) ctx_uid: u64,
    /// Unique id of this CQ (doorbells share event-fd duplicates per CQ).
    pub(crate) uid: u64,
    /// QPs with doorbells that complete into this CQ (see `doorbell.rs`):
    /// polls pick up their records, arming arms them.
    db: RwLock<Vec<DbReg>>,
    db_n: AtomicUsize,
    /// Connections of this CQ's QPs that a busy-poller may receive on
    /// (`polled_rx.rs`).
    rx: Mutex<Vec<Weak<dyn super::polled_rx::PolledRx>>>,
    rx_n: AtomicUsize,
}

/// A QP whose doorbell work lands in this CQ. The slot and the pending
/// count let a poll see whether there is anything to do without touching
/// the QP.
#[derive(Debug)]
pub(crate) struct DbReg {
    pub(crate) qp: Weak<SoftQp>,
    /// This CQ is the QP's receive CQ: its own slot.
    pub(crate) rx: Option<SlotRef>,
    /// This CQ is the QP's send CQ: its doorbell WRs not finished yet.
    pub(crate) tx: Option<Arc<AtomicU32>>,
}

#[derive(Debug, Default)]
struct CqState {
    entries: VecDeque<WorkCompletion>,
    dropped: u64,
}

impl SoftCq {
    /// The completion channel's event fd, to hand to a same-host peer.
    pub(crate) fn event_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.efd.as_fd()
    }

    pub(crate) fn new(cap: usize, ctx_uid: u64) -> Result<SoftCq> {
        // SAFETY: eventfd has no memory preconditions; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::last_os("eventfd"));
        }
        // SAFETY: fd is a fresh descriptor we own.
        let efd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(SoftCq {
            cap,
            q: Mutex::new(CqState { entries: VecDeque::with_capacity(cap.min(4096)), dropped: 0 }),
            armed: AtomicBool::new(false),
            efd,
            ctx_uid,
            uid: rand::random(),
            db: RwLock::new(Vec::new()),
            db_n: AtomicUsize::new(0),
            rx: Mutex::new(Vec::new()),
            rx_n: AtomicUsize::new(0),
        })
    }

    /// Lets busy-pollers of this CQ receive on a connection (until `rx`
    /// is dropped).
    pub(crate) fn rx_register(&self, rx: Weak<dyn super::polled_rx::PolledRx>) {
        let mut v = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|r| r.strong_count() > 0);
        v.push(rx);
        self.rx_n.store(v.len(), Ordering::Release);
    }

    /// Lets this CQ's polls and arming serve a QP's doorbells.
    pub(crate) fn db_register(&self, reg: DbReg) {
        if reg.rx.is_none() && reg.tx.is_none() {
            return;
        }
        let mut v = self.db.write().unwrap_or_else(|e| e.into_inner());
        v.retain(|r| r.qp.strong_count() > 0);
        v.push(reg);
        self.db_n.store(v.len(), Ordering::Release);
    }

    /// Runs the doorbell side of a poll (`arm` false) or of arming.
    fn db_run(&self, arm: bool) {
        if self.db_n.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut dead = false;
        for r in self.db.read().unwrap_or_else(|e| e.into_inner()).iter() {
            let rx = r.rx.as_ref().is_some_and(|s| arm || s.get().state.load(Ordering::Acquire) & 3 == POSTED);
            let tx = r.tx.as_ref().is_some_and(|p| p.load(Ordering::Acquire) > 0);
            if !rx && !tx {
                continue;
            }
            let Some(qp) = r.qp.upgrade() else {
                dead = true;
                continue;
            };
            match arm {
                false => {
                    if rx {
                        qp.db_claim_in_order();
                    }
                    if tx {
                        qp.db_check_tx();
                    }
                }
                true => {
                    if rx {
                        qp.db_arm_rx();
                    }
                    if tx {
                        qp.db_arm_tx();
                    }
                }
            }
        }
        if dead {
            let mut v = self.db.write().unwrap_or_else(|e| e.into_inner());
            v.retain(|r| r.qp.strong_count() > 0);
            self.db_n.store(v.len(), Ordering::Release);
        }
    }

    /// Adds a completion; on overflow the completion is counted as lost and
    /// every later poll reports the overflow.
    pub(crate) fn push(&self, wc: WorkCompletion) {
        {
            let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
            if q.entries.len() >= self.cap {
                q.dropped += 1;
                if q.dropped == 1 {
                    tracing::error!(capacity = self.cap, "soft CQ overflow: a completion was lost");
                }
            } else {
                q.entries.push_back(wc);
            }
        }
        self.signal();
    }

    fn signal(&self) {
        if self.armed.swap(false, Ordering::AcqRel) {
            let one: u64 = 1;
            // SAFETY: writing 8 bytes from a valid u64 to our eventfd.
            unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }
}

impl CqOps for SoftCq {
    fn capacity(&self) -> usize {
        self.cap
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.db_run(false);
        let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
        if q.dropped > 0 {
            return Err(Error::CqOverflow { capacity: self.cap, dropped: q.dropped });
        }
        let n = out.len().min(q.entries.len());
        for (slot, wc) in out.iter_mut().zip(q.entries.drain(..n)) {
            *slot = wc;
        }
        Ok(n)
    }

    fn req_notify(&self, _solicited_only: bool) -> Result<()> {
        self.armed.store(true, Ordering::Release);
        // A completion that arrived before arming would not signal; verbs
        // users poll once more after arming, which finds it (doorbell
        // records included).
        self.db_run(true);
        Ok(())
    }

    fn channel_fd(&self) -> RawFd {
        self.efd.as_raw_fd()
    }

    fn take_event(&self) -> Result<bool> {
        let mut v: u64 = 0;
        // SAFETY: reading 8 bytes into a valid u64 from our non-blocking eventfd.
        let r = unsafe { libc::read(self.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if r == 8 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::WouldBlock {
            Ok(false)
        } else {
            Err(Error::os("get_cq_event", e))
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn drive(&self) -> bool {
        if self.rx_n.load(Ordering::Acquire) == 0 {
            return false;
        }
        // Another thread is driving: nothing to add.
        let Ok(mut v) = self.rx.try_lock() else { return false };
        let mut did = false;
        let before = v.len();
        v.retain(|r| match r.upgrade() {
            Some(rx) => {
                did |= rx.drive();
                true
            }
            None => false,
        });
        if v.len() != before {
            self.rx_n.store(v.len(), Ordering::Release);
        }
        did
    }

    fn drive_stop(&self) {
        if self.rx_n.load(Ordering::Acquire) == 0 {
            return;
        }
        for rx in self.rx.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(Weak::upgrade) {
            rx.release();
        }
    }
}
