//! Deadlines from caller-given timeouts.

use std::time::{Duration, Instant};

/// A century: later than any wait can last, early enough for the clock.
const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The instant `timeout` from now; a timeout too long for the clock to
/// count (`Duration::MAX`, `u64::MAX` seconds: how callers say "never")
/// gives an instant a century away instead of overflowing.
pub fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout.min(FAR)).unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_past_what_the_clock_counts_is_a_far_deadline() {
        let now = Instant::now();
        assert!(deadline_after(Duration::MAX) > now + Duration::from_secs(3600 * 24 * 365));
        let d = deadline_after(Duration::from_millis(10));
        assert!(d >= now + Duration::from_millis(10) && d < now + Duration::from_secs(60));
    }
}
