//! One phone connection: frames in, ACKs and pages out, several sends in
//! flight at once.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use axum::extract::ws::{CloseFrame, Message, WebSocket, close_code};
use futures_util::{SinkExt, StreamExt};
use imdedup_domain::{
    Error, ErrorKind,
    model::{Ack, ClientMsgId, ConversationId, HistoryQuery, Sender, StoredMessage},
};
use imdedup_proto::convert;
use imdedup_runtime::metrics::GaugeGuard;
use tokio::sync::{Notify, Semaphore, mpsc, oneshot};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{
    AdmittedSend, Gateway, Held,
    admission::{Completion, Pass},
    frames::{self, Encoded, Encoding, HistoryCmd, Inbound, Outbound, ReplyTo, SendCmd},
    resends::Leader,
};

/// What the token said about this connection.
pub struct Session {
    pub sender: Sender,
    pub expires_at_unix: u64,
}

/// Serve one connection until the phone leaves, the token expires, or the
/// gateway shuts down; then finish the sends in flight and close.
pub async fn run(
    socket: WebSocket,
    gateway: Arc<Gateway>,
    session: Session,
    shutdown: CancellationToken,
) {
    let _open = gateway.metrics().connection_opened();
    let (sink, mut stream) = socket.split();
    let (out, outgoing) = mpsc::channel::<Message>(gateway.config.max_in_flight_per_connection * 2);
    let writer = tokio::spawn(write_replies(sink, outgoing));
    let limits = &gateway.config.limits;
    // A quiet connection is pinged; one that answers nothing at all, not
    // even the pings, is closed so a dead phone frees its slot.
    let mut ping = tokio::time::interval(limits.ping_interval);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ping.reset();
    let idle_timeout = limits.idle_timeout;
    let mut last_heard = tokio::time::Instant::now();
    let mut connection = Connection {
        in_flight: Arc::new(Semaphore::new(gateway.config.max_in_flight_per_connection)),
        pulls: Arc::new(Semaphore::new(limits.max_pulls_per_connection.max(1))),
        gateway: Arc::clone(&gateway),
        session,
        out,
        tasks: TaskTracker::new(),
        order: SendOrder::default(),
        held: HeldSends::default(),
    };
    // How the connection ends, when the gateway ends it.
    let close: Option<CloseFrame> = loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => {
                break Some(close_frame(close_code::AWAY, "server shutting down; reconnect"));
            }
            () = tokio::time::sleep_until(last_heard + idle_timeout) => {
                gateway.metrics().limited("idle");
                break Some(close_frame(close_code::AWAY, "idle; reconnect"));
            }
            _ = ping.tick() => {
                // Never waits: a full queue means replies are flowing.
                let _ = connection.out.try_send(Message::Ping(Default::default()));
                continue;
            }
            next = stream.next() => next,
        };
        last_heard = tokio::time::Instant::now();
        let (encoding, bytes) = match next {
            Some(Ok(Message::Text(text))) => (Encoding::Json, text.as_bytes().to_vec()),
            Some(Ok(Message::Binary(bytes))) => (Encoding::Protobuf, bytes.to_vec()),
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Close(_))) | None => break None,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "websocket read failed");
                break frame_too_big(&e).then(|| {
                    close_frame(close_code::SIZE, "frame larger than the gateway accepts")
                });
            }
        };
        if let Err(close) = connection.take(encoding, &bytes).await {
            break close;
        }
    };
    connection.finish(close).await;
    let _ = writer.await;
}

/// Write every reply already queued, then flush once: under load one write
/// carries many small ACKs, and none waits for a later one.
async fn write_replies(
    mut sink: futures_util::stream::SplitSink<WebSocket, Message>,
    mut outgoing: mpsc::Receiver<Message>,
) {
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
}

/// A connection's reading side: what it has taken in and not answered yet.
struct Connection {
    gateway: Arc<Gateway>,
    session: Session,
    /// Replies, to the socket's writer.
    out: mpsc::Sender<Message>,
    /// The connection's places for sends and pulls in flight.
    in_flight: Arc<Semaphore>,
    pulls: Arc<Semaphore>,
    /// Every send and pull taken in, answered before the connection closes.
    tasks: TaskTracker,
    order: SendOrder,
    held: HeldSends,
}

impl Connection {
    /// Take in one frame: answer it at once (a refusal, `queued`) or start
    /// its work. `Err` ends the connection, with the close frame to send if
    /// any.
    async fn take(&mut self, encoding: Encoding, bytes: &[u8]) -> Result<(), Option<CloseFrame>> {
        let read_at = Instant::now();
        let decoded = frames::decode(encoding, bytes);
        if self.gateway.config.clock.unix_seconds() >= self.session.expires_at_unix {
            self.answer_expired(encoding, &decoded, read_at).await;
            return Err(Some(close_frame(close_code::POLICY, "token expired")));
        }
        let work = decoded.and_then(|inbound| self.admit(inbound));
        let work = match work {
            Ok(work) => work,
            Err((to, error)) => {
                refuse(&self.gateway, &self.out, encoding, to, error, read_at).await;
                return Ok(());
            }
        };
        let reply = Reply {
            gateway: Arc::clone(&self.gateway),
            out: self.out.clone(),
            encoding,
            read_at,
        };
        let work = match work {
            Work::Send(cmd, AdmittedSend::Held(hold)) => {
                self.hold(reply, cmd, hold).await;
                return Ok(());
            }
            work => work,
        };
        // A joined copy stores nothing, so it takes no turn.
        let turn = match &work {
            Work::Send(cmd, AdmittedSend::Lead { .. }) => Some(self.order.next(&cmd.conversation)),
            Work::Send(..) | Work::Pull(..) => None,
        };
        // Waiting here stops reading: a phone cannot queue unbounded work.
        let Ok(permit) = Arc::clone(&self.in_flight).acquire_owned().await else {
            return Err(None);
        };
        let sender = self.session.sender.clone();
        self.tasks.spawn(async move {
            serve(reply, sender, work, turn).await;
            drop(permit);
        });
        Ok(())
    }

    /// Answer the frame that found the token expired, named like any other
    /// answer.
    async fn answer_expired(
        &self,
        encoding: Encoding,
        decoded: &Result<Inbound, (ReplyTo, Error)>,
        read_at: Instant,
    ) {
        let to = match decoded {
            Ok(Inbound::Send(cmd)) => ReplyTo::send(cmd),
            Ok(Inbound::History(cmd)) => ReplyTo::history(cmd),
            Err((to, _)) => to.clone(),
        };
        let error = Error::unauthenticated("token has expired; reconnect with a new one");
        refuse(&self.gateway, &self.out, encoding, to, error, read_at).await;
    }

    /// The limits of the user and the gateway: refused at once, with when
    /// to come back, rather than queued. A copy of a send in flight joins
    /// it instead.
    fn admit(&self, inbound: Inbound) -> Result<Work, (ReplyTo, Error)> {
        match inbound {
            Inbound::Send(cmd) => {
                if cmd.queue {
                    self.held
                        .promote_if_draining(&cmd.conversation, &self.gateway);
                }
                let behind_held = cmd.queue && self.held.waiting(&cmd.conversation);
                match self
                    .gateway
                    .admit_send(&self.session.sender, &cmd, behind_held)
                {
                    Ok(admitted) => Ok(Work::Send(cmd, admitted)),
                    Err(error) => Err((ReplyTo::send(&cmd), error)),
                }
            }
            Inbound::History(cmd) => match Arc::clone(&self.pulls).try_acquire_owned() {
                Ok(permit) => Ok(Work::Pull(cmd, permit)),
                Err(_) => {
                    self.gateway.metrics().limited("history_pulls");
                    Err((
                        ReplyTo::history(&cmd),
                        Error::overloaded(
                            "too many history pulls in flight on this connection; pull again after the last page arrives",
                            PULL_RETRY_AFTER,
                        ),
                    ))
                }
            },
        }
    }

    /// Answer `queued` now, and send it when its appointment comes, without
    /// a place of the connection's: what the gateway holds is bounded by
    /// its budget for held sends and the user's rate.
    async fn hold(&mut self, reply: Reply, cmd: SendCmd, hold: Held) {
        let turn = self.order.next(&cmd.conversation);
        let promoted = self.held.hold(&cmd.conversation);
        let queued = Outbound::Queued {
            id: cmd.id.clone(),
            id_b64: cmd.id_b64,
            retry_after: hold.wait + QUEUED_GRACE,
        };
        let _ = self
            .out
            .send(message(frames::encode(reply.encoding, queued)))
            .await;
        let sender = self.session.sender.clone();
        let closing = self.held.closing.clone();
        self.tasks.spawn(serve_held(
            reply, sender, cmd, hold, turn, closing, promoted,
        ));
    }

    /// Every frame read so far is answered before the connection closes;
    /// held sends not started yet are answered `unavailable` (not stored).
    /// Then the close frame, if the gateway ends the connection.
    async fn finish(self, close: Option<CloseFrame>) {
        self.held.closing.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        if let Some(frame) = close {
            let _ = self.out.send(Message::Close(Some(frame))).await;
        }
    }
}

/// Do a send or a pull taken in, and answer it.
async fn serve(reply: Reply, sender: Sender, work: Work, turn: Option<Turn>) {
    match work {
        Work::Send(cmd, admitted) => {
            let in_flight = reply.gateway.metrics().send_started();
            let to = ReplyTo::send(&cmd);
            let id_b64 = cmd.id_b64;
            let result = match admitted {
                AdmittedSend::Join(first) => first.answer().await,
                AdmittedSend::Lead { pass, leader } => {
                    let turn = match turn {
                        Some(turn) => Some(turn.wait().await),
                        None => None,
                    };
                    let result = send(&reply.gateway, sender, cmd).await;
                    // The next send of this conversation may go now.
                    drop(turn);
                    pass.finish(Completion::of(&result));
                    if let Some(leader) = leader {
                        leader.answer(&result);
                    }
                    result
                }
                // Taken care of before the connection's place.
                AdmittedSend::Held(_) => return,
            };
            reply.send(to, id_b64, result, in_flight).await;
        }
        Work::Pull(cmd, pull) => {
            let page = history(&reply.gateway, &sender, cmd).await;
            let _ = reply
                .out
                .send(message(frames::encode(reply.encoding, page)))
                .await;
            drop(pull);
        }
    }
}

/// A `queued` answer asks the phone not to resend before the appointment
/// and this much more: about the time the send then takes.
const QUEUED_GRACE: Duration = Duration::from_secs(1);

/// Where a send's answer goes.
struct Reply {
    gateway: Arc<Gateway>,
    out: mpsc::Sender<Message>,
    encoding: Encoding,
    /// When its frame was read.
    read_at: Instant,
}

impl Reply {
    /// Answer a send with its ACK or error, counted, releasing its place in
    /// the gateway's in-flight gauge.
    async fn send(
        self,
        to: ReplyTo,
        id_b64: bool,
        result: Result<Ack, Error>,
        in_flight: GaugeGuard,
    ) {
        let kind = result.as_ref().map(|ack| ack.outcome).map_err(Error::kind);
        let reply = match result {
            Ok(ack) => Outbound::Ack { ack, id_b64 },
            Err(error) => Outbound::Error { to, error },
        };
        let reply = message(frames::encode(self.encoding, reply));
        // Counted as answered once the reply is ready to go; enqueueing
        // waits only while the socket's writer is behind.
        drop(in_flight);
        self.gateway
            .metrics()
            .send_answered(kind, self.read_at.elapsed());
        let _ = self.out.send(reply).await;
    }
}

/// The sends this connection holds for their appointments.
#[derive(Default)]
struct HeldSends {
    /// Per conversation with held sends, the signal that moves them ahead
    /// of the backlog; each of its held sends still waiting for a place
    /// holds a clone (see [`HeldSends::waiting`]).
    promote: HashMap<String, Arc<Notify>>,
    /// Size of `promote` at which the conversations without held sends are
    /// forgotten next.
    prune_at: usize,
    /// Cancelled when the connection ends: held sends not started yet are
    /// answered `unavailable` then.
    closing: CancellationToken,
}

/// Whether a held send of the conversation whose promotion signal this is
/// still waits for a place: each such send keeps a clone until its place
/// comes.
fn still_held(promote: &Arc<Notify>) -> bool {
    Arc::strong_count(promote) > 1
}

impl HeldSends {
    /// Whether a send of `conversation` is held and still waits for a
    /// place, whether or not its appointment has come: a send behind it
    /// must then be held too. Taken in, it would wait for that send's turn
    /// holding a place of the limit, and sends waiting like that, once
    /// they hold every place, leave none for the held sends they wait for
    /// (on Redis + Cassandra at 3x the capacity every send in flight waited
    /// so and nothing was answered for a minute).
    fn waiting(&self, conversation: &str) -> bool {
        self.promote.get(conversation).is_some_and(still_held)
    }

    /// Hold a send of `conversation`: the signal it listens to for
    /// promotion, to keep until its place comes.
    fn hold(&mut self, conversation: &str) -> Arc<Notify> {
        prune(&mut self.promote, &mut self.prune_at, |_, promote| {
            still_held(promote)
        });
        Arc::clone(self.promote.entry(conversation.to_owned()).or_default())
    }

    /// A new send of `conversation` came: while the backlog drains, its
    /// held sends go ahead of the backlog, so that this one does not wait
    /// behind all of it.
    fn promote_if_draining(&self, conversation: &str, gateway: &Gateway) {
        if let Some(promote) = self.promote.get(conversation)
            && still_held(promote)
            && gateway.draining()
        {
            promote.notify_waiters();
        }
    }
}

/// Send a held send when its place comes, after the sends of its
/// conversation before it, and answer it; or answer `unavailable` if the
/// connection ends first.
async fn serve_held(
    reply: Reply,
    sender: Sender,
    cmd: SendCmd,
    hold: Held,
    turn: Turn,
    closing: CancellationToken,
    promote: Arc<Notify>,
) {
    let Held {
        mut ticket,
        mut promoted,
        leader,
        ..
    } = hold;
    let Turn { mut after, done } = turn;
    let mut urgent = false;
    let placed = loop {
        tokio::select! {
            () = closing.cancelled() => break Err(Error::unavailable(
                "the connection closed before the queued send's turn; not stored: resend with the same id",
            )),
            pass = ticket.place() => break pass.ok_or_else(|| reply.gateway.held_too_long()),
            // Its conversation has a new send while the backlog drains:
            // ahead of the backlog,
            () = promote.notified(), if !promoted => promoted = true,
            // once the sends before it are answered (the old ticket,
            // dropped, leaves the queue). Ahead of them it would take a
            // place and wait for their turn in it, and sends waiting so,
            // once they hold every place, leave none for those before them.
            () = answered(&mut after), if promoted && !urgent => {
                ticket = reply.gateway.hold_urgent(&sender, &cmd.id);
                urgent = true;
            }
        }
    };
    let turn = Turn { after, done };
    // No longer waiting for a place: a new send of the conversation may
    // take one and wait for this send's turn.
    drop(promote);
    // Tens of thousands wait here in a surge, each a task: the send's own
    // state (2 KB of gRPC call) is allocated when its place comes, not for
    // the whole wait (632 bytes a held task instead of 2,560).
    Box::pin(send_held(reply, sender, cmd, placed, turn, leader)).await;
}

/// A held send, once its place came (or never will): sent in its
/// conversation's turn, and answered.
async fn send_held(
    reply: Reply,
    sender: Sender,
    cmd: SendCmd,
    placed: Result<Pass, Error>,
    turn: Turn,
    leader: Option<Leader>,
) {
    let to = ReplyTo::send(&cmd);
    let id_b64 = cmd.id_b64;
    let in_flight = reply.gateway.metrics().send_started();
    let result = match placed {
        Ok(pass) => {
            let going = turn.wait().await;
            let result = send(&reply.gateway, sender, cmd).await;
            drop(going);
            pass.finish(Completion::of(&result));
            result
        }
        Err(error) => Err(error),
    };
    if let Some(leader) = leader {
        leader.answer(&result);
    }
    reply.send(to, id_b64, result, in_flight).await;
}

/// What a frame asks for, once taken in.
enum Work {
    Send(SendCmd, AdmittedSend),
    /// A pull, holding one of the connection's pull places.
    Pull(HistoryCmd, tokio::sync::OwnedSemaphorePermit),
}

/// How long a phone is asked to wait before another pull, when it has too
/// many in flight.
const PULL_RETRY_AFTER: Duration = Duration::from_millis(200);

fn close_frame(code: u16, reason: &'static str) -> CloseFrame {
    CloseFrame {
        code,
        reason: reason.into(),
    }
}

/// Whether a read failed because the phone's frame was over the size limit.
/// axum boxes the WebSocket library's error, so only its text says so.
fn frame_too_big(error: &axum::Error) -> bool {
    let text = error.to_string();
    text.contains("Message too long") || text.contains("Frame too long")
}

/// Keeps the sends of one conversation on one connection in the order the
/// phone sent them: each waits until the one before it has been answered, so
/// seqs follow send order. Sends to other conversations do not wait.
#[derive(Default)]
struct SendOrder {
    /// Per conversation, the signal that its latest send was answered.
    last: HashMap<String, oneshot::Receiver<()>>,
    /// Size of `last` at which the answered conversations are forgotten
    /// next.
    prune_at: usize,
}

/// A send's place in its conversation's order.
struct Turn {
    after: Option<oneshot::Receiver<()>>,
    done: oneshot::Sender<()>,
}

/// Held while a send is in progress; dropping it (and so its sender) lets
/// the next one go.
struct Going {
    _done: oneshot::Sender<()>,
}

impl SendOrder {
    fn next(&mut self, conversation: &str) -> Turn {
        // Forget conversations whose last send was answered.
        prune(&mut self.last, &mut self.prune_at, |_, rx| {
            matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty))
        });
        let (done, rx) = oneshot::channel();
        let after = self.last.insert(conversation.to_owned(), rx);
        Turn { after, done }
    }
}

/// A connection keeps this many conversations before it first forgets
/// finished ones.
const PRUNE_FROM: usize = 64;

/// Forget the entries of `map` that `keep` rejects, each time the map has
/// doubled since the last time (and from [`PRUNE_FROM`] entries). While a
/// backlog stands, hundreds of a connection's conversations have a send
/// pending; going through all of them on every send (as before) cost the
/// gateway time in proportion to its backlog, just when it had least.
fn prune<V>(
    map: &mut HashMap<String, V>,
    prune_at: &mut usize,
    keep: impl FnMut(&String, &mut V) -> bool,
) {
    if map.len() >= *prune_at {
        map.retain(keep);
        *prune_at = map.len().saturating_mul(2).max(PRUNE_FROM);
    }
}

/// Wait until the send before (if any) is answered; `after` is `None`
/// from then on.
async fn answered(after: &mut Option<oneshot::Receiver<()>>) {
    if let Some(before) = after.as_mut() {
        let _ = before.await;
    }
    *after = None;
}

impl Turn {
    /// Wait until the previous send of the conversation was answered (or
    /// dropped).
    async fn wait(self) -> Going {
        if let Some(after) = self.after {
            let _ = after.await;
        }
        Going { _done: self.done }
    }
}

/// Answer a frame the gateway will not act on with `error`; a refused send
/// (not a pull) counts as a send answered with an error.
async fn refuse(
    gateway: &Gateway,
    out: &mpsc::Sender<Message>,
    encoding: Encoding,
    to: ReplyTo,
    error: Error,
    read_at: Instant,
) {
    if to.reference.is_none() {
        gateway
            .metrics()
            .send_answered(Err(error.kind()), read_at.elapsed());
    }
    let _ = out
        .send(message(frames::encode(
            encoding,
            Outbound::Error { to, error },
        )))
        .await;
}

fn message(encoded: Encoded) -> Message {
    match encoded {
        Encoded::Text(text) => Message::Text(text.into()),
        Encoded::Binary(bytes) => Message::Binary(bytes.into()),
    }
}

/// One send is one trace, and this span is its root: the phone carries no
/// trace context. Kind server (the gateway answers the phone); the hops to
/// ingest and storage continue it (see `imdedup_runtime::telemetry`).
#[tracing::instrument(
    name = "imdedup.send",
    skip_all,
    fields(
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        network.protocol.name = "websocket",
        imdedup.outcome = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
)]
async fn send(gateway: &Gateway, sender: Sender, cmd: SendCmd) -> Result<Ack, Error> {
    let validated = if ClientMsgId::is_reserved_for_business(&cmd.id) {
        // Those IDs are derived from business idempotency keys: a phone
        // must not be able to answer for, or collide with, a business call.
        Err(Error::invalid(
            "client message ids starting with \"bk:\" are reserved for the business API",
        ))
    } else {
        convert::new_message(
            sender.as_str().to_owned(),
            cmd.id,
            cmd.conversation,
            cmd.body,
            gateway.config.max_body_bytes,
        )
    };
    let authorized = match validated {
        Ok(message) => gateway
            .config
            .authz
            .check(&sender, &message.conversation)
            .await
            .map(|()| message),
        Err(e) => Err(e),
    };
    let result = match authorized {
        Ok(message) => {
            let (shard, result) = gateway
                .shards
                .send(message, gateway.config.send_timeout)
                .await;
            gateway
                .metrics()
                .shard_replied(shard, result.as_ref().map(|_| ()).map_err(Error::kind));
            result.map_err(for_phone)
        }
        Err(e) => Err(e),
    };
    let span = tracing::Span::current();
    match &result {
        Ok(ack) => {
            span.record("imdedup.outcome", ack.outcome.as_str());
        }
        Err(error) => {
            span.record("error.type", error.kind().as_str());
            if error.retryable() {
                span.record("otel.status_code", "ERROR");
            }
        }
    }
    result
}

/// An error from ingest or storage, as the phone gets it. The gateway has
/// validated the frame already, so a refusal further on is not final for the
/// phone (a rolling update can change limits between hops): not stored,
/// resend. The text says what to do, never which node, file or driver
/// failed; the full cause goes to the log.
pub(crate) fn for_phone(error: Error) -> Error {
    if error.kind() == ErrorKind::IdReused {
        return error;
    }
    if error.kind() == ErrorKind::Overloaded {
        // Refusals under load come by the thousand and are counted in the
        // metrics: a log line each would add to the load.
        tracing::debug!(error = %error, "backend busy");
    } else {
        tracing::warn!(error = %error, "backend error");
    }
    let (kind, message) = match error.kind() {
        ErrorKind::MaybeStored => (
            ErrorKind::MaybeStored,
            "this send may be stored; resend with the same id to settle it",
        ),
        ErrorKind::DeadlineExceeded => (
            ErrorKind::DeadlineExceeded,
            "no answer in time; this send may be stored: resend with the same id",
        ),
        ErrorKind::Overloaded => (
            ErrorKind::Overloaded,
            "the service is busy; not stored: resend with the same id after a pause",
        ),
        ErrorKind::Internal => (
            ErrorKind::Internal,
            "internal error; resend with the same id",
        ),
        ErrorKind::Unavailable
        | ErrorKind::InvalidArgument
        | ErrorKind::Unauthenticated
        | ErrorKind::PermissionDenied
        | ErrorKind::IdReused => (
            ErrorKind::Unavailable,
            "the service is unavailable; not stored: resend with the same id",
        ),
    };
    // The backend's hint when it gave one, else a pause that spreads
    // resends out instead of bringing them straight back.
    let retry_after = error.retry_after().or(match kind {
        ErrorKind::Overloaded => Some(crate::BUSY_RETRY_AFTER),
        ErrorKind::Unavailable => Some(UNAVAILABLE_RETRY_AFTER),
        _ => None,
    });
    let phone = Error::new(kind, message);
    match retry_after {
        Some(after) => phone.with_retry_after(after),
        None => phone,
    }
}

/// How long a phone is asked to wait after `unavailable`.
const UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// A backend's failure to serve a pull, as the phone sees it. A pull
/// changes nothing, so whatever went wrong behind the gateway (the
/// database down or slow, a pending row it could not settle) means the
/// same to the phone: `unavailable`, pull again after the backend's hint or
/// a second. The send-path words (`maybe_stored`, "resend with the same
/// id") do not apply.
fn pull_failed(error: Error) -> Error {
    tracing::warn!(error = %error, "history pull failed");
    let wait = error.retry_after().unwrap_or(UNAVAILABLE_RETRY_AFTER);
    Error::unavailable("history is unavailable right now; pull again").with_retry_after(wait)
}

async fn history(gateway: &Gateway, sender: &Sender, cmd: HistoryCmd) -> Outbound {
    let to = ReplyTo::history(&cmd);
    let query = ConversationId::parse(cmd.conversation.clone())
        .and_then(|conversation| HistoryQuery::new(conversation, cmd.after_seq, cmd.limit));
    let result = match query {
        Ok(query) => match gateway
            .config
            .authz
            .check(sender, &query.conversation)
            .await
        {
            Ok(()) => gateway.history(&query).await.map_err(pull_failed),
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    match result {
        Ok(mut messages) => {
            keep_within(&mut messages, gateway.config.limits.max_history_page_bytes);
            Outbound::History {
                reference: cmd.reference,
                conversation: cmd.conversation,
                messages,
            }
        }
        Err(error) => Outbound::Error { to, error },
    }
}

/// Cut a page after the messages whose bodies fit in `max_bytes` (keeping
/// at least one): the phone pages on from the last seq it got, and only an
/// empty page ends the history.
fn keep_within(messages: &mut Vec<StoredMessage>, max_bytes: usize) {
    let mut total = 0;
    let fits = messages
        .iter()
        .take_while(|m| {
            total += m.body.len();
            total <= max_bytes
        })
        .count();
    messages.truncate(fits.max(1));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn send_order_forgets_answered_conversations_and_keeps_pending_ones() {
        let mut order = SendOrder::default();
        // 300 conversations with a send pending, then thousands answered.
        let pending: Vec<Turn> = (0..300).map(|i| order.next(&format!("p{i}"))).collect();
        for i in 0..5_000 {
            drop(order.next(&format!("a{i}")));
        }
        assert!(
            order.last.len() < 2 * 300 + PRUNE_FROM,
            "answered conversations are forgotten: {} kept",
            order.last.len()
        );
        // Every pending conversation still orders its next send after it.
        let mut going = Vec::new();
        for (i, first) in pending.into_iter().enumerate() {
            let next = order.next(&format!("p{i}"));
            assert!(next.after.is_some(), "p{i} forgot its pending send");
            going.push((first.wait().await, next));
        }
        let (first, next) = going.pop().expect("a pending conversation");
        let waiting = next.wait();
        tokio::pin!(waiting);
        let early = tokio::time::timeout(Duration::from_millis(20), &mut waiting).await;
        assert!(early.is_err(), "waits for the send before it");
        drop(first);
        let after = tokio::time::timeout(Duration::from_secs(5), &mut waiting).await;
        assert!(after.is_ok(), "goes once it is answered");
    }

    /// A held send whose appointment passed while the gateway was behind
    /// still waits for a place, so a new send of its conversation must be
    /// held behind it (not take a place and wait for its turn there); once
    /// its place came, a new send may go.
    #[test]
    fn a_held_send_holds_back_its_conversation_until_its_place_comes() {
        let mut held = HeldSends::default();
        assert!(!held.waiting("dm:ana:bo"));
        let listening = held.hold("dm:ana:bo");
        assert!(held.waiting("dm:ana:bo"));
        assert!(!held.waiting("dm:ana:carl"));
        let second = held.hold("dm:ana:bo");
        drop(listening);
        assert!(held.waiting("dm:ana:bo"), "one of its sends still waits");
        drop(second);
        assert!(!held.waiting("dm:ana:bo"));
    }

    /// A gateway whose backends are never reached.
    fn gateway(limits: crate::limits::Limits) -> Arc<Gateway> {
        use imdedup_domain::{clock::SystemClock, routing::ShardMap};
        use imdedup_runtime::{
            tls::InternalTls,
            token::{TokenKey, TokenVerifier},
        };

        let key = TokenKey::new("0123456789abcdef0123456789abcdef-test").expect("a key");
        Arc::new(
            Gateway::new(crate::GatewayConfig {
                shards: ShardMap::parse(&["ingest-0=http://127.0.0.1:9"]).expect("a shard"),
                storage: "http://127.0.0.1:9".to_owned(),
                internal_tls: InternalTls::Plaintext,
                tokens: TokenVerifier::hs256(key),
                service_tokens: None,
                authz: crate::authz::Authorizer::Open,
                send_timeout: Duration::from_secs(5),
                max_body_bytes: 4096,
                max_connections: 10,
                max_in_flight_per_connection: 10,
                limits,
                clock: Arc::new(SystemClock),
            })
            .expect("a gateway that connects lazily"),
        )
    }

    /// Appointments reach 20 s ahead at most. A phone refused past that
    /// is told to come back after 20 s, however soon the backlog ahead of
    /// it is served; a phone that asked to be queued is held instead, and
    /// goes as soon as a place frees.
    #[tokio::test]
    async fn a_phone_that_asks_to_be_queued_is_held_even_past_the_horizon() {
        let gateway = gateway(crate::limits::Limits {
            max_sends_in_flight: 1,
            ..crate::limits::Limits::default()
        });
        let cmd = |i: usize, queue: bool| SendCmd {
            id: format!("m-{i}").into_bytes(),
            id_b64: false,
            conversation: format!("dm:u{i}:bo"),
            body: "hello".to_owned(),
            queue,
        };
        let sender = |i: usize| Sender::parse(format!("u{i}")).expect("a sender");
        let mut kept = Vec::new();
        // The one place, then appointments 0.1 s apart (the slowest pace,
        // as nothing was served yet): 200 reach the horizon.
        for i in 0..400 {
            let admitted = gateway
                .admit_send(&sender(i), &cmd(i, true), false)
                .expect("held, not refused");
            assert!(
                i == 0 || matches!(admitted, AdmittedSend::Held(_)),
                "send {i} is held"
            );
            kept.push(admitted);
        }
        let refused = gateway
            .admit_send(&sender(400), &cmd(400, false), false)
            .err()
            .expect("a phone that did not ask to be queued is refused");
        assert_eq!(refused.kind(), imdedup_domain::ErrorKind::Overloaded);
        let wait = refused.retry_after().expect("a retry-after hint");
        assert!(
            wait >= Duration::from_secs(18),
            "past the horizon: {wait:?}"
        );
    }

    /// Past the budget for held sends, a phone that asked to be queued is
    /// refused with its appointment, and the refusal is counted under its
    /// own reason: the budget is memory, and an operator must see it bind.
    #[tokio::test]
    async fn past_the_budget_for_held_sends_a_queued_send_is_refused_and_counted_apart() {
        let cmd = |i: usize| SendCmd {
            id: format!("m-{i}").into_bytes(),
            id_b64: false,
            conversation: format!("dm:u{i}:bo"),
            body: "hello".to_owned(),
            queue: true,
        };
        let gateway = gateway(crate::limits::Limits {
            max_sends_in_flight: 1,
            // Room for two held sends, not three.
            max_held_bytes: 2 * crate::held_bytes(&cmd(1)) as usize + 100,
            ..crate::limits::Limits::default()
        });
        let sender = |i: usize| Sender::parse(format!("u{i}")).expect("a sender");
        let _taken = gateway.admission.admit("x", b"0").expect("the one place");
        let mut kept = Vec::new();
        for i in 1..=2 {
            let admitted = gateway.admit_send(&sender(i), &cmd(i), false);
            assert!(
                matches!(admitted, Ok(AdmittedSend::Held(_))),
                "send {i} is held"
            );
            kept.push(admitted);
        }
        let metrics = gateway.metrics();
        let in_flight = metrics.limited_count("in_flight");
        let refused = gateway
            .admit_send(&sender(3), &cmd(3), false)
            .err()
            .expect("no room to hold a third");
        assert_eq!(refused.kind(), imdedup_domain::ErrorKind::Overloaded);
        assert!(refused.retry_after().is_some(), "with its appointment");
        assert_eq!(metrics.limited_count("held_bytes"), 1);
        assert_eq!(metrics.limited_count("in_flight"), in_flight);
        // A held send answered gives its bytes back.
        drop(kept.pop());
        let admitted = gateway.admit_send(&sender(4), &cmd(4), false);
        assert!(matches!(admitted, Ok(AdmittedSend::Held(_))), "room again");
    }

    /// A send of ana's held for `wait`, its reply going to the receiver.
    fn held_send(
        gateway: &Arc<Gateway>,
        id: &[u8],
        wait: Duration,
    ) -> (Reply, mpsc::Receiver<Message>, SendCmd, Held) {
        let (out, replies) = mpsc::channel(4);
        let reply = Reply {
            gateway: Arc::clone(gateway),
            out,
            encoding: Encoding::Json,
            read_at: Instant::now(),
        };
        let cmd = SendCmd {
            id: id.to_vec(),
            id_b64: false,
            conversation: "dm:ana:bo".to_owned(),
            body: "hello".to_owned(),
            queue: true,
        };
        let held = Held {
            ticket: gateway.admission.hold("ana", id, wait),
            wait,
            promoted: false,
            leader: None,
            _budget: Arc::clone(&gateway.held_bytes)
                .try_acquire_many_owned(1)
                .expect("budget"),
        };
        (reply, replies, cmd, held)
    }

    /// The task that serves `held` for ana, on a connection that stays
    /// open.
    fn serve_held_send(
        reply: Reply,
        cmd: SendCmd,
        held: Held,
        turn: Turn,
        promote: Arc<Notify>,
    ) -> impl Future<Output = ()> {
        let sender = Sender::parse("ana").expect("a sender");
        serve_held(
            reply,
            sender,
            cmd,
            held,
            turn,
            CancellationToken::new(),
            promote,
        )
    }

    /// While the backlog drains, a held send moved ahead of it asks for a
    /// place only once the send before it in its conversation is
    /// answered: sooner, it would hold a place while it waits for that
    /// send, and sends waiting so, once they hold every place, leave none
    /// for the sends they wait for.
    #[tokio::test]
    async fn a_promoted_held_send_takes_a_place_only_after_the_send_before_it() {
        let gateway = gateway(crate::limits::Limits {
            max_sends_in_flight: 1,
            ..crate::limits::Limits::default()
        });
        let taken = gateway.admission.admit("x", b"0").expect("the place");
        let (reply, mut replies, cmd, held) = held_send(&gateway, b"m-2", Duration::from_secs(30));
        let mut order = SendOrder::default();
        let before = order.next(&cmd.conversation);
        let turn = order.next(&cmd.conversation);
        let promote = Arc::new(Notify::new());
        tokio::spawn(serve_held_send(
            reply,
            cmd,
            held,
            turn,
            Arc::clone(&promote),
        ));
        tokio::time::sleep(Duration::from_millis(20)).await;
        promote.notify_waiters();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            gateway.admission.in_flight(),
            1,
            "no place while the send before it is not answered"
        );
        drop(before);
        // Ahead of the backlog now: answered (the backends here are never
        // reached) long before its appointment.
        let answered = tokio::time::timeout(Duration::from_secs(10), replies.recv()).await;
        assert!(matches!(answered, Ok(Some(_))), "answered within 10 s");
        drop(taken);
    }

    /// In a surge the gateway holds tens of thousands of sends, each a
    /// task, and a held send's memory is what a surge grows by: its task
    /// must not carry the gRPC send's state while it waits.
    #[tokio::test]
    async fn a_held_send_waits_in_a_small_task() {
        let gateway = gateway(crate::limits::Limits::default());
        let (reply, _replies, cmd, held) = held_send(&gateway, b"m-1", Duration::from_secs(1));
        let turn = SendOrder::default().next(&cmd.conversation);
        let waiting = serve_held_send(reply, cmd, held, turn, Arc::default());
        // With the send's state inline the task was 2,560 bytes in a
        // release build (2,824 in a debug one); now 632.
        let size = std::mem::size_of_val(&waiting);
        assert!(size <= 1024, "a held send's task is {size} bytes");
    }

    /// The process's resident memory, in bytes.
    fn resident_bytes() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
        let pages: usize = statm
            .split_whitespace()
            .nth(1)
            .and_then(|field| field.parse().ok())
            .expect("resident pages");
        pages * 4096
    }

    /// The budget for held sends is memory: what the gateway keeps for a
    /// held send (its task, channels, queue and map entries) is within
    /// what the budget charges it. Charged its content and 256 bytes, as
    /// until 2026-12-05, a budget let a gateway keep several times the
    /// memory it was set to.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_held_send_keeps_no_more_memory_than_the_budget_charges_it() {
        const SENDS: usize = 100_000;
        let gateway = gateway(crate::limits::Limits {
            max_sends_in_flight: 1,
            user_sends_per_second: std::num::NonZeroU32::new(1_000_000).expect("non-zero"),
            user_send_burst: std::num::NonZeroU32::new(1_000_000).expect("non-zero"),
            ..crate::limits::Limits::default()
        });
        let _taken = gateway.admission.admit("x", b"0").expect("the one place");
        let (out, _replies) = mpsc::channel(4);
        let closing = CancellationToken::new();
        let mut order = SendOrder::default();
        let mut held = HeldSends::default();
        let cmd = |i: usize| SendCmd {
            id: format!("{i:08}-0000-4000-8000-000000000000").into_bytes(),
            id_b64: false,
            conversation: format!("dm:u{}:u{}x", i / 100, i % 7),
            body: "the usual length of a short chat message".to_owned(),
            queue: true,
        };
        let charged = crate::held_bytes(&cmd(0)) as usize;
        let before = resident_bytes();
        for i in 0..SENDS {
            let cmd = cmd(i);
            let sender = Sender::parse(format!("u{}", i / 100)).expect("a sender");
            let Ok(AdmittedSend::Held(hold)) = gateway.admit_send(&sender, &cmd, false) else {
                panic!("send {i} is held");
            };
            let turn = order.next(&cmd.conversation);
            let promote = held.hold(&cmd.conversation);
            let reply = Reply {
                gateway: Arc::clone(&gateway),
                out: out.clone(),
                encoding: Encoding::Json,
                read_at: Instant::now(),
            };
            tokio::spawn(serve_held(
                reply,
                sender,
                cmd,
                hold,
                turn,
                closing.clone(),
                promote,
            ));
        }
        // Every task polled once, waiting for its place.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let kept = resident_bytes().saturating_sub(before) / SENDS;
        assert!(
            kept <= charged,
            "a held send keeps {kept} bytes; the budget charges {charged}"
        );
    }

    #[test]
    fn prune_runs_again_only_after_the_map_doubles() {
        let mut map: HashMap<String, bool> = HashMap::new();
        let mut prune_at = 0;
        let mut sweeps = 0;
        for i in 0..10_000 {
            prune(&mut map, &mut prune_at, |_, _| {
                sweeps += 1;
                true
            });
            map.insert(i.to_string(), true);
        }
        // Everything kept: sweeps at 64, 128, 256, ... entries, each over
        // the whole map, sum under twice the final size.
        assert!(
            sweeps < 2 * 10_000,
            "{sweeps} entries visited for 10,000 inserts"
        );
    }

    #[test]
    fn a_failed_pull_is_unavailable_with_a_wait_and_tells_no_internals() {
        let cases = [
            Error::unavailable("cql history: connection refused by 10.1.2.3:9042"),
            Error::new(
                ErrorKind::MaybeStored,
                "cql history commit: keyspace f1 does not exist",
            ),
            Error::new(ErrorKind::DeadlineExceeded, "storage:7300 slow"),
            Error::internal("sqlite: /data/messages.db is locked"),
            Error::overloaded("storage busy", Duration::from_millis(300)),
        ];
        for error in cases {
            let kind = error.kind();
            let hint = error.retry_after();
            let phone = pull_failed(error);
            assert_eq!(phone.kind(), ErrorKind::Unavailable, "{kind:?}");
            assert!(phone.retryable());
            assert_eq!(
                phone.retry_after(),
                Some(hint.unwrap_or(UNAVAILABLE_RETRY_AFTER)),
                "{kind:?}: the backend's hint, else a second"
            );
            assert!(phone.message().contains("pull again"));
            for internal in ["10.1.2.3", "cql", "/data", "storage", "sqlite", "same id"] {
                assert!(!phone.message().contains(internal), "{internal}");
            }
        }
    }

    #[test]
    fn a_backend_refusal_is_not_final_and_tells_no_internals() {
        let refused = for_phone(Error::invalid(
            "body is 20000 bytes, more than the limit of 16384 (ingest 10.1.2.3:7200)",
        ));
        assert_eq!(refused.kind(), ErrorKind::Unavailable);
        assert!(refused.retryable());
        let cases = [
            Error::unavailable("cql insert: connection refused by 10.1.2.3:9042"),
            Error::new(
                ErrorKind::MaybeStored,
                "cql history write: /var/lib/scylla timeout",
            ),
            Error::new(ErrorKind::DeadlineExceeded, "ingest-0.ingest:7200 slow"),
            Error::internal("sqlite: /data/messages.db is locked"),
            Error::new(ErrorKind::Overloaded, "queue of ingest-1 full"),
        ];
        for error in cases {
            let kind = error.kind();
            let phone = for_phone(error);
            assert_eq!(phone.kind(), kind, "the kind is kept");
            assert_eq!(
                phone.retry_after().is_some(),
                matches!(kind, ErrorKind::Overloaded | ErrorKind::Unavailable),
                "{kind:?}: busy and unavailable answers say when to come back"
            );
            for internal in ["10.1.2.3", "cql", "/var", "/data", "ingest-", "sqlite"] {
                assert!(
                    !phone.message().contains(internal),
                    "{internal} leaked: {}",
                    phone.message()
                );
            }
            assert!(phone.message().contains("same id"), "{}", phone.message());
        }
        let receipt = imdedup_domain::model::Receipt {
            server_id: 7,
            seq: 3,
        };
        let hinted = for_phone(Error::overloaded("db limit", Duration::from_millis(70)));
        assert_eq!(
            hinted.retry_after(),
            Some(Duration::from_millis(70)),
            "the backend's hint is kept"
        );
        let reused = for_phone(Error::id_reused(receipt));
        assert_eq!(
            reused.original(),
            Some(receipt),
            "id_reused keeps its answer"
        );
    }
}
