//! Windows whose ranks are threads of this process (a `HashStore`):
//! signals ordered behind many async puts, operations issued from several
//! threads of one rank, collective register/deregister repeated, argument
//! errors.

use std::sync::Arc;
use std::time::Duration;

use ibverbx::soft::SoftConfig;
use ibverbx::{LoadBalancing, ProviderKind};
use rmacomm_transport::TransportConfig;
use rmacomm_window::{Error, Group, GroupOptions, HashStore, Store, Window, WindowOptions};

/// Runs `f(rank, group)` on `n` threads, one rank each.
fn ranks<F>(n: usize, f: F)
where
    F: Fn(usize, Group) + Send + Sync + 'static,
{
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (store, f) = (store.clone(), f.clone());
            std::thread::spawn(move || {
                let g =
                    Group::with_options(rank, n, store, GroupOptions::new().timeout(Duration::from_secs(30))).unwrap();
                f(rank, g)
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

fn window(g: &Group) -> Window {
    Window::new(g, WindowOptions::new().timeout(Duration::from_secs(30))).unwrap()
}

/// Four physical QPs, 64 KiB fragments and seeded stalls before every
/// operation of every QP: fragments of one put, and puts, overtake each other.
fn chaotic(lb: LoadBalancing, seed: u64) -> WindowOptions {
    let soft = SoftConfig { chaos_seed: Some(seed), ..SoftConfig::from_env() };
    let config = TransportConfig::default()
        .with_provider(ProviderKind::Soft)
        .with_qps(4)
        .with_frag_size(64 << 10)
        .with_load_balancing(lb)
        .with_soft(Some(soft));
    // The transport path (SEPARATE) is what reorders: same-host pairs use it
    // only with UNIFIED off.
    WindowOptions::new().timeout(Duration::from_secs(30)).transport(config).unified(false)
}

/// 16 async puts of 256 KiB each, their Works not waited, then one signal:
/// when the wait returns, all of them are there.
#[test]
fn a_signal_follows_every_earlier_async_put() {
    // UNIFIED (shared memory; threads of one process are one host).
    signal_after_async_puts(window, false);
    // SEPARATE: through the transport.
    signal_after_async_puts(
        |g| Window::new(g, WindowOptions::new().timeout(Duration::from_secs(30)).unified(false)).unwrap(),
        false,
    );
    // SEPARATE with every in-flight slot taken: a put issued then was posted
    // only when its Work was first polled — after the signal, which
    // overtook it.
    signal_after_async_puts(
        |g| {
            let opts = WindowOptions::new().timeout(Duration::from_secs(30)).unified(false).max_in_flight(2);
            Window::new(g, opts.transport(through_the_qp())).unwrap()
        },
        false,
    );
}

/// Every write through the QP (no direct copies by the calling thread,
/// which complete at once and take no in-flight slot).
fn through_the_qp() -> TransportConfig {
    let mut c = TransportConfig::default().with_provider(ProviderKind::Soft);
    c.direct_copy_max = 0;
    c
}

/// Async puts whose Works are dropped at once go on (as documented), even
/// issued while every in-flight slot is taken (they were never posted).
#[test]
fn dropped_works_of_puts_issued_with_every_slot_taken_still_land() {
    const PIECE: usize = 1 << 20;
    const PIECES: usize = 8;
    ranks(2, move |rank, g| {
        let opts = WindowOptions::new()
            .timeout(Duration::from_secs(30))
            .unified(false)
            .max_in_flight(1)
            .transport(through_the_qp());
        let mut w = Window::new(&g, opts).unwrap();
        w.tensor_register(w.alloc(PIECE * PIECES).unwrap(), 1).unwrap();
        let peer = 1 - rank;
        let src = w.alloc(PIECE * PIECES).unwrap();
        for i in 0..PIECES {
            src.write_from(i * PIECE, &vec![i as u8 + 1; PIECE]).unwrap();
        }
        for i in 0..PIECES {
            drop(w.put(src.view(i * PIECE, PIECE).unwrap(), peer, i * PIECE, true).unwrap());
        }
        w.signal(peer, false).unwrap();
        w.wait_signal(peer, None).unwrap();
        let mut got = vec![0u8; PIECE * PIECES];
        w.local_tensor().unwrap().read_into(0, &mut got).unwrap();
        for i in 0..PIECES {
            assert!(got[i * PIECE..(i + 1) * PIECE].iter().all(|b| *b == i as u8 + 1), "piece {i} did not land");
        }
        g.barrier(None).unwrap();
        w.tensor_deregister().unwrap();
    });
}

/// Same host, but the registered tensor is private memory (a `Vec`), which
/// cannot be mapped: puts go through the transport while signals stay
/// atomics on the shared slot, so a put completes before it returns, and
/// the signal still follows it. `get_attr` says SEPARATE for the peer.
#[test]
fn a_signal_follows_transport_puts_into_private_memory() {
    signal_after_async_puts(window, true);
}

/// The same over 4 QPs with reordering chaos, both load balancings.
#[test]
fn a_signal_follows_every_earlier_async_put_over_4_reordering_qps() {
    for (lb, seed) in [(LoadBalancing::Dqplb, 1), (LoadBalancing::Spray, 2), (LoadBalancing::Dqplb, 3)] {
        signal_after_async_puts(move |g| Window::new(g, chaotic(lb, seed)).unwrap(), false);
    }
}

fn signal_after_async_puts(make: impl Fn(&Group) -> Window + Send + Sync + 'static, private: bool) {
    const PIECE: usize = 256 << 10;
    const PIECES: usize = 16;
    ranks(2, move |rank, g| {
        let mut w = make(&g);
        let mem = if private {
            rmacomm_transport::RdmaMemory::register(vec![0u8; PIECE * PIECES]).unwrap()
        } else {
            w.alloc(PIECE * PIECES).unwrap()
        };
        w.tensor_register(mem, 1).unwrap();
        let peer = 1 - rank;
        if private {
            assert_eq!(w.get_attr(peer).unwrap().access_type, rmacomm_window::AccessType::Separate);
            assert!(matches!(w.map_remote_tensor(peer), Err(Error::Unsupported { .. })));
        }
        for round in 0..5u8 {
            let src = w.alloc(PIECE * PIECES).unwrap();
            for i in 0..PIECES {
                src.write_from(i * PIECE, &vec![round * 32 + i as u8; PIECE]).unwrap();
            }
            let works: Vec<_> = (0..PIECES)
                .map(|i| w.put(src.view(i * PIECE, PIECE).unwrap(), peer, i * PIECE, true).unwrap())
                .collect();
            w.signal(peer, true).unwrap();
            w.wait_signal(peer, None).unwrap();
            let mut got = vec![0u8; PIECE * PIECES];
            w.local_tensor().unwrap().read_into(0, &mut got).unwrap();
            for i in 0..PIECES {
                assert!(
                    got[i * PIECE..(i + 1) * PIECE].iter().all(|b| *b == round * 32 + i as u8),
                    "round {round} piece {i}"
                );
            }
            for wk in &works {
                wk.wait(None).unwrap();
            }
            g.barrier(None).unwrap();
        }
        w.tensor_deregister().unwrap();
    });
}

/// A window shared by two threads of each rank: one puts and signals, the
/// other waits.
#[test]
fn one_window_used_from_several_threads() {
    ranks(2, |rank, g| {
        let mut w = window(&g);
        w.tensor_register(w.alloc(4096).unwrap(), 8).unwrap();
        let peer = 1 - rank;
        let w = &w;
        std::thread::scope(|s| {
            s.spawn(move || {
                let src = w.alloc(8).unwrap();
                for i in 0..200u64 {
                    src.write_from(0, &i.to_le_bytes()).unwrap();
                    w.put(src.view(0, 8).unwrap(), peer, (i % 512) as usize, false).unwrap();
                    w.signal(peer, i % 3 == 0).unwrap();
                }
            });
            s.spawn(move || {
                for i in 0..200u64 {
                    w.wait_signal(peer, None).unwrap();
                    let mut got = [0u8; 8];
                    w.local_tensor().unwrap().read_into((i % 512) as usize * 8, &mut got).unwrap();
                    assert_eq!(u64::from_le_bytes(got), i);
                }
            });
        });
        g.barrier(None).unwrap();
    });
}

#[test]
fn register_deregister_repeats_and_argument_errors() {
    ranks(3, |rank, g| {
        let mut w = window(&g);
        // No tensor yet.
        let src = w.alloc(64).unwrap();
        assert!(matches!(w.put(src.view(0, 8).unwrap(), 0, 0, false), Err(Error::InvalidArgument { op: "put", .. })));
        assert!(matches!(w.map_remote_tensor(rank), Err(Error::InvalidArgument { .. })));
        assert!(matches!(w.tensor_deregister(), Err(Error::InvalidArgument { .. })));
        for round in 1..4usize {
            // Sizes and element sizes differ per rank and per round.
            let es = [1, 2, 4][(rank + round) % 3];
            w.tensor_register_len(w.alloc(4096).unwrap(), es * 10 * (rank + 1), es).unwrap();
            assert!(matches!(w.tensor_register(w.alloc(8).unwrap(), 1), Err(Error::InvalidArgument { .. })));
            let right = (rank + 1) % 3;
            let right_es = [1, 2, 4][(right + round) % 3];
            let right_len = right_es * 10 * (right + 1);
            // Fits exactly, then one byte too many.
            w.put(src.view(0, right_es).unwrap(), right, right_len / right_es - 1, false).unwrap();
            let e = w.put(src.view(0, right_es + 1).unwrap(), right, right_len / right_es - 1, false).unwrap_err();
            assert!(matches!(e, Error::Bounds { op: "put", peer, .. } if peer == right), "{e}");
            assert!(e.to_string().contains(&format!("{right_len} bytes")), "{e}");
            let mem = w.tensor_deregister().unwrap();
            assert_eq!(mem.len(), 4096);
        }
        assert!(matches!(w.signal(3, false), Err(Error::InvalidArgument { op: "signal", .. })));
        assert!(matches!(w.wait_signal(3, None), Err(Error::InvalidArgument { op: "wait_signal", .. })));
        assert!(matches!(w.tensor_register(w.alloc(8).unwrap(), 0), Err(Error::InvalidArgument { .. })));
    });
}

/// Works dropped unfinished detach their operations; `tensor_deregister`
/// still waits for them, and the window goes on working.
#[test]
fn deregister_waits_for_detached_operations() {
    const PIECE: usize = 64 << 10;
    ranks(2, |rank, g| {
        let mut w = window(&g);
        w.tensor_register(w.alloc(32 * PIECE).unwrap(), 1).unwrap();
        let src = w.alloc(32 * PIECE).unwrap();
        src.write_from(0, &vec![rank as u8 + 1; 32 * PIECE]).unwrap();
        let peer = 1 - rank;
        for i in 0..32 {
            let work = w.put(src.view(i * PIECE, PIECE).unwrap(), peer, i * PIECE, true).unwrap();
            assert!(work.op() == "put" && work.peer() == peer);
            drop(work);
            drop(w.signal(peer, true).unwrap());
        }
        let mem = w.tensor_deregister().unwrap();
        // The barrier inside proved the peer's puts done too.
        let mut got = vec![0u8; 32 * PIECE];
        mem.read_into(0, &mut got).unwrap();
        assert!(got.iter().all(|b| *b == peer as u8 + 1));
        for _ in 0..32 {
            w.wait_signal(peer, None).unwrap();
        }
        w.tensor_register(mem, 1).unwrap();
        let work = w.put(src.view(0, 8).unwrap(), peer, 0, true).unwrap();
        work.wait(None).unwrap();
        assert!(work.is_completed());
        g.barrier(None).unwrap();
    });
}

/// `put_bytes` from plain (unregistered) memory, on both paths: sizes
/// around the staging piece, at an offset, followed by a signal; bounds
/// checked before anything moves.
#[test]
fn put_bytes_from_unregistered_memory() {
    for unified in [true, false] {
        ranks(2, move |rank, g| {
            let opts = WindowOptions::new().timeout(Duration::from_secs(30)).unified(unified);
            let mut w = Window::new(&g, opts).unwrap();
            const CAP: usize = 3 * rmacomm_window::BOUNCE_CHUNK + 4096;
            w.tensor_register_len(w.alloc(CAP).unwrap(), CAP, 1).unwrap();
            let peer = 1 - rank;
            let mut done = 0;
            for (round, len) in [0usize, 1, rmacomm_window::BOUNCE_CHUNK + 3, 3 * rmacomm_window::BOUNCE_CHUNK + 5]
                .into_iter()
                .enumerate()
            {
                let src: Vec<u8> = (0..len).map(|i| (i * 7 + round + rank) as u8).collect();
                w.put_bytes(&src, peer, 11).unwrap();
                w.signal(peer, false).unwrap();
                w.wait_signal(peer, None).unwrap();
                let mut got = vec![0u8; len];
                w.local_tensor().unwrap().read_into(11, &mut got).unwrap();
                let want: Vec<u8> = (0..len).map(|i| (i * 7 + round + peer) as u8).collect();
                assert!(got == want, "unified {unified}: {len} bytes from rank {peer}");
                g.barrier(None).unwrap();
                done += 1;
            }
            assert_eq!(done, 4);
            let e = w.put_bytes(&[1u8; 8], peer, CAP - 4).unwrap_err();
            assert!(matches!(e, Error::Bounds { op: "put_bytes", .. }), "{e}");
            g.barrier(None).unwrap();
            w.tensor_deregister().unwrap();
        });
    }
}

/// `Window::register_host` (what GpuComm's transport mode uses for its
/// host slots): one shared segment of the window's, registered twice — as
/// the tensor peers put into and as the source of this rank's puts — each
/// registration keeping the segment alive; puts from the second land in
/// the peer's first, over UNIFIED and SEPARATE pairs; a put past the end is
/// refused; the provider is named.
#[test]
fn host_memory_registered_twice_serves_as_tensor_and_source() {
    for unified in [true, false] {
        ranks(2, move |rank, g| {
            let opts = WindowOptions::new().timeout(Duration::from_secs(30)).unified(unified);
            let mut w = Window::new(&g, opts).unwrap();
            assert_eq!(w.provider(), "soft");
            let seg = Arc::new(w.alloc(64 << 10).unwrap());
            let (ptr, len) = (seg.as_ptr(), seg.len());
            // SAFETY: the segment stays mapped while either registration
            // lives (each keeps it alive).
            let tensor = unsafe { w.register_host(ptr, len) }.unwrap().keep_alive(seg.clone());
            // SAFETY: as above.
            let src = Arc::new(unsafe { w.register_host(ptr, len) }.unwrap().keep_alive(seg.clone()));
            assert!(!tensor.is_device() && !src.is_device() && tensor.device().is_none());
            w.tensor_register(tensor, 1).unwrap();
            let peer = 1 - rank;
            let mine: Vec<u8> = (0..5000).map(|i| (i * 3 + rank) as u8).collect();
            src.write_from(0, &mine).unwrap();
            w.put(src.view(0, mine.len()).unwrap(), peer, 8192, false).unwrap();
            w.signal(peer, false).unwrap();
            w.wait_signal(peer, None).unwrap();
            let mut got = vec![0u8; mine.len()];
            seg.read_into(8192, &mut got).unwrap();
            let want: Vec<u8> = (0..5000).map(|i| (i * 3 + peer) as u8).collect();
            assert!(got == want, "unified {unified}: the peer's put through its second registration");
            let e = w.put(src.view(0, 16).unwrap(), peer, len - 8, false).unwrap_err();
            assert!(matches!(e, Error::Bounds { op: "put", .. }), "{e}");
            g.barrier(None).unwrap();
            drop(w.tensor_deregister().unwrap());
            drop(src);
            assert_eq!(Arc::strong_count(&seg), 1, "every registration let the segment go");
        });
    }
}

/// A rank's puts and gets to itself from and into its own registered
/// memory, overlapping the target, move the bytes as `memmove` would (they
/// went through a second mapping of the same pages, or the loopback link:
/// a forward copy read bytes it had just written through the other view).
#[test]
fn puts_and_gets_to_this_rank_over_its_own_memory_overlap_safely() {
    for unified in [true, false] {
        ranks(1, move |_, g| {
            let opts = WindowOptions::new().timeout(Duration::from_secs(30)).unified(unified);
            let mut w = Window::new(&g, opts).unwrap();
            let n = 1 << 20;
            let seg = Arc::new(w.alloc(n).unwrap());
            let (ptr, len) = (seg.as_ptr(), seg.len());
            // SAFETY: the segment stays mapped while either registration
            // lives (each keeps it alive).
            let tensor = unsafe { w.register_host(ptr, len) }.unwrap().keep_alive(seg.clone());
            // SAFETY: as above.
            let src = unsafe { w.register_host(ptr, len) }.unwrap().keep_alive(seg.clone());
            w.tensor_register(tensor, 1).unwrap();
            let orig: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
            let shift = 48;
            let check = |what: &str, want: &[u8], at: usize| {
                let mut got = vec![0u8; want.len()];
                seg.read_into(at, &mut got).unwrap();
                assert!(got == want, "unified {unified}: {what}");
            };
            seg.write_from(0, &orig).unwrap();
            w.put(src.view(0, n - shift).unwrap(), 0, shift, false).unwrap();
            check("put forward over itself", &orig[..n - shift], shift);
            seg.write_from(0, &orig).unwrap();
            w.put(src.view(shift, n - shift).unwrap(), 0, 0, false).unwrap();
            check("put back over itself", &orig[shift..], 0);
            seg.write_from(0, &orig).unwrap();
            w.get(src.view_mut(shift, n - shift).unwrap(), 0, 0, false).unwrap();
            check("get forward over itself", &orig[..n - shift], shift);
            seg.write_from(0, &orig).unwrap();
            w.put_bytes(&orig[..1000], 0, 7).unwrap();
            check("put_bytes to itself", &orig[..1000], 7);
            drop(w.tensor_deregister().unwrap());
        });
    }
}

/// `Duration::MAX` (how callers say "wait forever") as a wait's timeout or
/// the window's: the waits return once signalled, on mapped and separate
/// signal paths, instead of overflowing the clock.
#[test]
fn a_timeout_of_duration_max_waits_forever() {
    for unified in [true, false] {
        ranks(2, move |rank, g| {
            let opts = WindowOptions::new().timeout(Duration::MAX).unified(unified);
            let w = Window::allocate(&g, 64, 1, opts).unwrap();
            let peer = 1 - rank;
            w.signal(peer, false).unwrap();
            w.wait_signal(peer, Some(Duration::MAX)).unwrap();
            w.signal(peer, false).unwrap();
            // The window's own timeout, Duration::MAX too.
            w.wait_signal(peer, None).unwrap();
            w.signal_value(0, 7, peer, rmacomm_window::SignalOp::Set, false).unwrap();
            w.wait_signal_until(0, 7, rmacomm_window::Cmp::Ge, Some(Duration::MAX)).unwrap();
            w.wait_signal_until(0, 7, rmacomm_window::Cmp::Eq, None).unwrap();
            // A stream watchdog with that timeout drains (it computed its
            // deadline as now + timeout: an overflow panic).
            let watch = rmacomm_window::StreamWatch::start(
                Arc::new(|_| 0),
                Duration::MAX,
                w.peer_watch(),
                w.stream_release(),
                None,
            )
            .unwrap();
            watch.drain();
            g.barrier(None).unwrap();
        });
    }
}

/// Ranks passing different `signal_slots` fail on every rank, naming it
/// (a rank's value signals went into words its peer never waits on), and a
/// count too large to hold is refused before anything is allocated.
#[test]
fn ranks_disagreeing_on_signal_slots_fail_on_every_rank() {
    ranks(2, |rank, g| {
        let opts = WindowOptions::new().timeout(Duration::from_secs(30));
        let e = Window::allocate(&g, 64, if rank == 0 { 4 } else { 0 }, opts).unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }), "rank {rank}: {e}");
        assert!(e.to_string().contains("signal_slots") && e.to_string().contains(&format!("rank {}", 1 - rank)), "{e}");
    });
    ranks(1, |_rank, g| {
        let opts = WindowOptions::new().timeout(Duration::from_secs(30));
        let e = Window::allocate(&g, 64, 1 << 60, opts).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("signal_slots"), "{e}");
    });
    // One rank's count too large: its peer hears of it (a Mismatch) at
    // once, instead of waiting for it until the timeout.
    ranks(2, |rank, g| {
        let opts = WindowOptions::new().timeout(Duration::from_secs(30));
        let t0 = std::time::Instant::now();
        let e = Window::allocate(&g, 64, if rank == 0 { 1 << 60 } else { 1 }, opts).unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }) && e.to_string().contains("signal_slots"), "rank {rank}: {e}");
        assert!(t0.elapsed() < Duration::from_secs(20), "rank {rank} waited for the timeout: {e}");
    });
}

/// A rank whose registration is refused (its arguments, or memory it could
/// not allocate) still takes part in the exchange: its peers fail at once
/// with `PeerFailed` naming it and its reason, instead of waiting for it
/// until the timeout; the window then registers again on every rank.
#[test]
fn a_rank_whose_registration_fails_fails_its_peers_at_once() {
    ranks(3, |rank, g| {
        let mut w = window(&g);
        let t0 = std::time::Instant::now();
        // Rank 1 registers more bytes than its memory holds.
        let len = if rank == 1 { 8192 } else { 64 };
        let e = w.tensor_register_len(w.alloc(4096).unwrap(), len, 1).unwrap_err();
        if rank == 1 {
            assert!(matches!(e, Error::InvalidArgument { op: "tensor_register", .. }), "{e}");
        } else {
            assert!(
                matches!(&e, Error::PeerFailed { op: "tensor_register", peer: 1, reason } if reason.contains("8192")),
                "{e}"
            );
        }
        // Rank 2 could not get its memory at all.
        let e = if rank == 2 {
            w.tensor_register_failed(Error::InvalidArgument { op: "alloc", reason: "out of memory (test)".into() })
        } else {
            w.tensor_register(w.alloc(64).unwrap(), 1).unwrap_err()
        };
        if rank != 2 {
            assert!(
                matches!(&e, Error::PeerFailed { peer: 2, reason, .. } if reason.contains("out of memory (test)")),
                "{e}"
            );
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "rank {rank} waited for the timeout: {e}");
        // Nothing was left registered: a good registration follows.
        w.tensor_register(w.alloc(64).unwrap(), 1).unwrap();
        w.put(w.alloc(8).unwrap().view(0, 8).unwrap(), (rank + 1) % 3, 56, false).unwrap();
        drop(w.tensor_deregister().unwrap());
    });
    // ctran's allocate: one rank's size cannot be allocated.
    ranks(2, |rank, g| {
        let opts = WindowOptions::new().timeout(Duration::from_secs(30));
        let t0 = std::time::Instant::now();
        let size = if rank == 0 { usize::MAX / 2 } else { 64 };
        let e = Window::allocate(&g, size, 1, opts).unwrap_err();
        if rank == 1 {
            assert!(matches!(e, Error::PeerFailed { op: "window_allocate", peer: 0, .. }), "{e}");
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "rank {rank} waited for the timeout: {e}");
    });
}

/// ctran's `allocate` of 0 bytes: a window whose buffer no put or get
/// reaches (`get_size` 0; it used to register one byte, which peers' 1-byte
/// puts filled), beside a peer's buffer of 64 bytes.
#[test]
fn a_window_of_zero_bytes_takes_no_bytes() {
    for unified in [true, false] {
        ranks(2, move |rank, g| {
            let opts = WindowOptions::new().timeout(Duration::from_secs(30)).unified(unified);
            let w = Window::allocate(&g, if rank == 0 { 0 } else { 64 }, 1, opts).unwrap();
            assert_eq!(w.get_size(), if rank == 0 { 0 } else { 64 });
            let src = w.alloc(64).unwrap();
            if rank == 1 {
                let e = w.put(src.view(0, 1).unwrap(), 0, 0, false).unwrap_err();
                assert!(matches!(e, Error::Bounds { op: "put", peer: 0, .. }), "{e}");
                let e = w.get(src.view_mut(0, 1).unwrap(), 0, 0, false).unwrap_err();
                assert!(matches!(e, Error::Bounds { op: "get", peer: 0, .. }), "{e}");
                if unified {
                    assert!(w.map_remote_tensor(0).unwrap().is_empty());
                    assert!(matches!(w.get_tensor(0, 0, 1), Err(Error::Bounds { .. })));
                }
            } else {
                w.put(src.view(0, 64).unwrap(), 1, 0, false).unwrap();
                assert!(w.map_remote_tensor(0).unwrap().is_empty());
            }
            w.signal(1 - rank, false).unwrap();
            w.wait_signal(1 - rank, None).unwrap();
        });
    }
}

/// Async value SETs to one peer take effect in call order, over striped,
/// reordering connections: the last value stays (two SETs in flight at
/// once used to land in either order, an earlier value winning and the
/// waiter for the last one timing out).
#[test]
fn async_value_sets_land_in_call_order() {
    for seed in [3, 11] {
        ranks(2, move |rank, g| {
            let w = Window::allocate(&g, 8, 1, chaotic(LoadBalancing::Spray, seed)).unwrap();
            assert!(!w.all_unified(), "the test needs transport signals");
            if rank == 0 {
                let maps = || std::fs::read_to_string("/proc/self/maps").unwrap().lines().count();
                let before = maps();
                let works: Vec<_> = (1..=200u64)
                    .map(|v| w.signal_value(0, v, 1, rmacomm_window::SignalOp::Set, true).unwrap())
                    .collect();
                // Queued signals hold no memory each (each once made a
                // registered, mapped word up front: 200 queued held ~116
                // mappings, a burst grew without bound).
                let grew = maps().saturating_sub(before);
                assert!(grew < 50, "200 queued value signals made {grew} mappings");
                for k in works {
                    k.wait(None).unwrap();
                }
            } else {
                w.wait_signal_until(0, 200, rmacomm_window::Cmp::Eq, Some(Duration::from_secs(20))).unwrap();
            }
            g.barrier(None).unwrap();
            // Still 200 once everything has landed.
            if rank == 1 {
                assert_eq!(w.read_signal(0).unwrap(), 200);
            }
        });
    }
}

/// A window whose streams a watchdog released (`Window::stream_release`):
/// every slot of the releasing rank's signal buffer holds `u64::MAX`, and
/// its host waits, taken and ctran, fail with the reason instead of
/// reading that as signals; a sleeper is woken. Peers whose pair is not
/// released go on.
#[test]
fn a_released_window_fails_its_waits_instead_of_reading_poison() {
    ranks(2, |rank, g| {
        let w = Window::new(&g, WindowOptions::new().timeout(Duration::from_secs(30)).signal_slots(2)).unwrap();
        let peer = 1 - rank;
        if rank == 0 {
            let r = w.stream_release();
            assert!(r.released().is_none());
            // A sleeper on rank 0 is woken by the release.
            let why = Error::Unsupported { op: "test", reason: "the watchdog".into() };
            let t0 = std::time::Instant::now();
            std::thread::scope(|s| {
                let h = s.spawn(|| w.wait_signal(peer, Some(Duration::from_secs(20))));
                std::thread::sleep(Duration::from_millis(200));
                r.release(&why);
                let e = h.join().unwrap().unwrap_err();
                assert!(
                    matches!(&e, Error::StreamFailed { peer: 1, .. }) && e.to_string().contains("the watchdog"),
                    "{e}"
                );
            });
            assert!(t0.elapsed() < Duration::from_secs(10), "the sleeper was not woken: {:?}", t0.elapsed());
            assert_eq!(r.value(0), Some(u64::MAX));
            assert_eq!(r.value(1), Some(u64::MAX));
            let e = w.wait_signal_until(0, 1, rmacomm_window::Cmp::Ge, None).unwrap_err();
            assert!(matches!(e, Error::StreamFailed { .. }), "{e}");
            assert!(r.signals_missing().is_empty());
        }
        g.barrier(None).unwrap();
        // Rank 1's own buffer was not released: a signal from rank 0 works.
        if rank == 0 {
            w.signal(1, false).unwrap();
        } else {
            w.wait_signal(0, None).unwrap();
            assert!(w.stream_release().released().is_none());
        }
        g.barrier(None).unwrap();
    });
}

/// A zero-byte put or get at the very end of a UNIFIED peer's buffer is in
/// bounds and moves nothing (the mapping refused its empty range as "no
/// longer registered").
#[test]
fn zero_byte_operations_at_the_end_of_a_buffer_succeed() {
    ranks(2, |rank, g| {
        let mut w = window(&g);
        w.tensor_register(w.alloc(4096).unwrap(), 4).unwrap();
        let peer = 1 - rank;
        let src = w.alloc(64).unwrap();
        for p in [peer, rank] {
            w.put(src.view(0, 0).unwrap(), p, 1024, false).unwrap_or_else(|e| panic!("put to {p}: {e}"));
            w.get(src.view_mut(0, 0).unwrap(), p, 1024, false).unwrap_or_else(|e| panic!("get from {p}: {e}"));
            w.put_bytes(&[], p, 1024).unwrap_or_else(|e| panic!("put_bytes to {p}: {e}"));
        }
        // One past the end is still out of bounds.
        assert!(matches!(w.put(src.view(0, 0).unwrap(), peer, 1025, false), Err(Error::Bounds { .. })));
        g.barrier(None).unwrap();
        w.tensor_deregister().unwrap();
    });
}
