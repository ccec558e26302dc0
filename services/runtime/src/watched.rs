//! A file (or a few files read together) read at start and read again when
//! it changes, for configuration that must change without a restart:
//! groups, token keys, certificates. A Kubernetes ConfigMap or Secret
//! mounted as a directory updates this way. A thread of its own compares
//! the modification times once a second, so a change is in force within
//! about a second whether or not anything uses the value meanwhile, and
//! every reader sees either the old value or the new one, never a mix of
//! callers still on the old value after the new one was read. A change that
//! does not parse is logged and ignored: the last good value stays.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex, RwLock, Weak},
    time::{Duration, SystemTime},
};

use imdedup_domain::Error;

/// How often the files are checked for a change.
pub const RECHECK: Duration = Duration::from_secs(1);

struct Checked {
    read: Vec<Option<SystemTime>>,
    failed: Option<Vec<Option<SystemTime>>>,
}

type Parse<T> = Box<dyn Fn(&[PathBuf]) -> Result<T, Error> + Send + Sync>;

/// The parsed content of a file, kept current.
pub struct WatchedFile<T> {
    inner: Arc<Inner<T>>,
}

struct Inner<T> {
    paths: Vec<PathBuf>,
    parse: Parse<T>,
    value: RwLock<Arc<T>>,
    /// The files' modification times at the last good read, and at the last
    /// read that failed (retried every check, logged once).
    modified: Mutex<Checked>,
}

impl<T: Send + Sync + 'static> WatchedFile<T> {
    /// Read and parse `path` now; an error here is an error at start.
    pub fn open(
        path: impl Into<PathBuf>,
        parse: fn(&Path) -> Result<T, Error>,
    ) -> Result<Self, Error> {
        Self::open_all(vec![path.into()], move |paths| parse(&paths[0]))
    }

    /// Read and parse `paths` together now, and again when any changes.
    pub fn open_all(
        paths: Vec<PathBuf>,
        parse: impl Fn(&[PathBuf]) -> Result<T, Error> + Send + Sync + 'static,
    ) -> Result<Self, Error> {
        let modified = paths.iter().map(|p| modified(p)).collect();
        let value = parse(&paths)?;
        let inner = Arc::new(Inner {
            paths,
            parse: Box::new(parse),
            value: RwLock::new(Arc::new(value)),
            modified: Mutex::new(Checked {
                read: modified,
                failed: None,
            }),
        });
        watch(Arc::downgrade(&inner))?;
        Ok(Self { inner })
    }
}

impl<T> WatchedFile<T> {
    /// The (first) file watched.
    pub fn path(&self) -> &Path {
        &self.inner.paths[0]
    }

    /// The value in force.
    pub fn get(&self) -> Arc<T> {
        Arc::clone(&self.inner.value.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Check the files now rather than at the next tick (a test, or an
    /// operator's signal).
    pub fn check_now(&self) {
        self.inner.reload_if_changed();
    }
}

/// Check the files every [`RECHECK`] on a thread of their own, until the
/// [`WatchedFile`] is dropped.
fn watch<T: Send + Sync + 'static>(inner: Weak<Inner<T>>) -> Result<(), Error> {
    std::thread::Builder::new()
        .name("watched-file".into())
        .spawn(move || {
            loop {
                std::thread::sleep(RECHECK);
                match inner.upgrade() {
                    Some(inner) => inner.reload_if_changed(),
                    None => return,
                }
            }
        })
        .map(drop)
        .map_err(|e| Error::internal(format!("cannot start the file watcher: {e}")))
}

impl<T> Inner<T> {
    fn reload_if_changed(&self) {
        let mut checked = self.modified.lock().unwrap_or_else(|e| e.into_inner());
        let now_modified: Vec<_> = self.paths.iter().map(|p| modified(p)).collect();
        if now_modified == checked.read {
            return;
        }
        let path = self.paths[0].display();
        match (self.parse)(&self.paths) {
            Ok(value) => {
                tracing::info!(%path, "file changed; read again");
                *self.value.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(value);
                *checked = Checked {
                    read: now_modified,
                    failed: None,
                };
            }
            // Read again at the next check: a file caught halfway through a
            // write may be finished within the same modification time.
            Err(e) => {
                if checked.failed.as_ref() != Some(&now_modified) {
                    tracing::warn!(%path, error = %e, "file changed but cannot be used; the previous content stays");
                    checked.failed = Some(now_modified);
                }
            }
        }
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    fn number(path: &Path) -> Result<u32, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::invalid(e.to_string()))?;
        text.trim()
            .parse()
            .map_err(|_| Error::invalid(format!("{text:?} is not a number")))
    }

    /// Write `text` with the modification time `at`.
    fn rewrite(path: &Path, text: &str, at: SystemTime) {
        std::fs::write(path, text).unwrap();
        std::fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(at)
            .unwrap();
    }

    /// A file holding 1, watched; the directory lives as long as it is held.
    fn watching_one() -> (tempfile::TempDir, PathBuf, WatchedFile<u32>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n");
        std::fs::write(&path, "1").unwrap();
        let watched = WatchedFile::open(&path, number).unwrap();
        (dir, path, watched)
    }

    fn later(seconds: u64) -> SystemTime {
        SystemTime::now() + Duration::from_secs(seconds)
    }

    #[test]
    fn a_change_is_read_again_and_a_broken_one_keeps_the_last_good_value() {
        let (_dir, path, watched) = watching_one();
        assert_eq!(*watched.get(), 1);

        rewrite(&path, "2", later(5));
        watched.check_now();
        assert_eq!(*watched.get(), 2);

        rewrite(&path, "two", later(10));
        watched.check_now();
        assert_eq!(*watched.get(), 2, "the last good value stays");
    }

    #[test]
    fn a_change_is_in_force_within_seconds_with_no_one_asking() {
        // Whoever changes the file (a ConfigMap update, the load driver
        // adding its groups) may rely on it being read by then, not on the
        // first use after it, which raced with other users.
        let (_dir, path, watched) = watching_one();
        rewrite(&path, "2", later(5));
        let deadline = Instant::now() + 4 * RECHECK;
        while *watched.get() != 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(*watched.get(), 2, "read within four checks");
    }

    #[test]
    fn a_file_caught_halfway_through_a_write_is_read_again_when_finished() {
        let (_dir, path, watched) = watching_one();
        let at = later(5);
        rewrite(&path, "", at);
        watched.check_now();
        assert_eq!(*watched.get(), 1);
        // The rest of the write lands within the same modification time.
        rewrite(&path, "2", at);
        watched.check_now();
        assert_eq!(*watched.get(), 2);
    }

    #[test]
    fn a_file_that_does_not_parse_or_is_missing_is_an_error_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n");
        std::fs::write(&path, "x").unwrap();
        assert!(WatchedFile::open(&path, number).is_err());
        assert!(WatchedFile::open(dir.path().join("missing"), number).is_err());
    }
}
