//! The Redis recent-ID window, for a single Redis or a Redis Cluster.
//!
//! Layout. Remembered IDs live in hashes, one per (partition, time bucket):
//! `<prefix>{<partition>}b:<bucket>`, field = the injective (sender, ID) key,
//! value = the receipt (`A` + server id + seq as varints). Small hashes are
//! stored by Redis as listpacks, about 40 bytes per ID instead of the ~150 of
//! a key of its own with a TTL; each bucket hash expires as a whole, a TTL
//! plus one bucket after its last write, so an ID is remembered for at least
//! the TTL. Claims in flight are short-lived plain keys,
//! `<prefix>{<partition>}p:<key>`, with the claim TTL. The `{partition}`
//! hash tag keeps all keys of one ID in one cluster slot, so every step is
//! one atomic script on one node. (A partition here is only a spread of
//! keys; it has nothing to do with the ingest shards.)
//!
//! - claim (one round trip): the ID in a live bucket is a repeat, answered
//!   with its receipt without touching the database; else
//!   `SET pending P<token> NX GET PX <claim-ttl>` (Redis 7.0+). Nil: this
//!   copy owns the claim. A pending value: another copy is in flight; wait
//!   briefly for its receipt, else let the store's unique key decide.
//! - remember: write the receipt into the current bucket and drop the claim.
//! - release: delete the claim only if it still holds this copy's token
//!   (compare-and-delete).
//!
//! Every call has a timeout; failures open a circuit breaker, during which
//! the window reports itself unavailable at once and ingest goes straight
//! to the store.

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use crate::metrics::WindowMetrics;
use async_trait::async_trait;
use imdedup_domain::{
    Error,
    model::{Fingerprint, MessageKey, Receipt, Remembered},
    routing::stable_hash,
    window::{Claim, ClaimToken, RecentWindow},
};
use redis::{
    Cmd, Pipeline, RedisFuture, Value,
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig},
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
};

use crate::{ConnectingWindow, breaker::Breaker, window::DEFAULT_WINDOW_TTL};

/// KEYS: the live buckets, then the pending key. ARGV: field, pending value,
/// claim TTL in ms. Returns a receipt, a pending value, or nil (claimed).
const CLAIM_LUA: &str = r"
local n = #KEYS
for i = 1, n - 1 do
  local v = redis.call('HGET', KEYS[i], ARGV[1])
  if v then return v end
end
return redis.call('SET', KEYS[n], ARGV[2], 'NX', 'GET', 'PX', ARGV[3])
";

/// As CLAIM_LUA, without claiming: a receipt, a pending value, or nil.
const PEEK_LUA: &str = r"
local n = #KEYS
for i = 1, n - 1 do
  local v = redis.call('HGET', KEYS[i], ARGV[1])
  if v then return v end
end
return redis.call('GET', KEYS[n])
";

/// KEYS: the current bucket, the pending key. ARGV: field, receipt, bucket
/// TTL in ms.
const REMEMBER_LUA: &str = r"
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('DEL', KEYS[2])
return 1
";

/// KEYS: the pending key. ARGV: this copy's pending value.
const RELEASE_LUA: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// KEYS: the live buckets, then the pending key. ARGV: field.
const FORGET_LUA: &str = r"
local n = #KEYS
for i = 1, n - 1 do
  redis.call('HDEL', KEYS[i], ARGV[1])
end
return redis.call('DEL', KEYS[n])
";

/// Settings of the Redis window. `Debug` hides the URLs' passwords.
#[derive(Clone)]
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
    /// After an outage, how long the window takes to get all claims back
    /// (a growing share; the rest go straight to the unique key).
    pub warmup: Duration,
    /// PEM file of the CA that signs the server certificate, for
    /// `rediss://` URLs, read when connecting; without it the webpki roots
    /// are trusted.
    pub ca_file: Option<std::path::PathBuf>,
    /// Hashes (partitions) per time bucket. Size it so a bucket hash holds up to ~100
    /// IDs at peak (IDs per second x bucket span / 100): Redis keeps hashes of
    /// up to 128 entries (`hash-max-listpack-entries`) in the compact form.
    pub partitions: u32,
    /// Time span of one bucket.
    pub bucket_span: Duration,
}

impl std::fmt::Debug for RedisWindowOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<String> = self
            .urls
            .iter()
            .map(|u| imdedup_runtime::secret::redact_url(u))
            .collect();
        f.debug_struct("RedisWindowOptions")
            .field("urls", &urls)
            .field("cluster", &self.cluster)
            .field("key_prefix", &self.key_prefix)
            .field("ttl", &self.ttl)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisWindowOptions {
    pub fn new(urls: Vec<String>) -> Self {
        Self {
            cluster: urls.len() > 1,
            urls,
            key_prefix: "i:".to_owned(),
            ttl: DEFAULT_WINDOW_TTL,
            claim_ttl: Duration::from_secs(3),
            timeout: Duration::from_millis(250),
            pending_wait: Duration::from_millis(50),
            breaker_threshold: 3,
            breaker_cooldown: Duration::from_secs(1),
            warmup: Duration::from_secs(5),
            ca_file: None,
            partitions: 8192,
            bucket_span: Duration::from_secs(60),
        }
    }

    /// Check the options without connecting: at least one URL, each one a
    /// Redis URL (`redis://`, `rediss://`, `unix://`). The error does not
    /// repeat the URL, which may hold a password.
    pub fn check(&self) -> Result<(), Error> {
        if self.urls.is_empty() {
            return Err(Error::invalid("no redis url"));
        }
        for (index, url) in self.urls.iter().enumerate() {
            redis::Client::open(url.as_str()).map_err(|e| {
                Error::invalid(format!("redis url number {} is not valid: {e}", index + 1))
            })?;
        }
        Ok(())
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
    scripts: Scripts,
    breaker: Arc<Breaker>,
    metrics: WindowMetrics,
}

const BACKEND: &str = "redis";

struct Scripts {
    claim: redis::Script,
    peek: redis::Script,
    remember: redis::Script,
    release: redis::Script,
    forget: redis::Script,
}

/// The Redis keys of one ID.
struct Keys {
    field: Vec<u8>,
    /// Live buckets, newest first (one ahead, for clock skew between
    /// ingest instances).
    buckets: Vec<Vec<u8>>,
    current: Vec<u8>,
    pending: Vec<u8>,
}

fn redis_error(what: &str, e: &redis::RedisError) -> Error {
    Error::unavailable(format!("redis {what}: {e}"))
}

impl RedisWindow {
    /// The window an ingest shard serves with: connected in the background
    /// ([`ConnectingWindow`]), so a shard whose Redis is down at start
    /// serves, the window bypassed (counted), until it connects. The
    /// `imdedup ingest` process and the local cluster both build it here.
    pub fn connecting(
        options: RedisWindowOptions,
        metrics: WindowMetrics,
    ) -> ConnectingWindow<RedisWindow> {
        ConnectingWindow::spawn(move || {
            let (options, metrics) = (options.clone(), metrics.clone());
            async move { Ok(RedisWindow::connect(options).await?.with_metrics(metrics)) }
        })
    }

    /// Connect to Redis (or the cluster). Fails if it cannot be reached now;
    /// once built, the connection reconnects by itself.
    pub async fn connect(options: RedisWindowOptions) -> Result<Self, Error> {
        if options.urls.is_empty() {
            return Err(Error::invalid("no redis url"));
        }
        let ca_pem = match &options.ca_file {
            Some(path) => Some(std::fs::read(path).map_err(|e| {
                Error::invalid(format!("cannot read the redis CA {}: {e}", path.display()))
            })?),
            None => None,
        };
        let connect_timeout = options.timeout.max(Duration::from_secs(1));
        let connection = if options.cluster {
            let mut builder = ClusterClient::builder(options.urls.clone());
            if let Some(ca) = &ca_pem {
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
            let client = match &ca_pem {
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
            scripts: Scripts {
                claim: redis::Script::new(CLAIM_LUA),
                peek: redis::Script::new(PEEK_LUA),
                remember: redis::Script::new(REMEMBER_LUA),
                release: redis::Script::new(RELEASE_LUA),
                forget: redis::Script::new(FORGET_LUA),
            },
            breaker: Arc::new(
                Breaker::new(options.breaker_threshold, options.breaker_cooldown)
                    .with_warmup(options.warmup),
            ),
            options,
            metrics: WindowMetrics::default(),
        })
    }

    /// Record call durations into `metrics` (the ingest's `window`).
    pub fn with_metrics(mut self, metrics: WindowMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Forget `key` now, as if its TTL had passed (an operator's tool, and
    /// the demo's way to jump an hour ahead).
    pub async fn forget(&self, key: &MessageKey) -> Result<(), Error> {
        let keys = self.keys(key);
        let mut invocation = self.scripts.forget.prepare_invoke();
        for bucket in &keys.buckets {
            invocation.key(bucket);
        }
        invocation.key(&keys.pending).arg(&keys.field);
        let mut connection = self.connection.clone();
        self.call("forget", invocation.invoke_async::<i64>(&mut connection))
            .await
            .map(|_| ())
    }

    /// Whether the breaker is open (Redis is being bypassed).
    pub fn bypassing(&self) -> bool {
        self.breaker.is_open()
    }

    fn span_ms(&self) -> u64 {
        millis(self.options.bucket_span.min(self.options.ttl))
    }

    fn keys(&self, key: &MessageKey) -> Keys {
        let field = key.to_bytes();
        let partition = stable_hash(&[&field]) % u64::from(self.options.partitions.max(1));
        let base = format!("{}{{{partition}}}", self.options.key_prefix);
        let span = self.span_ms();
        let now = u64::try_from(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis(),
        )
        .unwrap_or(u64::MAX);
        let current = now / span;
        let back = millis(self.options.ttl).div_ceil(span);
        let bucket = |b: u64| format!("{base}b:{b}").into_bytes();
        let mut pending = format!("{base}p:").into_bytes();
        pending.extend_from_slice(&field);
        Keys {
            buckets: (current.saturating_sub(back)..=current + 1)
                .rev()
                .map(bucket)
                .collect(),
            current: bucket(current),
            pending,
            field,
        }
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

    async fn peek(&self, keys: &Keys) -> Result<Option<Vec<u8>>, Error> {
        let mut invocation = self.scripts.peek.prepare_invoke();
        for bucket in &keys.buckets {
            invocation.key(bucket);
        }
        invocation.key(&keys.pending).arg(&keys.field);
        let mut connection = self.connection.clone();
        self.call("peek", invocation.invoke_async(&mut connection))
            .await
    }
}

fn tls_roots(ca_pem: &[u8]) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(ca_pem.to_vec()),
    }
}

/// `B`, the server id and the seq as LEB128 varints, then the fingerprint
/// as 8 little-endian bytes: 14 to 18 bytes for real values, small enough for
/// Redis's smallest string allocations. Values written before fingerprints
/// were kept start with `A` and end after the seq.
fn encode_remembered(remembered: Remembered) -> Vec<u8> {
    let mut out = Vec::with_capacity(29);
    let receipt = remembered.receipt;
    out.push(if remembered.fingerprint.is_some() {
        b'B'
    } else {
        b'A'
    });
    for mut v in [receipt.server_id, receipt.seq] {
        loop {
            let byte = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(byte);
                break;
            }
            out.push(byte | 0x80);
        }
    }
    if let Some(Fingerprint(f)) = remembered.fingerprint {
        out.extend_from_slice(&f.to_le_bytes());
    }
    out
}

fn decode_remembered(value: &[u8]) -> Option<Remembered> {
    let (with_fingerprint, rest) = match value {
        [b'A', rest @ ..] => (false, rest),
        [b'B', rest @ ..] => (true, rest),
        _ => return None,
    };
    let mut numbers = [0u64; 2];
    let mut bytes = rest.iter();
    for number in &mut numbers {
        let mut shift = 0;
        loop {
            let byte = *bytes.next()?;
            if shift > 63 {
                return None;
            }
            *number |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                break;
            }
            shift += 7;
        }
    }
    let tail = bytes.as_slice();
    let fingerprint = match (with_fingerprint, tail.len()) {
        (false, 0) => None,
        (true, 8) => Some(Fingerprint(u64::from_le_bytes(tail.try_into().ok()?))),
        _ => return None,
    };
    Some(Remembered {
        receipt: Receipt {
            server_id: numbers[0],
            seq: numbers[1],
        },
        fingerprint,
    })
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
        if !self.breaker.warmed_for(Instant::now()) {
            self.metrics.warmup_skipped();
            return Err(Error::unavailable(
                "redis window warming up after an outage",
            ));
        }
        let started = Instant::now();
        let result = self.claim_key(key).await;
        self.metrics.observe("claim", BACKEND, started.elapsed());
        result
    }

    async fn remember(
        &self,
        key: &MessageKey,
        token: &ClaimToken,
        remembered: Remembered,
    ) -> Result<(), Error> {
        let started = Instant::now();
        let result = self.remember_key(key, token, remembered).await;
        self.metrics.observe("remember", BACKEND, started.elapsed());
        result
    }

    async fn release(&self, key: &MessageKey, token: &ClaimToken) -> Result<(), Error> {
        let started = Instant::now();
        let result = self.release_key(key, token).await;
        self.metrics.observe("release", BACKEND, started.elapsed());
        result
    }
}

impl RedisWindow {
    /// The claim script, and the peeks while another copy holds the claim.
    #[tracing::instrument(
        name = "redis.claim",
        skip_all,
        fields(
            otel.name = "EVALSHA claim",
            otel.kind = "client",
            db.system = "redis",
            db.operation = "EVALSHA",
        )
    )]
    async fn claim_key(&self, key: &MessageKey) -> Result<Claim, Error> {
        let keys = self.keys(key);
        let token = ClaimToken(uuid::Uuid::new_v4().simple().to_string());
        let mut invocation = self.scripts.claim.prepare_invoke();
        for bucket in &keys.buckets {
            invocation.key(bucket);
        }
        invocation
            .key(&keys.pending)
            .arg(&keys.field)
            .arg(pending_value(&token))
            .arg(millis(self.options.claim_ttl));
        let mut connection = self.connection.clone();
        let previous: Option<Vec<u8>> = self
            .call("claim", invocation.invoke_async(&mut connection))
            .await?;
        let Some(previous) = previous else {
            return Ok(Claim::Owned(token));
        };
        if let Some(receipt) = decode_remembered(&previous) {
            return Ok(Claim::Seen(receipt));
        }
        // Another copy holds the claim: give it a moment to finish.
        let deadline = Instant::now() + self.options.pending_wait;
        let step = (self.options.pending_wait / 5).max(Duration::from_millis(2));
        while Instant::now() < deadline {
            tokio::time::sleep(step).await;
            match self.peek(&keys).await? {
                Some(value) => {
                    if let Some(receipt) = decode_remembered(&value) {
                        return Ok(Claim::Seen(receipt));
                    }
                }
                // Released (its insert failed) or expired: the store decides.
                None => break,
            }
        }
        Ok(Claim::InFlight)
    }

    async fn remember_key(
        &self,
        key: &MessageKey,
        _token: &ClaimToken,
        remembered: Remembered,
    ) -> Result<(), Error> {
        let keys = self.keys(key);
        let bucket_ttl = millis(self.options.ttl) + self.span_ms();
        let mut invocation = self.scripts.remember.prepare_invoke();
        invocation
            .key(&keys.current)
            .key(&keys.pending)
            .arg(&keys.field)
            .arg(encode_remembered(remembered))
            .arg(bucket_ttl);
        let mut connection = self.connection.clone();
        self.call("remember", invocation.invoke_async::<i64>(&mut connection))
            .await
            .map(|_| ())
    }

    async fn release_key(&self, key: &MessageKey, token: &ClaimToken) -> Result<(), Error> {
        let keys = self.keys(key);
        let mut invocation = self.scripts.release.prepare_invoke();
        invocation.key(&keys.pending).arg(pending_value(token));
        let mut connection = self.connection.clone();
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
        let remembered = |server_id, seq, fingerprint: Option<u64>| Remembered {
            receipt: Receipt { server_id, seq },
            fingerprint: fingerprint.map(Fingerprint),
        };
        let token = ClaimToken("0123456789abcdef0123456789abcdef".into());
        assert_eq!(decode_remembered(&pending_value(&token)), None);
        assert_eq!(decode_remembered(b"A123"), None);
        for (server_id, seq) in [(0, 0), (1, 1), (u64::MAX, u64::MAX), (300, 1 << 40)] {
            for fingerprint in [None, Some(0), Some(u64::MAX)] {
                let value = remembered(server_id, seq, fingerprint);
                assert_eq!(decode_remembered(&encode_remembered(value)), Some(value));
            }
        }
        // A value written before fingerprints were kept.
        assert_eq!(
            decode_remembered(&[b'A', 42, 7]),
            Some(remembered(42, 7, None))
        );
        assert_eq!(decode_remembered(&[b'A', 0x80]), None, "truncated varint");
        assert_eq!(decode_remembered(&[b'A', 1, 1, 1]), None, "trailing bytes");
        assert_eq!(
            decode_remembered(&[b'B', 1, 1, 1]),
            None,
            "short fingerprint"
        );
    }
}
