//! The `imdedup` binary: the demo's verdict, and each service as its own
//! process wired over real sockets, stopped by SIGTERM.

use std::{net::SocketAddr, process::Command};

use imdedup_client::{Client, Encoding};

mod common;

use common::{BIN, Service, free_addr, wait_listening};

fn check_demo(extra: &[&str]) {
    let output = Command::new(BIN)
        .args(["demo", "--speed", "100"])
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let count = |label: &str| -> u64 {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(label))
            .unwrap_or_else(|| panic!("no {label:?} line in:\n{stdout}"));
        line[line.find(label).unwrap() + label.len()..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(count("stored (Ben sees)"), 8);
    assert_eq!(count("repeats Ben sees"), 0);
    assert_eq!(count("lost"), 0);
    assert_eq!(count("caught by the unique key"), 1);
    assert!(count("caught by the window") >= 1, "{stdout}");
    assert!(
        stdout.contains("#3  resend: repeat, caught by the unique key"),
        "{stdout}"
    );
}

#[test]
fn the_demo_shows_no_repeats_no_losses_and_the_late_resend_caught_by_the_unique_key() {
    check_demo(&[]);
}

#[test]
fn the_demo_on_redis_and_the_cql_database_gives_the_same_verdict() {
    let (Ok(redis), Ok(scylla)) = (
        std::env::var("IMDEDUP_TEST_REDIS_URL"),
        std::env::var("IMDEDUP_TEST_SCYLLA"),
    ) else {
        assert_eq!(
            std::env::var("IMDEDUP_SKIP_REAL_BACKENDS").as_deref(),
            Ok("1"),
            "IMDEDUP_TEST_REDIS_URL / IMDEDUP_TEST_SCYLLA are not set: run deploy/local/test.sh"
        );
        return;
    };
    check_demo(&[
        "--redis",
        &redis,
        "--scylla",
        &scylla,
        "--scylla-keyspace",
        "imdedup_demo_test",
    ]);
}

#[test]
fn the_demo_refuses_nonsense_flags() {
    let output = Command::new(BIN)
        .args(["demo", "--loss-send", "1.5"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("--loss-send must be between 0 and 1")
    );
}

/// A plain HTTP/1.1 GET on an admin port: the status code and the body.
fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_owned())
}

#[test]
fn services_run_as_separate_processes_and_stop_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let (storage_addr, ingest_addr, gateway_addr) = (free_addr(), free_addr(), free_addr());
    let admins = [free_addr(), free_addr(), free_addr()];
    let secret = "process-test-secret-0123456789";
    let storage = Service::start(
        &[
            "storage",
            "--listen",
            &storage_addr.to_string(),
            "--admin-listen",
            &admins[0].to_string(),
        ],
        dir.path(),
    );
    let storage_url = format!("http://{storage_addr}");
    let ingest = Service::start(
        &[
            "ingest",
            "--listen",
            &ingest_addr.to_string(),
            "--storage",
            &storage_url,
            "--admin-listen",
            &admins[1].to_string(),
            "--shard-name",
            "ingest-p",
        ],
        dir.path(),
    );
    let gateway = Service::start(
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
            &admins[2].to_string(),
        ],
        dir.path(),
    );
    for addr in [storage_addr, ingest_addr, gateway_addr]
        .into_iter()
        .chain(admins)
    {
        wait_listening(addr);
    }

    let token = Command::new(BIN)
        .args(["token", "--user", "ana", "--token-secret", secret])
        .output()
        .unwrap();
    let token = String::from_utf8(token.stdout).unwrap().trim().to_owned();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let ana = Client::connect(
            &format!("ws://{gateway_addr}/v1/ws"),
            &token,
            Encoding::Json,
        )
        .await
        .unwrap();
        let first = ana
            .send(b"p-1", "c", "over processes")
            .await
            .unwrap()
            .unwrap();
        let again = ana
            .send(b"p-1", "c", "over processes")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(first.outcome, "stored");
        assert_eq!(again.outcome, "duplicate_window");
        assert_eq!(again.seq, first.seq);
    });

    for admin in admins {
        assert_eq!(http_get(admin, "/readyz"), (200, "ready".to_owned()));
    }
    let (status, ingest_metrics) = http_get(admins[1], "/metrics");
    assert_eq!(status, 200);
    for line in [
        r#"imdedup_ingest_sends_total{shard="ingest-p",outcome="stored"} 1"#,
        r#"imdedup_ingest_sends_total{shard="ingest-p",outcome="duplicate_window"} 1"#,
    ] {
        assert!(
            ingest_metrics.lines().any(|l| l == line),
            "{ingest_metrics}"
        );
    }
    let (_, gateway_metrics) = http_get(admins[2], "/metrics");
    assert!(
        gateway_metrics.contains("imdedup_gateway_sends_total{outcome=\"stored\"} 1\n"),
        "{gateway_metrics}"
    );
    let (_, storage_metrics) = http_get(admins[0], "/metrics");
    assert!(
        storage_metrics
            .contains("imdedup_store_inserts_total{db_system=\"sqlite\",result=\"applied\"} 1\n"),
        "{storage_metrics}"
    );

    for service in [gateway, ingest, storage] {
        assert!(service.terminate().success());
    }
    assert!(dir.path().join("messages.db").exists());
}
