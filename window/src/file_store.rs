//! `FileStore`: a store in a directory of a file system every rank sees.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};

use crate::error::{Error, Result};
use crate::store::{add_counter, check_key, check_keys, check_value, Store, MAX_KEY_LEN, MAX_VALUE_LEN};

/// Names longer than this (after escaping) are replaced by a hash of the key.
const MAX_READABLE_NAME: usize = 180;

/// A [`Store`] kept in a directory (local, NFS, Lustre, ...).
///
/// One file per key, `k_<escaped key>` (or `h_<128-bit hash>` for long keys);
/// each file starts with its key, so that a hash collision is detected, not
/// confused. Every update writes a temporary file and renames it over the
/// key's file, so a reader sees the old or the new value, never half of one;
/// updates also hold an exclusive `flock` on `<dir>/.lock`, which makes `add`
/// and `compare_set` atomic against every other update. Reads take no lock.
/// Waits poll, starting at 1 ms and backing off to 50 ms.
///
/// The directory is not cleaned up: give each job its own (the job id in the
/// path is the usual way), as with torch's `FileStore`.
#[derive(Debug)]
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// Uses (and creates, if needed) the directory `dir`.
    pub fn new(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(|e| file_err(&dir, e))?;
        Ok(FileStore { dir })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn file_of(&self, key: &str) -> PathBuf {
        self.dir.join(file_name(key))
    }

    /// Holds the store-wide update lock until dropped.
    fn lock(&self) -> Result<File> {
        let path = self.dir.join(".lock");
        let f =
            OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(|e| file_err(&path, e))?;
        flock(&f, FlockOperation::LockExclusive).map_err(|e| file_err(&path, e.into()))?;
        Ok(f)
    }

    fn read(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let path = self.file_of(key);
        let mut data = Vec::new();
        // No record is longer than this: a longer file (something else
        // under the store's directory) is refused, not read whole.
        let longest = 4 + MAX_KEY_LEN + MAX_VALUE_LEN;
        match File::open(&path).and_then(|f| f.take(longest as u64 + 1).read_to_end(&mut data)) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(file_err(&path, e)),
        }
        let bad = || Error::File {
            path: path.display().to_string(),
            reason: "the file is not a store record (corrupt, or written by something else)".into(),
        };
        if data.len() > longest {
            return Err(bad());
        }
        let klen = u32::from_le_bytes(data.get(..4).ok_or_else(bad)?.try_into().expect("4 bytes")) as usize;
        let stored_key = data.get(4..4 + klen).ok_or_else(bad)?;
        if stored_key != key.as_bytes() {
            return Err(Error::File {
                path: path.display().to_string(),
                reason: format!(
                    "holds key '{}', not '{key}' (hash collision); use shorter keys",
                    String::from_utf8_lossy(stored_key)
                ),
            });
        }
        data.drain(..4 + klen);
        Ok(Some(data))
    }

    /// Writes a whole record next to the target and renames it over. Call with the lock held.
    fn write(&self, key: &str, value: &[u8]) -> Result<()> {
        let path = self.file_of(key);
        let tmp = self.dir.join(format!(".tmp-{}-{:016x}", std::process::id(), rand::random::<u64>()));
        let result = (|| {
            let mut f = File::create(&tmp)?;
            let mut buf = Vec::with_capacity(4 + key.len() + value.len());
            buf.extend_from_slice(&(key.len() as u32).to_le_bytes());
            buf.extend_from_slice(key.as_bytes());
            buf.extend_from_slice(value);
            f.write_all(&buf)?;
            fs::rename(&tmp, &path)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result.map_err(|e| file_err(&path, e))
    }

    /// Polls until every key is present.
    fn poll<T>(&self, keys: &[&str], timeout: Duration, mut f: impl FnMut(&[&str]) -> Result<Option<T>>) -> Result<T> {
        let start = Instant::now();
        let mut delay = Duration::from_millis(1);
        loop {
            if let Some(t) = f(keys)? {
                return Ok(t);
            }
            if start.elapsed() >= timeout {
                let missing = keys.iter().find(|k| !self.file_of(k).exists()).unwrap_or(&keys[0]);
                return Err(Error::key_timeout(missing, timeout));
            }
            thread::sleep(delay.min(timeout.saturating_sub(start.elapsed())));
            delay = (delay * 2).min(Duration::from_millis(50));
        }
    }
}

fn file_err(path: &Path, e: io::Error) -> Error {
    Error::File { path: path.display().to_string(), reason: e.to_string() }
}

/// A key's file name: readable when short, a hash when not.
fn file_name(key: &str) -> String {
    let mut name = String::with_capacity(2 + key.len());
    name.push_str("k_");
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.' {
            name.push(b as char);
        } else {
            name.push_str(&format!("%{b:02X}"));
        }
        if name.len() > MAX_READABLE_NAME {
            return format!("h_{:032x}", fnv1a128(key.as_bytes()));
        }
    }
    name
}

/// FNV-1a, 128 bit: stable across builds and platforms (std's hasher is not).
fn fnv1a128(data: &[u8]) -> u128 {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013B;
    data.iter().fold(OFFSET, |h, &b| (h ^ u128::from(b)).wrapping_mul(PRIME))
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key("set", key)?;
        check_value("set", value)?;
        let _lock = self.lock()?;
        self.write(key, value)
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        check_key("try_get", key)?;
        self.read(key)
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        check_keys("multi_get", keys)?;
        // Keys found on an earlier poll stay found: values are read once each.
        let mut got: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
        self.poll(keys, timeout, |keys| {
            for (slot, key) in got.iter_mut().zip(keys) {
                if slot.is_none() {
                    *slot = self.read(key)?;
                }
            }
            Ok(got.iter().all(Option::is_some).then(|| got.iter_mut().map(|v| v.take().unwrap_or_default()).collect()))
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        check_keys("wait", keys)?;
        self.poll(keys, timeout, |keys| Ok(keys.iter().all(|k| self.file_of(k).exists()).then_some(())))
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        check_keys("check", keys)?;
        Ok(keys.iter().all(|k| self.file_of(k).exists()))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key("add", key)?;
        let _lock = self.lock()?;
        let new = add_counter(key, self.read(key)?.as_deref(), delta)?;
        self.write(key, new.to_string().as_bytes())?;
        Ok(new)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Option<Vec<u8>>> {
        check_key("compare_set", key)?;
        check_value("compare_set", desired)?;
        let _lock = self.lock()?;
        let old = self.read(key)?;
        if old.as_deref() == expected {
            self.write(key, desired)?;
        }
        Ok(old)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        check_key("delete", key)?;
        let _lock = self.lock()?;
        let path = self.file_of(key);
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(file_err(&path, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_readable_when_short_and_hashed_when_long() {
        assert_eq!(file_name("group/0/x y"), "k_group%2F0%2Fx%20y");
        assert_eq!(file_name(""), "k_");
        let long = "a".repeat(500);
        assert!(file_name(&long).starts_with("h_") && file_name(&long).len() == 34);
        assert_ne!(file_name(&long), file_name(&"a".repeat(501)));
        // Names never hold a path separator or start with a dot.
        assert!(!file_name("../../etc").contains('/'));
    }
}
