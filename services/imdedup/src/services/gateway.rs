//! `imdedup gateway`: the phones' WebSocket, the business API, and how
//! tokens are verified.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use clap::Args;
use imdedup_domain::{clock::SystemClock, model::DEFAULT_MAX_BODY_BYTES, routing::ShardMap};
use imdedup_gateway::{Gateway, GatewayConfig};
use imdedup_runtime::{
    metrics::Registry,
    secret::Secret,
    token::{Jwks, TokenKey, TokenPolicy, TokenVerifier},
};

use crate::authz::AuthzArgs;
use crate::tls::InternalTlsArgs;

use super::*;
use imdedup_gateway::metrics::GatewayMetrics;

#[derive(Debug, Args)]
pub struct GatewayArgs {
    /// Address of the WebSocket server.
    #[arg(long, env = "IMDEDUP_GATEWAY_LISTEN", default_value = "127.0.0.1:7100")]
    pub listen: SocketAddr,
    /// Address of the admin HTTP server: /metrics, /healthz, /readyz.
    #[arg(long, env = "IMDEDUP_ADMIN_LISTEN", default_value = "127.0.0.1:9100")]
    pub admin_listen: SocketAddr,
    /// The ingest shards, comma-separated `NAME=URL` entries
    /// (`imdedup-ingest-0=http://imdedup-ingest-0.imdedup-ingest:7200`); a
    /// bare URL is named by the first label of its host. Conversations are
    /// routed by name: every gateway and ingest must have the same names.
    #[arg(long, env = "IMDEDUP_SHARDS", value_delimiter = ',', required = true)]
    pub shards: Vec<String>,
    /// URL of the storage service, for history pulls.
    #[arg(
        long,
        env = "IMDEDUP_STORAGE_URL",
        default_value = "http://127.0.0.1:7300"
    )]
    pub storage: String,
    #[command(flatten)]
    pub tokens: TokenArgsForGateway,
    #[command(flatten)]
    pub business: BusinessArgs,
    /// Deadline of one send through ingest and storage.
    #[arg(long, env = "IMDEDUP_SEND_TIMEOUT", default_value = "5s", value_parser = duration)]
    pub send_timeout: Duration,
    /// Largest message body accepted, in bytes.
    #[arg(long, env = "IMDEDUP_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Most phone connections at once; more are refused with HTTP 503.
    #[arg(long, env = "IMDEDUP_MAX_CONNECTIONS", default_value_t = imdedup_gateway::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Most sends and pulls in flight on one connection; the gateway stops
    /// reading that connection until one finishes.
    #[arg(long, env = "IMDEDUP_MAX_IN_FLIGHT", default_value_t = imdedup_gateway::DEFAULT_MAX_IN_FLIGHT_PER_CONNECTION)]
    pub max_in_flight: usize,
    /// Time given to sends in flight after SIGTERM.
    #[arg(long, env = "IMDEDUP_GRACE", default_value = "10s", value_parser = duration)]
    pub grace: Duration,
    #[command(flatten)]
    pub authz: AuthzArgs,
    #[command(flatten)]
    pub limits: crate::limits::LimitArgs,
    #[command(flatten)]
    pub tls: InternalTlsArgs,
}

/// How the gateway verifies phones' tokens.
#[derive(Debug, Args)]
pub struct TokenArgsForGateway {
    /// HS256 secret that signs tokens (at least 32 bytes).
    #[arg(
        long,
        env = "IMDEDUP_TOKEN_SECRET",
        hide_env_values = true,
        required_unless_present = "jwks_file"
    )]
    pub token_secret: Option<Secret>,
    /// Public keys (JWKS: RS256, ES256, EdDSA, each with a `kid`) of your
    /// identity provider; read again when the file changes.
    #[arg(long, env = "IMDEDUP_JWKS_FILE")]
    pub jwks_file: Option<PathBuf>,
    /// Required `iss` claim.
    #[arg(long, env = "IMDEDUP_TOKEN_ISSUER")]
    pub token_issuer: Option<String>,
    /// Required `aud` claim (one of the token's audiences).
    #[arg(long, env = "IMDEDUP_TOKEN_AUDIENCE")]
    pub token_audience: Option<String>,
    /// Clock difference allowed on `exp` and `nbf`.
    #[arg(long, env = "IMDEDUP_TOKEN_LEEWAY", default_value = "30s", value_parser = duration)]
    pub token_leeway: Duration,
    /// Longest token lifetime accepted (`exp` minus `iat`).
    #[arg(long, env = "IMDEDUP_TOKEN_MAX_LIFETIME", default_value = "24h", value_parser = duration)]
    pub token_max_lifetime: Duration,
}

impl TokenArgsForGateway {
    fn verifier(&self) -> anyhow::Result<TokenVerifier> {
        let secret = self
            .token_secret
            .as_ref()
            .map(|s| TokenKey::new(s.expose()))
            .transpose()
            .context("--token-secret")?;
        let jwks = self
            .jwks_file
            .as_ref()
            .map(Jwks::open)
            .transpose()
            .context("--jwks-file")?;
        let policy = TokenPolicy {
            leeway: self.token_leeway,
            issuer: self.token_issuer.clone(),
            audience: self.token_audience.clone(),
            max_lifetime: self.token_max_lifetime,
        };
        Ok(TokenVerifier::new(secret, jwks, policy)?)
    }
}

/// The business API (`POST /v1/messages` on the gateway's port, and
/// `imdedup.v1.BusinessService` on its own port): off unless a service-token
/// key is given.
#[derive(Debug, Args)]
pub struct BusinessArgs {
    /// HS256 secret of the business systems' service tokens (at least 32
    /// bytes; keep it apart from --token-secret). Turns the business API on.
    #[arg(long, env = "IMDEDUP_SERVICE_TOKEN_SECRET", hide_env_values = true)]
    pub service_token_secret: Option<Secret>,
    /// Public keys (JWKS) that sign service tokens; read again when the file
    /// changes. Turns the business API on.
    #[arg(long, env = "IMDEDUP_SERVICE_JWKS_FILE")]
    pub service_jwks_file: Option<PathBuf>,
    /// Address of the business API's gRPC server
    /// (imdedup.v1.BusinessService); none unless given (e.g. 0.0.0.0:7110).
    #[arg(long, env = "IMDEDUP_BUSINESS_GRPC_LISTEN")]
    pub business_grpc_listen: Option<SocketAddr>,
    /// Answer gRPC server reflection on the business gRPC port (for grpcurl
    /// without the protos).
    #[arg(long, env = "IMDEDUP_GRPC_REFLECTION")]
    pub grpc_reflection: bool,
}

impl BusinessArgs {
    /// The service-token verifier (`None`: the business API is off), with
    /// the phone tokens' leeway and longest lifetime.
    fn verifier(&self, tokens: &TokenArgsForGateway) -> anyhow::Result<Option<TokenVerifier>> {
        if self.service_token_secret.is_none() && self.service_jwks_file.is_none() {
            if self.business_grpc_listen.is_some() {
                anyhow::bail!(
                    "--business-grpc-listen needs service tokens: give --service-token-secret \
                     or --service-jwks-file"
                );
            }
            return Ok(None);
        }
        let secret = self
            .service_token_secret
            .as_ref()
            .map(|s| TokenKey::new(s.expose()))
            .transpose()
            .context("--service-token-secret")?;
        let jwks = self
            .service_jwks_file
            .as_ref()
            .map(Jwks::open)
            .transpose()
            .context("--service-jwks-file")?;
        let policy = TokenPolicy {
            leeway: tokens.token_leeway,
            max_lifetime: tokens.token_max_lifetime,
            ..TokenPolicy::default()
        };
        Ok(Some(
            TokenVerifier::new(secret, jwks, policy)?.for_services(),
        ))
    }
}

impl GatewayArgs {
    pub(super) fn config(&self) -> anyhow::Result<GatewayConfig> {
        let internal_tls = self.tls.internal_tls()?;
        Ok(GatewayConfig {
            shards: ShardMap::parse(&self.shards).context("--shards")?,
            storage: self.storage.clone(),
            tokens: self.tokens.verifier()?,
            service_tokens: self.business.verifier(&self.tokens)?,
            authz: self.authz.authorizer(&internal_tls)?,
            internal_tls,
            send_timeout: self.send_timeout,
            max_body_bytes: self.max_body_bytes,
            max_connections: self.max_connections,
            max_in_flight_per_connection: self.max_in_flight.max(1),
            limits: self.limits.limits(),
            clock: Arc::new(SystemClock),
        })
    }

    /// `--check-config`: the flags and environment parse and make sense
    /// (the gateway's clients connect lazily, so building it does no I/O).
    pub fn check(&self) -> anyhow::Result<()> {
        Gateway::new(self.config()?)?;
        Ok(())
    }
}

pub async fn gateway(args: GatewayArgs) -> anyhow::Result<()> {
    let mut registry = Registry::default();
    let metrics = GatewayMetrics::register(&mut registry);
    let gateway = Arc::new(Gateway::new(args.config()?)?.with_metrics(metrics));
    crate::authz::announce(&gateway.config.authz, &args.authz);
    crate::tls::announce(&gateway.config.internal_tls);
    let listener = bind(args.listen).await?;
    let business_listener = match args.business.business_grpc_listen {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    let shards: Vec<_> = gateway.shards.map().names().collect();
    let shard_map = gateway.shards.map().version();
    tracing::info!(listen = %args.listen, ?shards, %shard_map, "gateway serving at ws://{}/v1/ws", args.listen);
    match (
        &gateway.config.service_tokens,
        args.business.business_grpc_listen,
    ) {
        (None, _) => {
            tracing::info!("business API off (no --service-token-secret or --service-jwks-file)")
        }
        (Some(_), grpc) => tracing::info!(
            http = %format!("http://{}/v1/messages", args.listen),
            grpc = ?grpc,
            "business API on"
        ),
    }
    // Business systems bring their own tokens: the port is served like the
    // phones' (TLS, if any, ends in front of the gateway).
    let business_options = imdedup_runtime::server::ServeOptions {
        reflection: args.business.grpc_reflection,
        tls: None,
    };
    serve_with_admin(
        "gateway",
        args.grace,
        args.admin_listen,
        registry,
        move |stop| async move {
            let business = async {
                match business_listener {
                    Some(listener) => imdedup_gateway::business::grpc::serve(
                        listener,
                        Arc::clone(&gateway),
                        business_options,
                        stop.clone(),
                    )
                    .await
                    .map_err(std::io::Error::other),
                    None => Ok(()),
                }
            };
            let phones = imdedup_gateway::serve(listener, Arc::clone(&gateway), stop.clone());
            let (phones, business) = tokio::join!(phones, business);
            phones.and(business)
        },
    )
    .await
}
