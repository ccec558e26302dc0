//! The ScyllaDB store (also runs on Apache Cassandra, the stand-in for tests).
//!
//! Tables (see [`schema::migrate`]):
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
//!
//! Files: [`options`] (settings), [`session`] (connecting), [`schema`] (the
//! tables), [`rows`] (reading replies), [`leases`] (seq and server-id
//! blocks); the store and its insert are here.

mod leases;
mod options;
mod rows;
mod schema;
mod session;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use imdedup_core::{
    Error,
    metrics::DB_CASSANDRA,
    model::{HistoryQuery, MessageKey, NewMessage, Receipt, StoredMessage},
    store::{Insert, MessageStore},
};
use scylla::{client::session::Session, statement::prepared::PreparedStatement};
use tokio::sync::Mutex;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

pub use options::{ScyllaOptions, parse_consistency, parse_serial_consistency};
pub use schema::{is_scylla, migrate};
pub use session::connect;

use crate::locks::LockTable;
use options::check_keyspace_name;
use rows::{db_error, lwt, maybe_stored, rows, to_i64, to_message};

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
    async fn write_history(&self, row: &StoredMessage) -> Result<(), Error> {
        self.session
            .execute_unpaged(&self.statements.insert_history, columns(row))
            .await
            // The unique-key row is written: the message is stored, not yet
            // in the history. The resend rewrites the history row.
            .map_err(|e| maybe_stored("history write", e))?;
        Ok(())
    }
}

/// A row's values in the order of `COLUMNS`, for both insert statements.
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
            .execute_unpaged(&self.statements.insert_key, columns(&row))
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
