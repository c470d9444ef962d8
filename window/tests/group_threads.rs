//! Group semantics with ranks as threads over one in-process store: fast,
//! and able to look at timeouts and errors from every rank at once.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rmacomm_window::{Error, Group, GroupOptions, HashStore, Store};

const T: Duration = Duration::from_secs(20);

/// Runs `f(rank, group)` on `size` threads, each with its own group on a shared store.
fn on_ranks<R: Send + 'static>(
    size: usize,
    store: Arc<dyn Store>,
    options: impl Fn(usize) -> GroupOptions,
    f: impl Fn(Group) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            let (store, f, opts) = (store.clone(), f.clone(), options(rank));
            thread::spawn(move || f(Group::with_options(rank, size, store, opts).unwrap()))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn quick(_: usize) -> GroupOptions {
    GroupOptions::new().timeout(T)
}

#[test]
fn barrier_exchange_and_split_on_1_to_5_ranks() {
    for size in 1..=5 {
        let results = on_ranks(size, Arc::new(HashStore::new()), quick, move |g| {
            let rank = g.rank();
            for round in 0..10u8 {
                let all = g.exchange("x", &[rank as u8, round]).unwrap();
                assert_eq!(all, (0..size).map(|r| vec![r as u8, round]).collect::<Vec<_>>());
                g.barrier(None).unwrap();
            }
            let odds: Vec<usize> = (1..size).step_by(2).collect();
            let sub = if odds.is_empty() { None } else { g.split(&odds).unwrap() };
            if let Some(s) = &sub {
                assert_eq!((s.rank(), s.size()), (rank / 2, odds.len()));
                assert_eq!(
                    s.exchange("odd", &[rank as u8]).unwrap().concat(),
                    odds.iter().map(|&r| r as u8).collect::<Vec<_>>()
                );
                s.barrier(None).unwrap();
            }
            (rank, sub.is_some(), g.local_rank(), g.local_size())
        });
        for (rank, in_sub, local_rank, local_size) in results {
            assert_eq!(in_sub, rank % 2 == 1);
            assert_eq!((local_rank, local_size), (rank, size), "one host: local = global");
        }
    }
}

#[test]
fn barrier_really_waits_for_the_last_rank() {
    let start = Instant::now();
    let passed = on_ranks(3, Arc::new(HashStore::new()), quick, move |g| {
        if g.rank() == 2 {
            thread::sleep(Duration::from_millis(300));
        }
        g.barrier(None).unwrap();
        start.elapsed()
    });
    assert!(passed.iter().all(|t| *t >= Duration::from_millis(290)), "{passed:?}");
}

#[test]
fn barrier_timeout_says_how_many_ranks_arrived() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let results = on_ranks(3, store, quick, |g| {
        // Rank 2 never comes to the second barrier.
        g.barrier(None).unwrap();
        if g.rank() == 2 {
            return None;
        }
        Some(g.barrier(Some(Duration::from_millis(300))).unwrap_err())
    });
    for e in results.into_iter().flatten() {
        let msg = e.to_string();
        assert!(matches!(e, Error::Timeout { .. }) && msg.contains("2 of 3 ranks arrived"), "{msg}");
    }
}

#[test]
fn exchange_timeout_names_the_missing_ranks() {
    let results = on_ranks(
        4,
        Arc::new(HashStore::new()),
        |_| GroupOptions::new().timeout(Duration::from_millis(300)),
        |g| {
            if g.rank() >= 2 {
                return None;
            }
            Some(g.exchange("urls", b"u").unwrap_err().to_string())
        },
    );
    for msg in results.into_iter().flatten() {
        assert!(msg.contains("exchange 'urls'") && msg.contains("ranks [2, 3] of 4 missing"), "{msg}");
    }
}

#[test]
fn split_with_mismatched_lists_fails_on_every_rank() {
    let results = on_ranks(4, Arc::new(HashStore::new()), quick, |g| {
        let list: Vec<usize> = if g.rank() == 3 { vec![0, 1, 3] } else { vec![0, 1, 2] };
        let e = g.split(&list).unwrap_err();
        // The group stays usable.
        g.barrier(None).unwrap();
        e
    });
    for e in results {
        let msg = e.to_string();
        assert!(matches!(e, Error::Mismatch { .. }), "{msg}");
        assert!(msg.contains("split #0") && msg.contains("ranks [0, 1, 2]") && msg.contains("rank [3]"), "{msg}");
    }
}

/// A group timeout far longer than a mismatch should take to be found.
const SLOW: Duration = Duration::from_secs(10);

#[test]
fn exchanges_under_different_keys_fail_at_once_on_every_rank() {
    let start = Instant::now();
    let results = on_ranks(
        2,
        Arc::new(HashStore::new()),
        |_| GroupOptions::new().timeout(SLOW),
        move |g| {
            let e = g.exchange(if g.rank() == 0 { "a" } else { "b" }, b"v").unwrap_err();
            let found = start.elapsed();
            // The ranks stay in step: the next operation works.
            assert_eq!(g.exchange("c", &[g.rank() as u8]).unwrap(), [[0], [1]]);
            (e, found)
        },
    );
    for (e, found) in results {
        let msg = e.to_string();
        assert!(matches!(e, Error::Mismatch { .. }), "{msg}");
        assert!(msg.contains("rank [0] called exchange 'a'") && msg.contains("rank [1] called exchange 'b'"), "{msg}");
        assert!(found < SLOW / 2, "found after {found:?}, the group timeout is {SLOW:?}: {msg}");
    }
}

#[test]
fn a_barrier_against_an_exchange_fails_at_once_on_every_rank() {
    let start = Instant::now();
    let results = on_ranks(
        3,
        Arc::new(HashStore::new()),
        |_| GroupOptions::new().timeout(SLOW),
        move |g| {
            let e = if g.rank() == 2 { g.exchange("x", b"v").unwrap_err() } else { g.barrier(None).unwrap_err() };
            let found = start.elapsed();
            g.barrier(None).unwrap();
            (e, found)
        },
    );
    for (rank, (e, found)) in results.into_iter().enumerate() {
        let msg = e.to_string();
        assert!(matches!(e, Error::Mismatch { .. }), "rank {rank}: {msg}");
        let mine = if rank == 2 { "exchange 'x' (#0)" } else { "barrier #0" };
        assert!(
            msg.starts_with(mine)
                && msg.contains("ranks [0, 1] called barrier")
                && msg.contains("rank [2] called exchange 'x'"),
            "rank {rank}: {msg}"
        );
        assert!(found < SLOW / 2, "rank {rank} found it after {found:?}, the group timeout is {SLOW:?}: {msg}");
    }
}

#[test]
fn a_split_against_an_exchange_fails_at_once_on_every_rank() {
    let results = on_ranks(
        2,
        Arc::new(HashStore::new()),
        |_| GroupOptions::new().timeout(SLOW),
        |g| if g.rank() == 0 { g.split(&[0, 1]).map(drop).unwrap_err() } else { g.exchange("x", b"v").unwrap_err() },
    );
    for e in results {
        let msg = e.to_string();
        assert!(matches!(e, Error::Mismatch { .. }) && msg.contains("rank [0] called split"), "{msg}");
    }
}

#[test]
fn invalid_split_lists_fail_on_every_rank() {
    for bad in [vec![0, 0], vec![0, 7], vec![]] {
        let results = on_ranks(2, Arc::new(HashStore::new()), quick, move |g| g.split(&bad).unwrap_err());
        for e in results {
            assert!(matches!(e, Error::InvalidArgument { op: "split", .. }), "{e}");
        }
    }
}

#[test]
fn split_renumbers_by_position_and_splits_nest() {
    let results = on_ranks(4, Arc::new(HashStore::new()), quick, |g| {
        let rev = g.split(&[3, 2, 1, 0]).unwrap().unwrap();
        let pair = rev.split(&[1, 3]).unwrap(); // parent ranks 2 and 0
        let inner = pair.as_ref().map(|p| (p.rank(), p.size(), p.exchange("k", &[g.rank() as u8]).unwrap()));
        // Parent and child key spaces do not meet: the same op numbers in each.
        g.barrier(None).unwrap();
        rev.barrier(None).unwrap();
        (g.rank(), rev.rank(), inner)
    });
    for (rank, rev_rank, inner) in results {
        assert_eq!(rev_rank, 3 - rank);
        match rank {
            2 => assert_eq!(inner, Some((0, 2, vec![vec![2], vec![0]]))),
            0 => assert_eq!(inner, Some((1, 2, vec![vec![2], vec![0]]))),
            _ => assert_eq!(inner, None),
        }
    }
}

#[test]
fn same_host_follows_the_published_host_ids() {
    let results = on_ranks(
        5,
        Arc::new(HashStore::new()),
        |rank| GroupOptions::new().timeout(T).host_id(if rank < 3 { "a" } else { "b" }),
        |g| {
            let sub = g.split(&[4, 0, 3]).unwrap();
            let sub_view =
                sub.map(|s| ((0..3).map(|p| s.same_host(p)).collect::<Vec<_>>(), s.local_rank(), s.local_size()));
            ((0..6).map(|p| g.same_host(p)).collect::<Vec<_>>(), g.local_rank(), g.local_size(), sub_view)
        },
    );
    let a = vec![true, true, true, false, false, false];
    let b = vec![false, false, false, true, true, false];
    assert_eq!(results[0], (a.clone(), 0, 3, Some((vec![false, true, false], 0, 1))));
    assert_eq!(results[2], (a, 2, 3, None));
    assert_eq!(results[3], (b.clone(), 0, 2, Some((vec![true, false, true], 1, 2))));
    assert_eq!(results[4], (b, 1, 2, Some((vec![true, false, true], 0, 2))));
}

#[test]
fn disagreeing_sizes_are_an_error() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let s2 = store.clone();
    let a = thread::spawn(move || Group::with_options(0, 2, s2, quick(0)).unwrap_err());
    // This rank thinks the group has three ranks; it publishes under the same key space.
    let s3 = store.clone();
    let b =
        thread::spawn(move || Group::with_options(1, 3, s3, GroupOptions::new().timeout(Duration::from_millis(500))));
    let e = a.join().unwrap();
    assert!(matches!(e, Error::Mismatch { .. }) && e.to_string().contains("rank 1 says the size is 3"), "{e}");
    assert!(b.join().unwrap().is_err());
}

#[test]
fn bad_arguments_to_new() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    assert!(matches!(Group::new(2, 2, store.clone()), Err(Error::InvalidArgument { .. })));
    assert!(matches!(Group::new(0, 0, store.clone()), Err(Error::InvalidArgument { .. })));
    // Past the largest group: refused before anything is published (it
    // panicked on capacity overflow, or aborted reserving memory).
    for size in [rmacomm_window::MAX_GROUP_SIZE + 1, 1 << 40, usize::MAX] {
        let e = Group::new(0, size, store.clone()).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("largest group"), "{e}");
    }
}

#[test]
fn several_groups_on_one_store_and_keys_are_cleaned_up() {
    let store = Arc::new(HashStore::new());
    let dyn_store: Arc<dyn Store> = store.clone();
    for _ in 0..3 {
        on_ranks(3, dyn_store.clone(), quick, |g| {
            for _ in 0..20 {
                g.exchange("e", &[0; 100]).unwrap();
                g.split(&[0, 1]).unwrap();
                g.barrier(None).unwrap();
            }
        });
    }
    // 3 groups x 20 rounds of exchange + split + barrier; what is left is
    // bounded by the last round's keys and the join records, not by the rounds.
    let debug = format!("{store:?}");
    let keys: usize = debug.split("keys: ").nth(1).unwrap().split(',').next().unwrap().trim().parse().unwrap();
    assert!(keys < 3 * 3 * 6, "{keys} keys left: {debug}");
}

#[test]
fn groups_and_stores_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Group>();
    check::<rmacomm_window::TcpStore>();
    check::<rmacomm_window::FileStore>();
    check::<rmacomm_window::PrefixStore>();
    check::<rmacomm_window::TcpStoreServer>();
    check::<Arc<dyn Store>>();
}

#[test]
fn exchange_and_barrier_scale_to_a_few_hundred_ranks_over_tcp() {
    const N: usize = 200;
    let host = Arc::new(rmacomm_window::TcpStore::new("127.0.0.1", 0, Some(N), true, T).unwrap());
    let port = host.port();
    let start = Instant::now();
    let handles: Vec<_> = (0..N)
        .map(|rank| {
            let host = host.clone();
            thread::spawn(move || {
                // Rank 0 uses the hosting store, the others a connection each, as processes would.
                let store: Arc<dyn Store> = if rank == 0 {
                    host
                } else {
                    Arc::new(rmacomm_window::TcpStore::connect("127.0.0.1", port, T).unwrap())
                };
                let g = Group::with_options(rank, N, store, quick(rank)).unwrap();
                for round in 0..5u8 {
                    let all = g.exchange("desc", &[round; 64]).unwrap();
                    assert_eq!(all.len(), N);
                    assert!(all.iter().all(|v| v.len() == 64 && v[0] == round));
                    g.barrier(None).unwrap();
                }
            })
        })
        .collect();
    drop(host);
    handles.into_iter().for_each(|h| h.join().unwrap());
    let took = start.elapsed();
    eprintln!("{N} ranks: join + 5 x (exchange + barrier) in {took:?}");
    assert!(took < Duration::from_secs(15), "{took:?}");
}

#[test]
fn the_host_id_is_stable_and_names_boot_and_namespaces() {
    let id = rmacomm_window::host_id();
    assert_eq!(id, rmacomm_window::host_id());
    if std::path::Path::new("/proc/self/ns/net").exists() {
        assert!(id.contains("ipc:[") && id.contains("net:["), "{id}");
    }
}

/// A store whose deletes fail once `gone` is set (the hosting rank exited
/// right after a barrier released it, taking the store with it).
#[derive(Debug)]
struct Vanishing {
    inner: HashStore,
    gone: std::sync::atomic::AtomicBool,
    reads_fail: std::sync::atomic::AtomicBool,
}

impl Store for Vanishing {
    fn set(&self, key: &str, value: &[u8]) -> rmacomm_window::Result<()> {
        self.inner.set(key, value)
    }
    fn try_get(&self, key: &str) -> rmacomm_window::Result<Option<Vec<u8>>> {
        self.inner.try_get(key)
    }
    fn multi_get(&self, keys: &[&str], timeout: Duration) -> rmacomm_window::Result<Vec<Vec<u8>>> {
        if self.reads_fail.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Error::Disconnected { addr: "the test's store".into(), reason: "multi_get: gone".into() });
        }
        self.inner.multi_get(keys, timeout)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> rmacomm_window::Result<()> {
        self.inner.wait(keys, timeout)
    }
    fn check(&self, keys: &[&str]) -> rmacomm_window::Result<bool> {
        self.inner.check(keys)
    }
    fn add(&self, key: &str, delta: i64) -> rmacomm_window::Result<i64> {
        self.inner.add(key, delta)
    }
    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> rmacomm_window::Result<Option<Vec<u8>>> {
        self.inner.compare_set(key, expected, desired)
    }
    fn delete(&self, key: &str) -> rmacomm_window::Result<bool> {
        if self.gone.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Error::Disconnected { addr: "the test's vanished store".into(), reason: "gone".into() });
        }
        self.inner.delete(key)
    }
}

#[test]
fn a_barrier_every_rank_passed_succeeds_though_its_cleanup_cannot_reach_the_store() {
    // Once released, a barrier's ranks delete keys nobody reads again; with
    // rank 0 (the store's host) gone right after, those deletes fail. The
    // barrier had succeeded: it returned that failure as its own on the
    // other ranks (and tensor_deregister kept the memory).
    let store = Arc::new(Vanishing { inner: HashStore::new(), gone: false.into(), reads_fail: false.into() });
    let dyn_store: Arc<dyn Store> = store.clone();
    let s = store.clone();
    let results = on_ranks(3, dyn_store, quick, move |g| {
        g.exchange("before", &[g.rank() as u8]).unwrap();
        g.barrier(None).unwrap();
        g.exchange("again", &[1]).unwrap();
        if g.rank() == 0 {
            s.gone.store(true, std::sync::atomic::Ordering::Release);
        }
        g.barrier(None)
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

#[test]
fn a_store_failure_inside_a_group_operation_names_the_operation_and_rank() {
    // It named only the store call ("multi_get") and the address.
    let store = Arc::new(Vanishing { inner: HashStore::new(), gone: false.into(), reads_fail: false.into() });
    let s = store.clone();
    let results = on_ranks(2, store, quick, move |g| {
        g.barrier(None).unwrap();
        s.reads_fail.store(true, std::sync::atomic::Ordering::Release);
        g.exchange("urls", &[1]).unwrap_err().to_string()
    });
    for (rank, msg) in results.iter().enumerate() {
        assert!(msg.contains(&format!("exchange 'urls' (#1) on rank {rank}: multi_get: gone")), "{msg}");
    }
}
