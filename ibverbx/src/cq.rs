//! Completion queues and their completion channels.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::provider::CqOps;
use crate::wc::WorkCompletion;
use crate::{Context, Error, Result};

/// A completion queue with its own completion channel. Cheap to clone.
///
/// Non-blocking use: [`poll`](Self::poll). Blocking use:
/// [`wait`](Self::wait). Async use: register [`as_fd`](AsFd::as_fd) with a
/// reactor (it is non-blocking and readable while an event is pending), then
/// loop `req_notify` → `poll` → await readable → `take_event`: arming before
/// the poll is what makes a lost wake-up impossible.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

pub(crate) struct CqInner {
    pub(crate) ops: Arc<dyn CqOps>,
    _ctx: Context,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue").field("capacity", &self.inner.ops.capacity()).finish()
    }
}

impl CompletionQueue {
    pub(crate) fn new(ops: Arc<dyn CqOps>, ctx: Context) -> Self {
        CompletionQueue { inner: Arc::new(CqInner { ops, _ctx: ctx }) }
    }

    /// Entries the CQ holds.
    pub fn capacity(&self) -> usize {
        self.inner.ops.capacity()
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    /// Returns [`Error::CqOverflow`] once completions were lost.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.inner.ops.poll(out)
    }

    /// Progress on the calling thread for a busy-poller (see
    /// [`CqOps::drive`]): the soft provider over tcp receives here what is
    /// waiting on this CQ's QPs' connections. True when it did something;
    /// nothing to do on hardware.
    pub fn drive(&self) -> bool {
        self.inner.ops.drive()
    }

    /// Ends [`drive`](Self::drive)s before the caller sleeps: the
    /// provider's threads take the connections back (otherwise they do
    /// after a millisecond without drives).
    pub fn drive_stop(&self) {
        self.inner.ops.drive_stop()
    }

    /// Arms the channel: the next completion makes the fd readable.
    pub fn req_notify(&self) -> Result<()> {
        self.inner.ops.req_notify(false)
    }

    /// Consumes a pending channel event without blocking; returns whether
    /// there was one.
    pub fn take_event(&self) -> Result<bool> {
        self.inner.ops.take_event()
    }

    /// Waits until at least one completion is available or `timeout` passes
    /// (`None`: forever), then polls into `out`. It first busy-polls for
    /// `busy_poll` (lowest latency, burns a core), then sleeps on the
    /// completion channel (no CPU while idle). Returns 0 on timeout, and
    /// at once for an empty `out` (there is nothing to poll into).
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Option<Duration>, busy_poll: Duration) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let start = Instant::now();
        // A timeout past what the clock counts is forever.
        let deadline = timeout.and_then(|t| start.checked_add(t));
        // The busy phase ends with the timeout too.
        let busy_poll = timeout.map_or(busy_poll, |t| busy_poll.min(t));
        let mut spins = 0u32;
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            if start.elapsed() >= busy_poll {
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(8) && self.drive() {
                continue;
            }
            std::hint::spin_loop();
        }
        self.drive_stop();
        loop {
            self.req_notify()?;
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            let wait_ms = match deadline {
                None => -1,
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(0);
                    }
                    // At most i32::MAX (about 24.8 days: poll's limit; the loop
                    // waits again).
                    (d - now).as_millis().min(i32::MAX as u128 - 1) as i32 + 1
                }
            };
            let mut pfd = libc::pollfd { fd: self.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: pfd is a valid pollfd array of length 1.
            let r = unsafe { libc::poll(&mut pfd, 1, wait_ms) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::os("poll(cq channel)", e));
                }
            }
            self.take_event()?;
        }
    }

    /// The provider's CQ object.
    pub fn ops(&self) -> &Arc<dyn CqOps> {
        &self.inner.ops
    }
}

impl AsRawFd for CompletionQueue {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.ops.channel_fd()
    }
}

impl AsFd for CompletionQueue {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the provider owns the fd for as long as the CQ (and so
        // `self`) lives.
        unsafe { BorrowedFd::borrow_raw(self.inner.ops.channel_fd()) }
    }
}
