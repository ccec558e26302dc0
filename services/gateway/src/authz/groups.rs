//! Groups from a file, for small deployments and tests: a JSON object from
//! group conversation to its members,
//!
//! ```json
//! { "team-7": ["ana", "ben", "carl"], "ops": ["dana"] }
//! ```
//!
//! The file is read again when it changes (checked at most once a second),
//! so a Kubernetes ConfigMap update or an edit takes effect without a
//! restart. A change that does not parse is logged and ignored: the last
//! good groups stay in force.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, RwLock},
    time::{Duration, Instant, SystemTime},
};

use async_trait::async_trait;
use imdedup_core::{
    Error,
    model::{ConversationId, Sender},
};

use super::{Membership, direct};

/// How often the file is checked for a change.
const RECHECK: Duration = Duration::from_secs(1);

/// Group conversation → members.
pub type Groups = HashMap<String, HashSet<String>>;

/// Groups read from a JSON file, and read again when it changes.
pub struct GroupsFile {
    path: Option<PathBuf>,
    groups: RwLock<Arc<Groups>>,
    /// When the file was last checked, and its modification time then.
    checked: Mutex<(Instant, Option<SystemTime>)>,
}

impl std::fmt::Debug for GroupsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupsFile")
            .field("path", &self.path)
            .field("groups", &self.groups.read().map_or(0, |g| g.len()))
            .finish()
    }
}

impl GroupsFile {
    /// Read `path` now; a missing or malformed file is an error at start.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, Error> {
        let path = path.into();
        let modified = modified(&path);
        let groups = read(&path)?;
        Ok(Self {
            path: Some(path),
            groups: RwLock::new(Arc::new(groups)),
            checked: Mutex::new((Instant::now(), modified)),
        })
    }

    /// Fixed groups, never reloaded (tests, the embedded load driver).
    pub fn fixed(groups: Groups) -> Result<Self, Error> {
        check(&groups)?;
        Ok(Self {
            path: None,
            groups: RwLock::new(Arc::new(groups)),
            checked: Mutex::new((Instant::now(), None)),
        })
    }

    /// The groups in force, read again first if the file changed.
    pub fn groups(&self) -> Arc<Groups> {
        self.reload_if_changed();
        Arc::clone(&self.groups.read().unwrap_or_else(|e| e.into_inner()))
    }

    fn reload_if_changed(&self) {
        let Some(path) = &self.path else { return };
        // One caller checks; the others use the groups in force.
        let Ok(mut checked) = self.checked.try_lock() else {
            return;
        };
        if checked.0.elapsed() < RECHECK {
            return;
        }
        let now_modified = modified(path);
        *checked = (Instant::now(), checked.1);
        if now_modified == checked.1 {
            return;
        }
        match read(path) {
            Ok(groups) => {
                tracing::info!(path = %path.display(), groups = groups.len(), "groups file read again");
                *self.groups.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(groups);
                checked.1 = now_modified;
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "groups file changed but cannot be used; the previous groups stay");
                checked.1 = now_modified;
            }
        }
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn read(path: &Path) -> Result<Groups, Error> {
    let text = std::fs::read(path)
        .map_err(|e| Error::invalid(format!("cannot read groups file {}: {e}", path.display())))?;
    let groups: Groups = serde_json::from_slice(&text).map_err(|e| {
        Error::invalid(format!(
            "groups file {} is not a JSON object of conversation to member list: {e}",
            path.display()
        ))
    })?;
    check(&groups)?;
    Ok(groups)
}

fn check(groups: &Groups) -> Result<(), Error> {
    for (name, members) in groups {
        ConversationId::parse(name.clone())?;
        if name.starts_with(direct::PREFIX) {
            return Err(Error::invalid(format!(
                "group {name:?}: names starting with {:?} are direct conversations",
                direct::PREFIX
            )));
        }
        for member in members {
            Sender::parse(member.clone())
                .map_err(|e| Error::invalid(format!("group {name:?}: {}", e.message())))?;
        }
    }
    Ok(())
}

#[async_trait]
impl Membership for GroupsFile {
    async fn is_member(&self, user: &Sender, conversation: &ConversationId) -> Result<bool, Error> {
        Ok(self
            .groups()
            .get(conversation.as_str())
            .is_some_and(|members| members.contains(user.as_str())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(groups: &GroupsFile, user: &str, conversation: &str) -> bool {
        let user = Sender::parse(user).unwrap();
        let conversation = ConversationId::parse(conversation).unwrap();
        futures_util::FutureExt::now_or_never(groups.is_member(&user, &conversation))
            .unwrap()
            .unwrap()
    }

    #[test]
    fn members_are_read_from_the_file_and_a_change_takes_effect() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("groups.json");
        std::fs::write(&path, r#"{"team": ["ana", "ben"]}"#).unwrap();
        let groups = GroupsFile::open(&path).unwrap();
        assert!(ask(&groups, "ana", "team"));
        assert!(!ask(&groups, "carl", "team"));
        assert!(!ask(&groups, "ana", "other"));

        std::fs::write(&path, r#"{"team": ["ben", "carl"]}"#).unwrap();
        // The modification time must differ from the first write's.
        let later = SystemTime::now() + Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(later)
            .unwrap();
        groups.checked.lock().unwrap().0 = Instant::now() - RECHECK;
        assert!(ask(&groups, "carl", "team"), "the new member is in");
        assert!(!ask(&groups, "ana", "team"), "the removed member is out");
    }

    #[test]
    fn a_broken_change_keeps_the_last_good_groups() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("groups.json");
        std::fs::write(&path, r#"{"team": ["ana"]}"#).unwrap();
        let groups = GroupsFile::open(&path).unwrap();
        std::fs::write(&path, r#"{"team": ["#).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(SystemTime::now() + Duration::from_secs(5))
            .unwrap();
        groups.checked.lock().unwrap().0 = Instant::now() - RECHECK;
        assert!(ask(&groups, "ana", "team"));
    }

    #[test]
    fn a_file_that_names_a_direct_conversation_or_is_not_json_is_refused_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("groups.json");
        std::fs::write(&path, r#"{"dm:ana:ben": ["carl"]}"#).unwrap();
        assert!(
            GroupsFile::open(&path)
                .unwrap_err()
                .message()
                .contains("direct")
        );
        std::fs::write(&path, "team: ana ben").unwrap();
        assert!(GroupsFile::open(&path).is_err());
        assert!(GroupsFile::open(dir.path().join("missing.json")).is_err());
    }
}
