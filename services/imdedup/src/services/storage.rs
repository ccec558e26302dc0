//! `imdedup storage` and `imdedup migrate`: the message store over gRPC, and
//! the ScyllaDB schema.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use clap::Args;
use imdedup_domain::store::MessageStore;
use imdedup_runtime::metrics::Registry;
use imdedup_storage::metrics::StoreMetrics;
use imdedup_storage::{ScyllaOptions, ScyllaStore, SqliteOptions, SqliteStore};

use crate::backends::ScyllaArgs;
use crate::tls::{InternalTlsArgs, serve_options};
use imdedup_runtime::tls::names;

use super::*;

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
    /// How long a batch that is not full waits for more inserts before its
    /// commit: fewer transactions and fsyncs at low rates, for that much
    /// latency. Inserts are still answered only after their commit.
    #[arg(long, env = "IMDEDUP_STORAGE_COMMIT_DELAY", default_value = "3ms", value_parser = duration)]
    pub commit_delay: Duration,
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

/// What the storage flags say, checked, before any I/O.
pub(super) enum StorageBackend {
    Scylla(Box<ScyllaOptions>),
    Sqlite(SqliteOptions),
}

impl StorageArgs {
    pub(super) fn backend(&self) -> anyhow::Result<StorageBackend> {
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
                options.commit_delay = self.commit_delay;
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
