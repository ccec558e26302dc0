//! The `--redis` and `--scylla` options shared by the services, the demo and
//! the dev cluster. Unset, the embedded backends are used.

use std::{path::PathBuf, time::Duration};

use crate::services::duration;
use clap::Args;
use imdedup_cluster::{Backends, ClusterOptions};
use imdedup_ingest::{MemoryWindowOptions, RedisWindowOptions, window::DEFAULT_CLAIM_TTL};
use imdedup_runtime::secret::Secret;
use imdedup_storage::{
    ScyllaOptions,
    scylla::{parse_consistency, parse_serial_consistency},
};

/// The backend flags of a local cluster (`demo`, `dev`).
#[derive(Debug, Clone, Args)]
pub struct LocalBackendArgs {
    /// How long the recent-ID window remembers a stored ID.
    #[arg(long, default_value = "5m", value_parser = duration)]
    pub window_ttl: Duration,
    /// Run without dedup: a window that remembers nothing and an in-memory
    /// store without a unique key, so whatever arrives is stored; to see
    /// the repeats dedup prevents. Local mode only; not with --redis or
    /// --scylla.
    #[arg(long)]
    pub no_dedup: bool,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub scylla: ScyllaArgs,
}

impl LocalBackendArgs {
    /// Set the window and the backends of `options`: the real backends when
    /// both --redis and --scylla are given, the embedded ones when neither
    /// is, and the backends without dedup with --no-dedup.
    pub fn apply(&self, options: &mut ClusterOptions) -> anyhow::Result<()> {
        options.window = MemoryWindowOptions {
            ttl: self.window_ttl,
            ..MemoryWindowOptions::default()
        };
        let redis = self.redis.options(self.window_ttl, DEFAULT_CLAIM_TTL)?;
        let scylla = self.scylla.options_with_default_rf(1)?;
        options.backends = match (redis, scylla) {
            (None, None) if self.no_dedup => Backends::WithoutDedup,
            _ if self.no_dedup => anyhow::bail!(
                "--no-dedup runs on backends of its own (in memory): drop --redis and --scylla"
            ),
            (Some(redis), Some(scylla)) => Backends::Real { redis, scylla },
            (None, None) => Backends::Embedded,
            _ => anyhow::bail!("give both --redis and --scylla, or neither (embedded backends)"),
        };
        Ok(())
    }
}

#[derive(Debug, Clone, Args)]
pub struct RedisArgs {
    /// Redis for the recent-ID window: `redis://[user:password@]host:port[/db]`,
    /// `rediss://` for TLS. Several comma-separated URLs (or --redis-cluster)
    /// mean a Redis Cluster. Unset: the in-process window.
    #[arg(
        long = "redis",
        env = "IMDEDUP_REDIS_URL",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub redis_urls: Vec<String>,
    /// Treat the URL as a seed of a Redis Cluster.
    #[arg(long, env = "IMDEDUP_REDIS_CLUSTER")]
    pub redis_cluster: bool,
    /// Prefix of every window key.
    #[arg(long, env = "IMDEDUP_REDIS_KEY_PREFIX", default_value = "i:")]
    pub redis_key_prefix: String,
    /// Deadline of each Redis call; past it the window is bypassed.
    #[arg(long, env = "IMDEDUP_REDIS_TIMEOUT", default_value = "250ms", value_parser = duration)]
    pub redis_timeout: Duration,
    /// After a Redis outage, the time over which the window gets all claims
    /// back (a growing share; the rest go to the unique key).
    #[arg(long, env = "IMDEDUP_REDIS_WARMUP", default_value = "5s", value_parser = duration)]
    pub redis_warmup: Duration,
    /// PEM file of the CA for `rediss://` (default: the public web roots).
    #[arg(long, env = "IMDEDUP_REDIS_CA")]
    pub redis_ca: Option<PathBuf>,
}

impl RedisArgs {
    /// Window options, or `None` for the in-process window.
    pub fn options(
        &self,
        ttl: Duration,
        claim_ttl: Duration,
    ) -> anyhow::Result<Option<RedisWindowOptions>> {
        if self.redis_urls.is_empty() {
            return Ok(None);
        }
        let mut options = RedisWindowOptions::new(self.redis_urls.clone());
        options.cluster |= self.redis_cluster;
        options.key_prefix = self.redis_key_prefix.clone();
        options.timeout = self.redis_timeout;
        options.warmup = self.redis_warmup;
        options.ttl = ttl;
        options.claim_ttl = claim_ttl;
        options.ca_file = self.redis_ca.clone();
        options.check()?;
        Ok(Some(options))
    }
}

#[derive(Debug, Clone, Args)]
pub struct ScyllaArgs {
    /// ScyllaDB contact points, `host:port`, comma-separated. Unset: the
    /// embedded store.
    #[arg(long = "scylla", env = "IMDEDUP_SCYLLA_NODES", value_delimiter = ',')]
    pub scylla_nodes: Vec<String>,
    /// Keyspace (created by the migration if missing).
    #[arg(long, env = "IMDEDUP_SCYLLA_KEYSPACE", default_value = "imdedup")]
    pub scylla_keyspace: String,
    /// Replication factor the migration gives a new keyspace [default: 3
    /// for the services, 1 for demo and dev].
    #[arg(long, env = "IMDEDUP_SCYLLA_REPLICATION_FACTOR")]
    pub scylla_replication_factor: Option<u32>,
    /// Consistency of reads and writes.
    #[arg(
        long,
        env = "IMDEDUP_SCYLLA_CONSISTENCY",
        default_value = "local_quorum"
    )]
    pub scylla_consistency: String,
    /// Serial consistency of the lightweight transactions.
    #[arg(
        long,
        env = "IMDEDUP_SCYLLA_SERIAL_CONSISTENCY",
        default_value = "local_serial"
    )]
    pub scylla_serial_consistency: String,
    #[arg(long, env = "IMDEDUP_SCYLLA_USER")]
    pub scylla_user: Option<String>,
    #[arg(long, env = "IMDEDUP_SCYLLA_PASSWORD", hide_env_values = true)]
    pub scylla_password: Option<Secret>,
    /// Connect with TLS, trusting the CA in this PEM file.
    #[arg(long, env = "IMDEDUP_SCYLLA_CA")]
    pub scylla_ca: Option<PathBuf>,
    /// The datacenter to talk to, with no failover to others. Required on a
    /// cluster of several datacenters with LOCAL_SERIAL (the default), which
    /// is linearizable within one datacenter only: give every ingest of a
    /// deployment the same one.
    #[arg(long, env = "IMDEDUP_SCYLLA_LOCAL_DC")]
    pub scylla_local_dc: Option<String>,
    /// Deadline of each database request.
    #[arg(long, env = "IMDEDUP_SCYLLA_TIMEOUT", default_value = "2s", value_parser = duration)]
    pub scylla_timeout: Duration,
    /// Create or update the schema at startup. Turn it off where a separate
    /// step runs `imdedup migrate` (the Helm chart's hook), so that pods
    /// never race on schema changes.
    #[arg(
        long,
        env = "IMDEDUP_SCYLLA_MIGRATE",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub scylla_migrate: bool,
    /// How long one heartbeat keeps a writer's conversations its own; past
    /// it (a crash, a partition) another writer may take them over.
    #[arg(long, env = "IMDEDUP_SCYLLA_MEMBER_TTL", default_value = "10s", value_parser = duration)]
    pub scylla_member_ttl: Duration,
    /// Most difference between two processes' clocks allowed for.
    #[arg(long, env = "IMDEDUP_SCYLLA_CLOCK_SKEW", default_value = "2s", value_parser = duration)]
    pub scylla_clock_skew: Duration,
    /// Age past which a reader settles a pending history row itself (its
    /// writer died between its writes and no resend came). Until then
    /// readers of that conversation stop before it.
    #[arg(long, env = "IMDEDUP_SCYLLA_PENDING_FENCE", default_value = "30s", value_parser = duration)]
    pub scylla_pending_fence: Duration,
}

impl ScyllaArgs {
    /// Store options, or `None` for the embedded store.
    pub fn options(&self) -> anyhow::Result<Option<ScyllaOptions>> {
        self.options_with_default_rf(3)
    }

    /// As [`Self::options`], with another default replication factor.
    pub fn options_with_default_rf(
        &self,
        default_rf: u32,
    ) -> anyhow::Result<Option<ScyllaOptions>> {
        if self.scylla_nodes.is_empty() {
            return Ok(None);
        }
        let mut options = ScyllaOptions::new(self.scylla_nodes.clone());
        options.keyspace = self.scylla_keyspace.clone();
        options.replication_factor = self.scylla_replication_factor.unwrap_or(default_rf);
        options.consistency = parse_consistency(&self.scylla_consistency)?;
        options.serial_consistency = parse_serial_consistency(&self.scylla_serial_consistency)?;
        options.user = self.scylla_user.clone();
        options.password = self.scylla_password.clone();
        options.tls_ca = self.scylla_ca.clone();
        options.request_timeout = self.scylla_timeout;
        options.migrate = self.scylla_migrate;
        options.local_dc = self.scylla_local_dc.clone();
        options.member_ttl = self.scylla_member_ttl;
        options.clock_skew = self.scylla_clock_skew;
        options.pending_fence = self.scylla_pending_fence;
        options.check()?;
        Ok(Some(options))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        redis: RedisArgs,
        #[command(flatten)]
        scylla: ScyllaArgs,
    }

    #[test]
    fn passwords_show_in_no_debug_output_and_no_help() {
        let args = Wrap::try_parse_from([
            "ingest",
            "--redis",
            "redis://app:redis-pw-1@r:6379",
            "--scylla",
            "s:9042",
            "--scylla-user",
            "app",
            "--scylla-password",
            "scylla-pw-2",
        ])
        .unwrap();
        let redis = args
            .redis
            .options(Duration::from_secs(60), Duration::from_secs(3))
            .unwrap()
            .unwrap();
        let scylla = args.scylla.options().unwrap().unwrap();
        let shown = format!("{redis:?} {scylla:?}");
        assert!(!shown.contains("redis-pw-1"), "{shown}");
        assert!(!shown.contains("scylla-pw-2"), "{shown}");
        assert!(shown.contains("redis://app:..@r:6379"), "{shown}");

        // --help would print an environment variable's value unless hidden.
        use clap::CommandFactory;
        let command = Wrap::command();
        for var in ["IMDEDUP_REDIS_URL", "IMDEDUP_SCYLLA_PASSWORD"] {
            let arg = command
                .get_arguments()
                .find(|a| a.get_env().is_some_and(|e| e == var))
                .unwrap();
            assert!(arg.is_hide_env_values_set(), "{var} would show in --help");
        }
    }
}
