//! The `Store` trait: the small key-value service ranks bootstrap through.

use std::fmt;
use std::time::Duration;

use crate::error::{Error, Result};

/// Longest key a store accepts, in bytes (after any [`PrefixStore`](crate::PrefixStore) prefix).
pub const MAX_KEY_LEN: usize = 4096;
/// Largest value a store accepts, in bytes.
pub const MAX_VALUE_LEN: usize = 64 << 20;
/// Most keys one `multi_get`/`wait`/`check` call may name.
pub const MAX_KEYS: usize = 1 << 16;
/// Most bytes the keys of one `multi_get`/`wait`/`check` call may add up to
/// (so that every such request fits one TCP store frame).
pub const MAX_KEYS_BYTES: usize = MAX_VALUE_LEN;

/// A key-value store shared by the ranks of a job, used to bootstrap groups.
///
/// The API is blocking with explicit timeouts, like torch.distributed's
/// `Store`: bootstrap happens a handful of times per job, from code that is
/// often not async (Python, `main`, a test), and the calls wait on *other
/// processes* rather than on I/O the caller could overlap with. From async code
/// call it in `tokio::task::spawn_blocking`.
///
/// Counters written by [`add`](Store::add) are stored as ASCII decimal, so
/// `get` on a counter returns e.g. `b"3"`.
///
/// All implementations (`HashStore`, `TcpStore`, `FileStore`, `PrefixStore`)
/// pass one conformance suite and enforce the same limits: keys of at most
/// [`MAX_KEY_LEN`] bytes, values of at most [`MAX_VALUE_LEN`] bytes, at most
/// [`MAX_KEYS`] keys adding up to at most [`MAX_KEYS_BYTES`] in one call.
pub trait Store: Send + Sync + fmt::Debug {
    /// Sets `key` to `value`, replacing any earlier value, and wakes waiters.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value of `key`, or `None` at once when it is not set.
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Waits until every key is set (or `timeout` passes) and returns their
    /// values in order. A timeout error names the first missing key.
    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>>;

    /// Waits until every key is set, without fetching the values.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;

    /// Whether every key is set, at once.
    fn check(&self, keys: &[&str]) -> Result<bool>;

    /// Atomically adds `delta` to the counter `key` (absent counts as 0) and
    /// returns the new value. Fails if the key holds something that is not a
    /// decimal integer.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Atomically sets `key` to `desired` if its value is `expected` (`None`:
    /// if it is absent). Returns the value found before, like
    /// `compare_exchange`: the swap happened iff it equals `expected`.
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Option<Vec<u8>>>;

    /// Removes `key`; returns whether it was set.
    fn delete(&self, key: &str) -> Result<bool>;

    /// Waits until `key` is set and returns its value.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        Ok(self.multi_get(&[key], timeout)?.pop().unwrap_or_default())
    }
}

pub(crate) fn check_key(op: &'static str, key: &str) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::invalid(op, format!("key of {} bytes is longer than {MAX_KEY_LEN} bytes", key.len())));
    }
    Ok(())
}

pub(crate) fn check_value(op: &'static str, value: &[u8]) -> Result<()> {
    if value.len() > MAX_VALUE_LEN {
        return Err(Error::invalid(
            op,
            format!("value of {} bytes is larger than {MAX_VALUE_LEN} bytes; store a smaller blob", value.len()),
        ));
    }
    Ok(())
}

pub(crate) fn check_keys(op: &'static str, keys: &[&str]) -> Result<()> {
    if keys.len() > MAX_KEYS {
        return Err(Error::invalid(op, format!("{} keys in one call, at most {MAX_KEYS} allowed", keys.len())));
    }
    keys.iter().try_for_each(|k| check_key(op, k))?;
    let total: usize = keys.iter().map(|k| k.len()).sum();
    if total > MAX_KEYS_BYTES {
        return Err(Error::invalid(
            op,
            format!("the keys of one call add up to {total} bytes, more than {MAX_KEYS_BYTES}; ask in smaller calls"),
        ));
    }
    Ok(())
}

/// Parses a counter value written by `add`.
pub(crate) fn parse_counter(key: &str, value: Option<&[u8]>) -> Result<i64> {
    match value {
        None => Ok(0),
        Some(v) => std::str::from_utf8(v).ok().and_then(|s| s.parse::<i64>().ok()).ok_or_else(|| {
            Error::invalid("add", format!("key '{key}' holds a value that is not a decimal integer; use another key"))
        }),
    }
}

pub(crate) fn add_counter(key: &str, old: Option<&[u8]>, delta: i64) -> Result<i64> {
    parse_counter(key, old)?
        .checked_add(delta)
        .ok_or_else(|| Error::invalid("add", format!("counter '{key}' would overflow i64")))
}
