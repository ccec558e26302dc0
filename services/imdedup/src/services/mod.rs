//! One service per process: flags with `IMDEDUP_*` environment fallbacks,
//! one module per command.

mod gateway;
mod ingest;
mod storage;
mod token;

pub use gateway::{GatewayArgs, gateway};
pub use ingest::{IngestArgs, ingest};
pub use storage::{MigrateArgs, StorageArgs, migrate, storage};
pub use token::{TokenArgs, token};

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context;
use imdedup_runtime::{
    admin::{Readiness, serve_admin},
    metrics::Registry,
};

use tokio::net::TcpListener;

use crate::shutdown::serve_until_signal;
use tokio_util::sync::CancellationToken;

/// Parse a flag's duration: `750ms`, `5s`, `5m`, `1h`.
pub fn duration(raw: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(raw)
}

pub(crate) async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

/// The name of this ingest shard: the flag, else `HOSTNAME`, else the
/// system's hostname, else "ingest-0".
pub(super) fn shard_name(flag: Option<String>, hostname_var: Option<String>) -> String {
    let system = || {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .or_else(|_| std::fs::read_to_string("/etc/hostname"))
            .ok()
    };
    [flag, hostname_var]
        .into_iter()
        .flatten()
        .chain(std::iter::from_fn(system).take(1))
        .map(|name| name.trim().to_owned())
        .find(|name| !name.is_empty())
        .unwrap_or_else(|| "ingest-0".to_owned())
}

/// Run a service with its admin port beside it: `/readyz` turns ready when
/// the service starts serving and 503 the moment its shutdown begins; the
/// admin port stops after the service has stopped.
pub(super) async fn serve_with_admin<F, E>(
    name: &str,
    grace: Duration,
    admin_listen: SocketAddr,
    registry: Registry,
    serve: impl FnOnce(CancellationToken) -> F,
) -> anyhow::Result<()>
where
    F: Future<Output = Result<(), E>> + Send + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    let admin_listener = bind(admin_listen).await?;
    let mut registry = registry;
    imdedup_runtime::process::register(&mut registry);
    let readiness = Readiness::new();
    let admin_stop = CancellationToken::new();
    let admin = tokio::spawn(serve_admin(
        admin_listener,
        Arc::new(registry),
        readiness.clone(),
        admin_stop.clone(),
    ));
    tracing::info!(admin = %admin_listen, "admin serving /metrics, /healthz, /readyz");
    let result = serve_until_signal(name, grace, move |stop| {
        readiness.drain_on(stop.clone());
        readiness.set_ready();
        serve(stop)
    })
    .await;
    admin_stop.cancel();
    match admin.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "admin server stopped with an error"),
        Err(e) => tracing::warn!(error = %e, "admin server task failed"),
    }
    result
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{gateway::*, ingest::*, storage::*, token::*, *};
    use clap::Args;
    use imdedup_domain::{
        clock::{Clock, SystemClock},
        model::{DEFAULT_MAX_BODY_BYTES, Sender},
    };
    use imdedup_runtime::token::{TokenKey, TokenVerifier};

    #[derive(Parser)]
    struct Wrap<T: Args> {
        #[command(flatten)]
        inner: T,
    }

    #[test]
    fn ingest_defaults_follow_the_design() {
        let args = Wrap::<IngestArgs>::try_parse_from(["ingest"])
            .unwrap()
            .inner;
        assert_eq!(args.window_ttl, Duration::from_secs(300));
        assert_eq!(args.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
    }

    #[test]
    fn gateway_takes_a_comma_separated_shard_list() {
        let args = Wrap::<GatewayArgs>::try_parse_from([
            "gateway",
            "--shards",
            "http://a:7200,http://b:7200",
            "--token-secret",
            "0123456789abcdef",
            "--send-timeout",
            "750ms",
        ])
        .unwrap()
        .inner;
        assert_eq!(args.shards, ["http://a:7200", "http://b:7200"]);
        assert_eq!(args.send_timeout, Duration::from_millis(750));
    }

    #[test]
    fn admin_ports_and_the_shard_name_have_defaults() {
        let ingest = Wrap::<IngestArgs>::try_parse_from(["ingest"])
            .unwrap()
            .inner;
        assert_eq!(ingest.admin_listen, "127.0.0.1:9200".parse().unwrap());
        let storage = Wrap::<StorageArgs>::try_parse_from(["storage"])
            .unwrap()
            .inner;
        assert_eq!(storage.admin_listen, "127.0.0.1:9300".parse().unwrap());
        let gateway = Wrap::<GatewayArgs>::try_parse_from([
            "gateway",
            "--shards",
            "http://a:7200",
            "--token-secret",
            "0123456789abcdef",
            "--admin-listen",
            "0.0.0.0:9101",
        ])
        .unwrap()
        .inner;
        assert_eq!(gateway.admin_listen, "0.0.0.0:9101".parse().unwrap());

        assert_eq!(
            shard_name(Some("ingest-3".into()), Some("pod-7".into())),
            "ingest-3"
        );
        assert_eq!(
            shard_name(None, Some("imdedup-ingest-1\n".into())),
            "imdedup-ingest-1"
        );
        assert!(!shard_name(None, None).is_empty());
        assert_eq!(shard_name(Some(" ".into()), Some("pod-7".into())), "pod-7");
    }

    #[test]
    fn an_ingest_given_the_shard_map_owns_only_its_share() {
        let args = Wrap::<IngestArgs>::try_parse_from([
            "ingest",
            "--shards",
            "ingest-0=http://a:7200,ingest-1=http://b:7200",
            "--shard-name",
            "ingest-1",
            "--insecure-plaintext",
        ])
        .unwrap()
        .inner;
        assert!(args.plan().unwrap().ownership.is_some());
        let alone = Wrap::<IngestArgs>::try_parse_from(["ingest", "--insecure-plaintext"])
            .unwrap()
            .inner;
        assert!(alone.plan().unwrap().ownership.is_none());
    }

    #[test]
    fn internal_hops_need_certificates_or_plaintext_asked_for_by_name() {
        let ingest = Wrap::<IngestArgs>::try_parse_from(["ingest"])
            .unwrap()
            .inner;
        let err = ingest.plan().err().unwrap().to_string();
        assert!(
            err.contains("--tls-cert") && err.contains("--insecure-plaintext"),
            "{err}"
        );
        let storage = Wrap::<StorageArgs>::try_parse_from(["storage"])
            .unwrap()
            .inner;
        assert!(storage.check().is_err());

        // A certificate without its key and CA is a usage error.
        let half = Wrap::<IngestArgs>::try_parse_from(["ingest", "--tls-cert", "/x/tls.crt"]);
        assert!(half.is_err());
        // Files that do not exist are named in the error.
        let missing = Wrap::<StorageArgs>::try_parse_from([
            "storage",
            "--tls-cert",
            "/nonexistent/tls.crt",
            "--tls-key",
            "/nonexistent/tls.key",
            "--tls-ca",
            "/nonexistent/ca.crt",
        ])
        .unwrap()
        .inner;
        let err = format!("{:#}", missing.check().err().unwrap());
        assert!(err.contains("/nonexistent/tls.crt"), "{err}");
        // The servers check their callers by these names unless told.
        assert_eq!(
            storage.tls_allow_clients,
            ["imdedup-ingest", "imdedup-gateway"]
        );
        assert_eq!(ingest.tls_allow_clients, ["imdedup-gateway"]);
        assert!(!storage.grpc_reflection && !ingest.grpc_reflection);
    }

    #[test]
    fn migration_at_startup_can_be_left_to_a_separate_step() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["storage", "--scylla", "127.0.0.1:9042"];
            argv.extend_from_slice(extra);
            let args = Wrap::<StorageArgs>::try_parse_from(argv).unwrap().inner;
            match args.backend().unwrap() {
                StorageBackend::Scylla(options) => options.migrate,
                StorageBackend::Sqlite(_) => panic!("--scylla means ScyllaDB"),
            }
        };
        assert!(parse(&[]), "migrating at startup is the default");
        assert!(!parse(&["--scylla-migrate", "false"]));
    }

    #[test]
    fn the_business_api_is_off_without_a_service_key_and_its_port_needs_one() {
        let parse = |extra: &[&str]| {
            let mut argv = vec![
                "gateway",
                "--shards",
                "http://a:7200",
                "--token-secret",
                "a-phone-secret-of-at-least-32-bytes!",
                "--insecure-plaintext",
            ];
            argv.extend_from_slice(extra);
            Wrap::<GatewayArgs>::try_parse_from(argv).unwrap().inner
        };
        assert!(parse(&[]).config().unwrap().service_tokens.is_none());
        let err = parse(&["--business-grpc-listen", "127.0.0.1:7110"])
            .config()
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--service-token-secret"), "{err}");
        let on = parse(&[
            "--service-token-secret",
            "a-service-secret-of-at-least-32-bytes",
            "--business-grpc-listen",
            "127.0.0.1:7110",
        ]);
        assert!(on.config().unwrap().service_tokens.is_some());
        assert!(
            format!("{on:?}").contains("Secret(..)"),
            "the secret never shows"
        );
        assert!(
            parse(&["--service-token-secret", "short"])
                .config()
                .is_err()
        );
    }

    #[test]
    fn token_mints_service_tokens_the_gateway_accepts_for_the_business_api() {
        let secret = "a-service-secret-of-at-least-32-bytes";
        let args = Wrap::<TokenArgs>::try_parse_from([
            "token",
            "--service",
            "orders",
            "--senders",
            "orders-bot,ana",
            "--service-token-secret",
            secret,
        ])
        .unwrap()
        .inner;
        let now = SystemClock.unix_seconds();
        let token = args.mint(now + 600).unwrap();
        let services = TokenVerifier::hs256(TokenKey::new(secret).unwrap()).for_services();
        let verified = services.verify(&token, now).unwrap();
        assert_eq!(verified.sender.as_str(), "orders");
        assert!(
            verified
                .senders
                .unwrap()
                .allows(&Sender::parse("ana").unwrap())
        );
        // --senders belongs to --service, and --service needs --senders.
        assert!(Wrap::<TokenArgs>::try_parse_from(["token", "--service", "orders"]).is_err());
        assert!(
            Wrap::<TokenArgs>::try_parse_from(["token", "--user", "ana", "--senders", "x"])
                .is_err()
        );
    }

    #[test]
    fn a_bad_duration_is_a_clear_error() {
        let err = Wrap::<IngestArgs>::try_parse_from(["ingest", "--window-ttl", "five minutes"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--window-ttl"), "{err}");
    }
}
