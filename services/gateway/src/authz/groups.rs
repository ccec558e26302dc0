//! Groups from a file, for small deployments and tests: a JSON object from
//! group conversation to its members,
//!
//! ```json
//! { "team-7": ["ana", "ben", "carl"], "ops": ["dana"] }
//! ```
//!
//! The file is read again when it changes (see [`WatchedFile`]), so a
//! Kubernetes ConfigMap update or an edit takes effect without a restart; a
//! change that does not parse is logged and ignored.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::Arc,
};

use async_trait::async_trait;
use imdedup_domain::{
    Error,
    model::{ConversationId, Sender},
};
use imdedup_runtime::watched::WatchedFile;

use super::{Membership, direct};

/// Group conversation → members.
pub type Groups = HashMap<String, HashSet<String>>;

/// Groups read from a JSON file, and read again when it changes.
pub enum GroupsFile {
    Watched(WatchedFile<Groups>),
    /// Fixed groups, never reloaded (tests, the embedded load driver).
    Fixed(Arc<Groups>),
}

impl std::fmt::Debug for GroupsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Watched(file) => write!(f, "GroupsFile({})", file.path().display()),
            Self::Fixed(groups) => write!(f, "GroupsFile({} fixed groups)", groups.len()),
        }
    }
}

impl GroupsFile {
    /// Read `path` now; a missing or malformed file is an error at start.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, Error> {
        WatchedFile::open(path, read).map(Self::Watched)
    }

    /// Fixed groups, never reloaded.
    pub fn fixed(groups: Groups) -> Result<Self, Error> {
        check(&groups)?;
        Ok(Self::Fixed(Arc::new(groups)))
    }

    /// The groups in force, read again first if the file changed.
    pub fn groups(&self) -> Arc<Groups> {
        match self {
            Self::Watched(file) => file.get(),
            Self::Fixed(groups) => Arc::clone(groups),
        }
    }
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
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
            .unwrap();
        let GroupsFile::Watched(file) = &groups else {
            unreachable!("opened from a file")
        };
        file.check_now();
        assert!(ask(&groups, "carl", "team"), "the new member is in");
        assert!(!ask(&groups, "ana", "team"), "the removed member is out");
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
