//! The `imdedup` binary: the demo's verdict, and each service as its own
//! process wired over real sockets, stopped by SIGTERM.

use std::{net::SocketAddr, process::Command};

mod common;

use common::{BIN, Service, connect_phone, free_addr, gateway_args, mint_token, wait_listening};

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
    let Some((redis, scylla)) = imdedup_testkit::backends::redis_and_scylla() else {
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
    let secret = "process-test-secret-0123456789abcdef";
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
    let args = gateway_args(
        gateway_addr,
        &format!("http://{ingest_addr}"),
        &storage_url,
        secret,
        admins[2],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let gateway = Service::start(&args, dir.path());
    for addr in [storage_addr, ingest_addr, gateway_addr]
        .into_iter()
        .chain(admins)
    {
        wait_listening(addr);
    }

    let token = mint_token(secret, "ana");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let ana = connect_phone(gateway_addr, &token).await;
        let first = ana
            .send(b"p-1", "dm:ana:ben", "over processes")
            .await
            .unwrap()
            .unwrap();
        let again = ana
            .send(b"p-1", "dm:ana:ben", "over processes")
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

/// `imdedup dev --listen 127.0.0.1:0` takes free ports for every server it
/// runs, the business gRPC one too, and prints the ports it took; an idle
/// connection left open to it does not keep it from stopping on SIGTERM.
#[test]
fn dev_on_port_0_takes_free_ports_and_stops_on_sigterm_with_a_connection_idle() {
    use std::io::{BufRead, BufReader};

    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("dev");
    let mut command = common::command(
        &[
            "dev",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
        ],
        dir.path(),
    );
    command.stdout(std::process::Stdio::piped());
    let mut child = command.spawn().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let line = stdout
        .lines()
        .map(Result::unwrap)
        .find(|line| line.trim_start().starts_with("HTTP http://"))
        .expect("dev printed its business API addresses");
    let service = Service::from_child(child);
    // "HTTP http://ADDR/v1/messages   gRPC http://ADDR (...)"
    let addrs: Vec<SocketAddr> = line
        .split_whitespace()
        .filter_map(|word| word.strip_prefix("http://"))
        .map(|rest| rest.trim_end_matches("/v1/messages").parse().unwrap())
        .collect();
    assert_eq!(addrs.len(), 2, "{line}");
    for addr in &addrs {
        assert_ne!(addr.port(), 0, "{line}");
        wait_listening(*addr);
    }
    assert_ne!(addrs[1].port(), 7110, "{line}");
    let _idle = std::net::TcpStream::connect(addrs[1]).unwrap();
    assert!(service.terminate().success());
}

#[test]
fn named_shards_route_by_name_and_each_ingest_accepts_what_the_gateway_sends_it() {
    let dir = tempfile::tempdir().unwrap();
    let (storage_addr, gateway_addr) = (free_addr(), free_addr());
    let ingest_addrs = [free_addr(), free_addr()];
    let secret = "process-test-secret-0123456789abcdef";
    let storage_url = format!("http://{storage_addr}");
    let admin = || free_addr().to_string();
    let storage = Service::start(
        &[
            "storage",
            "--listen",
            &storage_addr.to_string(),
            "--admin-listen",
            &admin(),
        ],
        dir.path(),
    );
    // The ingests spell the URLs one way and list the shards in one order;
    // the gateway another. Routing follows the names, so every send reaches
    // the shard that owns its conversation, which accepts it.
    let ingest_map = format!(
        "shard-a=http://{},shard-b=http://{}",
        ingest_addrs[0], ingest_addrs[1]
    );
    let gateway_map = format!(
        "shard-b=http://localhost:{},shard-a=http://localhost:{}",
        ingest_addrs[1].port(),
        ingest_addrs[0].port()
    );
    let ingests: Vec<_> = ["shard-a", "shard-b"]
        .iter()
        .zip(ingest_addrs)
        .map(|(name, addr)| {
            Service::start(
                &[
                    "ingest",
                    "--listen",
                    &addr.to_string(),
                    "--storage",
                    &storage_url,
                    "--admin-listen",
                    &admin(),
                    "--shard-name",
                    name,
                    "--shards",
                    &ingest_map,
                ],
                dir.path(),
            )
        })
        .collect();
    let args = gateway_args(
        gateway_addr,
        &gateway_map,
        &storage_url,
        secret,
        free_addr(),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let gateway = Service::start(&args, dir.path());
    for addr in [storage_addr, gateway_addr].into_iter().chain(ingest_addrs) {
        wait_listening(addr);
    }
    let token = mint_token(secret, "ana");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let ana = connect_phone(gateway_addr, &token).await;
        for i in 0..40 {
            let conversation = format!("dm:ana:peer-{i}");
            let ack = ana
                .send(format!("n-{i}").as_bytes(), &conversation, "routed by name")
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("{conversation}: {e:?}"));
            assert_eq!(ack.outcome, "stored", "{conversation}");
        }
    });
    assert!(gateway.terminate().success());
    for ingest in ingests {
        assert!(ingest.terminate().success());
    }
    assert!(storage.terminate().success());
}

/// `imdedup --check-config …` with only `env` (and plaintext between the
/// services asked for): exit status and output.
fn check_config(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut env = env.to_vec();
    env.push(("IMDEDUP_INSECURE_PLAINTEXT", "true"));
    check_config_exactly(args, &env)
}

/// `imdedup --check-config …` with exactly `env`.
fn check_config_exactly(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let output = Command::new(BIN)
        .arg("--check-config")
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[test]
fn check_config_accepts_a_deployable_configuration_and_explains_a_wrong_one() {
    let shards = "imdedup-ingest-0=http://imdedup-ingest-0.imdedup-ingest-headless:7200,\
                  imdedup-ingest-1=http://imdedup-ingest-1.imdedup-ingest-headless:7200";
    let secret = "a-token-secret-of-more-than-32-bytes";
    let gateway = [
        ("IMDEDUP_SHARDS", shards),
        ("IMDEDUP_TOKEN_SECRET", secret),
        ("IMDEDUP_GATEWAY_LISTEN", "0.0.0.0:7100"),
    ];
    assert_eq!(
        check_config(&["gateway"], &gateway),
        (true, "config ok\n".to_owned())
    );
    let ingest = [
        ("IMDEDUP_SHARDS", shards),
        ("IMDEDUP_SHARD_NAME", "imdedup-ingest-1"),
        ("IMDEDUP_REDIS_URL", "redis://:secret@redis:6379"),
        ("IMDEDUP_SCYLLA_NODES", "scylla-0:9042,scylla-1:9042"),
        ("IMDEDUP_SCYLLA_MIGRATE", "false"),
    ];
    assert_eq!(
        check_config(&["ingest"], &ingest),
        (true, "config ok\n".to_owned())
    );

    let wrong = [
        (
            vec!["ingest"],
            vec![
                ("IMDEDUP_SHARDS", shards),
                ("IMDEDUP_SHARD_NAME", "imdedup-ingest-2"),
            ],
            "not in the shard list",
        ),
        (
            vec!["gateway"],
            vec![
                ("IMDEDUP_SHARDS", shards),
                ("IMDEDUP_TOKEN_SECRET", "short"),
            ],
            "--token-secret",
        ),
        (
            vec!["gateway", "--shards", "a=http://x:1,a=http://y:1"],
            vec![("IMDEDUP_TOKEN_SECRET", secret)],
            "twice",
        ),
        (
            vec!["ingest"],
            vec![("IMDEDUP_REDIS_URL", "http://redis:6379")],
            "redis url",
        ),
        (
            vec!["storage"],
            vec![
                ("IMDEDUP_SCYLLA_NODES", "s:9042"),
                ("IMDEDUP_SCYLLA_CONSISTENCY", "most"),
            ],
            "most",
        ),
        (
            vec!["ingest", "--scylla-migrate", "maybe"],
            vec![],
            "--scylla-migrate",
        ),
        (vec!["migrate"], vec![], "--scylla"),
        (vec!["gateway", "--no-such-flag"], vec![], "--no-such-flag"),
    ];
    for (args, env, expected) in wrong {
        let (ok, text) = check_config(&args, &env);
        assert!(!ok, "{args:?} {env:?} was accepted: {text}");
        assert!(text.contains(expected), "{args:?}: {text}");
        assert!(!text.contains("secret@"), "a password leaked: {text}");
    }
    // Neither certificates nor plaintext asked for: refused, saying both.
    for (service, env) in [
        ("gateway", &gateway[..]),
        ("ingest", &ingest[..]),
        ("storage", &[][..]),
    ] {
        let (ok, text) = check_config_exactly(&[service], env);
        assert!(!ok, "{service} started without TLS or --insecure-plaintext");
        assert!(
            text.contains("--tls-cert") && text.contains("--insecure-plaintext"),
            "{service}: {text}"
        );
    }
}

#[test]
fn an_ingest_started_while_redis_is_down_serves_with_the_window_bypassed() {
    let dir = tempfile::tempdir().unwrap();
    let (storage_addr, ingest_addr, gateway_addr) = (free_addr(), free_addr(), free_addr());
    let ingest_admin = free_addr();
    let secret = "process-test-secret-0123456789abcdef";
    let storage_url = format!("http://{storage_addr}");
    let admin = free_addr().to_string();
    let storage = Service::start(
        &[
            "storage",
            "--listen",
            &storage_addr.to_string(),
            "--admin-listen",
            &admin,
        ],
        dir.path(),
    );
    // Nothing listens at this Redis address.
    let dead_redis = format!("redis://{}", free_addr());
    let ingest = Service::start(
        &[
            "ingest",
            "--listen",
            &ingest_addr.to_string(),
            "--storage",
            &storage_url,
            "--admin-listen",
            &ingest_admin.to_string(),
            "--redis",
            &dead_redis,
        ],
        dir.path(),
    );
    let args = gateway_args(
        gateway_addr,
        &format!("http://{ingest_addr}"),
        &storage_url,
        secret,
        free_addr(),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let gateway = Service::start(&args, dir.path());
    for addr in [storage_addr, ingest_addr, gateway_addr, ingest_admin] {
        wait_listening(addr);
    }
    let token = mint_token(secret, "ana");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let ana = connect_phone(gateway_addr, &token).await;
        let first = ana
            .send(b"r-1", "dm:ana:ben", "no redis")
            .await
            .unwrap()
            .unwrap();
        let again = ana
            .send(b"r-1", "dm:ana:ben", "no redis")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(first.outcome, "stored");
        // No window: the unique key recognises the resend.
        assert_eq!(again.outcome, "duplicate_unique_key");
        assert_eq!(again.seq, first.seq);
    });
    let (_, metrics) = http_get(ingest_admin, "/metrics");
    let bypassed = metrics
        .lines()
        .find(|l| l.starts_with("imdedup_window_bypassed_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok());
    assert_eq!(bypassed, Some(2.0), "{metrics}");
    for service in [gateway, ingest, storage] {
        assert!(service.terminate().success());
    }
}
