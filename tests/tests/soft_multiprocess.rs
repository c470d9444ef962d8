//! The soft provider between real processes: same host (shared memory and
//! TCP) and two network namespaces joined by a veth pair (TCP over a real
//! interface). Every byte is verified by the peers themselves.

use std::time::Duration;

use rmacomm_tests::harness::{introduce, NetnsPair, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_soft_peer");

/// Starts target and initiator, swaps their endpoints, and checks both
/// succeed with every size verified; returns the target's and the
/// initiator's output.
fn run_pair(
    prefix_t: &[String],
    prefix_i: &[String],
    args: &[&str],
    env: &[(&str, &str)],
) -> (Vec<String>, Vec<String>) {
    let t = Peer::spawn("target", PEER, prefix_t, &[&["target"], args].concat(), env);
    let i = Peer::spawn("initiator", PEER, prefix_i, &[&["initiator"], args].concat(), env);
    let (t, i) = introduce(t, i);
    let (ti, ok_i) = i.finish(Duration::from_secs(180));
    let (tt, ok_t) = t.finish(Duration::from_secs(30));
    assert!(ok_i && ok_t, "initiator: {ti:?}\ntarget: {tt:?}");
    let verified = tt.iter().filter(|l| l.contains("verified")).count();
    let expected = args.iter().position(|a| *a == "--sizes").map(|p| args[p + 1].split(',').count()).unwrap_or(7);
    assert_eq!(verified, expected, "target output: {tt:?}");
    assert!(ti.iter().any(|l| l.contains("\"ok\":true")), "{ti:?}");
    (tt, ti)
}

/// The target's soft counter `key`.
fn counter(out: &[String], key: &str) -> u64 {
    out.iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v.get(key).and_then(serde_json::Value::as_u64))
        .unwrap_or_else(|| panic!("no {key} in {out:?}"))
}

#[test]
fn shm_two_processes_shared_segments() {
    let (t, i) = run_pair(&[], &[], &["--mem", "shm"], &[("RMACOMM_SOFT_LINK", "shm")]);
    // The initiator mapped the target's segment (its descriptor came over
    // the target's attach socket) and copied into it directly.
    assert!(counter(&i, "peer_segments_mapped") >= 1, "initiator: {i:?}");
    // Both sides wait asleep on their CQs: the notifications went through
    // the target's doorbell (claimed there, or retracted by the initiator
    // when the target woke too late), and a side rang the other's CQ in the
    // other process (event fds passed over the attach sockets). Which side rings depends on who armed
    // first, so only the sums are certain.
    let used = counter(&t, "doorbell_claimed") + counter(&i, "doorbell_retracted");
    let rings = counter(&t, "doorbell_rings") + counter(&i, "doorbell_rings");
    eprintln!(
        "doorbells: target claimed {} rang {}; initiator retracted {} rang {}",
        counter(&t, "doorbell_claimed"),
        counter(&t, "doorbell_rings"),
        counter(&i, "doorbell_retracted"),
        counter(&i, "doorbell_rings")
    );
    assert!(used > 0 && rings > 0, "target: {t:?}\ninitiator: {i:?}");
}

#[test]
fn shm_two_processes_heap_memory() {
    // Heap regions go by process_vm_writev/readv (or staged if refused).
    run_pair(&[], &[], &["--mem", "heap"], &[("RMACOMM_SOFT_LINK", "shm")]);
}

#[test]
fn tcp_two_processes() {
    run_pair(&[], &[], &["--mem", "heap"], &[("RMACOMM_SOFT_LINK", "tcp")]);
}

#[test]
fn tcp_two_network_namespaces() {
    let ns = match NetnsPair::create() {
        Ok(ns) => ns,
        Err(why) => {
            println!("skipped: two network namespaces need root and iproute2 ({why})");
            return;
        }
    };
    // Different network namespaces are different hosts to the soft
    // provider: auto picks TCP, across the veth pair.
    run_pair(&NetnsPair::prefix(&ns.a), &NetnsPair::prefix(&ns.b), &["--mem", "shm"], &[("RMACOMM_SOFT_LINK", "auto")]);
}

/// A peer killed mid-stream: the survivor's next operations fail with an
/// error completion, never hang.
fn dead_peer(link: &str) {
    let env = [("RMACOMM_SOFT_LINK", link)];
    let t = Peer::spawn("holder", PEER, &[], &["hold", "--sizes", "65536"], &env);
    let i = Peer::spawn("streamer", PEER, &[], &["stream", "--sizes", "65536"], &env);
    let (mut t, i) = introduce(t, i);
    assert!(t.line(Duration::from_secs(30)).contains("ready"));
    assert!(i.line(Duration::from_secs(30)).contains("ready"));
    // The holder never posts receives: WRITE_WITH_IMM waits in RNR, which is
    // fine — what matters is what happens when the holder dies.
    std::thread::sleep(Duration::from_millis(200));
    t.child.kill().unwrap();
    let (out, _) = i.finish(Duration::from_secs(30));
    let failed = out.iter().find(|l| l.contains("failed")).unwrap_or_else(|| panic!("no failure reported: {out:?}"));
    assert!(
        failed.contains("retry") || failed.contains("Flush") || failed.contains("RNR"),
        "unexpected failure: {failed}"
    );
}

#[test]
fn dead_peer_shm() {
    dead_peer("shm");
}

#[test]
fn dead_peer_tcp() {
    dead_peer("tcp");
}

/// An endpoint forged to name a third process (its pid, its key table's
/// descriptor number and uid, its region and key) must not steer our
/// writes into that process: descriptors come only from the process that
/// answers on the peer's socket, and only for that process's registrations.
#[test]
fn forged_endpoint_cannot_reach_a_third_process() {
    let env = [("RMACOMM_SOFT_LINK", "shm")];
    let mut victim = Peer::spawn("victim", PEER, &[], &["victim", "--sizes", "4096"], &env);
    let mut peer = Peer::spawn("peer", PEER, &[], &["hold", "--sizes", "4096"], &env);
    let mut forger = Peer::spawn("forger", PEER, &[], &["forge", "--sizes", "4096"], &env);
    forger.send(&victim.line(Duration::from_secs(30)));
    let f = forger.line(Duration::from_secs(30));
    forger.send(&peer.line(Duration::from_secs(30)));
    peer.send(&f);
    let (fo, ok_f) = forger.finish(Duration::from_secs(60));
    victim.close_stdin();
    let (vo, ok_v) = victim.finish(Duration::from_secs(30));
    assert!(ok_f && ok_v, "forger: {fo:?}\nvictim: {vo:?}");
    assert_eq!(counter(&vo, "victim_bytes_changed"), 0, "the third process was written: forger said {fo:?}");
    let status = fo.iter().find(|l| l.contains("forged_write")).unwrap_or_else(|| panic!("{fo:?}"));
    assert!(!status.contains("\"Success\""), "the forged write claims success: {status}");
    eprintln!("forged endpoint: {status}; victim untouched");
    drop(peer);
}
