//! The storage service: insert-once keyed on (sender, client message ID),
//! answering "stored" with the new row or "already stored" with the original
//! one, and the history of a conversation by seq.

pub mod grpc;
pub mod locks;
pub mod metrics;
pub mod scylla;
pub mod sqlite;

use std::sync::Arc;

use imdedup_runtime::server::{ServeOptions, serve_grpc};

use imdedup_domain::store::MessageStore;
use imdedup_proto::v1::storage_service_server::SERVICE_NAME;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;

pub use grpc::StorageGrpc;
pub use scylla::{ScyllaOptions, ScyllaStore};
pub use sqlite::{SqliteOptions, SqliteStore};

/// Serve `store` as `imdedup.v1.StorageService` (plus health, and
/// reflection if `options` say so) on `listener` until `shutdown` is
/// cancelled.
pub async fn serve(
    listener: TcpListener,
    store: Arc<dyn MessageStore>,
    options: ServeOptions,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let routes = Routes::new(StorageGrpc::new(store, shutdown.clone()).into_server());
    serve_grpc(listener, &[SERVICE_NAME], routes, 1024, options, shutdown).await
}
