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
