//! Drops things whose drop may wait for the whole device — `cuMemFree`
//! and `cuIpcCloseMemHandle` may synchronize the context — on a thread of
//! their own.
//!
//! A thread that stream operations depend on (a transport's engine, the
//! window's stream proxy and the runtime its operations run on) must never
//! wait for the device: a stream blocked until that thread has done its
//! part (a `cuStreamWaitValue64` on a word it writes) would never drain,
//! and the thread would wait for it forever. Such threads hand device
//! resources here instead of dropping them. Nothing waits for this thread,
//! so its waiting for the device blocks no one.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};

type Item = Box<dyn Send>;

fn sender() -> Option<Sender<Item>> {
    static TX: OnceLock<Option<Mutex<Sender<Item>>>> = OnceLock::new();
    let tx = TX.get_or_init(|| {
        let (tx, rx) = channel::<Item>();
        let spawned = std::thread::Builder::new().name("rmacomm-cuda-reaper".into()).spawn(move || {
            for item in rx {
                drop(item);
            }
        });
        spawned.ok().map(|_| Mutex::new(tx))
    });
    tx.as_ref().map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).clone())
}

/// Drops `item` on the reaper thread (at once, here, when the thread
/// cannot be started).
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
}
