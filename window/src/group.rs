//! `Group`: the ranks of a job, bootstrapped through a [`Store`].

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::host_id::host_id;
use crate::launch_env::{default_timeout, LaunchEnv};
use crate::prefix_store::PrefixStore;
use crate::store::{Store, MAX_KEYS};

/// The most ranks a group has: its creation reads one key per rank in one
/// store call, which holds at most [`MAX_KEYS`]. A larger size (an
/// argument, `WORLD_SIZE` and its kin, `rmacomm-run --nproc-per-node`) is
/// refused before anything is published.
pub const MAX_GROUP_SIZE: usize = MAX_KEYS;
use crate::tcp_store::TcpStore;

/// Settings for creating a [`Group`]; code wins over the environment.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct GroupOptions {
    timeout: Option<Duration>,
    host_id: Option<String>,
}

impl GroupOptions {
    /// Options with every value from the environment or its default.
    pub fn new() -> Self {
        Self::default()
    }

    /// Timeout of every group operation (default: `RMACOMM_TIMEOUT_SECONDS`, else 600 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Overrides this process's host identity (default: [`host_id()`](crate::host_id)),
    /// e.g. to make ranks on one machine behave as if on different hosts in tests.
    pub fn host_id(mut self, id: impl Into<String>) -> Self {
        self.host_id = Some(id.into());
        self
    }
}

/// The ranks of a job (or a subset split from it) and their bootstrap store.
///
/// Group operations ([`barrier`](Self::barrier), [`exchange`](Self::exchange),
/// [`split`](Self::split)) are *collective*: every rank of the group calls the
/// same operations in the same order, as with MPI or torch.distributed. Each
/// call takes the group's next sequence number and keeps its keys under it,
/// so operations can be repeated and a late rank never sees an earlier
/// operation's keys. Keys this rank wrote are deleted once a later barrier
/// proves every rank has read them.
pub struct Group {
    rank: usize,
    size: usize,
    store: Arc<PrefixStore>,
    hosts: Vec<String>,
    timeout: Duration,
    launch: Option<LaunchEnv>,
    next_op: AtomicU64,
    /// Keys this rank wrote, deletable after the next barrier.
    garbage: Mutex<Vec<String>>,
}

impl fmt::Debug for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank())
            .field("local_size", &self.local_size())
            .field("prefix", &self.store.prefix())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Group {
    /// Joins a group of `size` ranks as `rank`, through `store`. Collective:
    /// returns once every rank has joined (or fails after the timeout).
    ///
    /// Each rank publishes its host identity and its idea of `size`. Ranks
    /// that disagree on `size` fail: those expecting fewer ranks with
    /// [`Error::Mismatch`] naming the rank that disagrees, those expecting
    /// more with a timeout naming the ranks that never came. Several groups may
    /// be created on one store: the n-th group each rank creates uses its own
    /// key space.
    pub fn new(rank: usize, size: usize, store: Arc<dyn Store>) -> Result<Self> {
        Self::with_options(rank, size, store, GroupOptions::default())
    }

    /// [`new`](Self::new) with options.
    pub fn with_options(rank: usize, size: usize, store: Arc<dyn Store>, options: GroupOptions) -> Result<Self> {
        if size == 0 {
            return Err(Error::invalid("Group::new", "size is 0; a group has at least one rank"));
        }
        if size > MAX_GROUP_SIZE {
            return Err(Error::invalid(
                "Group::new",
                format!("size {size} is above the largest group, {MAX_GROUP_SIZE} ranks"),
            ));
        }
        if rank >= size {
            return Err(Error::invalid("Group::new", format!("rank {rank} is not below size {size}")));
        }
        let timeout = match options.timeout {
            Some(t) => t,
            None => default_timeout()?,
        };
        let generation = store.add(&format!("rmacomm/groups/{rank}"), 1)?;
        let store = Arc::new(PrefixStore::new(format!("rmacomm/g{generation}/"), store));
        let me = options.host_id.unwrap_or_else(host_id);
        store.set(&format!("join/{rank}"), format!("{size}\n{me}").as_bytes())?;
        let keys: Vec<String> = (0..size).map(|r| format!("join/{r}")).collect();
        let joined = store
            .multi_get(&refs(&keys), timeout)
            .map_err(|e| missing_ranks(&*store, e, &keys, || format!("group creation (rank {rank} of {size})")))?;
        let mut hosts = Vec::with_capacity(size);
        for (r, value) in joined.iter().enumerate() {
            let text = String::from_utf8_lossy(value);
            let (their_size, host) = text.split_once('\n').unwrap_or(("?", ""));
            if their_size != size.to_string() {
                return Err(Error::Mismatch {
                    op: "group creation".into(),
                    detail: format!("rank {r} says the size is {their_size}, rank {rank} says {size}"),
                });
            }
            hosts.push(host.to_string());
        }
        Ok(Group {
            rank,
            size,
            store,
            hosts,
            timeout,
            launch: None,
            next_op: AtomicU64::new(0),
            garbage: Mutex::new(Vec::new()),
        })
    }

    /// The job's group, from the launcher's environment (torchrun,
    /// rmacomm-run, Open MPI, Slurm; see [`LaunchEnv::detect`]). Rank 0 hosts
    /// a [`TcpStore`] at `MASTER_ADDR:MASTER_PORT`; the others connect to it.
    pub fn from_env() -> Result<Self> {
        Self::from_env_with(GroupOptions::default())
    }

    /// [`from_env`](Self::from_env) with options.
    pub fn from_env_with(options: GroupOptions) -> Result<Self> {
        Self::from_launch_env(LaunchEnv::from_process_env()?, options)
    }

    /// The group a detected launch describes (what [`from_env`](Self::from_env) does after detection).
    pub fn from_launch_env(env: LaunchEnv, mut options: GroupOptions) -> Result<Self> {
        let timeout = match options.timeout {
            Some(t) => t,
            None => default_timeout()?,
        };
        options.timeout = Some(timeout);
        let store = TcpStore::new(&env.master_addr, env.master_port, Some(env.world_size), env.rank == 0, timeout)?;
        let mut group = Self::with_options(env.rank, env.world_size, Arc::new(store), options)?;
        if let Some(lr) = env.local_rank {
            if lr != group.local_rank() {
                tracing::debug!(
                    "launcher's local rank {lr} differs from the host-identity one {}; containers or namespaces \
                     split this node",
                    group.local_rank()
                );
            }
        }
        group.launch = Some(env);
        Ok(group)
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Rank among the group's ranks on this host ([`same_host`](Self::same_host)),
    /// counted in group rank order. Under torchrun on one machine it equals
    /// `LOCAL_RANK`; where containers split a machine it counts only the
    /// ranks this one can share memory with (the launcher's value is in
    /// [`launch_env`](Self::launch_env)).
    pub fn local_rank(&self) -> usize {
        (0..self.rank).filter(|&r| self.hosts[r] == self.hosts[self.rank]).count()
    }

    /// Ranks of the group on this host, this one included.
    pub fn local_size(&self) -> usize {
        self.hosts.iter().filter(|h| **h == self.hosts[self.rank]).count()
    }

    /// Whether `peer` runs on this rank's host: same boot id, IPC and network
    /// namespace, so shared memory and loopback reach it. `false` for a rank
    /// outside the group.
    pub fn same_host(&self, peer: usize) -> bool {
        self.hosts.get(peer).is_some_and(|h| *h == self.hosts[self.rank])
    }

    /// The host identity `rank` published, if it is in the group.
    pub fn host_id(&self, rank: usize) -> Option<&str> {
        self.hosts.get(rank).map(String::as_str)
    }

    /// What the launcher said, for a group made by [`from_env`](Self::from_env).
    pub fn launch_env(&self) -> Option<&LaunchEnv> {
        self.launch.as_ref()
    }

    /// The group's default timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Changes the default timeout of later operations.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The group's own key space in the store: free for the user's keys,
    /// except those starting with `op/`, `split/` and `join/`.
    pub fn store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }

    fn next_op(&self) -> u64 {
        self.next_op.fetch_add(1, Ordering::Relaxed)
    }

    fn garbage(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.garbage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Returns once every rank of the group has called it (the n-th call on
    /// each rank meets the n-th on the others), or fails after `timeout`
    /// (`None`: the group's). Three store round trips per rank. A rank that
    /// called another operation at this point of the sequence makes it an
    /// [`Error::Mismatch`] on every rank.
    pub fn barrier(&self, timeout: Option<Duration>) -> Result<()> {
        let timeout = timeout.unwrap_or(self.timeout);
        let n = self.next_op();
        let count_key = op_key(n, "count");
        let done_key = op_key(n, "done");
        let old = std::mem::take(&mut *self.garbage());
        let result = (|| {
            let arrived = self.store.add(&count_key, 1)?;
            if arrived == self.size as i64 {
                // Only barriers count, so every rank called one: nothing to compare.
                self.store.set(&done_key, b"")?;
                self.garbage().push(done_key.clone());
                // Every rank has added already; nobody reads the counter
                // again. The barrier is complete whatever happens to this
                // delete (below).
                self.forget(std::slice::from_ref(&count_key));
                return Ok(());
            }
            // A rank that called another operation here reads this record
            // (as it reads every rank's) and answers the mismatch in `done`,
            // since the counter would never be complete.
            self.publish(n, "barrier", b"")?;
            match self.store.get(&done_key, timeout) {
                Ok(verdict) if verdict.is_empty() => Ok(()),
                Ok(detail) => {
                    self.garbage().push(count_key.clone());
                    Err(Error::Mismatch {
                        op: format!("barrier #{n}"),
                        detail: String::from_utf8_lossy(&detail).into_owned(),
                    })
                }
                Err(Error::Timeout { after, .. }) => {
                    let count = self.store.try_get(&count_key).ok().flatten();
                    let count = count.map(|c| String::from_utf8_lossy(&c).into_owned()).unwrap_or_else(|| "?".into());
                    Err(Error::Timeout {
                        waiting_for: format!(
                            "barrier #{n} on rank {} ({count} of {} ranks arrived)",
                            self.rank, self.size
                        ),
                        after,
                    })
                }
                Err(e) => Err(e),
            }
        })();
        match result {
            Ok(()) => {
                // Every rank has passed every earlier operation: its keys can go.
                self.forget(&old);
                Ok(())
            }
            Err(e) => {
                self.garbage().extend(old);
                Err(labelled(e, || format!("barrier #{n} on rank {}", self.rank)))
            }
        }
    }

    /// Deletes keys every rank is done with, best effort: a barrier that
    /// every rank passed has succeeded, and a store gone meanwhile (rank 0
    /// exited right after it, taking the store with it) must not turn it
    /// into an error on the others. What could not be deleted is retried
    /// at the next barrier.
    fn forget(&self, keys: &[String]) {
        for (i, key) in keys.iter().enumerate() {
            if let Err(e) = self.store.delete(key) {
                tracing::debug!(rank = self.rank, "keeping {} store keys for later: {e}", keys.len() - i);
                self.garbage().extend(keys[i..].iter().cloned());
                return;
            }
        }
    }

    /// All-gather of small blobs: every rank contributes `value` under the
    /// same `key` and gets every rank's value, indexed by rank. One store
    /// write and one multi-key read per rank, so a few hundred ranks cost a
    /// few hundred keys, fetched in one round trip. A rank that passed
    /// another `key`, or called another operation at this point of the
    /// sequence, makes it an [`Error::Mismatch`] on every rank.
    pub fn exchange(&self, key: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.next_op();
        self.publish(n, &format!("exchange '{key}'"), value)
            .map_err(|e| labelled(e, || format!("exchange '{key}' (#{n}) on rank {}", self.rank)))?;
        self.gather(n, &format!("exchange '{key}' (#{n})"))
    }

    /// Writes this rank's record of operation `n`: what it called (`call`,
    /// as messages name it) and its data.
    ///
    /// Every operation keeps its records under `op/<n>/`, whatever it is,
    /// so ranks that called different operations at `n` still meet and can
    /// compare their calls instead of each waiting out the timeout for keys
    /// the others never write.
    fn publish(&self, n: u64, call: &str, payload: &[u8]) -> Result<()> {
        let mine = op_key(n, &self.rank.to_string());
        let mut record = Vec::with_capacity(4 + call.len() + payload.len());
        record.extend_from_slice(&(call.len() as u32).to_le_bytes());
        record.extend_from_slice(call.as_bytes());
        record.extend_from_slice(payload);
        self.store.set(&mine, &record)?;
        self.garbage().push(mine);
        Ok(())
    }

    /// Every rank's data for operation `n` (after [`publish`](Self::publish)),
    /// or [`Error::Mismatch`] naming who called what when the calls differ.
    /// `op` names this rank's call in errors.
    fn gather(&self, n: u64, op: &str) -> Result<Vec<Vec<u8>>> {
        let keys: Vec<String> = (0..self.size).map(|r| op_key(n, &r.to_string())).collect();
        let records = self
            .store
            .multi_get(&refs(&keys), self.timeout)
            .map_err(|e| missing_ranks(&*self.store, e, &keys, || format!("{op} on rank {}", self.rank)))?;
        let mut calls: Vec<(&[u8], Vec<usize>)> = Vec::new();
        let mut payloads = Vec::with_capacity(self.size);
        for (r, record) in records.iter().enumerate() {
            let (call, payload) = split_record(record);
            match calls.iter_mut().find(|(c, _)| *c == call) {
                Some((_, ranks)) => ranks.push(r),
                None => calls.push((call, vec![r])),
            }
            payloads.push(payload.to_vec());
        }
        if calls.len() == 1 {
            return Ok(payloads);
        }
        // Every rank that reads the records words the verdict the same way.
        const SHOWN: usize = 4;
        let mut detail: Vec<String> = calls
            .iter()
            .take(SHOWN)
            .map(|(call, ranks)| format!("{} called {}", Ranks(ranks), String::from_utf8_lossy(call)))
            .collect();
        if calls.len() > SHOWN {
            detail.push(format!("and {} other calls", calls.len() - SHOWN));
        }
        let detail = detail.join(", ");
        // Ranks in a barrier at `n` wait on its `done` key, not on the records.
        let done = op_key(n, "done");
        self.store.set(&done, detail.as_bytes())?;
        self.garbage().push(done);
        Err(Error::Mismatch { op: op.to_string(), detail })
    }

    /// Makes a group of the parent ranks listed in `ranks`, renumbered by
    /// their position in the list. Collective over this (parent) group: every
    /// rank calls it with the same list; a rank not in the list gets `None`.
    ///
    /// Each rank publishes a digest of its list, so a list that differs on any
    /// rank is an [`Error::Mismatch`] on every rank. A list naming a rank
    /// twice or one outside the group is an [`Error::InvalidArgument`] (on
    /// every rank, since they all passed it). The new group's keys live under
    /// this group's, in a space of its own.
    pub fn split(&self, ranks: &[usize]) -> Result<Option<Group>> {
        let n = self.next_op();
        let digest = list_digest(ranks);
        self.publish(n, "split", &digest).map_err(|e| labelled(e, || format!("split #{n} on rank {}", self.rank)))?;
        let digests = self.gather(n, &format!("split #{n}"))?;
        if digests.iter().any(|d| *d != digest) {
            let mut by_list: BTreeMap<&[u8], Vec<usize>> = BTreeMap::new();
            for (r, d) in digests.iter().enumerate() {
                by_list.entry(d.as_slice()).or_default().push(r);
            }
            let same = &by_list[digest.as_slice()];
            let others: Vec<String> =
                by_list.iter().filter(|(d, _)| **d != digest).map(|(_, rs)| format!("{}", Ranks(rs))).collect();
            return Err(Error::Mismatch {
                op: format!("split #{n}"),
                detail: format!("{} passed {}, {} passed other lists", Ranks(same), Ranks(ranks), others.join(" and ")),
            });
        }
        let mut seen = vec![false; self.size];
        for &r in ranks {
            if r >= self.size {
                return Err(Error::invalid("split", format!("rank {r} is not in this group of {}", self.size)));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(Error::invalid("split", format!("rank {r} is listed twice")));
            }
        }
        if ranks.is_empty() {
            return Err(Error::invalid("split", "the rank list is empty"));
        }
        let Some(new_rank) = ranks.iter().position(|&r| r == self.rank) else { return Ok(None) };
        let prefix = format!("{}split/{n}/group/", self.store.prefix());
        Ok(Some(Group {
            rank: new_rank,
            size: ranks.len(),
            store: Arc::new(PrefixStore::new(prefix, self.store.inner().clone())),
            hosts: ranks.iter().map(|&r| self.hosts[r].clone()).collect(),
            timeout: self.timeout,
            launch: None,
            next_op: AtomicU64::new(0),
            garbage: Mutex::new(Vec::new()),
        }))
    }
}

/// Key `name` of the group's `n`-th operation.
fn op_key(n: u64, name: &str) -> String {
    format!("op/{n}/{name}")
}

/// A record from [`Group::publish`]: the call and the payload. Ranks run one
/// build, so a record that does not parse is a call of its own, which
/// differs from every real one.
fn split_record(record: &[u8]) -> (&[u8], &[u8]) {
    let parsed = record.split_first_chunk::<4>().and_then(|(len, rest)| {
        let len = u32::from_le_bytes(*len) as usize;
        (len <= rest.len()).then(|| rest.split_at(len))
    });
    parsed.unwrap_or((b"something unreadable", b""))
}

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

/// Turns a store timeout on per-rank keys into one naming the missing ranks;
/// other store errors get `op` in front (they named only the store call).
fn missing_ranks(store: &dyn Store, e: Error, keys: &[String], op: impl FnOnce() -> String) -> Error {
    let Error::Timeout { after, .. } = e else { return labelled(e, op) };
    let missing: Vec<usize> = (0..keys.len()).filter(|&r| !store.check(&[&keys[r]]).unwrap_or(false)).collect();
    Error::Timeout { waiting_for: format!("{}: {} of {} missing", op(), Ranks(&missing), keys.len()), after }
}

/// A store error (which names the store call: `multi_get`, `add`) with the
/// group operation and rank in front.
fn labelled(e: Error, op: impl FnOnce() -> String) -> Error {
    match e {
        Error::Disconnected { addr, reason } => Error::Disconnected { addr, reason: format!("{}: {reason}", op()) },
        Error::InvalidArgument { op: call, reason } => {
            Error::InvalidArgument { op: call, reason: format!("in {}: {reason}", op()) }
        }
        Error::Protocol(m) => Error::Protocol(format!("{}: {m}", op())),
        other => other,
    }
}

/// "rank [3]" / "ranks [0, 1]" for messages.
struct Ranks<'a>(&'a [usize]);

impl fmt::Display for Ranks<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let word = if self.0.len() == 1 { "rank" } else { "ranks" };
        write!(f, "{word} {}", short_list(self.0))
    }
}

/// A list for messages, shortened when long.
fn short_list(list: &[usize]) -> String {
    const SHOWN: usize = 16;
    let shown: Vec<String> = list.iter().take(SHOWN).map(usize::to_string).collect();
    let more = if list.len() > SHOWN { format!(", ... ({} in all)", list.len()) } else { String::new() };
    format!("[{}{more}]", shown.join(", "))
}

/// 64-bit FNV-1a of the list plus its length: equal lists, equal digests.
fn list_digest(ranks: &[usize]) -> Vec<u8> {
    let hash = ranks
        .iter()
        .flat_map(|r| (*r as u64).to_le_bytes())
        .fold(0xcbf29ce484222325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100000001b3));
    let mut d = hash.to_le_bytes().to_vec();
    d.extend_from_slice(&(ranks.len() as u64).to_le_bytes());
    d
}
