//! What a server without dedup does, for the demonstrations that show what
//! dedup prevents (`imdedup demo --no-dedup`, `imdedup dev --no-dedup`,
//! `imdedup-load --embedded --no-dedup`): a window that never remembers and
//! a store without a unique key, so every copy that arrives is stored again.
//! The send path runs unchanged on them; they live here, in the local
//! cluster, and no production backend or service has a switch for it.

use std::{
    collections::HashMap,
    sync::{Mutex, PoisonError},
    time::{SystemTime, UNIX_EPOCH},
};

use async_trait::async_trait;
use imdedup_domain::{
    Error,
    model::{ConversationId, HistoryQuery, MessageKey, NewMessage, Receipt, StoredMessage},
    store::{Insert, MessageStore},
    window::{Claim, ClaimToken, RecentWindow},
};

/// A recent-ID window that remembers nothing: every copy is new to it.
#[derive(Debug, Default)]
pub struct ForgetfulWindow;

#[async_trait]
impl RecentWindow for ForgetfulWindow {
    async fn claim(&self, _key: &MessageKey) -> Result<Claim, Error> {
        Ok(Claim::Owned(ClaimToken(String::new())))
    }

    async fn remember(
        &self,
        _key: &MessageKey,
        _token: &ClaimToken,
        _remembered: imdedup_domain::model::Remembered,
    ) -> Result<(), Error> {
        Ok(())
    }

    async fn release(&self, _key: &MessageKey, _token: &ClaimToken) -> Result<(), Error> {
        Ok(())
    }
}

/// A store without a unique key: every insert stores a row with the next
/// seq of its conversation. In memory, gone when the process ends.
#[derive(Debug, Default)]
pub struct StoreWithoutUniqueKey {
    rows: Mutex<Rows>,
}

#[derive(Debug, Default)]
struct Rows {
    last_server_id: u64,
    /// Each conversation's rows in seq order (seq = position + 1).
    conversations: HashMap<ConversationId, Vec<StoredMessage>>,
    /// Where the first copy of each key is: (conversation, position).
    first_copies: HashMap<MessageKey, (ConversationId, usize)>,
}

impl StoreWithoutUniqueKey {
    pub fn new() -> Self {
        Self::default()
    }

    fn rows(&self) -> std::sync::MutexGuard<'_, Rows> {
        self.rows.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait]
impl MessageStore for StoreWithoutUniqueKey {
    /// Stores every copy: there is no key to find it by.
    async fn insert_once(&self, message: NewMessage) -> Result<Insert, Error> {
        let stored_at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| {
                i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
            });
        let mut rows = self.rows();
        rows.last_server_id += 1;
        let server_id = rows.last_server_id;
        let conversation = rows
            .conversations
            .entry(message.conversation.clone())
            .or_default();
        let position = conversation.len();
        let row = StoredMessage {
            key: message.key,
            conversation: message.conversation,
            body: message.body.as_str().to_owned(),
            receipt: Receipt {
                server_id,
                seq: position as u64 + 1,
            },
            stored_at_ms,
        };
        conversation.push(row.clone());
        rows.first_copies
            .entry(row.key.clone())
            .or_insert_with(|| (row.conversation.clone(), position));
        Ok(Insert::Stored(row))
    }

    async fn lookup(&self, key: &MessageKey) -> Result<Option<StoredMessage>, Error> {
        let rows = self.rows();
        Ok(rows
            .first_copies
            .get(key)
            .and_then(|(conversation, position)| {
                rows.conversations.get(conversation)?.get(*position)
            })
            .cloned())
    }

    async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredMessage>, Error> {
        let rows = self.rows();
        let Some(conversation) = rows.conversations.get(&query.conversation) else {
            return Ok(Vec::new());
        };
        let from = usize::try_from(query.after_seq).unwrap_or(usize::MAX);
        Ok(conversation
            .iter()
            .skip(from)
            .take(query.limit as usize)
            .cloned()
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use imdedup_domain::model::{Body, ClientMsgId, Sender};

    use super::*;

    fn message(id: &str, conversation: &str, body: &str) -> NewMessage {
        NewMessage {
            key: MessageKey {
                sender: Sender::parse("ana").unwrap(),
                client_msg_id: ClientMsgId::parse(id.as_bytes().to_vec()).unwrap(),
            },
            conversation: ConversationId::parse(conversation).unwrap(),
            body: Body::parse(body, 1024).unwrap(),
        }
    }

    #[tokio::test]
    async fn every_copy_is_stored_with_the_next_seq_and_read_back_in_order() {
        let store = StoreWithoutUniqueKey::new();
        let window = ForgetfulWindow;
        let first = message("m1", "dm:ana:ben", "hello");
        for _ in 0..3 {
            assert!(matches!(
                window.claim(&first.key).await.unwrap(),
                Claim::Owned(_)
            ));
            assert!(matches!(
                store.insert_once(first.clone()).await.unwrap(),
                Insert::Stored(_)
            ));
        }
        store
            .insert_once(message("m2", "dm:ana:ben", "again"))
            .await
            .unwrap();
        store
            .insert_once(message("m1", "dm:ana:carl", "elsewhere"))
            .await
            .unwrap();

        let conversation = ConversationId::parse("dm:ana:ben").unwrap();
        let all = store
            .history(&HistoryQuery::new(conversation.clone(), 0, 100).unwrap())
            .await
            .unwrap();
        let seqs: Vec<u64> = all.iter().map(|row| row.receipt.seq).collect();
        assert_eq!(seqs, [1, 2, 3, 4]);
        assert_eq!(all.iter().filter(|row| row.key == first.key).count(), 3);
        let page = store
            .history(&HistoryQuery::new(conversation, 2, 1).unwrap())
            .await
            .unwrap();
        assert_eq!(page[0].receipt.seq, 3);
        // The first copy is what a lookup finds.
        let found = store.lookup(&first.key).await.unwrap().unwrap();
        assert_eq!(found.receipt, all[0].receipt);
    }
}
