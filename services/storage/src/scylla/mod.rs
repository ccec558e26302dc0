//! The ScyllaDB store (also runs on Apache Cassandra, the stand-in for tests).
//!
//! Tables (see [`schema::migrate`]):
//! - `messages_by_conversation`, keyed by (conversation, seq): the history,
//!   and at negative seqs the conversation's unique keys (sender, ID), both
//!   written by one conditional batch per new message ([`insert`]). Rows an
//!   older version wrote there may be pending, committed or abandoned
//!   ([`publish`]).
//! - `messages_by_key`, keyed by (sender, client_msg_id): each message's
//!   *global row*, written plainly after its batch, for lookups by key (and
//!   by older versions, which kept the unique key here with an LWT).
//! - `leases`: blocks of seqs per conversation, with the instance that owns
//!   the conversation, and blocks of server ids, leased with LWTs, so no seq
//!   or id is ever handed out twice, across restarts and failover.
//! - `members`: the writer processes alive ([`members`]).
//! - `layout_changes`: since when keys are kept per conversation.
//!
//! One insert, under its conversation's lock in this process: take a seq
//! from the conversation's block (leasing one, as its owner, when needed);
//! one conditional batch writes the key row and the history row; then the
//! global row. Gaps (a block left behind by a restart, an insert whose
//! outcome was unknown and which never applied) are harmless, as history
//! pulls are range-based.
//!
//! Files: [`options`] (settings), [`session`] (connecting), [`schema`] (the
//! tables), [`rows`] (reading replies), [`insert`] (a new message's one
//! round), [`leases`] (seq and server-id blocks), [`members`] (writer
//! membership), [`publish`] (what readers see), [`stalls`] (routing around a
//! replica that stopped answering); the store is here.

#[cfg(feature = "testing")]
mod faults;
mod insert;
mod leases;
mod members;
mod options;
mod publish;
mod requests;
mod rows;
mod schema;
mod session;
mod stalls;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::metrics::DB_CASSANDRA;
use async_trait::async_trait;
use imdedup_domain::{
    Error,
    model::{HistoryQuery, MessageKey, NewMessage, StoredMessage},
    store::{Insert, MessageStore},
};
use scylla::{
    client::session::Session,
    statement::batch::{Batch, BatchType},
};
use tokio::sync::Mutex;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

#[cfg(feature = "testing")]
pub use faults::Faults;
pub use options::{ScyllaOptions, parse_consistency, parse_serial_consistency};
pub use requests::RequestKind;
pub use schema::{is_scylla, migrate};
pub use session::connect;

use crate::locks::LockTable;
use members::Membership;
use options::check_keyspace_name;
use requests::{Counted, CountedBatch};
use rows::{KeyRow, db_error, rows, to_i64};

struct Statements {
    /// The key row `IF NOT EXISTS`, the history row and the conversation's
    /// `last_seq` `IF` it is still the one seen last, in one round.
    insert_message: CountedBatch,
    insert_global: Counted,
    history_row: Counted,
    commit_history: Counted,
    abandon_history: Counted,
    select_key: Counted,
    select_key_serial: Counted,
    history: Counted,
    lease_init: Counted,
    lease_cas: Counted,
    lease_seq_init: Counted,
    lease_seq_take: Counted,
}

/// A half-open range of numbers this process may hand out.
#[derive(Debug, Default, Clone, Copy)]
struct Block {
    next: u64,
    end: u64,
    /// The membership epoch it was leased in; void in a later one.
    epoch: u64,
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
    /// The seq block each conversation is using, and its `last_seq` as this
    /// process last saw it. Evicting one is harmless: it is read and
    /// written back under the conversation's lock, a block forgotten leaves
    /// a gap, never a seq handed out twice, and a `last_seq` forgotten costs
    /// one more round.
    seq_blocks: moka::sync::Cache<String, insert::Seqs>,
    /// This process as a writer: owner of the conversations it leases.
    member: Arc<Membership>,
    /// Until when (Unix ms) inserts also check the key table of the layout
    /// before keys were kept per conversation; 0 on a keyspace made after.
    legacy_keys_until_ms: i64,
    server_ids: Mutex<Block>,
    /// Inserts running in their own tasks, waited for by `drain`.
    running: TaskTracker,
}

impl ScyllaStore {
    /// Connect, migrate (unless `options.migrate` is off), and prepare the
    /// statements.
    pub async fn open(options: ScyllaOptions) -> Result<Self, Error> {
        options.check()?;
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
        const COLUMNS: &str =
            "sender, client_msg_id, conversation, body, server_id, seq, stored_at_ms";
        let prepare = |cql: String, kind: RequestKind| {
            // Every request but an LWT is safe to send twice (the message's
            // batch is prepared below, and is too).
            let idempotent = kind != RequestKind::Lwt;
            let session = Arc::clone(&session);
            let options = options.clone();
            async move {
                let mut statement = session
                    .prepare(cql)
                    .await
                    .map_err(|e| db_error("prepare", e))?;
                statement.set_consistency(options.consistency);
                statement.set_request_timeout(Some(options.request_timeout));
                match kind {
                    RequestKind::Lwt => {
                        statement.set_serial_consistency(Some(options.serial_consistency));
                    }
                    RequestKind::SerialRead => {
                        // A read at SERIAL: settles a Paxos round in flight.
                        statement.set_consistency(match options.serial_consistency {
                            scylla::statement::SerialConsistency::Serial => {
                                scylla::statement::Consistency::Serial
                            }
                            scylla::statement::SerialConsistency::LocalSerial => {
                                scylla::statement::Consistency::LocalSerial
                            }
                        });
                    }
                    RequestKind::Write | RequestKind::Read => {}
                }
                statement.set_is_idempotent(idempotent);
                Ok::<_, Error>(Counted::new(statement, kind, &options.metrics))
            }
        };
        let insert_message = {
            let key_row = session
                .prepare(format!(
                    "INSERT INTO {ks}.messages_by_conversation \
                     (conversation, seq, sender, client_msg_id, server_id, key_seq, fingerprint, \
                     stored_at_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS"
                ))
                .await
                .map_err(|e| db_error("prepare", e))?;
            let history_row = session
                .prepare(format!(
                    "INSERT INTO {ks}.messages_by_conversation ({COLUMNS}) \
                     VALUES (?, ?, ?, ?, ?, ?, ?)"
                ))
                .await
                .map_err(|e| db_error("prepare", e))?;
            // The conversation's last seq moves to this message's, only
            // from the one its writer saw last: batches apply in seq order,
            // and one that reaches a server late never applies.
            let last_seq = session
                .prepare(format!(
                    "UPDATE {ks}.messages_by_conversation SET last_seq = ? \
                     WHERE conversation = ? IF last_seq = ?"
                ))
                .await
                .map_err(|e| db_error("prepare", e))?;
            // The key row first: the batch is routed by its partition.
            let mut batch = Batch::new(BatchType::Unlogged);
            batch.append_statement(key_row);
            batch.append_statement(history_row);
            batch.append_statement(last_seq);
            batch.set_consistency(options.consistency);
            batch.set_serial_consistency(Some(options.serial_consistency));
            batch.set_request_timeout(Some(options.request_timeout));
            // A second copy finds the rows the first wrote, with this
            // message's receipt, which `Inner::claim` takes as its own.
            batch.set_is_idempotent(true);
            CountedBatch::new(batch, RequestKind::Lwt, &options.metrics)
        };
        let serial = prepare(
            format!(
                "SELECT {COLUMNS} FROM {ks}.messages_by_key WHERE sender = ? AND client_msg_id = ?"
            ),
            RequestKind::SerialRead,
        )
        .await?;
        let statements = Statements {
            insert_message,
            insert_global: prepare(
                format!(
                    "INSERT INTO {ks}.messages_by_key ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
                ),
                RequestKind::Write,
            )
            .await?,
            history_row: prepare(
                format!(
                    "SELECT {COLUMNS}, pending, committed, abandoned \
                     FROM {ks}.messages_by_conversation WHERE conversation = ? AND seq = ?"
                ),
                RequestKind::Read,
            )
            .await?,
            commit_history: prepare(
                format!(
                    "INSERT INTO {ks}.messages_by_conversation ({COLUMNS}, committed) \
                     VALUES (?, ?, ?, ?, ?, ?, ?, true)"
                ),
                RequestKind::Write,
            )
            .await?,
            abandon_history: prepare(
                format!(
                    "UPDATE {ks}.messages_by_conversation SET abandoned = true \
                     WHERE conversation = ? AND seq = ?"
                ),
                RequestKind::Write,
            )
            .await?,
            select_key_serial: serial,
            select_key: prepare(
                format!("SELECT {COLUMNS} FROM {ks}.messages_by_key WHERE sender = ? AND client_msg_id = ?"),
                RequestKind::Read,
            )
            .await?,
            history: prepare(
                format!(
                    "SELECT {COLUMNS}, pending, committed, abandoned \
                     FROM {ks}.messages_by_conversation \
                     WHERE conversation = ? AND seq > ? ORDER BY seq ASC LIMIT ?"
                ),
                RequestKind::Read,
            )
            .await?,
            lease_init: prepare(
                format!("INSERT INTO {ks}.leases (scope, name, next_free) VALUES (?, ?, ?) IF NOT EXISTS"),
                RequestKind::Lwt,
            )
            .await?,
            lease_cas: prepare(
                format!("UPDATE {ks}.leases SET next_free = ? WHERE scope = ? AND name = ? IF next_free = ?"),
                RequestKind::Lwt,
            )
            .await?,
            lease_seq_init: prepare(
                format!(
                    "INSERT INTO {ks}.leases (scope, name, next_free, owner) \
                     VALUES (?, ?, ?, ?) IF NOT EXISTS"
                ),
                RequestKind::Lwt,
            )
            .await?,
            lease_seq_take: prepare(
                format!(
                    "UPDATE {ks}.leases SET next_free = ?, owner = ? \
                     WHERE scope = ? AND name = ? IF next_free = ? AND owner = ?"
                ),
                RequestKind::Lwt,
            )
            .await?,
        };
        let legacy_keys_until_ms = legacy_keys_until(&session, &options).await?;
        let member = Membership::join(Arc::clone(&session), &options).await?;
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
                member,
                legacy_keys_until_ms,
                running: TaskTracker::new(),
                options,
            }),
        })
    }
}

/// Until when (Unix ms) inserts check the key table of the layout before
/// keys were kept per conversation: the upgrade's time plus the horizon, or
/// 0 on a keyspace made after.
async fn legacy_keys_until(session: &Session, options: &ScyllaOptions) -> Result<i64, Error> {
    let result = session
        .query_unpaged(
            format!(
                "SELECT since_ms FROM {}.layout_changes WHERE name = ?",
                options.keyspace
            ),
            (schema::CONVERSATION_KEYS,),
        )
        .await
        .map_err(|e| db_error("read the layout", e))?;
    let since_ms = rows::<(i64,)>(result)?
        .into_iter()
        .next()
        .map(|(since,)| since)
        .ok_or_else(|| Error::unavailable("the keyspace's layout is not recorded"))?;
    Ok(if since_ms == 0 {
        0
    } else {
        since_ms.saturating_add(millis(options.legacy_key_horizon))
    })
}

/// A row's values in the order of `COLUMNS`, for the history and global
/// rows.
fn columns(row: &StoredMessage) -> (&str, &[u8], &str, &str, i64, i64, i64) {
    (
        row.key.sender.as_str(),
        row.key.client_msg_id.as_bytes(),
        row.conversation.as_str(),
        row.body.as_str(),
        to_i64(row.receipt.server_id),
        to_i64(row.receipt.seq),
        row.stored_at_ms,
    )
}

fn unix_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, millis)
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
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
}

impl ScyllaStore {
    async fn lookup_uncounted(&self, key: &MessageKey) -> Result<Option<StoredMessage>, Error> {
        let result = self
            .inner
            .statements
            .select_key
            .execute(
                &self.inner.session,
                (key.sender.as_str(), key.client_msg_id.as_bytes()),
            )
            .await
            .map_err(|e| db_error("lookup", e))?;
        rows::<KeyRow>(result)?
            .into_iter()
            .next()
            .map(KeyRow::into_message)
            .transpose()
    }

    async fn history_uncounted(&self, query: &HistoryQuery) -> Result<Vec<StoredMessage>, Error> {
        self.inner.published(query).await
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
        // Every write of ours has ended: others may take our conversations.
        self.inner.member.relinquish().await;
    }
}
