//! `Work`: the handle of one window operation (put, signal, get).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;

use crate::error::{Error, Result};

type OpFuture<'a> = Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;

enum State<'a> {
    Pending(OpFuture<'a>),
    Done(Result<()>),
}

/// The handle of one window operation, as torchcomms' `Work`.
///
/// [`is_completed`](Self::is_completed) asks without blocking;
/// [`wait`](Self::wait) blocks the calling thread (never call it from
/// inside a tokio runtime: use `spawn_blocking`). Errors (a timeout, a peer
/// that went away) surface here, naming the operation and the peer, and are
/// returned again by every later `wait`.
///
/// A `Work` borrows the window and the local memory of its operation, so
/// neither can go while it lives. Dropping one that has not completed
/// detaches the operation: it goes on (its memory stays registered until it
/// completes), and its result is lost; the window's
/// [`tensor_deregister`](crate::Window::tensor_deregister) still waits for it.
pub struct Work<'a> {
    op: &'static str,
    peer: usize,
    rt: Handle,
    state: Mutex<State<'a>>,
}

impl fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never blocks (another thread may be waiting on it).
        let done = self.try_lock().map(|st| matches!(*st, State::Done(_)));
        f.debug_struct("Work").field("op", &self.op).field("peer", &self.peer).field("done", &done).finish()
    }
}

impl<'a> Work<'a> {
    pub(crate) fn new(rt: Handle, op: &'static str, peer: usize, fut: OpFuture<'a>) -> Self {
        Work { op, peer, rt, state: Mutex::new(State::Pending(fut)) }
    }

    /// A `Work` for an operation that finished when it was issued (the
    /// UNIFIED path's copies and signals).
    pub(crate) fn done(rt: Handle, op: &'static str, peer: usize, r: Result<()>) -> Self {
        Work { op, peer, rt, state: Mutex::new(State::Done(r)) }
    }

    fn lock(&self) -> MutexGuard<'_, State<'a>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state, unless another thread holds it (waiting on the Work).
    fn try_lock(&self) -> Option<MutexGuard<'_, State<'a>>> {
        match self.state.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// The operation (`put`, `signal`, `get`).
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The peer rank.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// Whether the operation has finished (successfully or not). Never
    /// blocks: it reaps completions once and looks (`false` while another
    /// thread is in [`wait`](Self::wait) on it: that one reaps them).
    pub fn is_completed(&self) -> bool {
        let Some(mut st) = self.try_lock() else { return false };
        if let State::Pending(fut) = &mut *st {
            // The runtime's context, for the timers inside the future; a
            // no-op waker, since `wait` polls again with a real one.
            let _rt = self.rt.enter();
            if let Poll::Ready(r) = fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
                *st = State::Done(r);
            }
        }
        matches!(*st, State::Done(_))
    }

    /// Blocks until the operation has finished and returns its result, or
    /// fails with [`Error::Timeout`] after `timeout` (`None`: no limit of
    /// its own; the operation's timeout still applies). A timed-out wait
    /// leaves the operation pending: wait again later.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let start = Instant::now();
        let timed_out = |t: Duration| Error::Timeout {
            waiting_for: format!("Work::wait of {} with rank {}", self.op, self.peer),
            after: t,
        };
        let mut st = match timeout {
            None => self.lock(),
            // Another thread waiting on this Work holds it: a bounded wait
            // stays bounded (it waited for the other's whole wait).
            Some(t) => loop {
                if let Some(g) = self.try_lock() {
                    break g;
                }
                if start.elapsed() >= t {
                    return Err(timed_out(t));
                }
                std::thread::sleep(Duration::from_millis(1));
            },
        };
        if let State::Pending(fut) = &mut *st {
            let r = match timeout {
                None => self.rt.block_on(fut.as_mut()),
                Some(t) => {
                    let left = t.saturating_sub(start.elapsed());
                    match self.rt.block_on(async { tokio::time::timeout(left, fut.as_mut()).await }) {
                        Ok(r) => r,
                        Err(_) => return Err(timed_out(t)),
                    }
                }
            };
            *st = State::Done(r);
        }
        match &*st {
            State::Done(r) => r.clone(),
            State::Pending(_) => unreachable!("set above"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_threads_wait_blocks_neither_is_completed_nor_a_bounded_wait() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let fut: OpFuture<'static> = Box::pin(async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            Ok(())
        });
        let w = std::sync::Arc::new(Work::new(rt.handle().clone(), "put", 1, fut));
        let waiter = {
            let w = w.clone();
            std::thread::spawn(move || w.wait(None))
        };
        std::thread::sleep(Duration::from_millis(100));
        // The waiter holds the state for its whole wait: these blocked
        // until it ended (2 s).
        let t0 = Instant::now();
        assert!(!w.is_completed());
        assert!(format!("{w:?}").contains("done: None"), "{w:?}");
        let e = w.wait(Some(Duration::from_millis(50))).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        waiter.join().unwrap().unwrap();
        assert!(w.is_completed());
        w.wait(Some(Duration::ZERO)).unwrap();
    }
}
