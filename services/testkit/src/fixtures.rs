//! Domain values for tests, built from plain strings (the strings must be
//! valid: these panic on what the domain refuses).

use imdedup_domain::model::{
    Body, ClientMsgId, ConversationId, HistoryQuery, MessageKey, NewMessage, Sender,
};

/// The key of `sender`'s message `id`.
pub fn key(sender: &str, id: &str) -> MessageKey {
    MessageKey {
        sender: Sender::parse(sender).expect("a valid sender"),
        client_msg_id: ClientMsgId::parse(id.as_bytes().to_vec()).expect("a valid message id"),
    }
}

/// A new message of `sender` with `id` in `conversation`.
pub fn message(sender: &str, id: &str, conversation: &str, body: &str) -> NewMessage {
    NewMessage {
        key: key(sender, id),
        conversation: ConversationId::parse(conversation).expect("a valid conversation"),
        body: Body::parse(body, 1 << 20).expect("a valid body"),
    }
}

/// A pull of `conversation` after `after_seq`, up to 1,000 messages.
pub fn history(conversation: &str, after_seq: u64) -> HistoryQuery {
    HistoryQuery::new(
        ConversationId::parse(conversation).expect("a valid conversation"),
        after_seq,
        1000,
    )
    .expect("a valid pull")
}

/// A short random tag: names of this run's own on a shared backend.
pub fn tag() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}
