//! One send is one trace across the three service processes: each exports
//! its spans over OTLP/gRPC to a receiver in this test, and they share the
//! send's trace id.

use std::{collections::BTreeSet, time::Duration};

use imdedup_testkit::otlp::{OtlpReceiver, ReceivedSpan};

mod common;

use common::{Service, connect_phone, free_addr, mint_token, wait_listening};

/// A service process exporting its spans to `otlp`, and nothing else's
/// tracing settings.
fn traced(args: &[&str], data_dir: &std::path::Path, otlp: &str) -> Service {
    let mut command = common::command(args, data_dir);
    command
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", otlp)
        .env("OTEL_BSP_SCHEDULE_DELAY", "100");
    for inherited in [
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_EXPORTER",
        "OTEL_TRACES_SAMPLER",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        command.env_remove(inherited);
    }
    Service::spawn(command)
}

fn find<'a>(spans: &'a [ReceivedSpan], service: &str, name: &str) -> Option<&'a ReceivedSpan> {
    spans
        .iter()
        .find(|s| s.service_name == service && s.name == name)
}

fn listing(spans: &[ReceivedSpan]) -> String {
    spans
        .iter()
        .map(|s| {
            format!(
                "  {:<16} {:<44} trace {} span {} parent {:<16}\n",
                s.service_name, s.name, s.trace_id, s.span_id, s.parent_span_id
            )
        })
        .collect()
}

#[test]
fn one_send_is_one_trace_across_gateway_ingest_and_storage() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let receiver = runtime.block_on(OtlpReceiver::start()).unwrap();
    let otlp = receiver.endpoint();

    let dir = tempfile::tempdir().unwrap();
    let (storage_addr, ingest_addr, gateway_addr) = (free_addr(), free_addr(), free_addr());
    // Admin ports too: the defaults may be taken by another test or service.
    let admins = [free_addr(), free_addr(), free_addr()].map(|a| a.to_string());
    let secret = "trace-test-secret-0123456789abcdef";
    let storage_url = format!("http://{storage_addr}");
    let _storage = traced(
        &[
            "storage",
            "--listen",
            &storage_addr.to_string(),
            "--admin-listen",
            &admins[0],
        ],
        dir.path(),
        &otlp,
    );
    let _ingest = traced(
        &[
            "ingest",
            "--listen",
            &ingest_addr.to_string(),
            "--storage",
            &storage_url,
            "--admin-listen",
            &admins[1],
        ],
        dir.path(),
        &otlp,
    );
    let _gateway = traced(
        &[
            "gateway",
            "--listen",
            &gateway_addr.to_string(),
            "--shards",
            &format!("http://{ingest_addr}"),
            "--storage",
            &storage_url,
            "--token-secret",
            secret,
            "--admin-listen",
            &admins[2],
        ],
        dir.path(),
        &otlp,
    );
    for addr in [storage_addr, ingest_addr, gateway_addr] {
        wait_listening(addr);
    }
    let token = mint_token(secret, "ana");

    let spans = runtime.block_on(async {
        let ana = connect_phone(gateway_addr, &token).await;
        let ack = ana
            .send(b"t-1", "dm:ana:ben", "traced")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ack.outcome, "stored");
        receiver
            .wait_for(Duration::from_secs(10), |spans| {
                find(spans, "imdedup-gateway", "imdedup.send").is_some()
                    && find(spans, "imdedup-ingest", "imdedup.dedup").is_some()
                    && find(spans, "imdedup-storage", "INSERT messages").is_some()
            })
            .await
    });
    let all = listing(&spans);

    // Each service exports its own spans, under its own service.name.
    let send = find(&spans, "imdedup-gateway", "imdedup.send")
        .unwrap_or_else(|| panic!("no gateway send span in:\n{all}"));
    assert_eq!(send.kind, 2, "server");
    assert_eq!(send.attribute("imdedup.outcome"), Some("stored"));
    assert!(send.parent_span_id.is_empty(), "the send is the root");
    let dedup = find(&spans, "imdedup-ingest", "imdedup.dedup")
        .unwrap_or_else(|| panic!("no ingest decision span in:\n{all}"));
    assert_eq!(dedup.attribute("imdedup.outcome"), Some("stored"));
    let insert = find(&spans, "imdedup-storage", "INSERT messages")
        .unwrap_or_else(|| panic!("no storage insert span in:\n{all}"));
    assert_eq!(insert.attribute("db.system"), Some("sqlite"));
    assert_eq!(insert.attribute("db.operation"), Some("INSERT"));
    assert_eq!(insert.kind, 3, "client");
    // The hops are served in server spans named after the gRPC method.
    let ingest_rpc = spans
        .iter()
        .find(|s| {
            s.service_name == "imdedup-ingest"
                && s.attribute("rpc.service") == Some("imdedup.v1.IngestService")
        })
        .unwrap_or_else(|| panic!("no ingest server span in:\n{all}"));
    assert_eq!(ingest_rpc.kind, 2, "server");
    assert_eq!(ingest_rpc.attribute("rpc.system"), Some("grpc"));
    assert_eq!(ingest_rpc.attribute("rpc.grpc.status_code"), Some("0"));
    assert_eq!(
        ingest_rpc.name,
        format!(
            "imdedup.v1.IngestService/{}",
            ingest_rpc.attribute("rpc.method").unwrap()
        )
    );

    // One send, one trace, three services.
    let services: BTreeSet<&str> = spans
        .iter()
        .filter(|s| s.trace_id == send.trace_id)
        .map(|s| s.service_name.as_str())
        .collect();
    assert_eq!(
        services,
        BTreeSet::from(["imdedup-gateway", "imdedup-ingest", "imdedup-storage"]),
        "services in the send's trace {}:\n{all}",
        send.trace_id
    );
    assert_eq!(dedup.trace_id, send.trace_id, "{all}");
    assert_eq!(insert.trace_id, send.trace_id, "{all}");
}
