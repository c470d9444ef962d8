//! TcpStore and its server against real sockets and processes: garbage
//! frames, reconnection, several processes, the host's linger, a host
//! without IPv6, replies too large to build, a host that stopped reading.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use rmacomm_window::{Error, Store, TcpStore, TcpStoreServer};

const T: Duration = Duration::from_secs(10);

/// Sends `bytes` on a raw connection and checks that the server closes it.
fn assert_closed_after(port: u16, bytes: &[u8]) {
    let mut raw = TcpStream::connect(("127.0.0.1", port)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    raw.write_all(bytes).unwrap();
    let mut buf = [0u8; 64];
    // Either a clean close or a reset; never a reply to garbage, never a hang.
    match raw.read(&mut buf) {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("server replied {n} bytes to garbage {:?}", &bytes[..bytes.len().min(16)]),
    }
}

fn assert_serving(client: &TcpStore, round: u32) {
    client.set("alive", &round.to_le_bytes()).unwrap();
    assert_eq!(client.get("alive", T).unwrap(), round.to_le_bytes());
}

#[test]
fn garbage_closes_that_client_and_the_server_keeps_serving() {
    let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().port();
    let good = TcpStore::connect("127.0.0.1", port, T).unwrap();
    assert_serving(&good, 0);

    let mut cases: Vec<Vec<u8>> = vec![
        u32::MAX.to_le_bytes().to_vec(),                            // oversized length
        (65u32 << 20).to_le_bytes().to_vec(),                       // just over the limit
        0u32.to_le_bytes().to_vec(),                                // empty frame
        [1u32.to_le_bytes().as_slice(), &[0xEE]].concat(),          // unknown opcode
        [5u32.to_le_bytes().as_slice(), &[2, 9, 0, 0, 0]].concat(), // key longer than its frame
        [7u32.to_le_bytes().as_slice(), &[2, 2, 0, 0, 0, 0xff, 0xfe]].concat(), // key not UTF-8
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),              // a stray HTTP client
    ];
    // Random bytes (deterministic).
    let mut x = 0x2545F4914F6CDD1Du64;
    for len in [1usize, 3, 17, 100, 1000, 5000] {
        cases.push(
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect(),
        );
    }
    for (i, case) in cases.iter().enumerate() {
        // Random bytes may announce a long frame and then wait: shut our side to end it.
        let mut raw = TcpStream::connect(("127.0.0.1", port)).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        raw.write_all(case).unwrap();
        raw.shutdown(Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        let _ = raw.read_to_end(&mut rest);
        // Whatever it answered, it did not answer garbage with data it should not have;
        // the good client still works.
        assert_serving(&good, i as u32 + 1);
    }
    // These are refused from the header alone, without waiting for more bytes.
    assert_closed_after(port, &u32::MAX.to_le_bytes());
    assert_closed_after(port, &[1, 0, 0, 0, 0xEE]);

    // A truncated frame left hanging does not block anyone else.
    let mut stalled = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stalled.write_all(&[100, 0, 0, 0, 1, 2, 3]).unwrap();
    assert_serving(&good, 100);
    let other = TcpStore::connect("127.0.0.1", port, T).unwrap();
    assert_serving(&other, 101);
    drop(stalled);
    assert_serving(&good, 102);
}

#[test]
fn a_client_started_before_the_server_connects_once_it_is_up() {
    // Find a free port, then let the server take it a little later.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let host = thread::spawn(move || {
        thread::sleep(Duration::from_millis(300));
        let host = TcpStore::new("127.0.0.1", port, Some(2), true, T).unwrap();
        host.set("hello", b"from the host").unwrap();
        host.wait(&["bye"], T).unwrap();
        // Dropping the host waits for the client to hang up.
    });
    let start = Instant::now();
    let client = TcpStore::new("127.0.0.1", port, Some(2), false, T).unwrap();
    assert!(start.elapsed() >= Duration::from_millis(250));
    assert_eq!(client.get("hello", T).unwrap(), b"from the host");
    client.set("bye", b"").unwrap();
    drop(client);
    host.join().unwrap();
}

#[test]
fn connect_gives_up_after_its_timeout_with_a_clear_error() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let start = Instant::now();
    match TcpStore::connect("127.0.0.1", port, Duration::from_millis(500)) {
        Err(e @ Error::Connect { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&format!("127.0.0.1:{port}")) && msg.contains("MASTER_ADDR"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(450) && took < Duration::from_secs(3), "{took:?}");
}

#[test]
fn a_client_reports_a_dead_server_and_reconnects_to_a_new_one() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut server = TcpStoreServer::bind(("127.0.0.1", port)).unwrap();
    let client = TcpStore::connect("127.0.0.1", port, Duration::from_secs(3)).unwrap();
    client.set("k", b"v").unwrap();
    // A waiter is woken when the server goes away.
    let c = Arc::new(client);
    let waiter = {
        let c = c.clone();
        thread::spawn(move || c.wait(&["never"], T))
    };
    thread::sleep(Duration::from_millis(100));
    server.shutdown();
    assert!(matches!(waiter.join().unwrap(), Err(Error::Disconnected { .. })));
    assert!(matches!(c.try_get("k"), Err(Error::Connect { .. } | Error::Disconnected { .. })));
    let _server = TcpStoreServer::bind(("127.0.0.1", port)).unwrap();
    assert_eq!(c.try_get("k").unwrap(), None, "reconnected to the new, empty server");
}

#[test]
fn many_threads_share_one_client() {
    let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
    let client = Arc::new(TcpStore::connect("127.0.0.1", server.local_addr().port(), T).unwrap());
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let c = client.clone();
            thread::spawn(move || {
                for j in 0..50 {
                    c.set(&format!("t{i}/{j}"), &[i, j]).unwrap();
                    assert_eq!(c.get(&format!("t{i}/{j}"), T).unwrap(), [i, j]);
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    let keys: Vec<String> = (0..8).flat_map(|i| (0..50).map(move |j| format!("t{i}/{j}"))).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let start = Instant::now();
    let values = client.multi_get(&refs, T).unwrap();
    assert_eq!(values.len(), 400);
    assert!(start.elapsed() < Duration::from_secs(1), "400 keys in one round trip");
}

fn run(nproc: usize, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_rmacomm-run"))
        .args(["--nproc-per-node", &nproc.to_string(), "--", env!("CARGO_BIN_EXE_group-scenario")])
        .args(args)
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .output()
        .unwrap()
}

#[test]
fn store_semantics_across_processes() {
    for n in [2, 3, 4] {
        let out = run(n, &["store-tcp"]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{n} ranks: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        for r in 0..n {
            assert!(stdout.contains(&format!("[{r}] rank {r} ok")), "{stdout}");
        }
    }
}

#[test]
fn a_taken_port_is_a_clear_error_for_the_host() {
    let taken = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    match TcpStore::new("127.0.0.1", port, Some(2), true, T) {
        Err(e @ Error::Listen { .. }) => assert!(e.to_string().contains("MASTER_PORT"), "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_connection_that_never_sent_a_request_does_not_hold_the_hosts_exit() {
    // A probe that sent a TLS ClientHello's first bytes (a length of ~33 MB)
    // and waits: the host's drop lingered the whole 30 s for it, as for a
    // rank still connected. A real client still is waited for.
    let host = TcpStore::new("127.0.0.1", 0, Some(2), true, T).unwrap();
    let port = host.port();
    let mut probe = TcpStream::connect(("127.0.0.1", port)).unwrap();
    probe.write_all(&[0x16, 0x03, 0x01, 0x02]).unwrap();
    let client = TcpStore::connect("127.0.0.1", port, T).unwrap();
    assert_serving(&client, 1);
    let (tx, rx) = mpsc::channel();
    let t0 = Instant::now();
    let dropper = thread::spawn(move || {
        drop(host);
        tx.send(t0.elapsed()).unwrap();
    });
    // The client is still connected: the host waits for it.
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "the host did not wait for its client");
    drop(client);
    let took = rx.recv_timeout(Duration::from_secs(20)).expect("the host waited for the probe");
    dropper.join().unwrap();
    assert!(took < Duration::from_secs(20), "{took:?}");
    drop(probe);
}

#[test]
fn a_second_host_on_this_processs_own_port_joins_the_first() {
    // A second Group::from_env (beside new_comm's) made rank 0 bind the
    // port its own first store holds: "Address already in use ... pick
    // another MASTER_PORT", while the other ranks joined and timed out.
    let first = TcpStore::new("127.0.0.1", 0, Some(1), true, T).unwrap();
    let port = first.port();
    let second = TcpStore::new("127.0.0.1", port, Some(1), true, T).unwrap();
    assert!(!second.is_master(), "the second joins the first as a client");
    second.set("k", b"v").unwrap();
    assert_eq!(first.try_get("k").unwrap().as_deref(), Some(&b"v"[..]));
    drop(second);
    // A port held by another process (here: a plain listener) is still an error.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let e = TcpStore::new("127.0.0.1", taken.local_addr().unwrap().port(), Some(1), true, T).unwrap_err();
    assert!(matches!(e, Error::Listen { .. }), "{e}");
}

#[test]
fn a_host_at_a_loopback_address_listens_on_loopback_only() {
    // A one-host job's store (it holds the transport's URLs) listened on
    // every interface, reachable from the network.
    for (host, loopback) in [("127.0.0.1", true), ("::1", true), ("[::1]", true), ("0.0.0.0", false)] {
        let Ok(store) = TcpStore::new(host, 0, Some(1), true, T) else {
            assert!(host.contains(':'), "{host}: only IPv6 may be missing here");
            continue;
        };
        let addr = store.local_addr().unwrap();
        assert_eq!(addr.ip().is_loopback(), loopback, "{host}: {addr}");
        assert!(loopback || addr.ip().is_unspecified(), "{host}: {addr}");
        let client = TcpStore::connect(
            host.trim_start_matches('[').trim_end_matches(']').replace("0.0.0.0", "127.0.0.1").as_str(),
            store.port(),
            T,
        )
        .unwrap();
        client.set("k", b"v").unwrap();
        assert_eq!(store.try_get("k").unwrap().as_deref(), Some(&b"v"[..]));
    }
}

/// Tells a copy of this test binary, started by one of the tests below, which
/// inner part to play (in a network namespace, under a memory limit).
const ROLE: &str = "RMACOMM_STORE_TCP_ROLE";

/// This test binary, running only `test` with `role`, behind `prefix` (e.g. `unshare -rn`).
fn this_test_as(test: &str, role: &str, prefix: &[&str]) -> Command {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match prefix.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]).env(ROLE, role);
    cmd
}

/// Waits for `child` until `limit`, then kills it: a regression must fail the test, not hang it.
fn finish(mut child: Child, limit: Duration) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "the child test process still ran after {limit:?}; killed it. Its output:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    (status, format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn a_host_shuts_down_in_a_network_without_ipv6() {
    const NAME: &str = "a_host_shuts_down_in_a_network_without_ipv6";
    if std::env::var_os(ROLE).is_some() {
        return host_shutdown_without_ipv6();
    }
    // A fresh network namespace (in a user namespace, so root is not needed
    // where unprivileged user namespaces are allowed) has IPv6 to disable
    // without touching the host's network.
    let probe = Command::new("unshare").args(["-rn", "true"]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: cannot make a network namespace with `unshare -rn` ({probe:?})");
        return;
    }
    let child =
        this_test_as(NAME, "netns", &["unshare", "-rn"]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let (status, output) = finish(child, Duration::from_secs(120));
    assert!(status.success(), "in the namespace without IPv6: {status}\n{output}");
}

/// Inside the namespace: IPv6 disabled by sysctl, the host's listener on
/// `[::]` still serves IPv4 clients, and dropping the host must return.
fn host_shutdown_without_ipv6() {
    let up = Command::new("ip").args(["link", "set", "lo", "up"]).output().unwrap();
    assert!(up.status.success(), "ip link set lo up: {}", String::from_utf8_lossy(&up.stderr));
    let ipv6 = std::path::Path::new("/proc/sys/net/ipv6/conf");
    if ipv6.exists() {
        for dev in ["all", "default", "lo"] {
            std::fs::write(ipv6.join(dev).join("disable_ipv6"), "1").unwrap();
        }
    }
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut host = TcpStore::new("127.0.0.1", 0, Some(2), true, T).unwrap();
        host.set_linger(T);
        let port = host.port();
        // The case at hand: loopback IPv6 is gone, so nothing reaches the listener through [::1].
        assert!(TcpStream::connect_timeout(&(std::net::Ipv6Addr::LOCALHOST, port).into(), T).is_err());
        let client = TcpStore::connect("127.0.0.1", port, T).unwrap();
        client.set("k", b"v").unwrap();
        assert_eq!(host.get("k", T).unwrap(), b"v");
        drop(client);
        drop(host);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("dropping the hosting TcpStore did not return: its acceptor was never woken");
}

#[test]
fn a_multi_get_too_large_for_one_reply_is_refused_before_copying() {
    const NAME: &str = "a_multi_get_too_large_for_one_reply_is_refused_before_copying";
    if std::env::var_os(ROLE).is_some() {
        return serve_under_a_memory_limit();
    }
    // The server runs in a child whose address space is capped 1 GiB above
    // what it uses at start: building the reply before checking its size
    // (8 GiB of copies here) aborts it instead of swapping the test machine.
    let mut child = this_test_as(NAME, "server", &[]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest may have started the line with the test's name.
            if let Some((_, p)) = line.split_once("store port ") {
                let _ = tx.send(p.trim().parse::<u16>().unwrap());
            }
        }
    });
    let port = rx.recv_timeout(Duration::from_secs(60)).expect("the server child did not say its port");
    let client = TcpStore::connect("127.0.0.1", port, T).unwrap();
    let big = vec![7u8; 16 << 20];
    client.set("big", &big).unwrap();
    // 512 names of one 16 MiB key: a 6 KB request asking for an 8 GiB reply.
    let keys = vec!["big"; 512];
    match client.multi_get(&keys, T) {
        Err(e @ Error::InvalidArgument { op: "multi_get", .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&(512u64 << 24).to_string()) && msg.contains(&((129u64 << 20).to_string())), "{msg}");
        }
        other => panic!("expected the request to be refused, got {:?}", other.map(|v| v.len())),
    }
    // The same connection and server go on, and a reply that fits still comes.
    assert_serving(&client, 1);
    assert_eq!(client.multi_get(&["big", "alive"], T).unwrap()[0], big);
    drop(child.stdin.take());
    let (status, output) = finish(child, Duration::from_secs(30));
    assert!(status.success(), "server child: {status}\n{output}");
}

/// The server child: serves on a free port until its stdin closes.
fn serve_under_a_memory_limit() {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let vm_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    let cap = (vm_kib << 10) + (1 << 30);
    rustix::process::setrlimit(
        rustix::process::Resource::As,
        rustix::process::Rlimit { current: Some(cap), maximum: Some(cap) },
    )
    .unwrap();
    let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
    println!("store port {}", server.local_addr().port());
    std::io::stdout().flush().unwrap();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}

#[test]
fn a_request_to_a_host_that_stopped_reading_times_out() {
    // A host that accepted and then stopped reading (rank 0 stopped with
    // SIGSTOP, or stuck): 32 MiB overflows the socket buffers on both sides.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let client = TcpStore::connect("127.0.0.1", port, Duration::from_secs(2)).unwrap();
    let (_stalled, _) = listener.accept().unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let start = Instant::now();
        let result = client.set("big", &vec![0u8; 32 << 20]);
        let _ = tx.send((result, start.elapsed()));
    });
    let (result, took) =
        rx.recv_timeout(Duration::from_secs(60)).expect("set blocked writing to a host that never reads");
    match result {
        Err(e @ Error::Disconnected { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("set") && msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
        }
        other => panic!("expected a send timeout, got {other:?}"),
    }
    eprintln!("the send gave up after {took:?}");
}
