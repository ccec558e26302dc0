//! The durable message store: the unique key on (sender, client message ID)
//! is the real dedup guarantee. One implementation per backend.

use async_trait::async_trait;

use crate::{
    Error,
    model::{HistoryQuery, MessageKey, NewMessage, StoredMessage},
};

/// The result of an insert-once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Insert {
    /// This call stored the message.
    Stored(StoredMessage),
    /// The key was already stored; here is the original row.
    AlreadyStored(StoredMessage),
}

impl Insert {
    pub fn message(&self) -> &StoredMessage {
        match self {
            Self::Stored(m) | Self::AlreadyStored(m) => m,
        }
    }
}

/// A store with a unique key on (sender, client message ID) and a
/// per-conversation seq.
///
/// Contract, checked by the conformance tests:
/// - `insert_once` returns only after the row is durable; two calls with the
///   same key, concurrent or not, store one row and return the same receipt;
/// - seqs within a conversation are unique and increase in storage order, and
///   a repeat never spends one;
/// - `history` returns rows with `seq > after_seq` in seq order.
#[async_trait]
pub trait MessageStore: Send + Sync + 'static {
    async fn insert_once(&self, message: NewMessage) -> Result<Insert, Error>;

    async fn lookup(&self, key: &MessageKey) -> Result<Option<StoredMessage>, Error>;

    async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredMessage>, Error>;

    /// Wait until inserts that run on their own, past a caller that gave up,
    /// have finished: called at shutdown, so a stop never cuts between an
    /// insert's writes.
    async fn drain(&self) {}
}
