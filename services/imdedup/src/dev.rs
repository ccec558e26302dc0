//! A local cluster for your own client: prints the WebSocket URL, the gRPC
//! endpoints and dev tokens, and runs until Ctrl-C.

use std::{net::SocketAddr, path::PathBuf, sync::Arc};

use clap::Args;
use imdedup_cluster::{Backends, ClusterOptions, DEV_TOKEN_SECRET, LocalCluster};
use imdedup_core::clock::SystemClock;

use crate::backends::LocalBackendArgs;

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
    #[command(flatten)]
    backends: LocalBackendArgs,
}

pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    let mut options = ClusterOptions::new(&args.data_dir, Arc::new(SystemClock));
    options.gateway_addr = args.listen;
    options.shards = args.shards;
    args.backends.apply(&mut options)?;
    let backends = match &options.backends {
        Backends::Real { redis, scylla } => {
            format!("Redis {:?}, ScyllaDB {:?}", redis.urls, scylla.nodes)
        }
        Backends::Embedded => format!("embedded backends, data in {}", args.data_dir.display()),
    };
    let cluster = LocalCluster::start(options).await?;
    println!("imdedup dev cluster ({backends})");
    if args.backends.no_dedup {
        println!("  DEDUP IS OFF (--no-dedup): every copy that arrives is stored");
    }
    println!("  WebSocket   {}", cluster.gateway_url());
    println!("  ingest gRPC {}", cluster.ingest_urls().join(" "));
    println!("  storage gRPC {}", cluster.storage_url());
    for (role, addr) in cluster.admin_addrs() {
        println!("  admin {role:<9} http://{addr}/metrics (and /healthz, /readyz)");
    }
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
