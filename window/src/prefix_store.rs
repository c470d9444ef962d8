//! `PrefixStore`: a view of another store with every key under a prefix.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::store::Store;

/// A [`Store`] that puts every key under `prefix` in an inner store, so that
/// several groups (a parent and the groups split from it) share one store
/// without their keys meeting.
#[derive(Debug, Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// Keys `k` become `prefix + k` in `inner`. Nesting prefix stores works; so
    /// does calling [`inner`](Self::inner) and joining the prefixes, which
    /// saves a level of indirection.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore { prefix: prefix.into(), inner }
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The store the keys go to.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn key(&self, k: &str) -> String {
        format!("{}{k}", self.prefix)
    }

    fn keys(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.key(k)).collect()
    }

    /// Reports timeouts with the caller's key, not the prefixed one.
    fn unprefix(&self, e: Error) -> Error {
        match e {
            Error::Timeout { waiting_for, after } => {
                let needle = format!("'{}", self.prefix);
                Error::Timeout { waiting_for: waiting_for.replacen(&needle, "'", 1), after }
            }
            other => other,
        }
    }
}

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.inner.try_get(&self.key(key))
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let keys = self.keys(keys);
        self.inner.multi_get(&refs(&keys), timeout).map_err(|e| self.unprefix(e))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let keys = self.keys(keys);
        self.inner.wait(&refs(&keys), timeout).map_err(|e| self.unprefix(e))
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.inner.check(&refs(&self.keys(keys)))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Option<Vec<u8>>> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }
}
