//! The soft TCP listener under a flood of idle, unauthenticated connections
//! (as an attacker on the same network could open them), against a target
//! whose descriptor limit is 1024.

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rmacomm_tests::harness::Peer;

const PEER: &str = env!("CARGO_BIN_EXE_soft_peer");
const FLOOD: usize = 10_000;

fn json(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

fn counter(out: &[String], key: &str) -> u64 {
    out.iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v.get(key).and_then(serde_json::Value::as_u64))
        .unwrap_or_else(|| panic!("no {key} in {out:?}"))
}

/// Raises this process's descriptor limit to its hard limit (the flood
/// holds 10,000 sockets); false when that is still too low.
fn raise_nofile() -> bool {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: r is a valid rlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return false;
    }
    r.rlim_cur = r.rlim_max;
    // SAFETY: as above.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) == 0 && r.rlim_cur >= (FLOOD as u64 + 512) }
}

#[test]
fn idle_connection_flood_does_not_lock_out_a_real_peer() {
    if !raise_nofile() {
        eprintln!("SKIP: this process cannot hold {FLOOD} sockets (RLIMIT_NOFILE hard limit too low)");
        return;
    }
    let env = [("RMACOMM_SOFT_LINK", "tcp")];
    let limit = vec!["sh".to_owned(), "-c".to_owned(), "ulimit -n 1024 && exec \"$0\" \"$@\"".to_owned()];
    let mut target = Peer::spawn(
        "target",
        PEER,
        &limit,
        &["target", "--mem", "heap", "--sizes", "4096,65536,1048576", "--wait-eof"],
        &env,
    );
    let th = target.line(Duration::from_secs(30));
    let addr: SocketAddr = json(&th)["endpoint"]["soft"]["tcp"]
        .as_array()
        .and_then(|a| a.iter().filter_map(|v| v.as_str()?.parse::<SocketAddr>().ok()).find(|a| a.ip().is_loopback()))
        .expect("the target listens on the loopback");

    // The flood: another thread opens FLOOD connections as fast as it can,
    // sends nothing and holds every one it got.
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let flood = {
        let (stop, opened) = (stop.clone(), opened.clone());
        std::thread::spawn(move || {
            let mut held = Vec::with_capacity(FLOOD);
            let start = Instant::now();
            while held.len() < FLOOD && !stop.load(Ordering::Relaxed) {
                if let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                    held.push(s);
                    opened.fetch_add(1, Ordering::Relaxed);
                }
            }
            let took = start.elapsed();
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(10));
            }
            (held.len(), took)
        })
    };
    // A real peer connects and writes while the flood is under way.
    while opened.load(Ordering::Relaxed) < FLOOD / 2 && !flood.is_finished() {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut initiator =
        Peer::spawn("initiator", PEER, &[], &["initiator", "--mem", "heap", "--sizes", "4096,65536,1048576"], &env);
    let ih = initiator.line(Duration::from_secs(30));
    let start = Instant::now();
    target.send(&ih);
    initiator.send(&th);
    // The target's next line: the first write verified.
    let first = target.line(Duration::from_secs(30));
    let connected_in = start.elapsed();
    assert!(first.contains("verified"), "{first}");
    let during = opened.load(Ordering::Relaxed);
    let (io, ok_i) = initiator.finish(Duration::from_secs(60));
    // The flood runs to its end (every connection it got still held), then
    // the target reports its descriptors.
    let deadline = Instant::now() + Duration::from_secs(60);
    while opened.load(Ordering::Relaxed) < FLOOD && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(target.line(Duration::from_secs(30)).contains("verified"));
    assert!(target.line(Duration::from_secs(30)).contains("verified"));
    assert!(target.line(Duration::from_secs(30)).contains("done"));
    target.close_stdin();
    let (to, ok_t) = target.finish(Duration::from_secs(30));
    stop.store(true, Ordering::Relaxed);
    let (held, took) = flood.join().unwrap();
    eprintln!(
        "flood: {held} connections opened in {took:?} ({during} when the real peer's first write completed); \
         real peer connected and wrote 4 KiB in {connected_in:?}; target: {} descriptors open, {} handshakes evicted",
        counter(&to, "open_fds"),
        counter(&to, "handshakes_evicted"),
    );
    assert!(ok_i && ok_t, "initiator: {first} {io:?}\ntarget: {to:?}");
    // Unauthenticated connections hold at most the handshake cap of
    // descriptors (plus the target's own few dozen).
    assert!(counter(&to, "open_fds") < 400, "target descriptors not bounded: {to:?}");
    assert!(held >= FLOOD / 2, "the flood itself did not get going ({held} connections)");
    assert!(
        connected_in < Duration::from_secs(2),
        "the real peer needed {connected_in:?} to connect and write during the flood"
    );
}
