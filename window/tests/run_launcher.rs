//! rmacomm-run: environment, `[rank]` prefixes, exit codes, stopping the
//! other ranks, signal forwarding.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const RUN: &str = env!("CARGO_BIN_EXE_rmacomm-run");
const SCENARIO: &str = env!("CARGO_BIN_EXE_group-scenario");

fn sh(nproc: &str, flag: &str, script: &str) -> Output {
    Command::new(RUN)
        .args([flag, nproc, "--", "sh", "-c", script])
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .output()
        .unwrap()
}

#[test]
fn every_line_is_prefixed_with_its_rank_on_its_own_stream() {
    let out = Command::new(RUN).args(["--nproc-per-node", "3", SCENARIO, "echo"]).output().unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for r in 0..3 {
        assert!(stdout.lines().any(|l| l == format!("[{r}] hello from rank {r}")), "{stdout}");
        assert!(stderr.lines().any(|l| l == format!("[{r}] complaint from rank {r}")), "{stderr}");
        assert!(!stdout.contains(&format!("complaint from rank {r}")), "stderr went to stdout");
    }
    // A last line without a newline still gets its prefix and its own line.
    assert!(stdout.lines().any(|l| l.starts_with("[1] no newline from rank 1")), "{stdout}");
    assert!(stdout.lines().all(|l| l.starts_with('[')), "{stdout}");
}

#[test]
fn ranks_get_torchrun_variables_and_a_free_port() {
    let out = sh(
        "2",
        "--nproc_per_node",
        r#"echo "R=$RANK W=$WORLD_SIZE L=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE A=$MASTER_ADDR P=$MASTER_PORT""#,
    );
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let port = stdout.lines().next().unwrap().rsplit("P=").next().unwrap().to_string();
    assert!(port.parse::<u16>().unwrap() > 0, "{stdout}");
    for r in 0..2 {
        let want = format!("[{r}] R={r} W=2 L={r} LW=2 A=127.0.0.1 P={port}");
        assert!(stdout.lines().any(|l| l == want), "{stdout}");
    }
    // MASTER_ADDR / MASTER_PORT from the environment are honoured.
    let out = Command::new(RUN)
        .args(["--nproc-per-node", "1", "sh", "-c", "echo $MASTER_ADDR:$MASTER_PORT"])
        .env("MASTER_ADDR", "10.1.2.3")
        .env("MASTER_PORT", "4567")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "[0] 10.1.2.3:4567\n");
}

#[test]
fn a_failing_rank_stops_the_others_and_its_code_is_the_exit_code() {
    let start = Instant::now();
    let out = Command::new(RUN).args(["--nproc-per-node", "4", SCENARIO, "fail", "2", "7"]).output().unwrap();
    let took = start.elapsed();
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    // The others sleep 60 s unless stopped.
    assert!(took < Duration::from_secs(20), "{took:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rank 2 failed with exit code 7"), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("ok"), "a rank finished instead of being stopped");
}

#[test]
fn ranks_that_ignore_sigterm_are_killed_after_the_grace_period() {
    let start = Instant::now();
    let out = Command::new(RUN)
        .args(["--nproc-per-node", "2", "--grace-period", "0.5", "--", "sh", "-c"])
        .arg(r#"if [ "$RANK" = 1 ]; then sleep 0.2; exit 3; fi; trap '' TERM; sleep 30 & wait; sleep 30"#)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
}

#[test]
fn a_rank_killed_by_a_signal_gives_128_plus_the_signal() {
    let out = sh("2", "--nproc-per-node", r#"if [ "$RANK" = 1 ]; then kill -KILL $$; fi; sleep 30"#);
    assert_eq!(out.status.code(), Some(128 + 9), "{out:?}");
}

#[test]
fn all_ranks_succeeding_exits_zero_and_a_missing_program_127() {
    assert_eq!(sh("3", "--nproc-per-node", "exit 0").status.code(), Some(0));
    let out = Command::new(RUN).args(["--nproc-per-node", "2", "/nonexistent/program"]).output().unwrap();
    assert_eq!(out.status.code(), Some(127));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot start"));
    // Bad usage is clap's exit code 2.
    assert_eq!(Command::new(RUN).args(["--nproc-per-node", "0", "true"]).output().unwrap().status.code(), Some(2));
    // Settings past what can be held are usage errors too, before anything
    // starts (a grace period past u64::MAX seconds panicked after the ranks
    // had started; a huge rank count aborted reserving memory).
    for bad in [
        &["--nproc-per-node", "1", "--grace-period", "1e20", "true"][..],
        &["--nproc-per-node", "1", "--grace-period", "NaN", "true"],
        &["--nproc-per-node", "18446744073709551615", "true"],
        &["--nproc-per-node", "65537", "true"],
    ] {
        let out = Command::new(RUN).args(bad).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("rmacomm-run: --"), "{bad:?}: {out:?}");
    }
    assert_eq!(Command::new(RUN).arg("true").output().unwrap().status.code(), Some(2));
}

#[test]
fn sigterm_to_the_launcher_is_forwarded_to_the_ranks() {
    let mut child = Command::new(RUN)
        .args(["--nproc-per-node", "2", "--", "sh", "-c", "echo started; exec sleep 30"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until both ranks run.
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 256];
    while seen.matches("started").count() < 2 {
        let n = std::io::Read::read(&mut stdout, &mut buf).unwrap();
        assert!(n > 0, "launcher ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let start = Instant::now();
    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + 15), "{status:?}");
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
}

/// Whether process `pid` runs (a zombie does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit(')').next().map(|rest| rest.trim_start().starts_with(|c| c != 'Z' && c != 'X')))
        .unwrap_or(false)
}

/// Starts the launcher on 2 ranks of `script` (which prints `pid N` lines)
/// and returns it with the pids printed once `want` of them came.
fn start(script: &str, want: usize) -> (std::process::Child, Vec<u32>) {
    let mut child = Command::new(RUN)
        .args(["--nproc-per-node", "2", "--grace-period", "1", "--", "sh", "-c", script])
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let mut pids = Vec::new();
    while pids.len() < want {
        let line = lines.next().expect("the launcher ended early").unwrap();
        if let Some(p) = line.split("pid ").nth(1) {
            pids.push(p.trim().parse().unwrap());
        }
    }
    // Keep reading (the ranks must not block on a full pipe).
    std::thread::spawn(move || lines.for_each(drop));
    (child, pids)
}

fn all_gone_within(pids: &[u32], limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if pids.iter().all(|&p| !alive(p)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn a_launcher_killed_by_sigkill_leaves_no_ranks_behind() {
    // Ranks used to keep running (and waiting out their store timeouts)
    // when the launcher died of a signal it cannot forward.
    let (mut child, pids) = start("echo pid $$; exec sleep 60", 2);
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(child.id() as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    child.wait().unwrap();
    assert!(all_gone_within(&pids, Duration::from_secs(5)), "ranks {pids:?} outlived their launcher");
}

#[test]
fn sighup_and_sigquit_to_the_launcher_stop_the_ranks() {
    for (sig, num) in [(rustix::process::Signal::HUP, 1), (rustix::process::Signal::QUIT, 3)] {
        let (mut child, pids) = start("echo pid $$; exec sleep 60", 2);
        rustix::process::kill_process(rustix::process::Pid::from_raw(child.id() as i32).unwrap(), sig).unwrap();
        let status = child.wait().unwrap();
        // The ranks die of the SIGTERM it is forwarded as.
        assert_eq!(status.code(), Some(128 + 15), "signal {num}: {status:?}");
        assert!(all_gone_within(&pids, Duration::from_secs(5)), "signal {num}: ranks {pids:?} still run");
    }
}

#[test]
fn what_a_finished_rank_left_running_is_stopped_with_it() {
    // Each rank starts a helper in its process group and exits 0: the
    // helper used to outlive the job (and hold its output pipe).
    let t0 = Instant::now();
    let (mut child, pids) = start("sleep 60 & echo pid $!; exit 0", 2);
    assert!(child.wait().unwrap().success());
    assert!(all_gone_within(&pids, Duration::from_secs(5)), "helpers {pids:?} outlived their ranks");
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
}

#[test]
fn inherited_port_variables_do_not_move_the_ranks_store() {
    // rmacomm's own RMACOMM_MASTER_PORT, or torchrun's agent-store flag,
    // inherited from an outer job, beat the MASTER_PORT the launcher gives.
    let out = Command::new(RUN)
        .args([
            "--nproc-per-node",
            "1",
            "--master-port",
            "4567",
            "sh",
            "-c",
            "echo \"[$RMACOMM_MASTER_PORT|$TORCHELASTIC_USE_AGENT_STORE|$MASTER_PORT]\"",
        ])
        .env("RMACOMM_MASTER_PORT", "1")
        .env("TORCHELASTIC_USE_AGENT_STORE", "True")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "[0] [||4567]\n");
    for port in [["--master-port", "0"].as_slice(), &[]] {
        let mut cmd = Command::new(RUN);
        cmd.args(["--nproc-per-node", "1"]).args(port).args(["true"]);
        if port.is_empty() {
            cmd.env("MASTER_PORT", "0");
        }
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{port:?}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("port number"), "{out:?}");
    }
}
