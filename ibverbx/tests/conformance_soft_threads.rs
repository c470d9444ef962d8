//! The conformance suite on the soft provider with a two-thread progress
//! engine (`progress_threads: 2`): over tcp, and over shm with the
//! posting-thread copy off, so that the engine's tasks for the two QPs of
//! each check (requesters, responders, completions) run on two threads at
//! once.

mod conformance;

use ibverbx::soft::{SoftConfig, SoftLink, SoftProvider};

mod tcp {
    use super::*;
    fn device() -> ibverbx::Device {
        SoftProvider::new(SoftConfig { link: SoftLink::Tcp, progress_threads: 2, ..SoftConfig::default() }).device()
    }
    conformance_suite!(device());
}

mod shm_engine {
    use super::*;
    fn device() -> ibverbx::Device {
        SoftProvider::new(SoftConfig {
            link: SoftLink::Shm,
            inline_copy_max: 0,
            progress_threads: 2,
            ..SoftConfig::default()
        })
        .device()
    }
    conformance_suite!(device());
}

/// The engine runs as many threads as configured: a context of three has
/// three worker threads (named `rmacomm-soft`) beside the one that owns the
/// runtime; one of one has none.
#[test]
fn a_context_runs_the_configured_progress_threads() {
    fn workers() -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|c| c.trim_end() == "rmacomm-soft")
            .count()
    }
    let before = workers();
    let three = SoftProvider::new(SoftConfig { link: SoftLink::Tcp, progress_threads: 3, ..SoftConfig::default() })
        .device()
        .open()
        .unwrap();
    // A new thread names itself once it runs: give them a moment.
    let t = std::time::Instant::now();
    while workers() - before < 3 && t.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(workers() - before, 3);
    let one = SoftProvider::new(SoftConfig { link: SoftLink::Tcp, ..SoftConfig::default() }).device().open().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(workers() - before, 3, "a one-thread engine runs on its own thread, no workers");
    drop((three, one));
}
