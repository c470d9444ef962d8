//! A window between two "hosts": two ranks in two network namespaces joined
//! by a veth pair (so the soft provider talks TCP and the group sees two
//! hosts), the group set up by hand with torchrun's variables: rank 0 hosts
//! the TcpStore on its veth address, rank 1 connects to it. Needs root and
//! iproute2; skipped with the reason otherwise.

use std::time::{Duration, Instant};

use rmacomm_tests::harness::{NetnsPair, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_window_peer");

/// Runs both ranks (`window_peer ITERS`), each in its namespace, with
/// `extra` environment for both; returns each rank's stdout lines and
/// whether it exited with 0.
fn run_pair(ns: &NetnsPair, iters: &str, extra: &[(&str, &str)]) -> [(Vec<String>, bool); 2] {
    let port = "29517"; // free in a fresh namespace
    let peers: Vec<Peer> = [(&ns.a, &ns.dev_a, "0", "rank 0"), (&ns.b, &ns.dev_b, "1", "rank 1")]
        .into_iter()
        .map(|(netns, dev, rank, name)| {
            let ifname = format!("={dev}");
            let mut env = vec![
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
            env.extend_from_slice(extra);
            Peer::spawn(name, PEER, &NetnsPair::prefix(netns), &[iters], &env)
        })
        .collect();
    let mut it = peers.into_iter();
    let (p0, p1) = (it.next().unwrap(), it.next().unwrap());
    let r1 = p1.finish(Duration::from_secs(120));
    let r0 = p0.finish(Duration::from_secs(60));
    [r0, r1]
}

fn namespaces() -> Option<NetnsPair> {
    match NetnsPair::create() {
        Ok(ns) => Some(ns),
        Err(why) => {
            println!("skipped: two network namespaces need root and iproute2 ({why})");
            None
        }
    }
}

/// get_attr says SEPARATE both ways, map_remote_tensor is refused naming
/// the peer, the TcpStore works across the namespaces, and 8 iterations of
/// the ring (1 Mi f32, then 4 i8; put + signal / wait_signal, sync and
/// async, both directions at once) and gets of the peer's buffer move
/// exactly the right elements (each rank checks every one it received).
#[test]
fn window_put_signal_get_between_two_network_namespaces() {
    let Some(ns) = namespaces() else { return };
    let t0 = Instant::now();
    let results = run_pair(&ns, "8", &[]);
    eprintln!("two ranks in two namespaces: {:?}", t0.elapsed());
    for (rank, (lines, ok)) in results.iter().enumerate() {
        let peer = 1 - rank;
        assert!(*ok, "rank {rank} failed (its stderr is above); stdout: {lines:?}");
        let has = |s: &str| lines.iter().any(|l| l.contains(s));
        assert!(has("store ok"), "rank {rank}: {lines:?}");
        assert!(has(&format!("attr {peer}: separate")), "rank {rank}: {lines:?}");
        let refused: Vec<&String> = lines.iter().filter(|l| l.starts_with("map_remote_tensor(")).collect();
        assert_eq!(refused.len(), 2, "one refusal per registration, rank {rank}: {lines:?}");
        assert!(refused.iter().all(|l| l.contains(&format!("rank {peer}"))), "{refused:?}");
        assert!(has("ring ok: 16 iterations"), "rank {rank}: {lines:?}");
        assert!(has("get ok"), "rank {rank}: {lines:?}");
        assert!(has("ctran ok"), "the ctran form, rank {rank}: {lines:?}");
        assert_eq!(lines.last().map(String::as_str), Some(format!("rank {rank} ok").as_str()), "{lines:?}");
    }
}

/// The same ring and gets on CUDA device memory (the stand-in's,
/// `WINDOW_PEER_MEM=cuda`): every tensor, source and destination is device
/// memory, moved across the namespaces by the transport's device staging;
/// then the ring ordered on a CUDA stream (the window's stream proxy).
#[test]
fn window_on_cuda_memory_between_two_network_namespaces() {
    let Some(lib) = rmacomm_cuda::standin_for_tests() else { return };
    let Some(ns) = namespaces() else { return };
    let lib = lib.to_string_lossy().into_owned();
    let results = run_pair(&ns, "4", &[("WINDOW_PEER_MEM", "cuda"), ("RMACOMM_CUDA_LIB", lib.as_str())]);
    for (rank, (lines, ok)) in results.iter().enumerate() {
        assert!(*ok, "rank {rank} failed (its stderr is above); stdout: {lines:?}");
        let has = |s: &str| lines.iter().any(|l| l.contains(s));
        assert!(has("ring ok: 8 iterations") && has("get ok"), "rank {rank}: {lines:?}");
        assert!(has("stream ring ok: 4 iterations"), "the stream-ordered ring, rank {rank}: {lines:?}");
        assert_eq!(lines.last().map(String::as_str), Some(format!("rank {rank} ok").as_str()), "{lines:?}");
    }
}

/// The checks are live: one byte of what rank 1 put into rank 0 is
/// damaged at rank 0 after the signal (`WINDOW_PEER_DAMAGE`), and rank 0
/// fails naming the element.
#[test]
fn a_damaged_element_fails_the_two_namespace_ring() {
    let Some(ns) = namespaces() else { return };
    let [(l0, ok0), (l1, _)] = run_pair(&ns, "1", &[("WINDOW_PEER_DAMAGE", "0")]);
    assert!(!ok0, "rank 0 accepted damaged data: {l0:?} / {l1:?}");
    let failed = l0.iter().find(|l| l.starts_with("rank 0 FAILED")).unwrap_or_else(|| panic!("{l0:?}"));
    assert!(failed.contains("element 3 from rank 1"), "{failed}");
    assert!(!l0.iter().any(|l| l.contains("ring ok")), "{l0:?}");
}
