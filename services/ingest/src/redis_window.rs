//! The Redis recent-ID window, for a single Redis or a Redis Cluster.
//!
//! - claim: `SET key P<token> NX GET PX <claim-ttl>` in one round trip (Redis
//!   7.0+). Nil: this copy owns the claim. An ACK value: a repeat, answered
//!   from Redis. A pending value: another copy is in flight; wait briefly for
//!   its ACK, else let the store's unique key decide.
//! - remember: overwrite the claim with the ACK for the window TTL.
//! - release: delete the claim only if it still holds this copy's token
//!   (compare-and-delete in Lua).
//!
//! Keys are binary: the prefix, then the injective (sender, ID) encoding.
//! Values: `A` + server id + seq (big-endian u64s), or `P` + the token.
//! Every call has a timeout; failures open a circuit breaker, during which
//! the window reports itself unavailable at once and ingest goes straight
//! to the store.

use std::{sync::Arc, time::Duration, time::Instant};

use async_trait::async_trait;
use imdedup_core::{
    Error,
    model::{MessageKey, Receipt},
    window::{Claim, ClaimToken, RecentWindow},
};
use redis::{
    Cmd, Pipeline, RedisFuture, Value,
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig},
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
};

use crate::{breaker::Breaker, window::DEFAULT_WINDOW_TTL};

const RELEASE_LUA: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// Settings of the Redis window.
#[derive(Debug, Clone)]
pub struct RedisWindowOptions {
    /// `redis://[user:pass@]host:port[/db]` (or `rediss://` for TLS); with
    /// several URLs, or `cluster`, a Redis Cluster.
    pub urls: Vec<String>,
    pub cluster: bool,
    pub key_prefix: String,
    pub ttl: Duration,
    pub claim_ttl: Duration,
    /// Deadline of every Redis call.
    pub timeout: Duration,
    /// How long a copy that finds a pending claim waits for its ACK.
    pub pending_wait: Duration,
    /// Failures in a row that open the breaker, and how long it stays open.
    pub breaker_threshold: u32,
    pub breaker_cooldown: Duration,
    /// PEM of the CA that signs the server certificate, for `rediss://`
    /// URLs; without it the webpki roots are trusted.
    pub ca_pem: Option<Vec<u8>>,
}

impl RedisWindowOptions {
    pub fn new(urls: Vec<String>) -> Self {
        Self {
            cluster: urls.len() > 1,
            urls,
            key_prefix: "imd:".to_owned(),
            ttl: DEFAULT_WINDOW_TTL,
            claim_ttl: Duration::from_secs(3),
            timeout: Duration::from_millis(250),
            pending_wait: Duration::from_millis(50),
            breaker_threshold: 3,
            breaker_cooldown: Duration::from_secs(1),
            ca_pem: None,
        }
    }
}

/// A single-node or cluster connection; both reconnect by themselves.
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// A [`RecentWindow`] in Redis.
pub struct RedisWindow {
    connection: Connection,
    options: RedisWindowOptions,
    release: redis::Script,
    breaker: Arc<Breaker>,
}

fn redis_error(what: &str, e: &redis::RedisError) -> Error {
    Error::unavailable(format!("redis {what}: {e}"))
}

impl RedisWindow {
    /// Connect to Redis (or the cluster). Fails if it cannot be reached now;
    /// once built, the connection reconnects by itself.
    pub async fn connect(options: RedisWindowOptions) -> Result<Self, Error> {
        if options.urls.is_empty() {
            return Err(Error::invalid("no redis url"));
        }
        let connect_timeout = options.timeout.max(Duration::from_secs(1));
        let connection = if options.cluster {
            let mut builder = ClusterClient::builder(options.urls.clone());
            if let Some(ca) = &options.ca_pem {
                builder = builder.certs(tls_roots(ca));
            }
            let client = builder
                .connection_timeout(connect_timeout)
                .response_timeout(options.timeout)
                .retries(1)
                .build()
                .map_err(|e| Error::invalid(format!("bad redis cluster urls: {e}")))?;
            let connection =
                tokio::time::timeout(connect_timeout * 3, client.get_async_connection())
                    .await
                    .map_err(|_| Error::unavailable("redis cluster: connect timed out"))?
                    .map_err(|e| redis_error("cluster connect", &e))?;
            Connection::Cluster(connection)
        } else {
            let url = options.urls[0].as_str();
            let client = match &options.ca_pem {
                Some(ca) => redis::Client::build_with_tls(url, tls_roots(ca)),
                None => redis::Client::open(url),
            }
            .map_err(|e| Error::invalid(format!("bad redis url: {e}")))?;
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(connect_timeout))
                .set_response_timeout(Some(options.timeout))
                .set_number_of_retries(1);
            let manager = tokio::time::timeout(
                connect_timeout * 3,
                ConnectionManager::new_with_config(client, config),
            )
            .await
            .map_err(|_| Error::unavailable("redis: connect timed out"))?
            .map_err(|e| redis_error("connect", &e))?;
            Connection::Single(manager)
        };
        Ok(Self {
            connection,
            release: redis::Script::new(RELEASE_LUA),
            breaker: Arc::new(Breaker::new(
                options.breaker_threshold,
                options.breaker_cooldown,
            )),
            options,
        })
    }

    /// Forget `key` now, as if its TTL had passed (an operator's tool, and
    /// the demo's way to jump an hour ahead).
    pub async fn forget(&self, key: &MessageKey) -> Result<(), Error> {
        let mut connection = self.connection.clone();
        self.call(
            "forget",
            redis::cmd("DEL")
                .arg(self.key(key))
                .query_async::<i64>(&mut connection),
        )
        .await
        .map(|_| ())
    }

    /// Whether the breaker is open (Redis is being bypassed).
    pub fn bypassing(&self) -> bool {
        self.breaker.is_open()
    }

    fn key(&self, key: &MessageKey) -> Vec<u8> {
        let mut out = self.options.key_prefix.as_bytes().to_vec();
        out.extend_from_slice(&key.to_bytes());
        out
    }

    /// Run one Redis call under the deadline and the breaker.
    async fn call<T, F>(&self, what: &str, f: F) -> Result<T, Error>
    where
        F: Future<Output = redis::RedisResult<T>>,
    {
        if !self.breaker.allow(Instant::now()) {
            return Err(Error::unavailable("redis window bypassed: circuit open"));
        }
        match tokio::time::timeout(self.options.timeout, f).await {
            Ok(Ok(value)) => {
                self.breaker.success();
                Ok(value)
            }
            Ok(Err(e)) => {
                self.breaker.failure(Instant::now());
                Err(redis_error(what, &e))
            }
            Err(_) => {
                self.breaker.failure(Instant::now());
                Err(Error::unavailable(format!(
                    "redis {what}: no answer within {:?}",
                    self.options.timeout
                )))
            }
        }
    }

    async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        let mut connection = self.connection.clone();
        self.call(
            "get",
            redis::cmd("GET").arg(key).query_async(&mut connection),
        )
        .await
    }
}

fn tls_roots(ca_pem: &[u8]) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(ca_pem.to_vec()),
    }
}

fn encode_receipt(receipt: Receipt) -> Vec<u8> {
    let mut out = Vec::with_capacity(17);
    out.push(b'A');
    out.extend_from_slice(&receipt.server_id.to_be_bytes());
    out.extend_from_slice(&receipt.seq.to_be_bytes());
    out
}

fn decode_receipt(value: &[u8]) -> Option<Receipt> {
    match value {
        [b'A', rest @ ..] if rest.len() == 16 => {
            let (server_id, seq) = rest.split_at(8);
            Some(Receipt {
                server_id: u64::from_be_bytes(server_id.try_into().ok()?),
                seq: u64::from_be_bytes(seq.try_into().ok()?),
            })
        }
        _ => None,
    }
}

fn pending_value(token: &ClaimToken) -> Vec<u8> {
    let mut out = vec![b'P'];
    out.extend_from_slice(token.0.as_bytes());
    out
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[async_trait]
impl RecentWindow for RedisWindow {
    async fn claim(&self, key: &MessageKey) -> Result<Claim, Error> {
        let redis_key = self.key(key);
        let token = ClaimToken(uuid::Uuid::new_v4().simple().to_string());
        let mut connection = self.connection.clone();
        let previous: Option<Vec<u8>> = self
            .call(
                "claim",
                redis::cmd("SET")
                    .arg(&redis_key)
                    .arg(pending_value(&token))
                    .arg("NX")
                    .arg("GET")
                    .arg("PX")
                    .arg(millis(self.options.claim_ttl))
                    .query_async(&mut connection),
            )
            .await?;
        let Some(previous) = previous else {
            return Ok(Claim::Owned(token));
        };
        if let Some(receipt) = decode_receipt(&previous) {
            return Ok(Claim::Seen(receipt));
        }
        // Another copy holds the claim: give it a moment to finish.
        let deadline = Instant::now() + self.options.pending_wait;
        let step = (self.options.pending_wait / 5).max(Duration::from_millis(2));
        while Instant::now() < deadline {
            tokio::time::sleep(step).await;
            match self.get(&redis_key).await? {
                Some(value) => {
                    if let Some(receipt) = decode_receipt(&value) {
                        return Ok(Claim::Seen(receipt));
                    }
                }
                // Released (its insert failed) or expired: the store decides.
                None => break,
            }
        }
        Ok(Claim::InFlight)
    }

    async fn remember(
        &self,
        key: &MessageKey,
        _token: &ClaimToken,
        receipt: Receipt,
    ) -> Result<(), Error> {
        let mut connection = self.connection.clone();
        self.call(
            "remember",
            redis::cmd("SET")
                .arg(self.key(key))
                .arg(encode_receipt(receipt))
                .arg("PX")
                .arg(millis(self.options.ttl))
                .query_async::<()>(&mut connection),
        )
        .await
    }

    async fn release(&self, key: &MessageKey, token: &ClaimToken) -> Result<(), Error> {
        let mut connection = self.connection.clone();
        let mut invocation = self.release.key(self.key(key));
        invocation.arg(pending_value(token));
        self.call("release", invocation.invoke_async::<i64>(&mut connection))
            .await
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receipts_round_trip_and_pending_values_are_not_receipts() {
        let receipt = Receipt {
            server_id: u64::MAX - 1,
            seq: 42,
        };
        assert_eq!(decode_receipt(&encode_receipt(receipt)), Some(receipt));
        let token = ClaimToken("0123456789abcdef0123456789abcdef".into());
        assert_eq!(decode_receipt(&pending_value(&token)), None);
        assert_eq!(decode_receipt(b"A123"), None);
    }
}
