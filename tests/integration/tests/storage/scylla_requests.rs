//! What messages cost the CQL database, as the store's own metric counts
//! it (`imdedup_store_requests_total{kind}`): every request the store sends
//! is counted once, by kind.

use imdedup_storage::metrics::DB_CASSANDRA;

use imdedup_domain::store::{Insert, MessageStore};
use imdedup_storage::{ScyllaStore, scylla::RequestKind};

use super::common;
use common::{message, scylla_options};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_database_request_is_counted_by_kind() {
    let Some(options) = scylla_options() else {
        return;
    };
    let metrics = options.metrics.clone();
    let count = || RequestKind::ALL.map(|kind| metrics.requests(DB_CASSANDRA, kind.as_str()));
    let store = ScyllaStore::open(options).await.unwrap();
    // The first message leases the conversation's seqs and a block of
    // server ids; the next ones use them.
    let first = store
        .insert_once(message("ana", "m0", "c", "hi"))
        .await
        .unwrap();
    assert!(matches!(first, Insert::Stored(_)));

    let before = count();
    let n = 20;
    for i in 1..=n {
        let stored = store
            .insert_once(message("ana", &format!("m{i}"), "c", "hi"))
            .await
            .unwrap();
        assert!(matches!(stored, Insert::Stored(_)));
    }
    let after = count();
    let delta: Vec<u64> = (0..4).map(|k| after[k] - before[k]).collect();
    // Today's design (the target: at most one LWT and one write per
    // message): the pending history row, the unique key's LWT, the commit.
    // The membership's heartbeat (a write, a read) may land in between.
    assert_eq!(delta[0], n, "LWTs: {delta:?}");
    assert!((2 * n..=2 * n + 2).contains(&delta[1]), "writes: {delta:?}");
    assert!(delta[2] + delta[3] <= 2, "reads: {delta:?}");

    // A history pull is one read.
    let before = count();
    store.history(&common::history("c", 0)).await.unwrap();
    let after = count();
    assert_eq!(after[2] - before[2], 1, "{before:?} -> {after:?}");
}
