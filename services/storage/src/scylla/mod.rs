//! The ScyllaDB store (also runs on Apache Cassandra, the stand-in for tests).
//!
//! Tables (see [`schema::migrate`]):
//! - `messages_by_key`, keyed by (sender, client_msg_id), written with
//!   `INSERT … IF NOT EXISTS`: the unique key. When the insert is not
//!   applied, the existing row comes back and its server id and seq are
//!   echoed. ScyllaDB returns the old row on every LWT reply, Cassandra only
//!   when not applied, so replies are read by column name, untyped.
//! - `messages_by_conversation`, keyed by (conversation, seq): history,
//!   each row pending, committed or abandoned ([`publish`]).
//! - `leases`: blocks of seqs per conversation, with the instance that owns
//!   the conversation, and blocks of server ids, leased with LWTs, so no seq
//!   or id is ever handed out twice, across restarts and failover.
//! - `members`: the writer processes alive ([`members`]).
//!
//! One insert, under its conversation's lock in this process: take a seq
//! from the conversation's block (leasing one, as its owner, when needed);
//! write the history row pending; the LWT; commit the row. Readers stop at
//! a pending row, so a cursor never passes a seq that may still appear;
//! gaps (a repeat's abandoned seq, a block left behind by a restart) are
//! harmless, as history pulls are range-based.
//!
//! Files: [`options`] (settings), [`session`] (connecting), [`schema`] (the
//! tables), [`rows`] (reading replies), [`leases`] (seq and server-id
//! blocks), [`members`] (writer membership), [`publish`] (pending rows and
//! what readers see), [`stalls`] (routing around a replica that stopped
//! answering); the store and its insert are here.

#[cfg(feature = "testing")]
mod faults;
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
    model::{HistoryQuery, MessageKey, NewMessage, Receipt, StoredMessage},
    store::{Insert, MessageStore},
};
use scylla::client::session::Session;
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
use requests::Counted;
use rows::{ExistingKey, KeyRow, db_error, lwt, maybe_stored, rows, to_i64};

struct Statements {
    insert_key: Counted,
    insert_pending: Counted,
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
    /// The seq block each conversation is using. Evicting one is harmless:
    /// it is read and written back under the conversation's lock, and a
    /// block forgotten leaves a gap, never a seq handed out twice.
    seq_blocks: moka::sync::Cache<String, Block>,
    /// This process as a writer: owner of the conversations it leases.
    member: Arc<Membership>,
    /// Pending rows whose LWT failed with an unknown outcome, by key: the
    /// next LWT of the same key (the phone's resend) settles them at once
    /// instead of leaving readers waiting for the fence.
    in_doubt: moka::sync::Cache<MessageKey, StoredMessage>,
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
        let insert_key_cql = format!(
            "INSERT INTO {ks}.messages_by_key ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS"
        );
        let prepare = |cql: String, kind: RequestKind| {
            // Every request but an LWT is safe to send twice, and so is the
            // unique key's: a second copy finds the row the first one
            // wrote, which `Inner::insert` takes as its own.
            let idempotent = kind != RequestKind::Lwt || cql == insert_key_cql;
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
        let serial = prepare(
            format!(
                "SELECT {COLUMNS} FROM {ks}.messages_by_key WHERE sender = ? AND client_msg_id = ?"
            ),
            RequestKind::SerialRead,
        )
        .await?;
        let statements = Statements {
            insert_key: prepare(insert_key_cql.clone(), RequestKind::Lwt)
            .await?,
            insert_pending: prepare(
                format!(
                    "INSERT INTO {ks}.messages_by_conversation ({COLUMNS}, pending, abandoned) \
                     VALUES (?, ?, ?, ?, ?, ?, ?, true, false)"
                ),
                RequestKind::Write,
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
                in_doubt: moka::sync::Cache::builder()
                    .max_capacity(100_000)
                    .time_to_live(options.pending_fence)
                    .build(),
                running: TaskTracker::new(),
                options,
            }),
        })
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

/// What an LWT that was not applied found in the key: the original, or
/// `None` when it is `row` itself. The driver sends the LWT again to another
/// replica when the first is slow to answer; when both copies ran, the one
/// answered second finds the row the other wrote. The receipt tells them
/// apart: a server id is never handed out twice.
fn original_of(existing: StoredMessage, row: &StoredMessage) -> Option<StoredMessage> {
    (existing.receipt != row.receipt).then_some(existing)
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

    async fn insert(&self, message: NewMessage) -> Result<Insert, Error> {
        let conversation = message.conversation.as_str().to_owned();
        // One insert at a time per conversation: seqs follow storage order.
        let locked = self.locks.lock(&conversation).await?;
        // Writes start only while this process's membership holds.
        let epoch = self.member.writable()?;
        let cached = self.seq_blocks.get(&conversation).unwrap_or_default();
        let mut seqs = cached;
        if seqs.epoch != epoch || seqs.next >= seqs.end {
            seqs = self
                .lease_seqs(&conversation, Some(cached.end), epoch)
                .await?;
        }
        // Reserved now: whatever happens next, this seq is never handed
        // out twice.
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
        // Readers stop at this row until it is committed or abandoned.
        self.write_pending(&row).await?;
        if unix_millis() - row.stored_at_ms > millis(self.options.request_timeout) {
            // Too slow to start the LWT now: readers must be able to tell,
            // once the fence passes, that no LWT for this row can still run.
            self.abandon(&row).await?;
            return Err(Error::unavailable("the database is slow; retry"));
        }
        let reply = self
            .statements
            .insert_key
            .execute(&self.session, columns(&row))
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
            Ok(reply) => lwt::<ExistingKey>(reply)?,
            Err(e) => {
                // The outcome is unknown: the row stays pending, the resend
                // (or a reader, after the fence) settles it.
                self.in_doubt.insert(row.key.clone(), row);
                return Err(maybe_stored("insert", e));
            }
        };
        let original = if applied {
            None
        } else {
            original_of(existing.into_message()?, &row)
        };
        self.options
            .metrics
            .inserted(DB_CASSANDRA, original.is_none());
        if let Some(earlier) = self.in_doubt.remove(&row.key) {
            // The key's fate is known now: an earlier try whose LWT failed
            // either stored it (the row it left is the original, committed
            // below) or can never apply (its seq is abandoned).
            let settled = original.as_ref().unwrap_or(&row);
            if settled.receipt != earlier.receipt
                && let Err(e) = self.abandon(&earlier).await
            {
                tracing::warn!(error = %e, seq = earlier.receipt.seq, "could not abandon a pending row; readers settle it after the fence");
            }
        }
        if let Some(original) = original {
            // A repeat: the seq was not used. Once its row is marked
            // abandoned, the next message takes the seq again (its pending
            // write, later from this process's clock, clears the mark), so
            // repeats leave no gaps.
            match self.abandon(&row).await {
                Ok(()) => {
                    if let Some(mut block) = self.seq_blocks.get(&conversation)
                        && block.next == seq + 1
                    {
                        block.next = seq;
                        self.seq_blocks.insert(conversation, block);
                    }
                }
                Err(e) => tracing::warn!(
                    error = %e,
                    seq,
                    "could not abandon a pending row; readers settle it after the fence"
                ),
            }
            drop(locked);
            // Commits the original if its own commit was lost.
            self.commit(&original).await?;
            Ok(Insert::AlreadyStored(original))
        } else {
            self.commit(&row).await?;
            Ok(Insert::Stored(row))
        }
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

#[cfg(test)]
mod tests {
    use imdedup_domain::model::{ClientMsgId, ConversationId, Sender};

    use super::*;

    fn row(server_id: u64, seq: u64) -> StoredMessage {
        StoredMessage {
            key: MessageKey {
                sender: Sender::parse("ana").unwrap(),
                client_msg_id: ClientMsgId::parse(b"m-1".to_vec()).unwrap(),
            },
            conversation: ConversationId::parse("dm:ana:ben").unwrap(),
            body: "hi".to_owned(),
            receipt: Receipt { server_id, seq },
            stored_at_ms: 1,
        }
    }

    #[test]
    fn a_key_holding_this_very_row_is_not_a_repeat() {
        // A second copy of the same LWT: the key holds what the first wrote.
        assert_eq!(original_of(row(7, 3), &row(7, 3)), None);
        // An earlier send of the same ID: its receipt is another.
        assert_eq!(original_of(row(5, 2), &row(7, 3)), Some(row(5, 2)));
    }
}
