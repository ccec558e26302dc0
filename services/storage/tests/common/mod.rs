//! Helpers shared by the store tests.
#![allow(dead_code)]

use imdedup_domain::model::{
    Body, ClientMsgId, ConversationId, HistoryQuery, MessageKey, NewMessage, Sender,
};
use imdedup_storage::ScyllaOptions;

pub fn message(sender: &str, id: &str, conversation: &str, body: &str) -> NewMessage {
    NewMessage {
        key: MessageKey {
            sender: Sender::parse(sender).unwrap(),
            client_msg_id: ClientMsgId::parse(id.as_bytes().to_vec()).unwrap(),
        },
        conversation: ConversationId::parse(conversation).unwrap(),
        body: Body::parse(body, 1 << 20).unwrap(),
    }
}

pub fn history(conversation: &str, after_seq: u64) -> HistoryQuery {
    HistoryQuery::new(
        ConversationId::parse(conversation).unwrap(),
        after_seq,
        1000,
    )
    .unwrap()
}

/// The CQL node (see [`imdedup_testkit::backends`]).
pub fn scylla_endpoint() -> Option<String> {
    imdedup_testkit::backends::real(imdedup_testkit::backends::SCYLLA)
}

/// Options for a keyspace of this test's own on the local CQL node.
pub fn scylla_options() -> Option<ScyllaOptions> {
    let mut options = ScyllaOptions::single_node(vec![scylla_endpoint()?]);
    options.keyspace = format!("s{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    Some(options)
}
