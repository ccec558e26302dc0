//! A local cluster for your own client: prints the WebSocket URL, the gRPC
//! endpoints and dev tokens, and runs until Ctrl-C.

use std::{net::SocketAddr, path::PathBuf, sync::Arc};

use clap::Args;
use imdedup_cluster::{Backends, ClusterOptions, DEV_TOKEN_SECRET, LocalCluster};
use imdedup_core::clock::SystemClock;
use imdedup_ingest::MemoryWindowOptions;

use crate::backends::{RedisArgs, ScyllaArgs, local_backends};

#[derive(Debug, Args)]
pub struct DevArgs {
    /// Address of the gateway's WebSocket server.
    #[arg(long, default_value = "127.0.0.1:7100")]
    listen: SocketAddr,
    /// Directory of the embedded database; kept between runs.
    #[arg(long, default_value = "imdedup-data")]
    data_dir: PathBuf,
    /// Number of ingest shards.
    #[arg(long, default_value_t = 2)]
    shards: usize,
    /// Users to print tokens for, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "ana,ben")]
    users: Vec<String>,
    /// How long the recent-ID window remembers a stored ID.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    window_ttl: std::time::Duration,
    /// Switch dedup off (store whatever arrives), for demonstrations.
    #[arg(long)]
    no_dedup: bool,
    #[command(flatten)]
    redis: RedisArgs,
    #[command(flatten)]
    scylla: ScyllaArgs,
}

pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    let mut options = ClusterOptions::new(&args.data_dir, Arc::new(SystemClock));
    options.gateway_addr = args.listen;
    options.shards = args.shards;
    options.window = MemoryWindowOptions {
        ttl: args.window_ttl,
        ..MemoryWindowOptions::default()
    };
    options.backends = local_backends(&args.redis, &args.scylla, args.window_ttl)?;
    let backends = match &options.backends {
        Backends::Real { redis, scylla } => {
            format!("Redis {:?}, ScyllaDB {:?}", redis.urls, scylla.nodes)
        }
        Backends::Embedded => format!("embedded backends, data in {}", args.data_dir.display()),
    };
    options.dedup_off = args.no_dedup;
    let cluster = LocalCluster::start(options).await?;
    println!("imdedup dev cluster ({backends})");
    if args.no_dedup {
        println!("  DEDUP IS OFF (--no-dedup): every copy that arrives is stored");
    }
    println!("  WebSocket   {}", cluster.gateway_url());
    println!("  ingest gRPC {}", cluster.ingest_urls().join(" "));
    println!("  storage gRPC {}", cluster.storage_url());
    println!("  token secret {DEV_TOKEN_SECRET:?} (dev only)");
    for user in &args.users {
        println!("  token for {user}: {}", cluster.token(user)?);
    }
    println!(
        "Try: websocat '{}?token=<token>' and send",
        cluster.gateway_url()
    );
    println!(r#"  {{"type":"send","id":"m1","conversation":"ana-ben","body":"hello"}}"#);
    println!("Ctrl-C stops.");
    crate::shutdown::signal().await;
    cluster.shutdown().await;
    Ok(())
}
