//! The ScyllaDB store (also runs on Apache Cassandra, the stand-in for tests).
//!
//! Tables (see [`migrate`]):
//! - `messages_by_key`, keyed by (sender, client_msg_id), written with
//!   `INSERT … IF NOT EXISTS`: the unique key. When the insert is not
//!   applied, the existing row comes back and its server id and seq are
//!   echoed. ScyllaDB returns the old row on every LWT reply, Cassandra only
//!   when not applied, so replies are read by column name, untyped.
//! - `messages_by_conversation`, keyed by (conversation, seq): history.
//! - `leases`: blocks of seqs per conversation, and of server ids, leased
//!   with LWTs, so no seq or id is ever handed out twice, across restarts and
//!   failover.
//!
//! Inserts for one conversation are serialised in this process (allocate a
//! seq, LWT, history row), so a message stored later never gets a smaller
//! seq, and a repeat gives its seq back. Where gaps can appear: a lease
//! block abandoned by a restart or a failover, and an LWT whose outcome is
//! unknown (timeout). History pulls are range-based, so gaps are harmless.
//!
//! A crash between the unique-key row and the history row leaves a row that
//! was never ACKed; the phone resends, the LWT is not applied, and the
//! history row is written again from the stored row (an idempotent write).

use std::{
    collections::{BTreeSet, HashMap},
    sync::Arc,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use imdedup_core::{
    Error, ErrorKind,
    metrics::{DB_CASSANDRA, StoreMetrics},
    model::{
        ClientMsgId, ConversationId, HistoryQuery, MessageKey, NewMessage, Receipt, Sender,
        StoredMessage,
    },
    store::{Insert, MessageStore},
};
use scylla::{
    client::{
        execution_profile::ExecutionProfile, session::Session, session_builder::SessionBuilder,
    },
    policies::load_balancing::DefaultPolicy,
    response::query_result::QueryResult,
    statement::{Consistency, SerialConsistency, prepared::PreparedStatement},
    value::{CqlValue, Row},
};
use tokio::sync::Mutex;
use tracing::Instrument;

use tokio_util::task::TaskTracker;

use crate::locks::LockTable;

/// Settings of the ScyllaDB store.
#[derive(Debug, Clone)]
pub struct ScyllaOptions {
    /// Contact points, `host:port`.
    pub nodes: Vec<String>,
    pub keyspace: String,
    /// Replication factor for the keyspace the migration creates.
    pub replication_factor: u32,
    pub consistency: Consistency,
    pub serial_consistency: SerialConsistency,
    pub user: Option<String>,
    pub password: Option<String>,
    pub request_timeout: Duration,
    /// Seqs leased per conversation at a time.
    pub seq_block: u64,
    /// Server ids leased at a time.
    pub id_block: u64,
    /// Connect with TLS, trusting the CA in this PEM file.
    pub tls_ca: Option<std::path::PathBuf>,
    /// Most inserts queued behind the one running for a conversation; more
    /// are refused with `overloaded`.
    pub max_waiting_per_conversation: usize,
    /// The datacenter this process talks to: requests (and so every LWT's
    /// Paxos round) go to its nodes only, never failing over to another.
    /// Required on a cluster of several datacenters when the serial
    /// consistency is LOCAL_SERIAL, which is linearizable within one
    /// datacenter only.
    pub local_dc: Option<String>,
    /// Where inserts, leases, errors and durations are counted.
    pub metrics: StoreMetrics,
    /// Create or update the schema when opening the store. Off where a
    /// separate step migrates (`imdedup migrate`, the Helm hook), so pods
    /// never race on schema changes.
    pub migrate: bool,
}

impl ScyllaOptions {
    /// Production defaults: LOCAL_QUORUM and LOCAL_SERIAL, RF 3.
    pub fn new(nodes: Vec<String>) -> Self {
        Self {
            nodes,
            keyspace: "imdedup".to_owned(),
            replication_factor: 3,
            consistency: Consistency::LocalQuorum,
            serial_consistency: SerialConsistency::LocalSerial,
            user: None,
            password: None,
            request_timeout: Duration::from_secs(2),
            seq_block: 100,
            id_block: 10_000,
            tls_ca: None,
            max_waiting_per_conversation: 512,
            local_dc: None,
            metrics: StoreMetrics::default(),
            migrate: true,
        }
    }

    /// Settings for a single local node: RF 1. LOCAL_QUORUM of one is one.
    pub fn single_node(nodes: Vec<String>) -> Self {
        Self {
            replication_factor: 1,
            ..Self::new(nodes)
        }
    }
}

/// Parse a consistency level name (`local_quorum`, `quorum`, `one`, …).
pub fn parse_consistency(raw: &str) -> Result<Consistency, Error> {
    Ok(match raw.to_ascii_lowercase().as_str() {
        "one" => Consistency::One,
        "two" => Consistency::Two,
        "three" => Consistency::Three,
        "quorum" => Consistency::Quorum,
        "all" => Consistency::All,
        "local_quorum" => Consistency::LocalQuorum,
        "each_quorum" => Consistency::EachQuorum,
        "local_one" => Consistency::LocalOne,
        other => {
            return Err(Error::invalid(format!(
                "unknown consistency level {other:?}"
            )));
        }
    })
}

/// Parse a serial consistency level name (`local_serial` or `serial`).
pub fn parse_serial_consistency(raw: &str) -> Result<SerialConsistency, Error> {
    match raw.to_ascii_lowercase().as_str() {
        "serial" => Ok(SerialConsistency::Serial),
        "local_serial" => Ok(SerialConsistency::LocalSerial),
        other => Err(Error::invalid(format!(
            "unknown serial consistency {other:?}"
        ))),
    }
}

fn db_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::unavailable(format!("cql {what}: {e}"))
}

/// A failure after which the message may be stored.
fn maybe_stored(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::MaybeStored, format!("cql {what}: {e}"))
}

/// Connect to the cluster.
pub async fn connect(options: &ScyllaOptions) -> Result<Session, Error> {
    if options.nodes.is_empty() {
        return Err(Error::invalid("no ScyllaDB contact point"));
    }
    let mut builder = SessionBuilder::new().connection_timeout(Duration::from_secs(5));
    for node in &options.nodes {
        builder = builder.known_node(node);
    }
    if let Some(user) = &options.user {
        builder = builder.user(user, options.password.clone().unwrap_or_default());
    }
    if let Some(ca) = &options.tls_ca {
        builder = builder.tls_context(Some(tls_config(ca)?));
    }
    if let Some(dc) = &options.local_dc {
        let policy = DefaultPolicy::builder()
            .prefer_datacenter(dc.clone())
            .permit_dc_failover(false)
            .token_aware(true)
            .build();
        let profile = ExecutionProfile::builder()
            .load_balancing_policy(policy)
            .build();
        builder = builder.default_execution_profile_handle(profile.into_handle());
    }
    let session = builder.build().await.map_err(|e| db_error("connect", e))?;
    let datacenters: BTreeSet<String> = session
        .get_cluster_state()
        .get_nodes_info()
        .iter()
        .filter_map(|node| node.datacenter.clone())
        .collect();
    check_datacenters(options, &datacenters)?;
    Ok(session)
}

/// LWTs under LOCAL_SERIAL are linearizable only within one datacenter: two
/// coordinators in two datacenters could both apply `IF NOT EXISTS` for one
/// key. So on several datacenters, LOCAL_SERIAL needs a local datacenter
/// with no failover (every LWT of this deployment in one datacenter), and
/// the local datacenter must exist.
fn check_datacenters(options: &ScyllaOptions, datacenters: &BTreeSet<String>) -> Result<(), Error> {
    let listed = || datacenters.iter().cloned().collect::<Vec<_>>().join(", ");
    match &options.local_dc {
        Some(dc) if !datacenters.contains(dc) => Err(Error::invalid(format!(
            "--scylla-local-dc {dc:?} is not a datacenter of this cluster ({})",
            listed()
        ))),
        None if datacenters.len() > 1
            && options.serial_consistency == SerialConsistency::LocalSerial =>
        {
            Err(Error::invalid(format!(
                "the cluster has several datacenters ({}): LOCAL_SERIAL lightweight \
                 transactions are linearizable within one datacenter only, so set \
                 --scylla-local-dc (every ingest of a deployment in the same one), or \
                 use --scylla-serial-consistency serial",
                listed()
            )))
        }
        _ => Ok(()),
    }
}

/// A TLS client configuration that trusts the CA certificates in `ca`.
fn tls_config(ca: &std::path::Path) -> Result<Arc<rustls::ClientConfig>, Error> {
    use rustls_pki_types::{CertificateDer, pem::PemObject};
    let bad = |e: &dyn std::fmt::Display| {
        Error::invalid(format!("ScyllaDB CA file {}: {e}", ca.display()))
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).map_err(|e| bad(&e))? {
        roots.add(cert.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
    }
    if roots.is_empty() {
        return Err(bad(&"no certificate in the file"));
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| bad(&e))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(config))
}

fn check_keyspace_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "keyspace name {name:?} must be 1 to 48 letters, digits or underscores"
        )))
    }
}

/// Whether the server is ScyllaDB (rather than Cassandra).
pub async fn is_scylla(session: &Session) -> Result<bool, Error> {
    let result = session
        .query_unpaged(
            "SELECT table_name FROM system_schema.tables \
             WHERE keyspace_name = 'system_schema' AND table_name = 'scylla_tables'",
            (),
        )
        .await
        .map_err(|e| db_error("probe", e))?;
    Ok(!rows(result)?.is_empty())
}

/// Create the keyspace and tables if they do not exist. Idempotent.
///
/// ScyllaDB does not support LWT in tablets keyspaces, so on ScyllaDB the
/// keyspace is created with tablets disabled (on versions without tablets
/// the option is left out).
pub async fn migrate(session: &Session, options: &ScyllaOptions) -> Result<(), Error> {
    check_keyspace_name(&options.keyspace)?;
    let ks = &options.keyspace;
    let create_keyspace = format!(
        "CREATE KEYSPACE IF NOT EXISTS {ks} WITH replication = \
         {{'class': 'NetworkTopologyStrategy', 'replication_factor': {}}}",
        options.replication_factor
    );
    if is_scylla(session).await? {
        let with_tablets_off = format!("{create_keyspace} AND tablets = {{'enabled': false}}");
        if let Err(e) = session.query_unpaged(with_tablets_off, ()).await {
            if !e.to_string().to_lowercase().contains("tablets") {
                return Err(db_error("create keyspace", e));
            }
            session
                .query_unpaged(create_keyspace, ())
                .await
                .map_err(|e| db_error("create keyspace", e))?;
        }
    } else {
        session
            .query_unpaged(create_keyspace, ())
            .await
            .map_err(|e| db_error("create keyspace", e))?;
    }
    let tables = [
        format!(
            "CREATE TABLE IF NOT EXISTS {ks}.messages_by_key (
                sender text, client_msg_id blob,
                conversation text, seq bigint, server_id bigint, body text, stored_at_ms bigint,
                PRIMARY KEY ((sender, client_msg_id)))"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {ks}.messages_by_conversation (
                conversation text, seq bigint,
                sender text, client_msg_id blob, server_id bigint, body text, stored_at_ms bigint,
                PRIMARY KEY ((conversation), seq))
             WITH CLUSTERING ORDER BY (seq ASC)"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {ks}.leases (
                scope text, name text, next_free bigint,
                PRIMARY KEY ((scope, name)))"
        ),
    ];
    for statement in tables {
        session
            .query_unpaged(statement, ())
            .await
            .map_err(|e| db_error("create table", e))?;
    }
    session
        .await_schema_agreement()
        .await
        .map_err(|e| db_error("schema agreement", e))?;
    Ok(())
}

fn rows(result: QueryResult) -> Result<Vec<HashMap<String, Option<CqlValue>>>, Error> {
    let rows = result
        .into_rows_result()
        .map_err(|e| db_error("result", e))?;
    let names: Vec<String> = rows
        .column_specs()
        .iter()
        .map(|c| c.name().to_owned())
        .collect();
    rows.rows::<Row>()
        .map_err(|e| db_error("result", e))?
        .map(|row| {
            let row = row.map_err(|e| db_error("row", e))?;
            Ok(names.iter().cloned().zip(row.columns).collect())
        })
        .collect()
}

/// Read an LWT reply: whether it was applied, and the existing row's columns
/// (present when not applied; ScyllaDB also sends them, as nulls or the old
/// row, when applied).
fn lwt(result: QueryResult) -> Result<(bool, HashMap<String, Option<CqlValue>>), Error> {
    let mut rows = rows(result)?;
    let row = rows
        .pop()
        .ok_or_else(|| Error::internal("LWT reply without a row"))?;
    let applied = matches!(row.get("[applied]"), Some(Some(CqlValue::Boolean(true))));
    Ok((applied, row))
}

fn column<'a>(
    row: &'a HashMap<String, Option<CqlValue>>,
    name: &str,
) -> Result<&'a CqlValue, Error> {
    row.get(name)
        .and_then(Option::as_ref)
        .ok_or_else(|| Error::internal(format!("row without column {name}")))
}

fn text(row: &HashMap<String, Option<CqlValue>>, name: &str) -> Result<String, Error> {
    match column(row, name)? {
        CqlValue::Text(s) | CqlValue::Ascii(s) => Ok(s.clone()),
        other => Err(Error::internal(format!(
            "column {name} is {other:?}, not text"
        ))),
    }
}

fn bigint(row: &HashMap<String, Option<CqlValue>>, name: &str) -> Result<i64, Error> {
    match column(row, name)? {
        CqlValue::BigInt(v) => Ok(*v),
        other => Err(Error::internal(format!(
            "column {name} is {other:?}, not bigint"
        ))),
    }
}

fn blob(row: &HashMap<String, Option<CqlValue>>, name: &str) -> Result<Vec<u8>, Error> {
    match column(row, name)? {
        CqlValue::Blob(v) => Ok(v.clone()),
        other => Err(Error::internal(format!(
            "column {name} is {other:?}, not blob"
        ))),
    }
}

fn to_message(row: &HashMap<String, Option<CqlValue>>) -> Result<StoredMessage, Error> {
    let bad = |e: Error| Error::internal(format!("malformed stored row: {}", e.message()));
    Ok(StoredMessage {
        key: MessageKey {
            sender: Sender::parse(text(row, "sender")?).map_err(bad)?,
            client_msg_id: ClientMsgId::parse(blob(row, "client_msg_id")?).map_err(bad)?,
        },
        conversation: ConversationId::parse(text(row, "conversation")?).map_err(bad)?,
        body: text(row, "body")?,
        receipt: Receipt {
            server_id: u64::try_from(bigint(row, "server_id")?).unwrap_or_default(),
            seq: u64::try_from(bigint(row, "seq")?).unwrap_or_default(),
        },
        stored_at_ms: bigint(row, "stored_at_ms")?,
    })
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

struct Statements {
    insert_key: PreparedStatement,
    insert_history: PreparedStatement,
    select_key: PreparedStatement,
    history: PreparedStatement,
    lease_init: PreparedStatement,
    lease_cas: PreparedStatement,
}

/// A half-open range of numbers this process may hand out.
#[derive(Debug, Default, Clone, Copy)]
struct Block {
    next: u64,
    end: u64,
}

/// The ScyllaDB [`MessageStore`].
///
/// Each insert runs in a task of its own, so a caller that gives up (a
/// deadline) never cuts an insert in half: the seq bookkeeping, the LWT and
/// the history row always finish together, in order, under the
/// conversation's lock.
pub struct ScyllaStore {
    inner: Arc<Inner>,
}

struct Inner {
    session: Arc<Session>,
    statements: Statements,
    options: ScyllaOptions,
    /// One insert at a time per conversation, with a bounded queue.
    locks: LockTable,
    /// The seq block each conversation is using. Evicting one is harmless:
    /// it is read and written back under the conversation's lock, and a
    /// block forgotten leaves a gap, never a seq handed out twice.
    seq_blocks: moka::sync::Cache<String, Block>,
    server_ids: Mutex<Block>,
    /// Inserts running in their own tasks, waited for by `drain`.
    running: TaskTracker,
}

impl ScyllaStore {
    /// Connect, migrate (unless `options.migrate` is off), and prepare the
    /// statements.
    pub async fn open(options: ScyllaOptions) -> Result<Self, Error> {
        let session = connect(&options).await?;
        let migrated = options.migrate;
        if migrated {
            migrate(&session, &options).await?;
        }
        options.metrics.start_at_zero(DB_CASSANDRA);
        let keyspace = options.keyspace.clone();
        Self::with_session(Arc::new(session), options)
            .await
            .map_err(|e| {
                if migrated {
                    e
                } else {
                    Error::new(
                        e.kind(),
                        format!(
                            "{}; is keyspace {keyspace} migrated? (`imdedup migrate`)",
                            e.message()
                        ),
                    )
                }
            })
    }

    /// Prepare the statements on an existing, migrated session.
    pub async fn with_session(
        session: Arc<Session>,
        options: ScyllaOptions,
    ) -> Result<Self, Error> {
        check_keyspace_name(&options.keyspace)?;
        let ks = &options.keyspace;
        let prepare = |cql: String, lwt: bool| {
            let session = Arc::clone(&session);
            let options = options.clone();
            async move {
                let mut statement = session
                    .prepare(cql)
                    .await
                    .map_err(|e| db_error("prepare", e))?;
                statement.set_consistency(options.consistency);
                statement.set_request_timeout(Some(options.request_timeout));
                if lwt {
                    statement.set_serial_consistency(Some(options.serial_consistency));
                } else {
                    statement.set_is_idempotent(true);
                }
                Ok::<_, Error>(statement)
            }
        };
        const COLUMNS: &str =
            "sender, client_msg_id, conversation, body, server_id, seq, stored_at_ms";
        let statements = Statements {
            insert_key: prepare(
                format!(
                    "INSERT INTO {ks}.messages_by_key ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS"
                ),
                true,
            )
            .await?,
            insert_history: prepare(
                format!("INSERT INTO {ks}.messages_by_conversation ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"),
                false,
            )
            .await?,
            select_key: prepare(
                format!("SELECT {COLUMNS} FROM {ks}.messages_by_key WHERE sender = ? AND client_msg_id = ?"),
                false,
            )
            .await?,
            history: prepare(
                format!(
                    "SELECT {COLUMNS} FROM {ks}.messages_by_conversation \
                     WHERE conversation = ? AND seq > ? ORDER BY seq ASC LIMIT ?"
                ),
                false,
            )
            .await?,
            lease_init: prepare(
                format!("INSERT INTO {ks}.leases (scope, name, next_free) VALUES (?, ?, ?) IF NOT EXISTS"),
                true,
            )
            .await?,
            lease_cas: prepare(
                format!("UPDATE {ks}.leases SET next_free = ? WHERE scope = ? AND name = ? IF next_free = ?"),
                true,
            )
            .await?,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                session,
                statements,
                locks: LockTable::new(options.max_waiting_per_conversation),
                seq_blocks: moka::sync::Cache::builder()
                    .max_capacity(1_000_000)
                    .time_to_idle(Duration::from_secs(600))
                    .build(),
                server_ids: Mutex::new(Block::default()),
                running: TaskTracker::new(),
                options,
            }),
        })
    }
}

impl Inner {
    /// Lease the next `size` numbers of (scope, name): an LWT on the lease
    /// row, retried when another process leased first.
    async fn lease(
        &self,
        scope: &str,
        name: &str,
        size: u64,
        hint: Option<u64>,
    ) -> Result<Block, Error> {
        // No read first: an LWT that is not applied returns the current
        // value, which the next try starts from. `hint` is where our last
        // block ended, usually where the next one starts.
        let mut known = hint.filter(|h| *h > 0);
        for _ in 0..64 {
            let (start, reply) = match known {
                None => (
                    1,
                    self.session
                        .execute_unpaged(
                            &self.statements.lease_init,
                            (scope, name, to_i64(1 + size)),
                        )
                        .await,
                ),
                Some(start) => (
                    start,
                    self.session
                        .execute_unpaged(
                            &self.statements.lease_cas,
                            (to_i64(start + size), scope, name, to_i64(start)),
                        )
                        .await,
                ),
            };
            let (applied, current) = lwt(reply.map_err(|e| db_error("lease", e))?)?;
            let kind = if scope == "seq" {
                "conversation"
            } else {
                "server_id"
            };
            self.options.metrics.leased(DB_CASSANDRA, kind, !applied);
            if applied {
                tracing::debug!(scope, name, start, size, "leased a block");
                return Ok(Block {
                    next: start,
                    end: start + size,
                });
            }
            known = match current.get("next_free") {
                Some(Some(CqlValue::BigInt(v))) => Some(u64::try_from(*v).unwrap_or_default()),
                // The row does not exist yet (an UPDATE … IF on no row).
                _ => None,
            };
        }
        Err(Error::unavailable(format!(
            "could not lease {scope} numbers: too much contention"
        )))
    }

    async fn next_server_id(&self) -> Result<u64, Error> {
        let mut block = self.server_ids.lock().await;
        if block.next >= block.end {
            let hint = Some(block.end);
            *block = self
                .lease("server_id", "", self.options.id_block, hint)
                .await?;
        }
        let id = block.next;
        block.next += 1;
        Ok(id)
    }

    async fn write_history(&self, row: &StoredMessage) -> Result<(), Error> {
        self.session
            .execute_unpaged(
                &self.statements.insert_history,
                (
                    row.key.sender.as_str(),
                    row.key.client_msg_id.as_bytes(),
                    row.conversation.as_str(),
                    row.body.as_str(),
                    to_i64(row.receipt.server_id),
                    to_i64(row.receipt.seq),
                    row.stored_at_ms,
                ),
            )
            .await
            // The unique-key row is written: the message is stored, not yet
            // in the history. The resend rewrites the history row.
            .map_err(|e| maybe_stored("history write", e))?;
        Ok(())
    }
}

fn unix_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

impl Inner {
    /// Count one operation that started at `started`.
    fn record<T>(&self, operation: &'static str, started: Instant, result: &Result<T, Error>) {
        self.options
            .metrics
            .operation(DB_CASSANDRA, operation, started.elapsed(), result.is_ok());
    }

    /// [`Inner::insert`], timed: counted even when the caller gave up.
    async fn insert_counted(&self, message: NewMessage) -> Result<Insert, Error> {
        let started = Instant::now();
        let result = self.insert(message).await;
        self.record("insert", started, &result);
        result
    }

    async fn insert(&self, message: NewMessage) -> Result<Insert, Error> {
        let conversation = message.conversation.as_str().to_owned();
        // One insert at a time per conversation: seqs follow storage order.
        let locked = self.locks.lock(&conversation).await?;
        let mut seqs = self.seq_blocks.get(&conversation).unwrap_or_default();
        if seqs.next >= seqs.end {
            seqs = self
                .lease("seq", &conversation, self.options.seq_block, Some(seqs.end))
                .await?;
        }
        // Reserved now: whatever happens next, this seq is never handed
        // out twice; only a definite "not applied" gives it back.
        let seq = seqs.next;
        seqs.next += 1;
        self.seq_blocks.insert(conversation.clone(), seqs);
        let row = StoredMessage {
            receipt: Receipt {
                server_id: self.next_server_id().await?,
                seq,
            },
            key: message.key,
            conversation: message.conversation,
            body: message.body.into_string(),
            stored_at_ms: unix_millis(),
        };
        let reply = self
            .session
            .execute_unpaged(
                &self.statements.insert_key,
                (
                    row.key.sender.as_str(),
                    row.key.client_msg_id.as_bytes(),
                    row.conversation.as_str(),
                    row.body.as_str(),
                    to_i64(row.receipt.server_id),
                    to_i64(seq),
                    row.stored_at_ms,
                ),
            )
            .instrument(tracing::info_span!(
                "cassandra.lwt",
                otel.name = "INSERT messages_by_key",
                otel.kind = "client",
                db.system = "cassandra",
                db.operation = "INSERT",
                db.name = %self.options.keyspace,
                db.cassandra.table = "messages_by_key",
            ))
            .await;
        let (applied, existing) = match reply {
            Ok(reply) => lwt(reply)?,
            Err(e) => {
                // The outcome is unknown: the seq stays spent (a possible gap),
                // and the resend decides.
                return Err(maybe_stored("insert", e));
            }
        };
        self.options.metrics.inserted(DB_CASSANDRA, applied);
        if applied {
            // Still under the lock: a reader never sees seq n+1 before n.
            self.write_history(&row).await?;
            Ok(Insert::Stored(row))
        } else {
            // A repeat: the seq was not used, keep it for the next message.
            seqs.next -= 1;
            self.seq_blocks.insert(conversation, seqs);
            drop(locked);
            let original = to_message(&existing)?;
            // Repairs a history row lost to a crash after the LWT.
            self.write_history(&original).await?;
            Ok(Insert::AlreadyStored(original))
        }
    }
}

impl ScyllaStore {
    async fn lookup_uncounted(&self, key: &MessageKey) -> Result<Option<StoredMessage>, Error> {
        let result = self
            .inner
            .session
            .execute_unpaged(
                &self.inner.statements.select_key,
                (key.sender.as_str(), key.client_msg_id.as_bytes()),
            )
            .await
            .map_err(|e| db_error("lookup", e))?;
        rows(result)?.first().map(to_message).transpose()
    }

    async fn history_uncounted(&self, query: &HistoryQuery) -> Result<Vec<StoredMessage>, Error> {
        let limit = i32::try_from(query.limit).unwrap_or(i32::MAX);
        let result = self
            .inner
            .session
            .execute_unpaged(
                &self.inner.statements.history,
                (query.conversation.as_str(), to_i64(query.after_seq), limit),
            )
            .await
            .map_err(|e| db_error("history", e))?;
        rows(result)?.iter().map(to_message).collect()
    }
}

#[async_trait]
impl MessageStore for ScyllaStore {
    async fn insert_once(&self, message: NewMessage) -> Result<Insert, Error> {
        let inner = Arc::clone(&self.inner);
        // In the caller's span: the LWT's span belongs to this send's trace.
        let running = inner.running.clone();
        running
            .spawn(async move { inner.insert_counted(message).await }.in_current_span())
            .await
            .map_err(|e| Error::internal(format!("insert task failed: {e}")))?
    }

    async fn lookup(&self, key: &MessageKey) -> Result<Option<StoredMessage>, Error> {
        let started = Instant::now();
        let result = self.lookup_uncounted(key).await;
        self.inner.record("lookup", started, &result);
        result
    }

    async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredMessage>, Error> {
        let started = Instant::now();
        let result = self.history_uncounted(query).await;
        self.inner.record("history", started, &result);
        result
    }

    async fn drain(&self) {
        self.inner.running.close();
        self.inner.running.wait().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consistency_names_parse() {
        assert_eq!(
            parse_consistency("LOCAL_QUORUM").unwrap(),
            Consistency::LocalQuorum
        );
        assert_eq!(
            parse_serial_consistency("serial").unwrap(),
            SerialConsistency::Serial
        );
        assert!(parse_consistency("most").is_err());
    }

    #[test]
    fn local_serial_on_several_datacenters_needs_a_local_datacenter() {
        let dcs = |names: &[&str]| names.iter().map(|n| n.to_string()).collect();
        let mut options = ScyllaOptions::new(vec!["n:9042".into()]);
        assert!(check_datacenters(&options, &dcs(&["dc1"])).is_ok());
        let err = check_datacenters(&options, &dcs(&["dc1", "dc2"])).unwrap_err();
        assert!(err.message().contains("--scylla-local-dc"), "{err}");

        options.local_dc = Some("dc2".into());
        assert!(check_datacenters(&options, &dcs(&["dc1", "dc2"])).is_ok());
        let err = check_datacenters(&options, &dcs(&["dc1", "dc3"])).unwrap_err();
        assert!(err.message().contains("not a datacenter"), "{err}");

        options.local_dc = None;
        options.serial_consistency = SerialConsistency::Serial;
        assert!(check_datacenters(&options, &dcs(&["dc1", "dc2"])).is_ok());
    }

    #[test]
    fn keyspace_names_are_plain_identifiers() {
        assert!(check_keyspace_name("imdedup_test").is_ok());
        assert!(check_keyspace_name("x; DROP").is_err());
        assert!(check_keyspace_name("").is_err());
    }
}
