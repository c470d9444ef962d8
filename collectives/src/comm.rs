//! `Comm`: a communicator over a group, torchcomms' surface.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use rmacomm_window::{Group, GroupOptions, Window, WindowOptions};

use crate::channel::{Channels, Transfer};
use crate::error::{Error, Result};
use crate::ops::AllReduceAlgo;

/// Settings of a [`Comm`] (torchcomms' `CommOptions`); code wins over the
/// environment.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct CommOptions {
    timeout: Option<Duration>,
    name: Option<String>,
    hints: HashMap<String, String>,
    abort_process_on_timeout_or_error: Option<bool>,
    slot_bytes: Option<usize>,
    window: Option<WindowOptions>,
}

/// Data bytes per channel slot (two slots per pair of ranks).
pub const DEFAULT_SLOT_BYTES: usize = 1 << 20;

/// The largest [`CommOptions::slot_bytes`]: a chunk header counts a slot's
/// bytes in 32 bits.
pub const MAX_SLOT_BYTES: usize = (u32::MAX as usize) & !63;

impl CommOptions {
    /// Options from the environment or defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Timeout of every operation (default `RMACOMM_TIMEOUT_SECONDS`, else
    /// 600 s).
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = Some(t);
        self
    }

    /// The communicator's name (default `"rdma"` plus a number).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// A hint (string map, as torchcomms): `rmacomm::algo` = `oneshot`,
    /// `direct` or `ring` forces the all-reduce algorithm; `ring` also the
    /// ring all_gather_single / reduce_scatter_single, `recursive` recursive
    /// doubling / halving for those two (power-of-two sizes; others use
    /// direct), `tree` the binomial tree broadcast.
    pub fn hint(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.hints.insert(key.into(), value.into());
        self
    }

    /// Abort the process (after printing the error) when an operation
    /// times out or fails, rather than return the error (default
    /// `RMACOMM_ABORT_ON_ERROR`, else false): what long-running jobs want so
    /// that the launcher stops every rank.
    pub fn abort_process_on_timeout_or_error(mut self, on: bool) -> Self {
        self.abort_process_on_timeout_or_error = Some(on);
        self
    }

    /// Data bytes per channel slot (default [`DEFAULT_SLOT_BYTES`]): the
    /// chunk size collectives are pipelined in. Each rank registers
    /// `2 × size × slot` bytes. Every rank must pass the same (checked at
    /// [`Comm::new`], as is the `rmacomm::algo` hint); at most
    /// [`MAX_SLOT_BYTES`].
    pub fn slot_bytes(mut self, n: usize) -> Self {
        self.slot_bytes = Some(n);
        self
    }

    /// Settings of the window underneath (e.g. `unified(false)` to send
    /// same-host data through the transport).
    pub fn window(mut self, w: WindowOptions) -> Self {
        self.window = Some(w);
        self
    }
}

/// A communicator: every collective of torchcomms over the ranks of a
/// [`Group`], on one-sided windows.
///
/// Operations are collective (every rank calls them in the same order)
/// except `send` / `recv` (matched per pair, in order). Buffers are bytes
/// with a [`DType`](rmacomm_kernels::DType) where a reduction needs one.
/// Operations take `&mut self`: one at a time per communicator; use
/// several communicators (e.g. from [`split`](Self::split)) for
/// concurrency.
pub struct Comm {
    pub(crate) ch: Channels,
    group: Group,
    name: String,
    timeout: Duration,
    hints: HashMap<String, String>,
    abort: bool,
    opts: CommOptions,
    /// Collectives started on this communicator (send/recv not counted).
    seq: u64,
    /// Set by `finalize` or an error that leaves the streams inconsistent.
    unusable: Option<String>,
}

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Comm")
            .field("name", &self.name)
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("seq", &self.seq)
            .finish()
    }
}

/// Creates a communicator on `backend` over the group the environment
/// describes (torchrun, Open MPI, Slurm, rmacomm-run): torchcomms'
/// `new_comm`. Backends: `"rdma"` (this crate; also `"rmacomm"`); `"nccl"`
/// and `"rccl"` are GPU backends not available in this build.
///
/// The first call joins the process's default group (rank 0 hosts the
/// store on `MASTER_PORT`, as torch's `init_process_group`); later calls
/// split it (collective), so a process may create many communicators.
pub fn new_comm(backend: &str, opts: CommOptions) -> Result<Comm> {
    check_backend(backend)?;
    static DEFAULT: std::sync::Mutex<Option<&'static Group>> = std::sync::Mutex::new(None);
    let group = {
        let mut d = DEFAULT.lock().unwrap_or_else(|e| e.into_inner());
        match *d {
            Some(g) => g,
            None => {
                let g = GroupOptions::new();
                // The default group waits as long as it must for ranks to
                // start; operations use the communicator's own timeout.
                let group = Group::from_env_with(g).map_err(Error::window("new_comm"))?;
                let group: &'static Group = Box::leak(Box::new(group));
                *d = Some(group);
                group
            }
        }
    };
    Comm::new(group, opts)
}

fn check_backend(backend: &str) -> Result<()> {
    match backend {
        "rdma" | "rmacomm" => Ok(()),
        "nccl" | "rccl" | "ncclx" => Err(Error::Unavailable {
            backend: backend.into(),
            reason: "this Rust Comm moves host memory; the nccl and rccl backends are the Python package's \
                     (rmacomm.new_comm(\"nccl\"), over rmacomm_cuda::nccl_comm); use backend \"rdma\" here"
                .into(),
        }),
        other => Err(Error::Unavailable {
            backend: other.into(),
            reason: "unknown backend; the backends are \"rdma\" (this library), \"nccl\", \"rccl\"".into(),
        }),
    }
}

/// Every rank's slot size and algorithm hint are the same (one exchange),
/// and the slot size is one a window holds: else every rank fails alike.
/// A rank with another slot size placed its chunks at other offsets of the
/// peers' windows (into another pair's slots: a receive returned Ok with
/// bytes of another rank's message); ranks with other hints traded chunks
/// of different algorithms.
fn agree_on_layout(group: &Group, slot_bytes: usize, algo: Option<&String>) -> Result<()> {
    const OP: &str = "new_comm";
    let mine = format!("slot_bytes {slot_bytes}, rmacomm::algo {algo:?}");
    let all = group.exchange("new_comm/layout", mine.as_bytes()).map_err(Error::window(OP))?;
    if let Some((p, theirs)) = all.iter().enumerate().find(|(_, v)| v.as_slice() != mine.as_bytes()) {
        return Err(Error::Mismatch {
            op: OP,
            seq: 0,
            reason: format!(
                "rank {p} has {}; this rank ({}) has {mine}: every rank must pass the same",
                String::from_utf8_lossy(theirs),
                group.rank()
            ),
        });
    }
    if slot_bytes > MAX_SLOT_BYTES {
        return Err(Error::invalid(OP, format!("slot_bytes {slot_bytes}: at most {MAX_SLOT_BYTES}")));
    }
    Ok(())
}

/// Refuses hints no algorithm answers to.
fn check_hints(op: &'static str, opts: &CommOptions) -> Result<()> {
    match opts.hints.get("rmacomm::algo") {
        Some(a) if !["oneshot", "direct", "ring", "tree", "recursive"].contains(&a.as_str()) => {
            Err(Error::invalid(op, format!("hint rmacomm::algo={a:?}: use oneshot, direct, ring, tree or recursive")))
        }
        _ => Ok(()),
    }
}

impl Comm {
    /// A communicator over `group` (collective: every rank calls it).
    pub fn new(group: &Group, opts: CommOptions) -> Result<Comm> {
        const OP: &str = "new_comm";
        // Before anything collective: a refused hint costs the peers nothing.
        check_hints(OP, &opts)?;
        let timeout = opts.timeout.unwrap_or(group.timeout());
        let wopts = opts.window.clone().unwrap_or_default().timeout(timeout);
        let all: Vec<usize> = (0..group.size()).collect();
        let mut group = group.split(&all).map_err(Error::window(OP))?.expect("every rank is in the list");
        group.set_timeout(timeout);
        let slot_bytes = opts.slot_bytes.unwrap_or(DEFAULT_SLOT_BYTES);
        agree_on_layout(&group, slot_bytes, opts.hints.get("rmacomm::algo"))?;
        let ch = Channels::new(&group, slot_bytes, wopts)?;
        let abort = opts.abort_process_on_timeout_or_error.unwrap_or_else(|| {
            std::env::var("RMACOMM_ABORT_ON_ERROR").is_ok_and(|v| matches!(v.as_str(), "1" | "true" | "yes"))
        });
        static NTH: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let name = opts
            .name
            .clone()
            .unwrap_or_else(|| format!("rdma{}", NTH.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
        Ok(Comm { ch, group, name, timeout, hints: opts.hints.clone(), abort, opts, seq: 0, unusable: None })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Ranks in the communicator.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// The communicator's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `"rdma"`.
    pub fn backend(&self) -> &'static str {
        "rdma"
    }

    /// `"cpu"`: the only device this version moves data of.
    pub fn device(&self) -> &'static str {
        "cpu"
    }

    /// The options it was made with.
    pub fn options(&self) -> &CommOptions {
        &self.opts
    }

    /// The timeout of every operation.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The group underneath.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Fails every later operation with `Unusable` and `reason`.
    pub(crate) fn mark_unusable(&mut self, reason: &str) {
        self.unusable.get_or_insert_with(|| reason.to_owned());
    }

    /// Ends the communicator (collective: a barrier); later operations fail.
    pub fn finalize(&mut self) -> Result<()> {
        self.barrier_as("finalize")?;
        self.unusable = Some("finalize() was called".into());
        Ok(())
    }

    /// A communicator of the ranks listed (collective over this one, every
    /// rank passes the same list): `Some` on those ranks (renumbered by
    /// their position in the list), `None` on the others.
    pub fn split(&self, ranks: &[usize]) -> Result<Option<Comm>> {
        self.split_with(ranks, self.opts.clone().name(format!("{}/split", self.name)))
    }

    /// [`split`](Self::split) into a communicator with settings of its own
    /// (a name, a timeout, hints: start from a clone of
    /// [`options`](Self::options), this one's).
    pub fn split_with(&self, ranks: &[usize], opts: CommOptions) -> Result<Option<Comm>> {
        check_hints("split", &opts)?;
        match self.group.split(ranks).map_err(Error::window("split"))? {
            Some(g) => Comm::new(&g, opts).map(Some),
            None => Ok(None),
        }
    }

    /// The window settings of [`CommOptions::window`] (default: the
    /// environment's), with the communicator's timeout.
    fn window_options(&self) -> WindowOptions {
        self.opts.window.clone().unwrap_or_default().timeout(self.timeout)
    }

    /// A new one-sided window over this communicator's ranks (collective),
    /// with the settings of [`CommOptions::window`].
    pub fn new_window(&self) -> Result<Window> {
        Window::new(&self.group, self.window_options()).map_err(Error::window("new_window"))
    }

    /// The window of the ctran form (collective): `size_bytes` of memory
    /// and `signal_slots` value-signal slots per rank, with the settings of
    /// [`CommOptions::window`].
    pub fn window_allocate(&self, size_bytes: usize, signal_slots: usize) -> Result<Window> {
        Window::allocate(&self.group, size_bytes, signal_slots, self.window_options())
            .map_err(Error::window("window_allocate"))
    }

    /// A batch of point-to-point operations issued together.
    pub fn batch_op_create<'a>(&self) -> Batch<'a> {
        Batch { ops: Vec::new() }
    }

    pub(crate) fn begin(&self, op: &'static str) -> Result<()> {
        match &self.unusable {
            Some(reason) => Err(Error::Unusable { op, reason: reason.clone() }),
            None => Ok(()),
        }
    }

    pub(crate) fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(Error::invalid(op, format!("root {root} is not in this communicator of {}", self.size())));
        }
        Ok(())
    }

    pub(crate) fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size() || peer == self.rank() {
            return Err(Error::invalid(
                op,
                format!("peer {peer}: not another rank of this communicator of {}", self.size()),
            ));
        }
        Ok(())
    }

    /// The algorithm the hint `rmacomm::algo` names, if any.
    pub(crate) fn algo_hint(&self) -> Option<&str> {
        self.hints.get("rmacomm::algo").map(String::as_str)
    }

    pub(crate) fn all_reduce_algo(&self, len: usize) -> AllReduceAlgo {
        let default = if len <= crate::ops::ONESHOT_MAX { AllReduceAlgo::OneShot } else { AllReduceAlgo::Direct };
        self.hints.get("rmacomm::algo").and_then(|a| AllReduceAlgo::parse(a)).unwrap_or(default)
    }

    /// Starts a collective: checks the communicator is usable and takes the
    /// next sequence number (every step of the collective carries it).
    /// Called after the call's own argument checks: a call refused for its
    /// arguments takes no number, so the caller's corrected retry is still
    /// the peers' call of that number.
    pub(crate) fn collective(&mut self, op: &'static str) -> Result<()> {
        self.begin(op)?;
        self.seq += 1;
        Ok(())
    }

    /// Runs transfers of the current collective.
    pub(crate) fn exchange(&mut self, op: &'static str, code: u32, transfers: Vec<Transfer<'_>>) -> Result<()> {
        let seq = self.seq;
        self.exchange_seq(op, code, seq, transfers)
    }

    pub(crate) fn exchange_seq(
        &mut self,
        op: &'static str,
        code: u32,
        seq: u64,
        transfers: Vec<Transfer<'_>>,
    ) -> Result<()> {
        let r = self.ch.run(op, code, seq, transfers, self.timeout);
        if let Err(e) = &r {
            // The pair streams may be mid-chunk: nothing later can be
            // matched safely.
            self.unusable = Some(format!("an earlier operation failed: {e}"));
            if self.abort {
                eprintln!(
                    "rmacomm: rank {} of {}: {e}; aborting (abort_process_on_timeout_or_error)",
                    self.rank(),
                    self.name
                );
                std::process::abort();
            }
        }
        r
    }
}

/// A batch of sends and receives (`batch_op_create` → `send` / `recv` →
/// `issue`): all of them progress together, so a rank may send to and
/// receive from the same peers in any order without deadlock. Operations
/// on one pair and direction are matched in the order they were added.
pub struct Batch<'a> {
    ops: Vec<Transfer<'a>>,
}

impl fmt::Debug for Batch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batch").field("ops", &self.ops.len()).finish()
    }
}

impl<'a> Batch<'a> {
    /// Adds a send of `data` to `dst`.
    pub fn send(mut self, data: &'a [u8], dst: usize) -> Self {
        self.ops.push(Transfer::Send { peer: dst, data });
        self
    }

    /// Adds a receive into `out` from `src`.
    pub fn recv(mut self, out: &'a mut [u8], src: usize) -> Self {
        self.ops.push(Transfer::Recv { peer: src, out });
        self
    }

    /// Runs them all on `comm`.
    pub fn issue(self, comm: &mut Comm) -> Result<()> {
        const OP: &str = "batch";
        comm.begin(OP)?;
        for t in &self.ops {
            let p = match t {
                Transfer::Send { peer, .. } | Transfer::Recv { peer, .. } => *peer,
                Transfer::Reduce { .. } => unreachable!("not in batches"),
            };
            comm.check_peer(OP, p)?;
        }
        comm.exchange_seq(OP, crate::ops::SEND, 0, self.ops)
    }
}
