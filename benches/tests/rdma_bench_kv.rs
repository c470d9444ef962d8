//! `rdma_bench kv` as a user runs it: the built binary, tiny requests over
//! the soft provider, prefill here and decode in a second process
//! (`--local`); the JSON it prints, its table, and the byte check.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_rdma_bench");

/// Runs `rdma_bench kv ARGS` on the soft provider; a run that hangs is
/// killed after two minutes (a guard, not a timing check).
fn kv(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("kv")
        .args(args)
        .args(["--provider", "soft"])
        .env_remove("RMACOMM_PROVIDER")
        .env_remove("RMACOMM_SOFT_LINK");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start rdma_bench");
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// Runs, insists on success, returns the JSON records and stderr.
fn records(args: &[&str]) -> (Vec<serde_json::Value>, String) {
    let o = kv(args, &[]);
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr).into_owned());
    assert!(o.status.success(), "rdma_bench kv {args:?} failed ({:?})\nstdout:\n{out}\nstderr:\n{err}", o.status);
    let recs = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}\nstdout:\n{out}")))
        .collect();
    (recs, err)
}

const KEYS: [&str; 22] = [
    "op",
    "kv_op",
    "blocks",
    "block_bytes",
    "bytes",
    "contiguous",
    "notify",
    "until",
    "ops",
    "iterations",
    "t_min_us",
    "t_median_us",
    "t_p90_us",
    "t_p99_us",
    "t_max_us",
    "t_local_median_us",
    "GBps",
    "us_per_block",
    "provider",
    "link",
    "qps",
    "checked_every_round",
];

fn check_figures(r: &serde_json::Value) {
    for k in KEYS {
        assert!(r.get(k).is_some(), "no {k:?} in {r}");
    }
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} is not a number in {r}"));
    assert!(f("t_min_us") > 0.0 && f("t_min_us") <= f("t_median_us"), "{r}");
    assert!(
        f("t_median_us") <= f("t_p90_us") && f("t_p90_us") <= f("t_p99_us") && f("t_p99_us") <= f("t_max_us"),
        "{r}"
    );
    let bytes = f("bytes");
    assert_eq!(bytes, f("blocks") * f("block_bytes"));
    assert!((f("GBps") - bytes / f("t_median_us") / 1e3).abs() < 1e-6 * f("GBps").max(1.0), "{r}");
    assert!((f("us_per_block") - f("t_median_us") / f("blocks")).abs() < 1e-6, "{r}");
    assert_eq!(r["op"], "kv");
    assert_eq!(r["provider"], "soft");
}

#[test]
fn shuffled_writes_with_a_notification_checked_every_request() {
    let (recs, err) =
        records(&["--blocks", "16", "--block-size", "4K", "-n", "5", "--warmup", "1", "--check", "--json"]);
    assert_eq!(recs.len(), 1, "{recs:?}");
    let r = &recs[0];
    check_figures(r);
    assert_eq!(
        (r["blocks"].as_u64(), r["block_bytes"].as_u64(), r["iterations"].as_u64()),
        (Some(16), Some(4096), Some(5))
    );
    // Shuffled slots never touch: one operation a block.
    assert_eq!(r["ops"], 16, "{r}");
    assert_eq!(
        (r["kv_op"].as_str(), r["notify"].as_bool(), r["contiguous"].as_bool()),
        (Some("write"), Some(true), Some(false))
    );
    assert_eq!(r["until"], "notification at decode");
    assert_eq!(r["link"], "shm");
    assert_eq!(r["checked_every_round"], true);
    assert!(err.contains("KV-cache transfer") && err.contains("data verified: every request"), "{err}");
}

#[test]
fn contiguous_writes_without_a_notification_coalesce() {
    let (recs, _) =
        records(&["--blocks", "16", "--block-size", "4K", "-n", "3", "--contiguous", "--no-notify", "--json"]);
    let r = &recs[0];
    check_figures(r);
    assert_eq!(r["ops"], 1, "{r}");
    assert_eq!((r["notify"].as_bool(), r["contiguous"].as_bool()), (Some(false), Some(true)));
    assert_eq!(r["until"], "transfer completed");
    assert_eq!(r["t_median_us"], r["t_local_median_us"]);
}

#[test]
fn reads_over_tcp_with_two_qps_are_checked() {
    let (recs, _) = records(&[
        "--blocks",
        "8",
        "--block-size",
        "64K",
        "-n",
        "3",
        "--op",
        "read",
        "--link",
        "tcp",
        "-q",
        "2",
        "--check",
        "--json",
    ]);
    let r = &recs[0];
    check_figures(r);
    assert_eq!((r["kv_op"].as_str(), r["link"].as_str(), r["qps"].as_u64()), (Some("read"), Some("tcp"), Some(2)));
    assert_eq!(r["until"], "transfer completed");
    assert_eq!(r["ops"], 8);
}

#[test]
fn a_sweep_prints_a_table_row_per_shape() {
    let o = kv(&["--blocks", "4", "-n", "2", "--warmup", "0"], &[]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let mut lines = out.lines().skip_while(|l| !l.contains("us/block"));
    assert!(lines.next().is_some(), "no column header:\n{out}");
    let rows: Vec<&str> = lines.take_while(|l| !l.starts_with("---")).collect();
    assert_eq!(rows.len(), 4, "4 block sizes:\n{out}");
    for (row, size) in rows.iter().zip(["4 KiB", "16 KiB", "256 KiB", "1 MiB"]) {
        assert!(row.trim_start().starts_with('4') && row.contains(size), "{row}");
    }
    assert!(out.contains("data verified"), "{out}");
}

#[test]
fn a_damaged_block_fails_the_check() {
    let o = kv(&["--blocks", "4", "--block-size", "4K", "-n", "2", "--json"], &[("RDMA_BENCH_TEST_CORRUPT", "kv")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("DATA VERIFICATION FAILED") && err.contains("block 0"), "{err}");
}

/// A request whose byte count passes 2^64 is refused as too large (it
/// wrapped to 0 and passed the size guard, or panicked in a debug build).
#[test]
fn a_request_past_u64_bytes_is_refused() {
    let o = kv(&["--blocks", "4294967296", "--block-size", "4294967296", "--local"], &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("more than this tool registers"), "{err}");
}
