//! Serving a gRPC service the way every imdedup server does: with the gRPC
//! health service next to it (and server reflection when asked for), over
//! mutual TLS unless plaintext is asked for (see [`crate::tls`]), a server
//! span per call (continuing the caller's trace, see [`crate::telemetry`]),
//! and a graceful stop.

use std::{sync::Arc, time::Duration};

use tokio::net::TcpListener;
use tokio_stream::{StreamExt, wrappers::TcpListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tonic_health::ServingStatus;

use crate::telemetry::GrpcServerTraceLayer;

/// How a gRPC server serves, besides what it serves.
#[derive(Clone, Debug, Default)]
pub struct ServeOptions {
    /// Answer gRPC server reflection (grpcurl without the protos). Off in
    /// production: it tells any caller the whole API.
    pub reflection: bool,
    /// Mutual TLS (see [`crate::tls::InternalTls::server`]); `None` serves
    /// plaintext.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

/// Serve `routes` on `listener` until `shutdown` is cancelled, then stop
/// taking new calls, report NOT_SERVING on the health service, and let calls
/// in flight finish (the caller bounds how long with its grace period).
///
/// `service_names` are the fully qualified names reported SERVING by the
/// health service (grpc.health.v1), besides the overall "" entry.
pub async fn serve_grpc(
    listener: TcpListener,
    service_names: &[&'static str],
    routes: Routes,
    max_concurrent_per_connection: usize,
    options: ServeOptions,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (health, health_service) = tonic_health::server::health_reporter();
    for name in service_names.iter().copied().chain([""]) {
        health
            .set_service_status(name, ServingStatus::Serving)
            .await;
    }
    // List only what this server serves, not every service in the protos.
    let reflection = || {
        service_names
            .iter()
            .copied()
            .chain([
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
            ])
            .fold(
                tonic_reflection::server::Builder::configure()
                    .register_encoded_file_descriptor_set(imdedup_proto::FILE_DESCRIPTOR_SET)
                    .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET),
                |builder, name| builder.with_service_name(name),
            )
    };
    let mut routes = routes.add_service(health_service);
    if options.reflection {
        let reflection_v1 = reflection()
            .build_v1()
            .expect("the embedded descriptor sets are valid");
        let reflection_v1alpha = reflection()
            .build_v1alpha()
            .expect("the embedded descriptor sets are valid");
        routes = routes
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha);
    }

    let names = service_names.to_vec();
    let stopping = shutdown.clone();
    let signal = async move {
        stopping.cancelled().await;
        for name in names.into_iter().chain([""]) {
            health
                .set_service_status(name, ServingStatus::NotServing)
                .await;
        }
    };
    let server = tonic::transport::Server::builder()
        .layer(GrpcServerTraceLayer)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .concurrency_limit_per_connection(max_concurrent_per_connection)
        .add_routes(routes);
    if let Some(tls) = options.tls {
        let incoming = crate::tls::incoming(listener, tls, shutdown);
        return server.serve_with_incoming_shutdown(incoming, signal).await;
    }
    // The builder's `tcp_nodelay` only reaches sockets it accepts itself;
    // these come from our listener, so set it here. Without it, small
    // answers wait for Nagle and the peer's delayed ACK (tens of ms).
    let incoming = TcpListenerStream::new(listener).map(|accepted| {
        accepted.inspect(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "cannot set TCP_NODELAY");
            }
        })
    });
    server.serve_with_incoming_shutdown(incoming, signal).await
}
