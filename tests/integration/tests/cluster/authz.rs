//! Authorization: a user sends to and reads only the conversations they
//! belong to; a refusal is final, stores nothing and tells nothing; group
//! membership comes from a groups file or from a membership service, and
//! when that service cannot answer, nothing goes through.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use imdedup_client::{Client, Encoding, ErrorReply};
use imdedup_cluster::{ClusterOptions, LocalCluster};
use imdedup_domain::clock::ManualClock;
use imdedup_gateway::authz::{
    Authorizer, GroupsFile, MembershipService, ServiceOptions, service::serve_groups,
};
use imdedup_runtime::tls::InternalTls;
use tokio_util::sync::CancellationToken;

use super::common;

async fn start(authz: Authorizer) -> (LocalCluster, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mut options = ClusterOptions::new(dir.path(), Arc::new(ManualClock::new()));
    options.authz = authz;
    (LocalCluster::start(options).await.unwrap(), dir)
}

async fn connect(cluster: &LocalCluster, user: &str) -> Client {
    common::connect(cluster, user, Encoding::Json).await
}

fn assert_denied(err: &ErrorReply) {
    assert_eq!(err.code, "permission_denied", "{err:?}");
    assert!(!err.retryable, "a refusal is final: {err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outsider_can_neither_read_nor_post_into_a_direct_conversation() {
    let (cluster, _dir) = start(Authorizer::direct_only()).await;
    let ana = connect(&cluster, "ana").await;
    let ben = connect(&cluster, "ben").await;
    let carl = connect(&cluster, "carl").await;
    ana.send(b"m1", "dm:ana:carl", "private to carl")
        .await
        .unwrap()
        .unwrap();

    let pull = ben
        .history("dm:ana:carl", 0, 100)
        .await
        .unwrap()
        .unwrap_err();
    assert_denied(&pull);
    let post = ben
        .send(b"b1", "dm:ana:carl", "let me in")
        .await
        .unwrap()
        .unwrap_err();
    assert_denied(&post);

    // Nothing of ben's was stored; carl sees only ana's message.
    let seen = carl.full_history("dm:ana:carl").await.unwrap().unwrap();
    let bodies: Vec<_> = seen.iter().map(|m| m.body.as_str()).collect();
    assert_eq!(bodies, ["private to carl"]);

    // A conversation that does not exist is refused in the same words.
    let nowhere = ben
        .history("dm:ana:dora", 0, 100)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(
        (nowhere.code.as_str(), nowhere.message.as_str()),
        (pull.code.as_str(), pull.message.as_str())
    );
    // A group nobody declared is refused too: groups exist only as declared.
    assert_denied(
        &ben.send(b"b2", "ana-carl", "hi")
            .await
            .unwrap()
            .unwrap_err(),
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_conversation_has_one_name_for_its_pair() {
    let (cluster, _dir) = start(Authorizer::direct_only()).await;
    let ben = connect(&cluster, "ben").await;
    let err = ben
        .send(b"b1", "dm:ben:ana", "hi")
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, "invalid_argument", "{err:?}");
    assert!(err.message.contains("dm:ana:ben"), "{err:?}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_members_come_from_the_groups_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("groups.json");
    std::fs::write(&path, r#"{"team": ["ana", "ben"]}"#).unwrap();
    let (cluster, _data) = start(Authorizer::members(GroupsFile::open(&path).unwrap())).await;
    let ana = connect(&cluster, "ana").await;
    let ben = connect(&cluster, "ben").await;
    let carl = connect(&cluster, "carl").await;
    ana.send(b"a1", "team", "standup at 10")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ben.full_history("team").await.unwrap().unwrap().len(), 1);
    assert_denied(&carl.history("team", 0, 10).await.unwrap().unwrap_err());
    assert_denied(&carl.send(b"c1", "team", "hi").await.unwrap().unwrap_err());
    cluster.shutdown().await;
}

/// `imdedup.v1.MembershipService` answering from `groups`, on a free port.
async fn membership_server(groups: &str) -> (SocketAddr, CancellationToken, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("groups.json");
    std::fs::write(&path, groups).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let groups = GroupsFile::open(&path).unwrap();
    tokio::spawn(serve_groups(
        listener,
        groups,
        Default::default(),
        stop.clone(),
    ));
    (addr, stop, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_membership_service_decides_groups_and_when_it_is_down_nothing_goes_through() {
    let (addr, stop, _groups) = membership_server(r#"{"team": ["ana", "ben"]}"#).await;
    let mut options = ServiceOptions::new(format!("http://{addr}"));
    options.timeout = Duration::from_millis(300);
    let service = MembershipService::connect_lazy(&options, &InternalTls::Plaintext).unwrap();
    let (cluster, _dir) = start(Authorizer::members(service)).await;
    let ana = connect(&cluster, "ana").await;
    let carl = connect(&cluster, "carl").await;
    ana.send(b"a1", "team", "hello team")
        .await
        .unwrap()
        .unwrap();
    assert_denied(&carl.send(b"c1", "team", "hi").await.unwrap().unwrap_err());
    // Direct conversations never ask the service.
    stop.cancel();
    tokio::time::sleep(Duration::from_millis(200)).await;
    ana.send(b"a2", "dm:ana:carl", "still here")
        .await
        .unwrap()
        .unwrap();

    // A question the cache cannot answer fails closed, and can be retried.
    let ben = connect(&cluster, "ben").await;
    let err = ben
        .send(b"b1", "team", "while it is down")
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, "unavailable", "{err:?}");
    assert!(err.retryable, "{err:?}");
    // Ana's answer is cached: the team's history is still hers to read, and
    // holds nothing of ben's.
    let rows = ana.full_history("team").await.unwrap().unwrap();
    let bodies: Vec<_> = rows.iter().map(|m| m.body.as_str()).collect();
    assert_eq!(bodies, ["hello team"]);
    cluster.shutdown().await;
}
