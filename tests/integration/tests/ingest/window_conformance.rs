//! The recent-ID window contract, on the in-process window, a real Redis and
//! a real 3-master Redis Cluster; and Redis killed in the middle of sending.

use imdedup_testkit::{
    backends::real,
    conformance::window::{RECEIPT, conforms},
    fixtures::{key, tag},
    process::{Process, wait_listening},
};
use std::{
    net::TcpListener,
    process::{Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use imdedup_domain::{
    model::{Body, ConversationId, NewMessage, Outcome},
    window::{Claim, RecentWindow},
};
use imdedup_ingest::{Dedup, MemoryWindow, MemoryWindowOptions, RedisWindow, RedisWindowOptions};
use imdedup_storage::{SqliteOptions, SqliteStore};

#[tokio::test]
async fn memory_window_conforms() {
    conforms(Arc::new(MemoryWindow::new(MemoryWindowOptions::default()))).await;
}

#[tokio::test]
async fn redis_window_conforms_and_sets_the_ttls() {
    let Some(url) = real("IMDEDUP_TEST_REDIS_URL") else {
        return;
    };
    let mut options = RedisWindowOptions::new(vec![url.clone()]);
    options.key_prefix = format!("w{}:", tag());
    let window = Arc::new(RedisWindow::connect(options.clone()).await.unwrap());
    conforms(window.clone()).await;

    // The claim lives for the claim TTL; the receipt lands in a compact
    // bucket hash that lives for the window TTL plus one bucket.
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let m = key("ana", "ttl");
    let pattern = format!("{}*", options.key_prefix);
    let Claim::Owned(token) = window.claim(&m).await.unwrap() else {
        panic!()
    };
    let before: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg(&pattern)
        .query_async(&mut conn)
        .await
        .unwrap();
    window.remember(&m, &token, RECEIPT).await.unwrap();
    let after: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg(&pattern)
        .query_async(&mut conn)
        .await
        .unwrap();
    let claim_key = before
        .iter()
        .find(|k| !after.contains(k))
        .expect("remember drops the claim");
    assert!(
        claim_key.windows(3).any(|w| w == b"}p:"),
        "the claim is a pending key"
    );
    let bucket = after
        .iter()
        .find(|k| k.windows(3).any(|w| w == b"}b:") && !before.contains(k))
        .expect("remember writes a bucket hash");
    let ttl: i64 = redis::cmd("PTTL")
        .arg(bucket)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 300_000 && ttl <= 360_000, "bucket ttl {ttl}");
    let encoding: String = redis::cmd("OBJECT")
        .arg("ENCODING")
        .arg(bucket)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(encoding, "listpack");
    let Claim::Owned(_) = window.claim(&key("ana", "ttl-claim")).await.unwrap() else {
        panic!()
    };
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg(&pattern)
        .query_async(&mut conn)
        .await
        .unwrap();
    for k in keys.iter().filter(|k| k.windows(3).any(|w| w == b"}p:")) {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(k)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(ttl > 0 && ttl <= 3_000, "claim ttl {ttl}");
    }
}

#[tokio::test]
async fn redis_cluster_window_conforms() {
    let Some(urls) = real("IMDEDUP_TEST_REDIS_CLUSTER") else {
        return;
    };
    let mut options = RedisWindowOptions::new(urls.split(',').map(str::to_owned).collect());
    options.cluster = true;
    options.key_prefix = format!("c{}:", tag());
    conforms(Arc::new(RedisWindow::connect(options).await.unwrap())).await;
}

/// A redis-server of this test's own, so it can be killed.
struct OwnRedis {
    port: u16,
    process: Process,
}

impl OwnRedis {
    fn start(port: u16) -> Self {
        let mut command = Command::new("redis-server");
        command
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null());
        // redis-server is on PATH: tests/services/services.sh installs it.
        let process = Process::spawn(command);
        wait_listening(
            std::net::SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_secs(10),
        );
        Self { port, process }
    }

    fn kill(self) {
        self.process.kill();
    }
}

fn message(id: &str) -> NewMessage {
    NewMessage {
        key: key("ana", id),
        conversation: ConversationId::parse("c").unwrap(),
        body: Body::parse("hi", 100).unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_sending_is_bypassed_then_used_again() {
    if real("IMDEDUP_TEST_REDIS_URL").is_none() {
        return;
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let redis = OwnRedis::start(port);
    let mut options = RedisWindowOptions::new(vec![format!("redis://127.0.0.1:{port}")]);
    options.breaker_cooldown = Duration::from_millis(200);
    let window = Arc::new(RedisWindow::connect(options).await.unwrap());
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SqliteStore::open(&SqliteOptions::new(dir.path().join("m.db"))).unwrap());
    let dedup = Dedup::new(window.clone(), store, Duration::from_secs(2));

    let first = dedup.send(message("m1")).await.unwrap();
    assert_eq!(
        dedup.send(message("m1")).await.unwrap().outcome,
        Outcome::DuplicateWindow
    );

    redis.kill();
    // Sends keep succeeding, straight to the unique key: nothing lost,
    // nothing doubled.
    let again = dedup.send(message("m1")).await.unwrap();
    assert_eq!(again.outcome, Outcome::DuplicateUniqueKey);
    assert_eq!(again.receipt, first.receipt);
    for i in 2..20 {
        let ack = dedup.send(message(&format!("m{i}"))).await.unwrap();
        assert_eq!(ack.outcome, Outcome::Stored);
        let repeat = dedup.send(message(&format!("m{i}"))).await.unwrap();
        assert_eq!(repeat.outcome, Outcome::DuplicateUniqueKey);
        assert_eq!(repeat.receipt, ack.receipt);
    }
    let counts = dedup.stats().snapshot();
    assert!(
        counts.window_bypassed >= 37,
        "every send while down is counted: {counts:?}"
    );
    assert!(
        window.bypassing(),
        "the breaker is open while Redis is down"
    );

    // Redis comes back (empty): the window is used again.
    let redis = OwnRedis::start(port);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut n = 100;
    loop {
        n += 1;
        let id = format!("m{n}");
        dedup.send(message(&id)).await.unwrap();
        if dedup.send(message(&id)).await.unwrap().outcome == Outcome::DuplicateWindow {
            break;
        }
        assert!(Instant::now() < deadline, "the window never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!window.bypassing());
    assert_eq!(redis.port, port);
    redis.kill();
}
