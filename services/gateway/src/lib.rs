//! The gateway: phones connect over WebSocket with a signed token; each send
//! goes to the ingest shard that owns its conversation, and the ACK (or a
//! clear error) comes back on the same connection.

pub mod admission;
pub mod authz;
pub mod business;
pub mod connection;
pub mod frames;
pub mod limits;
pub mod listener;
pub mod metrics;
pub mod resends;
pub mod shards;

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use admission::{Admission, AdmissionOptions, Pass, Refusal, Ticket};
use axum::{
    Json, Router,
    extract::{
        ConnectInfo, Query, State, WebSocketUpgrade, rejection::QueryRejection,
        ws::rejection::WebSocketUpgradeRejection,
    },
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use frames::SendCmd;
use imdedup_domain::{
    Error,
    clock::SharedClock,
    model::Sender,
    model::{HistoryQuery, StoredMessage},
    routing::ShardMap,
    store::MessageStore,
};
use imdedup_hops::storage::RemoteStore;
use imdedup_runtime::{tls::InternalTls, token::TokenVerifier};
use limits::{Limits, SendRate, UserConnections};
use listener::{Admission as ConnectionAdmission, GuardedListener};
use metrics::GatewayMetrics;
use resends::{Follower, InFlightSends, Leader};
use tokio::{
    net::TcpListener,
    sync::{OwnedSemaphorePermit, Semaphore},
};

/// How long a phone is asked to wait when the gateway as a whole is busy.
pub(crate) const BUSY_RETRY_AFTER: Duration = Duration::from_millis(500);
use tokio_util::{sync::CancellationToken, task::TaskTracker};

pub use shards::Shards;

/// Largest WebSocket frame accepted. Bodies have their own, smaller limit,
/// answered with an error frame; a frame above this closes the connection.
pub const MAX_FRAME_BYTES: usize = 256 * 1024;

/// What one read from a phone's socket asks for. tungstenite zero-fills this
/// much of its buffer before every read, and keeps it per connection: its
/// default of 128 KiB cost 8% of the gateway's CPU at 10,000 msgs/s in
/// memset alone, and 128 KiB of memory per phone. Frames are a few hundred
/// bytes; a larger one still arrives whole, in more reads. With 8 KiB a
/// connection cost ~19 KB of resident memory (8,000 phones of `imdedup-load
/// steady --users 8000` on `imdedup dev`), ~16 KB with 4 KiB, at the same
/// CPU per message in two alternating pairs of the overload scenario.
pub const READ_BUFFER_BYTES: usize = 4 * 1024;

/// Most phone connections a gateway holds at once, unless configured.
pub const DEFAULT_MAX_CONNECTIONS: usize = 50_000;

/// Most sends and pulls in flight on one connection, unless configured; the
/// gateway stops reading a connection at this many.
pub const DEFAULT_MAX_IN_FLIGHT_PER_CONNECTION: usize = 256;

#[derive(Clone)]
pub struct GatewayConfig {
    /// The ingest shards; every gateway and ingest must have the same set of
    /// names so they agree on owners.
    pub shards: ShardMap,
    /// Storage service URL, for history pulls.
    pub storage: String,
    /// How the gateway reaches ingest and storage.
    pub internal_tls: InternalTls,
    /// Verifies the tokens phones connect with.
    pub tokens: TokenVerifier,
    /// Verifies the service tokens of the business API
    /// ([`TokenVerifier::for_services`]); `None` turns the API off.
    pub service_tokens: Option<TokenVerifier>,
    /// Who may send to and read each conversation.
    pub authz: authz::Authorizer,
    /// Deadline of one send through ingest and storage.
    pub send_timeout: Duration,
    pub max_body_bytes: usize,
    /// Phones beyond this many connections are refused with HTTP 503.
    pub max_connections: usize,
    pub max_in_flight_per_connection: usize,
    /// What one client, or all of them, may cost.
    pub limits: Limits,
    pub clock: SharedClock,
}

/// Shared state of a gateway.
pub struct Gateway {
    pub config: GatewayConfig,
    pub shards: Shards,
    storage: RemoteStore,
    connections: Arc<Semaphore>,
    user_connections: UserConnections,
    send_rate: SendRate,
    /// Which sends go in now, and when the others come back.
    admission: Arc<Admission>,
    /// Sends in flight that a resend can join.
    resends: Arc<InFlightSends>,
    /// Sends admitted or held, to sample the admission gauges now and then.
    sampled: AtomicU64,
    /// Sends refused by the admission, to sample the shards' windows now
    /// and then while nothing is admitted.
    refusals: AtomicU64,
    /// Bytes of held sends the gateway may keep (permits are bytes).
    held_bytes: Arc<Semaphore>,
    metrics: GatewayMetrics,
}

/// How a send was taken in.
pub(crate) enum AdmittedSend {
    /// A copy of a send in flight: it gets that send's answer.
    Join(Follower),
    /// A send of its own, holding a place of the admission limit; its
    /// answer goes to the copies that join it (none if another send with
    /// the same ID but other content is in flight).
    Lead { pass: Pass, leader: Option<Leader> },
    /// Held until its appointment (see [`Gateway::admit_send`]).
    Held(Held),
}

/// A send the gateway holds, without a place of the admission limit yet.
pub(crate) struct Held {
    /// Its place in the queue of held sends.
    pub ticket: Ticket,
    /// Until its appointment.
    pub wait: Duration,
    /// To go ahead of the backlog ([`Admission::hold_urgent`]) once the
    /// sends of its conversation before it are answered.
    pub promoted: bool,
    /// A new send that found every place taken while the backlog drains
    /// ([`Refusal::AheadOfBacklog`]): its place will be a new send's.
    pub new: bool,
    /// Its answer goes to the copies that join it.
    pub leader: Option<Leader>,
    _budget: OwnedSemaphorePermit,
}

/// What a held send keeps besides its content: its task, its channels, its
/// entries in the admission's queue and the map of sends in flight, and what
/// the allocator rounds them up to. Measured: 1,391 bytes of resident memory
/// per held send with 85 bytes of content (the test
/// `a_held_send_keeps_no_more_memory_than_the_budget_charges_it`), and
/// ~1,630 by a fit of the resident memory of `imdedup dev` against its held
/// sends in a 3x surge, which also counts the rest of the process growing
/// meanwhile (docs/overload.md). Until 2026-12-05 this was taken to be 256,
/// so the budget for held sends let a gateway keep four to five times the
/// memory it was set to.
const HELD_SEND_OVERHEAD: usize = 1_600;

/// The budget for held sends, in bytes (the permits of its semaphore).
fn held_budget(limits: &Limits) -> usize {
    limits.max_held_bytes.min(Semaphore::MAX_PERMITS)
}

/// The share of the budget for held sends that only sends going ahead of
/// the backlog may take (see [`Gateway::hold`]): after a surge new sends
/// arrive slower than the gateway answers and each is held for
/// milliseconds, so a small part holds all of them.
const AHEAD_RESERVE: usize = 64;

/// What holding `cmd` costs of the budget for held sends, in bytes of
/// memory.
fn held_bytes(cmd: &SendCmd) -> u32 {
    let bytes = cmd.id.len() + cmd.conversation.len() + cmd.body.len() + HELD_SEND_OVERHEAD;
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

impl Gateway {
    pub fn new(config: GatewayConfig) -> Result<Self, Error> {
        Ok(Self {
            shards: Shards::connect_lazy(
                config.shards.clone(),
                config.send_timeout,
                &config.internal_tls,
            )?,
            storage: RemoteStore::connect_lazy(
                &config.storage,
                config.send_timeout,
                &config.internal_tls,
            )?,
            connections: Arc::new(Semaphore::new(config.max_connections)),
            user_connections: UserConnections::new(config.limits.max_connections_per_user),
            send_rate: SendRate::new(
                config.limits.user_sends_per_second,
                config.limits.user_send_burst,
            ),
            admission: Admission::new(AdmissionOptions {
                target: config.limits.send_latency_target,
                ..AdmissionOptions::with_max(config.limits.max_sends_in_flight)
            }),
            resends: InFlightSends::new(),
            sampled: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            held_bytes: Arc::new(Semaphore::new(held_budget(&config.limits))),
            metrics: GatewayMetrics::default(),
            config,
        })
    }

    /// Record into `metrics` (by default they are counted but registered
    /// nowhere).
    pub fn with_metrics(mut self, metrics: GatewayMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    pub fn metrics(&self) -> &GatewayMetrics {
        &self.metrics
    }

    pub async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredMessage>, Error> {
        self.storage.history(query).await
    }

    /// Admit one send of `sender`: a copy of a send in flight joins it;
    /// any other goes in if the admission limit and the user's rate allow,
    /// or is refused with `overloaded` and when to try again (see
    /// [`admission`]). A send whose phone asked for `queue` is held until
    /// its appointment instead of being refused; so is one `behind_held`
    /// (an earlier send of its conversation on the connection is held), so
    /// that it does not overtake that one.
    pub(crate) fn admit_send(
        &self,
        sender: &Sender,
        cmd: &SendCmd,
        behind_held: bool,
    ) -> Result<AdmittedSend, Error> {
        let key = self
            .resends
            .key(sender.as_str(), &cmd.id, &cmd.conversation, &cmd.body);
        if let Some(follower) = self.resends.join(key) {
            self.metrics.resend_joined();
            return Ok(AdmittedSend::Join(follower));
        }
        let admitted = if cmd.queue && behind_held {
            Err(self.admission.appoint(sender.as_str(), &cmd.id, cmd.age))
        } else {
            self.admission.admit(sender.as_str(), &cmd.id, cmd.age)
        };
        let pass = match admitted {
            Ok(pass) => pass,
            // Past the horizon too: a held send is served as soon as a
            // place frees, so a phone that asked to be queued is held
            // rather than told to come back after the horizon, when the
            // backlog ahead of it may long be gone.
            Err(refusal) if cmd.queue => {
                // A new send while the backlog drains goes ahead of it; so
                // does one behind a held send of its conversation (the
                // connection promotes that conversation's held sends), and
                // this send with them; not an old message (it goes with
                // the backlog).
                let new = matches!(refusal, Refusal::AheadOfBacklog { .. });
                let promoted =
                    new || behind_held && admission::fresh(cmd.age) && self.admission.draining();
                let wait = refusal.retry_after();
                return self.hold(sender, cmd, key, wait, promoted, new);
            }
            Err(refusal) => return Err(self.refused(refusal)),
        };
        self.check_send_rate(sender)?;
        self.sample_now_and_then();
        match self.resends.lead(key) {
            Ok(leader) => Ok(AdmittedSend::Lead { pass, leader }),
            Err(follower) => {
                self.metrics.resend_joined();
                Ok(AdmittedSend::Join(follower))
            }
        }
    }

    /// Hold a send that has an appointment `wait` from now: it is charged
    /// to the user's rate now, and holds its bytes of the gateway's budget
    /// for held sends until it is answered.
    fn hold(
        &self,
        sender: &Sender,
        cmd: &SendCmd,
        key: resends::SendKey,
        wait: Duration,
        promoted: bool,
        new: bool,
    ) -> Result<AdmittedSend, Error> {
        self.check_send_rate(sender)?;
        let bytes = held_bytes(cmd);
        // The budget's last part is kept for sends going ahead of the
        // backlog: with a budget that binds (the chart's 64 MiB at 3x), the
        // backlog fills it, and a new send refused for it after the surge
        // was booked behind every phone with an appointment (new messages
        // waited 14-20 s while most were answered in 200 ms).
        // Of that part, the last half is kept for messages arriving now:
        // a send ahead of the backlog with an older message (one of the
        // surge's last seconds, let go by its phone's throttle once it
        // ended) goes after them (youngest first), so it is held for
        // seconds, and such sends filled the reserve while each new
        // message was asked back every quarter second for 2-6 s.
        let reserve = held_budget(&self.config.limits) / AHEAD_RESERVE;
        let reserve = if !promoted {
            reserve
        } else if admission::arriving(cmd.age) {
            0
        } else {
            reserve / 2
        };
        let room = self.held_bytes.available_permits() >= bytes as usize + reserve;
        let Some(budget) = room
            .then(|| {
                Arc::clone(&self.held_bytes)
                    .try_acquire_many_owned(bytes)
                    .ok()
            })
            .flatten()
        else {
            // No room to hold it: the phone keeps the appointment, or,
            // going ahead of the backlog, comes back soon (with such sends
            // spread), not at the end of the appointments, where it would
            // wait for the whole backlog it was to go ahead of. Counted
            // apart, so an operator sees the budget (memory) bind.
            let refusal = if promoted {
                self.admission
                    .no_room_ahead(sender.as_str(), &cmd.id, cmd.age)
            } else {
                Refusal::Appointment { retry_after: wait }
            };
            return Err(self.refused_for("held_bytes", refusal));
        };
        let leader = match self.resends.lead(key) {
            Ok(leader) => leader,
            Err(follower) => {
                self.metrics.resend_joined();
                return Ok(AdmittedSend::Join(follower));
            }
        };
        let mut ticket = self.admission.hold(sender.as_str(), &cmd.id, wait, cmd.age);
        self.sample_now_and_then();
        if let Some(pass) = ticket.ready() {
            // A place was free for it (the gateway is far from its limit):
            // no need to hold it.
            return Ok(AdmittedSend::Lead { pass, leader });
        }
        self.metrics.send_queued();
        Ok(AdmittedSend::Held(Held {
            ticket,
            wait,
            promoted,
            new,
            leader,
            _budget: budget,
        }))
    }

    /// Whether the backlog of held sends is draining (see [`admission`]).
    pub(crate) fn draining(&self) -> bool {
        self.admission.draining()
    }

    /// A held send's new place in the queue, at the front of the backlog.
    pub(crate) fn hold_ahead(&self, sender: &Sender, id: &[u8], age: Duration) -> Ticket {
        self.admission.hold_ahead(sender.as_str(), id, age)
    }

    /// A held send's new place in the queue, ahead of the backlog.
    pub(crate) fn hold_urgent(
        &self,
        sender: &Sender,
        id: &[u8],
        new: bool,
        age: Duration,
    ) -> Ticket {
        self.admission.hold_urgent(sender.as_str(), id, new, age)
    }

    /// The answer to a held send given up before a place came for it.
    pub(crate) fn held_too_long(&self) -> Error {
        self.refused(Refusal::Shed {
            retry_after: Duration::from_secs(1),
        })
    }

    /// A place of the admission limit for a send of `sender` with `id`,
    /// within the user's rate; or `overloaded` with when to try again.
    pub(crate) fn admit(&self, sender: &Sender, id: &[u8]) -> Result<Pass, Error> {
        let pass = self
            .admission
            .admit(sender.as_str(), id, Duration::ZERO)
            .map_err(|refusal| self.refused(refusal))?;
        self.check_send_rate(sender)?;
        Ok(pass)
    }

    /// The admission's gauges and the budget for held sends in use.
    /// Every 256th send admitted or held, the admission's gauges and the
    /// shards' windows. (Sampled only for sends admitted, the gauges stood
    /// still for seconds of a surge in which most sends were held.)
    fn sample_now_and_then(&self) {
        if self
            .sampled
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(256)
        {
            self.sample_admission();
            self.metrics.set_shard_windows(self.shards.windows());
        }
    }

    fn sample_admission(&self) {
        self.metrics.set_admission(self.admission.gauges());
        let budget = held_budget(&self.config.limits);
        self.metrics
            .set_held_bytes(budget.saturating_sub(self.held_bytes.available_permits()));
    }

    /// The answer to a send the admission refused, counted.
    fn refused(&self, refusal: Refusal) -> Error {
        self.refused_for("in_flight", refusal)
    }

    /// The answer to a send refused with an appointment, counted under
    /// `reason`.
    fn refused_for(&self, reason: &'static str, refusal: Refusal) -> Error {
        self.metrics.limited(reason);
        self.sample_admission();
        if self
            .refusals
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(256)
        {
            // Builds each shard's labels: not on every refusal.
            self.metrics.set_shard_windows(self.shards.windows());
        }
        Error::overloaded(
            "the gateway is busy; not stored: resend with the same id after retry_after_ms",
            refusal.retry_after(),
        )
    }

    fn check_send_rate(&self, sender: &Sender) -> Result<(), Error> {
        self.send_rate.check(sender).map_err(|wait| {
            self.metrics.limited("user_send_rate");
            Error::overloaded(
                "too many sends from this user; not stored: resend with the same id later",
                wait.max(Duration::from_millis(1)),
            )
        })
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.config.max_connections - self.connections.available_permits()
    }
}

#[derive(Clone)]
struct AppState {
    gateway: Arc<Gateway>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
}

/// The HTTP routes: `/v1/ws` (the phone protocol), `/v1/messages` (the
/// business API), `/healthz`, `/readyz`.
fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/ws", get(upgrade))
        .route("/v1/messages", post(business_message))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .fallback(|| async {
            json_error(
                StatusCode::NOT_FOUND,
                "not_found",
                false,
                "no such path: the gateway serves /v1/ws, /v1/messages, /healthz and /readyz",
            )
        })
        .method_not_allowed_fallback(|| async {
            json_error(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                false,
                "method not allowed: /v1/ws is GET (a WebSocket upgrade), /v1/messages is POST",
            )
        })
        .with_state(state)
}

/// An error answer of the HTTP layer: the JSON every error is answered in.
/// The codes besides the error kinds are the HTTP layer's own (no such
/// path, a method the path does not take), final.
fn json_error(status: StatusCode, code: &str, retryable: bool, message: &str) -> Response {
    let body = serde_json::json!({
        "type": "error",
        "code": code,
        "retryable": retryable,
        "message": message,
    });
    (status, Json(body)).into_response()
}

async fn ready(State(state): State<AppState>) -> Response {
    if state.shutdown.is_cancelled() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response()
    } else {
        "ready".into_response()
    }
}

fn refuse(status: StatusCode, error: Error) -> Response {
    json_error(
        status,
        error.kind().as_str(),
        error.retryable(),
        error.message(),
    )
}

async fn business_message(
    State(state): State<AppState>,
    ConnectInfo(admission): ConnectInfo<ConnectionAdmission>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    if state.shutdown.is_cancelled() {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            Error::unavailable("gateway is shutting down"),
        );
    }
    business::http::post(&state.gateway, headers, body, || admission.authenticated()).await
}

/// The token from `Authorization: Bearer …`, or else the `token` query
/// parameter (browsers cannot set headers on a WebSocket).
fn bearer_token<'a>(headers: &'a HeaderMap, query: &'a HashMap<String, String>) -> Option<&'a str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| query.get("token").map(String::as_str))
}

async fn upgrade(
    State(state): State<AppState>,
    ConnectInfo(admission): ConnectInfo<ConnectionAdmission>,
    headers: HeaderMap,
    query: Result<Query<HashMap<String, String>>, QueryRejection>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let gateway = &state.gateway;
    let (Ok(Query(query)), Ok(ws)) = (query, ws) else {
        return refuse(
            StatusCode::BAD_REQUEST,
            Error::invalid(
                "/v1/ws takes a WebSocket upgrade (GET with Connection: upgrade, Upgrade: websocket, \
                 Sec-WebSocket-Version: 13 and a Sec-WebSocket-Key), with ?token=<token> or \
                 Authorization: Bearer <token>",
            ),
        );
    };
    if state.shutdown.is_cancelled() {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            Error::unavailable("gateway is shutting down"),
        );
    }
    let Some(token) = bearer_token(&headers, &query) else {
        return refuse(
            StatusCode::UNAUTHORIZED,
            Error::unauthenticated(
                "no token: send Authorization: Bearer <token> or ?token=<token>",
            ),
        );
    };
    let verified = match gateway
        .config
        .tokens
        .verify(token, gateway.config.clock.unix_seconds())
    {
        Ok(verified) => verified,
        Err(e) => {
            // The reason, never the token (it may have come in the URL).
            tracing::debug!(reason = e.message(), "connection refused: bad token");
            return refuse(StatusCode::UNAUTHORIZED, e);
        }
    };
    let Ok(slot) = Arc::clone(&gateway.connections).try_acquire_owned() else {
        gateway.metrics.limited("connections");
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            Error::overloaded("too many connections", BUSY_RETRY_AFTER),
        );
    };
    let Some(user_slot) = gateway.user_connections.open(&verified.sender) else {
        gateway.metrics.limited("user_connections");
        return refuse(
            StatusCode::TOO_MANY_REQUESTS,
            Error::overloaded(
                format!(
                    "this user has {} connections open already; close one first",
                    gateway.config.limits.max_connections_per_user
                ),
                Duration::from_secs(5),
            ),
        );
    };
    admission.authenticated();
    let session = connection::Session {
        sender: verified.sender,
        expires_at_unix: verified.expires_at_unix,
    };
    let gateway = Arc::clone(gateway);
    let tracker = state.tracker.clone();
    let shutdown = state.shutdown.clone();
    ws.max_message_size(MAX_FRAME_BYTES)
        .max_frame_size(MAX_FRAME_BYTES)
        .read_buffer_size(READ_BUFFER_BYTES)
        .on_upgrade(move |socket| {
            tracker.track_future(async move {
                connection::run(socket, gateway, session, shutdown).await;
                drop((slot, user_slot));
            })
        })
}

/// How often the admission's gauges are sampled besides as sends come.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// The admission's gauges and the budget for held sends in use, `every`
/// so often until `shutdown`. Sends sample them as they come (every
/// 256th); when sends stop, the gauges kept the last values sampled, and
/// after a 3x surge on the pinned wiring showed ~113,000 held sends and
/// 197 MB of the budget in use for as long as the gateway stayed idle,
/// though every send had been answered.
async fn sample_every(every: Duration, gateway: Arc<Gateway>, shutdown: CancellationToken) {
    let mut each = tokio::time::interval(every);
    each.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = each.tick() => gateway.sample_admission(),
        }
    }
}

/// Serve phones on `listener` until `shutdown` is cancelled; then refuse new
/// connections, stop reading frames, and return once every send in flight
/// has been answered (the caller bounds this with its grace period).
pub async fn serve(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let tracker = TaskTracker::new();
    tracker.spawn(sample_every(
        SAMPLE_EVERY,
        Arc::clone(&gateway),
        shutdown.clone(),
    ));
    let limits = gateway.config.limits.clone();
    let metrics = gateway.metrics.clone();
    let app = router(AppState {
        gateway,
        tracker: tracker.clone(),
        shutdown: shutdown.clone(),
    });
    let listener = GuardedListener::new(
        listener,
        limits.max_unauthenticated,
        limits.upgrade_timeout,
        metrics,
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<ConnectionAdmission>(),
    )
    .with_graceful_shutdown(shutdown.cancelled_owned())
    .await?;
    tracker.close();
    tracker.wait().await;
    Ok(())
}
