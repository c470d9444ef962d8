//! The thread that runs a communicator's async collectives, in the order
//! they were issued, and the completion they report to.
//!
//! Synchronous collectives run on the caller's thread (the GIL released):
//! a hand-off to another thread costs tens of microseconds of wake-ups on
//! a busy machine, more than a small all_reduce. They first wait for the
//! async ones issued before them, so that every rank sees the same order.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use rmacomm_collectives::Comm;

use crate::errors::Failure;

/// One operation's result, set once.
#[derive(Debug, Default)]
pub(crate) struct Completion {
    res: Mutex<Option<Result<(), Failure>>>,
    cv: Condvar,
}

impl Completion {
    fn set(&self, r: Result<(), Failure>) {
        *self.res.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        self.cv.notify_all();
    }

    /// The result, if there is one yet.
    pub(crate) fn try_get(&self) -> Option<Result<(), Failure>> {
        self.res.try_lock().ok().and_then(|r| r.clone())
    }

    /// Waits at most `d` for the result.
    pub(crate) fn wait_for(&self, d: Duration) -> Option<Result<(), Failure>> {
        let g = self.res.lock().unwrap_or_else(|e| e.into_inner());
        let (g, _) = self.cv.wait_timeout_while(g, d, |r| r.is_none()).unwrap_or_else(|e| e.into_inner());
        g.clone()
    }
}

/// An operation on the communicator, run on its worker.
pub(crate) type Op = Box<dyn FnOnce(&mut Comm) -> Result<(), Failure> + Send>;

struct Job {
    op: Op,
    done: Arc<Completion>,
}

/// A communicator's worker: started by the first async operation.
#[derive(Debug, Default)]
pub(crate) struct Worker {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    /// The last operation handed over: once it is done, all are.
    last: Mutex<Option<Arc<Completion>>>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Job")
    }
}

impl Worker {
    /// Queues `op` on the worker of `comm`; its completion.
    pub(crate) fn submit(&self, comm: &Arc<Mutex<Comm>>, name: &str, op: Op) -> Result<Arc<Completion>, Failure> {
        let done = Arc::new(Completion::default());
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.is_none() {
            let (t, rx) = mpsc::channel::<Job>();
            let comm = comm.clone();
            std::thread::Builder::new()
                .name(format!("rmacomm-{name}"))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        let r = {
                            let mut c = comm.lock().unwrap_or_else(|e| e.into_inner());
                            (job.op)(&mut c)
                        };
                        job.done.set(r);
                    }
                })
                .map_err(|e| {
                    Failure::new(crate::errors::ErrKind::Comm, format!("cannot start a worker thread: {e}"))
                })?;
            *tx = Some(t);
        }
        let job = Job { op, done: done.clone() };
        tx.as_ref().expect("set above").send(job).map_err(|_| {
            Failure::new(crate::errors::ErrKind::Comm, "the communicator's worker thread is gone (it panicked?)")
        })?;
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(done.clone());
        Ok(done)
    }

    /// The last operation queued, unless it is done.
    pub(crate) fn busy(&self) -> Option<Arc<Completion>> {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.as_ref().filter(|c| c.try_get().is_none()).cloned()
    }
}
