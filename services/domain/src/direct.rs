//! Direct conversations: `dm:<a>:<b>`, the two members' names sorted
//! (byte order; `a` may equal `b`, a user's notes to self). The name is the
//! membership list, so no lookup is needed, and each pair of users has
//! exactly one direct conversation.

use crate::{
    Error,
    model::{ConversationId, Sender},
};

/// The prefix of every direct conversation; no group may use it.
pub const PREFIX: &str = "dm:";

/// Decides direct conversations from their names.
pub struct DirectConversations;

/// The two members of a direct conversation.
#[derive(Debug, PartialEq, Eq)]
pub struct Pair<'a>(&'a str, &'a str);

impl Pair<'_> {
    pub fn contains(&self, user: &Sender) -> bool {
        user.as_str() == self.0 || user.as_str() == self.1
    }
}

impl DirectConversations {
    /// The name of the direct conversation of `a` and `b`.
    pub fn name(a: &Sender, b: &Sender) -> String {
        let (first, second) = if a <= b { (a, b) } else { (b, a) };
        format!("{PREFIX}{first}:{second}")
    }

    /// `Ok(None)` for a conversation that is not direct; the two members of
    /// a direct one; an `invalid_argument` error for a `dm:` name out of the
    /// canonical form (it tells the caller the form, nothing more).
    pub fn members(conversation: &ConversationId) -> Result<Option<Pair<'_>>, Error> {
        let Some(rest) = conversation.as_str().strip_prefix(PREFIX) else {
            return Ok(None);
        };
        let malformed = || {
            Error::invalid(
                "a direct conversation is named dm:<user>:<user>, the two names sorted \
                 (dm:ana:ben)",
            )
        };
        let (a, b) = rest.split_once(':').ok_or_else(malformed)?;
        if a.is_empty() || b.is_empty() || b.contains(':') || a > b {
            return Err(malformed());
        }
        Ok(Some(Pair(a, b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn parse(name: &str) -> Result<Option<(String, String)>, Error> {
        let conversation = ConversationId::parse(name).unwrap();
        DirectConversations::members(&conversation)
            .map(|pair| pair.map(|Pair(a, b)| (a.to_owned(), b.to_owned())))
    }

    #[test]
    fn a_direct_name_lists_its_members_and_groups_are_not_direct() {
        assert_eq!(
            parse("dm:ana:ben").unwrap(),
            Some(("ana".into(), "ben".into()))
        );
        assert_eq!(
            parse("dm:ana:ana").unwrap(),
            Some(("ana".into(), "ana".into()))
        );
        assert_eq!(parse("team-7").unwrap(), None);
        assert_eq!(parse("dmx:ana:ben").unwrap(), None);
    }

    #[test]
    fn direct_names_out_of_canonical_form_are_refused_so_no_pair_has_two() {
        for name in [
            "dm:ben:ana",
            "dm:ana",
            "dm::ben",
            "dm:ana:",
            "dm:ana:ben:carl",
        ] {
            let error = parse(name).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::InvalidArgument, "{name}");
        }
    }

    #[test]
    fn the_name_of_a_pair_is_the_same_either_way_round() {
        let (ana, ben) = (Sender::parse("ana").unwrap(), Sender::parse("ben").unwrap());
        assert_eq!(DirectConversations::name(&ben, &ana), "dm:ana:ben");
        assert_eq!(DirectConversations::name(&ana, &ben), "dm:ana:ben");
    }
}
