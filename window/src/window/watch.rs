//! A watchdog for stream-ordered waits on this rank's signal buffer: a
//! stream that waits for a peer that died, or never signals, must not wait
//! forever (and every synchronize, free and drop behind it).
//!
//! Whoever queues such waits writes a sequence number into a *progress*
//! word (host memory the device maps) after them, one word per *lane* (a
//! stream, or a communicator's calls: each lane's numbers grow in its
//! stream's order), and tells the watchdog each number as it queues it
//! ([`StreamWatch::issued`]). The watchdog thread reads the words and fails
//! the oldest unfinished number once a peer's connection broke (a
//! same-host peer's death closes it) or the timeout has passed since it
//! was queued (as torch's NCCL watchdog counts). Failing keeps the
//! [`Stalled`] reason and *releases* the streams ([`StreamRelease`]:
//! `u64::MAX` into every slot of this rank's signal buffer, which every
//! wait there reads as reached), again until every lane's last number has
//! been written or the timeout passed once more (a live peer may write its
//! count over the poison). The released work computes garbage; the
//! reason says so.
//!
//! The thread makes no CUDA driver call (host memory only): nothing a
//! stream waits for may take a driver lock (docs/gpu.md).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rmacomm_transport::TransportError;

use super::{PeerWatch, StreamRelease};
use crate::error::Error;

/// Why the watchdog failed a lane's work.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stall {
    /// A peer's connection broke (it died or closed its transport).
    Gone {
        /// The peer.
        peer: usize,
        /// How its connection ended.
        error: TransportError,
    },
    /// The timeout passed since the work was queued; `missing` are the
    /// peers whose signals (or other counts) had not arrived.
    Overdue {
        /// Whom the work waited for.
        missing: Vec<usize>,
        /// The timeout.
        after: Duration,
    },
}

/// The work the watchdog failed, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stalled {
    /// The operation that queued it.
    pub op: &'static str,
    /// Its number in its lane.
    pub seq: u64,
    /// Why.
    pub stall: Stall,
}

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (op, seq) = (self.op, self.seq);
        match &self.stall {
            Stall::Gone { peer, error } => {
                write!(f, "{op} #{seq}: rank {peer} is gone ({error}) while the stream waited for it")
            }
            Stall::Overdue { missing, after } => {
                write!(f, "{op} #{seq}: not done {after:?} after it was queued, waiting for ranks {missing:?}")
            }
        }?;
        write!(f, "; the streams were released (what they computed since is garbage)")
    }
}

impl Stalled {
    /// As the window's error for the released window (its later
    /// operations fail with it).
    pub fn to_error(&self) -> Error {
        match &self.stall {
            Stall::Gone { peer, error } => Error::Rma { op: self.op, peer: *peer, source: error.clone() },
            Stall::Overdue { .. } => Error::Timeout { waiting_for: self.to_string(), after: self.after() },
        }
    }

    fn after(&self) -> Duration {
        match &self.stall {
            Stall::Overdue { after, .. } => *after,
            Stall::Gone { .. } => Duration::ZERO,
        }
    }
}

/// A lane's number queued and not yet seen written.
#[derive(Debug)]
struct Issued {
    lane: usize,
    seq: u64,
    op: &'static str,
    at: Instant,
}

/// Who else is waited for (beyond the window's own signals): for naming
/// the missing ranks.
pub type MissingFn = Arc<dyn Fn() -> Vec<usize> + Send + Sync>;

/// A lane's progress word, read.
pub type ProgressFn = Arc<dyn Fn(usize) -> u64 + Send + Sync>;

struct Shared {
    progress: ProgressFn,
    issued: Mutex<VecDeque<Issued>>,
    wake: Condvar,
    timeout: Duration,
    peers: PeerWatch,
    release: StreamRelease,
    missing: Option<MissingFn>,
    stalled: OnceLock<Stalled>,
    /// Set when the thread has ended (asked to, or done releasing).
    stop: AtomicBool,
    ended: AtomicBool,
}

/// The watchdog (module docs); its thread ends on drop.
pub struct StreamWatch {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for StreamWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamWatch").field("stalled", &self.shared.stalled.get()).finish_non_exhaustive()
    }
}

impl StreamWatch {
    /// Starts watching: `progress(lane)` reads a lane's progress word,
    /// `peers` tells who is gone, `release` releases the streams, `missing`
    /// names further peers waited for.
    pub fn start(
        progress: ProgressFn,
        timeout: Duration,
        peers: PeerWatch,
        release: StreamRelease,
        missing: Option<MissingFn>,
    ) -> std::io::Result<StreamWatch> {
        let shared = Arc::new(Shared {
            progress,
            issued: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            timeout,
            peers,
            release,
            missing,
            stalled: OnceLock::new(),
            stop: AtomicBool::new(false),
            ended: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new().name("rmacomm-stream-watch".into()).spawn(move || {
            run(&s);
            s.ended.store(true, Ordering::Release);
        })?;
        Ok(StreamWatch { shared, thread: Some(thread) })
    }

    /// Number `seq` of `lane` is queued (by `op`): its stream writes it into
    /// the lane's progress word once its waits are through.
    pub fn issued(&self, lane: usize, seq: u64, op: &'static str) {
        let mut q = self.shared.issued.lock().unwrap_or_else(|e| e.into_inner());
        q.push_back(Issued { lane, seq, op, at: Instant::now() });
        drop(q);
        self.shared.wake.notify_one();
    }

    /// Why the watchdog failed the work, if it did.
    pub fn stalled(&self) -> Option<&Stalled> {
        self.shared.stalled.get()
    }

    /// Whether number `seq` of `lane` has been written (the work before it
    /// ran), or why the watchdog failed it; `None` meanwhile.
    pub fn done(&self, lane: usize, seq: u64) -> Option<Result<(), Stalled>> {
        if let Some(s) = self.shared.stalled.get() {
            return Some(Err(s.clone()));
        }
        ((self.shared.progress)(lane) >= seq).then_some(Ok(()))
    }

    /// Waits until every number queued has been written, or the watchdog
    /// has released what was left, at most the timeout and a second: before
    /// the memory the work uses goes.
    pub fn drain(&self) {
        let deadline = Instant::now() + self.shared.timeout + Duration::from_secs(1);
        while Instant::now() < deadline && !self.shared.ended.load(Ordering::Acquire) {
            let q = self.shared.issued.lock().unwrap_or_else(|e| e.into_inner());
            if q.iter().all(|i| (self.shared.progress)(i.lane) >= i.seq) {
                return;
            }
            drop(q);
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for StreamWatch {
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
        let mut q = s.issued.lock().unwrap_or_else(|e| e.into_inner());
        q.retain(|i| (s.progress)(i.lane) < i.seq);
        let Some(oldest) = q.iter().min_by_key(|i| i.at) else {
            // Idle: nothing to watch until something is queued.
            let _ = s.wake.wait_timeout(q, Duration::from_millis(100));
            continue;
        };
        let (op, seq, at) = (oldest.op, oldest.seq, oldest.at);
        drop(q);
        let stall = match s.peers.gone() {
            Some((peer, error)) => Some(Stall::Gone { peer, error }),
            None if at.elapsed() > s.timeout => {
                let mut missing = s.release.signals_missing();
                if let Some(f) = &s.missing {
                    missing.extend(f());
                }
                missing.sort_unstable();
                missing.dedup();
                Some(Stall::Overdue { missing, after: s.timeout })
            }
            None => None,
        };
        let Some(stall) = stall else {
            // Looked at often: a dead peer is seen within a few ms.
            std::thread::sleep(Duration::from_millis(2));
            continue;
        };
        let stalled = Stalled { op, seq, stall };
        tracing::error!("{stalled}");
        let why = stalled.to_error();
        let _ = s.stalled.set(stalled);
        // Released until everything queued has been written (peers may
        // write their counts over the poison meanwhile), for at most the
        // timeout.
        let until = Instant::now() + s.timeout;
        loop {
            s.release.release(&why);
            let q = s.issued.lock().unwrap_or_else(|e| e.into_inner());
            let drained = q.iter().all(|i| (s.progress)(i.lane) >= i.seq);
            drop(q);
            if drained || Instant::now() >= until || s.stop.load(Ordering::Acquire) {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
