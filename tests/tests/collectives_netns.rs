//! Collectives between two "hosts": two ranks in two network namespaces
//! joined by a veth pair (the soft provider talks TCP, the window pairs are
//! SEPARATE), running every operation of the `all` scenario
//! (`collectives/src/bin/coll-scenario.rs`), and the native GPU
//! collectives on the CUDA stand-in (`gpu`: transport mode). Needs root and
//! iproute2; skipped with the reason otherwise.

use std::time::{Duration, Instant};

use rmacomm_tests::harness::{NetnsPair, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_coll_peer");

#[test]
fn all_collectives_between_two_network_namespaces() {
    let Some(ns) = namespaces() else { return };
    let t0 = Instant::now();
    let (l0, ok0, l1, ok1) = pair(&ns, "29519", "all", &[], Duration::from_secs(240));
    eprintln!("collectives across two namespaces: {:?}", t0.elapsed());
    for (rank, (lines, ok)) in [(l0, ok0), (l1, ok1)].iter().enumerate() {
        assert!(*ok, "rank {rank} failed (its stderr is above); stdout: {lines:?}");
        assert!(lines.iter().any(|l| l.starts_with(&format!("rank {rank} ok"))), "rank {rank}: {lines:?}");
    }
}

/// The native GPU collectives (`GpuComm`) on the CUDA stand-in's device
/// memory between the two namespaces: the ranks are on different hosts,
/// so transport mode (puts through the windows' stream proxies across the
/// veth pair); every result checked. Needs the stand-in and NVRTC (CI's
/// NVRTC stage); says why it skipped otherwise.
#[test]
fn gpu_collectives_between_two_network_namespaces() {
    // Strict, level 2: no thread a stream waits for may make any driver
    // call while it waits (the stand-in aborts the rank naming the call:
    // docs/gpu.md). The soft provider's transport mode keeps its slots in
    // host memory, which its engines move with no driver call.
    gpu_pair("29521", "host", "2");
}

/// The same with the slots in device memory (`RMACOMM_GPU_SLOTS=device`:
/// what a verbs HCA gets), which the soft provider's engines copy through
/// the driver: held to strict level 1 (no lock-taking call while a stream
/// waits), not 2.
#[test]
fn gpu_collectives_on_device_slots_between_two_network_namespaces() {
    gpu_pair("29523", "device", "1");
}

/// Runs the `gpu` scenario across the namespaces with `slots` memory under
/// stand-in strict level `strict`; every result checked.
fn gpu_pair(port: &str, slots: &str, strict: &str) {
    let Some(lib) = rmacomm_cuda::standin_for_tests() else { return };
    let Some(ns) = namespaces() else { return };
    let lib = lib.to_string_lossy().into_owned();
    let env = [("RMACOMM_CUDA_LIB", lib.as_str()), ("RMACOMM_STANDIN_STRICT", strict), ("RMACOMM_GPU_SLOTS", slots)];
    let (l0, ok0, l1, ok1) = pair(&ns, port, "gpu", &env, Duration::from_secs(240));
    for (rank, (lines, ok)) in [(l0, ok0), (l1, ok1)].iter().enumerate() {
        assert!(*ok, "rank {rank} failed (its stderr is above); stdout: {lines:?}");
        if let Some(why) = lines.iter().find(|l| l.starts_with("gpu skipped")) {
            let expect = std::env::var("RMACOMM_EXPECT_NVRTC").is_ok_and(|v| v == "1");
            assert!(!expect || !why.contains("NVRTC"), "RMACOMM_EXPECT_NVRTC=1 but rank {rank}: {why}");
            println!("skipped: {why}");
            return;
        }
        let has = |s: &str| lines.iter().any(|l| l == s);
        let want = format!("gpu slots: {slots}");
        assert!(has("gpu mode: transport (cuda:0)") && has(&want) && has("gpu ok"), "rank {rank}: {lines:?}");
    }
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

/// Runs `coll_peer SCENARIO` as ranks 0 and 1, one per namespace; each
/// rank's stdout lines and whether it exited with 0.
fn pair(
    ns: &NetnsPair,
    port: &str,
    scenario: &str,
    extra: &[(&str, &str)],
    limit: Duration,
) -> (Vec<String>, bool, Vec<String>, bool) {
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
            Peer::spawn(name, PEER, &NetnsPair::prefix(netns), &[scenario], &env)
        })
        .collect();
    let mut it = peers.into_iter();
    let (p0, p1) = (it.next().unwrap(), it.next().unwrap());
    let (l1, ok1) = p1.finish(limit);
    let (l0, ok0) = p0.finish(Duration::from_secs(60));
    (l0, ok0, l1, ok1)
}
