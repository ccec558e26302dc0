//! Mutual TLS between the services: a cluster works over it; a server
//! refuses callers without a certificate from its CA naming an allowed
//! identity, and stores nothing for them; certificates rotate without a
//! restart.

use super::common;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use imdedup_client::Encoding;
use imdedup_cluster::{ClusterOptions, LocalCluster};
use imdedup_domain::{
    ErrorKind,
    clock::SystemClock,
    model::{Body, ClientMsgId, ConversationId, MessageKey, NewMessage, Sender},
    store::{Insert, MessageStore},
};
use imdedup_hops::storage::RemoteStore;
use imdedup_runtime::{
    server::ServeOptions,
    tls::{InternalTls, TlsFiles, names},
};
use imdedup_storage::{SqliteOptions, SqliteStore};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tokio_util::sync::CancellationToken;

/// A throwaway CA.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    fn new() -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Self { issuer }
    }

    /// Write a certificate for `names` (DNS names or IPs), its key and this
    /// CA into `dir`, with modification times `later` seconds ahead (so a
    /// rewrite within the same second is seen as a change).
    fn issue(&self, dir: &Path, names: &[&str], later: u64) -> TlsFiles {
        std::fs::create_dir_all(dir).unwrap();
        let key = KeyPair::generate().unwrap();
        let params =
            CertificateParams::new(names.iter().map(|&n| n.to_owned()).collect::<Vec<_>>())
                .unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let files = TlsFiles {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
            ca: dir.join("ca.crt"),
        };
        for (path, pem) in [
            (&files.cert, cert.pem()),
            (&files.key, key.serialize_pem()),
            (&files.ca, self.issuer.pem()),
        ] {
            std::fs::write(path, pem).unwrap();
            std::fs::File::options()
                .write(true)
                .open(path)
                .unwrap()
                .set_modified(SystemTime::now() + Duration::from_secs(later))
                .unwrap();
        }
        files
    }
}

fn mutual(files: &TlsFiles) -> InternalTls {
    InternalTls::mutual(files.clone()).unwrap()
}

fn message(id: &str) -> NewMessage {
    NewMessage {
        key: MessageKey {
            sender: Sender::parse("ana").unwrap(),
            client_msg_id: ClientMsgId::parse(id.as_bytes().to_vec()).unwrap(),
        },
        conversation: ConversationId::parse("dm:ana:ben").unwrap(),
        body: Body::parse(format!("body of {id}"), 1024).unwrap(),
    }
}

/// A storage service over mutual TLS that accepts ingest and gateways.
struct Storage {
    url: String,
    stop: CancellationToken,
    _dir: tempfile::TempDir,
}

async fn storage(files: &TlsFiles) -> Storage {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn MessageStore> =
        Arc::new(SqliteStore::open(&SqliteOptions::new(dir.path().join("messages.db"))).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let allowed = [names::INGEST.to_owned(), names::GATEWAY.to_owned()];
    let options = ServeOptions {
        reflection: false,
        tls: mutual(files).server(&allowed).unwrap(),
    };
    let stop = CancellationToken::new();
    tokio::spawn(imdedup_storage::serve(
        listener,
        store,
        options,
        stop.clone(),
    ));
    Storage {
        url: format!("https://{addr}"),
        stop,
        _dir: dir,
    }
}

fn client(url: &str, tls: &InternalTls) -> RemoteStore {
    RemoteStore::connect_lazy(url, Duration::from_secs(2), tls).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_over_mutual_tls_stores_once_and_answers_the_repeat() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let files = ca.issue(
        &dir.path().join("tls"),
        &[names::GATEWAY, names::INGEST, names::STORAGE, "127.0.0.1"],
        0,
    );
    let mut options = ClusterOptions::new(dir.path(), Arc::new(SystemClock));
    options.internal_tls = mutual(&files);
    let cluster = LocalCluster::start(options).await.unwrap();

    let ana = common::connect(&cluster, "ana", Encoding::Json).await;
    let first = common::send_until_acked(&ana, b"m-1", "dm:ana:ben", "hi").await;
    let again = common::send_until_acked(&ana, b"m-1", "dm:ana:ben", "hi").await;
    assert!(!first.duplicate && again.duplicate);
    assert_eq!((first.server_id, first.seq), (again.server_id, again.seq));
    // The history pull goes gateway -> storage, over TLS too.
    let ben = common::connect(&cluster, "ben", Encoding::Json).await;
    let rows = common::rows(&ben, "dm:ana:ben").await;
    assert_eq!(rows.len(), 1);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_refuses_callers_that_are_not_ingest_or_a_gateway_and_stores_nothing_for_them() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let server = ca.issue(
        &dir.path().join("storage"),
        &[names::STORAGE, "127.0.0.1"],
        0,
    );
    let storage = storage(&server).await;

    let ingest = client(
        &storage.url,
        &mutual(&ca.issue(&dir.path().join("ingest"), &[names::INGEST], 0)),
    );
    let stored = ingest.insert_once(message("allowed")).await.unwrap();
    assert!(matches!(stored, Insert::Stored(_)));

    // Same CA, another identity; no certificate at all; the right name
    // from another CA.
    let phone = mutual(&ca.issue(&dir.path().join("phone"), &["imdedup-phone"], 0));
    let other_ca = mutual(&Ca::new().issue(&dir.path().join("other"), &[names::INGEST], 0));
    for (who, tls) in [
        ("another identity", phone),
        ("plaintext", InternalTls::Plaintext),
        ("another CA", other_ca),
    ] {
        let id = format!("refused-{who}");
        let err = client(&storage.url, &tls)
            .insert_once(message(&id))
            .await
            .err()
            .unwrap_or_else(|| panic!("{who}: stored"));
        // Under TLS 1.3 the client may finish its side of the handshake
        // and send before the server's refusal reaches it: then all it can
        // say is maybe_stored. Either way nothing was stored.
        assert!(
            matches!(err.kind(), ErrorKind::Unavailable | ErrorKind::MaybeStored),
            "{who}: {err}"
        );
        let row = ingest.lookup(&message(&id).key).await.unwrap();
        assert!(row.is_none(), "{who}: a refused caller's insert was stored");
    }

    // A client checks the server too: a certificate that does not name the
    // host dialled is refused.
    let wrong_name = ca.issue(&dir.path().join("wrong"), &[names::STORAGE], 0);
    let impostor = self::storage(&wrong_name).await;
    let Err(err) = ingest_at(&impostor.url, &ca, dir.path())
        .insert_once(message("to-impostor"))
        .await
    else {
        panic!("a server with the wrong name is refused");
    };
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    storage.stop.cancel();
    impostor.stop.cancel();
}

fn ingest_at(url: &str, ca: &Ca, dir: &Path) -> RemoteStore {
    client(
        url,
        &mutual(&ca.issue(&dir.join("ingest-2"), &[names::INGEST], 0)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (server_dir, client_dir): (PathBuf, PathBuf) =
        (dir.path().join("storage"), dir.path().join("ingest"));
    let old = Ca::new();
    let server_files = old.issue(&server_dir, &[names::STORAGE, "127.0.0.1"], 0);
    let storage = storage(&server_files).await;
    let client_tls = mutual(&old.issue(&client_dir, &[names::INGEST], 0));
    client(&storage.url, &client_tls)
        .insert_once(message("before"))
        .await
        .unwrap();

    // cert-manager moves both sides to a new CA; the files change in place.
    let new = Ca::new();
    new.issue(&server_dir, &[names::STORAGE, "127.0.0.1"], 10);
    new.issue(&client_dir, &[names::INGEST], 10);
    // A change is noticed within a second, at the next handshake.
    tokio::time::sleep(imdedup_runtime::watched::RECHECK + Duration::from_millis(200)).await;

    // New connections (a new channel) use the new files on both sides.
    client(&storage.url, &client_tls)
        .insert_once(message("after"))
        .await
        .unwrap();
    // A caller still holding only the old CA's certificate is refused now.
    let stale = mutual(&old.issue(&dir.path().join("stale"), &[names::INGEST], 0));
    let Err(err) = client(&storage.url, &stale)
        .insert_once(message("stale"))
        .await
    else {
        panic!("the old CA is no longer trusted");
    };
    assert!(
        matches!(err.kind(), ErrorKind::Unavailable | ErrorKind::MaybeStored),
        "{err}"
    );
    storage.stop.cancel();
}
