//! The `imdedup` command: each service as its own process, plus the demo and
//! a local dev cluster. Parsing and wiring only; the services are libraries.

mod authz;
mod backends;
mod certs;
mod demo;
mod dev;
mod limits;
mod memory;
mod services;
mod shutdown;
mod tls;

use clap::{Parser, Subcommand};
use imdedup_runtime::telemetry;

// Many small allocations on many threads: glibc's arenas contend under load.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// imdedup: the send path of an IM backend that never loses a message and
/// never stores one twice.
#[derive(Parser)]
#[command(name = "imdedup", version, about, long_about = None)]
struct Cli {
    /// Check the command's flags and environment, print `config ok`, and
    /// exit without binding a port or connecting anywhere (for deployment
    /// checks such as the Helm chart's test).
    #[arg(long, global = true)]
    check_config: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the book's scenario on a local cluster with embedded backends and
    /// print what the receiver sees.
    Demo(demo::DemoArgs),
    /// Run a local cluster for your own client; print the WebSocket URL and
    /// dev tokens.
    Dev(dev::DevArgs),
    /// Run the storage service (gRPC).
    Storage(services::StorageArgs),
    /// Run one ingest shard (gRPC).
    Ingest(services::IngestArgs),
    /// Run the gateway (WebSocket for phones).
    Gateway(services::GatewayArgs),
    /// Create or update the ScyllaDB schema, then exit.
    Migrate(services::MigrateArgs),
    /// Mint a token for a user, signed with the gateway's secret; or, with
    /// --service, a service token for the business API.
    Token(services::TokenArgs),
    /// Answer group membership (`imdedup.v1.MembershipService`) from a
    /// groups file, for gateways started with --membership-url.
    Membership(authz::MembershipArgs),
    /// Write a throwaway CA and a certificate per service, for running the
    /// services by hand over mutual TLS (local runs only).
    Certs(certs::CertsArgs),
}

impl Command {
    /// The default `service.name` of the process's traces (`OTEL_SERVICE_NAME`
    /// wins) and the default log filter (`RUST_LOG` wins). The demo and dev
    /// run every service in one process, with one tracer: `imdedup`.
    fn telemetry_defaults(&self) -> Option<(&'static str, &'static str)> {
        match self {
            Command::Demo(_) => Some(("imdedup", "warn")),
            Command::Dev(_) => Some(("imdedup", "info")),
            Command::Storage(_) => Some(("imdedup-storage", "info")),
            Command::Ingest(_) => Some(("imdedup-ingest", "info")),
            Command::Gateway(_) => Some(("imdedup-gateway", "info")),
            Command::Migrate(_) => Some(("imdedup-migrate", "warn")),
            Command::Token(_) | Command::Certs(_) => None,
            Command::Membership(_) => Some(("imdedup-membership", "info")),
        }
    }
}

impl Command {
    /// `--check-config`: everything the command's flags say, checked as the
    /// command itself would before its first I/O. The local clusters (demo,
    /// dev) have nothing to check beyond parsing.
    fn check(&self) -> anyhow::Result<()> {
        match self {
            Command::Demo(_) | Command::Dev(_) | Command::Certs(_) => Ok(()),
            Command::Storage(args) => args.check(),
            Command::Ingest(args) => args.check(),
            Command::Gateway(args) => args.check(),
            Command::Migrate(args) => args.check(),
            Command::Token(args) => args.check(),
            Command::Membership(args) => args.check(),
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let huge_pages_off = memory::no_huge_pages(std::env::var_os(memory::ALLOW_THP_VAR));
    let cli = Cli::parse();
    if cli.check_config {
        cli.command.check()?;
        println!("config ok");
        return Ok(());
    }
    let telemetry = match cli.command.telemetry_defaults() {
        Some((service, filter)) => Some(telemetry::init(service, filter)?),
        None => None,
    };
    if let Err(e) = huge_pages_off {
        tracing::warn!(error = %e, "cannot turn transparent huge pages off; heap growth under load costs more CPU with them");
    }
    let result = match cli.command {
        Command::Demo(args) => demo::run(args).await,
        Command::Dev(args) => dev::run(args).await,
        Command::Storage(args) => services::storage(args).await,
        Command::Ingest(args) => services::ingest(args).await,
        Command::Gateway(args) => services::gateway(args).await,
        Command::Migrate(args) => services::migrate(args).await,
        Command::Token(args) => services::token(args),
        Command::Certs(args) => certs::run(args),
        Command::Membership(args) => authz::membership(args).await,
    };
    if let Some(telemetry) = telemetry {
        telemetry.shutdown().await;
    }
    result
}
