//! Per-conversation locks that are never dropped while held or awaited, with
//! a bounded queue per conversation.
//!
//! An evicting cache of locks can drop an entry while a task holds it; the
//! next caller then gets a fresh lock and two inserts run unserialised. Here
//! an entry lives exactly as long as someone holds or waits for it.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
};

use imdedup_domain::{Error, ErrorKind};
use tokio::sync::OwnedMutexGuard;

/// Locks by key, each with at most `max_waiting` callers queued behind its
/// holder.
pub struct LockTable {
    entries: Mutex<HashMap<String, Entry>>,
    max_waiting: usize,
}

struct Entry {
    lock: Arc<tokio::sync::Mutex<()>>,
    /// The holder plus the callers waiting.
    users: usize,
}

/// A held lock; dropping it lets the next caller in (first come, first
/// served) and forgets the key when no one else wants it.
pub struct KeyLock<'a> {
    // Fields drop in order: unlock first, then leave the table.
    _held: OwnedMutexGuard<()>,
    _user: User<'a>,
}

/// One holder or waiter of a key, counted from before it waits, so a caller
/// that gives up while waiting leaves the table too.
struct User<'a> {
    table: &'a LockTable,
    key: String,
}

impl Drop for User<'_> {
    fn drop(&mut self) {
        let mut entries = self.table.entries();
        if let Some(entry) = entries.get_mut(&self.key) {
            entry.users -= 1;
            if entry.users == 0 {
                entries.remove(&self.key);
            }
        }
    }
}

impl LockTable {
    pub fn new(max_waiting: usize) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            max_waiting,
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // The map is consistent after every statement; a panic elsewhere
        // does not make it unusable.
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wait for the lock of `key`; refused with `overloaded` when
    /// `max_waiting` callers already wait for it.
    pub async fn lock(&self, key: &str) -> Result<KeyLock<'_>, Error> {
        let lock = {
            let mut entries = self.entries();
            let entry = entries.entry(key.to_owned()).or_insert_with(|| Entry {
                lock: Arc::new(tokio::sync::Mutex::new(())),
                users: 0,
            });
            if entry.users > self.max_waiting {
                return Err(Error::new(
                    ErrorKind::Overloaded,
                    "too many sends are waiting for this conversation; retry later",
                ));
            }
            entry.users += 1;
            Arc::clone(&entry.lock)
        };
        let user = User {
            table: self,
            key: key.to_owned(),
        };
        Ok(KeyLock {
            _held: lock.lock_owned().await,
            _user: user,
        })
    }

    /// Keys someone holds or waits for.
    pub fn len(&self) -> usize {
        self.entries().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_held_lock_excludes_others_until_released() {
        let table = LockTable::new(8);
        let first = table.lock("c").await.unwrap();
        let second = tokio::time::timeout(Duration::from_millis(50), table.lock("c")).await;
        assert!(second.is_err(), "a second holder got in");
        // Another key is not blocked.
        let other = table.lock("d").await.unwrap();
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(1), table.lock("c"))
            .await
            .expect("released lock was not handed on")
            .unwrap();
        drop((second, other));
        assert!(table.is_empty(), "idle keys are forgotten");
    }

    #[tokio::test]
    async fn many_keys_never_evict_a_held_lock() {
        let table = LockTable::new(8);
        let held = table.lock("c").await.unwrap();
        for i in 0..10_000 {
            drop(table.lock(&format!("k{i}")).await.unwrap());
        }
        assert!(
            tokio::time::timeout(Duration::from_millis(50), table.lock("c"))
                .await
                .is_err(),
            "the held lock was dropped"
        );
        drop(held);
    }

    #[tokio::test]
    async fn the_queue_per_key_is_bounded_and_a_caller_that_gives_up_leaves_it() {
        let table = Arc::new(LockTable::new(2));
        let held = table.lock("c").await.unwrap();
        let mut waiters = Vec::new();
        for _ in 0..2 {
            let table = Arc::clone(&table);
            waiters.push(tokio::spawn(async move {
                drop(table.lock("c").await.unwrap());
            }));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let refused = table
            .lock("c")
            .await
            .err()
            .expect("a third waiter got queued");
        assert_eq!(refused.kind(), ErrorKind::Overloaded);

        // A waiter that gives up frees its place in the queue.
        waiters.pop().unwrap().abort();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let table2 = Arc::clone(&table);
        let late = tokio::spawn(async move { table2.lock("c").await.map(drop) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held);
        late.await.unwrap().unwrap();
        for waiter in waiters {
            waiter.await.unwrap();
        }
        assert!(table.is_empty());
    }
}
