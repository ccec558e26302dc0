//! The gateway: phones connect over WebSocket with a signed token; each send
//! goes to the ingest shard that owns its conversation, and the ACK (or a
//! clear error) comes back on the same connection.

pub mod authz;
pub mod connection;
pub mod frames;
pub mod shards;

use std::{collections::HashMap, sync::Arc, time::Duration};

use axum::{
    Json, Router,
    extract::{Query, State, WebSocketUpgrade},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
    serve::ListenerExt,
};
use imdedup_core::{
    Error,
    clock::SharedClock,
    metrics::GatewayMetrics,
    model::{HistoryQuery, StoredMessage},
    remote_store::RemoteStore,
    routing::ShardMap,
    store::MessageStore,
    tls::InternalTls,
    token::TokenVerifier,
};
use tokio::{net::TcpListener, sync::Semaphore};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

pub use shards::Shards;

/// Largest WebSocket frame accepted. Bodies have their own, smaller limit,
/// answered with an error frame; a frame above this closes the connection.
pub const MAX_FRAME_BYTES: usize = 256 * 1024;

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
    /// Who may send to and read each conversation.
    pub authz: authz::Authorizer,
    /// Deadline of one send through ingest and storage.
    pub send_timeout: Duration,
    pub max_body_bytes: usize,
    pub max_connections: usize,
    pub max_in_flight_per_connection: usize,
    pub clock: SharedClock,
}

/// Shared state of a gateway.
pub struct Gateway {
    pub config: GatewayConfig,
    pub shards: Shards,
    storage: RemoteStore,
    connections: Arc<Semaphore>,
    metrics: GatewayMetrics,
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

/// The HTTP routes: `/v1/ws` (the phone protocol), `/healthz`, `/readyz`.
fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/ws", get(upgrade))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .with_state(state)
}

async fn ready(State(state): State<AppState>) -> Response {
    if state.shutdown.is_cancelled() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response()
    } else {
        "ready".into_response()
    }
}

fn refuse(status: StatusCode, error: Error) -> Response {
    let body = serde_json::json!({
        "type": "error",
        "code": error.kind().as_str(),
        "retryable": error.retryable(),
        "message": error.message(),
    });
    (status, Json(body)).into_response()
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
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
    ws: WebSocketUpgrade,
) -> Response {
    let gateway = &state.gateway;
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
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            Error::new(imdedup_core::ErrorKind::Overloaded, "too many connections"),
        );
    };
    let session = connection::Session {
        sender: verified.sender,
        expires_at_unix: verified.expires_at_unix,
    };
    let gateway = Arc::clone(gateway);
    let tracker = state.tracker.clone();
    let shutdown = state.shutdown.clone();
    ws.max_message_size(MAX_FRAME_BYTES)
        .max_frame_size(MAX_FRAME_BYTES)
        .on_upgrade(move |socket| {
            tracker.track_future(async move {
                connection::run(socket, gateway, session, shutdown).await;
                drop(slot);
            })
        })
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
    let app = router(AppState {
        gateway,
        tracker: tracker.clone(),
        shutdown: shutdown.clone(),
    });
    // ACKs are small and latency-bound: never hold them for Nagle.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await?;
    tracker.close();
    tracker.wait().await;
    Ok(())
}
