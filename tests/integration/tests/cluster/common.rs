//! Test support: a local cluster on either backend, and the ways a test
//! moves time or breaks storage on each.

#![allow(dead_code)]

use std::{sync::Arc, time::Duration};

use imdedup_client::{Client, Encoding};
use imdedup_cluster::{Backends, ClusterOptions, LocalCluster};
use imdedup_domain::clock::ManualClock;
use imdedup_gateway::authz::{Authorizer, GroupsFile};
use imdedup_ingest::{RedisWindowOptions, window::DEFAULT_WINDOW_TTL};
use imdedup_storage::ScyllaOptions;

/// Which backends a test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Embedded,
    /// Redis and the CQL database from `tests/services/services.sh`.
    Real,
}

/// The real backends' endpoints (see [`imdedup_testkit::backends`]).
pub fn real_endpoints() -> Option<(String, String)> {
    imdedup_testkit::backends::redis_and_scylla()
}

/// The group conversations the tests use besides direct ones (`dm:a:b`),
/// each with every test user as a member.
pub fn test_groups() -> Authorizer {
    let everyone: std::collections::HashSet<String> =
        ["ana", "ben", "carl", "a", "a:b"].map(str::to_owned).into();
    let groups = [
        "c",
        "c-json",
        "c-protobuf",
        "chat",
        "bin",
        "busy",
        "race",
        "batch",
        "main",
        "side",
    ]
    .map(|g| (g.to_owned(), everyone.clone()))
    .into();
    Authorizer::members(GroupsFile::fixed(groups).unwrap())
}

/// A phone of `user` on `cluster`'s gateway.
pub async fn connect(cluster: &LocalCluster, user: &str, encoding: Encoding) -> Client {
    Client::connect(
        &cluster.gateway_url(),
        &cluster.token(user).unwrap(),
        encoding,
    )
    .await
    .unwrap()
}

pub fn unique_tag() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

pub struct Harness {
    pub cluster: LocalCluster,
    pub clock: ManualClock,
    pub kind: Kind,
    pub options: ClusterOptions,
    pub dir: tempfile::TempDir,
}

/// Options for a cluster of `kind`, isolated from every other test (own
/// data dir, own keyspace and Redis key prefix). `None`: skipped on purpose.
pub fn options(kind: Kind, dir: &tempfile::TempDir, clock: &ManualClock) -> Option<ClusterOptions> {
    let mut options = ClusterOptions::new(dir.path(), Arc::new(clock.clone()));
    options.authz = test_groups();
    // These tests pipeline hundreds of sends from one phone: the per-user
    // rate is tested on its own (tests/limits.rs), not in their way.
    let plenty = std::num::NonZeroU32::new(100_000).unwrap();
    options.gateway_limits.user_sends_per_second = plenty;
    options.gateway_limits.user_send_burst = plenty;
    if kind == Kind::Real {
        let (redis_url, scylla) = real_endpoints()?;
        let tag = unique_tag();
        let mut redis = RedisWindowOptions::new(vec![redis_url]);
        redis.key_prefix = format!("t{tag}:");
        let mut scylla = ScyllaOptions::single_node(vec![scylla]);
        scylla.keyspace = format!("t{tag}");
        options.backends = Backends::Real { redis, scylla };
    }
    Some(options)
}

pub async fn start(kind: Kind) -> Option<Harness> {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new();
    let options = options(kind, &dir, &clock)?;
    let cluster = LocalCluster::start(options.clone()).await.unwrap();
    Some(Harness {
        cluster,
        clock,
        kind,
        options,
        dir,
    })
}

impl Harness {
    pub async fn connect(&self, user: &str, encoding: Encoding) -> Client {
        connect(&self.cluster, user, encoding).await
    }

    /// Let the recent-ID window forget everything, as its TTL passing would.
    /// Embedded: move the clock. Redis: its clock is its own, so delete this
    /// test's keys (what expiry does), after checking they carry the TTL.
    pub async fn expire_window(&self) {
        match &self.options.backends {
            Backends::Embedded | Backends::WithoutDedup => self
                .clock
                .advance(DEFAULT_WINDOW_TTL + Duration::from_secs(1)),
            Backends::Real { redis, .. } => {
                let client = redis::Client::open(redis.urls[0].as_str()).unwrap();
                let mut conn = client.get_multiplexed_async_connection().await.unwrap();
                let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
                    .arg(format!("{}*", redis.key_prefix))
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                for key in keys {
                    let ttl_ms: i64 = redis::cmd("PTTL")
                        .arg(&key)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    assert!(
                        ttl_ms > 0
                            && ttl_ms
                                <= i64::try_from((redis.ttl + redis.bucket_span).as_millis())
                                    .unwrap(),
                        "every window key expires within the window TTL and a bucket, got {ttl_ms} ms"
                    );
                    let _: i64 = redis::cmd("DEL")
                        .arg(&key)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                }
            }
        }
    }

    /// Make storage fail. Embedded: stop the storage server. Real: drop the
    /// unique-key table, so every insert fails in the database itself.
    pub async fn break_storage(&mut self) {
        match &self.options.backends {
            Backends::Embedded | Backends::WithoutDedup => self.cluster.stop_storage().await,
            Backends::Real { scylla, .. } => {
                let session = imdedup_storage::scylla::connect(scylla).await.unwrap();
                session
                    .query_unpaged(
                        format!("DROP TABLE {}.messages_by_key", scylla.keyspace),
                        (),
                    )
                    .await
                    .unwrap();
            }
        }
    }

    /// Bring storage back (the data of the embedded store is on disk; the
    /// real one is migrated again, as at startup).
    pub async fn repair_storage(&mut self) {
        match &self.options.backends {
            Backends::Embedded | Backends::WithoutDedup => {
                self.cluster.restart_storage().await.unwrap()
            }
            Backends::Real { scylla, .. } => {
                let session = imdedup_storage::scylla::connect(scylla).await.unwrap();
                imdedup_storage::scylla::migrate(&session, scylla)
                    .await
                    .unwrap();
            }
        }
    }
}

/// Send as a phone does: resend the same ID on a retryable error.
pub async fn send_until_acked(
    client: &Client,
    id: &[u8],
    conversation: &str,
    body: &str,
) -> imdedup_client::AckReply {
    for _ in 0..20 {
        match client.send(id, conversation, body).await.unwrap() {
            Ok(ack) => return ack,
            Err(e) if e.retryable => {
                // As a phone does: after the pause the server asked for.
                if let Some(wait) = e.retry_after {
                    tokio::time::sleep(wait).await;
                }
            }
            Err(e) => panic!("final error {e:?}"),
        }
    }
    panic!("no ACK after 20 tries")
}

pub async fn rows(client: &Client, conversation: &str) -> Vec<imdedup_client::HistoryMessage> {
    client.full_history(conversation).await.unwrap().unwrap()
}

/// Run each listed `async fn(Kind)` test on the embedded backends and on
/// Redis plus the CQL database.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::common::Kind::Embedded).await;
                }
            )*
        }
        mod real {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::common::Kind::Real).await;
                }
            )*
        }
    };
}

pub struct HttpReply {
    pub status: u16,
    pub content_type: String,
    pub body: String,
}

/// A hand-written HTTP/1.1 GET, as a scraper sends it.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> HttpReply {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP reply");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status code");
    let content_type = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-type")
                .then(|| value.trim().to_owned())
        })
        .unwrap_or_default();
    HttpReply {
        status,
        content_type,
        body: body.to_owned(),
    }
}

/// The sum of `name`'s samples with `labels` on the admin port of `role`.
pub async fn metric(
    cluster: &LocalCluster,
    role: &str,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<f64> {
    let addr = cluster
        .admin_addrs()
        .into_iter()
        .find_map(|(r, addr)| (r == role).then_some(addr))
        .expect("a service with that role");
    imdedup_testkit::prom::sum_samples(&http_get(addr, "/metrics").await.body, name, labels)
}
