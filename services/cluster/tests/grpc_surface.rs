//! Every gRPC server answers health checks and lists its services through
//! reflection, so grpcurl and Kubernetes gRPC probes work.

use std::sync::Arc;

use imdedup_cluster::{ClusterOptions, LocalCluster};
use imdedup_core::clock::SystemClock;
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

async fn list_services(url: &str) -> Vec<String> {
    let mut client = ServerReflectionClient::new(channel(url).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut replies = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
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
async fn servers_expose_reflection_and_health() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::start(ClusterOptions::new(dir.path(), Arc::new(SystemClock)))
        .await
        .unwrap();

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
