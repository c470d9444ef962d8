//! rdma_bench given absurd counts, a silent or confused peer, an unwritable
//! output: an error and an exit status, never a panic, an abort or a hang
//! (found by review).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rmacomm_transport::{RdmaMemory, RdmaTransport, TransportConfig};

const BIN: &str = env!("CARGO_BIN_EXE_rdma_bench");

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env("RMACOMM_PROVIDER", "soft").env_remove("RMACOMM_SOFT_LINK");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start rdma_bench");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            panic!("rdma_bench {args:?} did not end");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn absurd_depths_and_shapes_are_refused() {
    // -t u32::MAX reserved 64 GiB up front and aborted.
    let o = run(&["write", "-s", "2", "-n", "10", "-t", "4294967295"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("-t 4294967295: at most 65536 operations in flight"), "{}", stderr(&o));
    // A kv sweep left with no shape panicked ("shapes").
    for args in [["kv", "--blocks", "1000000"], ["kv", "--block-size", "1G"]] {
        let o = run(&args, &[]);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("no shape of the sweep fits"), "{}", stderr(&o));
    }
    let o = run(&["write", "-a", "--min", "4G", "--max", "4G"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("1 B .. 4 GiB - 1"), "{}", stderr(&o));
    // -n 0 ran one iteration, -t 0 ran at depth 1 (the header said 0): both
    // refused, naming the option, as the collectives refuse -n 0.
    for (flag, args) in [("--iters", ["write", "-s", "2", "-n", "0"]), ("--tx-depth", ["write", "-s", "2", "-t", "0"])]
    {
        let o = run(&args, &[]);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(flag) && stderr(&o).contains("'0'"), "{args:?}: {}", stderr(&o));
    }
    // perftest's spelling of --report-gbits.
    let o = run(&["write", "-s", "4K", "-n", "20", "--report_gbits"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("Gb/sec"), "{}", String::from_utf8_lossy(&o.stdout));
}

/// A latency run of u64::MAX iterations reserved its whole vector of round
/// trips first (a capacity overflow panic, or an abort allocating 8 TB):
/// now it runs (until killed).
#[test]
fn a_huge_iteration_count_runs_instead_of_aborting() {
    for args in [["write_lat", "-n", "18446744073709551615"], ["read_lat", "-n", "1000000000000"]] {
        let mut child = Command::new(BIN)
            .args(args)
            .args(["-s", "2"])
            .env("RMACOMM_PROVIDER", "soft")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_secs(2));
        let st = child.try_wait().unwrap();
        let _ = child.kill();
        let mut err = String::new();
        let _ = child.wait();
        let _ = child.stderr.take().unwrap().read_to_string(&mut err);
        assert!(st.is_none(), "{args:?} ended at once ({st:?}): {err}");
    }
}

#[test]
fn an_unwritable_out_json_is_named() {
    if !std::path::Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full on this machine");
        return;
    }
    let o = run(&["write", "-s", "2", "-n", "10", "--out-json", "/dev/full"], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("--out-json: No space left on device"), "{}", stderr(&o));
    assert!(!stderr(&o).contains("bootstrap connection"), "{}", stderr(&o));
}

/// A "server" that accepts and never answers: the client waited forever.
#[test]
fn a_silent_server_is_an_error_within_the_hello_timeout() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let held = std::thread::spawn(move || {
        let c = l.accept();
        std::thread::sleep(Duration::from_secs(3));
        drop(c);
    });
    let peer = format!("127.0.0.1:{port}");
    let o = run(&["write", "-s", "2", "-n", "10", "--client", &peer], &[("RDMA_BENCH_HELLO_TIMEOUT_SECONDS", "1")]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("no answer on the bootstrap connection within 1s"), "{}", stderr(&o));
    held.join().unwrap();
}

/// A server that stops answering once the run is under way (SIGSTOP after
/// the first row): the client's next wait for a reply ends within the reply
/// timeout with an error (it waited forever: same-host writes are copied by
/// the client, so only the next size's refill noticed).
#[test]
fn a_server_silent_mid_run_is_an_error_within_the_reply_timeout() {
    let mut srv = Command::new(BIN)
        .args(["write", "--server", "--port", "0"])
        .env("RMACOMM_PROVIDER", "soft")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(srv.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let port: u16 = line.split("0.0.0.0:").nth(1).unwrap().split(';').next().unwrap().parse().unwrap();
    let mut client = Command::new(BIN)
        .args(["write", "-a", "--min", "4K", "--max", "64K", "-D", "1", "--client", &format!("127.0.0.1:{port}")])
        .env("RMACOMM_PROVIDER", "soft")
        .env("RDMA_BENCH_REPLY_TIMEOUT_SECONDS", "3")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(client.stdout.take().unwrap());
    loop {
        let mut l = String::new();
        assert!(out.read_line(&mut l).unwrap() > 0, "the client ended before its first row");
        if l.trim_start().starts_with("4096") {
            break;
        }
    }
    let pid = rustix::process::Pid::from_raw(srv.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = client.try_wait().unwrap() {
            break Some(st);
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = client.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = srv.kill();
    let _ = srv.wait();
    let mut err = String::new();
    client.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = status.unwrap_or_else(|| panic!("the client still waited for the stopped server after 30 s: {err}"));
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("no answer on the bootstrap connection within 3s"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
}

/// A request the server cannot parse ended it with status 0 and no word;
/// a checksum of more than a half read into the other half.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_request_fails_the_server() {
    bad_request(r#"{"req":"bogus"}"#, "bad bootstrap message (a request)").await;
    bad_request(r#"{"req":"checksum","region":"src","len":8192}"#, "a checksum of 8192 bytes of a 4096 byte half")
        .await;
}

async fn bad_request(request: &str, says: &str) {
    let mut srv = Command::new(BIN)
        .args(["write", "--server", "--port", "0"])
        .env("RMACOMM_PROVIDER", "soft")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(srv.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let port: u16 = line.split("0.0.0.0:").nth(1).unwrap().split(';').next().unwrap().parse().unwrap();
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    let hello = serde_json::json!({"version": 2, "op": "write", "max_bytes": 4096, "qps": 1, "lb": "dqplb",
        "frag_size": 1 << 20, "provider": "soft", "link": "auto", "tx_depth": 64, "busy_poll_us": null});
    writeln!(w, "{hello}").unwrap();
    let mut l = String::new();
    r.read_line(&mut l).unwrap();
    let mut info: serde_json::Value = serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l}"));
    let server_url = info["url"].as_str().unwrap().to_owned();
    let cfg = TransportConfig::default()
        .with_provider(ibverbx::ProviderKind::Soft)
        .with_timeout(Some(Duration::from_secs(20)));
    let t = RdmaTransport::new(cfg).unwrap();
    let mem = RdmaMemory::alloc(8192).unwrap();
    info["url"] = serde_json::Value::String(t.bind().unwrap());
    info["buf"] = serde_json::to_value(mem.remote_buffer()).unwrap();
    writeln!(w, "{info}").unwrap();
    t.connect(&server_url).await.unwrap();
    writeln!(w, "{request}").unwrap();
    let mut reply = String::new();
    r.get_mut().set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let _ = r.read_line(&mut reply);
    let st = srv.wait().unwrap();
    let mut err = String::new();
    srv.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(!st.success(), "{request}: {st}, reply {reply:?}, stderr {err:?}");
    assert!(err.contains(says), "{request}: {err}");
    assert!(reply.contains(says), "{request}: {reply}");
}
