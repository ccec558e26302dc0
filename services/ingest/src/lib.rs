//! The ingest service: validates a send, checks the recent-ID window, asks
//! storage to insert a new ID once, and answers every repeat with the
//! original ACK.

pub mod breaker;
pub mod connecting_window;
pub mod db_limit;
pub mod dedup;
pub mod grpc;
pub mod in_flight;
pub mod metrics;
pub mod redis_window;
pub mod window;

use std::sync::Arc;

use imdedup_proto::v1::ingest_service_server::SERVICE_NAME;
use imdedup_runtime::server::{ServeOptions, serve_grpc};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;

pub use connecting_window::ConnectingWindow;
pub use dedup::{Dedup, DedupCounts};
pub use grpc::IngestGrpc;
pub use redis_window::{RedisWindow, RedisWindowOptions};
pub use window::{MemoryWindow, MemoryWindowOptions};

/// Serve `dedup` as `imdedup.v1.IngestService` (plus health, and
/// reflection if `options` say so) on `listener` until `shutdown` is
/// cancelled.
pub async fn serve(
    listener: TcpListener,
    dedup: Arc<Dedup>,
    max_body_bytes: usize,
    options: ServeOptions,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let routes =
        Routes::new(IngestGrpc::new(dedup, max_body_bytes, shutdown.clone()).into_server());
    serve_grpc(listener, &[SERVICE_NAME], routes, 4096, options, shutdown).await
}
