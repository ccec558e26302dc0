//! On several CQL nodes: the store's session sends the unique key's LWT to
//! a replica of its partition (token-aware routing), so an LWT is not
//! forwarded by a coordinator that holds none of its data, and the
//! attempts for one key meet at its replicas.
//!
//! Opt-in (ignored in the suite, which does not start a cluster): run it on
//! services.sh's three-node cluster with
//! `eval "$(tests/services/services.sh up --cassandra-cluster)"` and
//! `cargo test -p imdedup-integration-tests -- --ignored storage::scylla_replicas`.

use std::{collections::HashSet, net::IpAddr};

use imdedup_storage::{ScyllaOptions, scylla};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs services.sh's three-node cluster (IMDEDUP_TEST_SCYLLA_CLUSTER)"]
async fn the_unique_keys_lwt_is_coordinated_by_the_replica_of_its_partition() {
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
    let mut lwt = session
        .prepare(format!(
            "INSERT INTO {ks}.messages_by_key \
             (sender, client_msg_id, conversation, body, server_id, seq, stored_at_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS"
        ))
        .await
        .unwrap();
    lwt.set_tracing(true);
    lwt.set_serial_consistency(Some(options.serial_consistency));
    let cluster = session.get_cluster_state();
    let mut coordinators = HashSet::new();
    for i in 0..12_i64 {
        let values = ("ana", format!("m{i}").into_bytes(), "c", "hi", i, i, 0_i64);
        let token = lwt.calculate_token(&values).unwrap().unwrap();
        let replicas: Vec<IpAddr> = cluster
            .get_token_endpoints(ks, "messages_by_key", token)
            .iter()
            .map(|(node, _)| node.address.ip())
            .collect();
        assert_eq!(replicas.len(), 1, "RF 1: one replica, got {replicas:?}");
        let reply = session.execute_unpaged(&lwt, &values).await.unwrap();
        let traced = reply.tracing_id().expect("the LWT was traced");
        let coordinator = session
            .get_tracing_info(&traced)
            .await
            .unwrap()
            .coordinator
            .expect("the trace names its coordinator");
        assert_eq!(coordinator, replicas[0], "key m{i}");
        coordinators.insert(coordinator);
    }
    assert!(
        coordinators.len() > 1,
        "twelve keys all on one node ({coordinators:?}): the check saw no routing"
    );
}
