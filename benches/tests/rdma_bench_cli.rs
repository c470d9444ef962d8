//! `rdma_bench` as a user runs it: the built binary with small sizes and
//! iteration counts, both ends in two processes (`--local`), and across two
//! network namespaces (`--server` / `--client`) when root with iproute2;
//! transport, raw virtual QP and window (`put`, `put_lat`, `get`) operations.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rmacomm_tests::harness::NetnsPair;

const BIN: &str = env!("CARGO_BIN_EXE_rdma_bench");

const JSON_KEYS: [&str; 20] = [
    "op",
    "bytes",
    "iterations",
    "bw_peak_MBps",
    "bw_avg_MBps",
    "msg_rate_Mpps",
    "t_min_us",
    "t_max_us",
    "t_typical_us",
    "t_avg_us",
    "t_stdev_us",
    "t_p99_us",
    "t_p999_us",
    "provider",
    "link",
    "qps",
    "lb",
    "device_copies",
    "device_copy_waits",
    "peer_device_bytes",
];

/// Runs the binary (soft provider, whatever the environment says) and
/// collects its output; a run that hangs is killed after two minutes (a
/// guard against hangs, not a timing check).
fn run_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env_remove("RMACOMM_PROVIDER").env_remove("RMACOMM_SOFT_LINK");
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

fn run(args: &[&str]) -> Output {
    run_with(args, &[])
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// Runs and insists on success; returns stdout.
fn ok(args: &[&str]) -> String {
    let o = run(args);
    let (out, err) = text(&o);
    assert!(o.status.success(), "rdma_bench {args:?} failed ({:?})\nstdout:\n{out}\nstderr:\n{err}", o.status);
    out
}

/// The data rows of a table (lines after the column header up to the rule).
fn rows(out: &str, header_word: &str) -> Vec<Vec<String>> {
    let mut lines = out.lines().skip_while(|l| !l.contains(header_word));
    let header = lines.next().unwrap_or_else(|| panic!("no header with {header_word:?} in:\n{out}"));
    assert!(header.contains("#bytes") && header.contains("#iterations"), "{header}");
    lines.take_while(|l| !l.starts_with("---")).map(|l| l.split_whitespace().map(str::to_owned).collect()).collect()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rdma_bench_cli_{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn check_bw_table(out: &str, bytes: &str, iters: &str) {
    assert!(out.contains("BW peak[MB/sec]") && out.contains("MsgRate[Mpps]"), "{out}");
    let r = rows(out, "BW average[MB/sec]");
    assert_eq!(r.len(), 1, "{out}");
    assert_eq!((r[0][0].as_str(), r[0][1].as_str()), (bytes, iters), "{out}");
    let (peak, avg): (f64, f64) = (r[0][2].parse().unwrap(), r[0][3].parse().unwrap());
    assert!(avg > 0.0 && peak >= avg, "{out}");
    assert!(out.contains("data verified"), "{out}");
    assert!(out.contains("Provider        : soft"), "{out}");
}

fn check_lat_table(out: &str, bytes: &str, iters: &str) {
    let r = rows(out, "t_typical[usec]");
    assert_eq!(r.len(), 1, "{out}");
    assert_eq!((r[0][0].as_str(), r[0][1].as_str()), (bytes, iters), "{out}");
    let v: Vec<f64> = r[0][2..].iter().map(|x| x.parse().unwrap()).collect();
    let (min, max, typ, avg, p99, p999) = (v[0], v[1], v[2], v[3], v[5], v[6]);
    assert!(min > 0.0 && min <= typ && typ <= max && min <= avg && avg <= max, "{out}");
    assert!(typ <= p99 && p99 <= p999 && p999 <= max, "{out}");
    assert!(out.contains("99.9% percentile[usec]") && out.contains("data verified"), "{out}");
}

#[test]
fn local_write_and_verbs_write_bandwidth() {
    let out = ok(&["write", "--local", "-s", "64K", "-n", "40"]);
    check_bw_table(&out, "65536", "40");
    assert!(out.contains("through RdmaTransport") && out.contains("Link            : shm"), "{out}");
    let out = ok(&["verbs_write", "-s", "64K", "-n", "40", "--link", "tcp", "-q", "2", "--lb", "spray"]);
    check_bw_table(&out, "65536", "40");
    assert!(out.contains("raw ibverbx::VirtualQp") && out.contains("Link            : tcp"), "{out}");
    assert!(out.contains("Number of qps   : 2") && out.contains("spray"), "{out}");
}

#[test]
fn local_write_and_verbs_write_latency() {
    let out = ok(&["write_lat", "-s", "8", "-n", "30"]);
    check_lat_table(&out, "8", "30");
    assert!(out.contains("half round trip"), "{out}");
    let out = ok(&["verbs_write_lat", "-s", "4K", "-n", "30", "-q", "2"]);
    check_lat_table(&out, "4096", "30");
}

#[test]
fn local_reads_and_bidirectional() {
    check_bw_table(&ok(&["read", "-s", "16K", "-n", "30"]), "16384", "30");
    check_bw_table(&ok(&["verbs_read", "-s", "16K", "-n", "30", "--link", "tcp"]), "16384", "30");
    check_lat_table(&ok(&["read_lat", "-s", "1K", "-n", "30"]), "1024", "30");
    // Both directions: each side does 30, the table reports the sum.
    let out = ok(&["write", "-b", "-s", "32K", "-n", "30"]);
    check_bw_table(&out, "32768", "60");
    assert!(out.contains("(bidirectional)"), "{out}");
    check_bw_table(&ok(&["verbs_write", "-b", "-s", "32K", "-n", "30", "--link", "tcp"]), "32768", "60");
}

#[test]
fn local_window_put_get_and_put_lat() {
    let out = ok(&["put", "--local", "-s", "64K", "-n", "40"]);
    check_bw_table(&out, "65536", "40");
    assert!(out.contains("Put BW Test through the Window") && out.contains("rmacomm_window::Window"), "{out}");
    // The header states the data path the window chose for the peer.
    assert!(out.contains("Window access   : "), "{out}");
    assert!(out.contains("Link            : shm"), "{out}");
    let out = ok(&["get", "-s", "64K", "-n", "40", "--link", "tcp", "-q", "2"]);
    check_bw_table(&out, "65536", "40");
    assert!(out.contains("Get BW Test through the Window") && out.contains("Link            : tcp"), "{out}");
    let out = ok(&["put_lat", "-s", "8", "-n", "30"]);
    check_lat_table(&out, "8", "30");
    assert!(out.contains("Put + Signal Latency Test") && out.contains("half round trip"), "{out}");
    // Both directions: each side does 30, each ends its batches with a
    // signal the other answers.
    let out = ok(&["put", "-b", "-s", "32K", "-n", "30"]);
    check_bw_table(&out, "32768", "60");
    assert!(out.contains("(bidirectional)"), "{out}");
    check_bw_table(&ok(&["get", "-b", "-s", "32K", "-n", "30"]), "32768", "60");
    // A window bandwidth sweep starts at 64 KiB unless --min says otherwise.
    let out = ok(&["put", "-a", "--max", "128K", "-n", "10", "--json"]);
    let sizes: Vec<u64> =
        out.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["bytes"].as_u64().unwrap()).collect();
    assert_eq!(sizes, [65536, 131072], "{out}");
}

#[test]
fn window_json_lines_parse() {
    let out = ok(&["put", "-a", "--min", "4K", "--max", "16K", "-n", "20", "--json"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "stdout must hold only the JSON lines:\n{out}");
    for (l, bytes) in lines.iter().zip([4096, 8192, 16384]) {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut want = JSON_KEYS.to_vec();
        want.sort_unstable();
        assert_eq!(keys, want);
        assert_eq!(
            (v["op"].as_str(), v["bytes"].as_u64(), v["iterations"].as_u64()),
            (Some("put"), Some(bytes), Some(20))
        );
        assert!(v["bw_avg_MBps"].as_f64().unwrap() > 0.0 && v["t_typical_us"].is_null(), "{v}");
    }
    let out = ok(&["get", "-s", "1M", "-n", "10", "--json", "--link", "tcp"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!((v["op"].as_str(), v["link"].as_str()), (Some("get"), Some("tcp")), "{v}");
    assert!(v["bw_avg_MBps"].as_f64().unwrap() > 0.0, "{v}");
    let out = ok(&["put_lat", "-s", "8", "-n", "20", "--json"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!((v["op"].as_str(), v["bytes"].as_u64()), (Some("put_lat"), Some(8)), "{v}");
    assert!(v["bw_avg_MBps"].is_null() && v["t_typical_us"].as_f64().unwrap() > 0.0, "{v}");
}

#[test]
fn window_ops_refuse_bad_options_and_wrong_data() {
    let o = run(&["put_lat", "-b", "-s", "8", "-n", "2"]);
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(text(&o).1.contains("-b/--bidirectional applies to bandwidth tests"), "{:?}", text(&o));
    let o = run(&["put", "-s", "12Q"]);
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(text(&o).1.contains("unknown suffix"), "{:?}", text(&o));
    let o = run(&["get", "-a", "--min", "1M", "--max", "64K"]);
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(text(&o).1.contains("--min must not exceed --max"), "{:?}", text(&o));
    let o = run(&["put", "-q", "0", "-s", "4K", "-n", "2"]);
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(text(&o).1.contains("-q 0"), "{:?}", text(&o));
    let o = run(&["put", "--frobnicate"]);
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(text(&o).1.contains("--frobnicate"), "{:?}", text(&o));
    // What a put left at the server is checked: a wrong checksum fails.
    let o = run_with(&["put", "-s", "4K", "-n", "5"], &[("RDMA_BENCH_TEST_CORRUPT", "always")]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(3), "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.contains("DATA VERIFICATION FAILED"), "{err}");
}

#[test]
fn json_lines_have_the_documented_keys() {
    let file = tmp("sweep.json");
    let f = file.to_str().unwrap();
    let out =
        ok(&["write", "-a", "--min", "4K", "--max", "16K", "-n", "20", "--json", "--link", "tcp", "--out-json", f]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "stdout must hold only the JSON lines:\n{out}");
    let mut sizes = Vec::new();
    for l in &lines {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
        let obj = v.as_object().unwrap();
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut want = JSON_KEYS.to_vec();
        want.sort_unstable();
        assert_eq!(keys, want);
        assert_eq!(
            (v["op"].as_str(), v["provider"].as_str(), v["link"].as_str()),
            (Some("write"), Some("soft"), Some("tcp"))
        );
        assert_eq!((v["qps"].as_u64(), v["lb"].as_str(), v["iterations"].as_u64()), (Some(1), Some("dqplb"), Some(20)));
        assert!(v["bw_avg_MBps"].as_f64().unwrap() > 0.0 && v["msg_rate_Mpps"].as_f64().unwrap() > 0.0);
        assert!(v["t_typical_us"].is_null() && v["t_p999_us"].is_null());
        sizes.push(v["bytes"].as_u64().unwrap());
    }
    assert_eq!(sizes, [4096, 8192, 16384]);
    assert_eq!(std::fs::read_to_string(&file).unwrap().lines().collect::<Vec<_>>(), lines);

    let out = ok(&["verbs_write_lat", "-s", "64", "-n", "20", "--json"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["bw_avg_MBps"].is_null() && v["t_typical_us"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(v["op"], "verbs_write_lat");
}

#[test]
fn plot_writes_an_svg_with_the_series() {
    let svg = tmp("bw.svg");
    let json = tmp("bw.json");
    ok(&[
        "verbs_write",
        "-a",
        "--min",
        "1K",
        "--max",
        "8K",
        "-n",
        "20",
        "--plot",
        svg.to_str().unwrap(),
        "--out-json",
        json.to_str().unwrap(),
    ]);
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.trim_start().starts_with("<svg") && s.trim_end().ends_with("</svg>"), "{s}");
    assert_eq!(s.matches("<svg").count(), s.matches("</svg>").count());
    assert!(s.contains("verbs_write (soft/shm)") && s.contains("Bandwidth"), "series or title missing");
    assert!(s.contains("<polyline") || s.contains("<path"), "no line drawn");

    // `plot` merges runs: a bandwidth and a latency file.
    let lat = tmp("lat.json");
    ok(&["write_lat", "-a", "--min", "8", "--max", "32", "-n", "20", "--out-json", lat.to_str().unwrap()]);
    let both = tmp("both.svg");
    ok(&["plot", "-o", both.to_str().unwrap(), json.to_str().unwrap(), lat.to_str().unwrap()]);
    let s = std::fs::read_to_string(&both).unwrap();
    assert!(s.contains("verbs_write (soft/shm)") && s.contains("write_lat (soft/shm)") && s.contains("Latency"));
}

#[test]
fn verbs_without_a_device_is_a_clear_error() {
    if matches!(ibverbx::devices_of(ibverbx::ProviderKind::Verbs), Ok(d) if !d.is_empty()) {
        println!("skipped: this machine has an RDMA device, so --provider verbs works");
        return;
    }
    let o = run(&["write", "--provider", "verbs", "-s", "8", "-n", "2"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.contains("--provider verbs") && err.contains("--provider soft"), "{err}");
    assert!(!out.contains("#bytes"), "nothing may be measured: {out}");
}

#[test]
fn an_invalid_rmacomm_provider_is_an_error_naming_it() {
    let o = run_with(&["write", "-s", "8", "-n", "2"], &[("RMACOMM_PROVIDER", "foo")]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.contains("RMACOMM_PROVIDER") && err.contains("foo") && err.contains("auto|verbs|soft"), "{err}");
    assert!(!out.contains("#bytes"), "nothing may be measured: {out}");
    // --provider wins over the variable.
    let o = run_with(&["write", "--provider", "soft", "-s", "8", "-n", "2"], &[("RMACOMM_PROVIDER", "foo")]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout:\n{out}\nstderr:\n{err}");
}

#[test]
fn rmacomm_provider_verbs_is_honoured_without_a_flag() {
    if matches!(ibverbx::devices_of(ibverbx::ProviderKind::Verbs), Ok(d) if !d.is_empty()) {
        println!("skipped: this machine has an RDMA device, so RMACOMM_PROVIDER=verbs works");
        return;
    }
    let o = run_with(&["write", "-s", "8", "-n", "2"], &[("RMACOMM_PROVIDER", "verbs")]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "it must not fall back to soft:\nstdout:\n{out}\nstderr:\n{err}");
    // The reason is the verbs provider's: no RDMA device in the kernel, or
    // no libibverbs to ask.
    assert!(err.contains("RMACOMM_PROVIDER=verbs: provider verbs unavailable"), "{err}");
    assert!(!out.contains("#bytes"), "nothing may be measured: {out}");
    // And RMACOMM_PROVIDER=soft runs on soft.
    let o = run_with(&["write", "-s", "8", "-n", "2"], &[("RMACOMM_PROVIDER", "soft")]);
    let (out, err) = text(&o);
    assert!(o.status.success() && out.contains("soft"), "stdout:\n{out}\nstderr:\n{err}");
}

#[test]
fn wrong_data_fails_loudly() {
    // Test hook: the server reports a wrong checksum.
    let o = run_with(&["write", "-s", "4K", "-n", "5"], &[("RDMA_BENCH_TEST_CORRUPT", "always")]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(3), "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.contains("DATA VERIFICATION FAILED"), "{err}");
}

#[test]
fn every_size_is_verified() {
    // One byte of what the 8 KiB writes left at the server is damaged: the
    // sweep must stop there, naming the size, although the 16 KiB and
    // 32 KiB sizes after it would overwrite the damage.
    let o =
        run_with(&["write", "-a", "--min", "4K", "--max", "32K", "-n", "20"], &[("RDMA_BENCH_TEST_CORRUPT", "8192")]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(3), "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.contains("DATA VERIFICATION FAILED: 8192 B messages"), "{err}");
    assert!(!out.contains("16384 "), "the sweep went on after the failed size:\n{out}");
    // Undamaged, the same sweep verifies every size.
    let out = ok(&["write", "-a", "--min", "4K", "--max", "32K", "-n", "20"]);
    assert!(out.contains("after every size, each destination matched its source"), "{out}");
}

#[test]
fn bad_options_are_refused() {
    let o = run(&["write_lat", "-b", "-s", "8", "-n", "2"]);
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(text(&o).1.contains("bidirectional"));
    let o = run(&["write", "-s", "12Q"]);
    assert!(!o.status.success());
    assert!(text(&o).1.contains("unknown suffix"), "{:?}", text(&o));
    let o = run(&["write", "-d", "nosuchdev", "-s", "8", "-n", "2"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("soft0"), "{:?}", text(&o));
}

/// The first IPv4 address of namespace `ns` other than loopback.
fn ns_addr(ns: &str) -> String {
    let o = Command::new("ip").args(["-n", ns, "-o", "-4", "addr", "show"]).output().unwrap();
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .find(|w| w[0] == "inet" && !w[1].starts_with("127."))
        .map(|w| w[1].split('/').next().unwrap().to_owned())
        .expect("an address in the namespace")
}

#[test]
fn server_and_client_in_two_network_namespaces() {
    let ns = match NetnsPair::create() {
        Ok(ns) => ns,
        Err(why) => {
            println!("skipped: cannot create network namespaces ({why})");
            return;
        }
    };
    for op in ["write", "verbs_write_lat", "put", "put_lat"] {
        let mut server = Server(
            Command::new("ip")
                .args(["netns", "exec", &ns.a, BIN, op, "--server", "--port", "0"])
                .env_remove("RMACOMM_SOFT_LINK")
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        );
        let mut line = String::new();
        BufReader::new(server.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
        // "rdma_bench server: listening on 0.0.0.0:PORT; run ..."
        let port: String = line
            .split("0.0.0.0:")
            .nth(1)
            .unwrap_or_else(|| panic!("no port in {line:?}"))
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        let peer = format!("{}:{port}", ns_addr(&ns.a));
        let o = Command::new("ip")
            .args(["netns", "exec", &ns.b, BIN, op, "--client", &peer, "-s", "256K", "-n", "10", "--json"])
            .env_remove("RMACOMM_SOFT_LINK")
            .output()
            .unwrap();
        let (out, err) = text(&o);
        assert!(o.status.success(), "{op}: {out}\n{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
        // auto link between two namespaces: TCP, and the header says why.
        assert_eq!(v["link"], "tcp", "{v}");
        assert!(err.contains("different hosts") && err.contains("data verified"), "{err}");
        assert!(server.0.wait().unwrap().success(), "{op}: the server failed");
    }
}

/// A server process, killed if the test fails before it exits.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

// --- collectives -----------------------------------------------------------

/// The keys of a collective's JSON line.
const COLL_KEYS: [&str; 16] = [
    "op",
    "bytes",
    "count",
    "type",
    "redop",
    "root",
    "algo",
    "ranks",
    "iterations",
    "time_us",
    "time_max_us",
    "algbw_GBps",
    "busbw_GBps",
    "wrong",
    "provider",
    "link",
];

/// The rows of a collective's table: the lines after the column header's
/// two lines, up to the rule.
fn coll_rows(out: &str) -> Vec<Vec<String>> {
    let mut lines = out.lines().skip_while(|l| !(l.starts_with('#') && l.contains("size[B]")));
    let header = lines.next().unwrap_or_else(|| panic!("no column header in:\n{out}"));
    for col in ["size[B]", "count", "type", "redop", "root", "time[us]", "algbw", "busbw", "#wrong"] {
        assert!(header.contains(col), "{col} missing: {header}");
    }
    assert!(lines.next().is_some_and(|u| u.starts_with('#') && u.contains("(GB/s)")), "{out}");
    lines.take_while(|l| !l.starts_with("---")).map(|l| l.split_whitespace().map(str::to_owned).collect()).collect()
}

/// nccl-tests' bus-bandwidth factor.
fn bus_factor(op: &str, n: f64) -> f64 {
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "broadcast" => 1.0,
        _ => (n - 1.0) / n,
    }
}

/// Every collective with two rank processes (`--nproc 2`), a short sweep:
/// the table parses, counts follow nccl-tests, busbw = algbw × the factor,
/// and the check passed (#wrong 0).
#[test]
fn collectives_with_two_ranks_print_nccl_tests_tables_and_pass_the_check() {
    for op in ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"] {
        let out = ok(&[op, "--nproc", "2", "-a", "--min", "4K", "--max", "64K", "-n", "5"]);
        assert!(out.contains(&format!("{op} through rmacomm_collectives::Comm")), "{out}");
        assert!(out.contains("Ranks           : 2 processes") && out.contains("Link: shm"), "{out}");
        let rows = coll_rows(&out);
        let sizes: Vec<u64> = rows.iter().map(|r| r[0].parse().unwrap()).collect();
        assert_eq!(sizes, [4096, 8192, 16384, 32768, 65536], "{out}");
        for r in &rows {
            let (size, count): (u64, u64) = (r[0].parse().unwrap(), r[1].parse().unwrap());
            let per_rank = matches!(op, "all_gather" | "reduce_scatter" | "all_to_all");
            assert_eq!(count, size / 4 / if per_rank { 2 } else { 1 }, "{op}: {r:?}");
            assert_eq!(r[2], "f32");
            assert_eq!(r[3], if matches!(op, "all_reduce" | "reduce_scatter") { "sum" } else { "none" }, "{r:?}");
            assert_eq!(r[4], if op == "broadcast" { "0" } else { "-1" }, "{r:?}");
            let (time, algbw, busbw): (f64, f64, f64) =
                (r[5].parse().unwrap(), r[6].parse().unwrap(), r[7].parse().unwrap());
            assert!(time > 0.0 && algbw > 0.0, "{r:?}");
            assert!((busbw - algbw * bus_factor(op, 2.0)).abs() <= 0.002, "{op}: {r:?}");
            assert_eq!((r[8].as_str(), r[9].as_str()), ("0", "5"), "{r:?}");
        }
        assert!(out.contains("every rank's output matched the reference"), "{out}");
    }
}

/// `--json` lines (and `--out-json`, `--plot`) with other types, ops,
/// algorithms and a root; the window's SEPARATE path over tcp.
#[test]
fn collective_json_lines_parse_with_types_ops_algorithms_and_roots() {
    let file = tmp("coll.json");
    let svg = tmp("coll.svg");
    let (f, p) = (file.to_str().unwrap(), svg.to_str().unwrap());
    let json = |args: &[&str]| -> Vec<serde_json::Value> {
        ok(args).lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect()
    };
    let lines =
        json(&["all_reduce", "-a", "--min", "1K", "--max", "4K", "-n", "4", "--json", "--out-json", f, "--plot", p]);
    assert_eq!(lines.len(), 3);
    for (v, bytes) in lines.iter().zip([1024, 2048, 4096]) {
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut want = COLL_KEYS.to_vec();
        want.sort_unstable();
        assert_eq!(keys, want, "{v}");
        assert_eq!(
            (v["op"].as_str(), v["bytes"].as_u64(), v["count"].as_u64()),
            (Some("all_reduce"), Some(bytes), Some(bytes / 4))
        );
        assert_eq!((v["type"].as_str(), v["redop"].as_str(), v["ranks"].as_u64()), (Some("f32"), Some("sum"), Some(2)));
        assert!(v["root"].is_null() && v["algo"].is_null(), "{v}");
        assert_eq!(
            (v["wrong"].as_u64(), v["iterations"].as_u64(), v["provider"].as_str()),
            (Some(0), Some(4), Some("soft"))
        );
        let (t, tmax) = (v["time_us"].as_f64().unwrap(), v["time_max_us"].as_f64().unwrap());
        assert!(t > 0.0 && tmax >= t, "{v}");
    }
    let written: Vec<String> = std::fs::read_to_string(&file).unwrap().lines().map(str::to_owned).collect();
    assert_eq!(written.len(), 3);
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.contains("all_reduce rmacomm soft/shm (2 ranks, f32)") && s.contains("Time per call"), "{s}");
    // `plot` reads collective records back.
    let again = tmp("again.svg");
    ok(&["plot", "-o", again.to_str().unwrap(), f]);
    assert!(std::fs::read_to_string(&again).unwrap().contains("Bus bandwidth"));

    for algo in ["oneshot", "direct", "ring"] {
        let v =
            &json(&["all_reduce", "-s", "256K", "-n", "3", "--algo", algo, "--dtype", "bf16", "--op", "max", "--json"])
                [0];
        assert_eq!(
            (v["algo"].as_str(), v["type"].as_str(), v["redop"].as_str()),
            (Some(algo), Some("bf16"), Some("max"))
        );
        assert_eq!((v["count"].as_u64(), v["wrong"].as_u64()), (Some(131072), Some(0)), "{v}");
    }
    let v = &json(&["all_reduce", "-s", "4K", "-n", "3", "--dtype", "f64", "--op", "premul_sum:2.5", "--json"])[0];
    assert_eq!((v["redop"].as_str(), v["wrong"].as_u64()), (Some("premul_sum:2.5"), Some(0)), "{v}");
    let v = &json(&["reduce_scatter", "-s", "64K", "-n", "3", "--dtype", "i8", "--op", "prod", "--json"])[0];
    assert_eq!((v["type"].as_str(), v["count"].as_u64(), v["wrong"].as_u64()), (Some("i8"), Some(32768), Some(0)));
    let v = &json(&["broadcast", "-s", "100K", "-n", "3", "--root", "1", "--json"])[0];
    assert_eq!((v["root"].as_u64(), v["redop"].as_str(), v["wrong"].as_u64()), (Some(1), None, Some(0)), "{v}");
    // Bound to one core each (Open MPI's --bind-to core), and the header says where.
    let o = run(&["all_gather", "-s", "64K", "-n", "3", "--bind-to", "core", "--json"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains("Binding         : core: rank r on CPU "), "{err}");
    assert!(serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()["wrong"] == 0, "{out}");
    // -c 0: not checked, and the record says so.
    let v = &json(&["all_to_all", "-s", "8K", "-n", "3", "-c", "0", "--json"])[0];
    assert!(v["wrong"].is_null(), "{v}");
    // Over the soft provider's TCP: every pair SEPARATE.
    let o = run(&["all_gather", "-s", "64K", "-n", "3", "--link", "tcp", "--json"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!((v["link"].as_str(), v["wrong"].as_u64()), (Some("tcp"), Some(0)), "{v}");
    assert!(err.contains("Window path     : SEPARATE"), "{err}");
}

/// Three ranks started by hand with torchrun's variables, as a launcher
/// (`rmacomm-run --nproc-per-node 3`, torchrun) would: each process is one
/// rank, rank 0 prints.
#[test]
fn collectives_under_a_launchers_variables() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let children: Vec<_> = (0..3)
        .map(|r| {
            Command::new(BIN)
                .args(["all_to_all", "-a", "--min", "4K", "--max", "16K", "-n", "4", "--json"])
                .env_remove("RMACOMM_PROVIDER")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "3")
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", "3")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // (A rank whose peers died fails by itself within the run's timeout.)
    let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    for (r, o) in outs.iter().enumerate() {
        let (out, err) = text(o);
        assert!(o.status.success(), "rank {r}: {out}\n{err}");
        if r > 0 {
            assert!(out.is_empty(), "only rank 0 prints: rank {r} said {out}");
        }
    }
    let (out, err) = text(&outs[0]);
    assert!(err.contains("3 processes (a launcher's RANK/WORLD_SIZE)"), "{err}");
    // 3 ranks of f32: sizes rounded down to 12-byte granules.
    let sizes: Vec<u64> = out
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            assert_eq!((v["ranks"].as_u64(), v["wrong"].as_u64()), (Some(3), Some(0)), "{v}");
            assert_eq!(v["count"].as_u64().unwrap() * 12, v["bytes"].as_u64().unwrap(), "{v}");
            v["bytes"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(sizes, [4092, 8184, 16380], "{out}");
}

/// With no `-s`, the default 1 MiB is rounded down to whole elements per
/// rank as the sweep's sizes are (3 ranks × 4 B: 1 MiB was refused by the
/// first all_gather, exit 1).
#[test]
fn the_default_size_fits_any_rank_count() {
    for coll in ["all_gather", "reduce_scatter", "all_to_all"] {
        let out = ok(&[coll, "--nproc", "3", "-n", "2", "--json"]);
        let v: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
        assert_eq!((v["bytes"].as_u64(), v["wrong"].as_u64()), (Some(1048572), Some(0)), "{coll}: {v}");
    }
}

/// Options that cannot work are refused before anything runs, naming the
/// option (exit 2).
#[test]
fn collective_bad_arguments_are_clear_errors() {
    let refused = |args: &[&str], says: &str| {
        let o = run(args);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: stdout:\n{out}\nstderr:\n{err}");
        assert!(err.contains(says), "{args:?}: wanted {says:?} in:\n{err}");
        assert!(!out.contains("size[B]"), "{args:?}: nothing may be measured:\n{out}");
    };
    refused(&["all_gather", "--op", "max"], "all_gather does not reduce");
    refused(&["all_reduce", "--op", "median"], "expected sum, prod, min, max, avg");
    refused(&["all_reduce", "--op", "premul_sum"], "premul_sum needs its factor");
    refused(&["all_reduce", "--op", "band"], "--op band with --dtype f32");
    refused(&["all_reduce", "--dtype", "f128"], "expected f32, f64");
    refused(&["all_reduce", "--algo", "tree"], "possible values: oneshot, direct, ring");
    refused(&["broadcast", "--algo", "ring"], "--algo applies to all_reduce only");
    refused(&["all_to_all", "--root", "1"], "--root applies to broadcast");
    refused(&["broadcast", "--root", "2", "--nproc", "2"], "--root 2: not a rank of this run of 2");
    refused(&["all_gather", "-s", "12", "--nproc", "2"], "needs a multiple of 8 B");
    refused(&["all_reduce", "-s", "6"], "needs a multiple of 4 B");
    refused(&["all_reduce", "--nproc", "0"], "--nproc 0");
    refused(&["all_reduce", "-n", "0"], "-n 0");
    refused(&["all_reduce", "-a", "--min", "1M", "--max", "4K"], "--min 1048576 must not exceed --max 4096");
    // No power of two between them: nothing to sweep (every rank panicked).
    refused(&["all_reduce", "-a", "--min", "5", "--max", "7"], "no size to sweep");
    refused(&["all_reduce", "-c", "2"], "-c");
    refused(&["all_reduce", "-s", "4K", "--provider", "verbs"], "--provider verbs");
}

/// One damaged element of one rank's result fails the run loudly (exit
/// 3), at that size: the sweep stops there.
#[test]
fn a_wrong_collective_result_fails_loudly() {
    for op in ["all_reduce", "all_gather", "broadcast"] {
        let o = run_with(&[op, "-a", "--min", "4K", "--max", "32K", "-n", "3"], &[("RDMA_BENCH_TEST_CORRUPT", "8192")]);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(3), "{op}: stdout:\n{out}\nstderr:\n{err}");
        assert!(err.contains("DATA VERIFICATION FAILED") && err.contains("of 8 KiB"), "{op}: {err}");
        assert!(err.contains("rank 1:") && err.contains("1 wrong elements"), "{op}: {err}");
        let rows = coll_rows(&out);
        assert_eq!(rows.last().map(|r| (r[0].as_str(), r[8].as_str())), Some(("8192", "1")), "{op}:\n{out}");
        assert!(!out.contains("16384 "), "{op}: the sweep went on:\n{out}");
    }
}

/// `--use-cuda`: both sides' buffers in (stand-in) device memory, data
/// verified, the header saying so; the raw and window tests refuse it;
/// without a driver, the error names it.
#[test]
fn use_cuda_moves_device_memory() {
    let Some(lib) = rmacomm_cuda::standin_for_tests() else { return };
    let lib = lib.to_string_lossy().into_owned();
    let env = [("RMACOMM_CUDA_LIB", lib.as_str())];
    for (op, link) in [("write", "auto"), ("read", "tcp"), ("write_lat", "tcp")] {
        let o = run_with(&[op, "--local", "-s", "1M", "-n", "20", "--link", link, "--use-cuda", "0"], &env);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{op}: {out}\n{err}");
        assert!(out.contains("Memory          : this side's buffer in CUDA device 0"), "{out}");
        assert!(out.contains("data verified"), "{out}");
    }
    // Same host, device to device: the engine batches the copies of the
    // messages in flight, though each writes the same bytes as the one
    // before (when it did not, it waited for the device once per message).
    for op in ["write", "read"] {
        let o = run_with(&[op, "--local", "-s", "256K", "-n", "64", "--json", "--use-cuda", "0"], &env);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{op}: {out}\n{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
        let (copies, waits) = (v["device_copies"].as_u64().unwrap(), v["device_copy_waits"].as_u64().unwrap());
        assert!(copies >= 64 && waits * 2 <= copies, "{op}: {copies} copies, {waits} waits: {v}");
        assert!(err.contains(&format!("{copies} copies, {waits} waits for the device")), "{err}");
    }
    let o = run_with(&["verbs_write", "-s", "4K", "--use-cuda", "0"], &env);
    let (out, err) = text(&o);
    assert!(!o.status.success() && err.contains("--use-cuda: verbs_write does not take device memory"), "{out}{err}");
    let o = run_with(&["write", "-s", "4K", "--use-cuda", "0"], &[("RMACOMM_CUDA_LIB", "/nonexistent/libcuda.so.1")]);
    let (out, err) = text(&o);
    assert!(!o.status.success() && err.contains("alloc_cuda") && err.contains("libcuda"), "{out}{err}");
}
