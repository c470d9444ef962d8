//! Collectives between two "hosts": two ranks in two network namespaces
//! joined by a veth pair (the soft provider talks TCP, the window pairs are
//! SEPARATE), running every operation of the `all` scenario
//! (`collectives/src/bin/coll-scenario.rs`). Needs root and iproute2;
//! skipped with the reason otherwise.

use std::time::{Duration, Instant};

use rmacomm_tests::harness::{NetnsPair, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_coll_peer");

#[test]
fn all_collectives_between_two_network_namespaces() {
    let ns = match NetnsPair::create() {
        Ok(ns) => ns,
        Err(why) => {
            println!("skipped: two network namespaces need root and iproute2 ({why})");
            return;
        }
    };
    let t0 = Instant::now();
    let port = "29519";
    let peers: Vec<Peer> = [(&ns.a, &ns.dev_a, "0", "rank 0"), (&ns.b, &ns.dev_b, "1", "rank 1")]
        .into_iter()
        .map(|(netns, dev, rank, name)| {
            let ifname = format!("={dev}");
            let env = [
                ("RMACOMM_PROVIDER", "soft"),
                ("RMACOMM_SOFT_LINK", "auto"),
                ("RMACOMM_SOCKET_IFNAME", ifname.as_str()),
                ("RANK", rank),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "0"),
                ("LOCAL_WORLD_SIZE", "1"),
                ("MASTER_ADDR", ns.addr_a.as_str()),
                ("MASTER_PORT", port),
            ];
            Peer::spawn(name, PEER, &NetnsPair::prefix(netns), &["all"], &env)
        })
        .collect();
    let mut it = peers.into_iter();
    let (p0, p1) = (it.next().unwrap(), it.next().unwrap());
    let (l1, ok1) = p1.finish(Duration::from_secs(240));
    let (l0, ok0) = p0.finish(Duration::from_secs(60));
    eprintln!("collectives across two namespaces: {:?}", t0.elapsed());
    for (rank, (lines, ok)) in [(l0, ok0), (l1, ok1)].iter().enumerate() {
        assert!(*ok, "rank {rank} failed (its stderr is above); stdout: {lines:?}");
        assert!(lines.iter().any(|l| l.starts_with(&format!("rank {rank} ok"))), "rank {rank}: {lines:?}");
    }
}
