//! The store contract, for every `MessageStore`: insert once and echo the
//! original row on repeats, unique increasing seqs that repeats never
//! spend, history in seq order, keys that are (sender, ID), and no two
//! messages sharing a seq when callers give up midway. Each backend's tests
//! run [`conforms`] on it, and so does the storage service reached over
//! gRPC.

use std::sync::Arc;

use imdedup_domain::store::{Insert, MessageStore};

use crate::fixtures::{history, message};

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

/// Run every check on `store`, in conversations named after `tag` (unique
/// per run on a shared database).
pub async fn conforms(store: Arc<dyn MessageStore>, tag: &str) {
    abandoned_inserts_never_share_a_seq(Arc::clone(&store), tag).await;
    inserts_once_and_echoes_the_original(Arc::clone(&store), tag).await;
    repeats_never_spend_a_seq(Arc::clone(&store), tag).await;
    concurrent_copies_store_one_row(Arc::clone(&store), tag).await;
    keys_are_sender_and_id(store, tag).await;
}
