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

const JSON_KEYS: [&str; 17] = [
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
