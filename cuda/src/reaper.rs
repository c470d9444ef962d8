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

type Item = Box<dyn Send>;

/// Stream waits on host threads outstanding, and whether the reaper is
/// dropping something now.
struct Gate {
    waits: usize,
    dropping: bool,
}

static GATE: Mutex<Gate> = Mutex::new(Gate { waits: 0, dropping: false });
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
    while g.dropping {
        g = GATE_CV.wait(g).unwrap_or_else(|e| e.into_inner());
    }
    g.waits += 1;
    HostWait(())
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
            for item in rx {
                let mut g = gate();
                while g.waits > 0 {
                    g = GATE_CV.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                g.dropping = true;
                drop(g);
                drop(item);
                gate().dropping = false;
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
    let item: Item = Box::new(item);
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
