//! `imdedup ingest`: one ingest shard.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context;
use clap::Args;
use imdedup_domain::window::RecentWindow;
use imdedup_domain::{
    model::DEFAULT_MAX_BODY_BYTES,
    routing::{Ownership, ShardMap},
    store::MessageStore,
};
use imdedup_hops::storage::RemoteStore;
use imdedup_ingest::{
    Dedup, MemoryWindow, MemoryWindowOptions, RedisWindow, RedisWindowOptions,
    db_limit::DbLimitOptions,
};
use imdedup_runtime::metrics::{Registry, shard_registry};
use imdedup_storage::{ScyllaOptions, ScyllaStore};

use crate::backends::{RedisArgs, ScyllaArgs};
use crate::tls::{InternalTlsArgs, serve_options};
use imdedup_runtime::tls::{InternalTls, names};

use super::*;
use imdedup_ingest::metrics::IngestMetrics;
use imdedup_storage::metrics::StoreMetrics;

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
    /// How long a send beyond the limit may wait for a place before it is
    /// refused with `overloaded` (0s: refused at once).
    #[arg(long, env = "IMDEDUP_DB_QUEUE_WAIT", default_value = "800ms", value_parser = duration)]
    pub db_queue_wait: Duration,
    /// Fail this share (0 to 1) of the writes that publish a stored
    /// message, as if the database had timed out: for fault tests only (a
    /// build with the `testing` feature).
    #[cfg(feature = "testing")]
    #[arg(long, env = "IMDEDUP_FAULT_COMMIT_FAILURES")]
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

/// What the ingest flags say, checked, before any I/O.
pub(super) struct IngestPlan {
    shard: String,
    tls: InternalTls,
    serving: imdedup_runtime::server::ServeOptions,
    pub(super) ownership: Option<Ownership>,
    scylla: Option<ScyllaOptions>,
    redis: Option<RedisWindowOptions>,
}

impl IngestArgs {
    pub(super) fn plan(&self) -> anyhow::Result<IngestPlan> {
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
            #[cfg(feature = "testing")]
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
        Some(redis) => Arc::new(RedisWindow::connecting(redis, metrics.window.clone())),
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
            queue_wait: args.db_queue_wait,
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
