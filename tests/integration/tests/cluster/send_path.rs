//! The send path end to end, through the real WebSocket gateway, the real
//! gRPC ingest shards and the real storage on SQLite.

use std::sync::Arc;

use super::common;

use common::{Kind, rows, start};
use imdedup_client::{Client, Encoding, RawMessage, Reply};
use imdedup_cluster::LocalCluster;
use imdedup_domain::clock::ManualClock;
use imdedup_proto::v1::{
    self as pb, ingest_service_client::IngestServiceClient, insert_result, send_response,
    storage_service_client::StorageServiceClient,
};

async fn a_resend_after_a_lost_ack_gets_the_same_ack_and_stores_one_row(kind: Kind) {
    let Some(h) = start(kind).await else { return };
    let ana = h.connect("ana", Encoding::Json).await;

    let first = ana
        .send(b"m-7", "dm:ana:ben", "I'm downstairs")
        .await
        .unwrap()
        .unwrap();
    // The ACK is "lost": the phone resends the same ID.
    let again = ana
        .send(b"m-7", "dm:ana:ben", "I'm downstairs")
        .await
        .unwrap()
        .unwrap();

    assert!(!first.duplicate);
    assert!(again.duplicate);
    assert_eq!(again.outcome, "duplicate_window");
    assert_eq!((again.server_id, again.seq), (first.server_id, first.seq));
    let stored = rows(&ana, "dm:ana:ben").await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].body, "I'm downstairs");
    h.cluster.shutdown().await;
}

async fn a_resend_after_the_window_is_caught_by_the_unique_key(kind: Kind) {
    let Some(h) = start(kind).await else { return };
    let ana = h.connect("ana", Encoding::Json).await;
    let first = ana
        .send(b"m-3", "dm:ana:ben", "see you")
        .await
        .unwrap()
        .unwrap();

    // The app was killed and resends an hour later: the window forgot.
    h.expire_window().await;
    let late = ana
        .send(b"m-3", "dm:ana:ben", "see you")
        .await
        .unwrap()
        .unwrap();

    assert_eq!(late.outcome, "duplicate_unique_key");
    assert_eq!((late.server_id, late.seq), (first.server_id, first.seq));
    assert_eq!(rows(&ana, "dm:ana:ben").await.len(), 1);
    // The late resend refilled the window: the next copy is a window hit.
    let next = ana
        .send(b"m-3", "dm:ana:ben", "see you")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(next.outcome, "duplicate_window");
    h.cluster.shutdown().await;
}

async fn an_id_reused_for_another_message_is_a_final_error_not_a_silent_ack(kind: Kind) {
    let Some(h) = start(kind).await else { return };
    for encoding in [Encoding::Json, Encoding::Protobuf] {
        let ana = h.connect("ana", encoding).await;
        let id = format!("reused-{encoding:?}");
        let first = ana
            .send(id.as_bytes(), "dm:ana:ben", "lunch at one?")
            .await
            .unwrap()
            .unwrap();
        let check_refused =
            |reply: Result<imdedup_client::AckReply, imdedup_client::ErrorReply>| {
                let err = reply.expect_err("a different message under a used id was acknowledged");
                assert_eq!(err.code, "id_reused", "{err:?}");
                assert!(!err.retryable, "{err:?}");
                assert_eq!(err.original, Some((first.server_id, first.seq)), "{err:?}");
            };
        // Another body, then another conversation: both refused, through the
        // window and, once it forgot, through the unique key.
        for round in 0..2 {
            check_refused(
                ana.send(id.as_bytes(), "dm:ana:ben", "dinner?")
                    .await
                    .unwrap(),
            );
            check_refused(
                ana.send(id.as_bytes(), "dm:ana:carl", "lunch at one?")
                    .await
                    .unwrap(),
            );
            // A true resend still gets the original ACK.
            let again = ana
                .send(id.as_bytes(), "dm:ana:ben", "lunch at one?")
                .await
                .unwrap()
                .unwrap();
            assert_eq!((again.server_id, again.seq), (first.server_id, first.seq));
            if round == 0 {
                h.expire_window().await;
            }
        }
        let bodies: Vec<String> = rows(&ana, "dm:ana:ben")
            .await
            .into_iter()
            .filter(|m| m.id == id.as_bytes())
            .map(|m| m.body)
            .collect();
        assert_eq!(bodies, ["lunch at one?"]);
        assert!(rows(&ana, "dm:ana:carl").await.is_empty());
    }
    h.cluster.shutdown().await;
}

async fn simultaneous_copies_through_two_ingest_instances_store_one_row(kind: Kind) {
    let Some(h) = start(kind).await else { return };
    let urls = h.cluster.ingest_urls();
    assert_eq!(urls.len(), 2);
    let mut clients = Vec::new();
    for url in &urls {
        clients.push(IngestServiceClient::connect(url.clone()).await.unwrap());
    }
    let request = |id: String| pb::SendRequest {
        sender: "ana".into(),
        client_msg_id: id.into_bytes(),
        conversation: "race".into(),
        body: "same moment".into(),
        ..Default::default()
    };
    for round in 0..50 {
        let id = format!("race-{round}");
        let (mut a, mut b) = (clients[0].clone(), clients[1].clone());
        let (ra, rb) = tokio::join!(a.send(request(id.clone())), b.send(request(id.clone())));
        // A conversation has one writer: the shard the shard map gives it.
        // The copy at the other shard is refused, retryably, and stores
        // nothing.
        let ack = |r: Result<tonic::Response<pb::SendResponse>, tonic::Status>| match r {
            Ok(reply) => match reply.into_inner().result {
                Some(send_response::Result::Ack(ack)) => Some(ack),
                other => panic!("expected an ack, got {other:?}"),
            },
            Err(status) if status.code() == tonic::Code::Unavailable => None,
            Err(status) => panic!("round {round}: {status:?}"),
        };
        let (ra, rb) = (ack(ra), ack(rb));
        let answered = if ra.is_some() { 0 } else { 1 };
        let mut acks: Vec<pb::Ack> = [ra, rb].into_iter().flatten().collect();
        assert_eq!(
            acks.len(),
            1,
            "round {round}: the shard that does not own the conversation answered"
        );
        // The phone's resend reaches the writer: the same ACK.
        let mut writer = clients[answered].clone();
        acks.extend(ack(writer.send(request(id)).await));
        let [ra, rb] = &acks[..] else {
            panic!("round {round}: the resend was refused")
        };
        assert_eq!(
            (ra.server_id, ra.seq),
            (rb.server_id, rb.seq),
            "round {round}"
        );
        let outcomes = [ra.outcome(), rb.outcome()];
        assert_eq!(
            outcomes
                .iter()
                .filter(|o| **o == pb::Outcome::Stored)
                .count(),
            1,
            "round {round}: exactly one copy is stored, got {outcomes:?}"
        );
    }
    let reader = h.connect("ben", Encoding::Json).await;
    let stored = rows(&reader, "race").await;
    assert_eq!(stored.len(), 50);
    let mut seqs: Vec<u64> = stored.iter().map(|m| m.seq).collect();
    if kind == Kind::Embedded {
        assert_eq!(
            seqs,
            (1..=50).collect::<Vec<_>>(),
            "no seq spent on a repeat"
        );
    } else {
        // Two shards writing one conversation (a failover) each lease their
        // own block of seqs: unique, but not contiguous.
        seqs.dedup();
        assert_eq!(seqs.len(), 50, "seqs are unique");
    }
    h.cluster.shutdown().await;
}

async fn different_messages_are_never_merged(kind: Kind) {
    let Some(h) = start(kind).await else { return };
    let ana = h.connect("ana", Encoding::Json).await;
    let ben = h.connect("ben", Encoding::Json).await;
    let a_b = h.connect("a:b", Encoding::Json).await;
    let a = h.connect("a", Encoding::Json).await;

    // "ok" twice with two IDs is two messages.
    let ok1 = ana.send(b"ok-1", "chat", "ok").await.unwrap().unwrap();
    let ok2 = ana.send(b"ok-2", "chat", "ok").await.unwrap().unwrap();
    // The same ID from two senders is two messages.
    let ana_x = ana
        .send(b"shared-id", "chat", "from ana")
        .await
        .unwrap()
        .unwrap();
    let ben_x = ben
        .send(b"shared-id", "chat", "from ben")
        .await
        .unwrap()
        .unwrap();
    // Sender "a:b" with ID "c" and sender "a" with ID "b:c" never meet.
    let ab_c = a_b.send(b"c", "chat", "one").await.unwrap().unwrap();
    let a_bc = a.send(b"b:c", "chat", "two").await.unwrap().unwrap();
    // IDs are compared exactly: case and padding matter.
    let upper = ana.send(b"ID-1", "chat", "upper").await.unwrap().unwrap();
    let lower = ana.send(b"id-1", "chat", "lower").await.unwrap().unwrap();
    let padded = ana.send(b"id-1 ", "chat", "padded").await.unwrap().unwrap();

    for ack in [
        &ok1, &ok2, &ana_x, &ben_x, &ab_c, &a_bc, &upper, &lower, &padded,
    ] {
        assert_eq!(ack.outcome, "stored", "{ack:?}");
    }
    let stored = rows(&ana, "chat").await;
    assert_eq!(stored.len(), 9);
    let mut server_ids: Vec<u64> = stored.iter().map(|m| m.server_id).collect();
    server_ids.dedup();
    assert_eq!(server_ids.len(), 9);
    h.cluster.shutdown().await;
}

async fn the_sender_comes_from_the_token_not_the_frame(kind: Kind) {
    let Some(h) = start(kind).await else { return };
    let ana = h.connect("ana", Encoding::Json).await;
    ana.send_raw(RawMessage::Text(
        r#"{"type":"send","id":"m1","conversation":"c","body":"hi","sender":"ben"}"#.into(),
    ))
    .await
    .unwrap();
    let Some(Reply::Ack(ack)) = ana.next_unmatched().await else {
        panic!("expected an ack");
    };
    assert_eq!(ack.outcome, "stored");
    let stored = rows(&ana, "c").await;
    assert_eq!(stored[0].sender, "ana");

    // Ben sending the same ID is his own message, not a repeat of Ana's.
    let ben = h.connect("ben", Encoding::Json).await;
    let bens = ben.send(b"m1", "c", "hi").await.unwrap().unwrap();
    assert_eq!(bens.outcome, "stored");
    h.cluster.shutdown().await;
}

async fn binary_protobuf_frames_work_end_to_end(kind: Kind) {
    let Some(h) = start(kind).await else { return };
    let ana = h.connect("ana", Encoding::Protobuf).await;
    let id = [0u8, 0xff, 0x80, 0x7f];
    let first = ana.send(&id, "bin", "hello").await.unwrap().unwrap();
    let again = ana.send(&id, "bin", "hello").await.unwrap().unwrap();
    assert_eq!(first.outcome, "stored");
    assert_eq!(again.outcome, "duplicate_window");
    assert_eq!(again.server_id, first.server_id);

    // A JSON client reading the same history sees the non-UTF-8 ID intact.
    let ben = h.connect("ben", Encoding::Json).await;
    let stored = rows(&ben, "bin").await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].id, id);
    h.cluster.shutdown().await;
}

async fn many_sends_in_flight_on_one_connection_get_unique_increasing_seqs(kind: Kind) {
    let Some(h) = start(kind).await else { return };
    let ana = Arc::new(h.connect("ana", Encoding::Json).await);
    let mut tasks = Vec::new();
    for i in 0..200 {
        let ana = Arc::clone(&ana);
        tasks.push(tokio::spawn(async move {
            let id = format!("m{i}");
            // One hot conversation is written one message at a time; under
            // a burst some sends hit the deadline and, like a phone, resend.
            common::send_until_acked(&ana, id.as_bytes(), "busy", &format!("message {i}")).await
        }));
    }
    let mut acks = Vec::new();
    for task in tasks {
        acks.push(task.await.unwrap());
    }
    let mut seqs: Vec<u64> = acks.iter().map(|a| a.seq).collect();
    seqs.sort_unstable();
    if kind == Kind::Embedded {
        assert_eq!(seqs, (1..=200).collect::<Vec<_>>());
    } else {
        // A send that timed out in the middle of its LWT may leave a gap.
        seqs.dedup();
        assert_eq!(seqs.len(), 200, "unique seqs");
    }
    assert_eq!(rows(&ana, "busy").await.len(), 200, "one row per message");
    // Storage order is seq order: a later server id never has a smaller seq.
    let stored = rows(&ana, "busy").await;
    assert!(stored.windows(2).all(|w| w[0].server_id < w[1].server_id));
    h.cluster.shutdown().await;
}

async fn sends_pipelined_on_one_connection_are_stored_in_send_order(kind: Kind) {
    let Some(h) = start(kind).await else { return };
    let ana = h.connect("ana", Encoding::Json).await;
    // 300 sends written back to back before any ACK comes back, as a
    // phone's outbox does after a reconnect; a second conversation mixed in.
    let planned: Vec<(String, &str, String)> = (0..300)
        .map(|i| {
            let conversation = if i % 3 == 0 { "side" } else { "main" };
            (format!("o{i}"), conversation, i.to_string())
        })
        .collect();
    let sends: Vec<(&[u8], &str, &str)> = planned
        .iter()
        .map(|(id, c, body)| (id.as_bytes(), *c, body.as_str()))
        .collect();
    let replies = ana.send_pipelined(&sends).await.unwrap();
    let acks: Vec<(&str, usize, u64)> = replies
        .into_iter()
        .enumerate()
        .map(|(i, reply)| (planned[i].1, i, reply.unwrap().seq))
        .collect();
    for conversation in ["main", "side"] {
        let seqs: Vec<u64> = acks
            .iter()
            .filter(|(c, _, _)| *c == conversation)
            .map(|(_, _, seq)| *seq)
            .collect();
        let reordered = seqs.windows(2).filter(|w| w[0] >= w[1]).count();
        assert_eq!(reordered, 0, "{conversation}: seqs in send order: {seqs:?}");
        let bodies: Vec<String> = rows(&ana, conversation)
            .await
            .into_iter()
            .map(|m| m.body)
            .collect();
        let sent: Vec<String> = acks
            .iter()
            .filter(|(c, _, _)| *c == conversation)
            .map(|(_, i, _)| i.to_string())
            .collect();
        assert_eq!(bodies, sent, "{conversation}: history in send order");
    }
    h.cluster.shutdown().await;
}

async fn storage_down_gives_a_retryable_error_and_the_resend_is_stored(kind: Kind) {
    let Some(mut h) = start(kind).await else {
        return;
    };
    let ana = h.connect("ana", Encoding::Json).await;
    ana.send(b"before", "c", "stored first")
        .await
        .unwrap()
        .unwrap();

    h.break_storage().await;
    let err = ana
        .send(b"m-2", "c", "while down")
        .await
        .unwrap()
        .unwrap_err();
    assert!(err.retryable, "{err:?}");
    assert!(
        // A failed LWT's outcome is unknown to the store: maybe stored.
        ["unavailable", "maybe_stored", "deadline_exceeded"].contains(&err.code.as_str()),
        "{err:?}"
    );

    h.repair_storage().await;
    // The failed send did not enter the window: the resend is stored.
    let ack = ana.send(b"m-2", "c", "while down").await.unwrap().unwrap();
    assert_eq!(ack.outcome, "stored");
    let stored = rows(&ana, "c").await;
    assert_eq!(stored.len(), 2);
    assert!(stored[1].seq > stored[0].seq);
    if kind == Kind::Embedded {
        // SQLite rolls the failed transaction back; a failed LWT whose
        // outcome is unknown may leave a gap (harmless to range pulls).
        assert_eq!(stored[1].seq, 2);
    }
    h.cluster.shutdown().await;
}

async fn after_a_storage_restart_earlier_messages_are_still_caught(kind: Kind) {
    let Some(mut h) = start(kind).await else {
        return;
    };
    let ana = h.connect("ana", Encoding::Json).await;
    let first = ana.send(b"m-1", "c", "hello").await.unwrap().unwrap();

    h.cluster.restart_storage().await.unwrap();
    h.expire_window().await;
    // The ingest's link to storage may still be the old connection: its
    // first call then fails retryably (maybe_stored), and the phone resends.
    let again = common::send_until_acked(&ana, b"m-1", "c", "hello").await;

    assert_eq!(again.outcome, "duplicate_unique_key");
    assert_eq!((again.server_id, again.seq), (first.server_id, first.seq));
    assert_eq!(rows(&ana, "c").await.len(), 1);
    h.cluster.shutdown().await;
}

/// Ingest and storage restarted in the middle of sending: what was stored
/// stays stored and recognised, and seqs keep increasing.
async fn a_whole_cluster_restart_keeps_the_messages_and_the_guarantee(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new();
    let Some(options) = common::options(kind, &dir, &clock) else {
        return;
    };
    let cluster = LocalCluster::start(options.clone()).await.unwrap();
    let token = cluster.token("ana").unwrap();
    let ana = Client::connect(&cluster.gateway_url(), &token, Encoding::Json)
        .await
        .unwrap();
    let first = ana.send(b"m-1", "c", "hello").await.unwrap().unwrap();
    drop(ana);
    cluster.shutdown().await;

    let cluster = LocalCluster::start(options).await.unwrap();
    let ana = Client::connect(&cluster.gateway_url(), &token, Encoding::Json)
        .await
        .unwrap();
    let again = ana.send(b"m-1", "c", "hello").await.unwrap().unwrap();
    // The in-process window starts empty; Redis outlives the restart.
    let expected = match kind {
        Kind::Embedded => "duplicate_unique_key",
        Kind::Real => "duplicate_window",
    };
    assert_eq!(again.outcome, expected);
    assert_eq!((again.server_id, again.seq), (first.server_id, first.seq));
    let next = ana.send(b"m-2", "c", "next").await.unwrap().unwrap();
    assert!(
        next.seq > first.seq,
        "seqs keep increasing across a restart"
    );
    if kind == Kind::Embedded {
        assert_eq!(next.seq, 2, "the embedded store allocates without gaps");
    }
    let stored = rows(&ana, "c").await;
    assert_eq!(stored.len(), 2);
    cluster.shutdown().await;
}

on_both_backends!(
    a_resend_after_a_lost_ack_gets_the_same_ack_and_stores_one_row,
    a_resend_after_the_window_is_caught_by_the_unique_key,
    simultaneous_copies_through_two_ingest_instances_store_one_row,
    different_messages_are_never_merged,
    an_id_reused_for_another_message_is_a_final_error_not_a_silent_ack,
    the_sender_comes_from_the_token_not_the_frame,
    binary_protobuf_frames_work_end_to_end,
    many_sends_in_flight_on_one_connection_get_unique_increasing_seqs,
    sends_pipelined_on_one_connection_are_stored_in_send_order,
    storage_down_gives_a_retryable_error_and_the_resend_is_stored,
    after_a_storage_restart_earlier_messages_are_still_caught,
    a_whole_cluster_restart_keeps_the_messages_and_the_guarantee,
);

/// Gateways before the hops became streams send in `SendBatch` calls (a
/// rolling upgrade has them talk to new shards for a while): a shard still
/// answers each send by its tag, stores each message once and gives a
/// repeat the first ACK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_batch_from_an_earlier_gateway_is_answered_by_tag_and_stored_once() {
    let Some(h) = start(Kind::Embedded).await else {
        return;
    };
    let url = h.cluster.owner_ingest_url("batch").unwrap();
    let client = IngestServiceClient::connect(url).await.unwrap();
    let send = |id: &str, tag: u64| pb::SendRequest {
        sender: "ana".into(),
        client_msg_id: id.as_bytes().to_vec(),
        conversation: "batch".into(),
        body: format!("body of {id}"),
        tag,
        ..Default::default()
    };
    let call = |sends: Vec<pb::SendRequest>| {
        let mut client = client.clone();
        async move {
            let mut answers = client
                .send_batch(pb::SendBatchRequest { sends })
                .await
                .unwrap()
                .into_inner();
            let mut acks = std::collections::HashMap::new();
            while let Some(answer) = answers.message().await.unwrap() {
                match answer.result {
                    Some(send_response::Result::Ack(ack)) => acks.insert(answer.tag, ack),
                    other => panic!("tag {}: expected an ack, got {other:?}", answer.tag),
                };
            }
            acks
        }
    };
    let first = call(vec![send("b-1", 7), send("b-2", 8)]).await;
    assert_eq!(first.len(), 2);
    assert!(first.values().all(|a| a.outcome() == pb::Outcome::Stored));
    assert_ne!(first[&7].server_id, first[&8].server_id);
    let again = call(vec![send("b-1", 3)]).await;
    assert_eq!(
        (again[&3].server_id, again[&3].seq),
        (first[&7].server_id, first[&7].seq),
        "the repeat gets the first ACK"
    );
    assert_ne!(again[&3].outcome(), pb::Outcome::Stored);
    let reader = h.connect("ben", Encoding::Json).await;
    assert_eq!(rows(&reader, "batch").await.len(), 2);
    h.cluster.shutdown().await;
}

/// Ingests before the hops became streams insert in `InsertBatch` calls:
/// storage still answers each insert by its index, and a repeat with the
/// stored row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_batch_from_an_earlier_ingest_is_answered_by_index_and_stored_once() {
    let Some(h) = start(Kind::Embedded).await else {
        return;
    };
    let mut client = StorageServiceClient::connect(h.cluster.storage_url())
        .await
        .unwrap();
    let insert = |id: &str| pb::InsertOnceRequest {
        sender: "ana".into(),
        client_msg_id: id.as_bytes().to_vec(),
        conversation: "batch".into(),
        body: format!("body of {id}"),
        ..Default::default()
    };
    let mut answers = client
        .insert_batch(pb::InsertBatchRequest {
            inserts: vec![insert("i-1"), insert("i-2"), insert("i-1")],
        })
        .await
        .unwrap()
        .into_inner();
    let mut rows_by_index = std::collections::BTreeMap::new();
    while let Some(answer) = answers.message().await.unwrap() {
        match answer.result {
            Some(insert_result::Result::Ok(ok)) => {
                let row = ok.message.unwrap();
                rows_by_index.insert(answer.index, (ok.inserted, row.server_id, row.seq));
            }
            other => panic!("index {}: {other:?}", answer.index),
        }
    }
    assert_eq!(rows_by_index.len(), 3, "every insert answered once");
    let (first, second, repeat) = (rows_by_index[&0], rows_by_index[&1], rows_by_index[&2]);
    // The two copies of i-1: one stored it, the other got the same row.
    assert!(first.0 != repeat.0, "exactly one copy of i-1 inserted");
    assert_eq!((first.1, first.2), (repeat.1, repeat.2));
    assert!(second.0);
    assert_ne!(second.1, first.1);
    let reader = h.connect("ben", Encoding::Json).await;
    assert_eq!(rows(&reader, "batch").await.len(), 2);
    h.cluster.shutdown().await;
}

/// The cluster's shards build their Redis window as `imdedup ingest` does:
/// a Redis that cannot be reached when the cluster starts does not stop it.
/// Sends are answered from the unique key, each counted as a bypass, and a
/// resend still gets the original ACK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_started_while_redis_is_unreachable_serves_with_the_window_bypassed() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new();
    let Some(mut options) = common::options(Kind::Real, &dir, &clock) else {
        return;
    };
    let imdedup_cluster::Backends::Real { redis, .. } = &mut options.backends else {
        unreachable!("real backends asked for");
    };
    // A loopback port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    redis.urls = vec![format!("redis://{}", closed.local_addr().unwrap())];
    drop(closed);
    let cluster = LocalCluster::start(options).await.unwrap();
    let ana = common::connect(&cluster, "ana", Encoding::Json).await;
    let first = ana.send(b"nr-1", "c", "hi").await.unwrap().unwrap();
    let again = ana.send(b"nr-1", "c", "hi").await.unwrap().unwrap();
    assert_eq!(first.outcome, "stored");
    assert_eq!(again.outcome, "duplicate_unique_key");
    assert_eq!((again.server_id, again.seq), (first.server_id, first.seq));
    assert_eq!(cluster.dedup_counts().window_bypassed, 2);
    assert_eq!(rows(&ana, "c").await.len(), 1);
    cluster.shutdown().await;
}
