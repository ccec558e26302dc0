//! Property tests of the gateway's client frames (`frames::decode` and
//! `frames::encode`, JSON text and protobuf binary) and of the names of
//! direct conversations (`imdedup_domain::direct`, and the `Authorizer` deciding on
//! them).
//!
//! - Any bytes, in either encoding, decode without a panic; what is refused
//!   is `invalid_argument`, and the error, encoded back as the error frame
//!   the phone gets, is a well-formed `ServerFrame` / JSON error frame with
//!   the code and the `retryable` flag of the protocol's table
//!   (docs/protocol.md), and names the send (`id`) or pull (`ref`) the
//!   frame carried, never one it did not.
//! - What a JSON frame decodes to is exactly what its JSON says, with the
//!   documented defaults; generated valid frames of both encodings decode
//!   to the command they were made from; replies survive `encode`.
//! - A direct conversation is named `dm:<a>:<b>`, sorted; only that form is
//!   accepted, only its two members pass, and everyone else is refused alike.
//!
//! The number of cases is proptest's (256), or `PROPTEST_CASES`.

use std::time::Duration;

use base64::{Engine, engine::general_purpose::STANDARD};
use imdedup_domain::{
    Error, ErrorKind,
    model::{
        Ack, ClientMsgId, ConversationId, MessageKey, Outcome, Receipt, Sender, StoredMessage,
    },
};
use imdedup_gateway::{
    authz::{Authorizer, DirectConversations},
    frames::{self, Encoded, Encoding, HistoryCmd, Inbound, Outbound, ReplyTo, SendCmd},
};
use imdedup_proto::{
    json::{DEFAULT_HISTORY_LIMIT, ServerJson},
    v1::{self as pb, client_frame, server_frame},
};
use proptest::{prelude::*, test_runner::TestCaseResult};
use prost::Message as _;
use serde_json::{Map, Value, json};

// ---------------------------------------------------------------------------
// The protocol as docs/protocol.md states it

/// Every error code of the client protocol and its `retryable` flag.
const CODES: [(&str, bool); 9] = [
    ("invalid_argument", false),
    ("unauthenticated", false),
    ("permission_denied", false),
    ("unavailable", true),
    ("maybe_stored", true),
    ("deadline_exceeded", true),
    ("overloaded", true),
    ("internal", true),
    ("id_reused", false),
];

fn retryable_of(code: &str) -> Option<bool> {
    CODES.iter().find(|(c, _)| *c == code).map(|(_, r)| *r)
}

/// The JSON name of a protobuf error code: `ERROR_CODE_ID_REUSED` is
/// `id_reused`.
fn code_of_protobuf(code: i32) -> Option<String> {
    let name = pb::ErrorCode::try_from(code).ok()?.as_str_name();
    Some(name.strip_prefix("ERROR_CODE_")?.to_ascii_lowercase())
}

/// The bytes an `id` / `id_b64` pair of a server JSON frame names.
fn json_id(frame: &Value) -> Result<Option<Vec<u8>>, TestCaseError> {
    match (frame.get("id"), frame.get("id_b64")) {
        (None, None) => Ok(None),
        (Some(Value::String(id)), None) => Ok(Some(id.as_bytes().to_vec())),
        (None, Some(Value::String(b64))) => {
            let bytes = STANDARD
                .decode(b64)
                .map_err(|e| TestCaseError::fail(format!("id_b64 {b64:?}: {e}")))?;
            Ok(Some(bytes))
        }
        _ => Err(TestCaseError::fail(format!("bad id fields in {frame}"))),
    }
}

/// The error frame the phone gets for `error`, answering `to`, checked to
/// be a well-formed frame of `encoding` that carries the error's code,
/// `retryable` flag and message, and exactly `to`'s id and ref.
fn check_error_frame(encoding: Encoding, to: &ReplyTo, error: &Error) -> TestCaseResult {
    let encoded = frames::encode(
        encoding,
        Outbound::Error {
            to: to.clone(),
            error: error.clone(),
        },
    );
    let code = error.kind().as_str();
    let retryable = retryable_of(code).expect("a documented code");
    prop_assert_eq!(error.retryable(), retryable, "{}", code);
    match (encoding, encoded) {
        (Encoding::Json, Encoded::Text(text)) => {
            let frame: Value = serde_json::from_str(&text)
                .map_err(|e| TestCaseError::fail(format!("not JSON: {e}: {text}")))?;
            prop_assert_eq!(&frame["type"], "error", "{}", text);
            prop_assert_eq!(&frame["code"], code, "{}", text);
            prop_assert_eq!(&frame["retryable"], &json!(retryable), "{}", text);
            prop_assert_eq!(&frame["message"], error.message(), "{}", text);
            prop_assert_eq!(json_id(&frame)?, to.id.clone(), "{}", text);
            prop_assert_eq!(
                frame.get("ref").and_then(Value::as_str),
                to.reference.as_deref(),
                "{}",
                text
            );
            // And it is the protocol's error frame, read as a client does.
            let typed: ServerJson = serde_json::from_str(&text)
                .map_err(|e| TestCaseError::fail(format!("not a ServerJson: {e}: {text}")))?;
            prop_assert!(matches!(typed, ServerJson::Error(_)), "{}", text);
        }
        (Encoding::Protobuf, Encoded::Binary(bytes)) => {
            let frame = pb::ServerFrame::decode(&bytes[..])
                .map_err(|e| TestCaseError::fail(format!("not a ServerFrame: {e}")))?;
            let Some(server_frame::Kind::Error(e)) = frame.kind else {
                return Err(TestCaseError::fail(format!("not an error: {frame:?}")));
            };
            let pb_code = code_of_protobuf(e.code);
            prop_assert_eq!(pb_code.as_deref(), Some(code));
            prop_assert_eq!(e.retryable, retryable);
            prop_assert_eq!(&e.message, error.message());
            // Protobuf has no "absent": an empty ID or ref is none.
            prop_assert_eq!(&e.client_msg_id, &to.id.clone().unwrap_or_default());
            prop_assert_eq!(&e.r#ref, &to.reference.clone().unwrap_or_default());
        }
        (encoding, _) => {
            return Err(TestCaseError::fail(format!(
                "a {encoding:?} frame answered in the other encoding"
            )));
        }
    }
    Ok(())
}

/// A frame refused by `decode`: `invalid_argument` with a reason, and an
/// error frame that is itself well formed.
fn check_refusal(encoding: Encoding, to: &ReplyTo, error: &Error) -> TestCaseResult {
    prop_assert_eq!(error.kind(), ErrorKind::InvalidArgument, "{}", error);
    prop_assert!(!error.message().is_empty());
    check_error_frame(encoding, to, error)
}

fn str_field<'a>(frame: &'a Value, name: &str) -> Option<&'a str> {
    frame.get(name).and_then(Value::as_str)
}

/// A field given a value (`null` counts as absent, as serde reads it).
fn present<'a>(frame: &'a Value, name: &str) -> Option<&'a Value> {
    frame.get(name).filter(|v| !v.is_null())
}

/// What `decode` made of a JSON text frame, against what the frame says:
/// a decoded command is the frame's fields (with the documented defaults);
/// a refusal names the frame's `id` and never a `ref` it did not carry.
fn check_json_decode(bytes: &[u8]) -> TestCaseResult {
    let result = frames::decode(Encoding::Json, bytes);
    let parsed: Option<Value> = serde_json::from_slice(bytes).ok();
    match result {
        Ok(inbound) => {
            let frame = parsed.expect("a frame that is not JSON was decoded");
            match inbound {
                Inbound::Send(cmd) => {
                    prop_assert_eq!(&frame["type"], "send");
                    prop_assert_eq!(str_field(&frame, "conversation"), Some(&*cmd.conversation));
                    prop_assert_eq!(str_field(&frame, "body"), Some(&*cmd.body));
                    let (id, id_b64) = (present(&frame, "id"), present(&frame, "id_b64"));
                    if cmd.id_b64 {
                        prop_assert!(id.is_none(), "both id forms accepted: {}", frame);
                        let b64 = id_b64.and_then(Value::as_str).expect("id_b64 is a string");
                        prop_assert_eq!(STANDARD.decode(b64).ok(), Some(cmd.id.clone()));
                    } else {
                        prop_assert!(id_b64.is_none(), "both id forms accepted: {}", frame);
                        let id = id.and_then(Value::as_str).expect("id is a string");
                        prop_assert_eq!(id.as_bytes(), &cmd.id[..]);
                    }
                }
                Inbound::History(cmd) => {
                    prop_assert_eq!(&frame["type"], "history");
                    prop_assert_eq!(str_field(&frame, "conversation"), Some(&*cmd.conversation));
                    let number = |name: &str, default: u64| match frame.get(name) {
                        None => Some(default),
                        Some(v) => v.as_u64(),
                    };
                    prop_assert_eq!(number("after_seq", 0), Some(cmd.after_seq));
                    prop_assert_eq!(
                        number("limit", DEFAULT_HISTORY_LIMIT.into()),
                        Some(u64::from(cmd.limit))
                    );
                    prop_assert_eq!(str_field(&frame, "ref"), cmd.reference.as_deref());
                }
            }
        }
        Err((to, error)) => {
            check_refusal(Encoding::Json, &to, &error)?;
            if let Some(frame) = parsed {
                let id = str_field(&frame, "id").map(|s| s.as_bytes().to_vec());
                prop_assert_eq!(&to.id, &id, "the error names the frame's id: {}", frame);
                let reference = str_field(&frame, "ref");
                if to.reference.is_some() || frame["type"] == "history" {
                    prop_assert_eq!(to.reference.as_deref(), reference, "{}", frame);
                }
            }
        }
    }
    Ok(())
}

/// Whether `needle` occurs in `haystack`.
fn contains_slice(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

/// What `decode` made of a binary frame: the documented defaults hold for
/// a decoded pull; a refusal echoes nothing that is not in the frame.
fn check_protobuf_decode(bytes: &[u8]) -> TestCaseResult {
    match frames::decode(Encoding::Protobuf, bytes) {
        Ok(Inbound::Send(cmd)) => prop_assert!(!cmd.id_b64),
        Ok(Inbound::History(cmd)) => {
            prop_assert!(cmd.limit != 0, "limit 0 stands for the default");
            prop_assert_ne!(cmd.reference.as_deref(), Some(""), "an empty ref is none");
        }
        Err((to, error)) => {
            check_refusal(Encoding::Protobuf, &to, &error)?;
            for echoed in [to.id.as_deref(), to.reference.as_deref().map(str::as_bytes)]
                .into_iter()
                .flatten()
            {
                prop_assert!(contains_slice(bytes, echoed), "invented {:?}", echoed);
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Strategies

/// Strings of every kind, with characters JSON escapes and U+E000, which
/// [`json_text`] may turn into a lone surrogate escape.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-z0-9:._-]{0,10}",
        2 => any::<String>(),
        2 => prop::collection::vec(
            prop_oneof![
                4 => prop::char::range('a', 'e'),
                1 => prop::sample::select(vec!['"', '\\', '/', '\u{0}', '\n', '\u{7f}', 'é', '😀', ':', '\u{e000}']),
            ],
            0..24,
        )
        .prop_map(|c| c.into_iter().collect()),
    ]
}

/// Any JSON scalar.
fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        Just(json!(1e30)),
        text().prop_map(Value::from),
    ]
}

/// Any JSON value, nested a little.
fn value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{0,6}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A field: mostly of the right kind, sometimes missing or of another.
fn field(right: impl Strategy<Value = Value>) -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        2 => Just(None),
        6 => right.prop_map(Some),
        1 => value().prop_map(Some),
    ]
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0u64..2000).prop_map(Value::from),
        any::<u32>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (i64::MIN..0).prop_map(Value::from),
        Just(json!(2.5)),
        Just(json!("10")),
    ]
}

fn base64_id() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..80).prop_map(|b| Value::from(STANDARD.encode(b))),
        "[A-Za-z0-9+/=_-]{0,12}".prop_map(Value::from),
    ]
}

/// Client frames of every shape: the known fields, each right, missing or
/// wrong, and unknown fields.
fn frame_object() -> impl Strategy<Value = Value> {
    (
        field(prop_oneof![
            3 => Just(json!("send")),
            3 => Just(json!("history")),
            1 => prop::sample::select(vec!["edit", "Send", "send ", "ack", ""]).prop_map(Value::from),
            1 => text().prop_map(Value::from),
        ]),
        field(text().prop_map(Value::from)),
        prop_oneof![3 => Just(None), 1 => field(base64_id())],
        field(text().prop_map(Value::from)),
        field(text().prop_map(Value::from)),
        field(number()),
        field(number()),
        field(text().prop_map(Value::from)),
        prop::collection::vec(("[a-z_]{1,8}", value()), 0..2),
    )
        .prop_map(
            |(kind, id, id_b64, conversation, body, after_seq, limit, reference, extra)| {
                let mut frame = Map::new();
                for (name, value) in extra {
                    frame.insert(name, value);
                }
                for (name, value) in [
                    ("type", kind),
                    ("id", id),
                    ("id_b64", id_b64),
                    ("conversation", conversation),
                    ("body", body),
                    ("after_seq", after_seq),
                    ("limit", limit),
                    ("ref", reference),
                ] {
                    if let Some(value) = value {
                        frame.insert(name.to_owned(), value);
                    }
                }
                Value::Object(frame)
            },
        )
}

/// What U+E000 becomes in the text of a frame: lone surrogate escapes, a
/// valid pair, an escaped backslash before a "surrogate", or itself.
fn surrogate() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        r"\ud800",
        r"\udfff",
        r"\udc00\ud800",
        r"\ud83d\ude00",
        r"\ud83d",
        r"\\ud800",
        r"\u0041",
        "\u{e000}",
    ])
}

/// Text frames: JSON frames of every shape, as serialised or damaged (cut
/// short, a byte changed, a key repeated), with lone surrogates, and
/// strings that are not JSON at all.
fn json_text() -> impl Strategy<Value = Vec<u8>> {
    let damaged = (
        frame_object(),
        surrogate(),
        0usize..8,
        any::<prop::sample::Index>(),
        any::<u8>(),
    )
        .prop_map(|(frame, surrogate, damage, at, byte)| {
            let text = serde_json::to_string(&frame)
                .unwrap()
                .replace('\u{e000}', surrogate);
            let mut bytes = text.into_bytes();
            let i = at.index(bytes.len());
            match damage {
                0 => bytes.truncate(i),
                1 => bytes[i] = byte,
                2 => {
                    // A repeated key: the last one wins in a lenient read.
                    bytes.pop();
                    bytes.extend_from_slice(br#","id":"again"}"#);
                }
                _ => {}
            }
            bytes
        });
    prop_oneof![
        8 => damaged,
        1 => any::<String>().prop_map(String::into_bytes),
        1 => "[\\[\\]{}\":,\\\\u0-9a-f dtypesnd]{0,40}".prop_map(String::into_bytes),
        1 => prop::collection::vec(any::<u8>(), 0..64),
    ]
}

fn id() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        "[a-z0-9-]{0,20}".prop_map(String::into_bytes),
        prop::collection::vec(any::<u8>(), 0..80),
    ]
}

fn send_cmd() -> impl Strategy<Value = SendCmd> {
    (
        id(),
        any::<bool>(),
        text(),
        text(),
        any::<bool>(),
        prop::option::of(any::<u64>()),
    )
        .prop_map(|(id, b64, conversation, body, queue, age_ms)| SendCmd {
            // JSON carries an ID that is not UTF-8 only as id_b64.
            id_b64: b64 || std::str::from_utf8(&id).is_err(),
            id,
            conversation,
            body,
            queue,
            age: Duration::from_millis(age_ms.unwrap_or(0)),
        })
}

/// A history pull as a phone writes it: any field may be left out.
#[derive(Debug, Clone)]
struct Pull {
    conversation: String,
    after_seq: Option<u64>,
    limit: Option<u32>,
    reference: Option<String>,
}

fn pull() -> impl Strategy<Value = Pull> {
    (
        text(),
        prop::option::of(any::<u64>()),
        prop::option::of(prop_oneof![0u32..2000, any::<u32>()]),
        prop::option::of(text()),
    )
        .prop_map(|(conversation, after_seq, limit, reference)| Pull {
            conversation,
            after_seq,
            limit,
            reference,
        })
}

/// Protobuf frames: real `ClientFrame`s, damaged ones, and any bytes.
fn protobuf_bytes() -> impl Strategy<Value = Vec<u8>> {
    let real = prop_oneof![
        send_cmd().prop_map(|c| client_frame::Kind::Send(pb::SendFrame {
            client_msg_id: c.id,
            conversation: c.conversation,
            body: c.body,
            queue: c.queue,
            age_ms: u64::try_from(c.age.as_millis()).unwrap(),
        })),
        pull().prop_map(|p| client_frame::Kind::History(pb::HistoryFrame {
            conversation: p.conversation,
            after_seq: p.after_seq.unwrap_or_default(),
            limit: p.limit.unwrap_or_default(),
            r#ref: p.reference.unwrap_or_default(),
        })),
    ]
    .prop_map(|kind| pb::ClientFrame { kind: Some(kind) }.encode_to_vec())
    .boxed();
    let damaged = (
        real.clone(),
        0usize..4,
        any::<prop::sample::Index>(),
        any::<u8>(),
    )
        .prop_map(|(mut bytes, damage, at, byte)| {
            if !bytes.is_empty() {
                let i = at.index(bytes.len());
                match damage {
                    0 => bytes.truncate(i),
                    1 => bytes[i] = byte,
                    2 => bytes.insert(i, byte),
                    _ => bytes.extend_from_slice(&[byte, byte]),
                }
            }
            bytes
        });
    prop_oneof![
        1 => real,
        3 => damaged,
        2 => prop::collection::vec(any::<u8>(), 0..64),
    ]
}

/// `raw` made a valid name (sender or conversation): control characters
/// dropped, cut to 128 bytes, `u` when nothing is left. Mapping rather than
/// filtering keeps long runs from giving up on rejected inputs.
fn valid_name(raw: &str) -> String {
    let mut name = String::new();
    for c in raw.chars().filter(|c| !c.is_control()) {
        if name.len() + c.len_utf8() > 128 {
            break;
        }
        name.push(c);
    }
    if name.is_empty() {
        name.push('u');
    }
    name
}

fn sender() -> impl Strategy<Value = Sender> {
    prop_oneof!["[a-z][a-z0-9:._-]{0,12}", any::<String>()]
        .prop_map(|s| Sender::parse(valid_name(&s)).unwrap())
}

fn msg_id() -> impl Strategy<Value = ClientMsgId> {
    prop_oneof![
        "[a-z0-9-]{1,20}".prop_map(String::into_bytes),
        prop::collection::vec(any::<u8>(), 1..=64),
    ]
    .prop_map(|id| ClientMsgId::parse(id).unwrap())
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop::sample::select(vec![
        Outcome::Stored,
        Outcome::DuplicateWindow,
        Outcome::DuplicateUniqueKey,
    ])
}

fn stored_message() -> impl Strategy<Value = StoredMessage> {
    (
        sender(),
        msg_id(),
        "[a-z:]{1,12}",
        text(),
        any::<u64>(),
        any::<u64>(),
        any::<i64>(),
    )
        .prop_map(
            |(sender, client_msg_id, conversation, body, server_id, seq, stored_at_ms)| {
                StoredMessage {
                    key: MessageKey {
                        sender,
                        client_msg_id,
                    },
                    conversation: ConversationId::parse(conversation).unwrap(),
                    body,
                    receipt: Receipt { server_id, seq },
                    stored_at_ms,
                }
            },
        )
}

fn error() -> impl Strategy<Value = Error> {
    (
        prop::sample::select(ErrorKind::ALL.to_vec()),
        text(),
        any::<(u64, u64)>(),
    )
        .prop_map(|(kind, message, (server_id, seq))| {
            if kind == ErrorKind::IdReused {
                Error::id_reused(Receipt { server_id, seq })
            } else {
                Error::new(kind, message)
            }
        })
}

fn reply_to() -> impl Strategy<Value = ReplyTo> {
    (
        prop::option::of(id()),
        any::<bool>(),
        prop::option::of(text()),
    )
        .prop_map(|(id, id_b64, reference)| ReplyTo {
            id,
            id_b64,
            reference,
        })
}

// ---------------------------------------------------------------------------
// Frames

proptest! {
    /// Any text frame: no panic; a decoded frame is what its JSON says; a
    /// refused one gets a well-formed error frame naming its id and ref.
    #[test]
    fn any_text_frame_is_decoded_as_its_json_says_or_refused_well(bytes in json_text()) {
        check_json_decode(&bytes)?;
    }

    /// Any binary frame: no panic; a refused one gets a well-formed error
    /// frame that echoes nothing the frame did not carry.
    #[test]
    fn any_binary_frame_is_decoded_or_refused_well(bytes in protobuf_bytes()) {
        check_protobuf_decode(&bytes)?;
    }

    /// A send whose JSON is broken only by lone surrogate escapes is
    /// refused, by its id, so the phone can match the error.
    #[test]
    fn a_send_with_lone_surrogates_is_refused_by_its_id(
        id in "[a-z0-9-]{1,20}",
        conversation in text(),
        body in text(),
        surrogate in prop::sample::select(vec![r"\ud800", r"\udfff", r"\udc00\ud800", r"\ud83d"]),
    ) {
        let text = serde_json::to_string(&json!({
            "type": "send", "id": id, "conversation": conversation, "body": format!("{body}\u{e000}"),
        }))
        .unwrap()
        .replace('\u{e000}', surrogate);
        let (to, error) = frames::decode(Encoding::Json, text.as_bytes())
            .err()
            .ok_or_else(|| TestCaseError::fail(format!("accepted {text}")))?;
        prop_assert_eq!(&to.id, &Some(id.into_bytes()));
        check_refusal(Encoding::Json, &to, &error)?;
    }

    /// A valid send, written as JSON (`id`, or `id_b64` for any bytes) or as
    /// protobuf, decodes to the send it was made from, unknown JSON fields
    /// ignored.
    #[test]
    fn valid_sends_round_trip(cmd in send_cmd(), extra in prop::option::of(value())) {
        let mut frame = json!({"type": "send", "conversation": cmd.conversation, "body": cmd.body});
        if cmd.queue {
            frame["queue"] = json!(true);
        }
        if !cmd.age.is_zero() {
            frame["age_ms"] = json!(cmd.age.as_millis());
        }
        if cmd.id_b64 {
            frame["id_b64"] = json!(STANDARD.encode(&cmd.id));
        } else {
            frame["id"] = json!(std::str::from_utf8(&cmd.id).unwrap());
        }
        if let Some(extra) = extra {
            frame["client_version"] = extra;
        }
        let text = serde_json::to_vec(&frame).unwrap();
        prop_assert_eq!(frames::decode(Encoding::Json, &text), Ok(Inbound::Send(cmd.clone())));

        let binary = pb::ClientFrame {
            kind: Some(client_frame::Kind::Send(pb::SendFrame {
                client_msg_id: cmd.id.clone(),
                conversation: cmd.conversation.clone(),
                body: cmd.body.clone(),
                queue: cmd.queue,
                age_ms: u64::try_from(cmd.age.as_millis()).unwrap(),
            })),
        }
        .encode_to_vec();
        prop_assert_eq!(
            frames::decode(Encoding::Protobuf, &binary),
            Ok(Inbound::Send(SendCmd { id_b64: false, ..cmd }))
        );
    }

    /// A valid pull decodes to what it asks, with the documented defaults
    /// (after_seq 0, limit 100; protobuf's 0 and "" stand for "not given").
    #[test]
    fn valid_pulls_round_trip(p in pull()) {
        let mut frame = json!({"type": "history", "conversation": p.conversation});
        if let Some(after_seq) = p.after_seq {
            frame["after_seq"] = json!(after_seq);
        }
        if let Some(limit) = p.limit {
            frame["limit"] = json!(limit);
        }
        if let Some(reference) = &p.reference {
            frame["ref"] = json!(reference);
        }
        let expected = HistoryCmd {
            conversation: p.conversation.clone(),
            after_seq: p.after_seq.unwrap_or(0),
            limit: p.limit.unwrap_or(DEFAULT_HISTORY_LIMIT),
            reference: p.reference.clone(),
        };
        let text = serde_json::to_vec(&frame).unwrap();
        prop_assert_eq!(frames::decode(Encoding::Json, &text), Ok(Inbound::History(expected.clone())));

        let binary = pb::ClientFrame {
            kind: Some(client_frame::Kind::History(pb::HistoryFrame {
                conversation: p.conversation.clone(),
                after_seq: p.after_seq.unwrap_or(0),
                limit: p.limit.unwrap_or(0),
                r#ref: p.reference.clone().unwrap_or_default(),
            })),
        }
        .encode_to_vec();
        let expected = HistoryCmd {
            limit: match p.limit {
                None | Some(0) => DEFAULT_HISTORY_LIMIT,
                Some(limit) => limit,
            },
            reference: p.reference.filter(|r| !r.is_empty()),
            ..expected
        };
        prop_assert_eq!(frames::decode(Encoding::Protobuf, &binary), Ok(Inbound::History(expected)));
    }

    /// Every error the gateway can send, to any send or pull, is a
    /// well-formed error frame in both encodings.
    #[test]
    fn every_error_frame_is_well_formed(to in reply_to(), error in error()) {
        for encoding in [Encoding::Json, Encoding::Protobuf] {
            check_error_frame(encoding, &to, &error)?;
        }
        let Encoded::Text(text) = frames::encode(Encoding::Json, Outbound::Error { to, error: error.clone() }) else {
            unreachable!("checked above");
        };
        let frame: Value = serde_json::from_str(&text).unwrap();
        // id_reused carries the original's receipt; nothing else does.
        match error.original() {
            Some(original) => {
                prop_assert_eq!(&frame["server_id"], &json!(original.server_id.to_string()));
                prop_assert_eq!(&frame["seq"], &json!(original.seq));
            }
            None => prop_assert!(frame.get("server_id").is_none() && frame.get("seq").is_none()),
        }
    }

    /// An ACK carries the send's ID (in the form the phone used, or base64
    /// when it is not UTF-8), the receipt and the outcome, in both encodings.
    #[test]
    fn acks_round_trip(id in msg_id(), id_b64 in any::<bool>(), server_id in any::<u64>(), seq in any::<u64>(), outcome in outcome()) {
        let ack = Ack { client_msg_id: id.clone(), receipt: Receipt { server_id, seq }, outcome };
        let Encoded::Text(text) = frames::encode(Encoding::Json, Outbound::Ack { ack: ack.clone(), id_b64 }) else {
            return Err(TestCaseError::fail("a JSON ack is a text frame"));
        };
        let frame: Value = serde_json::from_str(&text).unwrap();
        prop_assert_eq!(&frame["type"], "ack");
        prop_assert_eq!(json_id(&frame)?, Some(id.as_bytes().to_vec()));
        let utf8 = std::str::from_utf8(id.as_bytes()).is_ok();
        prop_assert_eq!(frame.get("id_b64").is_some(), id_b64 || !utf8, "{}", text);
        prop_assert_eq!(&frame["server_id"], &json!(server_id.to_string()));
        prop_assert_eq!(&frame["seq"], &json!(seq));
        prop_assert_eq!(&frame["duplicate"], &json!(outcome != Outcome::Stored));
        prop_assert_eq!(&frame["outcome"], outcome.as_str());

        let Encoded::Binary(bytes) = frames::encode(Encoding::Protobuf, Outbound::Ack { ack, id_b64 }) else {
            return Err(TestCaseError::fail("a protobuf ack is a binary frame"));
        };
        let Some(server_frame::Kind::Ack(a)) = pb::ServerFrame::decode(&bytes[..]).unwrap().kind else {
            return Err(TestCaseError::fail("not an ack"));
        };
        prop_assert_eq!(a.client_msg_id, id.into_bytes());
        prop_assert_eq!((a.server_id, a.seq, a.duplicate), (server_id, seq, outcome != Outcome::Stored));
        prop_assert_eq!(pb::Outcome::try_from(a.outcome), Ok(pb::Outcome::from(outcome)));
    }

    /// A history page carries every message whole, in order, and its ref.
    #[test]
    fn history_pages_round_trip(
        reference in prop::option::of(text()),
        conversation in text(),
        messages in prop::collection::vec(stored_message(), 0..4),
    ) {
        let page = || Outbound::History { reference: reference.clone(), conversation: conversation.clone(), messages: messages.clone() };
        let Encoded::Text(text) = frames::encode(Encoding::Json, page()) else {
            return Err(TestCaseError::fail("a JSON page is a text frame"));
        };
        let frame: Value = serde_json::from_str(&text).unwrap();
        prop_assert_eq!(&frame["type"], "history");
        prop_assert_eq!(frame.get("ref").and_then(Value::as_str), reference.as_deref());
        prop_assert_eq!(&frame["conversation"], &json!(conversation));
        let got = frame["messages"].as_array().unwrap();
        prop_assert_eq!(got.len(), messages.len());
        for (m, want) in got.iter().zip(&messages) {
            prop_assert_eq!(&m["sender"], want.key.sender.as_str());
            prop_assert_eq!(json_id(m)?, Some(want.key.client_msg_id.as_bytes().to_vec()));
            prop_assert_eq!(&m["server_id"], &json!(want.receipt.server_id.to_string()));
            prop_assert_eq!(&m["seq"], &json!(want.receipt.seq));
            prop_assert_eq!(&m["body"], &json!(want.body));
            prop_assert_eq!(&m["stored_at_ms"], &json!(want.stored_at_ms));
        }

        let Encoded::Binary(bytes) = frames::encode(Encoding::Protobuf, page()) else {
            return Err(TestCaseError::fail("a protobuf page is a binary frame"));
        };
        let Some(server_frame::Kind::History(h)) = pb::ServerFrame::decode(&bytes[..]).unwrap().kind else {
            return Err(TestCaseError::fail("not a page"));
        };
        prop_assert_eq!(h.r#ref, reference.unwrap_or_default());
        prop_assert_eq!(h.conversation, conversation);
        let want: Vec<pb::StoredMessage> = messages.into_iter().map(Into::into).collect();
        prop_assert_eq!(h.messages, want);
    }
}

// ---------------------------------------------------------------------------
// Direct conversations

/// The documented form: `dm:<a>:<b>`, two non-empty names without `:`,
/// sorted by bytes.
fn canonical_pair(name: &str) -> Option<(&str, &str)> {
    let parts: Vec<&str> = name.strip_prefix("dm:")?.split(':').collect();
    match parts[..] {
        [a, b] if !a.is_empty() && !b.is_empty() && a <= b => Some((a, b)),
        _ => None,
    }
}

fn conversation_name() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "(dm:|dm|dmx:|d)?[ab:]{0,6}",
        2 => ("[a-c:é]{0,5}", "[a-c:é]{0,5}").prop_map(|(a, b)| format!("dm:{a}:{b}")),
        1 => any::<String>(),
        1 => any::<String>().prop_map(|s| format!("dm:{s}")),
    ]
    .prop_map(|s| valid_name(&s))
}

fn user_for(name: &str) -> impl Strategy<Value = String> + use<> {
    let (a, b) = canonical_pair(name).map_or((String::new(), String::new()), |(a, b)| {
        (a.to_owned(), b.to_owned())
    });
    prop_oneof![
        Just(a.clone()),
        Just(b.clone()),
        Just(format!("{a}{b}")),
        Just(format!("{a}:{b}")),
        Just(format!("{a} ")),
        "[ab:]{1,4}",
        any::<String>(),
    ]
    .prop_map(|u| valid_name(&u))
}

/// Runs one decision of `authz` to completion.
fn check_access(
    authz: &Authorizer,
    user: &Sender,
    conversation: &ConversationId,
) -> Result<(), Error> {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(authz.check(user, conversation))
}

proptest! {
    /// Only the canonical form is a direct conversation; its members are
    /// exactly the two names in it, and the pair's name is the same string.
    #[test]
    fn direct_names_have_one_form_and_two_members(
        (name, user) in conversation_name().prop_flat_map(|n| { let u = user_for(&n); (Just(n), u) }),
    ) {
        let conversation = ConversationId::parse(name.as_str()).unwrap();
        let user = Sender::parse(user).unwrap();
        match DirectConversations::members(&conversation) {
            Ok(None) => prop_assert!(!name.starts_with("dm:")),
            Ok(Some(pair)) => {
                let (a, b) = canonical_pair(&name)
                    .ok_or_else(|| TestCaseError::fail(format!("{name:?} accepted as direct")))?;
                prop_assert_eq!(pair.contains(&user), user.as_str() == a || user.as_str() == b);
                let (a, b) = (Sender::parse(a).unwrap(), Sender::parse(b).unwrap());
                prop_assert_eq!(DirectConversations::name(&b, &a), name);
            }
            Err(error) => {
                prop_assert!(name.starts_with("dm:") && canonical_pair(&name).is_none(), "{}: {}", name, error);
                prop_assert_eq!(error.kind(), ErrorKind::InvalidArgument);
                prop_assert!(!error.retryable());
                prop_assert!(error.message().contains("dm:<user>:<user>"), "{}", error);
            }
        }
    }

    /// The name of a pair is the same either way round, and names a
    /// direct conversation of just those two, whenever it is a valid
    /// conversation. (Names holding `:` have no direct conversation: see
    /// `a_pair_with_a_colon_in_a_name_has_no_direct_conversation`.)
    #[test]
    fn the_name_of_a_pair_is_one_conversation_of_the_two(a in sender(), b in sender(), other in sender()) {
        let name = DirectConversations::name(&a, &b);
        prop_assert_eq!(&name, &DirectConversations::name(&b, &a));
        let Ok(conversation) = ConversationId::parse(name.as_str()) else {
            prop_assert!(name.len() > 128, "{:?} is not a valid conversation", name);
            return Ok(());
        };
        let colon = a.as_str().contains(':') || b.as_str().contains(':');
        match DirectConversations::members(&conversation) {
            Ok(Some(pair)) => {
                prop_assert!(!colon);
                prop_assert!(pair.contains(&a) && pair.contains(&b));
                prop_assert_eq!(pair.contains(&other), other == a || other == b);
            }
            Ok(None) => return Err(TestCaseError::fail(format!("{name:?} is not direct"))),
            Err(error) => {
                prop_assert!(colon, "{:?} refused: {}", name, error);
                prop_assert_eq!(error.kind(), ErrorKind::InvalidArgument);
            }
        }
    }

    /// The gateway's decision on direct conversations (without groups): the
    /// two members pass; everyone else, and every group, is refused with
    /// the same final `permission_denied`; a `dm:` name out of form is
    /// `invalid_argument`.
    #[test]
    fn only_the_two_members_may_use_a_direct_conversation(
        (name, user) in conversation_name().prop_flat_map(|n| { let u = user_for(&n); (Just(n), u) }),
    ) {
        let conversation = ConversationId::parse(name.as_str()).unwrap();
        let user = Sender::parse(user).unwrap();
        let authz = Authorizer::direct_only();
        let reference = check_access(
            &authz,
            &Sender::parse("carl").unwrap(),
            &ConversationId::parse("dm:ana:ben").unwrap(),
        )
        .unwrap_err();
        let decision = check_access(&authz, &user, &conversation);
        match canonical_pair(&name) {
            Some((a, b)) if user.as_str() == a || user.as_str() == b => {
                prop_assert!(decision.is_ok(), "{:?} refused in {:?}", user, name);
            }
            Some(_) => prop_assert_eq!(decision, Err(reference)),
            None if name.starts_with("dm:") => {
                let error = decision.unwrap_err();
                prop_assert_eq!(error.kind(), ErrorKind::InvalidArgument);
            }
            None => prop_assert_eq!(decision, Err(reference)),
        }
    }
}

/// `name` sorts and joins with `:`, so a name holding `:` makes a
/// conversation that reads as another split ("a:b" and "c", and "a" and
/// "b:c", both give `dm:a:b:c`). `members` refuses such names rather than
/// guess, so nobody is let in on a misreading; it also means such users
/// have no direct conversation at all.
#[test]
fn a_pair_with_a_colon_in_a_name_has_no_direct_conversation() {
    let s = |n: &str| Sender::parse(n).unwrap();
    let name = DirectConversations::name(&s("a:b"), &s("c"));
    assert_eq!(name, DirectConversations::name(&s("a"), &s("b:c")));
    let conversation = ConversationId::parse(name).unwrap();
    let error = DirectConversations::members(&conversation).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidArgument);
    let authz = Authorizer::direct_only();
    for user in ["a:b", "c", "a", "b:c"] {
        assert!(
            check_access(&authz, &s(user), &conversation).is_err(),
            "{user}"
        );
    }
}

/// The generators reach every outcome of `decode`, so the properties above
/// are not vacuous: decoded sends and pulls, and each kind of refusal.
#[test]
fn the_frame_generators_reach_every_outcome() {
    use proptest::{strategy::ValueTree, test_runner::TestRunner};
    use std::collections::BTreeMap;

    fn outcomes(result: Result<Inbound, (ReplyTo, Error)>) -> Vec<&'static str> {
        let (to, error) = match result {
            Ok(Inbound::Send(_)) => return vec!["send"],
            Ok(Inbound::History(_)) => return vec!["history"],
            Err(refused) => refused,
        };
        let reasons = [
            ("malformed JSON", "malformed JSON"),
            ("unknown frame type \"", "unknown type"),
            ("no \"type\"", "no type"),
            ("malformed frame", "malformed frame"),
            ("id_b64", "bad id_b64"),
            ("malformed protobuf", "malformed protobuf"),
            ("no kind", "no kind"),
        ];
        let mut seen: Vec<_> = reasons
            .iter()
            .filter(|(text, _)| error.message().contains(text))
            .map(|(_, label)| *label)
            .collect();
        if to.id.is_some() {
            seen.push("naming the send");
        }
        if to.reference.is_some() {
            seen.push("naming the pull");
        }
        seen
    }
    let mut runner = TestRunner::deterministic();
    let mut seen = BTreeMap::<(&str, &str), usize>::new();
    for _ in 0..3000 {
        let text = json_text().new_tree(&mut runner).unwrap().current();
        for outcome in outcomes(frames::decode(Encoding::Json, &text)) {
            *seen.entry(("json", outcome)).or_default() += 1;
        }
        let binary = protobuf_bytes().new_tree(&mut runner).unwrap().current();
        for outcome in outcomes(frames::decode(Encoding::Protobuf, &binary)) {
            *seen.entry(("protobuf", outcome)).or_default() += 1;
        }
    }
    let json = [
        "send",
        "history",
        "naming the send",
        "naming the pull",
        "malformed JSON",
        "bad id_b64",
        "unknown type",
        "no type",
        "malformed frame",
    ];
    let protobuf = ["send", "history", "malformed protobuf", "no kind"];
    for key in json
        .map(|o| ("json", o))
        .into_iter()
        .chain(protobuf.map(|o| ("protobuf", o)))
    {
        assert!(
            seen.get(&key).is_some_and(|n| *n >= 10),
            "{key:?} seldom reached: {seen:?}"
        );
    }
    println!("{seen:?}");
}
