//! GpuComm's watchdog (IPC mode): a call whose stream waits for a peer
//! that died, or that never makes the same call, must not leave the stream
//! waiting forever (and every synchronize, free and drop behind it).
//!
//! Each call queued on a stream ends by writing its number into this
//! rank's `done` word (host memory the device maps); the watchdog thread
//! reads it, with the time each call was queued, and fails the oldest
//! unfinished call once a peer's connection broke (a same-host peer's
//! death closes it) or the communicator's timeout has passed since it was
//! queued (as torch's NCCL watchdog counts). Failing it keeps the error
//! (every later call fails with it) and *releases* the streams: every word
//! they may wait on is host memory of this rank's window signal buffer, so
//! storing `u64::MAX` there ([`StreamRelease`]) satisfies each wait (they
//! are all "at least"); peers may write their counts over it, so it is
//! stored again until the `done` word says every queued call has run.
//! The released calls compute garbage: the kept error says so.
//!
//! The thread makes no CUDA driver call (host memory only): nothing a
//! stream waits for may take a driver lock (docs/gpu.md).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rmacomm_window::{PeerWatch, StreamRelease};

use crate::error::Error;

/// A call queued on a stream and not yet seen done.
#[derive(Debug)]
struct Issued {
    call: u64,
    op: &'static str,
    at: Instant,
}

/// What the caller's thread and the watchdog share.
struct Shared {
    /// The `done` word (host memory; the stream writes it).
    done: Arc<dyn Fn() -> u64 + Send + Sync>,
    issued: Mutex<VecDeque<Issued>>,
    wake: Condvar,
    timeout: Duration,
    peers: PeerWatch,
    release: StreamRelease,
    /// Per peer: send/recv chunks this rank's stream waits for (data from
    /// it) and credits it waits for (chunks it took), and where each lands
    /// in this rank's value slots (`p`, `n + p`): who is missing.
    p2p: Vec<(AtomicU64, AtomicU64)>,
    error: OnceLock<Error>,
    stop: AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("error", &self.error.get()).finish_non_exhaustive()
    }
}

/// The watchdog of one GpuComm (module docs); its thread ends on drop.
#[derive(Debug)]
pub(crate) struct Watch {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watch {
    /// Starts watching: `done` reads the `done` word, `ranks` peers.
    pub(crate) fn start(
        done: Arc<dyn Fn() -> u64 + Send + Sync>,
        timeout: Duration,
        peers: PeerWatch,
        release: StreamRelease,
        ranks: usize,
    ) -> std::io::Result<Watch> {
        let shared = Arc::new(Shared {
            done,
            issued: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            timeout,
            peers,
            release,
            p2p: (0..ranks).map(|_| (AtomicU64::new(0), AtomicU64::new(0))).collect(),
            error: OnceLock::new(),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new().name("rmacomm-gpu-watch".into()).spawn(move || run(&s))?;
        Ok(Watch { shared, thread: Some(thread) })
    }

    /// Call `call` (`op`) is queued.
    pub(crate) fn issued(&self, call: u64, op: &'static str) {
        let mut q = self.shared.issued.lock().unwrap_or_else(|e| e.into_inner());
        q.push_back(Issued { call, op, at: Instant::now() });
        drop(q);
        self.shared.wake.notify_one();
    }

    /// The stream will wait for `n` chunks from `peer` in all (recv), or
    /// for `peer` to have taken `n` (send).
    pub(crate) fn expect_p2p(&self, peer: usize, data: Option<u64>, credit: Option<u64>) {
        let (d, c) = &self.shared.p2p[peer];
        if let Some(n) = data {
            d.store(n, Ordering::Release);
        }
        if let Some(n) = credit {
            c.store(n, Ordering::Release);
        }
    }

    /// Why the watchdog failed the communicator, if it did.
    pub(crate) fn error(&self) -> Option<&Error> {
        self.shared.error.get()
    }

    /// Whether call `call` has run (on the device), or why it failed.
    pub(crate) fn call_done(&self, call: u64) -> Option<Result<(), Error>> {
        if let Some(e) = self.shared.error.get() {
            return Some(Err(e.clone()));
        }
        ((self.shared.done)() >= call).then_some(Ok(()))
    }

    /// Waits until every call issued has run or failed (released), at most
    /// the timeout and a little; for the communicator's drop, before its
    /// memory goes.
    pub(crate) fn drain(&self) {
        let last = self.shared.issued.lock().unwrap_or_else(|e| e.into_inner()).back().map(|i| i.call);
        let Some(last) = last else { return };
        let deadline = Instant::now() + self.shared.timeout + Duration::from_secs(1);
        while (self.shared.done)() < last && Instant::now() < deadline {
            if self.shared.error.get().is_some() && self.shared.stop.load(Ordering::Acquire) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The watchdog's loop (module docs).
fn run(s: &Shared) {
    loop {
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        let done = (s.done)();
        let mut q = s.issued.lock().unwrap_or_else(|e| e.into_inner());
        while q.front().is_some_and(|i| i.call <= done) {
            q.pop_front();
        }
        let Some(oldest) = q.front() else {
            // Idle: nothing to watch until a call is queued.
            let _ = s.wake.wait_timeout(q, Duration::from_millis(100));
            continue;
        };
        let (call, op, at, last) = (oldest.call, oldest.op, oldest.at, q.back().map_or(0, |i| i.call));
        drop(q);
        let failure = match s.peers.gone() {
            Some((p, e)) => Some(Error::Unusable {
                op,
                reason: format!(
                    "rank {p} is gone ({e}) while call #{call} ({op}) of this GPU communicator waited for it; its \
                     streams were released (what they computed since is garbage): make a new communicator"
                ),
            }),
            None if at.elapsed() > s.timeout => {
                let missing = missing(s);
                Some(Error::Timeout {
                    op,
                    seq: call,
                    missing: missing.clone(),
                    waiting_for: format!(
                        "call #{call} of this GPU communicator to run on its stream; its streams were released: what \
                         they computed since is garbage, make a new communicator"
                    ),
                    after: s.timeout,
                })
            }
            None => None,
        };
        let Some(e) = failure else {
            // Looked at often: a dead peer is seen within a few ms.
            std::thread::sleep(Duration::from_millis(2));
            continue;
        };
        tracing::error!("{e}");
        let _ = s.error.set(e.clone());
        // Released until every call queued has run (peers may write their
        // counts over the poison meanwhile), for at most the timeout.
        let until = Instant::now() + s.timeout;
        while (s.done)() < last && Instant::now() < until && !s.stop.load(Ordering::Acquire) {
            s.release.release(&rmacomm_window::Error::Unsupported { op: "GpuComm", reason: e.to_string() });
            std::thread::sleep(Duration::from_millis(1));
        }
        s.release.release(&rmacomm_window::Error::Unsupported { op: "GpuComm", reason: e.to_string() });
        s.stop.store(true, Ordering::Release);
        return;
    }
}

/// The peers this rank's stream waits for now: signals not arrived, send
/// credits or recv chunks not arrived.
fn missing(s: &Shared) -> Vec<usize> {
    let mut m = s.release.signals_missing();
    let n = s.p2p.len();
    for (p, (data, credit)) in s.p2p.iter().enumerate() {
        let behind = |disp: usize, want: u64| want > 0 && s.release.value(disp).is_some_and(|v| v < want);
        if (behind(p, data.load(Ordering::Acquire)) || behind(n + p, credit.load(Ordering::Acquire))) && !m.contains(&p)
        {
            m.push(p);
        }
    }
    m.sort_unstable();
    m
}
