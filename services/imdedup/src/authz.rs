//! Authorization flags: who may send to and read each conversation, and the
//! `imdedup membership` server that answers group membership from a file.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::Context;
use clap::{Args, ValueEnum};
use imdedup_gateway::authz::{
    Authorizer, GroupsFile, MembershipService, ServiceOptions, service::serve_groups,
};

use imdedup_runtime::tls::{InternalTls, names};

use crate::services::duration;
use crate::tls::{InternalTlsArgs, serve_options};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AuthzMode {
    /// Direct conversations (`dm:<a>:<b>`) by name, groups from
    /// --groups-file or --membership-url.
    Members,
    /// Everyone may send to and read every conversation: local runs only.
    Open,
}

#[derive(Debug, Clone, Args)]
pub struct AuthzArgs {
    /// Who may send to and read a conversation.
    #[arg(long, env = "IMDEDUP_AUTHZ", value_enum, default_value = "members")]
    pub authz: AuthzMode,
    /// Group conversations and their members, a JSON object
    /// (`{"team-7": ["ana", "ben"]}`); read again when it changes.
    #[arg(long, env = "IMDEDUP_GROUPS_FILE", conflicts_with = "membership_url")]
    pub groups_file: Option<PathBuf>,
    /// URL of your membership service (`imdedup.v1.MembershipService`), for
    /// group conversations.
    #[arg(long, env = "IMDEDUP_MEMBERSHIP_URL")]
    pub membership_url: Option<String>,
    /// Deadline of one membership question.
    #[arg(long, env = "IMDEDUP_MEMBERSHIP_TIMEOUT", default_value = "500ms", value_parser = duration)]
    pub membership_timeout: Duration,
    /// How long a "member" answer is cached.
    #[arg(long, env = "IMDEDUP_MEMBERSHIP_MEMBER_TTL", default_value = "60s", value_parser = duration)]
    pub membership_member_ttl: Duration,
    /// How long a "not a member" answer is cached.
    #[arg(long, env = "IMDEDUP_MEMBERSHIP_NOT_MEMBER_TTL", default_value = "5s", value_parser = duration)]
    pub membership_not_member_ttl: Duration,
    /// Most membership answers cached.
    #[arg(
        long,
        env = "IMDEDUP_MEMBERSHIP_CACHE_SIZE",
        default_value_t = 1_000_000
    )]
    pub membership_cache_size: u64,
}

impl AuthzArgs {
    /// Who may do what; the membership service is reached over `tls`.
    pub fn authorizer(&self, tls: &InternalTls) -> anyhow::Result<Authorizer> {
        if self.authz == AuthzMode::Open {
            return Ok(Authorizer::Open);
        }
        if let Some(path) = &self.groups_file {
            let groups = GroupsFile::open(path).context("--groups-file")?;
            return Ok(Authorizer::members(groups));
        }
        if let Some(url) = &self.membership_url {
            let options = ServiceOptions {
                url: url.clone(),
                timeout: self.membership_timeout,
                member_ttl: self.membership_member_ttl,
                not_member_ttl: self.membership_not_member_ttl,
                capacity: self.membership_cache_size,
            };
            let service =
                MembershipService::connect_lazy(&options, tls).context("--membership-url")?;
            return Ok(Authorizer::members(service));
        }
        Ok(Authorizer::direct_only())
    }
}

/// Say at start, where nobody can miss it, that authorization is off.
pub fn warn_if_open(authz: &Authorizer) {
    if authz.is_open() {
        let warning = "AUTHORIZATION IS OFF (--authz open): any user may send to and read \
                       any conversation. For local runs only; never deploy this.";
        eprintln!("WARNING: {warning}");
        tracing::warn!("{warning}");
    }
}

/// Which authorization is in force, in words.
fn describe(authz: &Authorizer, args: &AuthzArgs) -> String {
    match authz {
        Authorizer::Open => "open".to_owned(),
        Authorizer::Members { groups: None } => "direct conversations only".to_owned(),
        Authorizer::Members { groups: Some(_) } => {
            match (&args.groups_file, &args.membership_url) {
                (Some(path), _) => format!("direct conversations, groups from {}", path.display()),
                (_, Some(url)) => format!("direct conversations, groups from {url}"),
                _ => "direct conversations and groups".to_owned(),
            }
        }
    }
}

/// Log which authorization is in force.
pub fn announce(authz: &Authorizer, args: &AuthzArgs) {
    warn_if_open(authz);
    tracing::info!(authz = %describe(authz, args), "authorization");
}

#[derive(Debug, Args)]
pub struct MembershipArgs {
    /// Address of the gRPC server.
    #[arg(
        long,
        env = "IMDEDUP_MEMBERSHIP_LISTEN",
        default_value = "127.0.0.1:7400"
    )]
    pub listen: SocketAddr,
    /// Group conversations and their members, a JSON object; read again
    /// when it changes.
    #[arg(long, env = "IMDEDUP_GROUPS_FILE")]
    pub groups_file: PathBuf,
    /// Time given to calls in flight after SIGTERM.
    #[arg(long, env = "IMDEDUP_GRACE", default_value = "5s", value_parser = duration)]
    pub grace: Duration,
    #[command(flatten)]
    pub tls: InternalTlsArgs,
    /// Certificate names (DNS) of the callers accepted over mutual TLS.
    #[arg(long, env = "IMDEDUP_TLS_ALLOW_CLIENTS", value_delimiter = ',', default_value = names::GATEWAY)]
    pub tls_allow_clients: Vec<String>,
    /// Answer gRPC server reflection (for grpcurl without the protos).
    #[arg(long, env = "IMDEDUP_GRPC_REFLECTION")]
    pub grpc_reflection: bool,
}

impl MembershipArgs {
    /// `--check-config`: the groups file reads and makes sense.
    pub fn check(&self) -> anyhow::Result<()> {
        GroupsFile::open(&self.groups_file).context("--groups-file")?;
        let tls = self.tls.internal_tls()?;
        serve_options(&tls, &self.tls_allow_clients, self.grpc_reflection)?;
        Ok(())
    }
}

/// Serve `imdedup.v1.MembershipService` from a groups file until SIGTERM.
pub async fn membership(args: MembershipArgs) -> anyhow::Result<()> {
    let groups = GroupsFile::open(&args.groups_file).context("--groups-file")?;
    let tls = args.tls.internal_tls()?;
    crate::tls::announce(&tls);
    let options = serve_options(&tls, &args.tls_allow_clients, args.grpc_reflection)?;
    let listener = crate::services::bind(args.listen).await?;
    tracing::info!(listen = %args.listen, groups_file = %args.groups_file.display(), "membership serving");
    crate::shutdown::serve_until_signal("membership", args.grace, move |stop| {
        serve_groups(listener, groups, options, stop)
    })
    .await
}
