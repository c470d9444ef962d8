//! `CompletionQueue::wait`'s bounds: the timeout bounds the busy-poll phase
//! too, and an empty output returns at once.

use std::time::{Duration, Instant};

use ibverbx::soft::{SoftConfig, SoftProvider};
use ibverbx::WorkCompletion;

#[test]
fn the_timeout_bounds_busy_polling_and_an_empty_output_returns_at_once() {
    let ctx = SoftProvider::new(SoftConfig::default()).device().open().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    // A 20 s busy-poll under a 50 ms timeout: it spun the whole 20 s.
    let t0 = Instant::now();
    let mut wc = [WorkCompletion::empty(); 1];
    assert_eq!(cq.wait(&mut wc, Some(Duration::from_millis(50)), Duration::from_secs(20)).unwrap(), 0);
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // Nothing to poll into: no completion can make it return (it waited forever).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(cq.wait(&mut [], None, Duration::ZERO).map_err(|e| e.to_string())));
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)).expect("wait(&mut []) did not return"), Ok(0));
}
