//! Groups of real processes started by rmacomm-run: barrier, exchange and
//! split with 2, 3 and 4 ranks, host locality, a mismatched split.

use std::process::{Command, Output};

fn run(nproc: usize, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rmacomm-run"))
        .args(["--nproc-per-node", &nproc.to_string(), env!("CARGO_BIN_EXE_group-scenario")])
        .args(args)
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env("RMACOMM_TIMEOUT_SECONDS", "60")
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

#[test]
fn barrier_exchange_and_split_with_2_3_and_4_ranks() {
    for n in [2, 3, 4] {
        assert_every_rank_ok(n, &run(n, &["group"]));
    }
}

#[test]
fn same_host_follows_host_ids() {
    for n in [3, 4] {
        assert_every_rank_ok(n, &run(n, &["hosts"]));
    }
}

#[test]
fn a_mismatched_split_list_is_an_error_on_every_rank() {
    for n in [2, 3] {
        let out = run(n, &["mismatch-split"]);
        let stdout = assert_every_rank_ok(n, &out);
        for r in 0..n {
            let line = stdout
                .lines()
                .find(|l| l.starts_with(&format!("[{r}] mismatch detected")))
                .unwrap_or_else(|| panic!("rank {r}: {stdout}"));
            assert!(line.contains("ranks disagree") && line.contains("rank [0]"), "{line}");
        }
    }
}
