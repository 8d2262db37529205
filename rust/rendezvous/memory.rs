//! A key-value store in this process's memory: what rank 0's TCP store serves (rank 0 itself uses it
//! directly), and a store for tests. Bounded, since the TCP store fills it with what sockets say.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{KeyValueStore, MAX_VALUE};
use crate::error::{Error, Result};

/// Most keys a store holds (a meeting of n ranks uses n + 3).
pub(crate) const MAX_KEYS: usize = 16 << 10;
/// Longest key.
pub(crate) const MAX_KEY: usize = 1024;

/// A key-value store in memory, shared by the threads that hold it.
#[derive(Default)]
pub struct MemoryStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    fn map(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panic elsewhere while holding the lock leaves a consistent map (every change is one call).
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn insert(&self, key: &str, value: Vec<u8>) -> Result<()> {
        if key.len() > MAX_KEY || value.len() > MAX_VALUE {
            return Err(Error::invalid(format!(
                "a store key is at most {MAX_KEY} bytes and a value at most {MAX_VALUE}: {} and {} given",
                key.len(),
                value.len()
            )));
        }
        let mut map = self.map();
        if map.len() >= MAX_KEYS && !map.contains_key(key) {
            return Err(Error::invalid(format!("the store holds {MAX_KEYS} keys already")));
        }
        map.insert(key.to_string(), value);
        self.changed.notify_all();
        Ok(())
    }
}

impl KeyValueStore for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.insert(key, value.to_vec())
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.map().get(key).cloned())
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        let mut map = self.map();
        loop {
            if keys.iter().all(|k| map.contains_key(*k)) {
                return Ok(true);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            map = self.changed.wait_timeout(map, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        // Held across the read and the write: two adds never see the same sum.
        let mut map = self.map();
        let now = match map.get(key) {
            None => 0,
            // Decimal text, as torch's stores keep counters.
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|t| t.parse::<i64>().ok())
                .ok_or_else(|| Error::invalid(format!("store key {key:?} does not hold a number")))?,
        };
        let sum = now
            .checked_add(delta)
            .ok_or_else(|| Error::invalid(format!("store counter {key:?} overflows")))?;
        if key.len() > MAX_KEY || (map.len() >= MAX_KEYS && !map.contains_key(key)) {
            return Err(Error::invalid("the store is full"));
        }
        map.insert(key.to_string(), sum.to_string().into_bytes());
        self.changed.notify_all();
        Ok(sum)
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.map().remove(key);
        Ok(())
    }

    fn name(&self) -> String {
        "a store in this process".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_add_wait_delete_and_bounds() {
        let s = MemoryStore::new();
        assert_eq!(s.get("k").unwrap(), None);
        assert!(!s.wait(&["k"], Duration::from_millis(1)).unwrap());
        s.set("k", b"v").unwrap();
        assert!(s.wait(&["k"], Duration::ZERO).unwrap());
        assert_eq!(s.get("k").unwrap().as_deref(), Some(&b"v"[..]));
        assert_eq!((s.add("n", 2).unwrap(), s.add("n", -5).unwrap()), (2, -3));
        assert!(s.add("k", 1).is_err(), "not a number");
        s.set("m", i64::MAX.to_string().as_bytes()).unwrap();
        assert!(s.add("m", 1).is_err(), "overflow");
        s.delete("k").unwrap();
        assert_eq!(s.get("k").unwrap(), None);
        assert!(s.set("big", &vec![0; MAX_VALUE + 1]).is_err());
        assert!(s.set(&"k".repeat(MAX_KEY + 1), b"").is_err());
        std::thread::scope(|t| {
            t.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                s.set("late", b"").unwrap();
            });
            assert!(s.wait(&["late", "n"], Duration::from_secs(20)).unwrap());
        });
    }
}
