//! Drops things whose drop may wait for the whole device — `cuMemFree`
//! and `cuIpcCloseMemHandle` may synchronize the context — on a thread of
//! their own.
//!
//! A thread that stream operations depend on (a transport's engine, the
//! window's stream proxy and the runtime its operations run on) must never
//! wait for the device: a stream blocked until that thread has done its
//! part (a `cuStreamWaitValue64` on a word it writes) would never drain,
//! and the thread would wait for it forever. Such threads hand device
//! resources here instead of dropping them.
//!
//! Nor may this thread wait for the device while such a stream waits: on a
//! real driver (an H200, driver 580) a `cuIpcCloseMemHandle` that waits
//! for the device holds a lock of the driver's that `cuIpcOpenMemHandle`
//! in an engine thread then waits for — the engine never places the data
//! the stream waits for, and the close never ends. So whoever makes a
//! stream wait for a host thread holds a [`HostWait`] until that wait is
//! released (the window's stream proxy: one per operation outstanding),
//! and the reaper drops nothing while any is held; taking one waits for a
//! drop in progress to end (with no stream waiting for the host, it ends).
//! What is handed here meanwhile waits, and goes once the streams are
//! idle.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};

type Item = (Box<dyn Send>, &'static str);

/// Stream waits on host threads outstanding, and what the reaper is
/// dropping now (its type) and since when.
struct Gate {
    waits: usize,
    dropping: Option<(&'static str, std::time::Instant)>,
}

static GATE: Mutex<Gate> = Mutex::new(Gate { waits: 0, dropping: None });
static GATE_CV: Condvar = Condvar::new();

fn gate() -> MutexGuard<'static, Gate> {
    GATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A stream's wait for a host thread, outstanding while this lives: the
/// reaper drops nothing meanwhile (module docs).
#[derive(Debug)]
pub struct HostWait(());

/// Takes a [`HostWait`] before queuing a stream wait that a host thread
/// of this process releases; waits while the reaper is dropping something
/// (which then waits for the device, but no stream of ours waits for the
/// host).
pub fn host_wait() -> HostWait {
    let mut g = gate();
    while g.dropping.is_some() {
        g = GATE_CV.wait(g).unwrap_or_else(|e| e.into_inner());
    }
    g.waits += 1;
    HostWait(())
}

/// [`host_wait`] until `deadline` at most: a drop that waits for the device
/// longer (a stream of this process that never drains: another library's,
/// or one whose peer is gone) is an error naming what is being dropped and
/// for how long, instead of a caller blocked forever.
pub fn host_wait_until(deadline: std::time::Instant) -> Result<HostWait, String> {
    let mut g = gate();
    while let Some((what, since)) = g.dropping {
        let now = std::time::Instant::now();
        if now >= deadline {
            return Err(format!(
                "the CUDA reaper has been dropping {what} for {:?}, which waits for the device: a stream of this \
                 process does not drain",
                now - since
            ));
        }
        g = GATE_CV.wait_timeout(g, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
    }
    g.waits += 1;
    Ok(HostWait(()))
}

impl Drop for HostWait {
    fn drop(&mut self) {
        let mut g = gate();
        g.waits -= 1;
        let idle = g.waits == 0;
        drop(g);
        if idle {
            GATE_CV.notify_all();
        }
    }
}

/// Stream waits on host threads outstanding now (for tests and
/// diagnostics).
pub fn host_waits() -> usize {
    gate().waits
}

fn sender() -> Option<Sender<Item>> {
    static TX: OnceLock<Option<Mutex<Sender<Item>>>> = OnceLock::new();
    let tx = TX.get_or_init(|| {
        let (tx, rx) = channel::<Item>();
        let spawned = std::thread::Builder::new().name("rmacomm-cuda-reaper".into()).spawn(move || {
            for (item, what) in rx {
                let mut g = gate();
                while g.waits > 0 {
                    g = GATE_CV.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                g.dropping = Some((what, std::time::Instant::now()));
                drop(g);
                // A drop that panics must not leave the gate saying
                // "dropping" for good (every later host wait would then
                // fail at its deadline naming it): the thread goes on.
                let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(item)));
                if dropped.is_err() {
                    eprintln!("rmacomm: the CUDA reaper: dropping {what} panicked; going on");
                }
                gate().dropping = None;
                GATE_CV.notify_all();
            }
        });
        spawned.ok().map(|_| Mutex::new(tx))
    });
    tx.as_ref().map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).clone())
}

/// Drops `item` on the reaper thread (at once, here, when the thread
/// cannot be started), once no stream of this process waits for a host
/// thread ([`HostWait`]).
pub fn defer<T: Send + 'static>(item: T) {
    let item: Item = (Box::new(item), std::any::type_name::<T>());
    if let Some(tx) = sender() {
        if let Err(back) = tx.send(item) {
            drop(back.0);
        }
    } else {
        drop(item);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    struct Flag(Arc<AtomicBool>, std::thread::ThreadId);

    impl Drop for Flag {
        fn drop(&mut self) {
            assert_ne!(std::thread::current().id(), self.1, "dropped on the caller's thread");
            self.0.store(true, Ordering::Release);
        }
    }

    /// A drop that never ends (here: one blocked on a channel) makes
    /// `host_wait_until` an error naming the item's type at its deadline,
    /// not a wait forever; once the drop ends, waits are taken again.
    #[test]
    fn a_drop_that_never_ends_fails_host_waits_at_their_deadline() {
        struct Stuck(std::sync::mpsc::Receiver<()>);
        impl Drop for Stuck {
            fn drop(&mut self) {
                let _ = self.0.recv();
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        super::defer(Stuck(rx));
        let t = std::time::Instant::now();
        while super::gate().dropping.is_none() {
            assert!(t.elapsed().as_secs() < 10, "the reaper never started the drop");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let t0 = std::time::Instant::now();
        let e = super::host_wait_until(t0 + std::time::Duration::from_millis(200)).unwrap_err();
        let waited = t0.elapsed();
        assert!(e.contains("Stuck") && e.contains("does not drain"), "{e}");
        assert!(waited >= std::time::Duration::from_millis(190) && waited.as_secs() < 5, "{waited:?}");
        tx.send(()).unwrap();
        let w = super::host_wait_until(std::time::Instant::now() + std::time::Duration::from_secs(10)).unwrap();
        drop(w);
    }

    /// A drop that panics left the gate "dropping" for good (the thread
    /// died): every later host wait failed at its deadline naming it.
    #[test]
    fn a_drop_that_panics_does_not_stop_the_reaper() {
        struct Boom;
        impl Drop for Boom {
            fn drop(&mut self) {
                panic!("a drop that panics (the test's)");
            }
        }
        super::defer(Boom);
        let done = Arc::new(AtomicBool::new(false));
        super::defer(Flag(done.clone(), std::thread::current().id()));
        let t = std::time::Instant::now();
        while !done.load(Ordering::Acquire) {
            assert!(t.elapsed().as_secs() < 10, "the reaper stopped after the panic");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let w = super::host_wait_until(std::time::Instant::now() + std::time::Duration::from_secs(10)).unwrap();
        drop(w);
    }

    #[test]
    fn deferred_items_drop_on_another_thread() {
        let done = Arc::new(AtomicBool::new(false));
        super::defer(Flag(done.clone(), std::thread::current().id()));
        let t = std::time::Instant::now();
        while !done.load(Ordering::Acquire) {
            assert!(t.elapsed().as_secs() < 10, "never dropped");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Nothing is dropped while a stream waits for a host thread; taking
    /// a wait after the last one goes lets the drop happen.
    #[test]
    fn nothing_drops_while_a_stream_waits_for_the_host() {
        let wait = super::host_wait();
        let done = Arc::new(AtomicBool::new(false));
        super::defer(Flag(done.clone(), std::thread::current().id()));
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!done.load(Ordering::Acquire), "dropped while a HostWait was held");
        drop(wait);
        let t = std::time::Instant::now();
        while !done.load(Ordering::Acquire) {
            assert!(t.elapsed().as_secs() < 10, "never dropped after the wait went");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(super::host_waits(), 0);
    }
}
