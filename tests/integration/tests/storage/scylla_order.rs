//! What readers see on the ScyllaDB store while writes fail and writers
//! change: a cursor never passes a seq that may still appear, and one
//! conversation has one writer at a time.

use std::{sync::Arc, time::Duration};

use imdedup_domain::{
    ErrorKind,
    model::StoredMessage,
    store::{Insert, MessageStore},
};
use imdedup_storage::{ScyllaOptions, ScyllaStore};

use super::common;
use common::{history, message, scylla_options};

fn seqs(rows: &[StoredMessage]) -> Vec<u64> {
    rows.iter().map(|r| r.receipt.seq).collect()
}

/// Short timings, so fences pass within a test.
fn quick(mut options: ScyllaOptions, name: &str) -> ScyllaOptions {
    options.member_name = name.to_owned();
    options.request_timeout = Duration::from_secs(1);
    options.member_ttl = Duration::from_secs(2);
    options.clock_skew = Duration::ZERO;
    options.pending_fence = Duration::from_secs(7);
    options
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_never_passes_a_message_whose_publication_failed() {
    let Some(options) = scylla_options() else {
        return;
    };
    let faults = options.faults.clone();
    let store = ScyllaStore::open(options).await.unwrap();
    // A's unique key is stored; the write that publishes it fails.
    faults.fail_next_commits(1);
    let err = store
        .insert_once(message("ana", "a", "c", "A"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::MaybeStored, "{err}");
    assert!(err.retryable());
    // B, sent after, is stored and ACKed with a larger seq.
    let b = store
        .insert_once(message("ben", "b", "c", "B"))
        .await
        .unwrap();
    assert!(matches!(b, Insert::Stored(_)));
    // A follower must not see B yet: its cursor would pass A.
    assert_eq!(store.history(&history("c", 0)).await.unwrap(), vec![]);

    // The phone resends A: the same receipt, and now both, in order.
    let a = store
        .insert_once(message("ana", "a", "c", "A"))
        .await
        .unwrap();
    let Insert::AlreadyStored(a) = a else {
        panic!("A was stored by its first try: {a:?}")
    };
    assert!(a.receipt.seq < b.message().receipt.seq);
    assert_eq!(
        store.history(&history("c", 0)).await.unwrap(),
        vec![a, b.message().clone()]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_settles_a_row_nobody_resends_once_the_fence_passes() {
    let Some(options) = scylla_options() else {
        return;
    };
    let options = quick(options, "ingest-0");
    let faults = options.faults.clone();
    let store = ScyllaStore::open(options.clone()).await.unwrap();
    faults.fail_next_commits(1);
    store
        .insert_once(message("ana", "a", "c", "A"))
        .await
        .unwrap_err();
    let b = store
        .insert_once(message("ben", "b", "c", "B"))
        .await
        .unwrap();
    // A pending row whose LWT never ran (its writer died between the two):
    // its key is not stored, so it must be skipped, never shown.
    let session = imdedup_storage::scylla::connect(&options).await.unwrap();
    session
        .query_unpaged(
            format!(
                "INSERT INTO {}.messages_by_conversation \
                 (conversation, seq, sender, client_msg_id, server_id, body, stored_at_ms, pending) \
                 VALUES ('c', 1000, 'cy', 0x7a, 99, 'never stored', ?, true)",
                options.keyspace
            ),
            (b.message().stored_at_ms,),
        )
        .await
        .unwrap();
    assert!(store.history(&history("c", 0)).await.unwrap().is_empty());

    tokio::time::sleep(options.pending_fence + Duration::from_millis(500)).await;
    let rows = store.history(&history("c", 0)).await.unwrap();
    assert_eq!(
        seqs(&rows).len(),
        2,
        "A settled and shown, the orphan skipped"
    );
    assert_eq!(rows[0].body, "A");
    assert_eq!(rows[1], *b.message());
    // Settled for good: the same answer again, without waiting.
    assert_eq!(store.history(&history("c", 0)).await.unwrap(), rows);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeats_leave_no_gap_and_a_conversation_has_one_writer_until_it_leaves() {
    let Some(options) = scylla_options() else {
        return;
    };
    let one = ScyllaStore::open(quick(options.clone(), "ingest-0"))
        .await
        .unwrap();
    let first = one
        .insert_once(message("ana", "m1", "c", "one"))
        .await
        .unwrap();
    // A repeat that reaches the LWT gives its seq back.
    one.insert_once(message("ana", "m1", "c", "one"))
        .await
        .unwrap();
    let second = one
        .insert_once(message("ana", "m2", "c", "two"))
        .await
        .unwrap();
    assert_eq!(
        second.message().receipt.seq,
        first.message().receipt.seq + 1
    );

    // Another process (a new shard map gave it the conversation) must not
    // write while the owner lives: its seqs would interleave.
    let mut migrated = quick(options, "ingest-1");
    migrated.migrate = false;
    let two = ScyllaStore::open(migrated).await.unwrap();
    let refused = two
        .insert_once(message("ana", "m3", "c", "three"))
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unavailable, "{refused}");
    assert!(refused.retryable());
    assert!(refused.message().contains("ingest-0"), "{refused}");
    // Another conversation is free for it.
    two.insert_once(message("ana", "d1", "d", "elsewhere"))
        .await
        .unwrap();

    // The owner shuts down cleanly: the new one takes over at once, past
    // every seq the old one leased.
    one.drain().await;
    let third = two
        .insert_once(message("ana", "m3", "c", "three"))
        .await
        .unwrap();
    assert!(third.message().receipt.seq > second.message().receipt.seq);
    let rows = two.history(&history("c", 0)).await.unwrap();
    let bodies: Vec<&str> = rows.iter().map(|r| r.body.as_str()).collect();
    assert_eq!(bodies, ["one", "two", "three"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_owner_is_taken_over_once_its_membership_runs_out() {
    let Some(options) = scylla_options() else {
        return;
    };
    let options = quick(options, "ingest-0");
    let one = Arc::new(ScyllaStore::open(options.clone()).await.unwrap());
    let first = one
        .insert_once(message("ana", "m1", "c", "one"))
        .await
        .unwrap();
    // A crash: no relinquishing, the heartbeats stop.
    drop(one);
    let mut other = options.clone();
    other.member_name = "ingest-1".into();
    let two = ScyllaStore::open(other).await.unwrap();
    let refused = two
        .insert_once(message("ana", "m2", "c", "two"))
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unavailable, "{refused}");

    // The heartbeat's TTL plus the grace, then the conversation is free.
    tokio::time::sleep(options.member_ttl + options.handover_grace() + Duration::from_millis(500))
        .await;
    let second = two
        .insert_once(message("ana", "m2", "c", "two"))
        .await
        .unwrap();
    assert!(second.message().receipt.seq > first.message().receipt.seq);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_restarted_under_its_name_takes_its_conversations_back_after_the_grace() {
    let Some(options) = scylla_options() else {
        return;
    };
    let mut options = quick(options, "ingest-0");
    // Long heartbeats: only the same-name rule can hand over in time.
    options.member_ttl = Duration::from_secs(60);
    let one = ScyllaStore::open(options.clone()).await.unwrap();
    let first = one
        .insert_once(message("ana", "m1", "c", "one"))
        .await
        .unwrap();
    drop(one); // SIGKILL
    let restarted = ScyllaStore::open(options.clone()).await.unwrap();
    // Up for less than the grace: the old process's last writes may not
    // have ended yet.
    let early = restarted
        .insert_once(message("ana", "m2", "c", "two"))
        .await
        .unwrap_err();
    assert_eq!(early.kind(), ErrorKind::Unavailable, "{early}");
    tokio::time::sleep(options.handover_grace()).await;
    let second = restarted
        .insert_once(message("ana", "m2", "c", "two"))
        .await
        .unwrap();
    assert!(second.message().receipt.seq > first.message().receipt.seq);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_leased_before_owners_existed_is_taken_over() {
    let Some(options) = scylla_options() else {
        return;
    };
    let store = ScyllaStore::open(options.clone()).await.unwrap();
    // A lease row as an older release wrote it: no owner.
    let session = imdedup_storage::scylla::connect(&options).await.unwrap();
    session
        .query_unpaged(
            format!(
                "INSERT INTO {}.leases (scope, name, next_free) VALUES ('seq', 'old', 50)",
                options.keyspace
            ),
            (),
        )
        .await
        .unwrap();
    let row = store
        .insert_once(message("ana", "m1", "old", "hi"))
        .await
        .unwrap();
    assert_eq!(row.message().receipt.seq, 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timings_under_which_a_fence_cannot_hold_are_refused() {
    let mut options = ScyllaOptions::single_node(vec!["127.0.0.1:1".into()]);
    options.pending_fence = Duration::from_secs(3);
    let err = ScyllaStore::open(options.clone()).await.err().unwrap();
    assert!(err.message().contains("pending fence"), "{err}");
    options.pending_fence = Duration::from_secs(30);
    options.member_ttl = Duration::from_secs(1);
    let err = ScyllaStore::open(options).await.err().unwrap();
    assert!(err.message().contains("membership TTL"), "{err}");
}
