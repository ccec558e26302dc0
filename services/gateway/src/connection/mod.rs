//! One phone connection: frames in, ACKs and pages out, several sends in
//! flight at once.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use axum::extract::ws::{CloseFrame, Message, WebSocket, close_code};
use futures_util::{SinkExt, StreamExt};
use imdedup_domain::{
    Error,
    model::{Ack, Sender},
};
use imdedup_runtime::metrics::GaugeGuard;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

mod held;
mod history;
mod order;
mod send;

pub(crate) use send::for_phone;

use self::{
    held::{HeldSends, serve_held},
    history::history,
    order::{SendOrder, Turn},
    send::send,
};
use crate::{
    AdmittedSend, Gateway, Held,
    admission::{self, Completion},
    frames::{self, Encoded, Encoding, HistoryCmd, Inbound, Outbound, ReplyTo, SendCmd},
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
                if cmd.queue && admission::fresh(cmd.age) {
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

#[cfg(test)]
mod tests {
    use tokio::sync::Notify;

    use super::*;
    use crate::Pass;

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

    /// A gateway with one place for a send in flight, taken (kept while
    /// the returned place lives): every send admitted next is held or
    /// refused.
    fn full_gateway(limits: crate::limits::Limits) -> (Arc<Gateway>, Pass) {
        let gateway = gateway(crate::limits::Limits {
            max_sends_in_flight: 1,
            ..limits
        });
        let taken = gateway
            .admission
            .admit("x", b"0", Duration::ZERO)
            .expect("the one place");
        (gateway, taken)
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
            age: Duration::ZERO,
        };
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

    /// Send `i` of user `i`, asking to be queued; every one the same size.
    fn cmd(i: usize) -> SendCmd {
        SendCmd {
            id: format!("m-{i:02}").into_bytes(),
            id_b64: false,
            conversation: format!("dm:u{i:02}:bo"),
            body: "hello".to_owned(),
            queue: true,
            age: Duration::ZERO,
        }
    }

    fn sender(i: usize) -> Sender {
        Sender::parse(format!("u{i:02}")).expect("a sender")
    }

    /// Past the budget for held sends, a phone that asked to be queued is
    /// refused with its appointment, and the refusal is counted under its
    /// own reason: the budget is memory, and an operator must see it bind.
    #[tokio::test]
    async fn past_the_budget_for_held_sends_a_queued_send_is_refused_and_counted_apart() {
        let (gateway, _taken) = full_gateway(crate::limits::Limits {
            // Room for two held sends, not three.
            max_held_bytes: 2 * crate::held_bytes(&cmd(1)) as usize + 100,
            ..crate::limits::Limits::default()
        });
        let sender = |i: usize| Sender::parse(format!("u{i}")).expect("a sender");
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

    /// The gauges follow a surge in which every send is held (none
    /// admitted, none refused): sampled every 256th send held too.
    #[tokio::test]
    async fn the_held_sends_gauge_moves_while_every_send_is_held() {
        let (gateway, _taken) = full_gateway(crate::limits::Limits::default());
        let kept: Vec<_> = (1..=257)
            .map(|i| {
                let admitted = gateway.admit_send(&sender(i), &cmd(i), false);
                assert!(
                    matches!(admitted, Ok(AdmittedSend::Held(_))),
                    "send {i} is held"
                );
                admitted
            })
            .collect();
        assert_eq!(
            gateway.metrics().held_bytes_shown(),
            (1..=257)
                .map(|i| i64::from(crate::held_bytes(&cmd(i))))
                .sum::<i64>()
        );
        drop(kept);
    }

    /// Once sends stop, the gauges fall to what is held within a second:
    /// they do not keep a surge's last values while the gateway idles.
    #[tokio::test]
    async fn the_held_gauges_fall_when_the_sends_stop() {
        let (gateway, _taken) = full_gateway(crate::limits::Limits::default());
        let kept: Vec<_> = (1..=3)
            .map(|i| gateway.admit_send(&sender(i), &cmd(i), false))
            .collect();
        assert!(
            kept.iter()
                .all(|held| matches!(held, Ok(AdmittedSend::Held(_))))
        );
        gateway.sample_admission();
        assert!(gateway.metrics().held_bytes_shown() > 0);
        drop(kept);
        let stop = tokio_util::sync::CancellationToken::new();
        let sampling = tokio::spawn(crate::sample_every(
            Duration::from_millis(10),
            Arc::clone(&gateway),
            stop.clone(),
        ));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(gateway.metrics().held_bytes_shown(), 0);
        assert_eq!(gateway.metrics().held_sends_shown(), 0);
        stop.cancel();
        sampling.await.expect("the sampling stops");
    }

    /// The budget's last sixty-fourth is for sends going ahead of the
    /// backlog (new sends while it drains): a backlog that fills the rest
    /// does not make them wait behind it. Refused for the budget, a send
    /// of the backlog keeps its appointment; one going ahead is asked back
    /// soon (such sends spread), not at the end of the appointments. The
    /// last half of that part is kept for messages arriving now: a send
    /// ahead with an older message (the surge's last, let go by its phone)
    /// waits behind them, held for seconds, and must not fill all of it.
    #[tokio::test]
    async fn a_send_going_ahead_of_the_backlog_may_take_the_budgets_reserve() {
        // Every send the same size: ids of three digits.
        let one = crate::held_bytes(&cmd(101)) as usize;
        let (gateway, _taken) = full_gateway(crate::limits::Limits {
            // The reserve is two sends.
            max_held_bytes: 128 * one,
            ..crate::limits::Limits::default()
        });
        let hold = |i: usize, ahead: bool, age: Duration| {
            let cmd = SendCmd { age, ..cmd(i) };
            let key = gateway
                .resends
                .key(sender(i).as_str(), &cmd.id, &cmd.conversation, "hello");
            gateway.hold(&sender(i), &cmd, key, Duration::from_secs(1), ahead, ahead)
        };
        let (now, recent) = (Duration::ZERO, crate::admission::ARRIVING_FOR);
        let backlog: Vec<_> = (101..=226).map(|i| hold(i, false, now)).collect();
        assert!(
            backlog
                .iter()
                .all(|held| matches!(held, Ok(AdmittedSend::Held(_))))
        );
        let refused = hold(227, false, now)
            .err()
            .expect("the rest is the reserve");
        assert_eq!(refused.kind(), imdedup_domain::ErrorKind::Overloaded);
        assert_eq!(
            refused.retry_after(),
            Some(Duration::from_secs(1)),
            "its appointment"
        );
        let older = hold(228, true, recent);
        assert!(
            matches!(older, Ok(AdmittedSend::Held(_))),
            "an older message ahead of the backlog: held in the first half"
        );
        let kept = hold(229, true, recent)
            .err()
            .expect("the last half is kept for messages arriving now");
        let ahead = hold(230, true, now);
        assert!(
            matches!(ahead, Ok(AdmittedSend::Held(_))),
            "a message arriving now: held in the last half"
        );
        let spent = hold(231, true, now).err().expect("the budget is spent");
        let (kept, spent) = (
            kept.retry_after().expect("asked back"),
            spent.retry_after().expect("asked back"),
        );
        assert!(
            (Duration::from_millis(100)..Duration::from_secs(1)).contains(&kept),
            "asked back soon, not at the end: {kept:?}"
        );
        assert!(
            spent > kept && spent < Duration::from_secs(1),
            "the next one a little later: {spent:?} after {kept:?}"
        );
        assert_eq!(gateway.metrics().limited_count("held_bytes"), 3);
    }

    /// A send of ana's held for `wait`, its reply going to the receiver.
    fn held_send(
        gateway: &Arc<Gateway>,
        id: &[u8],
        wait: Duration,
    ) -> (Reply, mpsc::Receiver<Message>, SendCmd, Held) {
        held_message(gateway, id, wait, Duration::ZERO)
    }

    /// The same, of a message its phone has had for `age`.
    fn held_message(
        gateway: &Arc<Gateway>,
        id: &[u8],
        wait: Duration,
        age: Duration,
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
            age,
        };
        let held = Held {
            ticket: gateway.admission.hold("ana", id, wait, age),
            wait,
            promoted: false,
            new: false,
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
        let (gateway, taken) = full_gateway(crate::limits::Limits::default());
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

    /// A new message held behind the backlog just before the gateway saw
    /// the surge end goes ahead of it once it does, and takes its
    /// conversation's held sends with it, in their order: both are
    /// answered long before their appointments, the earlier first.
    #[tokio::test]
    async fn a_new_message_held_before_the_drain_was_seen_goes_ahead_with_its_conversation() {
        let (gateway, taken) = full_gateway(crate::limits::Limits::default());
        let wait = Duration::from_secs(30);
        let (reply, mut first_replies, first, first_held) =
            held_message(&gateway, b"m-1", wait, Duration::from_secs(10));
        let surge_seen = std::time::Instant::now();
        let (reply2, mut second_replies, second, second_held) =
            held_message(&gateway, b"m-2", wait, Duration::ZERO);
        let mut order = SendOrder::default();
        let first_turn = order.next(&first.conversation);
        let second_turn = order.next(&second.conversation);
        let promote = Arc::new(Notify::new());
        for (reply, cmd, held, turn) in [
            (reply, first, first_held, first_turn),
            (reply2, second, second_held, second_turn),
        ] {
            tokio::spawn(serve_held_send(
                reply,
                cmd,
                held,
                turn,
                Arc::clone(&promote),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        gateway.admission.drain_began(surge_seen);
        // Answered (the backends here are never reached) long before the
        // appointments, the earlier send first.
        let first = tokio::time::timeout(Duration::from_secs(10), first_replies.recv()).await;
        assert!(matches!(first, Ok(Some(_))), "the old message, ahead");
        assert!(
            second_replies.try_recv().is_err(),
            "not answered before the send before it"
        );
        let second = tokio::time::timeout(Duration::from_secs(10), second_replies.recv()).await;
        assert!(matches!(second, Ok(Some(_))), "the new message, ahead");
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
        let (gateway, _taken) = full_gateway(crate::limits::Limits {
            user_sends_per_second: std::num::NonZeroU32::new(1_000_000).expect("non-zero"),
            user_send_burst: std::num::NonZeroU32::new(1_000_000).expect("non-zero"),
            ..crate::limits::Limits::default()
        });
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
            age: Duration::ZERO,
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
}
