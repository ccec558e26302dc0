//! A whole imdedup cluster on loopback, in one process: storage, N ingest
//! shards and a gateway, each a real gRPC or WebSocket server on its own
//! port, wired exactly as in production. The demo, the dev command, the load
//! test's `--embedded` mode and the integration tests all start this.

pub mod without_dedup;

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use imdedup_domain::window::RecentWindow;
use imdedup_domain::{
    clock::SharedClock,
    model::{ConversationId, DEFAULT_MAX_BODY_BYTES, Sender},
    routing::{Ownership, Shard, ShardMap},
    store::MessageStore,
};
use imdedup_gateway::metrics::GatewayMetrics;
use imdedup_gateway::{
    DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_IN_FLIGHT_PER_CONNECTION, Gateway, GatewayConfig,
    authz::Authorizer, limits::Limits,
};
use imdedup_hops::storage::RemoteStore;
use imdedup_ingest::metrics::{IngestMetrics, WindowMetrics};
use imdedup_ingest::{
    Dedup, DedupCounts, MemoryWindow, MemoryWindowOptions, RedisWindow, RedisWindowOptions,
};
use imdedup_runtime::{
    admin::{Readiness, serve_admin},
    metrics::{Registry, shard_registry},
    server::ServeOptions,
    tls::{InternalTls, names},
    token::{TokenKey, TokenVerifier},
};
use imdedup_storage::metrics::StoreMetrics;
use imdedup_storage::{ScyllaOptions, ScyllaStore, SqliteOptions, SqliteStore};
use tokio::{net::TcpListener, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use without_dedup::{ForgetfulWindow, StoreWithoutUniqueKey};

/// The secret behind [`LocalCluster::token`]: for local use only.
pub const DEV_TOKEN_SECRET: &str = "imdedup-local-dev-secret-not-for-production";

/// The secret behind [`LocalCluster::service_token`] (the business API's
/// service tokens): for local use only.
pub const DEV_SERVICE_TOKEN_SECRET: &str = "imdedup-local-dev-service-secret-not-for-production";

/// Which backends the cluster runs on.
#[derive(Clone)]
#[allow(clippy::large_enum_variant, reason = "built once per cluster")]
pub enum Backends {
    /// The in-process window and SQLite behind the storage service.
    Embedded,
    /// A Redis (or Redis Cluster) window, and ScyllaDB (or Cassandra), which
    /// each ingest shard writes directly and the storage service reads.
    Real {
        redis: RedisWindowOptions,
        scylla: ScyllaOptions,
    },
    /// What a server without dedup does, to show what dedup prevents: a
    /// window that remembers nothing and an in-memory store without a
    /// unique key behind the storage service ([`without_dedup`]), so every
    /// copy that arrives is stored again. Only this local cluster has it.
    WithoutDedup,
}

#[derive(Clone)]
pub struct ClusterOptions {
    pub backends: Backends,
    /// Where the embedded database lives.
    pub data_dir: PathBuf,
    /// Number of ingest shards.
    pub shards: usize,
    pub window: MemoryWindowOptions,
    pub clock: SharedClock,
    pub token_secret: String,
    pub send_timeout: Duration,
    pub storage_timeout: Duration,
    pub max_body_bytes: usize,
    /// Gateway address; port 0 picks a free one.
    pub gateway_addr: SocketAddr,
    /// Gateways, all in front of the same ingest shards (the first at
    /// `gateway_addr`, the others on free ports).
    pub gateways: usize,
    /// The business API's service-token secret; `None` turns the API off.
    pub service_token_secret: Option<String>,
    /// The first gateway's business gRPC address (port 0: a free one);
    /// served when the business API is on.
    pub business_grpc_addr: SocketAddr,
    /// Who may send to and read each conversation (default: direct
    /// conversations only).
    pub authz: Authorizer,
    /// How the services talk to each other (default: plaintext on
    /// loopback). With mutual TLS, the one identity is every service's, so
    /// its certificate must name all three and 127.0.0.1.
    pub internal_tls: InternalTls,
    /// The gRPC servers answer server reflection.
    pub reflection: bool,
    /// What one phone, or all of them, may cost the gateway.
    pub gateway_limits: Limits,
    /// Most phone connections at once, per gateway.
    pub max_connections: usize,
    /// Most sends and pulls in flight on one connection.
    pub max_in_flight_per_connection: usize,
}

impl ClusterOptions {
    pub fn new(data_dir: impl Into<PathBuf>, clock: SharedClock) -> Self {
        Self {
            backends: Backends::Embedded,
            data_dir: data_dir.into(),
            shards: 2,
            window: MemoryWindowOptions::default(),
            clock,
            token_secret: DEV_TOKEN_SECRET.to_owned(),
            send_timeout: Duration::from_secs(5),
            storage_timeout: Duration::from_secs(2),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            gateway_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            gateways: 1,
            service_token_secret: Some(DEV_SERVICE_TOKEN_SECRET.to_owned()),
            business_grpc_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            authz: Authorizer::direct_only(),
            internal_tls: InternalTls::Plaintext,
            reflection: false,
            gateway_limits: Limits::default(),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_in_flight_per_connection: DEFAULT_MAX_IN_FLIGHT_PER_CONNECTION,
        }
    }

    /// How a server that accepts `callers` serves.
    fn serving(&self, callers: &[&str]) -> anyhow::Result<ServeOptions> {
        let callers: Vec<String> = callers.iter().map(|&name| name.to_owned()).collect();
        Ok(ServeOptions {
            reflection: self.reflection,
            tls: self.internal_tls.server(&callers)?,
        })
    }
}

/// A server task and the token that stops it.
struct Running {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Running {
    async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// One service's admin HTTP server (`/metrics`, `/healthz`, `/readyz`).
struct Admin {
    role: String,
    addr: SocketAddr,
    readiness: Readiness,
    running: Running,
}

/// Serve `registry` on a fresh loopback port, ready at once.
async fn start_admin(role: String, mut registry: Registry) -> anyhow::Result<Admin> {
    // One process here: every service shows the same process figures.
    imdedup_runtime::process::register(&mut registry);
    let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
    let addr = listener.local_addr()?;
    let readiness = Readiness::new();
    readiness.set_ready();
    let serving = readiness.clone();
    let registry = Arc::new(registry);
    let running = spawn("admin", move |stop| {
        serve_admin(listener, registry, serving, stop)
    });
    Ok(Admin {
        role,
        addr,
        readiness,
        running,
    })
}

/// One running gateway: its WebSocket and HTTP port, and its business
/// gRPC port when the business API is on.
struct RunningGateway {
    addr: SocketAddr,
    running: Running,
    business_grpc: Option<(SocketAddr, Running)>,
}

/// A running local cluster.
pub struct LocalCluster {
    options: ClusterOptions,
    /// Where the storage service's store counts, kept across restarts.
    storage_metrics: StoreMetrics,
    admins: Vec<Admin>,
    token_key: TokenKey,
    service_key: Option<TokenKey>,
    storage_addr: SocketAddr,
    storage: Option<Running>,
    /// Which shard answers which conversation, as the gateways route (and
    /// where each shard listens).
    shard_map: ShardMap,
    ingests: Vec<(Running, Arc<Dedup>)>,
    gateways: Vec<RunningGateway>,
}

fn spawn<F, E>(name: &'static str, serve: impl FnOnce(CancellationToken) -> F) -> Running
where
    F: Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Display,
{
    let stop = CancellationToken::new();
    let future = serve(stop.clone());
    let task = tokio::spawn(async move {
        if let Err(e) = future.await {
            tracing::error!(service = name, error = %e, "server stopped with an error");
        }
    });
    Running { stop, task }
}

/// Shard `index` of the cluster on `listener`: its window and store as
/// `imdedup ingest` builds them for the cluster's backends, its admin
/// server, and its gRPC server.
async fn start_ingest(
    options: &ClusterOptions,
    storage_url: &str,
    shard_map: &ShardMap,
    index: usize,
    listener: TcpListener,
) -> anyhow::Result<(Admin, (Running, Arc<Dedup>))> {
    let shard_name = shard_name(index);
    let mut registry = Registry::default();
    let shard_metrics = shard_registry(&mut registry, &shard_name);
    let metrics = IngestMetrics::register(shard_metrics);
    let remote_store = || -> anyhow::Result<Arc<dyn MessageStore>> {
        Ok(Arc::new(RemoteStore::connect_lazy(
            storage_url,
            options.storage_timeout,
            &options.internal_tls,
        )?))
    };
    let (window, store): (Arc<dyn RecentWindow>, Arc<dyn MessageStore>) = match &options.backends {
        Backends::Embedded => (
            Arc::new(
                MemoryWindow::with_clock(options.window.clone(), Arc::clone(&options.clock))
                    .with_metrics(metrics.window.clone()),
            ),
            remote_store()?,
        ),
        Backends::WithoutDedup => (Arc::new(ForgetfulWindow), remote_store()?),
        // Each shard has its own window client and its own store (its own
        // seq leases), as separate processes would.
        Backends::Real { redis, scylla } => (
            connecting_window(redis.clone(), metrics.window.clone()).await,
            Arc::new(
                ScyllaStore::open(ScyllaOptions {
                    metrics: StoreMetrics::register(shard_metrics),
                    member_name: shard_name.clone(),
                    ..scylla.clone()
                })
                .await?,
            ),
        ),
    };
    let admin = start_admin(shard_name.clone(), registry).await?;
    let dedup = Arc::new(
        Dedup::new(window, Arc::clone(&store), options.storage_timeout)
            .with_metrics(metrics)
            .with_ownership(Ownership::new(shard_map.clone(), &shard_name)?),
    );
    let serving = Arc::clone(&dedup);
    let max_body = options.max_body_bytes;
    let serve_options = options.serving(&[names::GATEWAY])?;
    let running = spawn("ingest", move |stop| async move {
        let served = imdedup_ingest::serve(listener, serving, max_body, serve_options, stop).await;
        // As the ingest process does: inserts finish, then the store leaves
        // (its conversations free for a successor).
        store.drain().await;
        served
    });
    Ok((admin, (running, dedup)))
}

/// What every gateway of the cluster is wired to.
struct GatewayWiring<'a> {
    shard_map: &'a ShardMap,
    storage_url: &'a str,
    token_key: &'a TokenKey,
    service_key: Option<&'a TokenKey>,
}

/// Gateway `index` (the first at the addresses the options give, the
/// others on free ports), its admin server, and its business gRPC server
/// when the business API is on.
async fn start_gateway(
    options: &ClusterOptions,
    index: usize,
    wiring: GatewayWiring<'_>,
) -> anyhow::Result<(Admin, RunningGateway)> {
    let (addr, business_addr, role) = if index == 0 {
        (
            options.gateway_addr,
            options.business_grpc_addr,
            "gateway".to_owned(),
        )
    } else {
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        (any, any, format!("gateway-{index}"))
    };
    let gateway_listener = bind(addr).await?;
    let gateway_addr = gateway_listener.local_addr()?;
    let mut gateway_registry = Registry::default();
    let gateway_metrics = GatewayMetrics::register(&mut gateway_registry);
    let gateway = Arc::new(
        Gateway::new(GatewayConfig {
            shards: wiring.shard_map.clone(),
            storage: wiring.storage_url.to_owned(),
            internal_tls: options.internal_tls.clone(),
            tokens: TokenVerifier::hs256(wiring.token_key.clone()),
            service_tokens: wiring
                .service_key
                .map(|key| TokenVerifier::hs256(key.clone()).for_services()),
            authz: options.authz.clone(),
            send_timeout: options.send_timeout,
            max_body_bytes: options.max_body_bytes,
            max_connections: options.max_connections,
            max_in_flight_per_connection: options.max_in_flight_per_connection,
            limits: options.gateway_limits.clone(),
            clock: Arc::clone(&options.clock),
        })?
        .with_metrics(gateway_metrics),
    );
    let admin = start_admin(role, gateway_registry).await?;
    // Business clients bring their own tokens; no mutual TLS here.
    let business_grpc = match wiring.service_key {
        Some(_) => {
            let listener = bind(business_addr).await?;
            let business_addr = listener.local_addr()?;
            let gateway = Arc::clone(&gateway);
            let serve_options = ServeOptions {
                reflection: options.reflection,
                tls: None,
            };
            let running = spawn("business grpc", move |stop| {
                imdedup_gateway::business::grpc::serve(listener, gateway, serve_options, stop)
            });
            Some((business_addr, running))
        }
        None => None,
    };
    let running = spawn("gateway", move |stop| {
        imdedup_gateway::serve(gateway_listener, gateway, stop)
    });
    Ok((
        admin,
        RunningGateway {
            addr: gateway_addr,
            running,
            business_grpc,
        },
    ))
}

/// The name of shard `index` in the cluster's shard map, its metrics and
/// its writer membership.
fn shard_name(index: usize) -> String {
    format!("ingest-{index}")
}

/// A shard's Redis window, built as the `imdedup ingest` process builds it
/// (connected in the background, bypassed until then), given a moment to
/// connect so that a cluster started beside a running Redis serves its
/// first sends through the window.
async fn connecting_window(
    options: RedisWindowOptions,
    metrics: WindowMetrics,
) -> Arc<dyn RecentWindow> {
    let window = RedisWindow::connecting(options, metrics);
    if !window.connected_within(REDIS_FIRST_CONNECT).await {
        tracing::warn!(waited = ?REDIS_FIRST_CONNECT, "Redis is not reachable; the shard serves with the window bypassed until it is");
    }
    Arc::new(window)
}

/// How long a starting shard waits for its Redis before it serves without.
const REDIS_FIRST_CONNECT: Duration = Duration::from_secs(3);

async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

impl LocalCluster {
    pub async fn start(options: ClusterOptions) -> anyhow::Result<Self> {
        let token_key = TokenKey::new(options.token_secret.clone())?;
        let service_key = options
            .service_token_secret
            .as_ref()
            .map(|secret| TokenKey::new(secret.clone()))
            .transpose()?;

        let storage_listener = bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let storage_addr = storage_listener.local_addr()?;
        let mut storage_registry = Registry::default();
        let storage_metrics = StoreMetrics::register(&mut storage_registry);
        let storage =
            Some(start_storage(&options, storage_listener, storage_metrics.clone()).await?);
        let storage_url = format!("http://{storage_addr}");
        let mut admins = vec![start_admin("storage".to_owned(), storage_registry).await?];

        // Every shard's port first: the shard map names them all, and each
        // shard answers only the conversations the map gives it, as an
        // `imdedup ingest --shards …` process does.
        let mut listeners = Vec::new();
        for _ in 0..options.shards.max(1) {
            listeners.push(bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?);
        }
        let ingest_addrs = listeners
            .iter()
            .map(TcpListener::local_addr)
            .collect::<Result<Vec<_>, _>>()?;
        let shard_map = ShardMap::new(
            ingest_addrs
                .iter()
                .enumerate()
                .map(|(index, addr)| Shard {
                    name: shard_name(index),
                    url: format!("http://{addr}"),
                })
                .collect(),
        )?;
        let mut ingests = Vec::new();
        for (index, listener) in listeners.into_iter().enumerate() {
            let (admin, ingest) =
                start_ingest(&options, &storage_url, &shard_map, index, listener).await?;
            admins.push(admin);
            ingests.push(ingest);
        }
        let mut gateways = Vec::new();
        for index in 0..options.gateways.max(1) {
            let wiring = GatewayWiring {
                shard_map: &shard_map,
                storage_url: &storage_url,
                token_key: &token_key,
                service_key: service_key.as_ref(),
            };
            let (admin, gateway) = start_gateway(&options, index, wiring).await?;
            admins.push(admin);
            gateways.push(gateway);
        }

        Ok(Self {
            options,
            storage_metrics,
            admins,
            token_key,
            service_key,
            storage_addr,
            storage,
            shard_map,
            ingests,
            gateways,
        })
    }

    /// The phones' WebSocket URL (of the first gateway).
    pub fn gateway_url(&self) -> String {
        format!("ws://{}/v1/ws", self.gateway_addr())
    }

    pub fn gateway_addr(&self) -> SocketAddr {
        self.gateways[0].addr
    }

    /// Every gateway's address (its WebSocket and business HTTP port).
    pub fn gateway_addrs(&self) -> Vec<SocketAddr> {
        self.gateways.iter().map(|g| g.addr).collect()
    }

    /// `http://…` URLs of the gateways' business gRPC servers (none when
    /// the business API is off).
    pub fn business_grpc_urls(&self) -> Vec<String> {
        self.gateways
            .iter()
            .filter_map(|g| g.business_grpc.as_ref())
            .map(|(addr, _)| format!("http://{addr}"))
            .collect()
    }

    /// A service token for the business API: the system `service`, which
    /// may send as each of `senders` (`"*"`: anyone), valid for a day of
    /// the cluster's clock.
    pub fn service_token(&self, service: &str, senders: &[&str]) -> anyhow::Result<String> {
        let key = self
            .service_key
            .as_ref()
            .context("the business API is off (no service token secret)")?;
        let senders: Vec<String> = senders.iter().map(|s| (*s).to_owned()).collect();
        let exp = self.options.clock.unix_seconds() + 86_400;
        Ok(key.mint_service(&Sender::parse(service)?, &senders, exp))
    }

    /// `http://…` URLs of the ingest shards' gRPC servers.
    pub fn ingest_urls(&self) -> Vec<String> {
        self.shard_map
            .shards()
            .iter()
            .map(|shard| shard.url.clone())
            .collect()
    }

    /// `http://…` URL of the ingest shard that owns `conversation` (the
    /// others refuse it, retryably).
    pub fn owner_ingest_url(&self, conversation: &str) -> anyhow::Result<String> {
        let conversation = ConversationId::parse(conversation)?;
        Ok(self.shard_map.shards()[self.shard_map.owner(&conversation)]
            .url
            .clone())
    }

    /// `http://…` URL of the storage gRPC server.
    pub fn storage_url(&self) -> String {
        format!("http://{}", self.storage_addr)
    }

    /// The admin HTTP servers (`/metrics`, `/healthz`, `/readyz`), one per
    /// service: `storage`, `ingest-0`, `ingest-1`, …, `gateway`.
    pub fn admin_addrs(&self) -> Vec<(String, SocketAddr)> {
        self.admins
            .iter()
            .map(|admin| (admin.role.clone(), admin.addr))
            .collect()
    }

    /// A token for `user`, valid for a day of the cluster's clock.
    pub fn token(&self, user: &str) -> anyhow::Result<String> {
        self.token_valid_for(user, Duration::from_secs(86_400))
    }

    pub fn token_valid_for(&self, user: &str, ttl: Duration) -> anyhow::Result<String> {
        let sender = Sender::parse(user)?;
        let exp = self.options.clock.unix_seconds() + ttl.as_secs();
        Ok(self.token_key.mint(&sender, exp))
    }

    /// What the ingest shards decided, summed.
    pub fn dedup_counts(&self) -> DedupCounts {
        self.ingests
            .iter()
            .map(|(_, dedup)| dedup.stats().snapshot())
            .fold(DedupCounts::default(), |a, b| DedupCounts {
                stored: a.stored + b.stored,
                duplicate_window: a.duplicate_window + b.duplicate_window,
                duplicate_unique_key: a.duplicate_unique_key + b.duplicate_unique_key,
                in_flight_conflicts: a.in_flight_conflicts + b.in_flight_conflicts,
                joined_in_flight: a.joined_in_flight + b.joined_in_flight,
                shed_after_deadline: a.shed_after_deadline + b.shed_after_deadline,
                window_bypassed: a.window_bypassed + b.window_bypassed,
                failed: a.failed + b.failed,
            })
    }

    /// Stop the storage server (the database stays on disk).
    pub async fn stop_storage(&mut self) {
        if let Some(storage) = self.storage.take() {
            storage.stop().await;
        }
    }

    /// Start storage again on the same port and database (without dedup, on
    /// an empty store: that one lives in memory).
    pub async fn restart_storage(&mut self) -> anyhow::Result<()> {
        self.stop_storage().await;
        // The old writer thread lets go of the file once its queue closes.
        let listener = bind(self.storage_addr).await?;
        self.storage =
            Some(start_storage(&self.options, listener, self.storage_metrics.clone()).await?);
        Ok(())
    }

    /// Stop every server, gateway first, and wait for them; the admin
    /// servers report not ready from the start and stop last.
    pub async fn shutdown(self) {
        for admin in &self.admins {
            admin.readiness.set_draining();
        }
        for gateway in self.gateways {
            if let Some((_, business)) = gateway.business_grpc {
                business.stop().await;
            }
            gateway.running.stop().await;
        }
        for (ingest, _) in self.ingests {
            ingest.stop().await;
        }
        if let Some(storage) = self.storage {
            storage.stop().await;
        }
        for admin in self.admins {
            admin.running.stop().await;
        }
    }
}

async fn start_storage(
    options: &ClusterOptions,
    listener: TcpListener,
    metrics: StoreMetrics,
) -> anyhow::Result<Running> {
    let store: Arc<dyn MessageStore> = match &options.backends {
        Backends::Embedded => {
            let mut sqlite = SqliteOptions::new(options.data_dir.join("messages.db"));
            sqlite.metrics = metrics;
            Arc::new(SqliteStore::open(&sqlite).context("cannot open the embedded database")?)
        }
        Backends::WithoutDedup => Arc::new(StoreWithoutUniqueKey::new()),
        Backends::Real { scylla, .. } => Arc::new(
            ScyllaStore::open(ScyllaOptions {
                metrics,
                member_name: "storage".to_owned(),
                ..scylla.clone()
            })
            .await?,
        ),
    };
    let serve_options = options.serving(&[names::INGEST, names::GATEWAY])?;
    Ok(spawn("storage", move |stop| async move {
        let served =
            imdedup_storage::serve(listener, Arc::clone(&store), serve_options, stop).await;
        store.drain().await;
        served
    }))
}
