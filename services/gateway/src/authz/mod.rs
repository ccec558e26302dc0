//! Who may send to and read a conversation, decided in the gateway before a
//! send or a history pull goes any further.
//!
//! Direct conversations name their two members (`dm:ana:ben`, sorted), so
//! they are decided without a lookup (`imdedup_domain::direct`, the naming
//! rule). Every other conversation
//! is a group whose members come from a [`Membership`] source: a groups file
//! ([`groups`]) for small deployments and tests, or the deployer's
//! membership service ([`service`]). A refusal is final and says nothing
//! about whether the conversation exists.

pub mod groups;
pub mod service;

use std::sync::Arc;

use async_trait::async_trait;
use imdedup_domain::{
    Error,
    model::{ConversationId, Sender},
};

pub use groups::GroupsFile;
pub use imdedup_domain::direct::{self, DirectConversations};
pub use service::{MembershipService, ServiceOptions};

/// A source of group membership.
#[async_trait]
pub trait Membership: Send + Sync {
    /// Whether `user` belongs to `conversation`. `Err` only when the answer
    /// cannot be had now (a retryable error); an unknown conversation is
    /// `Ok(false)`.
    async fn is_member(&self, user: &Sender, conversation: &ConversationId) -> Result<bool, Error>;
}

/// The gateway's decision on every send and history pull.
#[derive(Clone)]
pub enum Authorizer {
    /// Everyone may send to and read every conversation. For local runs
    /// only; the binary says so loudly at start.
    Open,
    /// Direct conversations by their name; groups by `groups` (without one,
    /// only direct conversations exist).
    Members { groups: Option<Arc<dyn Membership>> },
}

/// The text of every refusal: the same whether the conversation exists or
/// not, so a refusal reveals nothing.
const NOT_A_MEMBER: &str = "you are not a member of this conversation";

impl Authorizer {
    /// Direct conversations, and the groups of `groups`.
    pub fn members(groups: impl Membership + 'static) -> Self {
        Self::Members {
            groups: Some(Arc::new(groups)),
        }
    }

    /// Direct conversations only.
    pub fn direct_only() -> Self {
        Self::Members { groups: None }
    }

    pub fn is_open(&self) -> bool {
        matches!(self, Self::Open)
    }

    /// `Ok` when `user` may send to and read `conversation`; otherwise a
    /// final `permission_denied` (or `invalid_argument` for a direct
    /// conversation named out of the canonical form), or a retryable error
    /// when membership cannot be checked now.
    pub async fn check(&self, user: &Sender, conversation: &ConversationId) -> Result<(), Error> {
        let groups = match self {
            Self::Open => return Ok(()),
            Self::Members { groups } => groups,
        };
        let member = match DirectConversations::members(conversation)? {
            Some(pair) => pair.contains(user),
            None => match groups {
                Some(groups) => groups.is_member(user, conversation).await?,
                None => false,
            },
        };
        if member {
            Ok(())
        } else {
            Err(Error::permission_denied(NOT_A_MEMBER))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use imdedup_domain::ErrorKind;

    fn user(name: &str) -> Sender {
        Sender::parse(name).unwrap()
    }

    fn conversation(name: &str) -> ConversationId {
        ConversationId::parse(name).unwrap()
    }

    #[tokio::test]
    async fn members_of_a_direct_conversation_pass_and_anyone_else_is_refused_alike() {
        let authz = Authorizer::direct_only();
        let dm = conversation("dm:ana:ben");
        authz.check(&user("ana"), &dm).await.unwrap();
        authz.check(&user("ben"), &dm).await.unwrap();
        let outsider = authz.check(&user("carl"), &dm).await.unwrap_err();
        let unknown = authz
            .check(&user("carl"), &conversation("ana-carl"))
            .await
            .unwrap_err();
        assert_eq!(outsider.kind(), ErrorKind::PermissionDenied);
        assert!(!outsider.retryable());
        assert_eq!(
            (outsider.kind(), outsider.message()),
            (unknown.kind(), unknown.message()),
            "a refusal does not tell whether the conversation exists"
        );
    }

    #[tokio::test]
    async fn open_authorization_lets_everyone_in() {
        Authorizer::Open
            .check(&user("carl"), &conversation("dm:ana:ben"))
            .await
            .unwrap();
    }
}
