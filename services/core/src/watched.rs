//! A file (or a few files read together) read at start and read again when
//! it changes (modification times, checked at most once a second, on use),
//! for configuration that must change without a restart: groups, token
//! keys, certificates. A Kubernetes ConfigMap or Secret mounted as a
//! directory updates this way. A change that does not parse is logged and
//! ignored: the last good value stays.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex, RwLock},
    time::{Duration, Instant, SystemTime},
};

use crate::Error;

/// How often the file is checked for a change.
pub const RECHECK: Duration = Duration::from_secs(1);

type Parse<T> = Box<dyn Fn(&[PathBuf]) -> Result<T, Error> + Send + Sync>;

/// The parsed content of a file, kept current.
pub struct WatchedFile<T> {
    paths: Vec<PathBuf>,
    parse: Parse<T>,
    value: RwLock<Arc<T>>,
    /// When the files were last checked, and their modification times then.
    checked: Mutex<(Instant, Vec<Option<SystemTime>>)>,
}

impl<T: 'static> WatchedFile<T> {
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
        Ok(Self {
            paths,
            parse: Box::new(parse),
            value: RwLock::new(Arc::new(value)),
            checked: Mutex::new((Instant::now(), modified)),
        })
    }

    /// The (first) file watched.
    pub fn path(&self) -> &Path {
        &self.paths[0]
    }

    /// The value in force, read again first if the file changed.
    pub fn get(&self) -> Arc<T> {
        self.reload_if_changed();
        Arc::clone(&self.value.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Check the file at the next use, whenever it was last checked.
    pub fn recheck_now(&self) {
        if let Ok(mut checked) = self.checked.lock() {
            checked.0 = Instant::now() - RECHECK;
        }
    }

    fn reload_if_changed(&self) {
        // One caller checks; the others use the value in force.
        let Ok(mut checked) = self.checked.try_lock() else {
            return;
        };
        if checked.0.elapsed() < RECHECK {
            return;
        }
        let now_modified: Vec<_> = self.paths.iter().map(|p| modified(p)).collect();
        let changed = now_modified != checked.1;
        *checked = (Instant::now(), now_modified);
        if !changed {
            return;
        }
        let path = self.path().display();
        match (self.parse)(&self.paths) {
            Ok(value) => {
                tracing::info!(%path, "file changed; read again");
                *self.value.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(value);
            }
            Err(e) => {
                tracing::warn!(%path, error = %e, "file changed but cannot be used; the previous content stays");
            }
        }
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn number(path: &Path) -> Result<u32, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::invalid(e.to_string()))?;
        text.trim()
            .parse()
            .map_err(|_| Error::invalid(format!("{text:?} is not a number")))
    }

    /// Write `text` with a modification time that differs from the last.
    fn rewrite(path: &Path, text: &str, later: u64) {
        std::fs::write(path, text).unwrap();
        std::fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(SystemTime::now() + Duration::from_secs(later))
            .unwrap();
    }

    #[test]
    fn a_change_is_read_again_and_a_broken_one_keeps_the_last_good_value() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n");
        std::fs::write(&path, "1").unwrap();
        let watched = WatchedFile::open(&path, number).unwrap();
        assert_eq!(*watched.get(), 1);

        rewrite(&path, "2", 5);
        assert_eq!(*watched.get(), 1, "not checked again within a second");
        watched.recheck_now();
        assert_eq!(*watched.get(), 2);

        rewrite(&path, "two", 10);
        watched.recheck_now();
        assert_eq!(*watched.get(), 2, "the last good value stays");
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
