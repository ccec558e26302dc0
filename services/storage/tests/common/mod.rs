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

pub fn scylla_endpoint() -> Option<String> {
    match std::env::var("IMDEDUP_TEST_SCYLLA") {
        Ok(v) => Some(v),
        Err(_) if std::env::var("IMDEDUP_SKIP_REAL_BACKENDS").as_deref() == Ok("1") => None,
        Err(_) => panic!(
            "IMDEDUP_TEST_SCYLLA is not set: run deploy/local/test.sh (IMDEDUP_SKIP_REAL_BACKENDS=1 skips)"
        ),
    }
}

/// Options for a keyspace of this test's own on the local CQL node.
pub fn scylla_options() -> Option<ScyllaOptions> {
    let mut options = ScyllaOptions::single_node(vec![scylla_endpoint()?]);
    options.keyspace = format!("s{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    Some(options)
}
