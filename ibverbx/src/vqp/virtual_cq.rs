//! The virtual CQ: one physical CQ shared by the physical QPs of its virtual
//! QPs, drained into per-virtual-QP state machines that report virtual
//! completions.

use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use super::virtual_qp::VqpShared;
use crate::{CompletionQueue, Context, Error, Result, WorkCompletion};

/// The longest one sleep of [`VirtualCq::wait`] lasts before it polls again
/// (a concurrent waiter may have taken the wake-up).
const SLEEP_SLICE: Duration = Duration::from_millis(50);

/// A completion queue for [`VirtualQp`](crate::VirtualQp)s. Cheap to clone.
///
/// Every physical QP of every virtual QP created on it completes into one
/// physical CQ; [`poll`](Self::poll) drains that CQ, feeds each physical
/// completion to its virtual QP (which posts queued fragments into the room
/// it frees, replenishes DQPLB receives and reassembles messages) and
/// returns virtual completions: per virtual QP, sends in posting order and
/// receives in arrival order of whole messages.
///
/// Sizing is checked when a virtual QP is created: the physical CQ must hold
/// every completion all its physical QPs can have outstanding at once (send
/// windows plus receive queues), so that no completion can be lost.
///
/// Async use: register [`as_fd`](AsFd::as_fd) with a reactor, then loop
/// [`req_notify`](Self::req_notify) → [`poll`](Self::poll) → await readable
/// (or [`next_deadline`](Self::next_deadline)) → [`take_event`](Self::take_event).
/// Every method is non-blocking except [`wait`](Self::wait).
#[derive(Clone)]
pub struct VirtualCq {
    pub(crate) inner: Arc<VcqInner>,
}

pub(crate) struct VcqInner {
    pub(crate) cq: CompletionQueue,
    reg: Mutex<Registry>,
    /// Serialises draining, so that physical completions reach their
    /// virtual QPs in CQ order; holds the scratch buffer.
    drain: Mutex<Vec<WorkCompletion>>,
}

#[derive(Default)]
struct Registry {
    reserved: usize,
    qps: HashMap<u32, (Weak<VqpShared>, usize)>,
    /// The virtual QPs, as a snapshot that a poll clones without
    /// allocating (rebuilt on every change, which is rare).
    vqps: Arc<[Weak<VqpShared>]>,
}

impl fmt::Debug for VirtualCq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self.reg();
        f.debug_struct("VirtualCq")
            .field("capacity", &self.inner.cq.capacity())
            .field("reserved", &r.reserved)
            .field("virtual_qps", &r.vqps.len())
            .finish()
    }
}

impl VirtualCq {
    /// A virtual CQ whose physical CQ has `cqe` entries.
    pub fn new(ctx: &Context, cqe: usize) -> Result<VirtualCq> {
        let cq = ctx.create_cq(cqe)?;
        Ok(VirtualCq {
            inner: Arc::new(VcqInner {
                cq,
                reg: Mutex::new(Registry::default()),
                drain: Mutex::new(vec![WorkCompletion::empty(); 64]),
            }),
        })
    }

    fn reg(&self) -> MutexGuard<'_, Registry> {
        self.inner.reg.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Entries of the physical CQ.
    pub fn capacity(&self) -> usize {
        self.inner.cq.capacity()
    }

    /// Entries already promised to virtual QPs.
    pub fn reserved(&self) -> usize {
        self.reg().reserved
    }

    /// The physical CQ (every physical QP of this CQ's virtual QPs uses it).
    pub fn physical(&self) -> &CompletionQueue {
        &self.inner.cq
    }

    pub(crate) fn reserve(&self, n: usize) -> Result<()> {
        let mut r = self.reg();
        let cap = self.inner.cq.capacity();
        if r.reserved + n > cap {
            return Err(Error::InvalidArgument {
                verb: "create_virtual_qp",
                reason: format!(
                    "the VirtualCq's {cap} entries cannot hold the {} completions its virtual QPs may have outstanding \
                     ({} already reserved, {n} for this one); create the VirtualCq with at least {} entries",
                    r.reserved + n,
                    r.reserved,
                    r.reserved + n
                ),
            });
        }
        r.reserved += n;
        Ok(())
    }

    pub(crate) fn release(&self, n: usize) {
        let mut r = self.reg();
        r.reserved = r.reserved.saturating_sub(n);
    }

    pub(crate) fn register(&self, vqp: &Arc<VqpShared>, qpns: &[u32]) {
        let mut r = self.reg();
        for (i, &qpn) in qpns.iter().enumerate() {
            r.qps.insert(qpn, (Arc::downgrade(vqp), i));
        }
        let mut v = r.vqps.to_vec();
        v.push(Arc::downgrade(vqp));
        r.vqps = v.into();
    }

    pub(crate) fn unregister(&self, vqp: &Arc<VqpShared>, qpns: &[u32], reserved: usize) {
        let mut r = self.reg();
        for qpn in qpns {
            r.qps.remove(qpn);
        }
        let me = Arc::downgrade(vqp);
        let v: Vec<Weak<VqpShared>> =
            r.vqps.iter().filter(|w| !w.ptr_eq(&me) && w.strong_count() > 0).cloned().collect();
        r.vqps = v.into();
        r.reserved = r.reserved.saturating_sub(reserved);
    }

    fn route(&self, wcs: &[WorkCompletion]) {
        if wcs.is_empty() {
            return;
        }
        let targets: Vec<Option<(Arc<VqpShared>, usize)>> = {
            let r = self.reg();
            wcs.iter().map(|wc| r.qps.get(&wc.qp_num).and_then(|(w, i)| Some((w.upgrade()?, *i)))).collect()
        };
        let now = Instant::now();
        for (wc, t) in wcs.iter().zip(targets) {
            match t {
                Some((vqp, idx)) => vqp.on_physical(idx, *wc, now),
                // A completion of a virtual QP already destroyed.
                None => tracing::trace!(qpn = wc.qp_num, "dropping a completion of a destroyed virtual QP"),
            }
        }
    }

    /// Drains the physical CQ and feeds every completion to its virtual QP
    /// (under the drain lock, so that completions are routed in the order
    /// the CQ gave them). Returns how many physical completions were routed.
    fn drain_once(&self) -> Result<usize> {
        let mut scratch = self.inner.drain.lock().unwrap_or_else(|e| e.into_inner());
        let mut routed = 0;
        loop {
            let n = self.inner.cq.poll(&mut scratch)?;
            self.route(&scratch[..n]);
            routed += n;
            if n < scratch.len() {
                return Ok(routed);
            }
        }
    }

    /// [`drain_once`](Self::drain_once), waiting up to `wait` (timeout,
    /// busy-poll) for a first completion when given. The drain lock is
    /// never held while waiting: a concurrent `poll` stays non-blocking.
    /// Another waiter may consume the channel event meant for this one, so
    /// one sleep lasts at most [`SLEEP_SLICE`].
    fn progress_inner(&self, wait: Option<(Duration, Duration)>) -> Result<usize> {
        let routed = self.drain_once()?;
        let Some((timeout, busy)) = wait else { return Ok(routed) };
        if routed > 0 {
            return Ok(routed);
        }
        let start = Instant::now();
        let mut spins = 0u32;
        while start.elapsed() < busy.min(timeout) {
            let n = self.drain_once()?;
            if n > 0 {
                return Ok(n);
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(8) && self.inner.cq.drive() {
                continue;
            }
            std::hint::spin_loop();
        }
        self.inner.cq.drive_stop();
        self.inner.cq.req_notify()?;
        let n = self.drain_once()?;
        if n > 0 {
            return Ok(n);
        }
        let sleep = timeout.saturating_sub(start.elapsed()).min(SLEEP_SLICE);
        let mut pfd = libc::pollfd { fd: self.inner.cq.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: pfd is a valid pollfd array of length 1.
        let r = unsafe { libc::poll(&mut pfd, 1, sleep.as_millis().min(i32::MAX as u128) as i32 + 1) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::os("poll(virtual cq channel)", e));
            }
        }
        let _ = self.inner.cq.take_event()?;
        self.drain_once()
    }

    fn collect(&self, out: &mut [WorkCompletion]) -> usize {
        let vqps = self.reg().vqps.clone();
        let mut n = 0;
        for v in vqps.iter() {
            if n == out.len() {
                break;
            }
            if let Some(v) = v.upgrade() {
                n += v.drain_into(&mut out[n..]);
            }
        }
        n
    }

    /// Drains the physical CQ and lets every virtual QP act on what it
    /// found (post queued fragments, replenish DQPLB receives, reassemble),
    /// keeping the virtual completions for [`poll`](Self::poll). Never
    /// blocks. Both ends must make progress: a sender's queued fragments go
    /// out, and a DQPLB receiver's receives are replenished, only here (or
    /// in `poll`/`wait`).
    pub fn progress(&self) -> Result<()> {
        self.progress_inner(None).map(|_| ())
    }

    /// Moves up to `out.len()` virtual completions into `out`; returns how
    /// many. Never blocks. Returns [`Error::CqOverflow`] if the physical CQ
    /// overflowed (only possible when its physical QPs are used directly).
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        // Route what the physical CQ holds, then collect once.
        self.progress_inner(None)?;
        Ok(self.collect(out))
    }

    /// [`CompletionQueue::drive`] on the physical CQ: progress by the
    /// calling thread, for busy-pollers.
    pub fn drive(&self) -> bool {
        self.inner.cq.drive()
    }

    /// [`CompletionQueue::drive_stop`] on the physical CQ.
    pub fn drive_stop(&self) {
        self.inner.cq.drive_stop()
    }

    /// Waits until a virtual completion is available or `timeout` passes
    /// (`None`: forever), busy-polling for `busy_poll` first; returns how
    /// many completions were moved into `out` (0 on timeout).
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Option<Duration>, busy_poll: Duration) -> Result<usize> {
        // A timeout past what the clock counts is forever.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            let n = self.poll(out)?;
            if n > 0 || out.is_empty() {
                return Ok(n);
            }
            let now = Instant::now();
            let wake = match (deadline, self.next_deadline()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if deadline.is_some_and(|d| now >= d) {
                return Ok(0);
            }
            let slice = wake.map_or(Duration::from_secs(3600), |w| w.saturating_duration_since(now));
            self.progress_inner(Some((slice, busy_poll)))?;
        }
    }

    /// The earliest time at which a virtual QP gives up waiting for a lost
    /// fragment; an async driver wakes then and calls [`poll`](Self::poll).
    pub fn next_deadline(&self) -> Option<Instant> {
        let vqps = self.reg().vqps.clone();
        vqps.iter().filter_map(Weak::upgrade).filter_map(|v| v.deadline()).min()
    }

    /// Arms the completion channel: the next physical completion makes the
    /// fd readable. Poll once more after arming.
    pub fn req_notify(&self) -> Result<()> {
        self.inner.cq.req_notify()
    }

    /// Consumes a pending channel event without blocking.
    pub fn take_event(&self) -> Result<bool> {
        self.inner.cq.take_event()
    }
}

impl AsFd for VirtualCq {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.cq.as_fd()
    }
}

impl AsRawFd for VirtualCq {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.cq.as_raw_fd()
    }
}
