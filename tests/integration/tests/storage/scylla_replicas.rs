//! On several CQL nodes: the store's session sends a message's conditional
//! batch (the unique key's LWT) to a replica of its conversation's
//! partition (token-aware routing), so an LWT is not forwarded by a
//! coordinator that holds none of its data, and the attempts for one
//! conversation meet at its replicas.
//!
//! Opt-in (ignored in the suite, which does not start a cluster): run it on
//! services.sh's three-node cluster with
//! `eval "$(tests/services/services.sh up --cassandra-cluster)"` and
//! `cargo test -p imdedup-integration-tests -- --ignored storage::scylla_replicas`.

use std::{collections::HashSet, net::IpAddr};

use ::scylla::statement::batch::{Batch, BatchType};
use imdedup_storage::{ScyllaOptions, scylla};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs services.sh's three-node cluster (IMDEDUP_TEST_SCYLLA_CLUSTER)"]
async fn a_messages_batch_is_coordinated_by_a_replica_of_its_conversation() {
    let nodes = std::env::var("IMDEDUP_TEST_SCYLLA_CLUSTER").expect(
        "IMDEDUP_TEST_SCYLLA_CLUSTER is not set: \
         eval \"$(tests/services/services.sh up --cassandra-cluster)\" first",
    );
    let mut options = ScyllaOptions::new(nodes.split(',').map(str::to_owned).collect());
    options.keyspace = format!("r{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    // One replica per partition, so that a coordinator which is not the
    // replica shows (with three replicas on three nodes, every node holds
    // every partition).
    options.replication_factor = 1;
    let session = scylla::connect(&options).await.unwrap();
    scylla::migrate(&session, &options).await.unwrap();
    // The keyspace is new: the driver learns its replication now, as a
    // service starting on a migrated keyspace does when it connects.
    session.refresh_metadata().await.unwrap();
    let ks = &options.keyspace;
    // The store's batch: the key row IF NOT EXISTS, then the history row.
    let key_row = session
        .prepare(format!(
            "INSERT INTO {ks}.messages_by_conversation \
             (conversation, seq, sender, client_msg_id, server_id, key_seq, fingerprint, stored_at_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS"
        ))
        .await
        .unwrap();
    let history_row = session
        .prepare(format!(
            "INSERT INTO {ks}.messages_by_conversation \
             (conversation, seq, sender, client_msg_id, server_id, body, stored_at_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?)"
        ))
        .await
        .unwrap();
    let mut batch = Batch::new(BatchType::Unlogged);
    batch.append_statement(key_row.clone());
    batch.append_statement(history_row);
    batch.set_tracing(true);
    batch.set_serial_consistency(Some(options.serial_consistency));
    let cluster = session.get_cluster_state();
    let mut coordinators = HashSet::new();
    for i in 0..12_i64 {
        let conversation = format!("c{i}");
        let key = (
            &conversation,
            -1 - i,
            "ana",
            b"m".to_vec(),
            i,
            1_i64,
            0_i64,
            0_i64,
        );
        let history = (&conversation, 1_i64, "ana", b"m".to_vec(), i, "hi", 0_i64);
        let token = key_row.calculate_token(&key).unwrap().unwrap();
        let replicas: Vec<IpAddr> = cluster
            .get_token_endpoints(ks, "messages_by_conversation", token)
            .iter()
            .map(|(node, _)| node.address.ip())
            .collect();
        assert_eq!(replicas.len(), 1, "RF 1: one replica, got {replicas:?}");
        let reply = session.batch(&batch, (key, history)).await.unwrap();
        let traced = reply.tracing_id().expect("the batch was traced");
        let coordinator = session
            .get_tracing_info(&traced)
            .await
            .unwrap()
            .coordinator
            .expect("the trace names its coordinator");
        assert_eq!(coordinator, replicas[0], "conversation {conversation}");
        coordinators.insert(coordinator);
    }
    assert!(
        coordinators.len() > 1,
        "twelve conversations all on one node ({coordinators:?}): the check saw no routing"
    );
}
