//! One service per process: flags with `IMDEDUP_*` environment fallbacks.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use clap::Args;
use imdedup_core::window::RecentWindow;
use imdedup_core::{
    admin::{Readiness, serve_admin},
    clock::{Clock, SystemClock},
    metrics::{GatewayMetrics, IngestMetrics, Registry, StoreMetrics, shard_registry},
    model::{DEFAULT_MAX_BODY_BYTES, Sender},
    remote_store::RemoteStore,
    routing::{Ownership, ShardMap},
    secret::Secret,
    store::MessageStore,
    token::{Jwks, TokenKey, TokenPolicy, TokenVerifier},
};
use imdedup_gateway::{Gateway, GatewayConfig};
use imdedup_ingest::{
    ConnectingWindow, Dedup, MemoryWindow, MemoryWindowOptions, RedisWindow, RedisWindowOptions,
    db_limit::DbLimitOptions,
};
use imdedup_storage::{ScyllaOptions, ScyllaStore, SqliteOptions, SqliteStore};

use crate::authz::AuthzArgs;
use crate::backends::{RedisArgs, ScyllaArgs};
use crate::tls::{InternalTlsArgs, serve_options};
use imdedup_core::tls::{InternalTls, names};
use tokio::net::TcpListener;

use crate::shutdown::serve_until_signal;
use tokio_util::sync::CancellationToken;

/// Parse a flag's duration: `750ms`, `5s`, `5m`, `1h`.
pub fn duration(raw: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(raw)
}

#[derive(Debug, Args)]
pub struct StorageArgs {
    /// Address of the gRPC server.
    #[arg(long, env = "IMDEDUP_STORAGE_LISTEN", default_value = "127.0.0.1:7300")]
    pub listen: SocketAddr,
    /// Address of the admin HTTP server: /metrics, /healthz, /readyz.
    #[arg(long, env = "IMDEDUP_ADMIN_LISTEN", default_value = "127.0.0.1:9300")]
    pub admin_listen: SocketAddr,
    /// Directory of the embedded database (messages.db).
    #[arg(long, env = "IMDEDUP_DATA_DIR", default_value = "imdedup-data")]
    pub data_dir: PathBuf,
    /// Most inserts committed together (one fsync per batch).
    #[arg(long, env = "IMDEDUP_STORAGE_MAX_BATCH", default_value_t = 512)]
    pub max_batch: usize,
    /// Time given to calls in flight after SIGTERM.
    #[arg(long, env = "IMDEDUP_GRACE", default_value = "10s", value_parser = duration)]
    pub grace: Duration,
    #[command(flatten)]
    pub scylla: ScyllaArgs,
    #[command(flatten)]
    pub tls: InternalTlsArgs,
    /// Certificate names (DNS) of the callers accepted over mutual TLS:
    /// the ingest shards and the gateways.
    #[arg(
        long,
        env = "IMDEDUP_TLS_ALLOW_CLIENTS",
        value_delimiter = ',',
        default_values = [names::INGEST, names::GATEWAY]
    )]
    pub tls_allow_clients: Vec<String>,
    /// Answer gRPC server reflection (for grpcurl without the protos).
    #[arg(long, env = "IMDEDUP_GRPC_REFLECTION")]
    pub grpc_reflection: bool,
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub scylla: ScyllaArgs,
}

#[derive(Debug, Args)]
pub struct IngestArgs {
    /// Address of the gRPC server.
    #[arg(long, env = "IMDEDUP_INGEST_LISTEN", default_value = "127.0.0.1:7200")]
    pub listen: SocketAddr,
    /// Address of the admin HTTP server: /metrics, /healthz, /readyz.
    #[arg(long, env = "IMDEDUP_ADMIN_LISTEN", default_value = "127.0.0.1:9200")]
    pub admin_listen: SocketAddr,
    /// This shard's name, the `shard` label of its metrics (default: the
    /// HOSTNAME variable, else the system hostname, else "ingest-0"; a
    /// StatefulSet pod name such as imdedup-ingest-0).
    #[arg(long, env = "IMDEDUP_SHARD_NAME")]
    pub shard_name: Option<String>,
    /// The shard map, as the gateways have it (`NAME=URL,...`). Given, this
    /// shard answers only the conversations the map gives to its
    /// --shard-name and refuses the others with a retryable error, so a
    /// gateway routing by another map never has two shards write one
    /// conversation.
    #[arg(long, env = "IMDEDUP_SHARDS", value_delimiter = ',')]
    pub shards: Vec<String>,
    /// URL of the storage service.
    #[arg(
        long,
        env = "IMDEDUP_STORAGE_URL",
        default_value = "http://127.0.0.1:7300"
    )]
    pub storage: String,
    /// How long a stored ID is remembered by the recent-ID window.
    #[arg(long, env = "IMDEDUP_WINDOW_TTL", default_value = "5m", value_parser = duration)]
    pub window_ttl: Duration,
    /// Life of a claim whose owner never finished; a little over the storage
    /// timeout.
    #[arg(long, env = "IMDEDUP_CLAIM_TTL", default_value = "3s", value_parser = duration)]
    pub claim_ttl: Duration,
    /// Most IDs the in-process window keeps.
    #[arg(long, env = "IMDEDUP_WINDOW_MAX_KEYS", default_value_t = 2_000_000)]
    pub window_max_keys: u64,
    /// Deadline of one storage call.
    #[arg(long, env = "IMDEDUP_STORAGE_TIMEOUT", default_value = "2s", value_parser = duration)]
    pub storage_timeout: Duration,
    /// Largest message body accepted, in bytes.
    #[arg(long, env = "IMDEDUP_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Time given to sends in flight after SIGTERM.
    #[arg(long, env = "IMDEDUP_GRACE", default_value = "10s", value_parser = duration)]
    pub grace: Duration,
    /// Inserts in flight to the database at start; the limit then adapts
    /// (AIMD: +1 per insert in good time, -10% per failed or slow one)
    /// between the next two bounds.
    #[arg(long, env = "IMDEDUP_DB_CONCURRENCY_INITIAL", default_value_t = 64)]
    pub db_concurrency_initial: usize,
    #[arg(long, env = "IMDEDUP_DB_CONCURRENCY_MIN", default_value_t = 8)]
    pub db_concurrency_min: usize,
    #[arg(long, env = "IMDEDUP_DB_CONCURRENCY_MAX", default_value_t = 1024)]
    pub db_concurrency_max: usize,
    /// An insert slower than this lowers the limit, as a failed one does.
    #[arg(long, env = "IMDEDUP_DB_SLOW_INSERT", default_value = "500ms", value_parser = duration)]
    pub db_slow_insert: Duration,
    /// Refused: switching dedup off exists only for demonstrations, in
    /// local mode (`imdedup demo --no-dedup`, `imdedup dev --no-dedup`,
    /// `imdedup-load --embedded --no-dedup`).
    #[arg(long, hide = true)]
    pub no_dedup: bool,
    /// Fail this share (0 to 1) of the writes that publish a stored
    /// message, as if the database had timed out: for fault tests only.
    #[arg(long, env = "IMDEDUP_FAULT_COMMIT_FAILURES", hide = true)]
    pub fault_commit_failures: Option<f64>,
    #[command(flatten)]
    pub redis: RedisArgs,
    /// With --scylla, the shard writes to ScyllaDB itself (it owns its
    /// conversations' seqs) instead of going through the storage service.
    #[command(flatten)]
    pub scylla: ScyllaArgs,
    #[command(flatten)]
    pub tls: InternalTlsArgs,
    /// Certificate names (DNS) of the callers accepted over mutual TLS:
    /// the gateways.
    #[arg(
        long,
        env = "IMDEDUP_TLS_ALLOW_CLIENTS",
        value_delimiter = ',',
        default_value = names::GATEWAY
    )]
    pub tls_allow_clients: Vec<String>,
    /// Answer gRPC server reflection (for grpcurl without the protos).
    #[arg(long, env = "IMDEDUP_GRPC_REFLECTION")]
    pub grpc_reflection: bool,
}

#[derive(Debug, Args)]
pub struct GatewayArgs {
    /// Address of the WebSocket server.
    #[arg(long, env = "IMDEDUP_GATEWAY_LISTEN", default_value = "127.0.0.1:7100")]
    pub listen: SocketAddr,
    /// Address of the admin HTTP server: /metrics, /healthz, /readyz.
    #[arg(long, env = "IMDEDUP_ADMIN_LISTEN", default_value = "127.0.0.1:9100")]
    pub admin_listen: SocketAddr,
    /// The ingest shards, comma-separated `NAME=URL` entries
    /// (`imdedup-ingest-0=http://imdedup-ingest-0.imdedup-ingest:7200`); a
    /// bare URL is named by the first label of its host. Conversations are
    /// routed by name: every gateway and ingest must have the same names.
    #[arg(long, env = "IMDEDUP_SHARDS", value_delimiter = ',', required = true)]
    pub shards: Vec<String>,
    /// URL of the storage service, for history pulls.
    #[arg(
        long,
        env = "IMDEDUP_STORAGE_URL",
        default_value = "http://127.0.0.1:7300"
    )]
    pub storage: String,
    #[command(flatten)]
    pub tokens: TokenArgsForGateway,
    #[command(flatten)]
    pub business: BusinessArgs,
    /// Deadline of one send through ingest and storage.
    #[arg(long, env = "IMDEDUP_SEND_TIMEOUT", default_value = "5s", value_parser = duration)]
    pub send_timeout: Duration,
    /// Largest message body accepted, in bytes.
    #[arg(long, env = "IMDEDUP_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Most phone connections at once; more are refused with HTTP 503.
    #[arg(long, env = "IMDEDUP_MAX_CONNECTIONS", default_value_t = 50_000)]
    pub max_connections: usize,
    /// Most sends and pulls in flight on one connection; the gateway stops
    /// reading that connection until one finishes.
    #[arg(long, env = "IMDEDUP_MAX_IN_FLIGHT", default_value_t = 256)]
    pub max_in_flight: usize,
    /// Time given to sends in flight after SIGTERM.
    #[arg(long, env = "IMDEDUP_GRACE", default_value = "10s", value_parser = duration)]
    pub grace: Duration,
    #[command(flatten)]
    pub authz: AuthzArgs,
    #[command(flatten)]
    pub limits: crate::limits::LimitArgs,
    #[command(flatten)]
    pub tls: InternalTlsArgs,
}

/// How the gateway verifies phones' tokens.
#[derive(Debug, Args)]
pub struct TokenArgsForGateway {
    /// HS256 secret that signs tokens (at least 32 bytes).
    #[arg(
        long,
        env = "IMDEDUP_TOKEN_SECRET",
        hide_env_values = true,
        required_unless_present = "jwks_file"
    )]
    pub token_secret: Option<Secret>,
    /// Public keys (JWKS: RS256, ES256, EdDSA, each with a `kid`) of your
    /// identity provider; read again when the file changes.
    #[arg(long, env = "IMDEDUP_JWKS_FILE")]
    pub jwks_file: Option<PathBuf>,
    /// Required `iss` claim.
    #[arg(long, env = "IMDEDUP_TOKEN_ISSUER")]
    pub token_issuer: Option<String>,
    /// Required `aud` claim (one of the token's audiences).
    #[arg(long, env = "IMDEDUP_TOKEN_AUDIENCE")]
    pub token_audience: Option<String>,
    /// Clock difference allowed on `exp` and `nbf`.
    #[arg(long, env = "IMDEDUP_TOKEN_LEEWAY", default_value = "30s", value_parser = duration)]
    pub token_leeway: Duration,
    /// Longest token lifetime accepted (`exp` minus `iat`).
    #[arg(long, env = "IMDEDUP_TOKEN_MAX_LIFETIME", default_value = "24h", value_parser = duration)]
    pub token_max_lifetime: Duration,
}

impl TokenArgsForGateway {
    fn verifier(&self) -> anyhow::Result<TokenVerifier> {
        let secret = self
            .token_secret
            .as_ref()
            .map(|s| TokenKey::new(s.expose()))
            .transpose()
            .context("--token-secret")?;
        let jwks = self
            .jwks_file
            .as_ref()
            .map(Jwks::open)
            .transpose()
            .context("--jwks-file")?;
        let policy = TokenPolicy {
            leeway: self.token_leeway,
            issuer: self.token_issuer.clone(),
            audience: self.token_audience.clone(),
            max_lifetime: self.token_max_lifetime,
        };
        Ok(TokenVerifier::new(secret, jwks, policy)?)
    }
}

/// The business API (`POST /v1/messages` on the gateway's port, and
/// `imdedup.v1.BusinessService` on its own port): off unless a service-token
/// key is given.
#[derive(Debug, Args)]
pub struct BusinessArgs {
    /// HS256 secret of the business systems' service tokens (at least 32
    /// bytes; keep it apart from --token-secret). Turns the business API on.
    #[arg(long, env = "IMDEDUP_SERVICE_TOKEN_SECRET", hide_env_values = true)]
    pub service_token_secret: Option<Secret>,
    /// Public keys (JWKS) that sign service tokens; read again when the file
    /// changes. Turns the business API on.
    #[arg(long, env = "IMDEDUP_SERVICE_JWKS_FILE")]
    pub service_jwks_file: Option<PathBuf>,
    /// Address of the business API's gRPC server
    /// (imdedup.v1.BusinessService); none unless given (e.g. 0.0.0.0:7110).
    #[arg(long, env = "IMDEDUP_BUSINESS_GRPC_LISTEN")]
    pub business_grpc_listen: Option<SocketAddr>,
    /// Answer gRPC server reflection on the business gRPC port (for grpcurl
    /// without the protos).
    #[arg(long, env = "IMDEDUP_GRPC_REFLECTION")]
    pub grpc_reflection: bool,
}

impl BusinessArgs {
    /// The service-token verifier (`None`: the business API is off), with
    /// the phone tokens' leeway and longest lifetime.
    fn verifier(&self, tokens: &TokenArgsForGateway) -> anyhow::Result<Option<TokenVerifier>> {
        if self.service_token_secret.is_none() && self.service_jwks_file.is_none() {
            if self.business_grpc_listen.is_some() {
                anyhow::bail!(
                    "--business-grpc-listen needs service tokens: give --service-token-secret \
                     or --service-jwks-file"
                );
            }
            return Ok(None);
        }
        let secret = self
            .service_token_secret
            .as_ref()
            .map(|s| TokenKey::new(s.expose()))
            .transpose()
            .context("--service-token-secret")?;
        let jwks = self
            .service_jwks_file
            .as_ref()
            .map(Jwks::open)
            .transpose()
            .context("--service-jwks-file")?;
        let policy = TokenPolicy {
            leeway: tokens.token_leeway,
            max_lifetime: tokens.token_max_lifetime,
            ..TokenPolicy::default()
        };
        Ok(Some(
            TokenVerifier::new(secret, jwks, policy)?.for_services(),
        ))
    }
}

#[derive(Debug, Args)]
pub struct TokenArgs {
    /// The user a phone token names.
    #[arg(long, required_unless_present = "service", conflicts_with = "service")]
    pub user: Option<String>,
    /// Mint a service token (the business API) for this system instead,
    /// e.g. orders-bot; signed with --service-token-secret.
    #[arg(long, requires = "senders")]
    pub service: Option<String>,
    /// With --service: the accounts the system may send as,
    /// comma-separated; `*` means any account.
    #[arg(long, value_delimiter = ',', requires = "service")]
    pub senders: Vec<String>,
    /// How long the token is valid.
    #[arg(long, default_value = "24h", value_parser = duration)]
    pub ttl: Duration,
    /// HS256 secret, the gateway's (phone tokens).
    #[arg(
        long,
        env = "IMDEDUP_TOKEN_SECRET",
        hide_env_values = true,
        required_unless_present = "service"
    )]
    pub token_secret: Option<Secret>,
    /// HS256 secret of service tokens, the gateway's --service-token-secret.
    #[arg(long, env = "IMDEDUP_SERVICE_TOKEN_SECRET", hide_env_values = true)]
    pub service_token_secret: Option<Secret>,
}

pub(crate) async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

/// The name of this ingest shard: the flag, else `HOSTNAME`, else the
/// system's hostname, else "ingest-0".
fn shard_name(flag: Option<String>, hostname_var: Option<String>) -> String {
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
async fn serve_with_admin<F, E>(
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
    imdedup_core::process::register(&mut registry);
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

/// What the storage flags say, checked, before any I/O.
enum StorageBackend {
    Scylla(Box<ScyllaOptions>),
    Sqlite(SqliteOptions),
}

impl StorageArgs {
    fn backend(&self) -> anyhow::Result<StorageBackend> {
        Ok(match self.scylla.options()? {
            Some(mut scylla) => {
                // Unique per pod: storage replicas that insert never take
                // each other's conversations as their own predecessor's.
                scylla.member_name = format!(
                    "storage-{}",
                    shard_name(None, std::env::var("HOSTNAME").ok())
                );
                StorageBackend::Scylla(Box::new(scylla))
            }
            None => {
                let mut options = SqliteOptions::new(self.data_dir.join("messages.db"));
                options.max_batch = self.max_batch;
                StorageBackend::Sqlite(options)
            }
        })
    }

    /// `--check-config`: the flags and environment parse and make sense.
    pub fn check(&self) -> anyhow::Result<()> {
        self.backend()?;
        let tls = self.tls.internal_tls()?;
        serve_options(&tls, &self.tls_allow_clients, self.grpc_reflection)?;
        Ok(())
    }
}

pub async fn storage(args: StorageArgs) -> anyhow::Result<()> {
    let tls = args.tls.internal_tls()?;
    crate::tls::announce(&tls);
    let serving = serve_options(&tls, &args.tls_allow_clients, args.grpc_reflection)?;
    let mut registry = Registry::default();
    let store_metrics = StoreMetrics::register(&mut registry);
    let store: Arc<dyn MessageStore> = match args.backend()? {
        StorageBackend::Scylla(mut scylla) => {
            tracing::info!(nodes = ?scylla.nodes, keyspace = %scylla.keyspace, "storage on ScyllaDB");
            scylla.metrics = store_metrics;
            Arc::new(ScyllaStore::open(*scylla).await?)
        }
        StorageBackend::Sqlite(mut options) => {
            options.metrics = store_metrics;
            tracing::info!(db = %options.path.display(), "storage on embedded SQLite");
            Arc::new(SqliteStore::open(&options)?)
        }
    };
    let listener = bind(args.listen).await?;
    tracing::info!(listen = %args.listen, "storage serving");
    serve_with_admin(
        "storage",
        args.grace,
        args.admin_listen,
        registry,
        move |stop| async move {
            let served = imdedup_storage::serve(listener, Arc::clone(&store), serving, stop).await;
            store.drain().await;
            served
        },
    )
    .await
}

/// What the ingest flags say, checked, before any I/O.
struct IngestPlan {
    shard: String,
    tls: InternalTls,
    serving: imdedup_core::server::ServeOptions,
    ownership: Option<Ownership>,
    scylla: Option<ScyllaOptions>,
    redis: Option<RedisWindowOptions>,
}

impl IngestArgs {
    fn plan(&self) -> anyhow::Result<IngestPlan> {
        if self.no_dedup {
            anyhow::bail!(
                "--no-dedup is refused outside local mode: it exists to demonstrate duplicates \
                 (imdedup demo --no-dedup, imdedup dev --no-dedup)"
            );
        }
        let shard = shard_name(self.shard_name.clone(), std::env::var("HOSTNAME").ok());
        let ownership = if self.shards.is_empty() {
            None
        } else {
            let map = ShardMap::parse(&self.shards).context("--shards")?;
            Some(Ownership::new(map, &shard).context("--shards and --shard-name")?)
        };
        let scylla = self.scylla.options()?.map(|mut scylla| {
            // Conversations are owned under the shard's name: a restart
            // under the same name takes its own back.
            scylla.member_name.clone_from(&shard);
            if let Some(rate) = self.fault_commit_failures {
                tracing::warn!(rate, "injecting history commit failures");
                scylla.faults.fail_commits_at_rate(rate);
            }
            scylla
        });
        let tls = self.tls.internal_tls()?;
        let serving = serve_options(&tls, &self.tls_allow_clients, self.grpc_reflection)?;
        Ok(IngestPlan {
            shard,
            tls,
            serving,
            ownership,
            scylla,
            redis: self.redis.options(self.window_ttl, self.claim_ttl)?,
        })
    }

    /// `--check-config`: the flags and environment parse and make sense.
    pub fn check(&self) -> anyhow::Result<()> {
        let plan = self.plan()?;
        if plan.scylla.is_none() {
            RemoteStore::connect_lazy(&self.storage, self.storage_timeout, &plan.tls)
                .context("--storage")?;
        }
        Ok(())
    }
}

pub async fn ingest(args: IngestArgs) -> anyhow::Result<()> {
    let IngestPlan {
        shard,
        tls,
        serving,
        ownership,
        scylla,
        redis,
    } = args.plan()?;
    let mut registry = Registry::default();
    let shard_metrics = shard_registry(&mut registry, &shard);
    let metrics = IngestMetrics::register(shard_metrics);
    let store: Arc<dyn MessageStore> = match scylla {
        Some(mut scylla) => {
            scylla.metrics = StoreMetrics::register(shard_metrics);
            Arc::new(ScyllaStore::open(scylla).await?)
        }
        None => Arc::new(RemoteStore::connect_lazy(
            &args.storage,
            args.storage_timeout,
            &tls,
        )?),
    };
    crate::tls::announce(&tls);
    let window: Arc<dyn RecentWindow> = match redis {
        // Redis down at start does not stop the shard: the window is
        // bypassed (counted) until the connection is made in the background.
        Some(redis) => {
            let window_metrics = metrics.window.clone();
            Arc::new(ConnectingWindow::spawn(move || {
                let (redis, window_metrics) = (redis.clone(), window_metrics.clone());
                async move {
                    Ok(RedisWindow::connect(redis)
                        .await?
                        .with_metrics(window_metrics))
                }
            }))
        }
        None => Arc::new(
            MemoryWindow::new(MemoryWindowOptions {
                ttl: args.window_ttl,
                claim_ttl: args.claim_ttl,
                max_keys: args.window_max_keys,
            })
            .with_metrics(metrics.window.clone()),
        ),
    };
    let owns_all = ownership.is_none();
    // Empty when the shard owns every conversation (no --shards).
    let shard_map = ShardMap::parse(&args.shards)
        .map(|map| map.version())
        .unwrap_or_default();
    let mut dedup = Dedup::new(window, Arc::clone(&store), args.storage_timeout)
        .with_metrics(metrics)
        .with_db_limit(DbLimitOptions {
            initial: args.db_concurrency_initial,
            min: args.db_concurrency_min,
            max: args.db_concurrency_max,
            slow: args.db_slow_insert,
        });
    if let Some(ownership) = ownership {
        dedup = dedup.with_ownership(ownership);
    }
    let dedup = Arc::new(dedup);
    let draining = Arc::clone(&store);
    let listener = bind(args.listen).await?;
    tracing::info!(listen = %args.listen, storage = %args.storage, window_ttl = ?args.window_ttl, %shard, owns_all, %shard_map, "ingest serving");
    let max_body = args.max_body_bytes;
    serve_with_admin(
        "ingest",
        args.grace,
        args.admin_listen,
        registry,
        move |stop| async move {
            let served = imdedup_ingest::serve(listener, dedup, max_body, serving, stop).await;
            // Inserts whose callers went away still finish both writes.
            draining.drain().await;
            served
        },
    )
    .await
}

impl GatewayArgs {
    fn config(&self) -> anyhow::Result<GatewayConfig> {
        let internal_tls = self.tls.internal_tls()?;
        Ok(GatewayConfig {
            shards: ShardMap::parse(&self.shards).context("--shards")?,
            storage: self.storage.clone(),
            tokens: self.tokens.verifier()?,
            service_tokens: self.business.verifier(&self.tokens)?,
            authz: self.authz.authorizer(&internal_tls)?,
            internal_tls,
            send_timeout: self.send_timeout,
            max_body_bytes: self.max_body_bytes,
            max_connections: self.max_connections,
            max_in_flight_per_connection: self.max_in_flight.max(1),
            limits: self.limits.limits(),
            clock: Arc::new(SystemClock),
        })
    }

    /// `--check-config`: the flags and environment parse and make sense
    /// (the gateway's clients connect lazily, so building it does no I/O).
    pub fn check(&self) -> anyhow::Result<()> {
        Gateway::new(self.config()?)?;
        Ok(())
    }
}

pub async fn gateway(args: GatewayArgs) -> anyhow::Result<()> {
    let mut registry = Registry::default();
    let metrics = GatewayMetrics::register(&mut registry);
    let gateway = Arc::new(Gateway::new(args.config()?)?.with_metrics(metrics));
    crate::authz::announce(&gateway.config.authz, &args.authz);
    crate::tls::announce(&gateway.config.internal_tls);
    let listener = bind(args.listen).await?;
    let business_listener = match args.business.business_grpc_listen {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    let shards: Vec<_> = gateway.shards.map().names().collect();
    let shard_map = gateway.shards.map().version();
    tracing::info!(listen = %args.listen, ?shards, %shard_map, "gateway serving at ws://{}/v1/ws", args.listen);
    match (
        &gateway.config.service_tokens,
        args.business.business_grpc_listen,
    ) {
        (None, _) => {
            tracing::info!("business API off (no --service-token-secret or --service-jwks-file)")
        }
        (Some(_), grpc) => tracing::info!(
            http = %format!("http://{}/v1/messages", args.listen),
            grpc = ?grpc,
            "business API on"
        ),
    }
    // Business systems bring their own tokens: the port is served like the
    // phones' (TLS, if any, ends in front of the gateway).
    let business_options = imdedup_core::server::ServeOptions {
        reflection: args.business.grpc_reflection,
        tls: None,
    };
    serve_with_admin(
        "gateway",
        args.grace,
        args.admin_listen,
        registry,
        move |stop| async move {
            let business = async {
                match business_listener {
                    Some(listener) => imdedup_gateway::business::grpc::serve(
                        listener,
                        Arc::clone(&gateway),
                        business_options,
                        stop.clone(),
                    )
                    .await
                    .map_err(std::io::Error::other),
                    None => Ok(()),
                }
            };
            let phones = imdedup_gateway::serve(listener, Arc::clone(&gateway), stop.clone());
            let (phones, business) = tokio::join!(phones, business);
            phones.and(business)
        },
    )
    .await
}

impl MigrateArgs {
    fn options(&self) -> anyhow::Result<ScyllaOptions> {
        self.scylla
            .options()?
            .context("migrate needs --scylla (or IMDEDUP_SCYLLA_NODES)")
    }

    /// `--check-config`: the flags and environment parse and make sense.
    pub fn check(&self) -> anyhow::Result<()> {
        self.options().map(drop)
    }
}

pub async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let options = args.options()?;
    let session = imdedup_storage::scylla::connect(&options).await?;
    imdedup_storage::scylla::migrate(&session, &options).await?;
    println!("keyspace {} is up to date", options.keyspace);
    Ok(())
}

impl TokenArgs {
    /// `--check-config`: the flags and environment parse and make sense.
    pub fn check(&self) -> anyhow::Result<()> {
        self.mint(0).map(drop)
    }

    /// The token the flags ask for, expiring at `exp`.
    fn mint(&self, exp: u64) -> anyhow::Result<String> {
        if let Some(service) = &self.service {
            let secret = self.service_token_secret.as_ref().context(
                "a service token needs --service-token-secret (or IMDEDUP_SERVICE_TOKEN_SECRET)",
            )?;
            let key = TokenKey::new(secret.expose()).context("--service-token-secret")?;
            for sender in self.senders.iter().filter(|s| *s != "*") {
                Sender::parse(sender.clone()).context("--senders")?;
            }
            return Ok(key.mint_service(&Sender::parse(service.clone())?, &self.senders, exp));
        }
        let secret = self
            .token_secret
            .as_ref()
            .context("a phone token needs --token-secret (or IMDEDUP_TOKEN_SECRET)")?;
        let key = TokenKey::new(secret.expose()).context("--token-secret")?;
        let user = self.user.clone().context("--user")?;
        Ok(key.mint(&Sender::parse(user)?, exp))
    }
}

pub fn token(args: TokenArgs) -> anyhow::Result<()> {
    let exp = SystemClock.unix_seconds() + args.ttl.as_secs();
    println!("{}", args.mint(exp)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

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
