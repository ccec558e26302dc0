//! `imdedup token`: mint a phone or service token for local use.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use imdedup_domain::{
    clock::{Clock, SystemClock},
    model::Sender,
};
use imdedup_runtime::{secret::Secret, token::TokenKey};

use super::*;

#[derive(Debug, Args)]
pub struct TokenArgs {
    /// The user a phone token names.
    #[arg(long, required_unless_present = "service", conflicts_with = "service")]
    pub user: Option<String>,
    /// Mint a service token (the business API) for this system instead,
    /// e.g. orders-bot; signed with --service-token-secret.
    #[arg(long, requires = "senders")]
    pub service: Option<String>,
    /// With --service: the accounts the system may send as,
    /// comma-separated; `*` means any account.
    #[arg(long, value_delimiter = ',', requires = "service")]
    pub senders: Vec<String>,
    /// How long the token is valid.
    #[arg(long, default_value = "24h", value_parser = duration)]
    pub ttl: Duration,
    /// HS256 secret, the gateway's (phone tokens).
    #[arg(
        long,
        env = "IMDEDUP_TOKEN_SECRET",
        hide_env_values = true,
        required_unless_present = "service"
    )]
    pub token_secret: Option<Secret>,
    /// HS256 secret of service tokens, the gateway's --service-token-secret.
    #[arg(long, env = "IMDEDUP_SERVICE_TOKEN_SECRET", hide_env_values = true)]
    pub service_token_secret: Option<Secret>,
}

impl TokenArgs {
    /// `--check-config`: the flags and environment parse and make sense.
    pub fn check(&self) -> anyhow::Result<()> {
        self.mint(0).map(drop)
    }

    /// The token the flags ask for, expiring at `exp`.
    pub(super) fn mint(&self, exp: u64) -> anyhow::Result<String> {
        if let Some(service) = &self.service {
            let secret = self.service_token_secret.as_ref().context(
                "a service token needs --service-token-secret (or IMDEDUP_SERVICE_TOKEN_SECRET)",
            )?;
            let key = TokenKey::new(secret.expose()).context("--service-token-secret")?;
            for sender in self.senders.iter().filter(|s| *s != "*") {
                Sender::parse(sender.clone()).context("--senders")?;
            }
            return Ok(key.mint_service(&Sender::parse(service.clone())?, &self.senders, exp));
        }
        let secret = self
            .token_secret
            .as_ref()
            .context("a phone token needs --token-secret (or IMDEDUP_TOKEN_SECRET)")?;
        let key = TokenKey::new(secret.expose()).context("--token-secret")?;
        let user = self.user.clone().context("--user")?;
        Ok(key.mint(&Sender::parse(user)?, exp))
    }
}

pub fn token(args: TokenArgs) -> anyhow::Result<()> {
    let exp = SystemClock.unix_seconds() + args.ttl.as_secs();
    println!("{}", args.mint(exp)?);
    Ok(())
}
