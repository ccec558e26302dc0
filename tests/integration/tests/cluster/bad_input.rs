//! Bad input gets a clear, final error, stores nothing, and leaves the
//! connection usable.

use std::{sync::Arc, time::Duration};

use imdedup_client::{Client, ClientError, Encoding, ErrorReply, RawMessage, Reply};
use imdedup_cluster::{ClusterOptions, LocalCluster};
use imdedup_domain::clock::ManualClock;

use super::common;

use common::connect;

async fn start() -> (LocalCluster, ManualClock, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new();
    let mut options = ClusterOptions::new(dir.path(), Arc::new(clock.clone()));
    options.authz = common::test_groups();
    let cluster = LocalCluster::start(options).await.unwrap();
    (cluster, clock, dir)
}

fn assert_final(err: &ErrorReply, code: &str, mentions: &str) {
    assert_eq!(err.code, code, "{err:?}");
    assert!(!err.retryable, "{err:?}");
    assert!(
        err.message.contains(mentions),
        "{:?} should mention {mentions:?}",
        err.message
    );
}

async fn unmatched_error(client: &Client) -> ErrorReply {
    match tokio::time::timeout(Duration::from_secs(5), client.next_unmatched()).await {
        Ok(Some(Reply::Error(e))) => e,
        other => panic!("expected an error frame, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_sends_are_refused_and_nothing_is_stored() {
    let (cluster, _clock, _dir) = start().await;
    for (encoding, conv) in [
        (Encoding::Json, "c-json"),
        (Encoding::Protobuf, "c-protobuf"),
    ] {
        let ana = connect(&cluster, "ana", encoding).await;
        let too_long_id = vec![b'x'; 65];
        let big_body = "b".repeat(16 * 1024 + 1);
        let cases: [(&[u8], &str, &str, &str); 5] = [
            (b"", conv, "hi", "client message id is empty"),
            (&too_long_id, conv, "hi", "65 bytes"),
            (b"m1", conv, &big_body, "body is 16385 bytes"),
            (b"m2", conv, "", "body is empty"),
            (b"m3", "", "hi", "conversation is empty"),
        ];
        for (id, conversation, body, mentions) in cases {
            let err = ana.send(id, conversation, body).await;
            match err {
                Ok(Err(err)) => assert_final(&err, "invalid_argument", mentions),
                // The empty ID cannot be matched back to its send.
                Ok(Ok(ack)) => panic!("{mentions}: stored as {ack:?}"),
                Err(e) => panic!("{mentions}: connection failed: {e}"),
            }
        }
        // Still usable, and nothing of the above was stored.
        let ok = ana
            .send(conv.as_bytes(), conv, "fine")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ok.outcome, "stored");
        let stored = ana.full_history(conv).await.unwrap().unwrap();
        assert_eq!(stored.len(), 1, "{encoding:?}");
        assert_eq!(stored[0].body, "fine");
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_get_an_error_and_the_connection_stays_usable() {
    let (cluster, _clock, _dir) = start().await;
    let ana = connect(&cluster, "ana", Encoding::Json).await;

    let frames: [(RawMessage, &str); 7] = [
        (RawMessage::Text("{not json".into()), "malformed JSON"),
        (
            RawMessage::Text(r#"{"type":"edit","id":"m1"}"#.into()),
            "unknown frame type",
        ),
        (RawMessage::Text(r#"{"id":"m1"}"#.into()), "no \"type\""),
        (
            RawMessage::Text(r#"{"type":"send","id":"m1","conversation":"c"}"#.into()),
            "body",
        ),
        (
            RawMessage::Text(r#"{"type":"send","id":7,"conversation":"c","body":"x"}"#.into()),
            "malformed frame",
        ),
        (
            RawMessage::Binary(vec![0xff, 0xff, 0xff].into()),
            "malformed protobuf",
        ),
        (RawMessage::Binary(Vec::new().into()), "no kind"),
    ];
    for (frame, mentions) in frames {
        ana.send_raw(frame).await.unwrap();
        let err = unmatched_error(&ana).await;
        assert_final(&err, "invalid_argument", mentions);
    }
    // A send whose fields are bad but whose id is known is answered by id.
    let err = ana
        .send(b"m9", "c", &"x".repeat(20_000))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.id.as_deref(), Some(&b"m9"[..]));

    let ok = ana
        .send(b"after", "c", "still works")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ok.outcome, "stored");
    assert_eq!(ana.full_history("c").await.unwrap().unwrap().len(), 1);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_pulls_with_bad_limits_are_refused() {
    let (cluster, _clock, _dir) = start().await;
    let ana = connect(&cluster, "ana", Encoding::Json).await;
    let err = ana.history("c", 0, 5000).await.unwrap().unwrap_err();
    assert_final(&err, "invalid_argument", "limit");
    let err = ana.history("", 0, 10).await.unwrap().unwrap_err();
    assert_final(&err, "invalid_argument", "conversation");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_missing_and_expired_tokens_are_refused_at_connect() {
    let (cluster, clock, _dir) = start().await;
    let url = cluster.gateway_url();

    let refused = |r: Result<Client, ClientError>| match r {
        Err(ClientError::Refused { status, body }) => (status, body),
        Err(e) => panic!("expected a refusal, got {e}"),
        Ok(_) => panic!("expected a refusal, got a connection"),
    };
    let (status, body) = refused(Client::connect(&url, "not-a-token", Encoding::Json).await);
    assert_eq!(status, 401);
    assert!(body.contains("\"retryable\":false"), "{body}");

    // Signed with another secret.
    let other =
        imdedup_runtime::token::TokenKey::new("some-other-secret-value-of-32-bytes!").unwrap();
    let forged = other.mint(
        &imdedup_domain::model::Sender::parse("ana").unwrap(),
        u64::MAX / 2,
    );
    let (status, _) = refused(Client::connect(&url, &forged, Encoding::Json).await);
    assert_eq!(status, 401);

    let short = cluster
        .token_valid_for("ana", Duration::from_secs(60))
        .unwrap();
    clock.advance(Duration::from_secs(120));
    let (status, body) = refused(Client::connect(&url, &short, Encoding::Json).await);
    assert_eq!(status, 401);
    assert!(body.contains("expired"), "{body}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_that_expires_mid_connection_stops_sends() {
    let (cluster, clock, _dir) = start().await;
    let token = cluster
        .token_valid_for("ana", Duration::from_secs(60))
        .unwrap();
    let ana = Client::connect(&cluster.gateway_url(), &token, Encoding::Json)
        .await
        .unwrap();
    ana.send(b"m1", "c", "in time").await.unwrap().unwrap();
    clock.advance(Duration::from_secs(61));
    ana.send_raw(RawMessage::Text(
        r#"{"type":"send","id":"m2","conversation":"c","body":"too late"}"#.into(),
    ))
    .await
    .unwrap();
    let err = unmatched_error(&ana).await;
    assert_final(&err, "unauthenticated", "expired");
    assert_eq!(
        err.id.as_deref(),
        Some(&b"m2"[..]),
        "the answer names the send"
    );
    assert_eq!(ana.closed().await.code, Some(1008));
    let ben = connect(&cluster, "ben", Encoding::Json).await;
    assert_eq!(ben.full_history("c").await.unwrap().unwrap().len(), 1);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_with_a_lone_surrogate_is_refused_by_id() {
    let (cluster, _clock, _dir) = start().await;
    let ana = connect(&cluster, "ana", Encoding::Json).await;
    ana.send_raw(RawMessage::Text(
        r#"{"type":"send","id":"s-1","conversation":"c","body":"half \ud800 a pair"}"#.into(),
    ))
    .await
    .unwrap();
    let err = unmatched_error(&ana).await;
    assert_final(&err, "invalid_argument", "malformed frame");
    assert_eq!(err.id.as_deref(), Some(&b"s-1"[..]));
    assert!(ana.full_history("c").await.unwrap().unwrap().is_empty());
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_over_the_limit_closes_the_connection_with_1009() {
    let (cluster, _clock, _dir) = start().await;
    let ana = connect(&cluster, "ana", Encoding::Json).await;
    let huge = "x".repeat(imdedup_gateway::MAX_FRAME_BYTES + 1);
    ana.send_raw(RawMessage::Text(huge.into())).await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(5), ana.closed())
        .await
        .expect("the connection stayed open");
    assert_eq!(closed.code, Some(1009), "{closed:?}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_shutting_down_answers_what_it_read_then_closes_with_1001() {
    let (cluster, _clock, _dir) = start().await;
    let ana = connect(&cluster, "ana", Encoding::Json).await;
    let sends = (0..20).map(|i| {
        let ana = &ana;
        async move { ana.send(format!("d{i}").as_bytes(), "c", "before").await }
    });
    let shutdown = async {
        // Let the frames reach the gateway first.
        tokio::time::sleep(Duration::from_millis(50)).await;
        cluster.shutdown().await;
    };
    let (replies, ()) = tokio::join!(futures_util::future::join_all(sends), shutdown);
    for reply in replies {
        let ack = reply.expect("a frame read was not answered").unwrap();
        assert_eq!(ack.outcome, "stored");
    }
    assert_eq!(ana.closed().await.code, Some(1001));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_larger_than_one_socket_read_arrives_whole() {
    // The gateway reads a phone's socket in READ_BUFFER_BYTES; a frame
    // several times that (a body at its limit, JSON-escaped to twice its
    // size) is still one frame, stored intact.
    let (cluster, _clock, _dir) = start().await;
    let ana = connect(&cluster, "ana", Encoding::Json).await;
    // Three characters in four bytes: the body is exactly at its limit.
    let body: String = "\"é\n"
        .chars()
        .cycle()
        .take(imdedup_domain::model::DEFAULT_MAX_BODY_BYTES / 4 * 3)
        .collect();
    assert_eq!(body.len(), imdedup_domain::model::DEFAULT_MAX_BODY_BYTES);
    assert!(
        serde_json::to_string(&body).unwrap().len() > 2 * imdedup_gateway::READ_BUFFER_BYTES,
        "the frame must span several reads"
    );
    let ack = ana.send(b"big-1", "c", &body).await.unwrap().unwrap();
    assert_eq!(ack.outcome, "stored");
    let history = ana.full_history("c").await.unwrap().unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].body, body);
    // And the connection goes on with small frames.
    let ack = ana.send(b"small-1", "c", "after").await.unwrap().unwrap();
    assert_eq!(ack.outcome, "stored");
    cluster.shutdown().await;
}
