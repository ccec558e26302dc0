//! The admin HTTP port every service serves beside its main one:
//! `GET /metrics` (OpenMetrics text), `/healthz` (liveness) and `/readyz`
//! (readiness: 503 while starting or draining).

use std::sync::{
    Arc,
    atomic::{AtomicU8, Ordering},
};

use axum::{
    Router,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::render;

/// The content type of the OpenMetrics text exposition.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

const STARTING: u8 = 0;
const READY: u8 = 1;
const DRAINING: u8 = 2;

/// Whether a service takes work, as `/readyz` reports it: not ready until
/// [`Readiness::set_ready`], and never again after [`Readiness::set_draining`].
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicU8>);

impl Readiness {
    pub fn new() -> Self {
        Self::default()
    }

    /// Ready, unless already draining.
    pub fn set_ready(&self) {
        let _ = self
            .0
            .compare_exchange(STARTING, READY, Ordering::AcqRel, Ordering::Acquire);
    }

    pub fn set_draining(&self) {
        self.0.store(DRAINING, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Acquire) == READY
    }

    /// Turn to draining when `token` is cancelled (the service's shutdown).
    pub fn drain_on(&self, token: CancellationToken) {
        let readiness = self.clone();
        tokio::spawn(async move {
            token.cancelled().await;
            readiness.set_draining();
        });
    }
}

#[derive(Clone)]
struct AdminState {
    registry: Arc<Registry>,
    readiness: Readiness,
}

/// The admin routes, for tests and for serving on a listener of your own.
pub fn router(registry: Arc<Registry>, readiness: Readiness) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .with_state(AdminState {
            registry,
            readiness,
        })
}

async fn metrics(State(state): State<AdminState>) -> Response {
    (
        [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)],
        render(&state.registry),
    )
        .into_response()
}

async fn ready(State(state): State<AdminState>) -> Response {
    if state.readiness.is_ready() {
        "ready".into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response()
    }
}

/// Serve the admin routes on `listener` until `shutdown` is cancelled.
/// Cancelling it also turns `/readyz` to 503 for requests still answered.
pub async fn serve_admin(
    listener: TcpListener,
    registry: Arc<Registry>,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = router(registry, readiness.clone());
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.cancelled().await;
            readiness.set_draining();
        })
        .await
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use prometheus_client::metrics::counter::Counter;

    use super::*;

    /// A plain HTTP/1.1 GET; returns the status code and the body.
    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .unwrap();
        let mut raw = String::new();
        stream.read_to_string(&mut raw).await.unwrap();
        let status = raw[9..12].parse().unwrap();
        let body = raw.split_once("\r\n\r\n").unwrap().1.to_owned();
        (status, body)
    }

    #[tokio::test]
    async fn serves_metrics_health_and_readiness_until_shutdown() {
        let mut registry = Registry::default();
        let sends = Counter::<u64>::default();
        registry.register("imdedup_test_sends", "Sends", sends.clone());
        sends.inc();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let readiness = Readiness::new();
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve_admin(
            listener,
            Arc::new(registry),
            readiness.clone(),
            shutdown.clone(),
        ));

        assert_eq!(get(addr, "/healthz").await, (200, "ok".to_owned()));
        assert_eq!(
            get(addr, "/readyz").await.0,
            503,
            "not ready while starting"
        );
        readiness.set_ready();
        assert_eq!(get(addr, "/readyz").await, (200, "ready".to_owned()));
        let (status, body) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        assert!(body.contains("imdedup_test_sends_total 1\n"), "{body}");

        // Draining (the service's shutdown began): not ready, still alive.
        readiness.set_draining();
        assert_eq!(get(addr, "/readyz").await.0, 503);
        assert_eq!(get(addr, "/healthz").await.0, 200);
        readiness.set_ready();
        assert_eq!(get(addr, "/readyz").await.0, 503, "draining is final");

        shutdown.cancel();
        server.await.unwrap().unwrap();
        assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    }
}
