//! A watchdog for stream-ordered waits on this rank's signal buffer: a
//! stream that waits for a peer that died, or never signals, must not wait
//! forever (and every synchronize, free and drop behind it).
//!
//! Whoever queues such waits has the stream write a sequence number into
//! a *progress* word (host memory the device maps) after them, one word per
//! *lane* (a stream, or a communicator's calls: each lane's numbers grow in
//! its stream's order), and tells the watchdog each number before queueing
//! the waits it covers ([`StreamWatch::issued`]). The watchdog thread reads
//! the words and fails the work once
//! - a peer the work waits for (its signals, or what `missing` names, have
//!   not arrived) has a broken connection (a same-host peer's death closes
//!   it),
//! - a peer marked this rank: it released its own streams, whose work then
//!   wrote garbage here (`release` module), or
//! - a lane's oldest number is overdue: the timeout has passed since it was
//!   queued and since the lane last moved (the work before it is done).
//!
//! Kernel waits (a CUDA graph's replays: no host call issues them) are
//! watched too, from what each writes before it waits (`release` module):
//! one that waits for a gone peer fails the work at once, one that has
//! waited the timeout with nothing moving fails it as overdue.
//!
//! Failing keeps the [`Stalled`] reason and *releases* the streams
//! ([`StreamRelease`]), again and again while anything queued is not done
//! (a live peer may write its count over the poison; work may be issued
//! after the failure). The released work computes garbage: of a lane's
//! numbers only those written before the watchdog last looked and saw no
//! cause count as done ([`StreamWatch::done`]).
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
    /// A peer released its own streams (it failed its work), whose work
    /// then wrote what it computed into this rank's memory.
    PeerReleased {
        /// The peer.
        peer: usize,
    },
}

/// The work the watchdog failed, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stalled {
    /// The operation that queued it ([`KERNEL_WAIT`] for a kernel wait).
    pub op: &'static str,
    /// Its number in its lane; for a kernel wait, the count it waited for.
    pub seq: u64,
    /// Why.
    pub stall: Stall,
}

/// [`Stalled::op`] of a kernel wait the watchdog saw on the device with
/// nothing the host issued in flight: a CUDA graph's replay (or a kernel
/// wait of a device without stream memory operations).
pub const KERNEL_WAIT: &str = "a kernel's stream wait (a CUDA graph replay)";

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (op, seq) = (self.op, self.seq);
        if op == KERNEL_WAIT {
            write!(f, "{op} for count {seq}: ")?;
            return match &self.stall {
                Stall::Gone { peer, error } => write!(f, "rank {peer} is gone ({error}) while it waited for it"),
                Stall::Overdue { missing, after } => {
                    write!(f, "waited {after:?} with nothing moving, for ranks {missing:?}")
                }
                Stall::PeerReleased { peer } => write!(f, "rank {peer} failed its part and released its streams"),
            }
            .and_then(|()| write!(f, "; the streams were released (what they computed since is garbage)"));
        }
        match &self.stall {
            Stall::Gone { peer, error } => {
                write!(f, "{op} #{seq}: rank {peer} is gone ({error}) while the stream waited for it")
            }
            Stall::Overdue { missing, after } => {
                write!(f, "{op} #{seq}: not done {after:?} after it was queued, waiting for ranks {missing:?}")
            }
            Stall::PeerReleased { peer } => {
                write!(f, "{op} #{seq}: rank {peer} failed its part and released its streams (their data is garbage)")
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
            Stall::PeerReleased { peer } => {
                Error::PeerFailed { op: self.op, peer: *peer, reason: "it released its streams".into() }
            }
        }
    }

    fn after(&self) -> Duration {
        match &self.stall {
            Stall::Overdue { after, .. } => *after,
            Stall::Gone { .. } | Stall::PeerReleased { .. } => Duration::ZERO,
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
    /// Per lane: its progress as last read while no cause to fail was seen
    /// (what counts as done once the work is failed).
    sound: Mutex<std::collections::HashMap<usize, u64>>,
    stop: AtomicBool,
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
            sound: Mutex::new(std::collections::HashMap::new()),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new().name("rmacomm-stream-watch".into()).spawn(move || run(&s))?;
        Ok(StreamWatch { shared, thread: Some(thread) })
    }

    /// Number `seq` of `lane` is to be queued (by `op`): call it before
    /// queueing the waits it covers (so a failure midway, after some of
    /// them, is still watched); its stream writes it into the lane's
    /// progress word once they are through.
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
    /// ran, soundly), or why the watchdog failed it; `None` meanwhile.
    pub fn done(&self, lane: usize, seq: u64) -> Option<Result<(), Stalled>> {
        let s = &self.shared;
        // Progress first, then the causes: a number written before no cause
        // was there is sound (a releasing peer marks this rank before its
        // garbage can arrive).
        let progress = (s.progress)(lane);
        if s.stalled.get().is_none() && s.release.released_by().is_none() {
            return (progress >= seq).then_some(Ok(()));
        }
        let sound = s.sound.lock().unwrap_or_else(|e| e.into_inner()).get(&lane).copied().unwrap_or(0);
        if seq <= sound {
            return Some(Ok(()));
        }
        // Marked, and the watchdog has not failed the work yet (`None`): it
        // will.
        s.stalled.get().map(|st| Err(st.clone()))
    }

    /// Waits until every number queued has been written (the watchdog
    /// releasing what waits meanwhile), at most the timeout and a second
    /// past the failure, if any: before the memory the work uses goes.
    pub fn drain(&self) {
        let s = &self.shared;
        let mut deadline = ibverbx::deadline_after(s.timeout.saturating_add(Duration::from_secs(1)));
        let mut failed = s.stalled.get().is_some();
        while Instant::now() < deadline {
            let q = s.issued.lock().unwrap_or_else(|e| e.into_inner());
            if q.iter().all(|i| (s.progress)(i.lane) >= i.seq) {
                return;
            }
            drop(q);
            if !failed && s.stalled.get().is_some() {
                // Released now: its waits pass soon.
                failed = true;
                deadline = deadline.max(ibverbx::deadline_after(s.timeout));
            }
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
    // Per lane: its progress as last read, and since when it is so.
    let mut moved: std::collections::HashMap<usize, (u64, Instant)> = std::collections::HashMap::new();
    // Per slot a kernel waits on: what it waits for, what the slot held,
    // and since when both are so.
    let mut kernel_since: std::collections::HashMap<usize, (u64, u64, Instant)> = std::collections::HashMap::new();
    loop {
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        let mut q = s.issued.lock().unwrap_or_else(|e| e.into_inner());
        // Progress first, causes after (`StreamWatch::done`).
        let progress: std::collections::HashMap<usize, u64> =
            q.iter().map(|i| (i.lane, (s.progress)(i.lane))).collect();
        q.retain(|i| progress[&i.lane] < i.seq);
        // Kernel waits in flight (module docs), which no host call issued.
        let kernel = s.release.kernel_waits_in_flight();
        if s.stalled.get().is_some() {
            // Failed: released while anything is left (peers write over
            // the poison — a live peer's signal kernel wraps it to 0 —;
            // work issued after the failure; replays).
            let left = !q.is_empty() || !kernel.is_empty();
            if left {
                drop(q);
                s.release.release(&s.stalled.get().expect("set").to_error());
                std::thread::sleep(Duration::from_millis(1));
            } else {
                let _ = s.wake.wait_timeout(q, Duration::from_millis(100));
            }
            continue;
        }
        let now = Instant::now();
        let marked = s.release.released_by();
        if marked.is_none() {
            let mut sound = s.sound.lock().unwrap_or_else(|e| e.into_inner());
            for (&lane, &p) in &progress {
                sound.insert(lane, p);
            }
        }
        kernel_since.retain(|slot, k| kernel.iter().any(|&(i, want)| i == *slot && want == k.0));
        for &(slot, want) in &kernel {
            let have = s.release.slot_value(slot);
            let e = kernel_since.entry(slot).or_insert((want, have, now));
            if e.1 != have {
                *e = (want, have, now);
            }
        }
        if q.is_empty() && marked.is_none() && kernel.is_empty() {
            // Idle: nothing to watch until something is issued — or until a
            // replay's kernel waits start, seen at the next look (often,
            // once kernels have waited here).
            let look = if s.release.kernel_waits_seen() { 10 } else { 100 };
            let _ = s.wake.wait_timeout(q, Duration::from_millis(look));
            continue;
        }
        for (&lane, &p) in &progress {
            let e = moved.entry(lane).or_insert((p, now));
            if e.0 != p {
                *e = (p, now);
            }
        }
        // Each lane's oldest number: its clock starts when it was issued,
        // or when the lane last moved (the work before it done), whichever
        // is later.
        let mut heads: Vec<(&'static str, u64, Instant)> = Vec::new();
        for i in q.iter() {
            if !heads.iter().any(|h| std::ptr::eq(h.0, i.op) && h.1 == i.seq)
                && q.iter().filter(|j| j.lane == i.lane).all(|j| j.seq >= i.seq)
            {
                let since = moved.get(&i.lane).map_or(i.at, |m| m.1.max(i.at));
                heads.push((i.op, i.seq, since));
            }
        }
        // The work to fail: the oldest issued, else a kernel wait.
        let first = q.front().map(|i| (i.op, i.seq)).or_else(|| kernel.first().map(|k| (KERNEL_WAIT, k.1)));
        drop(q);
        let waited = || {
            let mut m = s.release.signals_missing();
            if let Some(f) = &s.missing {
                m.extend(f());
            }
            m.sort_unstable();
            m.dedup();
            m
        };
        let stall = if let Some(peer) = marked {
            // Failed even with nothing queued: the peer's released work may
            // have written into this rank's memory.
            let (op, seq) = first.unwrap_or(("stream wait", 0));
            Some((op, seq, Stall::PeerReleased { peer }))
        } else if let Some((peer, error)) = s
            .peers
            .gone_among(&waited())
            // Still waited for, looked at again after its connection was
            // seen broken: a peer that leaves normally has its last signals
            // land before it closes, perhaps just after the first look.
            .filter(|(peer, _)| waited().contains(peer))
        {
            first.map(|(op, seq)| (op, seq, Stall::Gone { peer, error }))
        } else {
            let kernel_heads = kernel_since.values().map(|k| (KERNEL_WAIT, k.0, k.2));
            heads
                .iter()
                .copied()
                .chain(kernel_heads)
                .filter(|h| now.duration_since(h.2) > s.timeout)
                .min_by_key(|h| h.2)
                .map(|h| (h.0, h.1, Stall::Overdue { missing: waited(), after: s.timeout }))
        };
        let Some((op, seq, stall)) = stall else {
            // Looked at often: a dead peer is seen within a few ms.
            std::thread::sleep(Duration::from_millis(2));
            continue;
        };
        let stalled = Stalled { op, seq, stall };
        tracing::error!("{stalled}");
        let why = stalled.to_error();
        let _ = s.stalled.set(stalled);
        s.release.release(&why);
    }
}
