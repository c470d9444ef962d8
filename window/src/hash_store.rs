//! `HashStore`: an in-process store (a map behind a mutex and a condition
//! variable). It also holds the TCP store server's data.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::store::{add_counter, check_key, check_keys, check_value, Store};

/// An in-process [`Store`], shared by threads through an `Arc`.
///
/// Useful for groups whose ranks are threads of one process (tests, tools),
/// and it is the data behind a hosting [`TcpStore`](crate::TcpStore).
#[derive(Default)]
pub struct HashStore {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    closed: bool,
}

impl fmt::Debug for HashStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("HashStore").field("keys", &st.map.len()).field("closed", &st.closed).finish()
    }
}

impl HashStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the map half-updated
        // (every update is one map call), so a poisoned lock is still good.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes every waiter with [`Error::Closed`] and refuses later waits.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }

    /// Waits until every key is present; returns the guard, or the first missing key on timeout.
    fn wait_for(&self, op: &'static str, keys: &[&str], timeout: Duration) -> Result<MutexGuard<'_, State>, WaitError> {
        let deadline = Instant::now().checked_add(timeout);
        let mut st = self.lock();
        loop {
            if st.closed {
                return Err(WaitError::Closed(op));
            }
            let Some(missing) = keys.iter().find(|k| !st.map.contains_key(**k)) else { return Ok(st) };
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                return Err(WaitError::Timeout(missing.to_string()));
            }
            st = self.changed.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// `multi_get` that reports a timeout as the missing key, for the TCP
    /// server, and refuses values adding up to more than `max_total` bytes.
    ///
    /// The sum is taken before anything is copied: keys may repeat, so one
    /// small request can name a 64 MiB value 65,536 times, and copying first
    /// would allocate terabytes under the lock before any size check.
    pub(crate) fn multi_get_raw(
        &self,
        keys: &[&str],
        timeout: Duration,
        max_total: usize,
    ) -> Result<Vec<Vec<u8>>, WaitError> {
        let st = self.wait_for("multi_get", keys, timeout)?;
        let total = keys.iter().fold(0usize, |sum, k| sum.saturating_add(st.map[*k].len()));
        if total > max_total {
            return Err(WaitError::TooLarge { total });
        }
        Ok(keys.iter().map(|k| st.map[*k].clone()).collect())
    }

    pub(crate) fn wait_raw(&self, keys: &[&str], timeout: Duration) -> Result<(), WaitError> {
        self.wait_for("wait", keys, timeout).map(drop)
    }
}

/// Why a wait ended without the keys (or, for `multi_get_raw`, without their values).
#[derive(Debug)]
pub(crate) enum WaitError {
    Timeout(String),
    Closed(&'static str),
    /// The keys are all there, but their values add up to `total` bytes, over the caller's limit.
    TooLarge {
        total: usize,
    },
}

impl WaitError {
    fn into_error(self, timeout: Duration) -> Error {
        match self {
            WaitError::Timeout(key) => Error::key_timeout(&key, timeout),
            WaitError::Closed(op) => Error::Closed { op },
            WaitError::TooLarge { total } => {
                Error::invalid("multi_get", format!("the values add up to {total} bytes, more than one call returns"))
            }
        }
    }
}

impl Store for HashStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key("set", key)?;
        check_value("set", value)?;
        self.lock().map.insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        check_key("try_get", key)?;
        Ok(self.lock().map.get(key).cloned())
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        check_keys("multi_get", keys)?;
        // In-process, the caller's own memory is the only limit, as with any `Vec` it asks for.
        self.multi_get_raw(keys, timeout, usize::MAX).map_err(|e| e.into_error(timeout))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        check_keys("wait", keys)?;
        self.wait_raw(keys, timeout).map_err(|e| e.into_error(timeout))
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        check_keys("check", keys)?;
        let st = self.lock();
        Ok(keys.iter().all(|k| st.map.contains_key(*k)))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key("add", key)?;
        let mut st = self.lock();
        let new = add_counter(key, st.map.get(key).map(Vec::as_slice), delta)?;
        st.map.insert(key.to_string(), new.to_string().into_bytes());
        drop(st);
        self.changed.notify_all();
        Ok(new)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Option<Vec<u8>>> {
        check_key("compare_set", key)?;
        check_value("compare_set", desired)?;
        let mut st = self.lock();
        let old = st.map.get(key).cloned();
        if old.as_deref() == expected {
            st.map.insert(key.to_string(), desired.to_vec());
            drop(st);
            self.changed.notify_all();
        }
        Ok(old)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        check_key("delete", key)?;
        Ok(self.lock().map.remove(key).is_some())
    }
}
