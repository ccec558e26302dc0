//! Flags for the internal gRPC hops: mutual TLS from files, or plaintext
//! when asked for by name.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use imdedup_runtime::{
    server::ServeOptions,
    tls::{InternalTls, TlsFiles},
};

/// How this process talks to the other imdedup services.
#[derive(Debug, Clone, Args)]
pub struct InternalTlsArgs {
    /// This service's certificate for the internal gRPC hops (PEM, the
    /// chain after it); read again when it changes. Its DNS names are what
    /// the servers it calls check (see --tls-allow-clients).
    #[arg(long, env = "IMDEDUP_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "IMDEDUP_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The CA that signs the services' certificates (PEM).
    #[arg(long, env = "IMDEDUP_TLS_CA", requires = "tls_cert")]
    pub tls_ca: Option<PathBuf>,
    /// Talk to the other services without TLS or authentication: for local
    /// runs only.
    #[arg(long, env = "IMDEDUP_INSECURE_PLAINTEXT", conflicts_with = "tls_cert")]
    pub insecure_plaintext: bool,
}

impl InternalTlsArgs {
    /// Read the certificate files, or say plaintext was asked for.
    pub fn internal_tls(&self) -> anyhow::Result<InternalTls> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(cert), Some(key), Some(ca)) => InternalTls::mutual(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            })
            .context("--tls-cert, --tls-key, --tls-ca"),
            _ if self.insecure_plaintext => Ok(InternalTls::Plaintext),
            _ => anyhow::bail!(
                "the services talk over mutual TLS: give --tls-cert, --tls-key and --tls-ca \
                 (IMDEDUP_TLS_*), or --insecure-plaintext for a local run"
            ),
        }
    }
}

/// How a gRPC server serves: TLS accepting `allowed_clients`, and
/// reflection when asked for.
pub fn serve_options(
    tls: &InternalTls,
    allowed_clients: &[String],
    reflection: bool,
) -> anyhow::Result<ServeOptions> {
    Ok(ServeOptions {
        reflection,
        tls: tls.server(allowed_clients).context("--tls-allow-clients")?,
    })
}

/// Say at start what the internal hops are.
pub fn announce(tls: &InternalTls) {
    match tls {
        InternalTls::Plaintext => tracing::warn!(
            "internal gRPC in PLAINTEXT (--insecure-plaintext): no encryption, and any caller \
             that reaches the port is believed; for local runs only"
        ),
        InternalTls::Mutual(identity) => {
            tracing::info!(?identity, "internal gRPC over mutual TLS");
        }
    }
}
