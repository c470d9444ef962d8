//! Collectives across real processes (one per rank, torchrun's variables,
//! the `coll-scenario` helper): every operation with 2, 3 and 4 ranks on
//! the UNIFIED (same-host) and SEPARATE paths, mismatched calls, a rank
//! that dies.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::Instant;

/// Runs `coll-scenario ARGS` as `n` ranks; returns whether all succeeded
/// and their combined output, each line prefixed with `[rank]`.
fn run(n: usize, path: &str, args: &[&str]) -> (bool, String) {
    run_with(n, path, args, &[])
}

/// [`run`] with `env` set for the ranks.
fn run_with(n: usize, path: &str, args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let children: Vec<_> = (0..n)
        .map(|r| {
            Command::new(env!("CARGO_BIN_EXE_coll-scenario"))
                .args(args)
                .envs(env.iter().copied())
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("COLL_PATH", path)
                .env("RMACOMM_PROVIDER", "soft")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut ok = true;
    let mut text = String::new();
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        ok &= out.status.success();
        for l in String::from_utf8_lossy(&out.stdout).lines().chain(String::from_utf8_lossy(&out.stderr).lines()) {
            text.push_str(&format!("[{r}] {l}\n"));
        }
    }
    (ok, text)
}

fn every_rank_ok(n: usize, path: &str, args: &[&str]) -> String {
    every_rank_ok_with(n, path, args, &[])
}

fn every_rank_ok_with(n: usize, path: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let (ok, out) = run_with(n, path, args, env);
    assert!(ok, "{n} ranks, {path}:\n{out}");
    for r in 0..n {
        assert!(out.contains(&format!("[{r}] rank {r} ok")), "rank {r}:\n{out}");
    }
    out
}

/// torchcomms' conventions, every operation: all_reduce counts 0, 4, 1024,
/// 1 Mi × f32, i32, i8 × SUM, MAX, AVG with the direct and ring algorithms;
/// PREMUL_SUM, PRODUCT, MIN, BOR, BAND on floats refused; all_gather
/// (single, v), reduce_scatter (single, v), reduce to every root, broadcast,
/// all_to_all (single, v), scatter, gather, send/recv in a ring, a batch,
/// barrier, a non-contiguous split running beside its parent, finalize.
#[test]
fn all_collectives_with_2_3_and_4_ranks_unified() {
    for n in [2, 3, 4] {
        let t0 = Instant::now();
        every_rank_ok(n, "unified", &["all"]);
        eprintln!("{n} ranks, unified: {:?}", t0.elapsed());
    }
}

#[test]
fn all_collectives_with_2_and_3_ranks_separate() {
    for n in [2, 3] {
        let t0 = Instant::now();
        every_rank_ok(n, "separate", &["all"]);
        eprintln!("{n} ranks, separate: {:?}", t0.elapsed());
    }
}

#[test]
fn three_ranks_mismatched_all_reduce_fails_on_every_rank() {
    let out = every_rank_ok(3, "unified", &["mismatch"]);
    assert!(out.contains("mismatch error"), "{out}");
}

#[test]
fn a_rank_that_dies_fails_the_others_within_the_timeout() {
    let out = every_rank_ok(3, "unified", &["killed"]);
    assert!(out.contains("[0] killed error"), "{out}");
}

/// Whether the GPU scenarios can run here: the CUDA stand-in (set for the
/// ranks) and NVRTC for the kernels; else false, said why (a missing
/// NVRTC fails under RMACOMM_EXPECT_NVRTC=1).
fn on_the_standin() -> bool {
    let Some(lib) = rmacomm_window::cuda::standin_for_tests() else { return false };
    if let Err(e) = rmacomm_window::cuda::nvrtc::Nvrtc::get() {
        assert!(std::env::var("RMACOMM_EXPECT_NVRTC").map_or(true, |v| v != "1"), "RMACOMM_EXPECT_NVRTC=1 but {e}");
        println!("skipped: no NVRTC to compile the GPU kernels ({e})");
        return false;
    }
    std::env::set_var("RMACOMM_CUDA_LIB", &lib);
    true
}

/// The native GPU collectives (IPC mode, the CUDA stand-in) with a rank
/// that dies while rank 0's all_reduce waits for it on its stream: the
/// stream is released and the call fails naming the rank, well before the
/// timeout (`coll-scenario gpu_killed`); and one that dies while the others
/// replay a captured all_reduce, two ranks and three (`gpu_killed_replay`:
/// kernel waits no host call issued; with three, the live peer's signals
/// wrap the poison and the watchdog must write it again). Skipped, saying
/// so, without the stand-in or NVRTC (the test command's NVRTC stage runs
/// it).
#[test]
fn a_gpu_rank_that_dies_releases_the_others_streams() {
    if !on_the_standin() {
        return;
    }
    let (ok, out) = run(2, "unified", &["gpu_killed"]);
    assert!(ok, "{out}");
    assert!(out.contains("[0] gpu_killed error after") && out.contains("[0] rank 0 ok"), "{out}");
    for n in [2, 3] {
        let (ok, out) = run(n, "unified", &["gpu_killed_replay"]);
        assert!(ok && !out.contains("gpu skipped"), "{n} ranks: {out}");
        for r in 0..n - 1 {
            assert!(out.contains(&format!("[{r}] gpu_killed_replay error after")), "{n} ranks: {out}");
            assert!(out.contains(&format!("[{r}] rank {r} ok")), "{n} ranks: {out}");
        }
    }
}

/// Ranks that leave normally while others still replay CUDA graphs of the
/// native GPU collectives are not taken for dead ones (`coll-scenario
/// gpu_replay_teardown`: three ranks, a staggered teardown, every replay
/// checked and the last rank still usable). Skipped, saying so, without
/// the stand-in or NVRTC.
#[test]
fn gpu_ranks_that_leave_normally_do_not_release_the_others_replays() {
    if !on_the_standin() {
        return;
    }
    let (ok, out) = run(3, "unified", &["gpu_replay_teardown"]);
    assert!(ok && !out.contains("gpu skipped"), "{out}");
    for r in 0..3 {
        assert!(out.contains(&format!("[{r}] rank {r} ok")), "{out}");
    }
}

/// A rank done with its native GPU collectives first keeps its slots until
/// a slower peer has read them (`coll-scenario gpu_slow_reader`: rank 1's
/// copies slowed by the stand-in, its sums checked after rank 0 dropped
/// its communicator, eager and replayed; 2 and 3 ranks). Skipped, saying
/// so, without the stand-in or NVRTC.
#[test]
fn a_gpu_rank_that_leaves_first_keeps_its_slots_until_slower_peers_read_them() {
    if !on_the_standin() {
        return;
    }
    for n in [2, 3] {
        let out = every_rank_ok_with(n, "unified", &["gpu_slow_reader"], &[("RMACOMM_STANDIN_COPY_DELAY", "150@1")]);
        assert!(!out.contains("gpu skipped") && out.contains("[0] rank 0 dropped its communicator (replays)"), "{out}");
    }
}

/// The native GPU collectives (`coll-scenario gpu`: every operation, every
/// result checked) of three processes on two GPUs (the stand-in's, rank r
/// on GPU r mod 2): through CUDA IPC across the GPUs where they have peer
/// access; without it (`RMACOMM_STANDIN_P2P=0`) every rank learns at
/// `GpuComm::new` that some rank cannot map a peer's slots and all go
/// through the transport (before, `GpuComm::new` failed). Skipped, saying
/// so, without the stand-in or NVRTC (the test command's NVRTC stage runs
/// it).
#[test]
fn gpu_collectives_of_processes_on_two_gpus_with_and_without_peer_access() {
    if !on_the_standin() {
        return;
    }
    for (p2p, mode) in [("1", "ipc"), ("0", "transport")] {
        let env = [("RMACOMM_STANDIN_DEVICES", "2"), ("GPU_PER_RANK", "1"), ("RMACOMM_STANDIN_P2P", p2p)];
        let out = every_rank_ok_with(3, "unified", &["gpu"], &env);
        for r in 0..3 {
            assert!(out.contains(&format!("[{r}] gpu mode: {mode} (cuda:{})", r % 2)), "{out}");
        }
    }
}

#[test]
fn unknown_and_gpu_backends_are_clear_errors() {
    let e = rmacomm_collectives::new_comm("nccl", rmacomm_collectives::CommOptions::new()).unwrap_err().to_string();
    assert!(e.contains("nccl") && e.contains("not available"), "{e}");
    let e = rmacomm_collectives::new_comm("mpi", rmacomm_collectives::CommOptions::new()).unwrap_err().to_string();
    assert!(e.contains("unknown backend"), "{e}");
}
