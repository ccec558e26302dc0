//! The business API end to end: a backend system's calls over HTTP/JSON
//! (`POST /v1/messages`) and gRPC (`imdedup.v1.BusinessService`), through
//! the real gateways, ingest shards and storage, deduplicated on (account,
//! idempotency key). The deduplication cases (a repeated call, a key
//! reused for another request, two copies at once, a call that failed) run
//! on both backends.

use std::sync::Arc;

use super::common;

use common::{Harness, Kind, rows, start};
use imdedup_client::{
    Client, ClientError, Encoding,
    business::{BusinessAck, BusinessError, BusinessHttp, RetryPolicy},
};
use imdedup_cluster::{ClusterOptions, LocalCluster};
use imdedup_domain::{
    clock::ManualClock,
    model::{ClientMsgId, IdempotencyKey},
};
use imdedup_proto::v1::{
    BusinessOutcome, BusinessSendRequest, BusinessSendResponse,
    business_service_client::BusinessServiceClient,
};
use std::time::Duration;

const BOT: &str = "orders-bot";
/// A direct conversation the bot belongs to by its name.
const TO_ANA: &str = "dm:ana:orders-bot";

fn http(h: &Harness) -> BusinessHttp {
    BusinessHttp::new(
        &h.cluster.gateway_url(),
        h.cluster.service_token("orders", &[BOT]).unwrap(),
    )
}

async fn call(client: &BusinessHttp, key: &str, conversation: &str, body: &str) -> BusinessAck {
    match client.send(key, BOT, conversation, body).await.unwrap() {
        Ok(ack) => ack,
        Err(e) => panic!("{key}: {e:?}"),
    }
}

async fn refused(
    client: &BusinessHttp,
    key: &str,
    conversation: &str,
    body: &str,
) -> BusinessError {
    match client.send(key, BOT, conversation, body).await.unwrap() {
        Ok(ack) => panic!("{key}: expected an error, got {ack:?}"),
        Err(e) => e,
    }
}

/// A gRPC call to the first gateway's business port.
async fn grpc_call(
    h: &Harness,
    token: &str,
    key: &str,
    sender: &str,
    conversation: &str,
    body: &str,
) -> Result<BusinessSendResponse, tonic::Status> {
    let url = h.cluster.business_grpc_urls()[0].clone();
    let mut client = BusinessServiceClient::connect(url).await.unwrap();
    let mut request = tonic::Request::new(BusinessSendRequest {
        idempotency_key: key.into(),
        sender: sender.into(),
        conversation: conversation.into(),
        body: body.into(),
    });
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    client.send(request).await.map(tonic::Response::into_inner)
}

/// The message ID a business key stands for.
fn id_of(key: &str) -> Vec<u8> {
    ClientMsgId::for_business_key(&IdempotencyKey::parse(key).unwrap()).into_bytes()
}

async fn gateway_sends(h: &Harness, outcome: &str) -> f64 {
    common::metric(
        &h.cluster,
        "gateway",
        "imdedup_gateway_sends_total",
        &[("outcome", outcome)],
    )
    .await
    .unwrap_or(0.0)
}

async fn a_repeated_call_is_stored_once_and_answered_with_the_original(kind: Kind) {
    let Some(h) = start(kind).await else { return };
    let bot = http(&h);
    let first = call(&bot, "order-1234:shipped", TO_ANA, "Your order shipped").await;
    assert_eq!(first.outcome, "stored");
    assert!(!first.duplicate && !first.replayed);
    // The backend timed out and retries: the original answer.
    let again = call(&bot, "order-1234:shipped", TO_ANA, "Your order shipped").await;
    assert_eq!(again.outcome, "duplicate_business_key");
    assert!(again.duplicate && again.replayed);
    assert_eq!((again.server_id, again.seq), (first.server_id, first.seq));
    // Long after, the window has forgotten: the unique key still answers.
    h.expire_window().await;
    let late = call(&bot, "order-1234:shipped", TO_ANA, "Your order shipped").await;
    assert_eq!(late.outcome, "duplicate_business_key");
    assert_eq!((late.server_id, late.seq), (first.server_id, first.seq));

    // The same over gRPC, and a key first sent over gRPC then retried over
    // HTTP: one API, one key space.
    let token = h.cluster.service_token("orders", &[BOT]).unwrap();
    let stored = grpc_call(&h, &token, "order-77:paid", BOT, TO_ANA, "Paid, thanks")
        .await
        .unwrap();
    assert_eq!(stored.outcome(), BusinessOutcome::Stored);
    assert!(!stored.duplicate);
    let repeat = grpc_call(&h, &token, "order-77:paid", BOT, TO_ANA, "Paid, thanks")
        .await
        .unwrap();
    assert_eq!(repeat.outcome(), BusinessOutcome::DuplicateBusinessKey);
    assert!(repeat.duplicate);
    assert_eq!(
        (repeat.server_id, repeat.seq),
        (stored.server_id, stored.seq)
    );
    let over_http = call(&bot, "order-77:paid", TO_ANA, "Paid, thanks").await;
    assert_eq!(
        (over_http.server_id, over_http.seq, over_http.duplicate),
        (stored.server_id, stored.seq, true)
    );

    // Ana sees each notice once, from the bot, under its derived ID.
    let ana = h.connect("ana", Encoding::Json).await;
    let seen = rows(&ana, TO_ANA).await;
    let seen: Vec<(&str, &[u8], &str, u64)> = seen
        .iter()
        .map(|m| (m.sender.as_str(), m.id.as_slice(), m.body.as_str(), m.seq))
        .collect();
    let (shipped, paid) = (id_of("order-1234:shipped"), id_of("order-77:paid"));
    assert_eq!(
        seen,
        [
            (BOT, shipped.as_slice(), "Your order shipped", first.seq),
            (BOT, paid.as_slice(), "Paid, thanks", stored.seq),
        ]
    );
    // Counted: two stored, four repeats under the business key's outcome.
    assert_eq!(gateway_sends(&h, "stored").await, 2.0);
    assert_eq!(gateway_sends(&h, "duplicate_business_key").await, 4.0);
    h.cluster.shutdown().await;
}

async fn a_key_reused_for_another_request_is_refused_with_the_original(kind: Kind) {
    let Some(h) = start(kind).await else { return };
    let bot = http(&h);
    let first = call(&bot, "invoice-9", TO_ANA, "Invoice 9 is ready").await;
    for round in 0..2 {
        // Another body, then another conversation: refused, final, with
        // the original's identity; through the window, then the unique key.
        for (conversation, body) in [
            (TO_ANA, "Invoice 10 is ready"),
            ("dm:ben:orders-bot", "Invoice 9 is ready"),
        ] {
            let err = refused(&bot, "invoice-9", conversation, body).await;
            assert_eq!(err.status, 409, "{err:?}");
            assert_eq!(err.code, "idempotency_key_reused", "{err:?}");
            assert!(!err.retryable);
            assert_eq!(err.original, Some((first.server_id, first.seq)), "{err:?}");
        }
        let token = h.cluster.service_token("orders", &[BOT]).unwrap();
        let status = grpc_call(&h, &token, "invoice-9", BOT, TO_ANA, "Invoice 10 is ready")
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::AlreadyExists, "{status:?}");
        let meta = |key| status.metadata().get(key).unwrap().to_str().unwrap();
        assert_eq!(meta("imdedup-error-code"), "idempotency_key_reused");
        assert_eq!(
            meta("imdedup-original-server-id"),
            first.server_id.to_string()
        );
        assert_eq!(meta("imdedup-original-seq"), first.seq.to_string());
        // The true retry still gets the original answer.
        let retry = call(&bot, "invoice-9", TO_ANA, "Invoice 9 is ready").await;
        assert_eq!((retry.server_id, retry.seq), (first.server_id, first.seq));
        if round == 0 {
            h.expire_window().await;
        }
    }
    // The key is the account's: another account with the same key is
    // another request.
    let two = BusinessHttp::new(
        &h.cluster.gateway_url(),
        h.cluster
            .service_token("orders", &[BOT, "billing-bot"])
            .unwrap(),
    );
    let billing = two
        .send(
            "invoice-9",
            "billing-bot",
            "dm:ana:billing-bot",
            "Invoice 10 is ready",
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(billing.outcome, "stored");

    let ana = h.connect("ana", Encoding::Json).await;
    let bodies: Vec<String> = rows(&ana, TO_ANA)
        .await
        .into_iter()
        .map(|m| m.body)
        .collect();
    assert_eq!(
        bodies,
        ["Invoice 9 is ready"],
        "nothing stored for the reuse"
    );
    let ben = h.connect("ben", Encoding::Json).await;
    assert!(rows(&ben, "dm:ben:orders-bot").await.is_empty());
    h.cluster.shutdown().await;
}

async fn two_copies_at_once_on_two_gateways_are_one_message(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new();
    let Some(mut options) = common::options(kind, &dir, &clock) else {
        return;
    };
    options.gateways = 2;
    let cluster = LocalCluster::start(options.clone()).await.unwrap();
    let h = Harness {
        cluster,
        clock,
        kind,
        options,
        dir,
    };
    let addrs = h.cluster.gateway_addrs();
    assert_eq!(addrs.len(), 2);
    let token = h.cluster.service_token("orders", &[BOT]).unwrap();
    let one = BusinessHttp::new(&addrs[0].to_string(), token.clone());
    let two = BusinessHttp::new(&addrs[1].to_string(), token);
    // As a backend does: retry a retryable error with the same key.
    let policy = RetryPolicy {
        timeouts: vec![Duration::from_secs(10)],
        pause: Duration::from_millis(50),
        max_tries: 10,
    };
    let rounds = 30;
    for round in 0..rounds {
        let key = format!("race-{round}");
        let body = format!("notice {round}");
        let (a, b) = tokio::join!(
            one.send_with_retries(&key, BOT, TO_ANA, &body, &policy),
            two.send_with_retries(&key, BOT, TO_ANA, &body, &policy),
        );
        let (Some(a), Some(b)) = (a.answers.last(), b.answers.last()) else {
            panic!("round {round}: no answer: {a:?} {b:?}");
        };
        assert_eq!(
            (a.server_id, a.seq),
            (b.server_id, b.seq),
            "round {round}: identical answers"
        );
        assert_eq!(
            [a, b].iter().filter(|ack| !ack.duplicate).count(),
            1,
            "round {round}: one copy stored, the other answered as its repeat: {a:?} {b:?}"
        );
    }
    let ana = h.connect("ana", Encoding::Json).await;
    let stored = rows(&ana, TO_ANA).await;
    assert_eq!(stored.len(), rounds, "one message per key");
    let mut seqs: Vec<u64> = stored.iter().map(|m| m.seq).collect();
    seqs.dedup();
    assert_eq!(seqs.len(), rounds);
    if kind == Kind::Embedded {
        assert_eq!(
            seqs,
            (1..=rounds as u64).collect::<Vec<_>>(),
            "no seq spent on a repeat"
        );
    }
    h.cluster.shutdown().await;
}

async fn a_call_that_failed_does_not_poison_its_key(kind: Kind) {
    let Some(mut h) = start(kind).await else {
        return;
    };
    let bot = http(&h);
    call(&bot, "before", TO_ANA, "stored first").await;

    h.break_storage().await;
    let err = refused(&bot, "refund-5", TO_ANA, "Your refund is on its way").await;
    assert!(err.retryable, "{err:?}");
    assert!(
        ["unavailable", "maybe_stored", "deadline_exceeded"].contains(&err.code.as_str()),
        "{err:?}"
    );
    assert!([503, 504].contains(&err.status), "{err:?}");
    assert!(err.message.contains("same idempotency key"), "{err:?}");

    h.repair_storage().await;
    // The failed call never entered the window: the retry is stored.
    let retry = call(&bot, "refund-5", TO_ANA, "Your refund is on its way").await;
    assert_eq!(retry.outcome, "stored");
    assert!(!retry.duplicate);
    let again = call(&bot, "refund-5", TO_ANA, "Your refund is on its way").await;
    assert_eq!(
        (again.server_id, again.seq, again.duplicate),
        (retry.server_id, retry.seq, true)
    );
    let ana = h.connect("ana", Encoding::Json).await;
    let bodies: Vec<String> = rows(&ana, TO_ANA)
        .await
        .into_iter()
        .map(|m| m.body)
        .collect();
    assert_eq!(bodies, ["stored first", "Your refund is on its way"]);
    h.cluster.shutdown().await;
}

on_both_backends!(
    a_repeated_call_is_stored_once_and_answered_with_the_original,
    a_key_reused_for_another_request_is_refused_with_the_original,
    two_copies_at_once_on_two_gateways_are_one_message,
    a_call_that_failed_does_not_poison_its_key,
);

/// Who may call, and as whom (embedded backends: the checks are the
/// gateway's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_service_tokens_in_scope_and_members_get_through() {
    let Some(h) = start(Kind::Embedded).await else {
        return;
    };
    let url = h.cluster.gateway_url();
    let phone_token = h.cluster.token("ana").unwrap();

    // A phone token is refused on the business API, over HTTP and gRPC.
    let as_phone = BusinessHttp::new(&url, phone_token.clone());
    let err = as_phone
        .send("k1", "ana", "dm:ana:ben", "hi")
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(
        (err.status, err.code.as_str()),
        (401, "unauthenticated"),
        "{err:?}"
    );
    let status = grpc_call(&h, &phone_token, "k1", "ana", "dm:ana:ben", "hi")
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    // No token, or a token signed with the phones' secret but claiming
    // senders: refused too.
    let none = BusinessHttp::new(&url, "");
    let err = none
        .send("k1", "ana", "dm:ana:ben", "hi")
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, "unauthenticated");
    let forged = imdedup_runtime::token::TokenKey::new(imdedup_cluster::DEV_TOKEN_SECRET)
        .unwrap()
        .mint_service(
            &imdedup_domain::model::Sender::parse("orders").unwrap(),
            &["*".to_owned()],
            u64::MAX / 2,
        );
    let err = BusinessHttp::new(&url, forged)
        .send("k1", "ana", "dm:ana:ben", "hi")
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, "unauthenticated");

    // A service token cannot open a phone connection.
    let service_token = h.cluster.service_token("orders", &[BOT]).unwrap();
    match Client::connect(&url, &service_token, Encoding::Json).await {
        Err(ClientError::Refused { status, body }) => {
            assert_eq!(status, 401);
            assert!(body.contains("unauthenticated"), "{body}");
        }
        Ok(_) => panic!("a service token opened a phone connection"),
        Err(e) => panic!("{e}"),
    }

    // A sender outside the token's scope: permission_denied, nothing stored.
    let bot = BusinessHttp::new(&url, service_token.clone());
    let err = bot
        .send("k2", "ana", "dm:ana:ben", "I am ana, trust me")
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(
        (err.status, err.code.as_str()),
        (403, "permission_denied"),
        "{err:?}"
    );
    assert!(!err.retryable);
    let status = grpc_call(&h, &service_token, "k2", "ana", "dm:ana:ben", "hi")
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    // In scope, but not a member of the conversation: permission_denied.
    let err = refused(&bot, "k3", "dm:ana:ben", "let me in").await;
    assert_eq!(
        (err.status, err.code.as_str()),
        (403, "permission_denied"),
        "{err:?}"
    );
    let ana = h.connect("ana", Encoding::Json).await;
    assert!(rows(&ana, "dm:ana:ben").await.is_empty(), "nothing stored");

    // "*": any account; the sender is then the one named in the call.
    let anyone = BusinessHttp::new(&url, h.cluster.service_token("support", &["*"]).unwrap());
    let ack = anyone
        .send("k4", "ben", "dm:ana:ben", "on ben's behalf")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ack.outcome, "stored");
    let seen = rows(&ana, "dm:ana:ben").await;
    assert_eq!(
        (seen[0].sender.as_str(), seen[0].body.as_str()),
        ("ben", "on ben's behalf")
    );

    // Keys outside 1 to 255 bytes and a missing key: invalid_argument.
    for key in ["", &"k".repeat(256)] {
        let err = refused(&bot, key, TO_ANA, "hi").await;
        assert_eq!(
            (err.status, err.code.as_str()),
            (400, "invalid_argument"),
            "{key:?}"
        );
    }
    let auth = format!("Bearer {service_token}");
    let reply = bot
        .post(
            "/v1/messages",
            &[
                ("Authorization", &auth),
                ("Content-Type", "application/json"),
            ],
            br#"{"sender":"orders-bot","conversation":"dm:ana:orders-bot","body":"hi"}"#,
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 400);
    assert!(String::from_utf8_lossy(&reply.body).contains("Idempotency-Key"));

    // Phones may not use the business IDs' prefix.
    let err = ana
        .send(&id_of("k4"), "dm:ana:ben", "on ben's behalf")
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, "invalid_argument", "{err:?}");
    assert!(err.message.contains("bk:"), "{err:?}");
    assert_eq!(rows(&ana, "dm:ana:ben").await.len(), 1);
    h.cluster.shutdown().await;
}

/// Calls the API cannot take are `INVALID_ARGUMENT` with the code named,
/// however they fail: one larger than the server decodes (tonic's own
/// limit, 4 MiB), and a key HTTP could not carry (it drops the spaces
/// around a header). Nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_the_api_cannot_take_are_invalid_argument_with_the_code_named() {
    let Some(h) = start(Kind::Embedded).await else {
        return;
    };
    let token = h.cluster.service_token("orders", &[BOT]).unwrap();
    let huge = "x".repeat(5 << 20);
    for (what, key, body) in [
        ("a 5 MiB call", "big-1", huge.as_str()),
        ("a key ending in a space", "k ", "hi"),
        ("a key beginning with a tab", "\tk", "hi"),
    ] {
        let status = grpc_call(&h, &token, key, BOT, TO_ANA, body)
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{what}: {status:?}"
        );
        assert_eq!(
            status
                .metadata()
                .get(imdedup_gateway::business::grpc::ERROR_CODE_METADATA)
                .and_then(|v| v.to_str().ok()),
            Some("invalid_argument"),
            "{what}: {status:?}"
        );
    }
    assert_eq!(gateway_sends(&h, "stored").await, 0.0);
    // The key without the space is another call, and goes through.
    let ok = grpc_call(&h, &token, "k", BOT, TO_ANA, "hi").await.unwrap();
    assert_eq!(ok.outcome, BusinessOutcome::Stored as i32);
    h.cluster.shutdown().await;
}

/// One HTTP/1.1 request written as is; the status and the body.
async fn raw_http(addr: std::net::SocketAddr, request: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut answer))
        .await
        .expect("answered and closed")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer.split(' ').nth(1).unwrap().parse().unwrap();
    let body = answer
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    (status, body)
}

/// What the HTTP layer itself answers (no such path, a method a path does
/// not take, a plain GET where a WebSocket upgrade belongs) is JSON like
/// every other error, with a code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_own_http_errors_are_json_with_a_code() {
    let Some(h) = start(Kind::Embedded).await else {
        return;
    };
    let addr = h.cluster.gateway_addr();
    for (request, status, code) in [
        (
            "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            404,
            "not_found",
        ),
        (
            "GET /v1/messages HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            405,
            "method_not_allowed",
        ),
        (
            "GET /v1/ws?token=x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            400,
            "invalid_argument",
        ),
    ] {
        let (got, body) = raw_http(addr, request).await;
        assert_eq!(got, status, "{request:?}: {body}");
        let json: serde_json::Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("{request:?}: not JSON ({e}): {body:?}"));
        assert_eq!(json["code"], code, "{body}");
        assert_eq!(json["retryable"], false, "{body}");
    }
    h.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_service_key_the_business_api_is_not_there() {
    let dir = tempfile::tempdir().unwrap();
    let mut options = ClusterOptions::new(dir.path(), Arc::new(ManualClock::new()));
    options.service_token_secret = None;
    let cluster = LocalCluster::start(options).await.unwrap();
    assert!(cluster.business_grpc_urls().is_empty());
    let reply = BusinessHttp::new(&cluster.gateway_url(), "x")
        .send("k", BOT, TO_ANA, "hi")
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!((reply.status, reply.code.as_str()), (404, "not_found"));
    cluster.shutdown().await;
}

/// Even with one secret for phones and services (not recommended), a token
/// of one kind does not pass as the other: the `senders` claim decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_secret_for_both_kinds_still_keeps_them_apart() {
    let dir = tempfile::tempdir().unwrap();
    let mut options = ClusterOptions::new(dir.path(), Arc::new(ManualClock::new()));
    options.service_token_secret = Some(imdedup_cluster::DEV_TOKEN_SECRET.to_owned());
    let cluster = LocalCluster::start(options).await.unwrap();
    let url = cluster.gateway_url();
    let service_token = cluster.service_token("orders", &["*"]).unwrap();
    match Client::connect(&url, &service_token, Encoding::Json).await {
        Err(ClientError::Refused { status, body }) => {
            assert_eq!(status, 401);
            assert!(body.contains("service token"), "{body}");
        }
        Ok(_) => panic!("a service token opened a phone connection"),
        Err(e) => panic!("{e}"),
    }
    let err = BusinessHttp::new(&url, cluster.token("ana").unwrap())
        .send("k", "ana", "dm:ana:ben", "hi")
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!((err.status, err.code.as_str()), (401, "unauthenticated"));
    assert!(err.message.contains("no senders claim"), "{err:?}");
    let ok = BusinessHttp::new(&url, service_token)
        .send("k", "ana", "dm:ana:ben", "hi")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ok.outcome, "stored");
    cluster.shutdown().await;
}
