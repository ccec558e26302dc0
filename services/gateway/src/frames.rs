//! Client frames: JSON text or protobuf binary in, the same encoding out.
//! Decoding only checks the frame's shape; the fields are validated into
//! domain types by the connection, with the sender from the token.

use std::time::Duration;

use imdedup_domain::{
    Error,
    model::{Ack, StoredMessage},
};
use imdedup_proto::{
    json::{self, ClientJson, ServerJson},
    v1::{self as pb, client_frame, server_frame},
};
use prost::Message as _;

/// How a frame was encoded; replies use the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Json,
    Protobuf,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendCmd {
    pub id: Vec<u8>,
    /// The phone sent `id_b64` (JSON only): answer in the same form.
    pub id_b64: bool,
    pub conversation: String,
    pub body: String,
    /// The phone understands a `queued` answer (see [`Outbound::Queued`]).
    pub queue: bool,
    /// How long the phone has had the message (`age_ms`: since it was
    /// written): a scheduling hint for the admission after a surge.
    pub age: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryCmd {
    pub conversation: String,
    pub after_seq: u64,
    pub limit: u32,
    pub reference: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inbound {
    Send(SendCmd),
    History(HistoryCmd),
}

/// Where an error reply goes: the send or pull it answers, when known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplyTo {
    pub id: Option<Vec<u8>>,
    pub id_b64: bool,
    pub reference: Option<String>,
}

impl ReplyTo {
    pub fn send(cmd: &SendCmd) -> Self {
        Self {
            id: Some(cmd.id.clone()),
            id_b64: cmd.id_b64,
            reference: None,
        }
    }

    pub fn history(cmd: &HistoryCmd) -> Self {
        Self {
            reference: cmd.reference.clone(),
            ..Self::default()
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outbound {
    Ack {
        ack: Ack,
        id_b64: bool,
    },
    Error {
        to: ReplyTo,
        error: Error,
    },
    History {
        reference: Option<String>,
        conversation: String,
        messages: Vec<StoredMessage>,
    },
    /// The gateway holds the send and will answer it later; the phone is
    /// not to resend it before `retry_after`.
    Queued {
        id: Vec<u8>,
        id_b64: bool,
        retry_after: Duration,
    },
}

/// Decode one frame. A frame that cannot be decoded still names, where it
/// can, the send it was meant to be, so the phone can match the error.
pub fn decode(encoding: Encoding, bytes: &[u8]) -> Result<Inbound, (ReplyTo, Error)> {
    match encoding {
        Encoding::Json => decode_json(bytes),
        Encoding::Protobuf => decode_protobuf(bytes),
    }
}

fn decode_json(bytes: &[u8]) -> Result<Inbound, (ReplyTo, Error)> {
    // A well-formed frame is parsed once; only a bad one is read again, to
    // explain what is wrong and which send it was meant to be.
    let frame: ClientJson =
        serde_json::from_slice(bytes).map_err(|e| explain_bad_json(bytes, &e))?;
    match frame {
        ClientJson::Send(send) => {
            let id =
                json::id_from_json(send.id.as_deref(), send.id_b64.as_deref()).map_err(|e| {
                    let to = ReplyTo {
                        id: send.id.as_ref().map(|s| s.as_bytes().to_vec()),
                        ..ReplyTo::default()
                    };
                    (to, Error::invalid(e))
                })?;
            Ok(Inbound::Send(SendCmd {
                id,
                id_b64: send.id_b64.is_some(),
                conversation: send.conversation,
                body: send.body,
                queue: send.queue,
                age: Duration::from_millis(send.age_ms),
            }))
        }
        ClientJson::History(h) => Ok(Inbound::History(HistoryCmd {
            conversation: h.conversation,
            after_seq: h.after_seq,
            limit: h.limit,
            reference: h.reference,
        })),
    }
}

/// Why a text frame is not a client frame, and the send or pull it names.
fn explain_bad_json(bytes: &[u8], typed: &serde_json::Error) -> (ReplyTo, Error) {
    // A lone surrogate escape ("\ud800") is not a Unicode scalar: the frame
    // is refused, but read leniently to find which send it was.
    let lenient = serde_json::from_slice(bytes)
        .or_else(|e| serde_json::from_slice(&replace_lone_surrogates(bytes)).map_err(|_| e));
    let value: serde_json::Value = match lenient {
        Ok(value) => value,
        Err(e) => {
            return (
                ReplyTo::default(),
                Error::invalid(format!("malformed JSON: {e}")),
            );
        }
    };
    let to = ReplyTo {
        id: value
            .get("id")
            .and_then(|v| v.as_str())
            .map(|s| s.as_bytes().to_vec()),
        id_b64: false,
        reference: value.get("ref").and_then(|v| v.as_str()).map(str::to_owned),
    };
    let error = match value.get("type").and_then(|t| t.as_str()) {
        None => Error::invalid("frame has no \"type\""),
        Some("send" | "history") => Error::invalid(format!("malformed frame: {typed}")),
        Some(other) => Error::invalid(format!(
            "unknown frame type {other:?}; expected \"send\" or \"history\""
        )),
    };
    (to, error)
}

/// `bytes` with every `\uXXXX` escape of a lone UTF-16 surrogate replaced
/// by `\ufffd`; surrogate pairs and every other byte are kept as they are.
fn replace_lone_surrogates(bytes: &[u8]) -> Vec<u8> {
    fn unit_at(bytes: &[u8], at: usize) -> Option<u16> {
        let escape = bytes.get(at..at + 6)?;
        if &escape[..2] != b"\\u" {
            return None;
        }
        u16::from_str_radix(std::str::from_utf8(&escape[2..]).ok()?, 16).ok()
    }
    let high = |u: u16| (0xD800..0xDC00).contains(&u);
    let low = |u: u16| (0xDC00..0xE000).contains(&u);
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] != b'\\' {
            out.push(bytes[at]);
            at += 1;
            continue;
        }
        match unit_at(bytes, at) {
            Some(u) if high(u) && unit_at(bytes, at + 6).is_some_and(low) => {
                out.extend_from_slice(&bytes[at..at + 12]);
                at += 12;
            }
            Some(u) if high(u) || low(u) => {
                out.extend_from_slice(b"\\ufffd");
                at += 6;
            }
            // Any other escape, `\\` included: copied whole, so the
            // backslash it escapes never starts an escape of its own.
            _ => {
                out.extend_from_slice(&bytes[at..(at + 2).min(bytes.len())]);
                at += 2;
            }
        }
    }
    out
}

fn decode_protobuf(bytes: &[u8]) -> Result<Inbound, (ReplyTo, Error)> {
    let frame = pb::ClientFrame::decode(bytes).map_err(|e| {
        (
            ReplyTo::default(),
            Error::invalid(format!("malformed protobuf ClientFrame: {e}")),
        )
    })?;
    match frame.kind {
        Some(client_frame::Kind::Send(send)) => Ok(Inbound::Send(SendCmd {
            id: send.client_msg_id,
            id_b64: false,
            conversation: send.conversation,
            body: send.body,
            queue: send.queue,
            age: Duration::from_millis(send.age_ms),
        })),
        Some(client_frame::Kind::History(h)) => Ok(Inbound::History(HistoryCmd {
            conversation: h.conversation,
            after_seq: h.after_seq,
            limit: if h.limit == 0 {
                json::DEFAULT_HISTORY_LIMIT
            } else {
                h.limit
            },
            reference: (!h.r#ref.is_empty()).then_some(h.r#ref),
        })),
        None => Err((
            ReplyTo::default(),
            Error::invalid("ClientFrame has no kind (unknown frame type)"),
        )),
    }
}

/// Encode a reply as a JSON text frame or a protobuf binary frame.
pub enum Encoded {
    Text(String),
    Binary(Vec<u8>),
}

pub fn encode(encoding: Encoding, frame: Outbound) -> Encoded {
    match encoding {
        Encoding::Json => Encoded::Text(
            // Serialising these plain structs cannot fail.
            serde_json::to_string(&to_json(frame)).unwrap_or_default(),
        ),
        Encoding::Protobuf => Encoded::Binary(to_protobuf(frame).encode_to_vec()),
    }
}

fn to_json(frame: Outbound) -> ServerJson {
    match frame {
        Outbound::Ack { ack, id_b64 } => {
            let (id, id_b64) = json::id_to_json(ack.client_msg_id.as_bytes(), id_b64);
            ServerJson::Ack(json::AckJson {
                id,
                id_b64,
                server_id: ack.receipt.server_id.to_string(),
                seq: ack.receipt.seq,
                duplicate: ack.outcome.is_duplicate(),
                outcome: ack.outcome.as_str().to_owned(),
            })
        }
        Outbound::Error { to, error } => {
            let (id, id_b64) = match &to.id {
                Some(bytes) => json::id_to_json(bytes, to.id_b64),
                None => (None, None),
            };
            ServerJson::Error(json::ErrorJson {
                id,
                id_b64,
                reference: to.reference,
                code: error.kind().as_str().to_owned(),
                retryable: error.retryable(),
                message: error.message().to_owned(),
                server_id: error.original().map(|r| r.server_id.to_string()),
                seq: error.original().map(|r| r.seq),
                retry_after_ms: Some(imdedup_proto::convert::retry_after_ms(&error))
                    .filter(|&ms| ms > 0),
            })
        }
        Outbound::History {
            reference,
            conversation,
            messages,
        } => ServerJson::History(json::HistoryPageJson {
            reference,
            conversation,
            messages: messages
                .into_iter()
                .map(|m| {
                    let (id, id_b64) = json::id_to_json(m.key.client_msg_id.as_bytes(), false);
                    json::MessageJson {
                        sender: m.key.sender.as_str().to_owned(),
                        id,
                        id_b64,
                        server_id: m.receipt.server_id.to_string(),
                        seq: m.receipt.seq,
                        body: m.body,
                        stored_at_ms: m.stored_at_ms,
                    }
                })
                .collect(),
        }),
        Outbound::Queued {
            id,
            id_b64,
            retry_after,
        } => {
            let (id, id_b64) = json::id_to_json(&id, id_b64);
            ServerJson::Queued(json::QueuedJson {
                id,
                id_b64,
                retry_after_ms: millis(retry_after),
            })
        }
    }
}

/// A wait in whole milliseconds, rounded up, for the wire.
fn millis(wait: Duration) -> u32 {
    u32::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(u32::MAX)
}

fn to_protobuf(frame: Outbound) -> pb::ServerFrame {
    let kind = match frame {
        Outbound::Ack { ack, .. } => {
            let duplicate = ack.outcome.is_duplicate();
            let ack = pb::Ack::from(ack);
            server_frame::Kind::Ack(pb::AckFrame {
                client_msg_id: ack.client_msg_id,
                server_id: ack.server_id,
                seq: ack.seq,
                duplicate,
                outcome: ack.outcome,
            })
        }
        Outbound::Error { to, error } => server_frame::Kind::Error(pb::ErrorFrame {
            client_msg_id: to.id.unwrap_or_default(),
            r#ref: to.reference.unwrap_or_default(),
            code: pb::ErrorCode::from(error.kind()).into(),
            retryable: error.retryable(),
            message: error.message().to_owned(),
            original_server_id: error.original().map_or(0, |r| r.server_id),
            original_seq: error.original().map_or(0, |r| r.seq),
            retry_after_ms: imdedup_proto::convert::retry_after_ms(&error),
        }),
        Outbound::History {
            reference,
            conversation,
            messages,
        } => server_frame::Kind::History(pb::HistoryPage {
            r#ref: reference.unwrap_or_default(),
            conversation,
            messages: messages.into_iter().map(Into::into).collect(),
        }),
        Outbound::Queued {
            id, retry_after, ..
        } => server_frame::Kind::Queued(pb::QueuedFrame {
            client_msg_id: id,
            retry_after_ms: millis(retry_after),
        }),
    };
    pb::ServerFrame { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_json_is_an_invalid_argument() {
        let (_, err) = decode(Encoding::Json, b"{not json").unwrap_err();
        assert_eq!(err.kind(), imdedup_domain::ErrorKind::InvalidArgument);
        assert!(err.message().contains("malformed JSON"));
    }

    #[test]
    fn an_unknown_type_is_named_and_keeps_the_id() {
        let (to, err) = decode(Encoding::Json, br#"{"type":"edit","id":"m1"}"#).unwrap_err();
        assert!(err.message().contains("\"edit\""), "{err}");
        assert_eq!(to.id.as_deref(), Some(&b"m1"[..]));
    }

    #[test]
    fn a_send_missing_its_body_keeps_the_id() {
        let (to, err) = decode(
            Encoding::Json,
            br#"{"type":"send","id":"m1","conversation":"c"}"#,
        )
        .unwrap_err();
        assert!(err.message().contains("body"), "{err}");
        assert_eq!(to.id.as_deref(), Some(&b"m1"[..]));
    }

    #[test]
    fn a_lone_surrogate_is_refused_but_the_error_names_the_send() {
        let frame = br#"{"type":"send","id":"m-7","conversation":"c","body":"x\ud800y"}"#;
        let (to, error) = decode(Encoding::Json, frame).unwrap_err();
        assert_eq!(to.id.as_deref(), Some(&b"m-7"[..]));
        assert_eq!(error.kind(), imdedup_domain::ErrorKind::InvalidArgument);
        // Pairs and escaped backslashes are left alone.
        assert_eq!(
            replace_lone_surrogates(br#""\ud83d\ude00 \\ud800 \udc00""#),
            br#""\ud83d\ude00 \\ud800 \ufffd""#
        );
    }

    #[test]
    fn garbage_bytes_are_not_a_client_frame() {
        let err = decode(Encoding::Protobuf, &[0xff, 0xff, 0xff])
            .unwrap_err()
            .1;
        assert!(err.message().contains("protobuf"), "{err}");
        let err = decode(Encoding::Protobuf, &[]).unwrap_err().1;
        assert!(err.message().contains("no kind"), "{err}");
    }
}
