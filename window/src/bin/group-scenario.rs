//! Test helper, not a tool: the multi-process scenarios the window crate's
//! integration tests run under `rmacomm-run`. Each checks itself and exits
//! non-zero (with a message) when something is wrong.
//!
//! `group-scenario SCENARIO [ARGS]`, scenarios: `group`, `hosts`,
//! `mismatch-split`, `fail RANK CODE`, `echo`, `store-tcp`, `store-file DIR`.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use rmacomm_window::{Error, FileStore, Group, GroupOptions, LaunchEnv, Store, TcpStore};

type R = Result<(), String>;

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> R {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}

fn env_usize(k: &str) -> usize {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).expect("launched by rmacomm-run")
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rank = env_usize("RANK");
    let result = match args.first().map(String::as_str) {
        Some("group") => group(),
        Some("hosts") => hosts(),
        Some("mismatch-split") => mismatch_split(),
        Some("fail") => fail(rank, &args[1..]),
        Some("echo") => {
            println!("hello from rank {rank}");
            eprintln!("complaint from rank {rank}");
            print!("no newline from rank {rank}");
            Ok(())
        }
        Some("store-tcp") => store_tcp(),
        Some("store-file") => store_file(&args[1]),
        other => Err(format!("unknown scenario {other:?}")),
    };
    match result {
        Ok(()) => println!("rank {rank} ok"),
        Err(e) => {
            eprintln!("rank {rank} FAILED: {e}");
            std::process::exit(1);
        }
    }
}

fn group() -> R {
    let g = Group::from_env_with(GroupOptions::new().timeout(Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let (rank, size) = (g.rank(), g.size());
    ensure(rank == env_usize("RANK") && size == env_usize("WORLD_SIZE"), || format!("rank/size {rank}/{size}"))?;
    ensure(g.local_rank() == env_usize("LOCAL_RANK") && g.local_size() == size, || format!("local {g:?}"))?;
    ensure((0..size).all(|p| g.same_host(p)) && !g.same_host(size), || "same_host".into())?;
    let launch = g.launch_env().ok_or("no launch env")?;
    ensure(launch.local_world_size == Some(size), || format!("{launch:?}"))?;

    // Repeated exchanges and barriers: generation counting keeps them apart.
    let start = Instant::now();
    for round in 0..50u32 {
        let mine = format!("{rank}:{round}").into_bytes();
        let all = g.exchange("round", &mine).map_err(|e| e.to_string())?;
        for (r, v) in all.iter().enumerate() {
            ensure(*v == format!("{r}:{round}").into_bytes(), || format!("round {round}: rank {r} sent {v:?}"))?;
        }
        g.barrier(None).map_err(|e| e.to_string())?;
    }
    let per_round = start.elapsed() / 50;
    eprintln!("exchange+barrier round: {per_round:?}");

    // A bigger blob, as a window's descriptors might be.
    let blob = vec![rank as u8; 100_000];
    let all = g.exchange("blob", &blob).map_err(|e| e.to_string())?;
    ensure(all.iter().enumerate().all(|(r, v)| v.len() == 100_000 && v[0] == r as u8), || "blob".into())?;

    // Split: evens, and everyone in reverse order.
    let evens: Vec<usize> = (0..size).step_by(2).collect();
    let sub = g.split(&evens).map_err(|e| e.to_string())?;
    match &sub {
        Some(s) => {
            ensure(rank % 2 == 0 && s.rank() == rank / 2 && s.size() == evens.len(), || format!("evens {s:?}"))?;
            let all = s.exchange("evens", &[rank as u8]).map_err(|e| e.to_string())?;
            let want: Vec<Vec<u8>> = evens.iter().map(|&r| vec![r as u8]).collect();
            ensure(all == want, || format!("evens exchange {all:?}"))?;
            s.barrier(None).map_err(|e| e.to_string())?;
        }
        None => ensure(rank % 2 == 1, || "even rank left out".into())?,
    }
    let reversed: Vec<usize> = (0..size).rev().collect();
    let rev = g.split(&reversed).map_err(|e| e.to_string())?.ok_or("left out of the full split")?;
    ensure(rev.rank() == size - 1 - rank && rev.size() == size, || format!("reversed {rev:?}"))?;
    let all = rev.exchange("rev", &[rank as u8]).map_err(|e| e.to_string())?;
    ensure(all.iter().enumerate().all(|(i, v)| v[0] as usize == size - 1 - i), || format!("{all:?}"))?;
    // A split of a split.
    if let Some(first) = rev.split(&[0]).map_err(|e| e.to_string())? {
        ensure(rank == size - 1 && first.size() == 1 && first.rank() == 0, || "nested".into())?;
        first.barrier(None).map_err(|e| e.to_string())?;
    }
    rev.barrier(None).map_err(|e| e.to_string())?;
    // The parent still works after its children.
    g.barrier(None).map_err(|e| e.to_string())
}

fn hosts() -> R {
    let rank = env_usize("RANK");
    let opts = GroupOptions::new().timeout(Duration::from_secs(60)).host_id(format!("fake-host-{}", rank % 2));
    let g = Group::from_env_with(opts).map_err(|e| e.to_string())?;
    for p in 0..g.size() {
        ensure(g.same_host(p) == (p % 2 == rank % 2), || format!("same_host({p}) on rank {rank}"))?;
    }
    let on_mine = (0..g.size()).filter(|p| p % 2 == rank % 2).count();
    ensure(g.local_size() == on_mine && g.local_rank() == rank / 2, || format!("{g:?}"))?;
    g.barrier(None).map_err(|e| e.to_string())
}

fn mismatch_split() -> R {
    let g = Group::from_env_with(GroupOptions::new().timeout(Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let list: Vec<usize> = if g.rank() == 0 { vec![1, 0] } else { (0..g.size()).collect() };
    match g.split(&list) {
        Err(e @ Error::Mismatch { .. }) => {
            println!("mismatch detected: {e}");
            // The group is still usable after the error.
            g.barrier(None).map_err(|e| e.to_string())
        }
        other => Err(format!("expected a mismatch error, got {other:?}")),
    }
}

fn fail(rank: usize, args: &[String]) -> R {
    let bad: usize = args[0].parse().expect("RANK");
    let code: i32 = args[1].parse().expect("CODE");
    if rank == bad {
        std::thread::sleep(Duration::from_millis(200));
        eprintln!("rank {rank} failing on purpose with {code}");
        std::process::exit(code);
    }
    std::thread::sleep(Duration::from_secs(60));
    Err("was not stopped".into())
}

fn store_tcp() -> R {
    let env = LaunchEnv::from_process_env().map_err(|e| e.to_string())?;
    let store =
        TcpStore::new(&env.master_addr, env.master_port, Some(env.world_size), env.rank == 0, Duration::from_secs(30))
            .map_err(|e| e.to_string())?;
    store_semantics(Arc::new(store), env.rank, env.world_size)
}

fn store_file(dir: &str) -> R {
    let store = FileStore::new(dir).map_err(|e| e.to_string())?;
    store_semantics(Arc::new(store), env_usize("RANK"), env_usize("WORLD_SIZE"))
}

/// The store operations, raced by every rank.
fn store_semantics(store: Arc<dyn Store>, rank: usize, size: usize) -> R {
    let t = Duration::from_secs(30);
    let e = |e: Error| e.to_string();
    store.set(&format!("key/{rank}"), format!("value {rank}").as_bytes()).map_err(e)?;
    // Concurrent adds from every rank and two threads each: no update lost.
    let s2 = store.clone();
    let helper = std::thread::spawn(move || (0..50).try_for_each(|_| s2.add("counter", 1).map(drop)));
    for _ in 0..50 {
        store.add("counter", 1).map_err(e)?;
    }
    helper.join().map_err(|_| "helper panicked")?.map_err(e)?;
    if store.add("finished", 1).map_err(e)? == size as i64 {
        store.set("all-finished", b"").map_err(e)?;
    }
    store.wait(&["all-finished"], t).map_err(e)?;
    let counter = store.get("counter", t).map_err(e)?;
    ensure(counter == (100 * size).to_string().into_bytes(), || format!("counter {counter:?}"))?;
    let keys: Vec<String> = (0..size).map(|r| format!("key/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let values = store.multi_get(&refs, t).map_err(e)?;
    for (r, v) in values.iter().enumerate() {
        ensure(*v == format!("value {r}").into_bytes(), || format!("key/{r} = {v:?}"))?;
    }
    // Exactly one rank wins a compare_set race on an absent key.
    let won = store.compare_set("winner", None, rank.to_string().as_bytes()).map_err(e)?.is_none();
    if won {
        store.add("winners", 1).map_err(e)?;
    }
    if store.add("raced", 1).map_err(e)? == size as i64 {
        store.set("race-done", b"").map_err(e)?;
    }
    store.wait(&["race-done"], t).map_err(e)?;
    ensure(store.get("winners", t).map_err(e)? == b"1", || "compare_set winners".into())?;
    // A wait for a key nobody sets times out with the key's name.
    match store.wait(&["never/set"], Duration::from_millis(200)) {
        Err(Error::Timeout { waiting_for, .. }) if waiting_for.contains("never/set") => {}
        other => return Err(format!("wait on a missing key: {other:?}")),
    }
    // Each rank deletes its own key once everyone has read it.
    store.delete(&format!("key/{rank}")).map_err(e)?.then_some(()).ok_or("delete of a present key")?;
    ensure(!store.delete(&format!("key/{rank}")).map_err(e)?, || "second delete".into())?;
    if store.add("deleted", 1).map_err(e)? == size as i64 {
        store.set("delete-done", b"").map_err(e)?;
    }
    store.wait(&["delete-done"], t).map_err(e)?;
    ensure(!store.check(&refs).map_err(e)?, || "keys survived delete".into())?;
    ensure(store.try_get(&keys[0]).map_err(e)?.is_none(), || "try_get after delete".into())
}
