//! The `imdedup` command: each service as its own process, plus the demo and
//! a local dev cluster. Parsing and wiring only; the services are libraries.

mod backends;
mod demo;
mod dev;
mod services;
mod shutdown;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// imdedup: the send path of an IM backend that never loses a message and
/// never stores one twice.
#[derive(Parser)]
#[command(name = "imdedup", version, about, long_about = None)]
struct Cli {
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
    /// Mint a token for a user, signed with the gateway's secret.
    Token(services::TokenArgs),
}

fn init_tracing(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Demo(args) => {
            init_tracing("warn");
            demo::run(args).await
        }
        Command::Dev(args) => {
            init_tracing("info");
            dev::run(args).await
        }
        Command::Storage(args) => {
            init_tracing("info");
            services::storage(args).await
        }
        Command::Ingest(args) => {
            init_tracing("info");
            services::ingest(args).await
        }
        Command::Gateway(args) => {
            init_tracing("info");
            services::gateway(args).await
        }
        Command::Migrate(args) => {
            init_tracing("warn");
            services::migrate(args).await
        }
        Command::Token(args) => services::token(args),
    }
}
