//! `Work`: the handle of one window operation (put, signal, get).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

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
        let done = matches!(*self.lock(), State::Done(_));
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

    /// The operation (`put`, `signal`, `get`).
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The peer rank.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// Whether the operation has finished (successfully or not). Never
    /// blocks: it reaps completions once and looks.
    pub fn is_completed(&self) -> bool {
        let mut st = self.lock();
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
        let mut st = self.lock();
        if let State::Pending(fut) = &mut *st {
            let r = match timeout {
                None => self.rt.block_on(fut.as_mut()),
                Some(t) => match self.rt.block_on(async { tokio::time::timeout(t, fut.as_mut()).await }) {
                    Ok(r) => r,
                    Err(_) => {
                        return Err(Error::Timeout {
                            waiting_for: format!("Work::wait of {} with rank {}", self.op, self.peer),
                            after: t,
                        })
                    }
                },
            };
            *st = State::Done(r);
        }
        match &*st {
            State::Done(r) => r.clone(),
            State::Pending(_) => unreachable!("set above"),
        }
    }
}
