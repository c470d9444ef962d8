//! How many bytes a posting thread may copy itself within one post of a
//! virtual QP: the rest of a large message goes to the progress thread.
//!
//! A same-host WRITE/READ on an idle QP is copied by the thread that posts
//! it (up to `inline_copy_max` per WR). A virtual QP posts a large message
//! as many fragments, and each fragment's copy finishes before the next is
//! posted, so the QP looks idle every time: without a budget, a 64 MiB
//! `RdmaTransport::write` was copied whole on the caller's (async runtime's)
//! thread. `VirtualQp` runs its posting inside [`scope`]; the soft QP takes
//! each copy from the budget ([`take`]). Outside a scope (a physical QP
//! used directly) only the per-WR limit applies.

use std::cell::Cell;

thread_local! {
    static LEFT: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Runs `f` with `bytes` of inline copying allowed to this thread.
pub(crate) fn scope<R>(bytes: usize, f: impl FnOnce() -> R) -> R {
    let prev = LEFT.with(|l| l.replace(Some(bytes)));
    // Restored on unwind too, so that a panic cannot leave a budget behind.
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            LEFT.with(|l| l.set(self.0));
        }
    }
    let _restore = Restore(prev);
    f()
}

/// Takes `len` bytes from this thread's budget; false when it has not that
/// many left (the WR then goes to the progress thread).
pub(crate) fn take(len: u64) -> bool {
    LEFT.with(|l| match l.get() {
        None => true,
        Some(left) if left as u64 >= len => {
            l.set(Some(left - len as usize));
            true
        }
        Some(_) => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_is_scoped_and_spent() {
        assert!(take(u64::MAX), "no scope: no budget");
        scope(100, || {
            assert!(take(60));
            assert!(!take(60));
            assert!(take(40));
            scope(10, || assert!(!take(11)));
            assert!(!take(1), "the inner scope restored the outer budget");
        });
        assert!(take(1 << 40));
    }
}
