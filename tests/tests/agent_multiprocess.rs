//! The transfer agent between real processes: two prefill processes
//! writing scattered KV blocks concurrently into one decode process (same
//! host over shared memory, tcp forced, and two network namespaces), reads
//! back, and a decode process killed under a stream of requests.

use std::time::Duration;

use rmacomm_tests::harness::{NetnsPair, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_agent_peer");

fn soft(link: &str) -> Vec<(&'static str, String)> {
    vec![("RMACOMM_PROVIDER", "soft".into()), ("RMACOMM_SOFT_LINK", link.into())]
}

fn env_refs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// Runs one decode and `prefills` prefill processes (`shape`: requests,
/// blocks, block size), decode behind `prefix_d` and the prefills behind
/// `prefix_p`; checks that decode verified every request of every prefill
/// exactly once and that every prefill read its blocks back. Returns
/// decode's final line and the prefills' final lines.
fn kv(
    prefix_d: &[String],
    prefix_p: &[String],
    env: &[(&'static str, String)],
    prefills: usize,
    shape: (usize, usize, usize),
) -> (serde_json::Value, Vec<serde_json::Value>) {
    let (requests, blocks, size) = shape;
    let (r, b, s, n) = (requests.to_string(), blocks.to_string(), size.to_string(), prefills.to_string());
    let env = env_refs(env);
    let common = ["--requests", r.as_str(), "--blocks", b.as_str(), "--block-size", s.as_str()];
    let decode = Peer::spawn("decode", PEER, prefix_d, &[&["decode", "--prefills", &n][..], &common].concat(), &env);
    let hello = decode.line(Duration::from_secs(30));
    assert!(hello.contains("\"meta\""), "{hello}");
    let ids: Vec<String> = (0..prefills).map(|i| i.to_string()).collect();
    let ps: Vec<Peer> = ids
        .iter()
        .map(|id| {
            let mut p = Peer::spawn("prefill", PEER, prefix_p, &[&["prefill", "--id", id][..], &common].concat(), &env);
            p.send(&hello);
            p
        })
        .collect();
    let outs: Vec<(Vec<String>, bool)> = ps.into_iter().map(|p| p.finish(Duration::from_secs(180))).collect();
    let (out, ok) = decode.finish(Duration::from_secs(60));
    assert!(ok && outs.iter().all(|(_, ok)| *ok), "decode: {out:?}\nprefills: {outs:?}");
    let finals: Vec<serde_json::Value> =
        outs.iter().map(|(o, _)| serde_json::from_str(o.last().expect("a final line")).unwrap()).collect();
    let mut verified: Vec<(u64, u64)> = out
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let t = v.get("verified")?;
            Some((t["prefill"].as_u64()?, t["request"].as_u64()?))
        })
        .collect();
    verified.sort_unstable();
    let want: Vec<(u64, u64)> = (0..prefills as u64).flat_map(|p| (0..requests as u64).map(move |r| (p, r))).collect();
    assert_eq!(verified, want, "decode verified each request of each prefill once: {out:?}");
    let last: serde_json::Value = serde_json::from_str(out.last().unwrap()).unwrap();
    assert_eq!(last["ok"], true, "{last}");
    assert_eq!(last["received"], (prefills * (requests + 1)) as u64, "requests + one done each: {last}");
    assert_eq!(last["connections"], prefills as u64, "one connection per prefill: {last}");
    for f in &finals {
        assert_eq!(f["ok"], true, "{f}");
        assert_eq!(f["pieces"], (2 * requests * blocks) as u64, "{f}");
        assert_eq!(f["sent"], (requests + 1) as u64, "{f}");
    }
    eprintln!("decode: {last}\nprefills: {finals:?}");
    (last, finals)
}

fn same_host(last: &serde_json::Value, prefills: usize) -> Vec<bool> {
    (0..prefills).map(|i| last["same_host"][format!("prefill-{i}")].as_bool().expect("reported")).collect()
}

/// Two prefills, 4 concurrent requests each of 64 scattered 16 KiB blocks,
/// into one decode on this host: the shared-memory path.
#[test]
fn two_prefills_into_one_decode_shm() {
    let (last, _) = kv(&[], &[], &soft("auto"), 2, (4, 64, 16 << 10));
    assert_eq!(same_host(&last, 2), [true, true]);
}

/// The same with four QPs per connection, DQPLB or spray striping, and the
/// soft provider's seeded chaos (random stalls before each operation of each
/// QP): fragments of a request land out of order, and decode still finds
/// every byte of a request in place when its notification arrives.
fn four_qps(lb: &str) {
    for seed in ["1", "7"] {
        let mut env = soft("auto");
        env.extend([("AGENT_PEER_QPS", "4".into()), ("AGENT_PEER_LB", lb.into()), ("RMACOMM_SOFT_CHAOS", seed.into())]);
        kv(&[], &[], &env, 2, (3, 32, 200_000));
    }
}

#[test]
fn two_prefills_into_one_decode_shm_four_qps_dqplb_chaos() {
    four_qps("dqplb");
}

#[test]
fn two_prefills_into_one_decode_shm_four_qps_spray_chaos() {
    four_qps("spray");
}

/// The same over TCP (forced on one host).
#[test]
fn two_prefills_into_one_decode_tcp() {
    let (last, _) = kv(&[], &[], &soft("tcp"), 2, (4, 64, 16 << 10));
    assert_eq!(same_host(&last, 2), [false, false]);
}

/// Decode in one network namespace, both prefills in another: the
/// handshake listener and the transport reach across the veth pair.
#[test]
fn two_prefills_into_one_decode_two_network_namespaces() {
    let ns = match NetnsPair::create() {
        Ok(ns) => ns,
        Err(why) => return println!("skipped: two network namespaces need root and iproute2 ({why})"),
    };
    let (last, _) = kv(&NetnsPair::prefix(&ns.a), &NetnsPair::prefix(&ns.b), &soft("auto"), 2, (4, 16, 1 << 20));
    assert_eq!(same_host(&last, 2), [false, false]);
}

/// A decode process and a prefill streaming requests into it (three in
/// flight), once the prefill says it is streaming.
fn start_stream(env: &[(&'static str, String)], prefix_d: &[String], prefix_p: &[String]) -> (Peer, Peer) {
    let env = env_refs(env);
    // 4 MiB blocks: above the soft provider's inline-copy limit (1 MiB), so
    // that requests stay in flight while the provider copies them.
    let shape = ["--requests", "1", "--blocks", "16", "--block-size", "4194304"];
    let decode =
        Peer::spawn("decode", PEER, prefix_d, &[&["decode", "--prefills", "1", "--hold"][..], &shape].concat(), &env);
    let hello = decode.line(Duration::from_secs(30));
    let mut p =
        Peer::spawn("prefill", PEER, prefix_p, &[&["prefill", "--id", "0", "--stream"][..], &shape].concat(), &env);
    p.send(&hello);
    assert!(p.line(Duration::from_secs(60)).contains("streaming"));
    std::thread::sleep(Duration::from_millis(200));
    (decode, p)
}

/// Decode killed under a stream of requests (three in flight): the
/// prefill's transfer fails naming "decode", and the next one fails at once
/// (nothing listens).
fn decode_killed(link: &str, prefix_d: &[String], prefix_p: &[String]) {
    let (mut decode, p) = start_stream(&soft(link), prefix_d, prefix_p);
    decode.child.kill().unwrap();
    let (failed, again) = outcome(p);
    // Mid-request, as a rule: "lost mid-transfer". On a loaded machine the
    // kill can land between two requests, when the next one finds the
    // connection closed and nobody listening: "cannot connect". Both name
    // the peer.
    assert!(failed.contains("\"decode\""), "{failed}");
    assert!(failed.contains("lost mid-transfer") || failed.contains("cannot connect"), "{failed}");
    eprintln!("killed decode: {failed}");
    let a = again["again"].as_str().unwrap_or_else(|| panic!("the next transfer succeeded: {again}"));
    assert!(a.contains("cannot connect to peer \"decode\""), "{a}");
    assert!(again["again_secs"].as_f64().unwrap() < 10.0, "{again}");
}

/// The streaming prefill's failure (which must name decode) and its
/// `again` line.
fn outcome(p: Peer) -> (String, serde_json::Value) {
    let (out, ok) = p.finish(Duration::from_secs(60));
    assert!(ok, "{out:?}");
    let line = |key: &str| -> serde_json::Value {
        let l = out.iter().find(|l| l.contains(key)).unwrap_or_else(|| panic!("no {key}: {out:?}"));
        serde_json::from_str(l).unwrap()
    };
    let f = line("\"failed\"");
    assert_eq!(f["peer"], "decode", "{f}");
    (f["failed"].as_str().unwrap().to_owned(), line("\"again\""))
}

/// Decode stopped (SIGSTOP: alive, silent, nothing closes) under a stream
/// of requests over tcp: the transfer fails within the 3 s timeout (plus
/// slack), naming "decode"; so does the next, reconnecting.
#[test]
fn decode_stopped_mid_request_tcp() {
    let mut env = soft("tcp");
    env.push(("AGENT_PEER_TIMEOUT_S", "3".into()));
    let (decode, p) = start_stream(&env, &[], &[]);
    let pid = decode.child.id().to_string();
    std::process::Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    let t0 = std::time::Instant::now();
    let first: serde_json::Value = serde_json::from_str(&p.line(Duration::from_secs(30))).unwrap();
    let took = t0.elapsed();
    let (out, ok) = p.finish(Duration::from_secs(60));
    std::process::Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    assert!(ok, "{out:?}");
    assert_eq!(first["peer"], "decode", "{first}");
    let failed = first["failed"].as_str().unwrap_or_else(|| panic!("{first}"));
    let again: serde_json::Value = serde_json::from_str(out.last().unwrap()).unwrap();
    // Over tcp the soft provider may give up first (its retry timeout).
    assert!(failed.contains("timed out after 3s") || failed.contains("lost mid-transfer"), "{failed}");
    assert!(took < Duration::from_secs(8), "found after {took:?}: {failed}");
    // Reconnecting: the stopped process's kernel accepts the handshake's
    // TCP connection, nobody answers: the connection timeout.
    let a = again["again"].as_str().unwrap_or_else(|| panic!("the next transfer succeeded: {again}"));
    assert!(a.contains("\"decode\""), "{a}");
    eprintln!("stopped decode, after {took:?}: {failed} (then: {a})");
}

#[test]
fn decode_killed_mid_request_shm() {
    decode_killed("auto", &[], &[]);
}

#[test]
fn decode_killed_mid_request_tcp() {
    decode_killed("tcp", &[], &[]);
}

#[test]
fn decode_killed_mid_request_two_network_namespaces() {
    let ns = match NetnsPair::create() {
        Ok(ns) => ns,
        Err(why) => return println!("skipped: two network namespaces need root and iproute2 ({why})"),
    };
    decode_killed("auto", &NetnsPair::prefix(&ns.a), &NetnsPair::prefix(&ns.b));
}
