//! One suite of store semantics, instantiated for every `Store`
//! implementation (in-process, TCP host, TCP client, file, prefix).

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rmacomm_window::{
    Error, FileStore, HashStore, PrefixStore, Store, TcpStore, TcpStoreServer, MAX_KEYS_BYTES, MAX_KEY_LEN,
    MAX_VALUE_LEN,
};

const T: Duration = Duration::from_secs(10);

/// A store under test, plus whatever must live as long as it.
struct Fixture {
    store: Arc<dyn Store>,
    /// A second handle on the same data (another client, another instance).
    other: Arc<dyn Store>,
    _keep: Vec<Box<dyn std::any::Any + Send>>,
}

fn hash() -> Fixture {
    let s = Arc::new(HashStore::new());
    Fixture { store: s.clone(), other: s, _keep: vec![] }
}

fn tcp_host() -> Fixture {
    let mut host = TcpStore::new("127.0.0.1", 0, None, true, T).unwrap();
    host.set_linger(Duration::ZERO);
    let client = TcpStore::connect("127.0.0.1", host.port(), T).unwrap();
    Fixture { store: Arc::new(host), other: Arc::new(client), _keep: vec![] }
}

fn tcp_client() -> Fixture {
    let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().port();
    let a = TcpStore::connect("127.0.0.1", port, T).unwrap();
    let b = TcpStore::connect("localhost", port, T).unwrap();
    Fixture { store: Arc::new(a), other: Arc::new(b), _keep: vec![Box::new(server)] }
}

fn file() -> Fixture {
    let dir = std::env::temp_dir().join(format!("rmacomm-store-{}-{}", std::process::id(), rand_u64()));
    let a = FileStore::new(&dir).unwrap();
    let b = FileStore::new(&dir).unwrap();
    Fixture { store: Arc::new(a), other: Arc::new(b), _keep: vec![Box::new(TempDir(dir))] }
}

fn prefix() -> Fixture {
    let inner: Arc<dyn Store> = Arc::new(HashStore::new());
    // Keys of another prefix must not be seen.
    inner.set("other/k", b"not mine").unwrap();
    let a = PrefixStore::new("mine/", inner.clone());
    let b = PrefixStore::new("mine/", inner);
    Fixture { store: Arc::new(a), other: Arc::new(b), _keep: vec![] }
}

struct TempDir(std::path::PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    h.finish()
}

fn set_get_overwrite(f: Fixture) {
    let s = &f.store;
    assert_eq!(s.try_get("k").unwrap(), None);
    s.set("k", b"one").unwrap();
    assert_eq!(f.other.get("k", T).unwrap(), b"one");
    s.set("k", b"").unwrap();
    assert_eq!(f.other.try_get("k").unwrap(), Some(vec![]));
    s.set("k", &[0, 255, 10]).unwrap();
    assert_eq!(s.get("k", T).unwrap(), vec![0, 255, 10]);
    // Odd keys: slashes, spaces, unicode, empty, dots.
    for key in ["a/b/c", "with space", "ключ", "", "..", "../../x", "%41"] {
        s.set(key, key.as_bytes()).unwrap();
    }
    for key in ["a/b/c", "with space", "ключ", "", "..", "../../x", "%41"] {
        assert_eq!(f.other.try_get(key).unwrap().unwrap(), key.as_bytes(), "{key:?}");
    }
    assert_eq!(s.try_get("A").unwrap(), None, "'%41' and 'A' are different keys");
}

fn multi_get_waits_for_keys_set_later(f: Fixture) {
    let other = f.other.clone();
    let setter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        other.set("late/1", b"b").unwrap();
        thread::sleep(Duration::from_millis(50));
        other.set("late/0", b"a").unwrap();
    });
    let start = Instant::now();
    let values = f.store.multi_get(&["late/0", "late/1"], T).unwrap();
    assert_eq!(values, vec![b"a".to_vec(), b"b".to_vec()]);
    assert!(start.elapsed() >= Duration::from_millis(140));
    setter.join().unwrap();
    f.store.wait(&["late/0", "late/1"], T).unwrap();
    assert!(f.store.check(&["late/0", "late/1"]).unwrap());
    assert!(!f.store.check(&["late/0", "nope"]).unwrap());
    assert!(f.store.check(&[]).unwrap());
}

fn wait_timeout_names_the_key(f: Fixture) {
    f.store.set("present", b"").unwrap();
    let start = Instant::now();
    for r in [
        f.store.wait(&["present", "missing/key"], Duration::from_millis(200)).map(drop),
        f.store.multi_get(&["present", "missing/key"], Duration::from_millis(200)).map(drop),
        f.store.get("missing/key", Duration::from_millis(200)).map(drop),
    ] {
        match r {
            Err(e @ Error::Timeout { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("'missing/key'") && msg.contains("RMACOMM_TIMEOUT_SECONDS"), "{msg}");
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(600) && took < Duration::from_secs(5), "{took:?}");
}

fn add_counts_atomically(f: Fixture) {
    assert_eq!(f.store.add("c", 5).unwrap(), 5);
    assert_eq!(f.store.add("c", -2).unwrap(), 3);
    assert_eq!(f.other.get("c", T).unwrap(), b"3", "counters are decimal text");
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let s = if i % 2 == 0 { f.store.clone() } else { f.other.clone() };
            thread::spawn(move || {
                (0..25).for_each(|_| {
                    s.add("c", 1).unwrap();
                })
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert_eq!(f.store.add("c", 0).unwrap(), 103);
    f.store.set("text", b"hello").unwrap();
    match f.store.add("text", 1) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("text'") && reason.contains("integer"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    f.store.set("big", i64::MAX.to_string().as_bytes()).unwrap();
    assert!(f.store.add("big", 1).is_err());
}

fn compare_set_is_a_compare_exchange(f: Fixture) {
    assert_eq!(f.store.compare_set("cas", None, b"first").unwrap(), None);
    assert_eq!(f.store.compare_set("cas", None, b"second").unwrap(), Some(b"first".to_vec()));
    assert_eq!(f.other.compare_set("cas", Some(b"wrong"), b"third").unwrap(), Some(b"first".to_vec()));
    assert_eq!(f.other.compare_set("cas", Some(b"first"), b"fourth").unwrap(), Some(b"first".to_vec()));
    assert_eq!(f.store.get("cas", T).unwrap(), b"fourth");
    // Racers on an absent key: exactly one wins.
    let winners: usize = (0..6)
        .map(|i| {
            let s = if i % 2 == 0 { f.store.clone() } else { f.other.clone() };
            thread::spawn(move || s.compare_set("race", None, &[i]).unwrap().is_none())
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| usize::from(t.join().unwrap()))
        .sum();
    assert_eq!(winners, 1);
}

fn delete_removes(f: Fixture) {
    assert!(!f.store.delete("d").unwrap());
    f.store.set("d", b"x").unwrap();
    assert!(f.other.delete("d").unwrap());
    assert_eq!(f.store.try_get("d").unwrap(), None);
    assert!(!f.store.check(&["d"]).unwrap());
    assert_eq!(f.store.add("d", 1).unwrap(), 1, "a deleted counter starts again at 0");
}

fn limits_are_enforced(f: Fixture) {
    let long = "k".repeat(MAX_KEY_LEN + 1);
    for r in [f.store.set(&long, b""), f.store.try_get(&long).map(drop), f.store.add(&long, 1).map(drop)] {
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    }
    assert!(matches!(f.store.wait(&[&long], T), Err(Error::InvalidArgument { .. })));
    // The longest key works, including on the file store (a hashed name).
    let longest = "k".repeat(MAX_KEY_LEN - 8);
    f.store.set(&longest, b"ok").unwrap();
    assert_eq!(f.other.try_get(&longest).unwrap().unwrap(), b"ok");
    let huge = vec![0u8; MAX_VALUE_LEN + 1];
    assert!(matches!(f.store.set("huge", &huge), Err(Error::InvalidArgument { .. })));
    // A large value that is allowed.
    let big = vec![7u8; 4 << 20];
    f.store.set("big-value", &big).unwrap();
    assert_eq!(f.other.get("big-value", T).unwrap(), big);
    // Whatever the per-field limits let through reaches every store alike:
    // a compare_set of two large values (over TCP it made a frame the host
    // refused: a "Disconnected" for a healthy store)...
    let half = vec![3u8; (MAX_VALUE_LEN / 8) * 5];
    assert_eq!(f.store.compare_set("cs-big", Some(&half), &half).unwrap(), None);
    assert_eq!(f.store.compare_set("cs-big", None, &half).unwrap(), None);
    assert_eq!(f.other.get("cs-big", T).unwrap().len(), half.len());
    f.store.delete("cs-big").unwrap();
    // ...and keys adding up to more than one call carries are refused by
    // name on every store.
    let many: Vec<String> = (0..MAX_KEYS_BYTES / (MAX_KEY_LEN - 8) + 1)
        .map(|i| format!("{i:08}{}", "k".repeat(MAX_KEY_LEN - 16)))
        .collect();
    let refs: Vec<&str> = many.iter().map(String::as_str).collect();
    for r in [f.store.wait(&refs, T), f.store.check(&refs).map(drop), f.store.multi_get(&refs, T).map(drop)] {
        assert!(matches!(&r, Err(Error::InvalidArgument { reason, .. }) if reason.contains("add up to")), "{r:?}");
    }
}

macro_rules! conformance {
    ($($name:ident => $fixture:expr;)*) => {$(
        mod $name {
            use super::*;
            #[test] fn set_get_overwrite() { super::set_get_overwrite($fixture) }
            #[test] fn multi_get_waits_for_keys_set_later() { super::multi_get_waits_for_keys_set_later($fixture) }
            #[test] fn wait_timeout_names_the_key() { super::wait_timeout_names_the_key($fixture) }
            #[test] fn add_counts_atomically() { super::add_counts_atomically($fixture) }
            #[test] fn compare_set_is_a_compare_exchange() { super::compare_set_is_a_compare_exchange($fixture) }
            #[test] fn delete_removes() { super::delete_removes($fixture) }
            #[test] fn limits_are_enforced() { super::limits_are_enforced($fixture) }
        }
    )*};
}

conformance! {
    hash_store => hash();
    tcp_store_host => tcp_host();
    tcp_store_client => tcp_client();
    file_store => file();
    prefix_store => prefix();
}

#[test]
fn prefix_store_keeps_key_spaces_apart() {
    let inner: Arc<dyn Store> = Arc::new(HashStore::new());
    let a = PrefixStore::new("a/", inner.clone());
    let b = PrefixStore::new("b/", inner.clone());
    a.set("k", b"A").unwrap();
    b.set("k", b"B").unwrap();
    assert_eq!(inner.try_get("a/k").unwrap().unwrap(), b"A");
    assert_eq!(b.try_get("k").unwrap().unwrap(), b"B");
    // Timeouts name the caller's key, not the prefixed one.
    let e = a.wait(&["nope"], Duration::from_millis(10)).unwrap_err().to_string();
    assert!(e.contains("'nope'") && !e.contains("a/nope"), "{e}");
}
