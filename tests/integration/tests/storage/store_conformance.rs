//! The store contract, checked against every backend: insert once, echo the
//! original row on repeats, unique increasing seqs that repeats never spend,
//! history in seq order, durability across a reopen.

use std::{sync::Arc, time::Duration};

use imdedup_domain::store::{Insert, MessageStore};
use imdedup_hops::storage::RemoteStore;
use imdedup_runtime::{server::ServeOptions, tls::InternalTls};
use imdedup_storage::{ScyllaStore, SqliteOptions, SqliteStore};
use imdedup_testkit::conformance::store::conforms;

use super::common;
use common::{history, message, scylla_options};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&SqliteOptions::new(dir.path().join("m.db"))).unwrap();
    conforms(Arc::new(store), "sqlite").await;
}

/// The storage service reached over gRPC (`RemoteStore`: inserts on one
/// long-lived stream, lookups and pages as calls) keeps the same contract
/// as the store behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_storage_service_over_grpc_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&SqliteOptions::new(dir.path().join("m.db"))).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let serving = tokio::spawn(imdedup_storage::serve(
        listener,
        Arc::new(store),
        ServeOptions {
            reflection: false,
            tls: None,
        },
        stop.clone(),
    ));
    let remote =
        RemoteStore::connect_lazy(&url, Duration::from_secs(10), &InternalTls::Plaintext).unwrap();
    conforms(Arc::new(remote), "remote").await;
    stop.cancel();
    serving.await.unwrap().unwrap();
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
