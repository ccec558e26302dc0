//! The store contract, checked against every backend: insert once, echo the
//! original row on repeats, unique increasing seqs that repeats never spend,
//! history in seq order, durability across a reopen.

use std::sync::Arc;

use imdedup_domain::store::{Insert, MessageStore};
use imdedup_storage::{ScyllaStore, SqliteOptions, SqliteStore};

mod common;
use common::{history, message, scylla_options};

async fn inserts_once_and_echoes_the_original(store: Arc<dyn MessageStore>, tag: &str) {
    let conv = format!("{tag}-once");
    let first = store
        .insert_once(message("ana", "m1", &conv, "hello"))
        .await
        .unwrap();
    let Insert::Stored(row) = first else {
        panic!("first insert must store")
    };
    let again = store
        .insert_once(message("ana", "m1", &conv, "hello"))
        .await
        .unwrap();
    assert_eq!(again, Insert::AlreadyStored(row.clone()));
    assert_eq!(store.lookup(&row.key).await.unwrap(), Some(row.clone()));
    assert_eq!(store.history(&history(&conv, 0)).await.unwrap(), vec![row]);
}

async fn repeats_never_spend_a_seq(store: Arc<dyn MessageStore>, tag: &str) {
    let conv = format!("{tag}-seq");
    let mut seqs = Vec::new();
    for id in ["a", "b", "a", "c", "b", "d"] {
        let insert = store
            .insert_once(message("ana", &format!("{conv}-{id}"), &conv, id))
            .await
            .unwrap();
        if let Insert::Stored(row) = insert {
            seqs.push(row.receipt.seq);
        }
    }
    assert_eq!(seqs, [1, 2, 3, 4]);
    let rows = store.history(&history(&conv, 2)).await.unwrap();
    let bodies: Vec<&str> = rows.iter().map(|r| r.body.as_str()).collect();
    assert_eq!(bodies, ["c", "d"], "history after seq 2, in seq order");
}

async fn concurrent_copies_store_one_row(store: Arc<dyn MessageStore>, tag: &str) {
    let conv = format!("{tag}-race");
    let mut tasks = Vec::new();
    for copy in 0..32 {
        let store = Arc::clone(&store);
        let conv = conv.clone();
        tasks.push(tokio::spawn(async move {
            // 4 messages, 8 copies of each, all at once.
            let id = format!("{conv}-m{}", copy % 4);
            store
                .insert_once(message("ana", &id, &conv, &id))
                .await
                .unwrap()
        }));
    }
    let mut stored = 0;
    let mut receipts = std::collections::HashMap::new();
    for task in tasks {
        let insert = task.await.unwrap();
        if matches!(insert, Insert::Stored(_)) {
            stored += 1;
        }
        let row = insert.message().clone();
        let first = receipts.entry(row.key.clone()).or_insert(row.receipt);
        assert_eq!(*first, row.receipt, "every copy gets the same receipt");
    }
    assert_eq!(stored, 4);
    assert_eq!(store.history(&history(&conv, 0)).await.unwrap().len(), 4);
}

async fn keys_are_sender_and_id(store: Arc<dyn MessageStore>, tag: &str) {
    let conv = format!("{tag}-keys");
    for (sender, id) in [
        ("ana", "x"),
        ("ben", "x"),
        ("a:b", "c"),
        ("a", "b:c"),
        ("ana", "X"),
    ] {
        let id = format!("{id}-{conv}");
        let insert = store
            .insert_once(message(sender, &id, &conv, "ok"))
            .await
            .unwrap();
        assert!(
            matches!(insert, Insert::Stored(_)),
            "{sender}/{id} is a new message"
        );
    }
    assert_eq!(store.history(&history(&conv, 0)).await.unwrap().len(), 5);
}

/// Callers that give up mid-insert (deadlines) never make two messages
/// share a seq, and every message is readable once its resend is ACKed.
async fn abandoned_inserts_never_share_a_seq(store: Arc<dyn MessageStore>, tag: &str) {
    let conv = format!("{tag}-abandoned");
    let mut tasks = Vec::new();
    for i in 0..40u64 {
        let store = Arc::clone(&store);
        let conv = conv.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("{conv}-{i}");
            // Give up after 0 to 7 ms: some inserts are cut off midway.
            let _ = tokio::time::timeout(
                std::time::Duration::from_millis(i % 8),
                store.insert_once(message("ana", &id, &conv, &id)),
            )
            .await;
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    // Every phone resends until ACKed.
    for i in 0..40u64 {
        let id = format!("{conv}-{i}");
        store
            .insert_once(message("ana", &id, &conv, &id))
            .await
            .unwrap();
    }
    let rows = store.history(&history(&conv, 0)).await.unwrap();
    assert_eq!(rows.len(), 40, "every message readable, none twice");
    let mut bodies: Vec<&str> = rows.iter().map(|r| r.body.as_str()).collect();
    bodies.sort_unstable();
    bodies.dedup();
    assert_eq!(bodies.len(), 40);
    assert!(rows.windows(2).all(|w| w[0].receipt.seq < w[1].receipt.seq));
}

async fn conforms(store: Arc<dyn MessageStore>, tag: &str) {
    abandoned_inserts_never_share_a_seq(Arc::clone(&store), tag).await;
    inserts_once_and_echoes_the_original(Arc::clone(&store), tag).await;
    repeats_never_spend_a_seq(Arc::clone(&store), tag).await;
    concurrent_copies_store_one_row(Arc::clone(&store), tag).await;
    keys_are_sender_and_id(store, tag).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&SqliteOptions::new(dir.path().join("m.db"))).unwrap();
    conforms(Arc::new(store), "sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_keeps_rows_and_the_unique_key_across_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteOptions::new(dir.path().join("m.db"));
    let first = {
        let store = SqliteStore::open(&options).unwrap();
        store
            .insert_once(message("ana", "m1", "c", "hi"))
            .await
            .unwrap()
    };
    let store = SqliteStore::open(&options).unwrap();
    let again = store
        .insert_once(message("ana", "m1", "c", "hi"))
        .await
        .unwrap();
    assert_eq!(again, Insert::AlreadyStored(first.message().clone()));
    let next = store
        .insert_once(message("ana", "m2", "c", "next"))
        .await
        .unwrap();
    assert_eq!(next.message().receipt.seq, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_reports_an_unusable_path_as_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let err = SqliteStore::open(&SqliteOptions::new(file.join("m.db")))
        .err()
        .unwrap();
    assert!(err.message().contains("cannot"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scylla_conforms() {
    let Some(options) = scylla_options() else {
        return;
    };
    let store = ScyllaStore::open(options).await.unwrap();
    conforms(Arc::new(store), "scylla").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scylla_migration_is_idempotent_and_seqs_survive_a_restart() {
    let Some(options) = scylla_options() else {
        return;
    };
    let first = ScyllaStore::open(options.clone()).await.unwrap();
    let a = first
        .insert_once(message("ana", "m1", "c", "one"))
        .await
        .unwrap();
    // A clean restart: drained, then migrate again, new process state, new
    // lease.
    first.drain().await;
    drop(first);
    let second = ScyllaStore::open(options).await.unwrap();
    let again = second
        .insert_once(message("ana", "m1", "c", "one"))
        .await
        .unwrap();
    assert_eq!(again, Insert::AlreadyStored(a.message().clone()));
    let b = second
        .insert_once(message("ana", "m2", "c", "two"))
        .await
        .unwrap();
    assert!(
        b.message().receipt.seq > a.message().receipt.seq,
        "a seq is never reused"
    );
    assert_ne!(b.message().receipt.server_id, a.message().receipt.server_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scylla_a_resend_repairs_a_history_row_lost_in_a_crash() {
    let Some(options) = scylla_options() else {
        return;
    };
    let store = ScyllaStore::open(options.clone()).await.unwrap();
    let first = store
        .insert_once(message("ana", "m1", "c", "hi"))
        .await
        .unwrap();
    // The crash: the unique-key row is there, the history row is not.
    let session = imdedup_storage::scylla::connect(&options).await.unwrap();
    session
        .query_unpaged(
            format!(
                "DELETE FROM {}.messages_by_conversation WHERE conversation = 'c'",
                options.keyspace
            ),
            (),
        )
        .await
        .unwrap();
    assert!(store.history(&history("c", 0)).await.unwrap().is_empty());

    let again = store
        .insert_once(message("ana", "m1", "c", "hi"))
        .await
        .unwrap();
    assert_eq!(again, Insert::AlreadyStored(first.message().clone()));
    assert_eq!(
        store.history(&history("c", 0)).await.unwrap(),
        vec![first.message().clone()]
    );
}
