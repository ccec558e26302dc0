//! A local cluster for your own client: prints the WebSocket URL, the gRPC
//! endpoints and dev tokens, and runs until Ctrl-C.

use std::{
    fmt::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::Context;

use clap::Args;
use imdedup_cluster::{
    Backends, ClusterOptions, DEV_SERVICE_TOKEN_SECRET, DEV_TOKEN_SECRET, LocalCluster,
};
use imdedup_domain::clock::SystemClock;
use imdedup_runtime::secret::redact_url;

use crate::{authz::AuthzMode, backends::LocalBackendArgs, limits::LimitArgs};
use imdedup_gateway::authz::{Authorizer, GroupsFile};

/// Time given to what is in flight after Ctrl-C or SIGTERM (the services'
/// default `--grace`).
const GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, Args)]
pub struct DevArgs {
    /// Address of the gateway's WebSocket server (and of the business
    /// API's `POST /v1/messages`).
    #[arg(long, default_value = "127.0.0.1:7100")]
    listen: SocketAddr,
    /// Address of the business API's gRPC server [default: the --listen
    /// address with its port + 10 (127.0.0.1:7110), or any free port when
    /// --listen asks for one (port 0)].
    #[arg(long)]
    business_grpc_listen: Option<SocketAddr>,
    /// Directory of the embedded database; kept between runs.
    #[arg(long, default_value = "imdedup-data")]
    data_dir: PathBuf,
    /// Number of ingest shards.
    #[arg(long, default_value_t = 2)]
    shards: usize,
    /// Users to print tokens for, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "ana,ben,carl")]
    users: Vec<String>,
    /// Group conversations and their members (JSON); default: a groups.json
    /// in the data directory, written with one group of --users if missing.
    #[arg(long)]
    groups_file: Option<PathBuf>,
    /// `open` lets any user send to and read any conversation (loudly).
    #[arg(long, value_enum, default_value = "members")]
    authz: AuthzMode,
    #[command(flatten)]
    backends: LocalBackendArgs,
    /// The gateway's limits, the flags of `imdedup gateway` (to try a
    /// deployment's limits, such as the chart's, on one machine).
    #[command(flatten)]
    limits: LimitArgs,
}

pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    let mut options = ClusterOptions::new(&args.data_dir, Arc::new(SystemClock));
    options.gateway_addr = args.listen;
    options.business_grpc_addr = args
        .business_grpc_listen
        .unwrap_or_else(|| business_grpc_beside(args.listen));
    options.shards = args.shards;
    options.gateway_limits = args.limits.limits();
    args.backends.apply(&mut options)?;
    let groups_file = args
        .groups_file
        .clone()
        .unwrap_or_else(|| args.data_dir.join("groups.json"));
    options.authz = match args.authz {
        AuthzMode::Open => Authorizer::Open,
        AuthzMode::Members => {
            write_default_groups(&groups_file, &args.users)?;
            Authorizer::members(GroupsFile::open(&groups_file)?)
        }
    };
    let backends = match &options.backends {
        Backends::Real { redis, scylla } => {
            format!(
                "Redis {:?}, ScyllaDB {:?}",
                redis.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>(),
                scylla.nodes
            )
        }
        Backends::Embedded => format!("embedded backends, data in {}", args.data_dir.display()),
        Backends::WithoutDedup => "no dedup: a window that remembers nothing and a store without \
             a unique key, in memory"
            .to_owned(),
    };
    crate::authz::warn_if_open(&options.authz);
    // From here on a Ctrl-C or SIGTERM stops the cluster gracefully, even
    // one that comes while it starts or prints its banner.
    let stop = crate::shutdown::signal();
    let cluster = LocalCluster::start(options).await?;
    let mut banner = String::new();
    writeln!(banner, "imdedup dev cluster ({backends})")?;
    if args.authz == AuthzMode::Members {
        writeln!(
            banner,
            "  authorization on: direct conversations dm:<a>:<b> (names sorted), groups in {} (read again when it changes):",
            groups_file.display()
        )?;
        writeln!(
            banner,
            "    {}",
            std::fs::read_to_string(&groups_file)?.trim()
        )?;
    }
    if args.backends.no_dedup {
        writeln!(
            banner,
            "  DEDUP IS OFF (--no-dedup): every copy that arrives is stored"
        )?;
    }
    writeln!(banner, "  WebSocket   {}", cluster.gateway_url())?;
    writeln!(banner, "  ingest gRPC {}", cluster.ingest_urls().join(" "))?;
    writeln!(banner, "  storage gRPC {}", cluster.storage_url())?;
    for (role, addr) in cluster.admin_addrs() {
        writeln!(
            banner,
            "  admin {role:<9} http://{addr}/metrics (and /healthz, /readyz)"
        )?;
    }
    writeln!(banner, "  token secret {DEV_TOKEN_SECRET:?} (dev only)")?;
    for user in &args.users {
        writeln!(banner, "  token for {user}: {}", cluster.token(user)?)?;
    }
    writeln!(
        banner,
        "Try: websocat '{}?token=<token>' and send",
        cluster.gateway_url()
    )?;
    writeln!(
        banner,
        r#"  {{"type":"send","id":"m1","conversation":"dm:ana:ben","body":"hello"}}"#
    )?;
    // The business API, for a system account that may send as itself.
    let bot = "orders-bot";
    let service_token = cluster.service_token(bot, &[bot])?;
    writeln!(
        banner,
        "Business API (service token secret {DEV_SERVICE_TOKEN_SECRET:?}, dev only):"
    )?;
    writeln!(
        banner,
        "  HTTP http://{}/v1/messages   gRPC {} (imdedup.v1.BusinessService)",
        cluster.gateway_addr(),
        cluster.business_grpc_urls().join(" ")
    )?;
    writeln!(
        banner,
        "  service token for {bot} (senders: {bot}): {service_token}"
    )?;
    let to = args.users.first().map_or("ana", String::as_str);
    let conversation = if to < bot {
        format!("dm:{to}:{bot}")
    } else {
        format!("dm:{bot}:{to}")
    };
    writeln!(
        banner,
        "  curl -sS http://{}/v1/messages -H 'Authorization: Bearer {service_token}' \\\n    \
         -H 'Idempotency-Key: order-1234:shipped' -H 'Content-Type: application/json' \\\n    \
         -d '{{\"sender\":\"{bot}\",\"conversation\":\"{conversation}\",\"body\":\"Your order shipped\"}}'",
        cluster.gateway_addr()
    )?;
    writeln!(banner, "Ctrl-C stops.")?;
    print_banner(&banner);
    stop.await;
    // As the standalone services: what is in flight gets a grace period; a
    // client that keeps an idle connection open does not hold the exit.
    if tokio::time::timeout(GRACE, cluster.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(?GRACE, "grace period over, stopping with connections open");
    }
    Ok(())
}

/// Print the banner in one write, so that a reader who stops reading after
/// the line it wanted (a script, `| head`) cannot break a later line; a
/// closed stdout is not a reason to stop serving.
fn print_banner(banner: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = stdout
        .write_all(banner.as_bytes())
        .and_then(|()| stdout.flush());
}

/// The business gRPC address that goes with the WebSocket address
/// `listen`: the same host, port + 10; any free port when `listen` asks for
/// one, so two dev clusters started with port 0 do not clash.
fn business_grpc_beside(listen: SocketAddr) -> SocketAddr {
    let port = match listen.port() {
        0 => 0,
        port => port.saturating_add(10),
    };
    SocketAddr::new(listen.ip(), port)
}

/// Write a groups file with one group, `team`, of `users`, unless one is
/// there already (the user's edits are kept between runs).
fn write_default_groups(path: &Path, users: &[String]) -> anyhow::Result<()> {
    if path.exists() {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let groups = serde_json::json!({ "team": users });
    std::fs::write(path, format!("{groups}\n"))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        dev: DevArgs,
    }

    #[test]
    fn dev_takes_the_gateways_limit_flags() {
        let args = Wrap::try_parse_from([
            "dev",
            "--authz",
            "open",
            "--max-held-bytes",
            "67108864",
            "--max-sends-in-flight",
            "300",
        ])
        .expect("dev's flags");
        let limits = args.dev.limits.limits();
        assert_eq!(limits.max_held_bytes, 64 << 20);
        assert_eq!(limits.max_sends_in_flight, 300);
        let defaults = Wrap::try_parse_from(["dev"]).expect("no flags");
        assert_eq!(
            format!("{:?}", defaults.dev.limits.limits()),
            format!("{:?}", imdedup_gateway::limits::Limits::default()),
            "without flags, the gateway's defaults"
        );
    }

    #[test]
    fn the_business_grpc_port_follows_the_websocket_port() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(
            business_grpc_beside(at("127.0.0.1:7100")),
            at("127.0.0.1:7110")
        );
        assert_eq!(business_grpc_beside(at("127.0.0.1:0")), at("127.0.0.1:0"));
        assert_eq!(
            business_grpc_beside(at("127.0.0.2:9000")),
            at("127.0.0.2:9010")
        );
    }
}
