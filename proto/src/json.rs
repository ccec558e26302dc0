//! The JSON text frames of the client WebSocket protocol. They carry the same
//! fields as the binary frames in `imdedup/v1/gateway.proto`;
//! `docs/protocol.md` documents both.
//!
//! A client message ID is bytes. In JSON it travels as `id` (a string whose
//! UTF-8 bytes are the ID) or as `id_b64` (standard base64 of the bytes, for
//! IDs that are not UTF-8). Server ids are strings, because they do not fit
//! a JavaScript number.

use base64::{Engine, engine::general_purpose::STANDARD};
use serde::{Deserialize, Serialize};

/// Default page size of a history pull that does not name one.
pub const DEFAULT_HISTORY_LIMIT: u32 = 100;

fn default_limit() -> u32 {
    DEFAULT_HISTORY_LIMIT
}

/// A frame from the phone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClientJson {
    Send(SendJson),
    History(HistoryJson),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendJson {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_b64: Option<String>,
    pub conversation: String,
    pub body: String,
    /// The phone understands a `queued` answer: when the gateway is full it
    /// may hold this send and answer it later instead of refusing it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub queue: bool,
    /// Milliseconds since the phone wrote this message (put it in the
    /// outbox): a scheduling hint after a surge.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub age_ms: u64,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(value: &u64) -> bool {
    *value == 0
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryJson {
    pub conversation: String,
    #[serde(default)]
    pub after_seq: u64,
    #[serde(default = "default_limit")]
    pub limit: u32,
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
}

/// A frame from the gateway.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerJson {
    Ack(AckJson),
    Error(ErrorJson),
    History(HistoryPageJson),
    Queued(QueuedJson),
}

/// The gateway holds the send and will answer it on this connection; do not
/// resend it before `retry_after_ms` (see `QueuedFrame` in gateway.proto).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedJson {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_b64: Option<String>,
    pub retry_after_ms: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AckJson {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_b64: Option<String>,
    pub server_id: String,
    pub seq: u64,
    pub duplicate: bool,
    /// `stored`, `duplicate_window` or `duplicate_unique_key`.
    pub outcome: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorJson {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_b64: Option<String>,
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    pub code: String,
    pub retryable: bool,
    pub message: String,
    /// `id_reused`: the server id of the message stored under this ID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_id: Option<String>,
    /// `id_reused`: the seq of the message stored under this ID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// `overloaded`, `unavailable`: wait at least this many ms before
    /// resending.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryPageJson {
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    pub conversation: String,
    pub messages: Vec<MessageJson>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageJson {
    pub sender: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_b64: Option<String>,
    pub server_id: String,
    pub seq: u64,
    pub body: String,
    pub stored_at_ms: i64,
}

/// The two JSON forms of an ID: `(id, id_b64)`. `id` when the bytes are UTF-8
/// and base64 was not asked for, `id_b64` otherwise.
pub fn id_to_json(bytes: &[u8], prefer_b64: bool) -> (Option<String>, Option<String>) {
    match std::str::from_utf8(bytes) {
        Ok(text) if !prefer_b64 => (Some(text.to_owned()), None),
        _ => (None, Some(STANDARD.encode(bytes))),
    }
}

/// The ID bytes from the JSON fields; exactly one of them must be present.
pub fn id_from_json(id: Option<&str>, id_b64: Option<&str>) -> Result<Vec<u8>, String> {
    match (id, id_b64) {
        (Some(text), None) => Ok(text.as_bytes().to_vec()),
        (None, Some(b64)) => STANDARD
            .decode(b64)
            .map_err(|e| format!("id_b64 is not standard base64: {e}")),
        (Some(_), Some(_)) => Err("give either id or id_b64, not both".to_owned()),
        (None, None) => Err("client message id is missing (id or id_b64)".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_in_both_forms() {
        let raw = [0u8, 0xff, 0x10];
        let (id, b64) = id_to_json(&raw, false);
        assert_eq!(id, None);
        assert_eq!(id_from_json(None, b64.as_deref()).unwrap(), raw);
        let (id, _) = id_to_json(b"msg-1", false);
        assert_eq!(id_from_json(id.as_deref(), None).unwrap(), b"msg-1");
        assert!(id_from_json(Some("a"), Some("YQ==")).is_err());
        assert!(id_from_json(None, None).is_err());
    }

    #[test]
    fn frames_use_the_documented_shape() {
        let frame: ClientJson = serde_json::from_str(
            r#"{"type":"send","id":"m1","conversation":"c","body":"hi","extra":1}"#,
        )
        .unwrap();
        assert_eq!(
            frame,
            ClientJson::Send(SendJson {
                id: Some("m1".into()),
                id_b64: None,
                conversation: "c".into(),
                body: "hi".into(),
                queue: false,
                age_ms: 0,
            })
        );
        let queued: ClientJson = serde_json::from_str(
            r#"{"type":"send","id":"m1","conversation":"c","body":"hi","queue":true}"#,
        )
        .unwrap();
        assert!(matches!(
            queued,
            ClientJson::Send(SendJson { queue: true, .. })
        ));
        let aged: ClientJson = serde_json::from_str(
            r#"{"type":"send","id":"m1","conversation":"c","body":"hi","age_ms":2500}"#,
        )
        .unwrap();
        assert!(matches!(
            aged,
            ClientJson::Send(SendJson { age_ms: 2500, .. })
        ));
        assert!(
            serde_json::from_str::<ClientJson>(
                r#"{"type":"send","id":"m1","conversation":"c","body":"hi","age_ms":-1}"#
            )
            .is_err(),
            "a negative age is a malformed frame"
        );
        let queued = ServerJson::Queued(QueuedJson {
            id: Some("m1".into()),
            id_b64: None,
            retry_after_ms: 1500,
        });
        assert_eq!(
            serde_json::to_string(&queued).unwrap(),
            r#"{"type":"queued","id":"m1","retry_after_ms":1500}"#
        );
        let ack = ServerJson::Ack(AckJson {
            id: Some("m1".into()),
            id_b64: None,
            server_id: "18446744073709551615".into(),
            seq: 3,
            duplicate: true,
            outcome: "duplicate_window".into(),
        });
        assert_eq!(
            serde_json::to_string(&ack).unwrap(),
            r#"{"type":"ack","id":"m1","server_id":"18446744073709551615","seq":3,"duplicate":true,"outcome":"duplicate_window"}"#
        );
    }
}
