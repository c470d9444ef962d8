//! A communicator whose ranks are threads of one process (an in-process
//! store): the settings it hands to the windows it makes.

use std::sync::Arc;
use std::time::Duration;

use rmacomm_collectives::{Comm, CommOptions};
use rmacomm_window::{AccessType, Group, HashStore, Store, WindowOptions};

/// Runs `f(rank, comm)` on two ranks (threads) and returns their results.
fn two_ranks<T: Send + 'static>(opts: CommOptions, f: impl Fn(usize, Comm) -> T + Send + Sync + 'static) -> Vec<T> {
    std::env::set_var("RMACOMM_PROVIDER", "soft");
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let f = Arc::new(f);
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let (store, f, opts) = (store.clone(), f.clone(), opts.clone());
            std::thread::spawn(move || {
                let group = Group::new(rank, 2, store).unwrap();
                let comm = Comm::new(&group, opts).unwrap();
                f(rank, comm)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// `CommOptions::window` reaches the windows the communicator makes: with
/// `unified(false)` a same-host peer is reached through the transport
/// (SEPARATE); by default it is mapped (UNIFIED). `window_allocate` takes
/// its settings from the same place (`Comm::window_options`).
#[test]
fn window_options_reach_the_communicators_windows() {
    let base = CommOptions::new().timeout(Duration::from_secs(30));
    for (unified, want) in [(true, AccessType::Unified), (false, AccessType::Separate)] {
        let opts = base.clone().window(WindowOptions::new().unified(unified));
        let got = two_ranks(opts, |rank, comm| comm.new_window().unwrap().get_attr(1 - rank).unwrap().access_type);
        assert_eq!(got, vec![want; 2], "unified({unified})");
    }
}

/// Windows allocated and dropped back to back: a rank that is done with its
/// window drops it (deregistering its memory) while its peer may still be
/// registering. Registration ends with every rank reporting its mappings,
/// so none leaves before its peers have mapped its memory. (Before, rank 0
/// failed to map rank 1's allocation within a few rounds, "does not
/// register ... under key ...": rank 1 had already dropped it.)
#[test]
fn windows_allocated_and_dropped_back_to_back() {
    let opts = CommOptions::new().timeout(Duration::from_secs(30));
    let done = two_ranks(opts, |rank, comm| {
        for round in 0..30 {
            let w = comm.window_allocate(4096, 1).unwrap_or_else(|e| panic!("rank {rank}, round {round}: {e}"));
            assert_eq!(w.get_attr(1 - rank).unwrap().access_type, AccessType::Unified);
        }
        true
    });
    assert_eq!(done, vec![true, true]);
}

/// Splits that overflow when summed are refused (they used to wrap to the
/// buffer's length and split past its end: a panic), and a closure that
/// panics on an `AsyncComm` fails its own work and the later ones, naming
/// why, instead of killing the worker and then the caller's next submit.
#[test]
fn overflowing_splits_are_refused_and_a_panicking_job_fails_its_work() {
    let opts = CommOptions::new().timeout(Duration::from_secs(30));
    let done = two_ranks(opts, |_rank, mut comm| {
        let e = comm.all_to_all_v_single(&mut [], &[], &[usize::MAX, 1], &[usize::MAX, 1]).unwrap_err();
        assert!(e.to_string().contains("all_to_all_v_single") && e.to_string().contains("add up"), "{e}");
        let e = comm.all_to_all_v_single(&mut [0u8; 4], &[0u8; 4], &[usize::MAX, 5], &[2, 2]).unwrap_err();
        assert!(e.to_string().contains("add up"), "{e}");
        // Still matched on both ranks: nothing was exchanged.
        comm.barrier().unwrap();

        let a = rmacomm_collectives::AsyncComm::new(comm);
        let mut bad = a.submit(|_c| -> rmacomm_collectives::Result<()> { panic!("a bug in the caller's closure") });
        let e = bad.wait(Some(Duration::from_secs(30))).unwrap_err();
        assert!(e.to_string().contains("panicked"), "{e}");
        let mut later = a.submit(|c| c.barrier());
        let e = later.wait(Some(Duration::from_secs(30))).unwrap_err();
        assert!(e.to_string().contains("panicked"), "{e}");
        a.into_inner().rank()
    });
    assert_eq!(done, vec![0, 1]);
}

/// Ranks reducing the same bytes as different element types, or with
/// different operations, fail as mismatched on every rank, naming the
/// peer's call: each used to combine the bytes its own way and return Ok
/// (different results on different ranks).
#[test]
fn a_reduction_with_another_type_or_operation_is_a_mismatch() {
    use rmacomm_collectives::{DType, Error, ReduceOp};
    let cases = [
        ((DType::F32, ReduceOp::Sum), (DType::I32, ReduceOp::Sum), "all_reduce of I32 with Sum"),
        ((DType::F32, ReduceOp::Sum), (DType::F32, ReduceOp::Max), "all_reduce of F32 with Max"),
        ((DType::F16, ReduceOp::Avg), (DType::F16, ReduceOp::Sum), "all_reduce of F16 with Sum"),
    ];
    for (mine, theirs, named) in cases {
        let opts = CommOptions::new().timeout(Duration::from_secs(30));
        let errs = two_ranks(opts, move |rank, mut comm| {
            let (dtype, op) = if rank == 0 { mine } else { theirs };
            let mut buf = [0u8; 64];
            comm.all_reduce(&mut buf, dtype, op).unwrap_err()
        });
        for (rank, e) in errs.iter().enumerate() {
            assert!(matches!(e, Error::Mismatch { .. }), "rank {rank}: {e}");
            assert!(e.to_string().contains(&format!("rank {}", 1 - rank)), "rank {rank}: {e}");
        }
        assert!(errs[0].to_string().contains(named), "{}", errs[0]);
    }
}

/// Float AVG and PREMUL_SUM scale each rank's contribution before the sum,
/// as NCCL does: an f16 average of 40000 and 40000 is 40000 (summing first
/// overflowed to inf), and ranks with different PREMUL_SUM factors agree
/// on Σ fᵣ·xᵣ (each used to multiply the whole sum by its own factor) —
/// under every algorithm, and in reduce and reduce_scatter too.
#[test]
fn avg_and_premul_sum_scale_each_contribution_before_the_sum() {
    use half::f16;
    use rmacomm_collectives::{DType, ReduceOp};
    let f16s = |v: &[f32]| v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect::<Vec<u8>>();
    let back = |b: &[u8]| b.chunks(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect::<Vec<f32>>();
    for algo in ["oneshot", "direct", "ring"] {
        let opts = CommOptions::new().timeout(Duration::from_secs(30)).hint("rmacomm::algo", algo);
        let got = two_ranks(opts, move |rank, mut comm| {
            let mut avg = f16s(&[40000.0; 6]);
            comm.all_reduce(&mut avg, DType::F16, ReduceOp::Avg).unwrap();
            let mut half = f16s(&[40000.0; 6]);
            comm.all_reduce(&mut half, DType::F16, ReduceOp::PremulSum(0.5)).unwrap();
            // Rank 0 weighs its 1s by 1, rank 1 by 3: 4 on both.
            let mut weighed = f16s(&[1.0; 6]);
            comm.all_reduce(&mut weighed, DType::F16, ReduceOp::PremulSum(1.0 + 2.0 * rank as f64)).unwrap();
            let mut root = f16s(&[40000.0; 6]);
            comm.reduce(&mut root, DType::F16, ReduceOp::Avg, 0).unwrap();
            let input = f16s(&[40000.0; 6]);
            let mut out = vec![0u8; 6];
            comm.reduce_scatter_single(&mut out, &input, DType::F16, ReduceOp::Avg).unwrap();
            (back(&avg), back(&half), back(&weighed), back(&root), back(&out), back(&input))
        });
        for (rank, (avg, half, weighed, root, out, input)) in got.into_iter().enumerate() {
            let at = format!("{algo}, rank {rank}");
            assert_eq!(avg, vec![40000.0; 6], "{at}: all_reduce Avg");
            assert_eq!(half, vec![40000.0; 6], "{at}: all_reduce PremulSum(0.5)");
            assert_eq!(weighed, vec![4.0; 6], "{at}: all_reduce PremulSum(1 or 3)");
            if rank == 0 {
                assert_eq!(root, vec![40000.0; 6], "{at}: reduce Avg at the root");
            } else {
                assert_eq!(root, vec![40000.0; 6], "{at}: reduce left a non-root's buffer as it was");
            }
            assert_eq!(out, vec![40000.0; 3], "{at}: reduce_scatter_single Avg");
            assert_eq!(input, vec![40000.0; 6], "{at}: the caller's input stays as it was");
        }
    }
}

/// A call one rank makes with bad arguments is refused there, and takes no
/// sequence number: its corrected retry is still the peer's call of that
/// number (each refused call here used to take one, so the retry failed as
/// mismatched on this rank and timed out on the other, the communicator
/// lost). Every collective with a local argument check, refused on rank 1
/// only, then made right on both.
#[test]
fn a_call_refused_for_its_arguments_leaves_the_retry_matched() {
    use rmacomm_collectives::{DType, ReduceOp};
    let opts = CommOptions::new().timeout(Duration::from_secs(10));
    let done = two_ranks(opts, |rank, mut comm| {
        let refused = |what: &str, r: rmacomm_collectives::Result<()>| {
            let e = r.expect_err(what);
            assert!(e.to_string().contains("invalid argument"), "{what}: {e}");
        };
        let src = [rank as u8 + 1; 8];
        if rank == 1 {
            refused("broadcast root", comm.broadcast(&mut [0u8; 8], 7));
            refused("reduce root", comm.reduce(&mut [0u8; 8], DType::F32, ReduceOp::Sum, 7));
            refused("all_reduce length", comm.all_reduce(&mut [0u8; 7], DType::F32, ReduceOp::Sum));
            refused("all_gather_single", comm.all_gather_single(&mut [0u8; 15], &src));
            let (mut a, mut b) = ([0u8; 8], [0u8; 12]);
            refused("all_gather outputs", comm.all_gather(&mut [&mut a, &mut b], &src));
            refused("all_to_all inputs", comm.all_to_all(&mut [&mut [0u8; 8], &mut [0u8; 8]], &[&src, &src, &src]));
            refused("reduce_scatter", comm.reduce_scatter(&mut [0u8; 8], &[&src], DType::F32, ReduceOp::Sum));
            // A peer's input of no whole elements, under an op that scales
            // the inputs (it was refused after the call took its number).
            for op in [ReduceOp::Avg, ReduceOp::PremulSum(2.0), ReduceOp::Sum] {
                let e = comm.reduce_scatter(&mut [0u8; 8], &[&[0u8; 7], &src], DType::F32, op);
                refused("reduce_scatter peer input", e);
            }
            refused("scatter root", comm.scatter(&mut [0u8; 8], None, 9));
            refused("gather root", comm.gather(None, &src, 9));
        }
        let mut b = if rank == 0 { [5u8; 8] } else { [0u8; 8] };
        comm.broadcast(&mut b, 0).unwrap();
        assert_eq!(b, [5u8; 8]);
        let mut g = [[0u8; 8]; 2];
        {
            let [g0, g1] = &mut g;
            comm.all_gather(&mut [g0, g1], &src).unwrap();
        }
        assert_eq!(g, [[1u8; 8], [2u8; 8]]);
        let mut x = 1.5f32.to_le_bytes();
        comm.all_reduce(&mut x, DType::F32, ReduceOp::Sum).unwrap();
        assert_eq!(f32::from_le_bytes(x), 3.0);
        comm.barrier().unwrap();
        rank
    });
    assert_eq!(done, vec![0, 1]);
}

/// Errors name the call the user made: `all_gather_v` and
/// `reduce_scatter_v` (they share `all_gather`'s and `reduce_scatter`'s
/// code), and `finalize` (a barrier inside).
#[test]
fn errors_name_the_v_forms_and_finalize() {
    use rmacomm_collectives::{DType, ReduceOp};
    let opts = CommOptions::new().timeout(Duration::from_secs(10));
    let done = two_ranks(opts, |rank, mut comm| {
        let src = [rank as u8 + 1; 8];
        let (mut a, mut b, mut c) = ([0u8; 8], [0u8; 8], [0u8; 8]);
        let e = comm.all_gather_v(&mut [&mut a, &mut b, &mut c], &src).unwrap_err().to_string();
        assert!(e.starts_with("all_gather_v: invalid argument"), "{e}");
        let e = comm.reduce_scatter_v(&mut [0u8; 8], &[&src], DType::F32, ReduceOp::Sum).unwrap_err().to_string();
        assert!(e.starts_with("reduce_scatter_v: invalid argument"), "{e}");
        let (mut a, mut b) = ([0u8; 4], [0u8; 8]);
        let mine = if rank == 0 { &src[..4] } else { &src[..] };
        comm.all_gather_v(&mut [&mut a, &mut b], mine).unwrap();
        assert_eq!((a, b), ([1u8; 4], [2u8; 8]));
        comm.finalize().unwrap();
        let e = comm.finalize().unwrap_err().to_string();
        assert!(e.starts_with("finalize: the communicator is unusable"), "{e}");
        rank
    });
    assert_eq!(done, vec![0, 1]);
}

/// Every rank a broadcast root: nobody receives, so both calls return Ok
/// (as NCCL's); the mismatch surfaces at the next call on every rank, as
/// docs/collectives.md says (the chunks are still in the peers' slots).
#[test]
fn two_broadcast_roots_fail_at_the_next_call() {
    let opts = CommOptions::new().timeout(Duration::from_secs(10));
    let done = two_ranks(opts, |rank, mut comm| {
        comm.broadcast(&mut [rank as u8; 8], rank).unwrap();
        let e = comm.barrier().unwrap_err();
        assert!(matches!(e, rmacomm_collectives::Error::Mismatch { .. }), "rank {rank}: {e}");
        assert!(e.to_string().contains("broadcast"), "rank {rank}: {e}");
        rank
    });
    assert_eq!(done, vec![0, 1]);
}

/// Ranks whose all_reduce takes different algorithms — one's buffer within
/// the one-shot limit (64 KiB), the other's past it — fail as mismatched,
/// naming both algorithms. The one-shot rank returned Ok holding its data
/// reduced with the first 64 KiB of its peer's (the chunks looked alike).
#[test]
fn an_all_reduce_whose_ranks_take_different_algorithms_is_a_mismatch() {
    let opts = CommOptions::new().timeout(Duration::from_secs(5));
    let got = two_ranks(opts, |rank, mut c| {
        let mut buf = vec![0u8; if rank == 0 { 64 << 10 } else { 128 << 10 }];
        c.all_reduce(&mut buf, rmacomm_collectives::DType::F32, rmacomm_collectives::ReduceOp::Sum)
            .map_err(|e| e.to_string())
    });
    let e = got[0].as_ref().expect_err("the one-shot rank's all_reduce returned Ok");
    assert!(e.contains("mismatched") && e.contains("(one-shot)") && e.contains("(direct)"), "{e}");
    assert!(got[1].is_err(), "{:?}", got[1]);
}

/// A `CommWork::wait` whose own limit passes first says the operation is
/// pending (it said the communicator was unusable, which callers answer by
/// rebuilding it); waiting again gets the result.
#[test]
fn a_wait_whose_limit_passes_says_pending() {
    let opts = CommOptions::new().timeout(Duration::from_secs(30));
    two_ranks(opts, |rank, comm| {
        let a = rmacomm_collectives::AsyncComm::new(comm);
        if rank == 1 {
            std::thread::sleep(Duration::from_millis(500));
        }
        let mut w = a.submit(|c| c.barrier());
        if rank == 0 {
            let e = w.wait(Some(Duration::from_millis(10))).unwrap_err();
            assert!(matches!(e, rmacomm_collectives::Error::Pending { .. }), "{e}");
            assert!(e.to_string().contains("wait again"), "{e}");
        }
        w.wait(None).unwrap();
    });
}

/// Ranks passing different slot sizes (or algorithm hints) fail at
/// `Comm::new` on every rank, naming the one that differs: a rank with
/// another slot size placed its chunks at other offsets of the peers'
/// windows, inside another pair's slots. A slot size no chunk header can
/// count is refused on every rank.
#[test]
fn ranks_with_different_layouts_fail_at_new() {
    let cases: Vec<(CommOptions, CommOptions, &str)> = vec![
        (CommOptions::new().slot_bytes(4096), CommOptions::new().slot_bytes(64), "slot_bytes"),
        (CommOptions::new(), CommOptions::new().hint("rmacomm::algo", "ring"), "rmacomm::algo"),
    ];
    for (a, b, what) in cases {
        let store: Arc<dyn Store> = Arc::new(HashStore::new());
        let handles: Vec<_> = [a, b]
            .into_iter()
            .enumerate()
            .map(|(rank, opts)| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let group = Group::new(rank, 2, store).unwrap();
                    Comm::new(&group, opts.timeout(Duration::from_secs(30))).err().map(|e| e.to_string())
                })
            })
            .collect();
        for (rank, h) in handles.into_iter().enumerate() {
            let e = h.join().unwrap().unwrap_or_else(|| panic!("rank {rank} made a communicator"));
            assert!(e.contains("mismatched") && e.contains(what) && e.contains(&format!("rank {}", 1 - rank)), "{e}");
        }
    }
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let group = Group::new(0, 1, store).unwrap();
    let Err(e) = Comm::new(&group, CommOptions::new().slot_bytes(usize::MAX)) else { panic!("a slot of usize::MAX") };
    assert!(e.to_string().contains("slot_bytes") && e.to_string().contains("at most"), "{e}");
}

/// The single forms' errors name the call made (they named reduce_scatter
/// and all_to_all, and lists the caller never passed), and nothing was
/// exchanged: the ranks are still matched.
#[test]
fn single_forms_name_themselves_in_errors() {
    use rmacomm_collectives::{DType, ReduceOp};
    let opts = CommOptions::new().timeout(Duration::from_secs(30));
    two_ranks(opts, |rank, mut c| {
        let e = c.reduce_scatter_single(&mut [0u8; 4], &[0u8; 8], DType::F32, ReduceOp::Bxor).unwrap_err();
        assert!(e.to_string().starts_with("reduce_scatter_single:"), "{e}");
        let e = c.reduce_scatter_single(&mut [0u8; 6], &[0u8; 12], DType::F32, ReduceOp::Sum).unwrap_err();
        assert!(e.to_string().starts_with("reduce_scatter_single:"), "{e}");
        let (outs, ins) = if rank == 0 { ([4, 0], [0, 4]) } else { ([0, 4], [4, 0]) };
        let e = c.all_to_all_v_single(&mut [0u8; 4], &[0u8; 4], &outs, &ins).unwrap_err();
        assert!(e.to_string().starts_with("all_to_all_v_single:") && e.to_string().contains("output_splits"), "{e}");
        c.barrier().unwrap();
    });
}
