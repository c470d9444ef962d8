//! Splitting one large reduction over helper threads: contiguous element
//! ranges, one per thread, run under `std::thread::scope` (the calling
//! thread takes the last range), joined before the call returns.
//!
//! Why scoped threads and not a pool: the path only runs above
//! [`PARALLEL_MIN_BYTES`](crate::PARALLEL_MIN_BYTES), where spawning
//! (tens of microseconds) is small beside the work (hundreds), and it keeps
//! the crate free of a global pool that would compete with the
//! application's own (rayon, torch intra-op threads).

use std::num::NonZeroUsize;
use std::ops::Range;
use std::sync::OnceLock;

/// Least output bytes per thread: below this a thread costs more to start
/// than it saves.
pub(crate) const MIN_BYTES_PER_THREAD: usize = 1 << 20;

/// Ranges start on multiples of this many bytes (a page), so that threads
/// never share a cache line of the output.
const RANGE_ALIGN_BYTES: usize = 4096;

/// Raw pointers handed to the helper threads of one call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shared<T>(T);

impl<T: Copy> Shared<T> {
    pub(crate) fn new(value: T) -> Self {
        Shared(value)
    }

    /// The value (a method, so that closures capture the whole `Shared`
    /// rather than its non-`Sync` field).
    pub(crate) fn get(&self) -> T {
        self.0
    }
}

// SAFETY: a `Shared` carries the pointers of one reduction call to its
// helper threads only; the threads write disjoint element ranges of the
// output and only read the inputs, and the caller's contract (nothing else
// writes these buffers during the call) holds until the scope joins them.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as for Send.
unsafe impl<T> Sync for Shared<T> {}

/// Runs `f` over `0..len` elements of `elem_size` bytes, split into up to
/// `threads` contiguous ranges (each at least `MIN_BYTES_PER_THREAD`).
/// A helper thread that cannot be spawned has its range run by the
/// calling thread instead.
pub(crate) fn for_each_range(len: usize, elem_size: usize, threads: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
    let ranges = split(len, elem_size, threads);
    let Some((mine, others)) = ranges.split_last() else { return };
    std::thread::scope(|s| {
        let mut inline = Vec::new();
        for r in others {
            let r = r.clone();
            let spawned = std::thread::Builder::new().name("rmacomm-reduce".into()).spawn_scoped(s, {
                let r = r.clone();
                move || f(r)
            });
            if spawned.is_err() {
                inline.push(r);
            }
        }
        f(mine.clone());
        for r in inline {
            f(r);
        }
    });
}

/// The ranges `for_each_range` runs: as equal as the alignment allows,
/// covering `0..len` in order.
pub(crate) fn split(len: usize, elem_size: usize, threads: usize) -> Vec<Range<usize>> {
    let bytes = len * elem_size;
    let n = threads.min(bytes / MIN_BYTES_PER_THREAD).max(1);
    let align = RANGE_ALIGN_BYTES / elem_size;
    let per = len.div_ceil(n).div_ceil(align) * align;
    (0..n).map(|i| (i * per).min(len)..((i + 1) * per).min(len)).filter(|r| !r.is_empty()).collect()
}

/// The default helper thread count: `RMACOMM_REDUCE_THREADS` if set, else
/// 1 on machines with at most 2 cores (the collective's own thread and the
/// application need them), else half the cores up to 8 (a socket's memory
/// bandwidth is saturated by then, and the other half stays with the
/// application's compute).
pub(crate) fn default_threads() -> usize {
    static DEFAULT: OnceLock<usize> = OnceLock::new();
    *DEFAULT.get_or_init(|| {
        if let Some(n) = std::env::var("RMACOMM_REDUCE_THREADS").ok().and_then(|v| v.trim().parse::<usize>().ok()) {
            return n.max(1);
        }
        let cores = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
        if cores <= 2 {
            1
        } else {
            (cores / 2).min(8)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_everything_in_aligned_ranges() {
        for (len, size, threads) in [(3 << 20, 4, 4), ((8 << 20) + 3, 1, 3), (1 << 20, 8, 16), (100, 4, 8)] {
            let ranges = split(len, size, threads);
            assert!(ranges.len() <= threads);
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges.last().unwrap().end, len);
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert_eq!(w[1].start * size % RANGE_ALIGN_BYTES, 0);
            }
        }
        assert_eq!(split(100, 4, 8), vec![0..100; 1]);
        assert_eq!(split(4 << 20, 1, 8).len(), 4);
    }

    #[test]
    fn every_range_runs_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let len = 5 << 20;
        let seen: Vec<AtomicUsize> = (0..len / 4096).map(|_| AtomicUsize::new(0)).collect();
        for_each_range(len, 1, 3, &|r| {
            for page in &seen[r.start / 4096..r.end.div_ceil(4096)] {
                page.fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(seen.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    }
}
