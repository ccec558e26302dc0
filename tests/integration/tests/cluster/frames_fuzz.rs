//! Arbitrary frames over the real WebSocket: an authenticated phone on the
//! embedded cluster writes generated text and binary frames (client frames
//! of every shape, damaged ones, lone surrogates, random bytes), one at a
//! time, on one connection. For every frame:
//!
//! - the answer comes in the frame's encoding and is a well-formed server
//!   frame: an error with a documented code, its `retryable` flag as the
//!   protocol's table (docs/protocol.md) says, a message, and the `id` (or
//!   `ref`) the frame carried; or, for a frame that happens to be a valid
//!   send, an ACK (or `id_reused`, when its ID was stored with another
//!   message); or, for a valid pull, its page;
//! - bad input is refused finally (never a "retry" for a malformed frame);
//!   a client frame turned away for load (`overloaded`, retryable, storing
//!   nothing) is sent again after a pause, as a phone does;
//! - nothing is stored unless the answer is an ACK `stored`, and a repeat
//!   gets the original's receipt;
//! - the connection stays usable: a pull written right after is answered,
//!   and is the very next frame (no stray or missing answers).
//!
//! At the end, the conversations hold exactly the ACKed messages.
//!
//! 64 cases by default (a few seconds); `PROPTEST_CASES` sets the number.

use std::{
    cell::RefCell,
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use futures_util::{SinkExt, StreamExt};
use imdedup_client::Encoding;
use imdedup_cluster::LocalCluster;
use imdedup_domain::{
    clock::ManualClock,
    model::{Body, ClientMsgId, ConversationId, DEFAULT_MAX_BODY_BYTES, HistoryQuery, Sender},
};
use imdedup_gateway::authz::Authorizer;
use imdedup_proto::{
    json::{self, ClientJson, ServerJson},
    v1::{self as pb, client_frame, server_frame},
};
use proptest::{
    prelude::*,
    test_runner::{Config, TestCaseResult, TestError, TestRunner},
};
use prost::Message as _;
use serde_json::{Value, json};
use tokio_tungstenite::{
    MaybeTlsStream, WebSocketStream,
    tungstenite::{Message, client::IntoClientRequest, http},
};

use super::common;

type Ws = WebSocketStream<MaybeTlsStream<tokio::net::TcpStream>>;

const USER: &str = "ana";
const DEFAULT_CASES: u32 = 64;
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the phone waits before sending a frame again that was answered
/// `overloaded`, and how often it does.
const RESEND_AFTER: Duration = Duration::from_millis(25);
const MAX_RESENDS: u32 = 400;

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

// ---------------------------------------------------------------------------
// Frames

/// One frame from the phone.
#[derive(Debug, Clone)]
enum Frame {
    Text(String),
    Binary(Vec<u8>),
}

fn id() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        // A few IDs used again and again: repeats and reused IDs.
        4 => (0u8..6).prop_map(|i| format!("m{i}").into_bytes()),
        2 => "[a-z0-9-]{1,64}".prop_map(String::into_bytes),
        2 => prop::collection::vec(any::<u8>(), 1..=64),
        1 => Just(Vec::new()),
        1 => prop::collection::vec(any::<u8>(), 65..80),
    ]
}

fn conversation() -> impl Strategy<Value = String> {
    prop_oneof![
        // Ana's (a group of the test groups, her direct ones) and others'.
        6 => prop::sample::select(vec![
            "c", "chat", "dm:ana:ben", "dm:ana:ana", "dm:ben:ana", "dm:ben:carl", "team-x", "",
            "c\u{7}", "dm:ana",
        ])
        .prop_map(str::to_owned),
        1 => Just("x".repeat(129)),
        1 => "(dm:)?[a-z:]{0,10}",
        1 => any::<String>(),
    ]
}

fn body() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec!["hi", "hello", ""]).prop_map(str::to_owned),
        1 => Just("b".repeat(DEFAULT_MAX_BODY_BYTES)),
        1 => Just("b".repeat(DEFAULT_MAX_BODY_BYTES + 1)),
        2 => any::<String>(),
    ]
}

/// A JSON value of the wrong kind for any field.
fn wrong() -> impl Strategy<Value = Value> {
    prop::sample::select(vec![
        Value::Null,
        json!(7),
        json!(-1),
        json!(2.5),
        json!(true),
        json!([]),
        json!({}),
        json!("7"),
    ])
}

fn maybe(right: impl Strategy<Value = Value>) -> impl Strategy<Value = Option<Value>> {
    prop_oneof![1 => Just(None), 6 => right.prop_map(Some), 1 => wrong().prop_map(Some)]
}

fn json_send() -> impl Strategy<Value = Value> {
    (
        id(),
        0u8..6,
        maybe(conversation().prop_map(Value::from)),
        maybe(body().prop_map(Value::from)),
        maybe(
            prop::sample::select(vec!["send", "send", "send", "history", "edit"])
                .prop_map(Value::from),
        ),
    )
        .prop_map(|(id, id_form, conversation, body, kind)| {
            let mut frame = serde_json::Map::new();
            let b64 = Value::from(json::id_to_json(&id, true).1.unwrap());
            let text = std::str::from_utf8(&id).ok().map(Value::from);
            match (id_form, text) {
                (0..=2, Some(text)) => {
                    frame.insert("id".into(), text);
                }
                (0..=3, _) => {
                    frame.insert("id_b64".into(), b64);
                }
                (4, text) => {
                    frame.insert("id".into(), text.unwrap_or(json!("m0")));
                    frame.insert("id_b64".into(), b64);
                }
                _ => {}
            }
            for (name, value) in [
                ("type", kind),
                ("conversation", conversation),
                ("body", body),
            ] {
                if let Some(value) = value {
                    frame.insert(name.into(), value);
                }
            }
            Value::Object(frame)
        })
}

fn json_pull() -> impl Strategy<Value = Value> {
    (
        maybe(conversation().prop_map(Value::from)),
        maybe(any::<u64>().prop_map(Value::from)),
        maybe(prop_oneof![Just(0u32), 1u32..1002, any::<u32>()].prop_map(Value::from)),
        maybe("[a-z0-9]{0,8}".prop_map(Value::from)),
        maybe(prop::sample::select(vec!["history", "history", "send"]).prop_map(Value::from)),
    )
        .prop_map(|(conversation, after_seq, limit, reference, kind)| {
            let mut frame = serde_json::Map::new();
            for (name, value) in [
                ("type", kind),
                ("conversation", conversation),
                ("after_seq", after_seq),
                ("limit", limit),
                ("ref", reference),
            ] {
                if let Some(value) = value {
                    frame.insert(name.into(), value);
                }
            }
            Value::Object(frame)
        })
}

fn text_frame() -> impl Strategy<Value = Frame> {
    let damaged = (
        prop_oneof![json_send(), json_pull()],
        0u8..8,
        any::<prop::sample::Index>(),
        any::<char>(),
        prop::sample::select(vec![r"\ud800", r"\udc00", r"\ud83d\ude00", r"\\ud800"]),
    )
        .prop_map(|(frame, damage, at, c, surrogate)| {
            let text = frame.to_string();
            let mut chars: Vec<char> = text.chars().collect();
            let i = at.index(chars.len().max(1)).min(chars.len());
            match damage {
                0 => chars.truncate(i),
                1 if i < chars.len() => chars[i] = c,
                2 => {
                    // A lone surrogate (or a pair, or an escaped backslash)
                    // at the end of the body.
                    let text = text.replacen(r#""body":""#, &format!(r#""body":"{surrogate}"#), 1);
                    return text;
                }
                _ => {}
            }
            chars.into_iter().collect()
        });
    prop_oneof![
        8 => damaged,
        1 => any::<String>(),
        1 => "[\\[\\]{}\":,\\\\u0-9a-f dtypesnd]{0,40}",
    ]
    .prop_map(Frame::Text)
}

fn binary_frame() -> impl Strategy<Value = Frame> {
    let real = prop_oneof![
        (id(), conversation(), body()).prop_map(|(id, conversation, body)| {
            client_frame::Kind::Send(pb::SendFrame {
                client_msg_id: id,
                conversation,
                body,
                queue: false,
                age_ms: 0,
            })
        }),
        (
            conversation(),
            any::<u64>(),
            prop_oneof![Just(0u32), 1u32..1002, any::<u32>()],
            "[a-z0-9]{0,8}"
        )
            .prop_map(|(conversation, after_seq, limit, r#ref)| {
                client_frame::Kind::History(pb::HistoryFrame {
                    conversation,
                    after_seq,
                    limit,
                    r#ref,
                })
            }),
    ]
    .prop_map(|kind| pb::ClientFrame { kind: Some(kind) }.encode_to_vec())
    .boxed();
    let damaged = (
        real.clone(),
        0u8..3,
        any::<prop::sample::Index>(),
        any::<u8>(),
    )
        .prop_map(|(mut bytes, damage, at, byte)| {
            if !bytes.is_empty() {
                let i = at.index(bytes.len());
                match damage {
                    0 => bytes.truncate(i),
                    1 => bytes[i] = byte,
                    _ => bytes.insert(i, byte),
                }
            }
            bytes
        });
    prop_oneof![
        3 => real,
        3 => damaged,
        1 => prop::collection::vec(any::<u8>(), 0..64),
    ]
    .prop_map(Frame::Binary)
}

/// A send that is valid and that ana may write, in either encoding; its ID
/// often one used before, with the same message (a repeat) or another
/// (a reused ID).
fn valid_send_frame() -> impl Strategy<Value = Frame> {
    const WRITABLE: [&str; 4] = ["c", "chat", "dm:ana:ben", "dm:ana:ana"];
    let any_message = (
        prop::sample::select(WRITABLE.to_vec()),
        prop_oneof![
            3 => prop::sample::select(vec!["hi", "hello"]).prop_map(str::to_owned),
            1 => "(?s).{1,40}",
        ],
    );
    let message = prop_oneof![
        // Message i of the phone's outbox, sent again and again.
        3 => (0usize..6).prop_map(|i| (
            format!("m{i}").into_bytes(),
            WRITABLE[i % WRITABLE.len()],
            format!("message {i}"),
        )),
        // A used ID with another message, or a fresh ID.
        1 => ((0u8..6).prop_map(|i| format!("m{i}").into_bytes()), any_message.clone())
            .prop_map(|(id, (conversation, body))| (id, conversation, body)),
        1 => (prop::collection::vec(any::<u8>(), 1..=64), any_message)
            .prop_map(|(id, (conversation, body))| (id, conversation, body)),
    ];
    (message, any::<bool>()).prop_map(|((id, conversation, body), binary)| {
        if binary {
            let kind = client_frame::Kind::Send(pb::SendFrame {
                client_msg_id: id,
                conversation: conversation.to_owned(),
                body,
                queue: false,
                age_ms: 0,
            });
            Frame::Binary(pb::ClientFrame { kind: Some(kind) }.encode_to_vec())
        } else {
            let (id, id_b64) = json::id_to_json(&id, false);
            let send = ClientJson::Send(json::SendJson {
                id,
                id_b64,
                conversation: conversation.to_owned(),
                body,
                queue: false,
                age_ms: 0,
            });
            Frame::Text(serde_json::to_string(&send).unwrap())
        }
    })
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![3 => text_frame(), 3 => binary_frame(), 2 => valid_send_frame()]
}

// ---------------------------------------------------------------------------
// What a frame is, read as the protocol defines it

#[derive(Debug, Default)]
struct Expected {
    /// A send whose fields are valid and that ana may write.
    send: Option<(Vec<u8>, String, String)>,
    /// A pull that is valid and that ana may read.
    pull: Option<String>,
    /// The id an error must name (`Some(None)`: none), when known.
    id: Option<Option<Vec<u8>>>,
    /// The ref an error must name, when known.
    reference: Option<Option<String>>,
    /// A client frame (a send with a readable ID, or a pull), whatever
    /// its fields: one the gateway may turn away for load.
    decoded: bool,
}

async fn may_use(authz: &Authorizer, conversation: &ConversationId) -> bool {
    authz
        .check(&Sender::parse(USER).unwrap(), conversation)
        .await
        .is_ok()
}

async fn valid_send(
    authz: &Authorizer,
    id: Vec<u8>,
    conversation: String,
    body: String,
) -> Option<(Vec<u8>, String, String)> {
    ClientMsgId::parse(id.clone()).ok()?;
    // IDs starting with `bk:` belong to the business API: refused to phones.
    if ClientMsgId::is_reserved_for_business(&id) {
        return None;
    }
    let parsed = ConversationId::parse(conversation.clone()).ok()?;
    Body::parse(body.clone(), DEFAULT_MAX_BODY_BYTES).ok()?;
    may_use(authz, &parsed)
        .await
        .then_some((id, conversation, body))
}

async fn valid_pull(authz: &Authorizer, conversation: String, limit: u32) -> Option<String> {
    let parsed = ConversationId::parse(conversation.clone()).ok()?;
    HistoryQuery::new(parsed.clone(), 0, limit).ok()?;
    may_use(authz, &parsed).await.then_some(conversation)
}

async fn expected(authz: &Authorizer, frame: &Frame) -> Expected {
    match frame {
        Frame::Text(text) => match serde_json::from_str::<ClientJson>(text) {
            Ok(ClientJson::Send(s)) => {
                match json::id_from_json(s.id.as_deref(), s.id_b64.as_deref()) {
                    Ok(id) => Expected {
                        send: valid_send(authz, id.clone(), s.conversation, s.body).await,
                        id: Some(Some(id)),
                        decoded: true,
                        ..Expected::default()
                    },
                    Err(_) => Expected {
                        id: Some(s.id.map(String::into_bytes)),
                        ..Expected::default()
                    },
                }
            }
            Ok(ClientJson::History(h)) => Expected {
                pull: valid_pull(authz, h.conversation, h.limit).await,
                reference: Some(h.reference),
                decoded: true,
                ..Expected::default()
            },
            // Not a client frame: an error naming what the JSON carries.
            Err(_) => match serde_json::from_str::<Value>(text) {
                Ok(value) => {
                    let string =
                        |name: &str| value.get(name).and_then(Value::as_str).map(str::to_owned);
                    Expected {
                        id: Some(string("id").map(String::into_bytes)),
                        reference: (value["type"] == "history").then(|| string("ref")),
                        ..Expected::default()
                    }
                }
                // Lone surrogates are read leniently by the gateway: the id
                // is then checked by the unit properties, not here.
                Err(_) => Expected::default(),
            },
        },
        Frame::Binary(bytes) => match pb::ClientFrame::decode(&bytes[..])
            .ok()
            .and_then(|f| f.kind)
        {
            Some(client_frame::Kind::Send(s)) => Expected {
                id: Some((!s.client_msg_id.is_empty()).then(|| s.client_msg_id.clone())),
                send: valid_send(authz, s.client_msg_id, s.conversation, s.body).await,
                decoded: true,
                ..Expected::default()
            },
            Some(client_frame::Kind::History(h)) => Expected {
                pull: valid_pull(
                    authz,
                    h.conversation,
                    if h.limit == 0 { 100 } else { h.limit },
                )
                .await,
                reference: Some((!h.r#ref.is_empty()).then_some(h.r#ref)),
                decoded: true,
                ..Expected::default()
            },
            // Nothing could be read: nothing is named.
            None => Expected {
                id: Some(None),
                reference: Some(None),
                ..Expected::default()
            },
        },
    }
}

// ---------------------------------------------------------------------------
// What the gateway answered

#[derive(Debug)]
enum Reply {
    Ack {
        id: Vec<u8>,
        server_id: u64,
        seq: u64,
        outcome: String,
        duplicate: bool,
    },
    Error {
        id: Option<Vec<u8>>,
        reference: Option<String>,
        code: String,
        retryable: bool,
        message: String,
        original: Option<(u64, u64)>,
    },
    History {
        reference: Option<String>,
        conversation: String,
    },
}

fn fail(message: impl Into<String>) -> TestCaseError {
    TestCaseError::fail(message.into())
}

/// The next frame from the gateway, read strictly as a server frame of the
/// protocol, in `text`'s encoding.
async fn next_reply(ws: &mut Ws, text: bool) -> Result<Reply, TestCaseError> {
    let message = loop {
        match tokio::time::timeout(REPLY_TIMEOUT, ws.next()).await {
            Err(_) => return Err(fail("no answer in time")),
            Ok(None) => return Err(fail("the connection closed")),
            Ok(Some(Err(e))) => return Err(fail(format!("the connection failed: {e}"))),
            Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => continue,
            Ok(Some(Ok(message))) => break message,
        }
    };
    match (message, text) {
        (Message::Text(reply), true) => {
            let frame: ServerJson = serde_json::from_str(reply.as_str())
                .map_err(|e| fail(format!("not a server frame: {e}: {}", reply.as_str())))?;
            let id = |id: Option<String>, b64: Option<String>| match (id, b64) {
                (None, None) => Ok(None),
                (id, b64) => json::id_from_json(id.as_deref(), b64.as_deref())
                    .map(Some)
                    .map_err(|e| fail(format!("bad id in {}: {e}", reply.as_str()))),
            };
            Ok(match frame {
                ServerJson::Ack(a) => Reply::Ack {
                    id: id(a.id, a.id_b64)?.ok_or_else(|| fail("an ACK without an id"))?,
                    server_id: a
                        .server_id
                        .parse()
                        .map_err(|_| fail("server_id is no u64"))?,
                    seq: a.seq,
                    outcome: a.outcome,
                    duplicate: a.duplicate,
                },
                ServerJson::Error(e) => Reply::Error {
                    id: id(e.id, e.id_b64)?,
                    reference: e.reference,
                    original: match (e.server_id, e.seq) {
                        (Some(server_id), Some(seq)) => Some((
                            server_id.parse().map_err(|_| fail("server_id is no u64"))?,
                            seq,
                        )),
                        (None, None) => None,
                        _ => return Err(fail(format!("half a receipt: {}", reply.as_str()))),
                    },
                    code: e.code,
                    retryable: e.retryable,
                    message: e.message,
                },
                ServerJson::History(h) => Reply::History {
                    reference: h.reference,
                    conversation: h.conversation,
                },
                ServerJson::Queued(_) => return Err(fail("queued, but no send asked for it")),
            })
        }
        (Message::Binary(reply), false) => {
            let frame = pb::ServerFrame::decode(&reply[..])
                .map_err(|e| fail(format!("not a ServerFrame: {e}")))?;
            Ok(
                match frame
                    .kind
                    .ok_or_else(|| fail("a ServerFrame without a kind"))?
                {
                    server_frame::Kind::Ack(a) => Reply::Ack {
                        id: a.client_msg_id,
                        server_id: a.server_id,
                        seq: a.seq,
                        outcome: match pb::Outcome::try_from(a.outcome) {
                            Ok(pb::Outcome::Stored) => "stored",
                            Ok(pb::Outcome::DuplicateWindow) => "duplicate_window",
                            Ok(pb::Outcome::DuplicateUniqueKey) => "duplicate_unique_key",
                            _ => return Err(fail(format!("ACK outcome {}", a.outcome))),
                        }
                        .to_owned(),
                        duplicate: a.duplicate,
                    },
                    server_frame::Kind::Error(e) => {
                        let code = pb::ErrorCode::try_from(e.code)
                            .ok()
                            .and_then(|c| {
                                c.as_str_name()
                                    .strip_prefix("ERROR_CODE_")
                                    .map(str::to_ascii_lowercase)
                            })
                            .ok_or_else(|| fail(format!("error code {}", e.code)))?;
                        Reply::Error {
                            id: (!e.client_msg_id.is_empty()).then_some(e.client_msg_id),
                            reference: (!e.r#ref.is_empty()).then_some(e.r#ref),
                            original: (code == "id_reused")
                                .then_some((e.original_server_id, e.original_seq)),
                            code,
                            retryable: e.retryable,
                            message: e.message,
                        }
                    }
                    server_frame::Kind::History(h) => Reply::History {
                        reference: (!h.r#ref.is_empty()).then_some(h.r#ref),
                        conversation: h.conversation,
                    },
                    server_frame::Kind::Queued(_) => {
                        return Err(fail("queued, but no send asked for it"));
                    }
                },
            )
        }
        (other, text) => Err(fail(format!(
            "a {} frame answered with {other:?}",
            if text { "text" } else { "binary" }
        ))),
    }
}

// ---------------------------------------------------------------------------
// The run

/// What the phone was told was stored: (conversation, id) → (body, server
/// id, seq).
type Acked = BTreeMap<(String, Vec<u8>), (String, u64, u64)>;

struct Phone {
    ws: Option<Ws>,
    acked: Acked,
    probes: u64,
    /// How many frames got each answer (ACK outcome, error code, page).
    answers: BTreeMap<String, u64>,
}

async fn connect(cluster: &LocalCluster) -> Ws {
    let mut request = cluster.gateway_url().into_client_request().unwrap();
    let bearer = format!("Bearer {}", cluster.token(USER).unwrap());
    request.headers_mut().insert(
        http::header::AUTHORIZATION,
        http::HeaderValue::from_str(&bearer).unwrap(),
    );
    tokio_tungstenite::connect_async(request).await.unwrap().0
}

/// One case: write `frame`, check its answer and what was stored, then
/// check that the connection still answers a pull, next.
async fn one_frame(
    cluster: &LocalCluster,
    authz: &Authorizer,
    phone: &mut Phone,
    frame: Frame,
) -> TestCaseResult {
    let expected = expected(authz, &frame).await;
    if phone.ws.is_none() {
        phone.ws = Some(connect(cluster).await);
    }
    let ws = phone.ws.as_mut().unwrap();
    let text = matches!(frame, Frame::Text(_));
    let message = match frame {
        Frame::Text(text) => Message::Text(text.into()),
        Frame::Binary(bytes) => Message::Binary(bytes.into()),
    };
    let mut resends = 0;
    let (reply, stored) = loop {
        let stored_before = cluster.dedup_counts().stored;
        ws.send(message.clone())
            .await
            .map_err(|e| fail(format!("cannot write: {e}")))?;
        let reply = next_reply(ws, text).await?;
        let stored = cluster.dedup_counts().stored - stored_before;
        // A client frame may be turned away for the user's send rate or the
        // gateway's load: `overloaded`, retryable, nothing stored. The phone
        // waits and sends it again, as a phone does.
        if let Reply::Error {
            code,
            retryable,
            id,
            reference,
            ..
        } = &reply
            && code == "overloaded"
            && expected.decoded
            && resends < MAX_RESENDS
        {
            prop_assert!(*retryable);
            prop_assert_eq!(stored, 0, "stored, yet answered overloaded");
            if let Some(want) = &expected.id {
                prop_assert_eq!(id, want, "overloaded names the send");
            }
            if let Some(want) = &expected.reference {
                prop_assert_eq!(reference, want, "overloaded names the pull");
            }
            *phone
                .answers
                .entry("error overloaded, resent".to_owned())
                .or_default() += 1;
            resends += 1;
            tokio::time::sleep(RESEND_AFTER).await;
            continue;
        }
        break (reply, stored);
    };
    let answer = match &reply {
        Reply::Ack { outcome, .. } => format!("ack {outcome}"),
        Reply::Error { code, .. } => format!("error {code}"),
        Reply::History { .. } => "history page".to_owned(),
    };
    *phone.answers.entry(answer).or_default() += 1;

    match reply {
        Reply::Ack {
            id,
            server_id,
            seq,
            outcome,
            duplicate,
        } => {
            let (want_id, conversation, body) = expected.send.ok_or_else(|| {
                fail(format!(
                    "an ACK ({outcome}) for a frame that is no valid send"
                ))
            })?;
            prop_assert_eq!(&id, &want_id, "the ACK names the send");
            prop_assert_eq!(duplicate, outcome != "stored");
            let key = (conversation, id);
            match outcome.as_str() {
                "stored" => {
                    prop_assert_eq!(stored, 1, "one message stored");
                    prop_assert!(
                        !phone.acked.keys().any(|(_, id)| *id == key.1),
                        "an ID stored twice: {:?}",
                        key
                    );
                    phone.acked.insert(key, (body, server_id, seq));
                }
                "duplicate_window" | "duplicate_unique_key" => {
                    prop_assert_eq!(stored, 0, "a repeat stored again");
                    let original = phone
                        .acked
                        .get(&key)
                        .ok_or_else(|| fail(format!("a repeat of nothing: {key:?}")))?;
                    prop_assert_eq!(
                        original,
                        &(body, server_id, seq),
                        "a repeat gets the original's receipt"
                    );
                }
                other => return Err(fail(format!("ACK outcome {other:?}"))),
            }
        }
        Reply::Error {
            id,
            reference,
            code,
            retryable,
            message,
            original,
        } => {
            prop_assert_eq!(
                stored,
                0,
                "a refused frame stored something ({}: {})",
                code,
                message
            );
            let documented = CODES.iter().find(|(c, _)| *c == code).map(|(_, r)| *r);
            prop_assert_eq!(
                documented,
                Some(retryable),
                "code {} with retryable {}",
                code,
                retryable
            );
            prop_assert!(
                !retryable,
                "bad input is refused finally, not {}: {}",
                code,
                message
            );
            prop_assert!(!message.is_empty());
            if let Some(want) = &expected.id {
                prop_assert_eq!(&id, want, "the error names the frame's send ({})", message);
            }
            if let Some(want) = &expected.reference {
                prop_assert_eq!(
                    &reference,
                    want,
                    "the error names the frame's pull ({})",
                    message
                );
            }
            if let Some((want_id, conversation, body)) = &expected.send {
                // A valid send is refused only when its ID holds another message.
                prop_assert_eq!(
                    code.as_str(),
                    "id_reused",
                    "a valid send refused: {}",
                    message
                );
                let stored_as = phone
                    .acked
                    .iter()
                    .find(|((_, id), _)| id == want_id)
                    .ok_or_else(|| fail("id_reused for an ID never stored"))?;
                prop_assert!(stored_as.0.0 != *conversation || stored_as.1.0 != *body);
                prop_assert_eq!(original, Some((stored_as.1.1, stored_as.1.2)));
            } else {
                prop_assert!(original.is_none() || code == "id_reused");
            }
            if expected.pull.is_some() {
                return Err(fail(format!("a valid pull refused: {code}: {message}")));
            }
        }
        Reply::History {
            reference,
            conversation,
        } => {
            prop_assert_eq!(stored, 0);
            let want = expected
                .pull
                .ok_or_else(|| fail("a page for a frame that is no valid pull"))?;
            prop_assert_eq!(conversation, want);
            prop_assert_eq!(Some(reference), expected.reference);
        }
    }

    // Still usable, and nothing else is on its way: the next frame is the
    // answer to this pull.
    phone.probes += 1;
    let probe = format!("probe-{}", phone.probes);
    let pull = json!({"type": "history", "conversation": "c", "limit": 1, "ref": probe});
    ws.send(Message::Text(pull.to_string().into()))
        .await
        .map_err(|e| fail(format!("cannot write the probe: {e}")))?;
    match next_reply(ws, true).await? {
        Reply::History { reference, .. } if reference.as_deref() == Some(probe.as_str()) => Ok(()),
        other => Err(fail(format!("the probe pull was answered with {other:?}"))),
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

#[test]
fn arbitrary_frames_get_a_well_formed_answer_and_store_nothing_invalid() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The test groups, and a per-user send rate that long runs do not
    // reach (the rate has tests of its own).
    let options = common::options(common::Kind::Embedded, &dir, &ManualClock::new()).unwrap();
    let cluster = runtime.block_on(LocalCluster::start(options)).unwrap();
    // The cluster's own rule, asked directly: who may use what.
    let authz = common::test_groups();

    let phone = RefCell::new(Phone {
        ws: None,
        acked: Acked::new(),
        probes: 0,
        answers: BTreeMap::new(),
    });
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        max_shrink_iters: 512,
        ..Config::default()
    });
    let result = runner.run(&frame(), |frame| {
        let mut phone = phone.borrow_mut();
        let outcome = runtime.block_on(one_frame(&cluster, &authz, &mut phone, frame));
        if outcome.is_err() {
            // Start the next case (a shrunk one) on a fresh connection.
            phone.ws = None;
        }
        outcome
    });
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, frame)) => panic!("{reason}\nminimal failing frame: {frame:?}"),
        Err(e) => panic!("{e}"),
    }

    // Exactly the ACKed messages are stored: pull every conversation that
    // got one, and the writable ones the frames aimed at.
    let phone = phone.into_inner();
    runtime.block_on(async {
        let client = common::connect(&cluster, USER, Encoding::Json).await;
        let mut conversations: BTreeSet<String> =
            phone.acked.keys().map(|(c, _)| c.clone()).collect();
        conversations.extend(["c", "chat", "dm:ana:ben", "dm:ana:ana"].map(str::to_owned));
        for conversation in conversations {
            let rows = common::rows(&client, &conversation).await;
            let stored: BTreeMap<_, _> = rows
                .into_iter()
                .map(|m| {
                    assert_eq!(m.sender, USER);
                    ((conversation.clone(), m.id), (m.body, m.server_id, m.seq))
                })
                .collect();
            let acked: BTreeMap<_, _> = phone
                .acked
                .iter()
                .filter(|((c, _), _)| *c == conversation)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            assert_eq!(
                stored, acked,
                "{conversation:?} holds exactly what was ACKed"
            );
        }
        assert_eq!(
            cluster.dedup_counts().stored,
            phone.acked.len() as u64,
            "nothing stored anywhere but the ACKed messages"
        );
        println!(
            "{} frames, {} messages stored; answers: {:?}",
            phone.probes,
            phone.acked.len(),
            phone.answers
        );
        // Not vacuous: some frames were stored, some refused.
        let count = |prefix: &str| {
            phone
                .answers
                .iter()
                .filter(|(a, _)| a.starts_with(prefix))
                .map(|(_, n)| n)
                .sum::<u64>()
        };
        assert!(
            count("ack stored") > 0 && count("error") > 0,
            "{:?}",
            phone.answers
        );
    });
    runtime.block_on(cluster.shutdown());
}
