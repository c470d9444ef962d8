//! A communicator whose ranks are threads of one process (an in-process
//! store): the settings it hands to the windows it makes.

use std::sync::Arc;
use std::time::Duration;

use rmacomm_collectives::{Comm, CommOptions};
use rmacomm_window::{AccessType, Group, HashStore, Store, WindowOptions};

/// Runs `f(rank, comm)` on two ranks (threads) and returns their results.
fn two_ranks<T: Send + 'static>(opts: CommOptions, f: impl Fn(usize, Comm) -> T + Send + Sync + 'static) -> Vec<T> {
    std::env::set_var("RMACOMM_PROVIDER", "soft");
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let f = Arc::new(f);
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let (store, f, opts) = (store.clone(), f.clone(), opts.clone());
            std::thread::spawn(move || {
                let group = Group::new(rank, 2, store).unwrap();
                let comm = Comm::new(&group, opts).unwrap();
                f(rank, comm)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// `CommOptions::window` reaches the windows the communicator makes: with
/// `unified(false)` a same-host peer is reached through the transport
/// (SEPARATE); by default it is mapped (UNIFIED). `window_allocate` takes
/// its settings from the same place (`Comm::window_options`).
#[test]
fn window_options_reach_the_communicators_windows() {
    let base = CommOptions::new().timeout(Duration::from_secs(30));
    for (unified, want) in [(true, AccessType::Unified), (false, AccessType::Separate)] {
        let opts = base.clone().window(WindowOptions::new().unified(unified));
        let got = two_ranks(opts, |rank, comm| comm.new_window().unwrap().get_attr(1 - rank).unwrap().access_type);
        assert_eq!(got, vec![want; 2], "unified({unified})");
    }
}

/// Windows allocated and dropped back to back: a rank that is done with its
/// window drops it (deregistering its memory) while its peer may still be
/// registering. Registration ends with every rank reporting its mappings,
/// so none leaves before its peers have mapped its memory. (Before, rank 0
/// failed to map rank 1's allocation within a few rounds, "does not
/// register ... under key ...": rank 1 had already dropped it.)
#[test]
fn windows_allocated_and_dropped_back_to_back() {
    let opts = CommOptions::new().timeout(Duration::from_secs(30));
    let done = two_ranks(opts, |rank, comm| {
        for round in 0..30 {
            let w = comm.window_allocate(4096, 1).unwrap_or_else(|e| panic!("rank {rank}, round {round}: {e}"));
            assert_eq!(w.get_attr(1 - rank).unwrap().access_type, AccessType::Unified);
        }
        true
    });
    assert_eq!(done, vec![true, true]);
}
