//! A phone-side client of the gateway's WebSocket protocol, in JSON text or
//! protobuf binary frames. Several sends may be in flight on one connection;
//! replies are matched to their send by client message ID and to their
//! history pull by `ref`.
//!
//! Used by the demo, the load-test driver and the integration tests. It
//! delivers what arrives; simulating a lost ACK is the caller's business.

pub mod business;
mod throttle;

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures_util::{SinkExt, StreamExt};
use imdedup_proto::{
    json::{self, ClientJson, ServerJson},
    v1::{self as pb, client_frame, server_frame},
};
use prost::Message as _;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_tungstenite::tungstenite::{
    self, Message, client::IntoClientRequest, http, protocol::WebSocketConfig,
};

use crate::throttle::Throttles;

/// What one read from the socket asks for (see [`Client::connect`]).
const READ_BUFFER_BYTES: usize = 8 * 1024;

/// How this client encodes its frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Json,
    Protobuf,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("the gateway refused the connection with HTTP {status}: {body}")]
    Refused { status: u16, body: String },
    #[error("the connection is closed")]
    Closed,
    #[error("no reply within {0:?}")]
    Timeout(Duration),
}

/// The code of the error a send gets when this client held it back
/// ([`Client::with_throttle`]): nothing was written to the gateway.
pub const HELD_BACK: &str = "held_back";

/// How long [`Client::send`] and [`Client::history`] wait for a reply.
pub const DEFAULT_REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// Held-back IDs kept before those not tried for [`HELD_IDS_KEPT`] are
/// forgotten (then again at twice what is left).
const HELD_IDS_PRUNE_AT: usize = 4096;
const HELD_IDS_KEPT: Duration = Duration::from_secs(60);

/// An ACK as the phone sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckReply {
    pub id: Vec<u8>,
    pub server_id: u64,
    pub seq: u64,
    pub duplicate: bool,
    /// `stored`, `duplicate_window` or `duplicate_unique_key`.
    pub outcome: String,
}

/// An error frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorReply {
    pub id: Option<Vec<u8>>,
    pub reference: Option<String>,
    /// `invalid_argument`, `unauthenticated`, `unavailable`, …
    pub code: String,
    pub retryable: bool,
    pub message: String,
    /// `id_reused`: the server id and seq of the message already stored
    /// under this ID.
    pub original: Option<(u64, u64)>,
    /// `overloaded`, `unavailable`: the server asks to wait this long
    /// before resending.
    pub retry_after: Option<Duration>,
}

/// One stored message in a history page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryMessage {
    pub sender: String,
    pub id: Vec<u8>,
    pub server_id: u64,
    pub seq: u64,
    pub body: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryPage {
    pub reference: Option<String>,
    pub conversation: String,
    pub messages: Vec<HistoryMessage>,
}

/// Any frame from the gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Ack(AckReply),
    Error(ErrorReply),
    History(HistoryPage),
    /// The gateway holds the send `id` and will answer it later; do not
    /// resend it before `retry_after`. The client counts these
    /// ([`Client::queued_answers`]) and keeps waiting for the answer.
    Queued {
        id: Vec<u8>,
        retry_after: Duration,
    },
}

type Waiter = oneshot::Sender<Reply>;

/// A send waiting for its reply, and whether its message was fresh
/// ([`FRESH_FOR`]) when sent: its refusal counts for the throttle of its
/// kind.
struct SendWaiter {
    reply: Waiter,
    fresh: bool,
}

/// A send's answer: known at once (held back), or to come.
enum Answer {
    Now(ErrorReply),
    Later(oneshot::Receiver<Reply>),
}

#[derive(Default)]
struct Pending {
    sends: HashMap<Vec<u8>, VecDeque<SendWaiter>>,
    pulls: HashMap<String, Waiter>,
    /// Set by the reader when the connection is gone: a waiter added after
    /// that would never be woken and would sit out the whole reply timeout.
    gone: bool,
    /// `queued` answers received.
    queued: u64,
    /// Client-side throttling, when asked for.
    throttle: Option<Throttles>,
    /// Sends held back by the throttle.
    held_back: u64,
    /// The IDs of sends held back and not written since, with when they
    /// were last held back: a try of one of them is not a new request.
    held_ids: HashMap<Vec<u8>, Instant>,
    /// Size of `held_ids` at which the stale are forgotten next.
    held_ids_prune_at: usize,
}

/// How the gateway closed a connection: the WebSocket close code (1001 going
/// away, 1008 policy, 1009 too big) and reason, when it sent a close frame.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Closed {
    pub code: Option<u16>,
    pub reason: String,
}

/// One connection to the gateway.
pub struct Client {
    encoding: Encoding,
    out: mpsc::Sender<Message>,
    pending: Arc<Mutex<Pending>>,
    unmatched: tokio::sync::Mutex<mpsc::UnboundedReceiver<Reply>>,
    closed: watch::Receiver<Option<Closed>>,
    next_ref: AtomicU64,
    reply_timeout: Duration,
    /// Send frames ask the gateway to hold them when it is full.
    queue: bool,
    /// Send frames written so far; taken together with the frame's place
    /// in the socket's queue, so numbers follow the order on the wire.
    sent_frames: Mutex<u64>,
}

impl Client {
    /// Connect to `url` (`ws://host:port/v1/ws`) with `token`.
    pub async fn connect(url: &str, token: &str, encoding: Encoding) -> Result<Self, ClientError> {
        let mut request = url
            .into_client_request()
            .map_err(|e| ClientError::Connect(e.to_string()))?;
        let bearer = http::HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|e| ClientError::Connect(e.to_string()))?;
        request
            .headers_mut()
            .insert(http::header::AUTHORIZATION, bearer);
        // A small read buffer: tungstenite zero-fills the whole of it before
        // every read (128 KiB by default), which a load driver with
        // thousands of phones pays per frame.
        let config = WebSocketConfig::default().read_buffer_size(READ_BUFFER_BYTES);
        let (socket, _) = match // Replies to one request at a time (history pages) must not wait
        // for Nagle's algorithm.
        tokio_tungstenite::connect_async_with_config(request, Some(config), true).await {
            Ok(ok) => ok,
            Err(tungstenite::Error::Http(response)) => {
                let status = response.status().as_u16();
                let body = response
                    .body()
                    .as_ref()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default();
                return Err(ClientError::Refused { status, body });
            }
            Err(e) => return Err(ClientError::Connect(e.to_string())),
        };
        let (mut sink, mut stream) = socket.split();
        let (out, mut outgoing) = mpsc::channel::<Message>(1024);
        tokio::spawn(async move {
            // Frames already queued go out in one write, then one flush.
            'writing: while let Some(first) = outgoing.recv().await {
                if sink.feed(first).await.is_err() {
                    break;
                }
                for _ in 0..64 {
                    let Ok(next) = outgoing.try_recv() else {
                        break;
                    };
                    if sink.feed(next).await.is_err() {
                        break 'writing;
                    }
                }
                if sink.flush().await.is_err() {
                    break;
                }
            }
            let _ = sink.close().await;
        });
        let pending = Arc::new(Mutex::new(Pending::default()));
        let (unmatched_tx, unmatched) = mpsc::unbounded_channel();
        let (closed_tx, closed) = watch::channel(None);
        let reader_pending = Arc::clone(&pending);
        tokio::spawn(async move {
            let mut close = Closed::default();
            while let Some(Ok(message)) = stream.next().await {
                let reply = match message {
                    Message::Text(text) => parse_json(text.as_bytes()),
                    Message::Binary(bytes) => parse_protobuf(&bytes),
                    Message::Close(frame) => {
                        if let Some(frame) = frame {
                            close = Closed {
                                code: Some(frame.code.into()),
                                reason: frame.reason.to_string(),
                            };
                        }
                        break;
                    }
                    _ => continue,
                };
                let Some(reply) = reply else { continue };
                if let Some(reply) = dispatch(&reader_pending, reply) {
                    let _ = unmatched_tx.send(reply);
                }
            }
            // Wake every waiter: the connection is gone.
            if let Ok(mut p) = reader_pending.lock() {
                p.gone = true;
                p.sends.clear();
                p.pulls.clear();
            }
            let _ = closed_tx.send(Some(close));
        });
        Ok(Self {
            encoding,
            out,
            pending,
            unmatched: tokio::sync::Mutex::new(unmatched),
            closed,
            next_ref: AtomicU64::new(1),
            reply_timeout: DEFAULT_REPLY_TIMEOUT,
            queue: false,
            sent_frames: Mutex::new(0),
        })
    }

    /// Wait at most `timeout` for each reply.
    pub fn with_reply_timeout(mut self, timeout: Duration) -> Self {
        self.reply_timeout = timeout;
        self
    }

    /// Ask the gateway, in every send frame, to hold a send when it is full
    /// (answering `queued`) instead of refusing it. The reply timeout must
    /// cover the wait: the gateway holds a send for up to 20 s by default.
    pub fn with_queue(mut self, queue: bool) -> Self {
        self.queue = queue;
        self
    }

    /// `queued` answers received on this connection so far.
    pub fn queued_answers(&self) -> u64 {
        self.lock().queued
    }

    /// Hold back some new sends while the gateway refuses much of what this
    /// connection sends (`overloaded`): adaptive throttling with factor `k`
    /// (2 is the usual value; 0 turns it off), see the `throttle` module.
    /// A send held back is answered at once, without a frame, with the
    /// retryable error [`HELD_BACK`] and a `retry_after` about as long as
    /// the gateway's last `overloaded` answer asked for.
    pub fn with_throttle(self, k: f64) -> Self {
        self.lock().throttle = (k > 0.0).then(|| Throttles::new(k, Instant::now()));
        self
    }

    /// Sends this client held back so far ([`Client::with_throttle`]).
    pub fn held_back_sends(&self) -> u64 {
        self.lock().held_back
    }

    async fn wait(&self, rx: oneshot::Receiver<Reply>) -> Result<Reply, ClientError> {
        tokio::time::timeout(self.reply_timeout, rx)
            .await
            .map_err(|_| ClientError::Timeout(self.reply_timeout))?
            .map_err(|_| ClientError::Closed)
    }

    /// Send a message and wait for its reply: an ACK or an error frame.
    pub async fn send(
        &self,
        id: &[u8],
        conversation: &str,
        body: &str,
    ) -> Result<Result<AckReply, ErrorReply>, ClientError> {
        let (_, reply) = self
            .enqueue_send(id, conversation, body, Duration::ZERO)
            .await?;
        self.send_reply(reply).await
    }

    /// [`Client::send`], also telling the send frame's place among the send
    /// frames this connection wrote (1 for the first): the order the
    /// gateway read them in; 0 for a send held back ([`HELD_BACK`]).
    pub async fn send_numbered(
        &self,
        id: &[u8],
        conversation: &str,
        body: &str,
    ) -> Result<(u64, Result<AckReply, ErrorReply>), ClientError> {
        self.send_numbered_since(id, conversation, body, Instant::now())
            .await
    }

    /// [`Client::send_numbered`] for a message written (put in the outbox)
    /// at `written`: the frame says how long the phone has had it
    /// (`age_ms`), so that after a surge the gateway serves the messages
    /// written since before the old ones it has not seen yet.
    pub async fn send_numbered_since(
        &self,
        id: &[u8],
        conversation: &str,
        body: &str,
        written: Instant,
    ) -> Result<(u64, Result<AckReply, ErrorReply>), ClientError> {
        let (number, reply) = self
            .enqueue_send(id, conversation, body, written.elapsed())
            .await?;
        Ok((number, self.send_reply(reply).await?))
    }

    /// Write several sends back to back, in this order, before waiting for
    /// any reply (as a phone's outbox does after a reconnect); then wait
    /// for each reply. Replies come in the order of `sends`.
    pub async fn send_pipelined(
        &self,
        sends: &[(&[u8], &str, &str)],
    ) -> Result<Vec<Result<AckReply, ErrorReply>>, ClientError> {
        let mut waiting = Vec::with_capacity(sends.len());
        for (id, conversation, body) in sends {
            waiting.push(
                self.enqueue_send(id, conversation, body, Duration::ZERO)
                    .await?
                    .1,
            );
        }
        let mut replies = Vec::with_capacity(waiting.len());
        for reply in waiting {
            replies.push(self.send_reply(reply).await?);
        }
        Ok(replies)
    }

    /// Queue a send frame for the socket: its number on this connection,
    /// and the receiver its reply arrives on; or the answer for a send the
    /// throttle holds back (number 0).
    async fn enqueue_send(
        &self,
        id: &[u8],
        conversation: &str,
        body: &str,
        age: Duration,
    ) -> Result<(u64, Answer), ClientError> {
        let age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
        let fresh = age < FRESH_FOR;
        if let Some(held) = self.hold_back(id, fresh) {
            return Ok((0, Answer::Now(held)));
        }
        let frame = match self.encoding {
            Encoding::Json => {
                let (id_text, id_b64) = json::id_to_json(id, false);
                json_message(&ClientJson::Send(json::SendJson {
                    id: id_text,
                    id_b64,
                    conversation: conversation.to_owned(),
                    body: body.to_owned(),
                    queue: self.queue,
                    age_ms,
                }))
            }
            Encoding::Protobuf => protobuf_message(client_frame::Kind::Send(pb::SendFrame {
                client_msg_id: id.to_vec(),
                conversation: conversation.to_owned(),
                body: body.to_owned(),
                queue: self.queue,
                age_ms,
            })),
        };
        let (tx, rx) = oneshot::channel();
        {
            let mut pending = self.lock();
            if pending.gone {
                return Err(ClientError::Closed);
            }
            pending
                .sends
                .entry(id.to_vec())
                .or_default()
                .push_back(SendWaiter { reply: tx, fresh });
        }
        let slot = self.out.reserve().await.map_err(|_| ClientError::Closed)?;
        let mut sent = self
            .sent_frames
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *sent += 1;
        slot.send(frame);
        Ok((*sent, Answer::Later(rx)))
    }

    /// Whether the throttle holds back this send of `id`, of a message
    /// `fresh` or not, and its answer.
    fn hold_back(&self, id: &[u8], fresh: bool) -> Option<ErrorReply> {
        let mut pending = self.lock();
        let pending = &mut *pending;
        let throttle = pending.throttle.as_mut()?;
        let now = Instant::now();
        let again = pending.held_ids.contains_key(id);
        if !throttle.hold_back(now, rand::random(), again, fresh) {
            if again {
                pending.held_ids.remove(id);
            }
            return None;
        }
        let wait = throttle.wait(now, rand::random_range(0.5..=1.5), fresh);
        if pending.held_ids.len() >= pending.held_ids_prune_at.max(HELD_IDS_PRUNE_AT) {
            // Sends their callers stopped trying.
            pending
                .held_ids
                .retain(|_, at| now.saturating_duration_since(*at) < HELD_IDS_KEPT);
            pending.held_ids_prune_at = 2 * pending.held_ids.len();
        }
        pending.held_ids.insert(id.to_vec(), now);
        pending.held_back += 1;
        Some(ErrorReply {
            id: Some(id.to_vec()),
            reference: None,
            code: HELD_BACK.to_owned(),
            retryable: true,
            message: "held back by the client: the gateway is refusing much of what it reads; send again after retry_after".to_owned(),
            original: None,
            retry_after: Some(wait),
        })
    }

    async fn send_reply(
        &self,
        answer: Answer,
    ) -> Result<Result<AckReply, ErrorReply>, ClientError> {
        let rx = match answer {
            Answer::Now(held) => return Ok(Err(held)),
            Answer::Later(rx) => rx,
        };
        match self.wait(rx).await? {
            Reply::Ack(ack) => Ok(Ok(ack)),
            Reply::Error(e) => Ok(Err(e)),
            Reply::History(_) | Reply::Queued { .. } => Err(ClientError::Closed),
        }
    }

    /// Pull up to `limit` messages of `conversation` with seq > `after_seq`.
    pub async fn history(
        &self,
        conversation: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Result<HistoryPage, ErrorReply>, ClientError> {
        let reference = format!("h{}", self.next_ref.fetch_add(1, Ordering::Relaxed));
        let frame = match self.encoding {
            Encoding::Json => json_message(&ClientJson::History(json::HistoryJson {
                conversation: conversation.to_owned(),
                after_seq,
                limit,
                reference: Some(reference.clone()),
            })),
            Encoding::Protobuf => protobuf_message(client_frame::Kind::History(pb::HistoryFrame {
                conversation: conversation.to_owned(),
                after_seq,
                limit,
                r#ref: reference.clone(),
            })),
        };
        let (tx, rx) = oneshot::channel();
        {
            let mut pending = self.lock();
            if pending.gone {
                return Err(ClientError::Closed);
            }
            pending.pulls.insert(reference, tx);
        }
        self.out
            .send(frame)
            .await
            .map_err(|_| ClientError::Closed)?;
        match self.wait(rx).await? {
            Reply::History(page) => Ok(Ok(page)),
            Reply::Error(e) => Ok(Err(e)),
            Reply::Ack(_) | Reply::Queued { .. } => Err(ClientError::Closed),
        }
    }

    /// Every stored message of `conversation`, following pages to the end.
    /// A page the gateway asks to pull later (`retry_after_ms`) is pulled
    /// again after that wait, a few times at most.
    pub async fn full_history(
        &self,
        conversation: &str,
    ) -> Result<Result<Vec<HistoryMessage>, ErrorReply>, ClientError> {
        const MAX_WAITS: u32 = 50;
        let mut all = Vec::new();
        let mut after = 0;
        let mut waits = 0;
        loop {
            let page = match self.history(conversation, after, 1000).await? {
                Ok(page) => page,
                Err(e) => match e.retry_after {
                    Some(wait) if e.retryable && waits < MAX_WAITS => {
                        waits += 1;
                        tokio::time::sleep(wait).await;
                        continue;
                    }
                    _ => return Ok(Err(e)),
                },
            };
            let Some(last) = page.messages.last() else {
                return Ok(Ok(all));
            };
            after = last.seq;
            all.extend(page.messages);
        }
    }

    /// Send a raw frame (for testing how the gateway treats bad input).
    pub async fn send_raw(&self, message: Message) -> Result<(), ClientError> {
        self.out
            .send(message)
            .await
            .map_err(|_| ClientError::Closed)
    }

    /// The next reply that matched no send or pull in flight, such as the
    /// error for a frame sent with [`Client::send_raw`]. `None` once the
    /// connection is closed.
    pub async fn next_unmatched(&self) -> Option<Reply> {
        self.unmatched.lock().await.recv().await
    }

    /// Wait until the gateway closes the connection; how it closed it.
    /// Whether the connection has closed (the server closed it, or it broke).
    pub fn is_closed(&self) -> bool {
        self.closed.borrow().is_some()
    }

    pub async fn closed(&self) -> Closed {
        let mut closed = self.closed.clone();
        match closed.wait_for(Option::is_some).await {
            Ok(close) => close.clone().unwrap_or_default(),
            // The reader is gone without a word: closed all the same.
            Err(_) => Closed::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn dispatch(pending: &Mutex<Pending>, reply: Reply) -> Option<Reply> {
    let mut pending = pending.lock().unwrap_or_else(|p| p.into_inner());
    let pending = &mut *pending;
    let waiter = match &reply {
        // The answer comes later; its waiter keeps waiting.
        Reply::Queued { .. } => {
            pending.queued += 1;
            return None;
        }
        Reply::Error(ErrorReply {
            id: Some(id),
            code,
            retry_after,
            ..
        }) if code == "overloaded" => {
            let waiter = pending.sends.get_mut(id).and_then(VecDeque::pop_front);
            if let Some(throttle) = pending.throttle.as_mut() {
                let fresh = waiter.as_ref().is_some_and(|w| w.fresh);
                throttle.refused(Instant::now(), *retry_after, fresh);
            }
            waiter.map(|w| w.reply)
        }
        Reply::Ack(AckReply { id, .. }) | Reply::Error(ErrorReply { id: Some(id), .. }) => pending
            .sends
            .get_mut(id)
            .and_then(VecDeque::pop_front)
            .map(|w| w.reply),
        // Protobuf cannot tell an empty ID from none: such an error answers
        // a send with the empty ID, if one is waiting.
        Reply::Error(ErrorReply {
            id: None,
            reference: None,
            ..
        }) => pending
            .sends
            .get_mut(&Vec::new())
            .and_then(VecDeque::pop_front)
            .map(|w| w.reply),
        Reply::Error(ErrorReply {
            reference: Some(r), ..
        })
        | Reply::History(HistoryPage {
            reference: Some(r), ..
        }) => pending.pulls.remove(r),
        _ => None,
    };
    match waiter {
        Some(waiter) => {
            let _ = waiter.send(reply);
            None
        }
        None => Some(reply),
    }
}

fn json_message(frame: &ClientJson) -> Message {
    Message::Text(serde_json::to_string(frame).unwrap_or_default().into())
}

fn protobuf_message(kind: client_frame::Kind) -> Message {
    Message::Binary(pb::ClientFrame { kind: Some(kind) }.encode_to_vec().into())
}

fn id_bytes(id: Option<String>, id_b64: Option<String>) -> Option<Vec<u8>> {
    json::id_from_json(id.as_deref(), id_b64.as_deref()).ok()
}

fn parse_json(bytes: &[u8]) -> Option<Reply> {
    let frame: ServerJson = serde_json::from_slice(bytes).ok()?;
    Some(match frame {
        ServerJson::Ack(a) => Reply::Ack(AckReply {
            id: id_bytes(a.id, a.id_b64)?,
            server_id: a.server_id.parse().ok()?,
            seq: a.seq,
            duplicate: a.duplicate,
            outcome: a.outcome,
        }),
        ServerJson::Error(e) => Reply::Error(ErrorReply {
            id: id_bytes(e.id, e.id_b64),
            reference: e.reference,
            original: match (e.server_id.and_then(|id| id.parse().ok()), e.seq) {
                (Some(server_id), Some(seq)) => Some((server_id, seq)),
                _ => None,
            },
            code: e.code,
            retryable: e.retryable,
            message: e.message,
            retry_after: e
                .retry_after_ms
                .map(|ms| Duration::from_millis(u64::from(ms))),
        }),
        ServerJson::Queued(q) => Reply::Queued {
            id: id_bytes(q.id, q.id_b64)?,
            retry_after: Duration::from_millis(u64::from(q.retry_after_ms)),
        },
        ServerJson::History(h) => Reply::History(HistoryPage {
            reference: h.reference,
            conversation: h.conversation,
            messages: h
                .messages
                .into_iter()
                .map(|m| {
                    Some(HistoryMessage {
                        id: id_bytes(m.id, m.id_b64)?,
                        sender: m.sender,
                        server_id: m.server_id.parse().ok()?,
                        seq: m.seq,
                        body: m.body,
                    })
                })
                .collect::<Option<_>>()?,
        }),
    })
}

fn outcome_name(outcome: i32) -> String {
    match pb::Outcome::try_from(outcome).unwrap_or(pb::Outcome::Unspecified) {
        pb::Outcome::Stored => "stored",
        pb::Outcome::DuplicateWindow => "duplicate_window",
        pb::Outcome::DuplicateUniqueKey => "duplicate_unique_key",
        pb::Outcome::Unspecified => "unspecified",
    }
    .to_owned()
}

fn code_name(code: i32) -> String {
    match pb::ErrorCode::try_from(code).unwrap_or(pb::ErrorCode::Unspecified) {
        pb::ErrorCode::InvalidArgument => "invalid_argument",
        pb::ErrorCode::Unauthenticated => "unauthenticated",
        pb::ErrorCode::PermissionDenied => "permission_denied",
        pb::ErrorCode::Unavailable => "unavailable",
        pb::ErrorCode::DeadlineExceeded => "deadline_exceeded",
        pb::ErrorCode::Overloaded => "overloaded",
        pb::ErrorCode::Internal | pb::ErrorCode::Unspecified => "internal",
        pb::ErrorCode::IdReused => "id_reused",
        pb::ErrorCode::MaybeStored => "maybe_stored",
    }
    .to_owned()
}

fn parse_protobuf(bytes: &[u8]) -> Option<Reply> {
    let frame = pb::ServerFrame::decode(bytes).ok()?;
    Some(match frame.kind? {
        server_frame::Kind::Ack(a) => Reply::Ack(AckReply {
            id: a.client_msg_id,
            server_id: a.server_id,
            seq: a.seq,
            duplicate: a.duplicate,
            outcome: outcome_name(a.outcome),
        }),
        server_frame::Kind::Error(e) => Reply::Error(ErrorReply {
            id: (!e.client_msg_id.is_empty()).then_some(e.client_msg_id),
            reference: (!e.r#ref.is_empty()).then_some(e.r#ref),
            original: (e.code == pb::ErrorCode::IdReused as i32)
                .then_some((e.original_server_id, e.original_seq)),
            code: code_name(e.code),
            retryable: e.retryable,
            message: e.message,
            retry_after: (e.retry_after_ms > 0)
                .then(|| Duration::from_millis(u64::from(e.retry_after_ms))),
        }),
        server_frame::Kind::Queued(q) => Reply::Queued {
            id: q.client_msg_id,
            retry_after: Duration::from_millis(u64::from(q.retry_after_ms)),
        },
        server_frame::Kind::History(h) => Reply::History(HistoryPage {
            reference: (!h.r#ref.is_empty()).then_some(h.r#ref),
            conversation: h.conversation,
            messages: h
                .messages
                .into_iter()
                .map(|m| HistoryMessage {
                    sender: m.sender,
                    id: m.client_msg_id,
                    server_id: m.server_id,
                    seq: m.seq,
                    body: m.body,
                })
                .collect(),
        }),
    })
}

pub use tokio_tungstenite::tungstenite::Message as RawMessage;

/// How long a phone has had a message before it is old
/// ([`Client::with_throttle`] decides for fresh and old messages apart).
pub use imdedup_proto::FRESH_FOR;

#[cfg(test)]
mod tests {
    use super::*;

    /// A gateway that accepts the WebSocket and closes it at once, as a
    /// gateway shutting down does ("going away").
    async fn closing_gateway() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut socket = tokio_tungstenite::accept_async(tcp).await.unwrap();
            let _ = socket.close(None).await;
            // keep the TCP connection open, as a gateway still draining does
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        format!("ws://{addr}/v1/ws")
    }

    #[tokio::test]
    async fn a_send_after_the_gateway_closed_the_connection_fails_at_once() {
        let url = closing_gateway().await;
        let client = Client::connect(&url, "token", Encoding::Json)
            .await
            .unwrap()
            .with_reply_timeout(Duration::from_secs(20));
        client.closed().await;
        // Before the fix this send waited out the whole reply timeout: its
        // waiter was added after the reader had woken every waiter.
        let started = Instant::now();
        let sent = client.send(b"m1", "dm:a:b", "hi").await;
        assert!(matches!(sent, Err(ClientError::Closed)), "{sent:?}");
        let pulled = client.history("dm:a:b", 0, 10).await;
        assert!(matches!(pulled, Err(ClientError::Closed)), "{pulled:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
