//! The admin ports of a whole local cluster, scraped over real HTTP after
//! real sends: what a Prometheus server would see.

use super::common;

use common::{Kind, http_get as get, start};
use imdedup_client::Encoding;
use imdedup_testkit::prom::sum_samples;

async fn every_service_exposes_what_the_sends_did(kind: Kind) {
    let Some(h) = start(kind).await else { return };
    let ana = h.connect("ana", Encoding::Json).await;
    let first = ana
        .send(b"m-1", "dm:ana:ben", "hello")
        .await
        .unwrap()
        .unwrap();
    let again = ana
        .send(b"m-1", "dm:ana:ben", "hello")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.outcome, "duplicate_window");
    assert_eq!((again.server_id, again.seq), (first.server_id, first.seq));
    let bad = ana
        .send(b"m-2", "dm:ana:ben", "")
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(bad.code, "invalid_argument");

    let admins = h.cluster.admin_addrs();
    let roles: Vec<&str> = admins.iter().map(|(role, _)| role.as_str()).collect();
    assert_eq!(roles, ["storage", "ingest-0", "ingest-1", "gateway"]);

    let mut scraped = Vec::new();
    for (role, addr) in &admins {
        let health = get(*addr, "/healthz").await;
        assert_eq!((health.status, health.body.as_str()), (200, "ok"), "{role}");
        let ready = get(*addr, "/readyz").await;
        assert_eq!(
            (ready.status, ready.body.as_str()),
            (200, "ready"),
            "{role}"
        );
        let metrics = get(*addr, "/metrics").await;
        assert_eq!(metrics.status, 200, "{role}");
        assert!(
            metrics
                .content_type
                .starts_with("application/openmetrics-text"),
            "{role}: {}",
            metrics.content_type
        );
        assert!(metrics.body.ends_with("# EOF\n"), "{role}");
        scraped.push((role.clone(), metrics.body));
    }
    let text = |role: &str| {
        scraped
            .iter()
            .find(|(r, _)| r == role)
            .map(|(_, body)| body.as_str())
            .unwrap()
    };

    let gateway = text("gateway");
    let sends = "imdedup_gateway_sends_total";
    for (outcome, count) in [
        ("stored", 1.0),
        ("duplicate_window", 1.0),
        ("rejected", 1.0),
    ] {
        assert_eq!(
            sum_samples(gateway, sends, &[("outcome", outcome)]),
            Some(count),
            "{outcome} in\n{gateway}"
        );
    }
    assert_eq!(
        sum_samples(
            gateway,
            "imdedup_gateway_send_errors_total",
            &[("code", "invalid_argument")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sum_samples(gateway, "imdedup_gateway_ack_duration_seconds_count", &[]),
        Some(3.0)
    );
    assert_eq!(
        sum_samples(gateway, "imdedup_gateway_connections", &[]),
        Some(1.0)
    );
    assert_eq!(
        sum_samples(gateway, "imdedup_gateway_sends_in_flight", &[]),
        Some(0.0)
    );
    // The one shard that owns ana-ben answered: its link is up.
    assert_eq!(
        sum_samples(gateway, "imdedup_gateway_shard_up", &[]),
        Some(1.0),
        "{gateway}"
    );

    // Exactly one shard decided both copies, under its own shard label.
    let mut deciders = Vec::new();
    for shard in ["ingest-0", "ingest-1"] {
        let ingest = text(shard);
        let label = ("shard", shard);
        assert_eq!(
            sum_samples(ingest, "imdedup_ingest_shard_info", &[label]),
            Some(1.0),
            "{ingest}"
        );
        let stored = sum_samples(
            ingest,
            "imdedup_ingest_sends_total",
            &[label, ("outcome", "stored")],
        );
        if stored.unwrap_or(0.0) == 0.0 {
            continue;
        }
        deciders.push(shard);
        assert_eq!(stored, Some(1.0));
        assert_eq!(
            sum_samples(
                ingest,
                "imdedup_ingest_sends_total",
                &[label, ("outcome", "duplicate_window")]
            ),
            Some(1.0)
        );
        assert_eq!(
            sum_samples(
                ingest,
                "imdedup_window_claims_total",
                &[label, ("result", "seen")]
            ),
            Some(1.0)
        );
        let backend = if kind == Kind::Real {
            "redis"
        } else {
            "memory"
        };
        assert_eq!(
            sum_samples(
                ingest,
                "imdedup_window_operation_duration_seconds_count",
                &[label, ("operation", "claim"), ("backend", backend)]
            ),
            Some(2.0)
        );
        // The window answered the repeat: one insert only.
        assert_eq!(
            sum_samples(
                ingest,
                "imdedup_storage_operation_duration_seconds_count",
                &[label, ("operation", "insert")]
            ),
            Some(1.0)
        );
        if kind == Kind::Real {
            // The shard writes to the database itself.
            assert_eq!(
                sum_samples(
                    ingest,
                    "imdedup_store_inserts_total",
                    &[label, ("db_system", "cassandra"), ("result", "applied")]
                ),
                Some(1.0)
            );
        }
    }
    assert_eq!(deciders.len(), 1, "one owner for ana-ben: {deciders:?}");

    if kind == Kind::Embedded {
        assert_eq!(
            sum_samples(
                text("storage"),
                "imdedup_store_inserts_total",
                &[("db_system", "sqlite"), ("result", "applied")]
            ),
            Some(1.0),
            "{}",
            text("storage")
        );
    }

    drop(ana);
    h.cluster.shutdown().await;
    for (role, addr) in &admins {
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "{role}'s admin port stops with the cluster"
        );
    }
}

#[tokio::test]
async fn every_service_exposes_what_the_sends_did_embedded() {
    every_service_exposes_what_the_sends_did(Kind::Embedded).await;
}

#[tokio::test]
async fn every_service_exposes_what_the_sends_did_real() {
    every_service_exposes_what_the_sends_did(Kind::Real).await;
}
