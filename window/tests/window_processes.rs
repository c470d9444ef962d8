//! Windows across real processes started by rmacomm-run (the
//! `window-scenario` helper): torchcomms' ring test with 2, 3 and 4 ranks,
//! banked signals and wait timeouts, bounds, get, a peer that dies.

use std::process::{Command, Output};
use std::time::Instant;

fn run(nproc: usize, args: &[&str]) -> Output {
    run_on("unified", nproc, args)
}

/// `path`: `unified` (same-host peers through shared memory, the default)
/// or `separate` (every peer through the transport).
fn run_on(path: &str, nproc: usize, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rmacomm-run"))
        .args(["--nproc-per-node", &nproc.to_string(), env!("CARGO_BIN_EXE_window-scenario")])
        .args(args)
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env("RMACOMM_TIMEOUT_SECONDS", "60")
        .env("WINDOW_PATH", path)
        .output()
        .unwrap()
}

fn assert_every_rank_ok(n: usize, out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{n} ranks failed ({:?}):\n{stdout}\n{stderr}", out.status);
    for r in 0..n {
        assert!(stdout.contains(&format!("[{r}] rank {r} ok")), "rank {r}:\n{stdout}\n{stderr}");
    }
    stdout
}

/// Counts 4, 1024 and 1 Mi elements × f32, i32, i8 × sync/async put ×
/// sync/async signal × 10 iterations, on 2, 3 and 4 ranks (the full cross
/// product, about 5 s in all on two cores).
/// Same host, so every pair is UNIFIED (shared memory: copies and atomics).
#[test]
fn ring_put_signal_wait_with_2_3_and_4_ranks() {
    for n in [2, 3, 4] {
        let t0 = Instant::now();
        assert_every_rank_ok(n, &run(n, &["ring", "4,1024,1048576", "10"]));
        eprintln!("ring, {n} ranks: {:?}", t0.elapsed());
    }
}

/// The same ring with the UNIFIED path off: every pair through the transport.
#[test]
fn ring_put_signal_wait_separate_with_2_and_3_ranks() {
    for n in [2, 3] {
        assert_every_rank_ok(n, &run_on("separate", n, &["ring", "4,1024,1048576", "10"]));
    }
}

#[test]
fn signals_are_banked_and_a_wait_times_out_clearly() {
    for path in ["unified", "separate"] {
        for n in [2, 3] {
            let stdout = assert_every_rank_ok(n, &run_on(path, n, &["signals"]));
            assert!(stdout.contains("timeout error: wait_signal with rank"), "{path}: {stdout}");
        }
    }
}

#[test]
fn out_of_bounds_puts_and_gets_fail_and_move_nothing() {
    for path in ["unified", "separate"] {
        for n in [2, 3] {
            let stdout = assert_every_rank_ok(n, &run_on(path, n, &["bounds"]));
            assert!(stdout.contains("bounds error: put with rank"), "{path}: {stdout}");
        }
    }
}

#[test]
fn get_reads_every_ranks_buffer() {
    for path in ["unified", "separate"] {
        for n in [2, 3] {
            assert_every_rank_ok(n, &run_on(path, n, &["get"]));
        }
    }
}

#[test]
fn a_dead_peer_fails_wait_signal_within_the_timeout() {
    for path in ["unified", "separate"] {
        a_dead_peer_fails(path);
    }
}

fn a_dead_peer_fails(path: &str) {
    let t0 = Instant::now();
    let stdout = assert_every_rank_ok(2, &run_on(path, 2, &["killed"]));
    let line = stdout.lines().find(|l| l.starts_with("[0] killed peer error")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("wait_signal with rank 1") && line.contains("peer closed the connection"), "{line}");
    assert!(t0.elapsed().as_secs() < 30, "{:?}", t0.elapsed());
}

/// The ctran form (`allocate`, value signals SET/ADD, every comparison,
/// `get_tensor`), UNIFIED and SEPARATE, 2 and 3 ranks.
#[test]
fn ctran_form_value_signals_with_every_comparison() {
    for path in ["unified", "separate"] {
        for n in [2, 3] {
            let stdout = assert_every_rank_ok(n, &run_on(path, n, &["ctran"]));
            assert!(stdout.contains("value timeout: timed out"), "{path}: {stdout}");
        }
    }
}

/// A peer drops its window while this rank still puts into it: the put
/// fails with an error naming the operation and the peer, on both paths.
#[test]
fn a_peer_leaving_fails_the_writer_cleanly() {
    for path in ["unified", "separate"] {
        let t0 = Instant::now();
        let stdout = assert_every_rank_ok(2, &run_on(path, 2, &["leave"]));
        let line = stdout.lines().find(|l| l.starts_with("[0] leave error")).unwrap_or_else(|| panic!("{stdout}"));
        assert!(line.contains("put with rank 1"), "{path}: {line}");
        assert!(t0.elapsed().as_secs() < 30, "{path}: {:?}", t0.elapsed());
    }
}

/// Windows on CUDA device memory between two processes on one GPU (CUDA
/// IPC; host- and stream-ordered signals, get, bounds, a CUDA graph
/// replay): the full check on a machine with an NVIDIA GPU (the GPU suite
/// runs it with RMACOMM_EXPECT_GPU=1, where a missing GPU fails). Without
/// one, every rank says why it skipped.
#[test]
fn device_memory_ring_over_cuda_ipc() {
    let out = Command::new(env!("CARGO_BIN_EXE_rmacomm-run"))
        .args(["--nproc-per-node", "2", env!("CARGO_BIN_EXE_gpu-window-scenario"), "ring"])
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env("RMACOMM_TIMEOUT_SECONDS", "60")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}:\n{stdout}\n{stderr}", out.status);
    for r in 0..2 {
        let ok = stdout.contains(&format!("[{r}] rank {r} ok"));
        let skipped = stdout.lines().find(|l| l.contains(&format!("[{r}] rank {r} skipped (no GPU")));
        assert!(ok || skipped.is_some(), "rank {r} neither ran nor said why it skipped:\n{stdout}\n{stderr}");
        if let Some(line) = skipped {
            eprintln!("skipped: {line}");
        }
    }
}

/// The device-memory ring (on cuMemAlloc and on VMM memory), the bandwidth and signal-latency scenarios and
/// the stream proxy's (`proxy`: stream-ordered operations through the
/// transport) included, against the CUDA
/// stand-in on 2, 3 and 4 ranks: rmacomm's side of device windows (IPC
/// handle exchange, offsets, bounds, signal counts, stream order, graph
/// replay) on every CI run. CUDA itself is the GPU suite's to check.
/// A device window (the CUDA stand-in, two processes) whose peer dies
/// while this rank's stream waits for its signal: the watchdog releases the
/// stream within moments and the next stream operation fails naming the
/// rank (`gpu-window-scenario dead`); before, the stream waited forever.
#[test]
fn a_dead_peer_releases_device_stream_waits() {
    let Some(lib) = rmacomm_window::cuda::standin_for_tests() else { return };
    let out = gpu_scenario(2, &["dead"], &lib, &[("RMACOMM_STANDIN_STRICT", "1")]);
    let stdout = assert_every_rank_ok(2, &out);
    assert!(stdout.contains("dead: released after"), "{stdout}");
}

/// Device windows' waits in a CUDA graph's replay (kernel signals, which
/// no host call issues): one for a rank that stops replaying is released
/// after the 2 s timeout, one for a rank that dies at once, naming it
/// (`gpu-window-scenario dead_replay`); before, both waited forever.
/// Needs NVRTC for the signal kernels: skipped, saying so, without it (the
/// test command's NVRTC stage runs it).
#[test]
fn device_replays_waiting_for_an_absent_or_dead_peer_are_released() {
    let Some(lib) = rmacomm_window::cuda::standin_for_tests() else { return };
    let out = gpu_scenario(2, &["dead_replay"], &lib, &[("RMACOMM_STANDIN_STRICT", "1")]);
    let stdout = assert_every_rank_ok(2, &out);
    if let Some(line) = stdout.lines().find(|l| l.contains("dead_replay skipped")) {
        eprintln!("skipped: {line}");
        return;
    }
    assert!(stdout.contains("dead_replay: overdue replay released after"), "{stdout}");
    assert!(stdout.contains("dead_replay: released after"), "{stdout}");
}

/// Processes on two GPUs (the stand-in's two devices, rank r on GPU r mod
/// 2): with peer access the device ring maps peers through CUDA IPC across
/// the GPUs; without (`RMACOMM_STANDIN_P2P=0`) the registration is
/// `Unreachable` on every rank, naming rank 0, and the same window's
/// stream-ordered ring goes through the transport (`gpu-window-scenario
/// gpus`). Before, the registration failed and nothing could be moved.
#[test]
fn device_windows_of_processes_on_two_gpus_with_and_without_peer_access() {
    let Some(lib) = rmacomm_window::cuda::standin_for_tests() else { return };
    for (n, p2p) in [(2, "1"), (3, "0")] {
        let env = [
            ("RMACOMM_STANDIN_DEVICES", "2"),
            ("GPU_PER_RANK", "1"),
            ("RMACOMM_STANDIN_P2P", p2p),
            ("RMACOMM_STANDIN_STRICT", "1"),
        ];
        let out = gpu_scenario(n, &["gpus"], &lib, &env);
        let stdout = assert_every_rank_ok(n, &out);
        let how = if p2p == "1" { "through CUDA IPC" } else { "through the transport" };
        for r in 0..n {
            assert!(stdout.contains(&format!("gpus: rank {r} on cuda:{}, {how}", r % 2)), "{stdout}");
        }
        if p2p == "0" {
            assert_eq!(stdout.matches("cannot map a peer's device memory").count(), n, "{stdout}");
        }
    }
}

#[test]
fn device_memory_ring_against_the_cuda_standin() {
    let Some(lib) = rmacomm_window::cuda::standin_for_tests() else { return };
    // `vmm`: every registered tensor is cuMem/VMM memory in 2 MiB mappings
    // (PyTorch's expandable segments), mapped by peers through descriptors.
    for (n, args, alloc) in [
        (2, &["ring"][..], "cuMemAlloc"),
        (3, &["ring"], "cuMemAlloc"),
        (4, &["ring"], "cuMemAlloc"),
        (2, &["ring"], "vmm"),
        (3, &["ring"], "vmm"),
        (2, &["bw", "1048576"], "cuMemAlloc"),
        (2, &["lat"], "cuMemAlloc"),
        (2, &["proxy"], "cuMemAlloc"),
        (3, &["proxy"], "cuMemAlloc"),
    ] {
        // No thread a stream waits for may take a driver lock while it
        // waits (the stand-in aborts the rank naming the call).
        let out = gpu_scenario(n, args, &lib, &[("GPU_WINDOW_ALLOC", alloc), ("RMACOMM_STANDIN_STRICT", "1")]);
        let stdout = assert_every_rank_ok(n, &out);
        if args[0] == "bw" {
            assert_eq!(stdout.matches("\"window_device_put\"").count(), 3, "{stdout}");
        }
        if args[0] == "lat" {
            assert!(stdout.contains("\"window_device_signal_rtt\",\"host_us\":"), "{stdout}");
        }
        if args[0] == "proxy" && n == 2 {
            assert!(stdout.contains("\"window_proxy_put\",\"bytes\":"), "{stdout}");
            assert!(stdout.contains("\"window_proxy_signal_rtt\",\"stream_queued_us\":"), "{stdout}");
        }
    }
    // A device without stream memory operations: every stream signal and
    // wait is a kernel from the start, and host waits count with them
    // (needs NVRTC for the kernels: CI's NVRTC stage).
    if rmacomm_window::cuda::nvrtc::Nvrtc::get().is_err() {
        eprintln!("the ring without stream memory operations skipped: no NVRTC for the signal kernels");
        return;
    }
    let out = gpu_scenario(3, &["ring"], &lib, &[("RMACOMM_STANDIN_NO_MEMOPS", "1")]);
    assert_every_rank_ok(3, &out);
}

/// `gpu-window-scenario ARGS` on `n` ranks under `rmacomm-run`, against the
/// CUDA stand-in at `lib` (a 60 s timeout), with `env` besides.
fn gpu_scenario(n: usize, args: &[&str], lib: &std::path::Path, env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rmacomm-run"));
    c.args(["--nproc-per-node", &n.to_string(), env!("CARGO_BIN_EXE_gpu-window-scenario")])
        .args(args)
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env("RMACOMM_TIMEOUT_SECONDS", "60")
        .env("RMACOMM_CUDA_LIB", lib)
        .env("RMACOMM_EXPECT_GPU", "1");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// NCCL's window API (2.29+) through `NcclRma`, against the stand-in (the
/// CUDA stand-in's library also stands in for NCCL's one-sided calls): the
/// ring whose rounds put to two peers and two windows, one of them in
/// several pieces before one signal (a wait that counted NCCL's signals
/// wrong passes early and finds old data) on 1, 2 and 3 ranks, and the
/// refusals; then a library that says it is 2.28.9 (refused on every rank
/// naming the versions), a communicator without symmetric windows
/// (`NCCL_WIN_ENABLE=0`: registration fails on every rank saying NCCL gave
/// no window), and a library whose puts fail (the `NcclRma` is then broken:
/// later calls and registrations fail naming it).
/// `gpu-window-scenario nccl` on `n` ranks against the CUDA and NCCL
/// stand-in at `lib` (a 60 s timeout), none of its variants' settings
/// inherited.
fn nccl_scenario(lib: &std::path::Path, n: usize) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rmacomm-run"));
    cmd.args(["--nproc-per-node", &n.to_string(), env!("CARGO_BIN_EXE_gpu-window-scenario"), "nccl"])
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env("RMACOMM_TIMEOUT_SECONDS", "60")
        .env("RMACOMM_CUDA_LIB", lib)
        .env("RMACOMM_NCCL_LIB", lib)
        .env("RMACOMM_EXPECT_GPU", "1");
    for var in [
        "NCCL_WIN_ENABLE",
        "RMACOMM_STANDIN_NCCL_FAIL_PUT",
        "NCCL_SCENARIO_PUT_FAILS",
        "NCCL_SCENARIO_STUCK_SIGNAL",
        "RMACOMM_STANDIN_NCCL_VERSION",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

#[test]
fn nccl_windows_against_the_standin() {
    let Some(lib) = rmacomm_window::cuda::standin_for_tests() else { return };
    let run = |n: usize, env: &[(&str, &str)]| {
        let mut cmd = nccl_scenario(&lib, n);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    };
    // One rank: puts to itself (what the GPU suite runs: one GPU, one rank).
    for n in [1, 2, 3] {
        let stdout = assert_every_rank_ok(n, &run(n, &[]));
        for r in 0..n {
            let want = format!("[{r}] rank {r}: NCCL windows (NCCL (libnccl.so.2) 2.30.7) ring");
            assert!(stdout.contains(&want), "{stdout}");
        }
    }
    let stdout = assert_every_rank_ok(2, &run(2, &[("RMACOMM_STANDIN_NCCL_VERSION", "22809")]));
    for r in 0..2 {
        let line = stdout.lines().find(|l| l.starts_with(&format!("[{r}] rank {r} refused:")));
        let line = line.unwrap_or_else(|| panic!("{stdout}"));
        assert!(line.contains("2.28.9") && line.contains("2.29"), "{line}");
    }
    let out = run(2, &[("NCCL_WIN_ENABLE", "0")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "NCCL_WIN_ENABLE=0 passed:\n{stderr}");
    assert!(stderr.contains("NCCL gave no window"), "NCCL_WIN_ENABLE=0:\n{stderr}");
    let stdout =
        assert_every_rank_ok(2, &run(2, &[("RMACOMM_STANDIN_NCCL_FAIL_PUT", "1"), ("NCCL_SCENARIO_PUT_FAILS", "1")]));
    for r in 0..2 {
        assert!(stdout.contains(&format!("[{r}] rank {r}: a failed put broke the NcclRma")), "{stdout}");
    }
}

/// A rank's NCCL window wait for a signal that never runs (rank 0 queued
/// it behind a stream wait nobody ends) never ends by itself, yet nothing
/// waits without a limit: on both ranks `deregister` fails within the
/// `NcclRma`'s 3 s timeout and dropping the `NcclRma` aborts the
/// communicator and returns; rank 1's stream is free after it (the abort
/// released its wait), rank 0's still waits (its windows' memory leaked,
/// said so). Against the stand-in; the launcher runs under a deadline (past
/// it, a rank hung: the test fails).
#[test]
fn an_nccl_window_wait_for_a_signal_that_never_runs_ends_with_deregister_and_drop() {
    let Some(lib) = rmacomm_window::cuda::standin_for_tests() else { return };
    let mut child = nccl_scenario(&lib, 2)
        .env("NCCL_SCENARIO_STUCK_SIGNAL", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(45) {
            // SIGTERM first: the launcher forwards it to the ranks.
            let _ = Command::new("kill").arg(child.id().to_string()).status();
            std::thread::sleep(std::time::Duration::from_secs(2));
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "hung: still running after 45 s\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}:\n{stdout}\n{stderr}", out.status);
    for want in [
        "[0] rank 0: a put and a signal queued behind a stream wait that never ends",
        "[0] rank 0: deregister failed after 3",
        "[1] rank 1: deregister failed after 3",
        "[0] rank 0: dropped the NcclRma in",
        "[1] rank 1: dropped the NcclRma in",
        "[1] rank 1: its stream is free again",
        "[0] rank 0 ok",
        "[1] rank 1 ok",
    ] {
        assert!(stdout.contains(want), "no {want:?}:\n{stdout}\n{stderr}");
    }
    for r in 0..2 {
        let want =
            format!("[{r}] rmacomm: dropping the NCCL windows (rank {r} of 2): device work still queued after 3s");
        assert!(stderr.contains(&want), "no {want:?}:\n{stderr}");
    }
    assert!(stderr.contains("[0] rmacomm: dropping the NCCL windows (rank 0 of 2): device work still queued 3s after the abort: the windows' memory is leaked"), "{stderr}");
    assert!(!stderr.contains("(rank 1 of 2): device work still queued 3s after the abort"), "{stderr}");
}
