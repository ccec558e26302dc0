//! Every gRPC server answers health checks, so Kubernetes gRPC probes work,
//! and, when asked to, lists its services through reflection for grpcurl;
//! by default it tells a caller nothing about its API.

use std::sync::Arc;

use imdedup_cluster::{ClusterOptions, LocalCluster};
use imdedup_domain::clock::SystemClock;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};
use tonic_reflection::pb::v1::{
    ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
    server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
};

async fn channel(url: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(url.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap()
}

async fn reflection(
    url: &str,
) -> Result<tonic::Streaming<tonic_reflection::pb::v1::ServerReflectionResponse>, tonic::Status> {
    let mut client = ServerReflectionClient::new(channel(url).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    client
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .map(tonic::Response::into_inner)
}

async fn list_services(url: &str) -> Vec<String> {
    let mut replies = reflection(url).await.unwrap();
    let reply = replies.message().await.unwrap().unwrap();
    match reply.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("unexpected reflection reply {other:?}"),
    }
}

async fn health(url: &str, service: &str) -> ServingStatus {
    let mut client = HealthClient::new(channel(url).await);
    let reply = client
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    reply.status()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_expose_reflection_when_asked_and_health() {
    let dir = tempfile::tempdir().unwrap();
    let mut options = ClusterOptions::new(dir.path(), Arc::new(SystemClock));
    options.reflection = true;
    let cluster = LocalCluster::start(options).await.unwrap();

    let storage = list_services(&cluster.storage_url()).await;
    assert!(
        storage.contains(&"imdedup.v1.StorageService".to_owned()),
        "{storage:?}"
    );
    assert!(
        storage.contains(&"grpc.health.v1.Health".to_owned()),
        "{storage:?}"
    );
    assert_eq!(
        health(&cluster.storage_url(), "imdedup.v1.StorageService").await,
        ServingStatus::Serving
    );

    for url in cluster.ingest_urls() {
        let ingest = list_services(&url).await;
        assert!(
            ingest.contains(&"imdedup.v1.IngestService".to_owned()),
            "{ingest:?}"
        );
        assert_eq!(health(&url, "").await, ServingStatus::Serving);
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_is_off_unless_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::start(ClusterOptions::new(dir.path(), Arc::new(SystemClock)))
        .await
        .unwrap();
    for url in [cluster.storage_url()]
        .into_iter()
        .chain(cluster.ingest_urls())
    {
        let Err(refused) = reflection(&url).await else {
            panic!("{url}: reflection answered");
        };
        assert_eq!(refused.code(), tonic::Code::Unimplemented, "{url}");
        // Health still answers, for the probes.
        assert_eq!(health(&url, "").await, ServingStatus::Serving);
    }
    cluster.shutdown().await;
}
