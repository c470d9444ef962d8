//! Asynchronous operations: a communicator handed to a worker thread
//! ([`AsyncComm`]) runs the operations submitted to it in order, each
//! returning a [`CommWork`] (torchcomms' `async_op=True` → `Work`).

use std::fmt;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::comm::Comm;
use crate::error::{Error, Result};

type Job = Box<dyn FnOnce(&mut Comm) + Send>;

/// A communicator on a worker thread: [`submit`](Self::submit) queues an
/// operation (any closure over the `Comm`, owning its buffers) and returns
/// at once; operations run in submission order, as a collective stream
/// does on one rank. [`into_inner`](Self::into_inner) waits for the queue
/// and gives the communicator back.
pub struct AsyncComm {
    tx: Option<mpsc::Sender<Job>>,
    worker: Option<JoinHandle<Comm>>,
    rank: usize,
}

impl fmt::Debug for AsyncComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncComm").field("rank", &self.rank).finish()
    }
}

/// The handle of one submitted operation (torchcomms' `Work`).
pub struct CommWork<T> {
    rx: mpsc::Receiver<Result<T>>,
    done: Option<Result<T>>,
}

impl<T> fmt::Debug for CommWork<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommWork").field("completed", &self.done.is_some()).finish()
    }
}

impl<T> CommWork<T> {
    /// Whether the operation has finished (never blocks).
    pub fn is_completed(&mut self) -> bool {
        if self.done.is_none() {
            if let Ok(r) = self.rx.try_recv() {
                self.done = Some(r);
            }
        }
        self.done.is_some()
    }

    /// Waits for the operation and returns what it returned (its buffers,
    /// typically), or its error. With a `timeout` (`None`: no limit of its
    /// own; the operation's timeout still applies) that passes, the
    /// operation stays pending: wait again. The result is handed out once.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<T> {
        const OP: &str = "CommWork::wait";
        if let Some(r) = self.done.take() {
            return r;
        }
        let r = match timeout {
            None => self.rx.recv().ok(),
            Some(t) => match self.rx.recv_timeout(t) {
                Ok(r) => Some(r),
                // Pending, not unusable: a caller that rebuilt an unusable
                // communicator threw a healthy one away.
                Err(mpsc::RecvTimeoutError::Timeout) => return Err(Error::Pending { op: OP, after: t }),
                Err(mpsc::RecvTimeoutError::Disconnected) => None,
            },
        };
        r.unwrap_or_else(|| {
            Err(Error::Unusable {
                op: OP,
                reason: "no result: it was handed out already, or the worker thread ended (it panicked)".into(),
            })
        })
    }
}

impl AsyncComm {
    /// Moves `comm` to a worker thread.
    pub fn new(comm: Comm) -> AsyncComm {
        let rank = comm.rank();
        let (tx, rx) = mpsc::channel::<Job>();
        let worker = std::thread::Builder::new()
            .name(format!("rmacomm-comm-{rank}"))
            .spawn(move || {
                let mut comm = comm;
                while let Ok(job) = rx.recv() {
                    // A submitted closure that panics fails its own work
                    // (its result sender goes with the unwinding) and leaves
                    // the communicator unusable, possibly mid-collective;
                    // the worker lives on to fail the later ones.
                    let run = std::panic::AssertUnwindSafe(|| job(&mut comm));
                    if std::panic::catch_unwind(run).is_err() {
                        comm.mark_unusable("an operation submitted to it panicked");
                    }
                }
                comm
            })
            .expect("spawning the communicator's worker thread");
        AsyncComm { tx: Some(tx), worker: Some(worker), rank }
    }

    /// Queues `op` to run on the communicator after everything submitted
    /// before it.
    pub fn submit<T, F>(&self, op: F) -> CommWork<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Comm) -> Result<T> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |c: &mut Comm| {
            let _ = tx.send(op(c));
        });
        // The worker ends only with `self` (it catches panics): were it gone
        // anyway, the job comes back and drops its sender, and the work's
        // wait reports it.
        if let Some(q) = &self.tx {
            let _ = q.send(job);
        }
        CommWork { rx, done: None }
    }

    /// Waits for every submitted operation and returns the communicator.
    pub fn into_inner(mut self) -> Comm {
        drop(self.tx.take());
        self.worker.take().expect("present").join().expect("the communicator's worker thread panicked")
    }
}

impl Drop for AsyncComm {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
