//! What readers and writers see on the ScyllaDB store while writes fail,
//! writers change and the layout is upgraded: a cursor never passes a seq
//! that may still appear, one conversation has one writer at a time, and a
//! key is recognised whatever slot or table it is in.

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
async fn a_message_answered_maybe_stored_is_readable_in_order_and_its_resend_gets_its_receipt() {
    let Some(options) = scylla_options() else {
        return;
    };
    let faults = options.faults.clone();
    let store = ScyllaStore::open(options).await.unwrap();
    // A is stored with its key; the write after (its global row) fails.
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
    // A follower sees both, A first: A's history row was written with its
    // key, in one round.
    let rows = store.history(&history("c", 0)).await.unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!((rows[0].body.as_str(), &rows[1]), ("A", b.message()));
    // Only a lookup by key misses A until it is resent.
    assert_eq!(store.lookup(&rows[0].key).await.unwrap(), None);

    // The phone resends A: the receipt it was stored with.
    let a = store
        .insert_once(message("ana", "a", "c", "A"))
        .await
        .unwrap();
    assert_eq!(a, Insert::AlreadyStored(rows[0].clone()));
    assert_eq!(
        store.lookup(&rows[0].key).await.unwrap(),
        Some(rows[0].clone())
    );
    assert_eq!(store.history(&history("c", 0)).await.unwrap(), rows);
}

/// A batch whose answer never came may still reach a server later. It
/// lands only if nothing was written after it (the conversation's
/// `last_seq` condition): before the next message, it is kept in order;
/// after it, never, so it cannot appear behind a follower's cursor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_reaches_the_database_late_never_lands_behind_a_later_message() {
    let Some(options) = scylla_options() else {
        return;
    };
    let options = quick(options, "ingest-0");
    let faults = options.faults.clone();
    let store = ScyllaStore::open(options.clone()).await.unwrap();
    let bodies = |rows: &[StoredMessage]| rows.iter().map(|r| r.body.clone()).collect::<Vec<_>>();

    // Late past the next message: A's batch gets no answer and reaches the
    // database a second later, after B was stored at once.
    faults.delay_next_batch(Duration::from_secs(1));
    let err = store
        .insert_once(message("ana", "a", "c1", "A"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::MaybeStored, "{err}");
    let b = store
        .insert_once(message("ben", "b", "c1", "B"))
        .await
        .unwrap();
    let read = store.history(&history("c1", 0)).await.unwrap();
    assert_eq!(bodies(&read), ["B"]);
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(
        store.history(&history("c1", 0)).await.unwrap(),
        read,
        "A's late batch did not land behind B, which a follower has read"
    );
    // A's resend stores it, after B.
    let a = store
        .insert_once(message("ana", "a", "c1", "A"))
        .await
        .unwrap();
    assert!(matches!(a, Insert::Stored(_)), "{a:?}");
    assert!(a.message().receipt.seq > b.message().receipt.seq);
    let rows = store.history(&history("c1", 0)).await.unwrap();
    assert_eq!(bodies(&rows), ["B", "A"]);

    // Late but before the next message: it lands, in order, and its
    // resend gets the receipt it was stored with.
    faults.delay_next_batch(Duration::from_millis(100));
    store
        .insert_once(message("ana", "a", "c2", "A"))
        .await
        .unwrap_err();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let b = store
        .insert_once(message("ben", "b", "c2", "B"))
        .await
        .unwrap();
    let rows = store.history(&history("c2", 0)).await.unwrap();
    assert_eq!(bodies(&rows), ["A", "B"]);
    assert_eq!(rows[1], *b.message());
    let a = store
        .insert_once(message("ana", "a", "c2", "A"))
        .await
        .unwrap();
    assert_eq!(a, Insert::AlreadyStored(rows[0].clone()));
}

/// Pending history rows are no longer written, but an older version's may
/// still be in a keyspace it used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_settles_an_older_versions_pending_row_once_the_fence_passes() {
    let Some(options) = scylla_options() else {
        return;
    };
    let options = quick(options, "ingest-0");
    let store = ScyllaStore::open(options.clone()).await.unwrap();
    let b = store
        .insert_once(message("ben", "b", "c", "B"))
        .await
        .unwrap();
    let now = b.message().stored_at_ms;
    // As an older version left them: A's key stored and its history row
    // pending (its commit lost), then a pending row whose LWT never ran.
    let session = imdedup_storage::scylla::connect(&options).await.unwrap();
    let ks = &options.keyspace;
    for cql in [
        format!(
            "INSERT INTO {ks}.messages_by_key \
             (sender, client_msg_id, conversation, seq, server_id, body, stored_at_ms) \
             VALUES ('ana', 0x61, 'c', 1000, 98, 'A', {now})"
        ),
        format!(
            "INSERT INTO {ks}.messages_by_conversation \
             (conversation, seq, sender, client_msg_id, server_id, body, stored_at_ms, pending) \
             VALUES ('c', 1000, 'ana', 0x61, 98, 'A', {now}, true)"
        ),
        format!(
            "INSERT INTO {ks}.messages_by_conversation \
             (conversation, seq, sender, client_msg_id, server_id, body, stored_at_ms, pending) \
             VALUES ('c', 1001, 'cy', 0x7a, 99, 'never stored', {now}, true)"
        ),
    ] {
        session.query_unpaged(cql, ()).await.unwrap();
    }
    // Readers stop before A: its writer may still be at it.
    assert_eq!(
        store.history(&history("c", 0)).await.unwrap(),
        vec![b.message().clone()]
    );

    tokio::time::sleep(options.pending_fence + Duration::from_millis(500)).await;
    let rows = store.history(&history("c", 0)).await.unwrap();
    assert_eq!(
        seqs(&rows),
        [b.message().receipt.seq, 1000],
        "A settled and shown, the orphan skipped"
    );
    assert_eq!(rows[1].body, "A");
    // Settled for good: the same answer again, without waiting.
    assert_eq!(store.history(&history("c", 0)).await.unwrap(), rows);
}

/// A keyspace used by a version that kept every key in `messages_by_key`:
/// until the horizon, a resend of a message stored then is recognised.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_stored_before_keys_moved_into_conversations_are_recognised_until_the_horizon() {
    let Some(options) = scylla_options() else {
        return;
    };
    let ks = &options.keyspace;
    let session = imdedup_storage::scylla::connect(&options).await.unwrap();
    // The older layout, with one message in it.
    for cql in [
        format!(
            "CREATE KEYSPACE {ks} WITH replication = \
             {{'class': 'NetworkTopologyStrategy', 'replication_factor': 1}}"
        ),
        format!(
            "CREATE TABLE {ks}.messages_by_key (sender text, client_msg_id blob, \
             conversation text, seq bigint, server_id bigint, body text, stored_at_ms bigint, \
             PRIMARY KEY ((sender, client_msg_id)))"
        ),
        format!(
            "INSERT INTO {ks}.messages_by_key \
             (sender, client_msg_id, conversation, seq, server_id, body, stored_at_ms) \
             VALUES ('ana', 0x6f6c64, 'c', 7, 70, 'old', 1)"
        ),
    ] {
        session.query_unpaged(cql, ()).await.unwrap();
    }
    let store = ScyllaStore::open(options.clone()).await.unwrap();
    let resent = store
        .insert_once(message("ana", "old", "c", "old"))
        .await
        .unwrap();
    let Insert::AlreadyStored(original) = resent else {
        panic!("a message stored before the upgrade was stored again: {resent:?}")
    };
    assert_eq!((original.receipt.server_id, original.receipt.seq), (70, 7));
    // Its history row, lost in a crash of the older version, is written
    // again by the resend.
    assert_eq!(
        store.history(&history("c", 0)).await.unwrap(),
        vec![original.clone()]
    );
    // Its ID reused for another conversation: the original comes back
    // (the ingest answers `id_reused`).
    let reused = store
        .insert_once(message("ana", "old", "d", "other"))
        .await
        .unwrap();
    assert_eq!(reused, Insert::AlreadyStored(original.clone()));
    // New messages are stored as usual, and recognised in their
    // conversation.
    let new = store
        .insert_once(message("ana", "new", "c", "new"))
        .await
        .unwrap();
    assert!(matches!(new, Insert::Stored(_)), "{new:?}");
    assert_eq!(
        store
            .insert_once(message("ana", "new", "c", "new"))
            .await
            .unwrap(),
        Insert::AlreadyStored(new.message().clone())
    );
    drop(store);

    // Past the horizon the old table is not read: the old message's ID is
    // free in its conversation's partition.
    let mut past = options;
    past.legacy_key_horizon = Duration::ZERO;
    past.member_name = "past-the-horizon".to_owned();
    let store = ScyllaStore::open(past).await.unwrap();
    let after = store
        .insert_once(message("ana", "old", "e", "old"))
        .await
        .unwrap();
    assert!(matches!(after, Insert::Stored(_)), "{after:?}");
}

/// Two keys whose slots collide are two messages, each recognised again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_that_share_a_slot_stay_apart() {
    let Some(options) = scylla_options() else {
        return;
    };
    options.faults.collide_key_slots();
    let store = ScyllaStore::open(options).await.unwrap();
    let mut stored = Vec::new();
    for (sender, id) in [("ana", "m1"), ("ben", "m1"), ("ana", "m2")] {
        let insert = store
            .insert_once(message(sender, id, "c", &format!("{sender} {id}")))
            .await
            .unwrap();
        let Insert::Stored(row) = insert else {
            panic!("{sender}/{id} merged with another key: {insert:?}")
        };
        stored.push(row);
    }
    assert_eq!(seqs(&stored), [1, 2, 3]);
    for row in &stored {
        let again = store
            .insert_once(message(
                row.key.sender.as_str(),
                std::str::from_utf8(row.key.client_msg_id.as_bytes()).unwrap(),
                "c",
                &row.body,
            ))
            .await
            .unwrap();
        assert_eq!(again, Insert::AlreadyStored(row.clone()));
    }
    // An ID reused for other content: the original, body and all, comes
    // back (read from its history row).
    let reused = store
        .insert_once(message("ana", "m2", "c", "something else"))
        .await
        .unwrap();
    assert_eq!(reused, Insert::AlreadyStored(stored[2].clone()));
    assert_eq!(store.history(&history("c", 0)).await.unwrap(), stored);
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
