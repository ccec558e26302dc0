//! Conversions between wire types (`imdedup_proto::v1`) and domain types.
//! Wire → domain validates; domain → wire cannot fail.

use crate::v1 as pb;

use imdedup_domain::{
    Error, ErrorKind,
    model::{
        Ack, Body, ClientMsgId, ConversationId, HistoryQuery, MessageKey, NewMessage, Outcome,
        Receipt, Sender, StoredMessage,
    },
};

/// Validate the fields of a send. `sender` has already been authenticated by
/// the gateway.
pub fn new_message(
    sender: String,
    client_msg_id: Vec<u8>,
    conversation: String,
    body: String,
    max_body_bytes: usize,
) -> Result<NewMessage, Error> {
    Ok(NewMessage {
        key: MessageKey {
            sender: Sender::parse(sender)?,
            client_msg_id: ClientMsgId::parse(client_msg_id)?,
        },
        conversation: ConversationId::parse(conversation)?,
        body: Body::parse(body, max_body_bytes)?,
    })
}

pub fn send_request(req: pb::SendRequest, max_body_bytes: usize) -> Result<NewMessage, Error> {
    new_message(
        req.sender,
        req.client_msg_id,
        req.conversation,
        req.body,
        max_body_bytes,
    )
}

pub fn insert_request(
    req: pb::InsertOnceRequest,
    max_body_bytes: usize,
) -> Result<NewMessage, Error> {
    new_message(
        req.sender,
        req.client_msg_id,
        req.conversation,
        req.body,
        max_body_bytes,
    )
}

impl From<NewMessage> for pb::InsertOnceRequest {
    fn from(m: NewMessage) -> Self {
        Self {
            sender: m.key.sender.as_str().to_owned(),
            client_msg_id: m.key.client_msg_id.into_bytes(),
            conversation: m.conversation.as_str().to_owned(),
            body: m.body.into_string(),
            trace_context: Default::default(),
            tag: 0,
        }
    }
}

pub fn message_key(sender: String, client_msg_id: Vec<u8>) -> Result<MessageKey, Error> {
    Ok(MessageKey {
        sender: Sender::parse(sender)?,
        client_msg_id: ClientMsgId::parse(client_msg_id)?,
    })
}

pub fn history_request(req: pb::HistoryRequest) -> Result<HistoryQuery, Error> {
    HistoryQuery::new(
        ConversationId::parse(req.conversation)?,
        req.after_seq,
        req.limit,
    )
}

impl From<&HistoryQuery> for pb::HistoryRequest {
    fn from(q: &HistoryQuery) -> Self {
        Self {
            conversation: q.conversation.as_str().to_owned(),
            after_seq: q.after_seq,
            limit: q.limit,
        }
    }
}

impl From<StoredMessage> for pb::StoredMessage {
    fn from(m: StoredMessage) -> Self {
        Self {
            sender: m.key.sender.as_str().to_owned(),
            client_msg_id: m.key.client_msg_id.into_bytes(),
            conversation: m.conversation.as_str().to_owned(),
            body: m.body,
            server_id: m.receipt.server_id,
            seq: m.receipt.seq,
            stored_at_ms: m.stored_at_ms,
        }
    }
}

/// A stored row coming back from storage. Storage is trusted, but a row that
/// does not parse is still an error rather than a panic.
pub fn stored_message(m: pb::StoredMessage) -> Result<StoredMessage, Error> {
    let invalid =
        |e: Error| Error::internal(format!("storage returned a malformed row: {}", e.message()));
    Ok(StoredMessage {
        key: message_key(m.sender, m.client_msg_id).map_err(invalid)?,
        conversation: ConversationId::parse(m.conversation).map_err(invalid)?,
        body: m.body,
        receipt: Receipt {
            server_id: m.server_id,
            seq: m.seq,
        },
        stored_at_ms: m.stored_at_ms,
    })
}

impl From<Outcome> for pb::Outcome {
    fn from(o: Outcome) -> Self {
        match o {
            Outcome::Stored => Self::Stored,
            Outcome::DuplicateWindow => Self::DuplicateWindow,
            Outcome::DuplicateUniqueKey => Self::DuplicateUniqueKey,
        }
    }
}

pub fn outcome(o: pb::Outcome) -> Result<Outcome, Error> {
    match o {
        pb::Outcome::Stored => Ok(Outcome::Stored),
        pb::Outcome::DuplicateWindow => Ok(Outcome::DuplicateWindow),
        pb::Outcome::DuplicateUniqueKey => Ok(Outcome::DuplicateUniqueKey),
        pb::Outcome::Unspecified => Err(Error::internal("ack without an outcome")),
    }
}

impl From<Ack> for pb::Ack {
    fn from(a: Ack) -> Self {
        Self {
            client_msg_id: a.client_msg_id.into_bytes(),
            server_id: a.receipt.server_id,
            seq: a.receipt.seq,
            outcome: pb::Outcome::from(a.outcome).into(),
        }
    }
}

pub fn ack(a: pb::Ack) -> Result<Ack, Error> {
    let outcome = outcome(a.outcome())?;
    Ok(Ack {
        client_msg_id: ClientMsgId::parse(a.client_msg_id)
            .map_err(|e| Error::internal(format!("malformed ack: {}", e.message())))?,
        receipt: Receipt {
            server_id: a.server_id,
            seq: a.seq,
        },
        outcome,
    })
}

impl From<ErrorKind> for pb::ErrorCode {
    fn from(kind: ErrorKind) -> Self {
        match kind {
            ErrorKind::InvalidArgument => Self::InvalidArgument,
            ErrorKind::Unauthenticated => Self::Unauthenticated,
            ErrorKind::PermissionDenied => Self::PermissionDenied,
            ErrorKind::Unavailable => Self::Unavailable,
            ErrorKind::MaybeStored => Self::MaybeStored,
            ErrorKind::DeadlineExceeded => Self::DeadlineExceeded,
            ErrorKind::Overloaded => Self::Overloaded,
            ErrorKind::Internal => Self::Internal,
            ErrorKind::IdReused => Self::IdReused,
        }
    }
}

pub fn error_kind(code: pb::ErrorCode) -> ErrorKind {
    match code {
        pb::ErrorCode::InvalidArgument => ErrorKind::InvalidArgument,
        pb::ErrorCode::Unauthenticated => ErrorKind::Unauthenticated,
        pb::ErrorCode::PermissionDenied => ErrorKind::PermissionDenied,
        pb::ErrorCode::Unavailable => ErrorKind::Unavailable,
        pb::ErrorCode::DeadlineExceeded => ErrorKind::DeadlineExceeded,
        pb::ErrorCode::Overloaded => ErrorKind::Overloaded,
        pb::ErrorCode::Internal | pb::ErrorCode::Unspecified => ErrorKind::Internal,
        pb::ErrorCode::IdReused => ErrorKind::IdReused,
        pb::ErrorCode::MaybeStored => ErrorKind::MaybeStored,
    }
}

impl From<Error> for pb::Error {
    fn from(e: Error) -> Self {
        Self {
            code: pb::ErrorCode::from(e.kind()).into(),
            retryable: e.retryable(),
            message: e.message().to_owned(),
            original_server_id: e.original().map_or(0, |r| r.server_id),
            original_seq: e.original().map_or(0, |r| r.seq),
            retry_after_ms: retry_after_ms(&e),
        }
    }
}

/// An error's retry-after hint in whole ms (0: none).
pub fn retry_after_ms(e: &Error) -> u32 {
    e.retry_after().map_or(0, |d| {
        u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)
    })
}

impl From<pb::Error> for Error {
    fn from(e: pb::Error) -> Self {
        let kind = error_kind(e.code());
        let original = (kind == ErrorKind::IdReused).then_some(Receipt {
            server_id: e.original_server_id,
            seq: e.original_seq,
        });
        let error = Error::new(kind, e.message).with_original(original);
        match e.retry_after_ms {
            0 => error,
            ms => error.with_retry_after(std::time::Duration::from_millis(u64::from(ms))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_send_with_a_bad_field_names_the_field() {
        let err = new_message("ana".into(), vec![], "c".into(), "hi".into(), 100).unwrap_err();
        assert!(err.message().contains("client message id"), "{err}");
        let err = new_message("ana".into(), vec![1], "".into(), "hi".into(), 100).unwrap_err();
        assert!(err.message().contains("conversation"), "{err}");
        let err = new_message("ana".into(), vec![1], "c".into(), "x".repeat(101), 100).unwrap_err();
        assert!(err.message().contains("body"), "{err}");
    }

    #[test]
    fn acks_survive_the_wire() {
        let ack = Ack {
            client_msg_id: ClientMsgId::parse(vec![0, 159, 255]).unwrap(),
            receipt: Receipt {
                server_id: u64::MAX,
                seq: 7,
            },
            outcome: Outcome::DuplicateUniqueKey,
        };
        assert_eq!(super::ack(pb::Ack::from(ack.clone())).unwrap(), ack);
    }
}
