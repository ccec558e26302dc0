//! The gateway's limits under abuse: each answers with a clear error (and
//! when to come back), stores nothing for what it refuses, is counted in
//! `imdedup_gateway_limited_total`, and leaves well-behaved phones alone.

use super::common;

use std::{
    num::NonZeroU32,
    sync::Arc,
    time::{Duration, Instant},
};

use futures_util::StreamExt;
use imdedup_client::{Client, ClientError, Encoding, HELD_BACK};
use imdedup_cluster::{ClusterOptions, LocalCluster};
use imdedup_domain::clock::SystemClock;
use tokio::io::AsyncReadExt;
use tokio_tungstenite::tungstenite::{self, client::IntoClientRequest};

async fn cluster(
    dir: &tempfile::TempDir,
    limits: impl FnOnce(&mut imdedup_gateway::limits::Limits),
) -> LocalCluster {
    let mut options = ClusterOptions::new(dir.path(), Arc::new(SystemClock));
    options.shards = 1;
    limits(&mut options.gateway_limits);
    LocalCluster::start(options).await.unwrap()
}

/// Limits with a user send rate of `per_second` and a burst of `burst`.
fn send_rate(per_second: u32, burst: u32) -> impl FnOnce(&mut imdedup_gateway::limits::Limits) {
    move |l| {
        l.user_sends_per_second = NonZeroU32::new(per_second).unwrap();
        l.user_send_burst = NonZeroU32::new(burst).unwrap();
    }
}

async fn limited(cluster: &LocalCluster, reason: &str) -> f64 {
    common::metric(
        cluster,
        "gateway",
        "imdedup_gateway_limited_total",
        &[("reason", reason)],
    )
    .await
    .unwrap_or_default()
}

const DM: &str = "dm:ana:ben";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_over_the_send_rate_is_told_when_to_come_back_and_nothing_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(&dir, send_rate(2, 3)).await;
    let ana = common::connect(&cluster, "ana", Encoding::Json).await;
    // Two connections of one user share one bucket.
    let ana_again = common::connect(&cluster, "ana", Encoding::Protobuf).await;
    for id in [&b"r-1"[..], b"r-2"] {
        ana.send(id, DM, "ok").await.unwrap().unwrap();
    }
    ana_again.send(b"r-3", DM, "ok").await.unwrap().unwrap();
    let refused = ana_again.send(b"r-4", DM, "too fast").await.unwrap();
    let refused = refused.expect_err("the fourth send within a second is over the rate");
    assert_eq!(refused.code, "overloaded");
    assert!(refused.retryable);
    let wait = refused.retry_after.expect("a retry-after hint");
    assert!(wait <= Duration::from_millis(500), "{wait:?}");
    assert_eq!(
        common::rows(&ana, DM).await.len(),
        3,
        "nothing stored for it"
    );

    // Another user is not held back; ana is, after the wait, served again.
    let ben = common::connect(&cluster, "ben", Encoding::Json).await;
    ben.send(b"b-1", DM, "hi").await.unwrap().unwrap();
    tokio::time::sleep(wait).await;
    let ack = ana_again
        .send(b"r-4", DM, "too fast")
        .await
        .unwrap()
        .unwrap();
    assert!(!ack.duplicate);
    assert_eq!(limited(&cluster, "user_send_rate").await, 1.0);
    cluster.shutdown().await;
}

/// What a phone's hundred quick sends met: (stored, refused by the
/// gateway, held back by the phone's client).
async fn hundred_sends(phone: &Client, prefix: &str) -> (u32, u32, u32) {
    let (mut stored, mut refused, mut held_back) = (0, 0, 0);
    for i in 0..100 {
        let id = format!("{prefix}-{i}");
        match phone.send(id.as_bytes(), DM, "quick").await.unwrap() {
            Ok(_) => stored += 1,
            Err(e) if e.code == HELD_BACK => {
                assert!(e.retryable && e.retry_after.is_some(), "{e:?}");
                held_back += 1;
            }
            Err(e) => {
                assert_eq!(e.code, "overloaded", "{e:?}");
                refused += 1;
            }
        }
    }
    (stored, refused, held_back)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_phone_holds_back_most_of_what_the_gateway_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(&dir, send_rate(1, 1)).await;
    // Two users, each over the rate with a hundred sends in well under a
    // second: one phone without client-side throttling, one with it.
    let plain = common::connect(&cluster, "ana", Encoding::Json).await;
    let (stored, refused, held_back) = hundred_sends(&plain, "a").await;
    assert_eq!(held_back, 0);
    assert!(refused >= 95, "stored {stored}, refused {refused}");
    let read_plain = limited(&cluster, "user_send_rate").await;

    let throttled = common::connect(&cluster, "ben", Encoding::Json)
        .await
        .with_throttle(2.0);
    let (stored_t, refused_t, held_back_t) = hundred_sends(&throttled, "b").await;
    assert_eq!(throttled.held_back_sends(), u64::from(held_back_t));
    // The gateway read, and refused, a fraction of what it refused the
    // plain phone: the rest stayed on the phone.
    let refused_by_gateway = limited(&cluster, "user_send_rate").await - read_plain;
    assert_eq!(refused_by_gateway, f64::from(refused_t));
    assert!(
        held_back_t >= 60 && refused_t <= 30,
        "stored {stored_t}, refused {refused_t}, held back {held_back_t}"
    );
    // Nothing held back was stored.
    assert_eq!(
        common::rows(&plain, DM).await.len(),
        (stored + stored_t) as usize
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_of_a_phones_old_messages_hold_back_its_old_messages_not_its_new_ones() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(&dir, send_rate(1, 1)).await;
    let ben = common::connect(&cluster, "ben", Encoding::Json)
        .await
        .with_throttle(2.0);
    // A phone back with a hundred messages written ten seconds ago: the
    // gateway refuses all but the first (over the rate), and the throttle
    // holds most of them back.
    let written = Instant::now()
        .checked_sub(imdedup_client::FRESH_FOR * 2)
        .unwrap();
    let (mut refused, mut held_back) = (0, 0);
    for i in 0..100 {
        let id = format!("old-{i}");
        let (number, reply) = ben
            .send_numbered_since(id.as_bytes(), DM, "old", written)
            .await
            .unwrap();
        match reply {
            Err(e) if number == 0 => {
                assert_eq!(e.code, HELD_BACK, "{e:?}");
                held_back += 1;
            }
            Err(e) => {
                assert_eq!(e.code, "overloaded", "{e:?}");
                refused += 1;
            }
            Ok(_) => {}
        }
    }
    assert!(held_back >= 60, "held back {held_back}, refused {refused}");
    // Its new message goes to the gateway: the old ones' refusals do not
    // count for it (counted, they hold back ~97% of new sends).
    let (number, reply) = ben.send_numbered(b"new-1", DM, "new").await.unwrap();
    assert_ne!(number, 0, "the new message was held back: {reply:?}");
    refused += u32::from(reply.is_err());
    assert_eq!(
        limited(&cluster, "user_send_rate").await,
        f64::from(refused)
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_sheds_sends_beyond_its_in_flight_cap_and_a_resend_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(&dir, |l| l.max_sends_in_flight = 1).await;
    let ana = common::connect(&cluster, "ana", Encoding::Json).await;
    let ids: Vec<String> = (0..8).map(|i| format!("f-{i}")).collect();
    let sends: Vec<_> = ids.iter().map(|id| (id.as_bytes(), DM, "body")).collect();
    let replies = ana.send_pipelined(&sends).await.unwrap();
    let shed: Vec<_> = replies.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(!shed.is_empty(), "eight sends at once through a cap of one");
    for e in &shed {
        assert_eq!(e.code, "overloaded");
        assert!(e.retry_after.is_some());
    }
    // Each refusal is an appointment after the one before: the phones are
    // spread out, not sent back together.
    let waits: Vec<Duration> = shed.iter().map(|e| e.retry_after.unwrap()).collect();
    assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
    assert!(
        waits.first() < waits.last() || waits.len() == 1,
        "{waits:?}"
    );
    let stored = replies.len() - shed.len();
    assert_eq!(common::rows(&ana, DM).await.len(), stored);
    // The phone resends what was shed, one at a time: all stored, once.
    for id in &ids {
        common::send_until_acked(&ana, id.as_bytes(), DM, "body").await;
    }
    assert_eq!(common::rows(&ana, DM).await.len(), ids.len());
    assert_eq!(limited(&cluster, "in_flight").await, shed.len() as f64);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_of_a_send_in_flight_joins_it_and_gets_the_same_ack() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(&dir, |_| {}).await;
    let ana = common::connect(&cluster, "ana", Encoding::Json).await;
    let other = common::connect(&cluster, "ana", Encoding::Json).await;
    // The same message three times back to back (the second and third
    // arrive while the first is on its way to the shard), and once more
    // with other content under the same ID.
    let copies = [(b"j-1".as_slice(), DM, "hello"); 3];
    let (replies, reused) = tokio::join!(ana.send_pipelined(&copies), async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        other.send(b"j-1", DM, "other text").await
    });
    let acks: Vec<_> = replies
        .unwrap()
        .into_iter()
        .map(|r| r.expect("an ACK"))
        .collect();
    assert!(
        acks.iter()
            .all(|a| a.server_id == acks[0].server_id && a.seq == acks[0].seq)
    );
    let joined = common::metric(
        &cluster,
        "gateway",
        "imdedup_gateway_resends_joined_total",
        &[],
    )
    .await
    .unwrap_or_default();
    assert!(joined >= 1.0, "copies in flight joined the first: {joined}");
    assert_eq!(reused.unwrap().unwrap_err().code, "id_reused");
    assert_eq!(common::rows(&ana, DM).await.len(), 1, "stored once");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_has_a_bounded_number_of_connections() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(&dir, |l| l.max_connections_per_user = 2).await;
    let first = common::connect(&cluster, "ana", Encoding::Json).await;
    let _second = common::connect(&cluster, "ana", Encoding::Json).await;
    let token = cluster.token("ana").unwrap();
    match Client::connect(&cluster.gateway_url(), &token, Encoding::Json).await {
        Err(ClientError::Refused { status, body }) => {
            assert_eq!(status, 429);
            assert!(body.contains("overloaded"), "{body}");
        }
        Ok(_) => panic!("a third connection of one user was accepted"),
        Err(e) => panic!("{e}"),
    }
    // Other users are not affected; a closed connection frees its slot.
    common::connect(&cluster, "ben", Encoding::Json).await;
    drop(first);
    let mut reconnected = None;
    for _ in 0..50 {
        if let Ok(c) = Client::connect(&cluster.gateway_url(), &token, Encoding::Json).await {
            reconnected = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(reconnected.is_some(), "the freed slot was not given back");
    assert!(limited(&cluster, "user_connections").await >= 1.0);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_authenticate_are_capped_and_cut() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(&dir, |l| {
        l.max_unauthenticated = 2;
        l.upgrade_timeout = Duration::from_millis(400);
    })
    .await;
    let addr = cluster.gateway_addr();
    // Two slow clients that send half a request and stop.
    let mut slow = Vec::new();
    for _ in 0..2 {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut tcp, b"GET /v1/ws HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        slow.push(tcp);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    // A third is closed at once.
    let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_millis(300), third.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "the third unauthenticated connection was kept: {read:?}"
    );
    // The slow ones are cut at their deadline, with nothing answered.
    for tcp in &mut slow {
        let read = tokio::time::timeout(Duration::from_secs(3), tcp.read(&mut buf))
            .await
            .expect("cut by the upgrade timeout");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
    // Their slots are free again: a phone connects and sends.
    let ana = common::connect(&cluster, "ana", Encoding::Json).await;
    ana.send(b"after", DM, "hi").await.unwrap().unwrap();
    assert!(limited(&cluster, "unauthenticated").await >= 1.0);
    assert_eq!(limited(&cluster, "upgrade_timeout").await, 2.0);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_phone_is_closed_after_the_idle_timeout_and_a_live_one_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(&dir, |l| {
        l.ping_interval = Duration::from_millis(100);
        l.idle_timeout = Duration::from_millis(500);
    })
    .await;
    // A live phone answers the pings (the client library reads all the
    // time); a dead one never reads, so never answers.
    let live = common::connect(&cluster, "ana", Encoding::Json).await;
    let mut request = cluster.gateway_url().into_client_request().unwrap();
    let bearer = format!("Bearer {}", cluster.token("ben").unwrap());
    request
        .headers_mut()
        .insert("authorization", bearer.parse().unwrap());
    let (mut dead, _) = tokio_tungstenite::connect_async(request).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;

    assert!(!live.is_closed(), "a phone answering pings was closed");
    live.send(b"still", DM, "here").await.unwrap().unwrap();
    // The dead phone finds pings, then the gateway's close (or, as its
    // pongs now meet a closed socket, the end of the connection).
    let ended = tokio::time::timeout(Duration::from_secs(2), async {
        while let Some(frame) = dead.next().await {
            match frame {
                Ok(tungstenite::Message::Close(frame)) => {
                    return frame.map(|f| f.reason.to_string());
                }
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
        None
    })
    .await
    .expect("the gateway closed the dead phone's connection");
    if let Some(reason) = ended {
        assert!(reason.contains("idle"), "{reason}");
    }
    assert_eq!(limited(&cluster, "idle").await, 1.0);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_pages_are_capped_in_bytes_and_pulls_per_connection_in_number() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(&dir, |l| {
        l.max_history_page_bytes = 100;
        l.max_pulls_per_connection = 1;
    })
    .await;
    let ana = common::connect(&cluster, "ana", Encoding::Json).await;
    let body = "x".repeat(60);
    for i in 0..5 {
        ana.send(format!("h-{i}").as_bytes(), DM, &body)
            .await
            .unwrap()
            .unwrap();
    }
    // 60-byte bodies, 100 bytes a page: one message a page; paging on from
    // the last seq still reads them all.
    let page = ana.history(DM, 0, 100).await.unwrap().unwrap();
    assert_eq!(page.messages.len(), 1);
    assert_eq!(common::rows(&ana, DM).await.len(), 5);

    // Pulls at once on one connection: one at a time goes, the others are
    // refused with a hint.
    let pulls = futures_util::future::join_all((0..4).map(|_| ana.history(DM, 0, 1))).await;
    let refused: Vec<_> = pulls
        .iter()
        .filter_map(|p| p.as_ref().unwrap().as_ref().err())
        .collect();
    assert!(!refused.is_empty() && refused.len() < 4, "{pulls:?}");
    for e in refused {
        assert_eq!(e.code, "overloaded");
        assert!(e.retry_after.is_some());
    }
    assert!(limited(&cluster, "history_pulls").await >= 1.0);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phone_that_asks_for_queue_is_held_not_refused_and_keeps_its_send_order() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = cluster(&dir, |l| l.max_sends_in_flight = 1).await;
    let ana = common::connect(&cluster, "ana", Encoding::Json)
        .await
        .with_queue(true);
    let other = "dm:ana:cat";
    let ids: Vec<String> = (0..8).map(|i| format!("q-{i}")).collect();
    let mut sends: Vec<_> = ids.iter().map(|id| (id.as_bytes(), DM, "body")).collect();
    sends.insert(3, (b"q-other", other, "elsewhere"));
    // While they are held, the same message from a second connection of
    // the phone (a resend after a reconnect) joins the held send.
    let again = common::connect(&cluster, "ana", Encoding::Protobuf)
        .await
        .with_queue(true);
    let (replies, resent) = tokio::join!(ana.send_pipelined(&sends), async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        again.send(b"q-7", DM, "body").await
    });
    let acks: Vec<_> = replies
        .unwrap()
        .into_iter()
        .map(|r| r.expect("held and then stored, never refused"))
        .collect();
    assert!(ana.queued_answers() >= 2, "{}", ana.queued_answers());
    assert_eq!(limited(&cluster, "in_flight").await, 0.0);
    let queued = common::metric(
        &cluster,
        "gateway",
        "imdedup_gateway_sends_queued_total",
        &[],
    )
    .await
    .unwrap_or_default();
    assert_eq!(
        queued,
        (ana.queued_answers() + again.queued_answers()) as f64
    );

    // The conversation's sends are stored in the order they were written.
    let dm_seqs: Vec<u64> = acks
        .iter()
        .filter(|a| a.id != b"q-other")
        .map(|a| a.seq)
        .collect();
    assert!(dm_seqs.windows(2).all(|w| w[0] < w[1]), "{dm_seqs:?}");
    let rows = common::rows(&ana, DM).await;
    let stored: Vec<&[u8]> = rows.iter().map(|m| &m.id[..]).collect();
    let written: Vec<&[u8]> = ids.iter().map(|id| id.as_bytes()).collect();
    assert_eq!(stored, written, "each stored once, in send order");
    let resent = resent.unwrap().expect("the copy gets the held send's ACK");
    let first = acks.iter().find(|a| a.id == b"q-7").unwrap();
    assert_eq!((resent.server_id, resent.seq), (first.server_id, first.seq));
    cluster.shutdown().await;
}
