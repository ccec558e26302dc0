//! Validated domain types. Wire input becomes one of these once, at the edge;
//! nothing past the edge handles unvalidated bytes.

use std::fmt;

use crate::Error;
pub use crate::receipt::Receipt;

/// Largest client message ID, in bytes. 16 random bytes (or a UUID) is the
/// recommended form.
pub const MAX_CLIENT_MSG_ID_BYTES: usize = 64;
/// Largest sender name, in bytes (the `sub` of a token).
pub const MAX_SENDER_BYTES: usize = 128;
/// Largest idempotency key of the business API, in bytes.
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 255;
/// The prefix of every client message ID derived from a business
/// idempotency key. Reserved: phones may not send IDs that start with it.
pub const BUSINESS_ID_PREFIX: &[u8] = b"bk:";
/// Largest conversation ID, in bytes.
pub const MAX_CONVERSATION_BYTES: usize = 128;
/// Default largest message body, in bytes of UTF-8.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 * 1024;
/// Largest page a history pull may ask for.
pub const MAX_HISTORY_LIMIT: u32 = 1000;

/// A user, as named by a verified token. Never taken from a frame.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sender(String);

impl Sender {
    pub fn parse(raw: impl Into<String>) -> Result<Self, Error> {
        let raw = raw.into();
        check_name("sender", &raw, MAX_SENDER_BYTES)?;
        Ok(Self(raw))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Sender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A conversation (a direct chat or a group): the unit of ordering and of
/// shard ownership.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConversationId(String);

impl ConversationId {
    pub fn parse(raw: impl Into<String>) -> Result<Self, Error> {
        let raw = raw.into();
        check_name("conversation", &raw, MAX_CONVERSATION_BYTES)?;
        Ok(Self(raw))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ConversationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn check_name(what: &str, raw: &str, max: usize) -> Result<(), Error> {
    if raw.is_empty() {
        return Err(Error::invalid(format!("{what} is empty")));
    }
    if raw.len() > max {
        return Err(Error::invalid(format!(
            "{what} is {} bytes, more than the limit of {max}",
            raw.len()
        )));
    }
    if raw.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "{what} contains a control character"
        )));
    }
    Ok(())
}

/// The ID a phone gives a message before its first send and reuses on every
/// resend. Opaque bytes, compared exactly: no case folding, trimming or
/// re-encoding, because merging two different IDs swallows a message.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClientMsgId(Vec<u8>);

impl ClientMsgId {
    pub fn parse(raw: impl Into<Vec<u8>>) -> Result<Self, Error> {
        let raw = raw.into();
        if raw.is_empty() {
            return Err(Error::invalid("client message id is empty"));
        }
        if raw.len() > MAX_CLIENT_MSG_ID_BYTES {
            return Err(Error::invalid(format!(
                "client message id is {} bytes, more than the limit of {MAX_CLIENT_MSG_ID_BYTES}",
                raw.len()
            )));
        }
        Ok(Self(raw))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl ClientMsgId {
    /// The message ID of a business API call: `bk:` and the SHA-256 of the
    /// idempotency key (35 bytes). Deterministic, so every retry of a call,
    /// on any gateway, is the same message to the dedup machinery (window,
    /// in-flight join, unique key); the prefix keeps it apart from every
    /// ID a phone may choose.
    pub fn for_business_key(key: &IdempotencyKey) -> Self {
        use sha2::{Digest, Sha256};
        let mut id = BUSINESS_ID_PREFIX.to_vec();
        id.extend_from_slice(&Sha256::digest(key.as_bytes()));
        Self(id)
    }

    /// Whether the ID is in the space reserved for business keys.
    pub fn is_reserved_for_business(raw: &[u8]) -> bool {
        raw.starts_with(BUSINESS_ID_PREFIX)
    }
}

/// A business system's idempotency key: 1 to 255 bytes, compared exactly.
/// The same key from the same sending account is the same request.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(Vec<u8>);

impl IdempotencyKey {
    pub fn parse(raw: impl Into<Vec<u8>>) -> Result<Self, Error> {
        let raw = raw.into();
        if raw.is_empty() {
            return Err(Error::invalid("idempotency key is empty"));
        }
        if raw.len() > MAX_IDEMPOTENCY_KEY_BYTES {
            return Err(Error::invalid(format!(
                "idempotency key is {} bytes, more than the limit of {MAX_IDEMPOTENCY_KEY_BYTES}",
                raw.len()
            )));
        }
        // HTTP drops the spaces and tabs around a header's value, so
        // "k " could only ever be "k" there: over gRPC too such a key is
        // refused rather than compared as another key than HTTP's.
        let blank = |b: &u8| matches!(b, b' ' | b'\t');
        if raw.first().is_some_and(blank) || raw.last().is_some_and(blank) {
            return Err(Error::invalid(
                "idempotency key begins or ends with a space or tab (HTTP headers cannot carry them)",
            ));
        }
        Ok(Self(raw))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({} bytes)", self.0.len())
    }
}

impl fmt::Debug for ClientMsgId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::str::from_utf8(&self.0) {
            Ok(text) => write!(f, "ClientMsgId({text:?})"),
            Err(_) => write!(f, "ClientMsgId(0x{})", hex(&self.0)),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A message body: UTF-8 text, non-empty, within the configured size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Body(String);

impl Body {
    pub fn parse(raw: impl Into<String>, max_bytes: usize) -> Result<Self, Error> {
        let raw = raw.into();
        if raw.is_empty() {
            return Err(Error::invalid("body is empty"));
        }
        if raw.len() > max_bytes {
            return Err(Error::invalid(format!(
                "body is {} bytes, more than the limit of {max_bytes}",
                raw.len()
            )));
        }
        Ok(Self(raw))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

/// What a message is recognised by: the sender and the phone's message ID.
/// The same ID from two senders is two messages.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MessageKey {
    pub sender: Sender,
    pub client_msg_id: ClientMsgId,
}

impl MessageKey {
    /// An injective byte encoding of the key, for stores that key on one
    /// string (the Redis window): a two-byte big-endian sender length, the
    /// sender, then the ID. Sender `a:b` with ID `c` and sender `a` with ID
    /// `b:c` never meet.
    pub fn to_bytes(&self) -> Vec<u8> {
        let sender = self.sender.as_str().as_bytes();
        let id = self.client_msg_id.as_bytes();
        let mut out = Vec::with_capacity(2 + sender.len() + id.len());
        // MAX_SENDER_BYTES keeps the length well inside a u16.
        out.extend_from_slice(&(sender.len() as u16).to_be_bytes());
        out.extend_from_slice(sender);
        out.extend_from_slice(id);
        out
    }
}

/// A message to store once: validated, with its sender from the token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewMessage {
    pub key: MessageKey,
    pub conversation: ConversationId,
    pub body: Body,
}

impl NewMessage {
    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(&self.conversation, self.body.as_str())
    }
}

/// A 64-bit digest of a message's conversation and body: a true resend has
/// the fingerprint of the original; an ID reused for another message (almost
/// surely) does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub u64);

impl Fingerprint {
    pub fn of(conversation: &ConversationId, body: &str) -> Self {
        Self(crate::routing::stable_hash(&[
            conversation.as_str().as_bytes(),
            body.as_bytes(),
        ]))
    }
}

/// What the recent-ID window remembers of a stored message: its receipt,
/// and its fingerprint when known (entries written before fingerprints were
/// kept have none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Remembered {
    pub receipt: Receipt,
    pub fingerprint: Option<Fingerprint>,
}

/// A message as stored: the original row, returned again for every repeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    pub key: MessageKey,
    pub conversation: ConversationId,
    pub body: String,
    pub receipt: Receipt,
    pub stored_at_ms: i64,
}

impl StoredMessage {
    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(&self.conversation, &self.body)
    }
}

/// How a send was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The first copy, stored now.
    Stored,
    /// A repeat recognised by the recent-ID window; storage was not asked.
    DuplicateWindow,
    /// A repeat recognised by the storage unique key.
    DuplicateUniqueKey,
}

impl Outcome {
    pub fn is_duplicate(self) -> bool {
        !matches!(self, Self::Stored)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::DuplicateWindow => "duplicate_window",
            Self::DuplicateUniqueKey => "duplicate_unique_key",
        }
    }
}

/// The acknowledgement of one send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    pub client_msg_id: ClientMsgId,
    pub receipt: Receipt,
    pub outcome: Outcome,
}

/// A validated history pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryQuery {
    pub conversation: ConversationId,
    pub after_seq: u64,
    pub limit: u32,
}

impl HistoryQuery {
    pub fn new(conversation: ConversationId, after_seq: u64, limit: u32) -> Result<Self, Error> {
        if limit == 0 || limit > MAX_HISTORY_LIMIT {
            return Err(Error::invalid(format!(
                "history limit must be between 1 and {MAX_HISTORY_LIMIT}, got {limit}"
            )));
        }
        Ok(Self {
            conversation,
            after_seq,
            limit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn key(sender: &str, id: &[u8]) -> MessageKey {
        MessageKey {
            sender: Sender::parse(sender).unwrap(),
            client_msg_id: ClientMsgId::parse(id).unwrap(),
        }
    }

    #[test]
    fn key_bytes_are_injective_across_separators() {
        assert_ne!(key("a:b", b"c").to_bytes(), key("a", b"b:c").to_bytes());
        assert_ne!(key("ab", b"c").to_bytes(), key("a", b"bc").to_bytes());
    }

    #[test]
    fn ids_are_compared_exactly() {
        let upper = ClientMsgId::parse(b"ABC".to_vec()).unwrap();
        let lower = ClientMsgId::parse(b"abc".to_vec()).unwrap();
        let padded = ClientMsgId::parse(b" abc".to_vec()).unwrap();
        assert_ne!(upper, lower);
        assert_ne!(lower, padded);
        assert_eq!(padded.as_bytes(), b" abc");
    }

    #[test]
    fn ids_outside_one_to_64_bytes_are_rejected() {
        assert_eq!(
            ClientMsgId::parse(Vec::new()).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert!(ClientMsgId::parse(vec![0xff; 64]).is_ok());
        let err = ClientMsgId::parse(vec![7; 65]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert!(err.message().contains("65 bytes"), "{err}");
    }

    #[test]
    fn a_business_key_gives_one_reserved_id_that_fits() {
        let key = IdempotencyKey::parse(b"order-1234:shipped".to_vec()).unwrap();
        let id = ClientMsgId::for_business_key(&key);
        assert_eq!(id, ClientMsgId::for_business_key(&key), "deterministic");
        assert_eq!(id.as_bytes().len(), 35);
        assert!(id.as_bytes().len() <= MAX_CLIENT_MSG_ID_BYTES);
        assert!(ClientMsgId::is_reserved_for_business(id.as_bytes()));
        assert!(ClientMsgId::parse(id.as_bytes().to_vec()).is_ok());
        // Keys are compared exactly.
        let other = IdempotencyKey::parse(b"Order-1234:shipped".to_vec()).unwrap();
        assert_ne!(ClientMsgId::for_business_key(&other), id);
        assert!(!ClientMsgId::is_reserved_for_business(b"bk"));
        assert!(!ClientMsgId::is_reserved_for_business(b"BK:x"));
    }

    #[test]
    fn idempotency_keys_are_one_to_255_bytes() {
        assert!(IdempotencyKey::parse(Vec::new()).is_err());
        assert!(IdempotencyKey::parse(vec![b'k'; 255]).is_ok());
        let err = IdempotencyKey::parse(vec![b'k'; 256]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert!(err.message().contains("256 bytes"), "{err}");
        assert!(!format!("{:?}", IdempotencyKey::parse("secret-ish").unwrap()).contains("secret"));
    }

    #[test]
    fn an_idempotency_key_http_would_trim_is_refused_not_taken_for_another_key() {
        for key in [" k", "k ", "\tk", "k\t"] {
            let err = IdempotencyKey::parse(key).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{key:?}");
        }
        // Inside the key they are part of it, as in an HTTP header.
        let spaced = IdempotencyKey::parse("order 1234").unwrap();
        assert_eq!(spaced.as_bytes(), b"order 1234");
    }

    #[test]
    fn bodies_are_bounded() {
        assert!(Body::parse("", 10).is_err());
        assert!(Body::parse("0123456789", 10).is_ok());
        assert!(Body::parse("0123456789a", 10).is_err());
    }

    #[test]
    fn names_reject_empty_oversized_and_control_characters() {
        assert!(ConversationId::parse("").is_err());
        assert!(ConversationId::parse("x".repeat(129)).is_err());
        assert!(ConversationId::parse("a\nb").is_err());
        assert!(Sender::parse("ana").is_ok());
    }

    #[test]
    fn history_limit_is_bounded() {
        let conv = ConversationId::parse("c").unwrap();
        assert!(HistoryQuery::new(conv.clone(), 0, 0).is_err());
        assert!(HistoryQuery::new(conv.clone(), 0, MAX_HISTORY_LIMIT + 1).is_err());
        assert!(HistoryQuery::new(conv, 5, 10).is_ok());
    }
}
