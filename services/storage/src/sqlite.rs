//! The embedded store: SQLite on disk, with a real UNIQUE key on
//! (sender, client_msg_id), WAL with `synchronous=FULL`, and group commit.
//!
//! One writer thread owns the write connection. It takes every insert that
//! is waiting (up to `max_batch`), runs them in one transaction, commits
//! once (one fsync for the batch), and only then answers each caller. With
//! a `commit_delay`, a batch that is not full waits that long for more
//! inserts first: at low rates, where inserts do not queue, it trades that
//! much latency for fewer transactions and fsyncs. An insert is still
//! answered only after its commit.
//!
//! An insert is one statement: its seq is one more than the highest of its
//! conversation (read from the `(conversation, seq)` key under the
//! transaction's write lock), so a repeat, which fails on the unique key,
//! has changed nothing (SQLite undoes only the failed statement) and never
//! spends a seq. Files written before this kept the last seq in a
//! `conversations` table as well; it is left as it is and no longer
//! written. Reads use a small pool of separate connections.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use crate::metrics::{DB_SQLITE, StoreMetrics};
use async_trait::async_trait;
use imdedup_domain::{
    Error,
    model::{
        ClientMsgId, ConversationId, HistoryQuery, MessageKey, NewMessage, Receipt, Sender,
        StoredMessage,
    },
    store::{Insert, MessageStore},
};
use rusqlite::{Connection, OpenFlags, OptionalExtension, Row, TransactionBehavior, params};
use tokio::sync::{Semaphore, mpsc, oneshot};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS messages (
    server_id     INTEGER PRIMARY KEY,
    sender        TEXT    NOT NULL,
    client_msg_id BLOB    NOT NULL,
    conversation  TEXT    NOT NULL,
    seq           INTEGER NOT NULL,
    body          TEXT    NOT NULL,
    stored_at_ms  INTEGER NOT NULL,
    UNIQUE (sender, client_msg_id),
    UNIQUE (conversation, seq)
);
";

const COLUMNS: &str = "sender, client_msg_id, conversation, body, server_id, seq, stored_at_ms";

/// Settings of the embedded store.
#[derive(Debug, Clone)]
pub struct SqliteOptions {
    /// The database file; its directory is created if missing.
    pub path: PathBuf,
    /// Most inserts committed in one transaction.
    pub max_batch: usize,
    /// How long a batch that is not full waits for more inserts before its
    /// commit (zero: commit what is waiting at once).
    pub commit_delay: Duration,
    /// Read connections for lookups and history.
    pub readers: usize,
    /// Where inserts, errors and durations are counted.
    pub metrics: StoreMetrics,
}

impl SqliteOptions {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            max_batch: 512,
            commit_delay: Duration::ZERO,
            readers: 4,
            metrics: StoreMetrics::default(),
        }
    }
}

struct WriteJob {
    message: NewMessage,
    reply: oneshot::Sender<Result<Insert, Error>>,
}

/// The embedded [`MessageStore`].
pub struct SqliteStore {
    writer: mpsc::Sender<WriteJob>,
    readers: Arc<Mutex<Vec<Connection>>>,
    /// One permit per pooled reader, so a read waits for a free connection.
    reader_permits: Arc<Semaphore>,
    metrics: StoreMetrics,
}

impl SqliteStore {
    /// Open (creating if needed) the database and start the writer thread.
    pub fn open(options: &SqliteOptions) -> Result<Self, Error> {
        if let Some(dir) = options.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                Error::internal(format!(
                    "cannot create data directory {}: {e}",
                    dir.display()
                ))
            })?;
        }
        let writer = open_connection(&options.path, false)?;
        writer.execute_batch(SCHEMA).map_err(sql_error)?;
        let readers = (0..options.readers.max(1))
            .map(|_| open_connection(&options.path, true))
            .collect::<Result<Vec<_>, _>>()?;

        let (tx, rx) = mpsc::channel(options.max_batch.max(1) * 4);
        let (max_batch, delay) = (options.max_batch.max(1), options.commit_delay);
        let metrics = options.metrics.clone();
        thread::Builder::new()
            .name("sqlite-writer".into())
            .spawn(move || run_writer(writer, rx, max_batch, delay, &metrics))
            .map_err(|e| Error::internal(format!("cannot start the writer thread: {e}")))?;
        options.metrics.start_at_zero(DB_SQLITE);
        Ok(Self {
            writer: tx,
            reader_permits: Arc::new(Semaphore::new(readers.len())),
            readers: Arc::new(Mutex::new(readers)),
            metrics: options.metrics.clone(),
        })
    }

    async fn read<T, F>(&self, f: F) -> Result<T, Error>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let permit = Arc::clone(&self.reader_permits)
            .acquire_owned()
            .await
            .map_err(|_| Error::unavailable("storage is closed"))?;
        let readers = Arc::clone(&self.readers);
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let conn = readers
                .lock()
                .map_err(|_| Error::internal("reader pool poisoned"))?
                .pop()
                .ok_or_else(|| Error::internal("reader pool is empty despite a permit"))?;
            let result = f(&conn).map_err(sql_error);
            if let Ok(mut pool) = readers.lock() {
                pool.push(conn);
            }
            result
        })
        .await
        .map_err(|e| Error::internal(format!("storage read task failed: {e}")))?
    }
}

fn open_connection(path: &Path, read_only: bool) -> Result<Connection, Error> {
    let flags = if read_only {
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX
    } else {
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
    };
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| Error::internal(format!("cannot open database {}: {e}", path.display())))?;
    conn.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(sql_error)?;
    if !read_only {
        // WAL lets readers run beside the writer; FULL makes every commit
        // durable before the ACK goes out.
        conn.execute_batch("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;")
            .map_err(sql_error)?;
    }
    Ok(conn)
}

fn sql_error(e: rusqlite::Error) -> Error {
    Error::internal(format!("sqlite: {e}"))
}

fn run_writer(
    mut conn: Connection,
    mut jobs: mpsc::Receiver<WriteJob>,
    max_batch: usize,
    commit_delay: Duration,
    metrics: &StoreMetrics,
) {
    let mut batch = Vec::with_capacity(max_batch);
    let take_waiting = |jobs: &mut mpsc::Receiver<WriteJob>, batch: &mut Vec<WriteJob>| {
        while batch.len() < max_batch {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
    };
    while let Some(first) = jobs.blocking_recv() {
        batch.push(first);
        take_waiting(&mut jobs, &mut batch);
        if !commit_delay.is_zero() && batch.len() < max_batch {
            thread::sleep(commit_delay);
            take_waiting(&mut jobs, &mut batch);
        }
        metrics.writer_queue(DB_SQLITE, batch.len() + jobs.len());
        match write_batch(&mut conn, &batch) {
            Ok(results) => {
                for (job, result) in batch.drain(..).zip(results) {
                    // The caller may have given up (deadline); the row stays.
                    let _ = job.reply.send(result);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, batch = batch.len(), "group commit failed");
                let err = sql_error(e);
                for job in batch.drain(..) {
                    let _ = job.reply.send(Err(err.clone()));
                }
            }
        }
    }
    tracing::debug!("sqlite writer stopped");
}

/// One transaction for the whole batch. Each insert is one statement, so a
/// repeat (or a per-message failure) undoes only its own work.
fn write_batch(
    conn: &mut Connection,
    batch: &[WriteJob],
) -> rusqlite::Result<Vec<Result<Insert, Error>>> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let now_ms = unix_millis();
    let mut results = Vec::with_capacity(batch.len());
    for job in batch {
        match insert_one(&tx, &job.message, now_ms) {
            Ok(stored) => results.push(Ok(Insert::Stored(stored))),
            Err(e) if is_unique_violation(&e) => {
                let original = select_by_key(&tx, &job.message.key)?;
                results.push(match original {
                    Some(row) => Ok(Insert::AlreadyStored(row)),
                    None => Err(Error::internal(format!(
                        "unique key violated but no row found: {e}"
                    ))),
                });
            }
            // Some failures (a full disk, an I/O error) end the whole
            // transaction: then the batch fails as one, rather than running
            // the rest outside it.
            Err(e) if tx.is_autocommit() => return Err(e),
            Err(e) => results.push(Err(sql_error(e))),
        }
    }
    tx.commit()?;
    Ok(results)
}

fn insert_one(
    conn: &Connection,
    message: &NewMessage,
    now_ms: i64,
) -> rusqlite::Result<StoredMessage> {
    // The writer holds the write lock, so nobody else takes this seq.
    let last: Option<i64> = conn
        .prepare_cached(
            "SELECT seq FROM messages WHERE conversation = ?1 ORDER BY seq DESC LIMIT 1",
        )?
        .query_row(params![message.conversation.as_str()], |row| row.get(0))
        .optional()?;
    let seq = last.unwrap_or(0) + 1;
    conn.prepare_cached(
        "INSERT INTO messages (sender, client_msg_id, conversation, seq, body, stored_at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![
        message.key.sender.as_str(),
        message.key.client_msg_id.as_bytes(),
        message.conversation.as_str(),
        seq,
        message.body.as_str(),
        now_ms,
    ])?;
    Ok(StoredMessage {
        key: message.key.clone(),
        conversation: message.conversation.clone(),
        body: message.body.as_str().to_owned(),
        receipt: Receipt {
            server_id: u64::try_from(conn.last_insert_rowid()).unwrap_or_default(),
            seq: u64::try_from(seq).unwrap_or_default(),
        },
        stored_at_ms: now_ms,
    })
}

fn is_unique_violation(e: &rusqlite::Error) -> bool {
    matches!(
        e,
        rusqlite::Error::SqliteFailure(err, _)
            if err.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
    )
}

fn select_by_key(conn: &Connection, key: &MessageKey) -> rusqlite::Result<Option<StoredMessage>> {
    conn.prepare_cached(&format!(
        "SELECT {COLUMNS} FROM messages WHERE sender = ?1 AND client_msg_id = ?2
         ORDER BY server_id LIMIT 1"
    ))?
    .query_row(
        params![key.sender.as_str(), key.client_msg_id.as_bytes()],
        row_to_message,
    )
    .optional()
}

fn row_to_message(row: &Row<'_>) -> rusqlite::Result<StoredMessage> {
    let bad = |i: usize, e: Error| {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, Box::new(e))
    };
    let server_id: i64 = row.get(4)?;
    let seq: i64 = row.get(5)?;
    Ok(StoredMessage {
        key: MessageKey {
            sender: Sender::parse(row.get::<_, String>(0)?).map_err(|e| bad(0, e))?,
            client_msg_id: ClientMsgId::parse(row.get::<_, Vec<u8>>(1)?).map_err(|e| bad(1, e))?,
        },
        conversation: ConversationId::parse(row.get::<_, String>(2)?).map_err(|e| bad(2, e))?,
        body: row.get(3)?,
        receipt: Receipt {
            server_id: u64::try_from(server_id).unwrap_or_default(),
            seq: u64::try_from(seq).unwrap_or_default(),
        },
        stored_at_ms: row.get(6)?,
    })
}

fn unix_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

impl SqliteStore {
    /// Count one operation that started at `started`.
    fn record<T>(&self, operation: &'static str, started: Instant, result: &Result<T, Error>) {
        self.metrics
            .operation(DB_SQLITE, operation, started.elapsed(), result.is_ok());
    }

    async fn insert_once_uncounted(&self, message: NewMessage) -> Result<Insert, Error> {
        let (reply, answer) = oneshot::channel();
        self.writer
            .send(WriteJob { message, reply })
            .await
            .map_err(|_| Error::unavailable("storage writer has stopped"))?;
        answer
            .await
            .map_err(|_| Error::unavailable("storage writer has stopped"))?
    }
}

#[async_trait]
impl MessageStore for SqliteStore {
    /// Until the batch holding this insert is committed.
    #[tracing::instrument(
        name = "sqlite.insert",
        skip_all,
        fields(
            otel.name = "INSERT messages",
            otel.kind = "client",
            db.system = "sqlite",
            db.operation = "INSERT",
        )
    )]
    async fn insert_once(&self, message: NewMessage) -> Result<Insert, Error> {
        let started = Instant::now();
        let result = self.insert_once_uncounted(message).await;
        self.record("insert", started, &result);
        if let Ok(insert) = &result {
            self.metrics
                .inserted(DB_SQLITE, matches!(insert, Insert::Stored(_)));
        }
        result
    }

    async fn lookup(&self, key: &MessageKey) -> Result<Option<StoredMessage>, Error> {
        let started = Instant::now();
        let key = key.clone();
        let result = self.read(move |conn| select_by_key(conn, &key)).await;
        self.record("lookup", started, &result);
        result
    }

    async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredMessage>, Error> {
        let started = Instant::now();
        let query = query.clone();
        let result = self
            .read(move |conn| {
                let mut stmt = conn.prepare_cached(&format!(
                    "SELECT {COLUMNS} FROM messages WHERE conversation = ?1 AND seq > ?2
                 ORDER BY seq LIMIT ?3"
                ))?;
                let after = i64::try_from(query.after_seq).unwrap_or(i64::MAX);
                stmt.query_map(
                    params![query.conversation.as_str(), after, query.limit],
                    row_to_message,
                )?
                .collect()
            })
            .await;
        self.record("history", started, &result);
        result
    }
}

#[cfg(test)]
mod tests {
    use imdedup_runtime::metrics::{Registry, render};
    use imdedup_testkit::prom::sum_samples;

    use super::*;

    fn message(id: &str) -> NewMessage {
        NewMessage {
            key: MessageKey {
                sender: Sender::parse("ana").unwrap(),
                client_msg_id: ClientMsgId::parse(id.as_bytes().to_vec()).unwrap(),
            },
            conversation: ConversationId::parse("ana-ben").unwrap(),
            body: imdedup_domain::model::Body::parse("hi", 100).unwrap(),
        }
    }

    /// A store in a temporary directory whose writer waits `delay` to
    /// gather a batch (kept with the directory it lives in).
    fn store_gathering_for(delay: Duration) -> (tempfile::TempDir, Arc<SqliteStore>) {
        let dir = tempfile::tempdir().unwrap();
        let mut options = SqliteOptions::new(dir.path().join("messages.db"));
        options.commit_delay = delay;
        let store = Arc::new(SqliteStore::open(&options).unwrap());
        (dir, store)
    }

    /// Inserts of `ids` sent at once, each from a task of its own (so a
    /// commit delay gathers them), answered in the order of `ids`.
    async fn insert_together(store: &Arc<SqliteStore>, ids: &[&'static str]) -> Vec<Insert> {
        let tasks: Vec<_> = ids
            .iter()
            .map(|&id| {
                let store = Arc::clone(store);
                tokio::spawn(async move { store.insert_once(message(id)).await.unwrap() })
            })
            .collect();
        let mut answers = Vec::with_capacity(tasks.len());
        for task in tasks {
            answers.push(task.await.unwrap());
        }
        answers
    }

    /// The seqs of conversation `ana-ben`'s history, in order.
    async fn seqs(store: &SqliteStore) -> Vec<u64> {
        let query = HistoryQuery::new(ConversationId::parse("ana-ben").unwrap(), 0, 10).unwrap();
        (store.history(&query).await.unwrap().iter())
            .map(|row| row.receipt.seq)
            .collect()
    }

    /// Files written before the dedup-off demonstration left this store
    /// had a `copy` column inside the unique key; a copy was stored under the
    /// same key with `copy` above 0.
    const SCHEMA_WITH_COPIES: &str = "
        CREATE TABLE messages (
            server_id     INTEGER PRIMARY KEY,
            sender        TEXT    NOT NULL,
            client_msg_id BLOB    NOT NULL,
            conversation  TEXT    NOT NULL,
            seq           INTEGER NOT NULL,
            body          TEXT    NOT NULL,
            stored_at_ms  INTEGER NOT NULL,
            copy          INTEGER NOT NULL DEFAULT 0,
            UNIQUE (sender, client_msg_id, copy),
            UNIQUE (conversation, seq)
        );
        CREATE TABLE conversations (
            conversation TEXT    PRIMARY KEY,
            last_seq     INTEGER NOT NULL
        ) WITHOUT ROWID;
        INSERT INTO messages VALUES (1, 'ana', X'6D31', 'ana-ben', 1, 'hi', 1000, 0);
        INSERT INTO messages VALUES (2, 'ana', X'6D31', 'ana-ben', 2, 'hi', 1001, 1);
        INSERT INTO messages VALUES (3, 'ana', X'6D32', 'ana-ben', 3, 'hi', 1002, 0);
        INSERT INTO conversations VALUES ('ana-ben', 3);
    ";

    #[tokio::test]
    async fn a_file_from_before_keeps_every_row_and_its_unique_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("messages.db");
        Connection::open(&path)
            .unwrap()
            .execute_batch(SCHEMA_WITH_COPIES)
            .unwrap();
        let store = SqliteStore::open(&SqliteOptions::new(&path)).unwrap();

        assert_eq!(seqs(&store).await, [1, 2, 3], "every row, the copy too");
        // A key stored before, copies and all, answers with its first row.
        let first = Receipt {
            server_id: 1,
            seq: 1,
        };
        assert_eq!(
            store
                .lookup(&message("m1").key)
                .await
                .unwrap()
                .unwrap()
                .receipt,
            first
        );
        match store.insert_once(message("m1")).await.unwrap() {
            Insert::AlreadyStored(row) => assert_eq!(row.receipt, first),
            other => panic!("stored again: {other:?}"),
        }
        match store.insert_once(message("m3")).await.unwrap() {
            Insert::Stored(row) => assert_eq!(row.receipt.seq, 4),
            other => panic!("{other:?}"),
        }
        assert_eq!(seqs(&store).await.len(), 4);
    }

    #[tokio::test]
    async fn inserts_and_reads_are_counted() {
        let dir = tempfile::tempdir().unwrap();
        let mut registry = Registry::default();
        let mut options = SqliteOptions::new(dir.path().join("messages.db"));
        options.metrics = StoreMetrics::register(&mut registry);
        let store = SqliteStore::open(&options).unwrap();

        store.insert_once(message("m1")).await.unwrap();
        store.insert_once(message("m1")).await.unwrap();
        store.insert_once(message("m2")).await.unwrap();
        let query = HistoryQuery::new(ConversationId::parse("ana-ben").unwrap(), 0, 10).unwrap();
        assert_eq!(store.history(&query).await.unwrap().len(), 2);

        let text = render(&registry);
        let value = |name: &str, labels: &[(&str, &str)]| {
            let mut all = vec![("db_system", "sqlite")];
            all.extend_from_slice(labels);
            sum_samples(&text, name, &all)
        };
        let inserts = "imdedup_store_inserts_total";
        assert_eq!(
            value(inserts, &[("result", "applied")]),
            Some(2.0),
            "{text}"
        );
        assert_eq!(value(inserts, &[("result", "not_applied")]), Some(1.0));
        let durations = "imdedup_store_operation_duration_seconds_count";
        assert_eq!(value(durations, &[("operation", "insert")]), Some(3.0));
        assert_eq!(value(durations, &[("operation", "history")]), Some(1.0));
        assert_eq!(
            value("imdedup_store_errors_total", &[]),
            Some(0.0),
            "{text}"
        );
    }

    /// The writer's queue gauge reads the inserts at hand as a commit
    /// began: one alone, then four gathered by the commit delay.
    #[tokio::test]
    async fn the_writer_queue_counts_the_inserts_a_commit_began_with() {
        let dir = tempfile::tempdir().unwrap();
        let mut registry = Registry::default();
        let mut options = SqliteOptions::new(dir.path().join("messages.db"));
        options.commit_delay = Duration::from_millis(200);
        options.metrics = StoreMetrics::register(&mut registry);
        let store = Arc::new(SqliteStore::open(&options).unwrap());
        let queue = |registry: &Registry| {
            sum_samples(
                &render(registry),
                "imdedup_store_writer_queue",
                &[("db_system", "sqlite")],
            )
        };

        store.insert_once(message("m0")).await.unwrap();
        assert_eq!(queue(&registry), Some(1.0));
        for insert in insert_together(&store, &["m1", "m2", "m3", "m4"]).await {
            assert!(matches!(insert, Insert::Stored(_)));
        }
        assert_eq!(queue(&registry), Some(4.0));
    }

    /// A repeat in the middle of a batch fails alone: the inserts around it
    /// in the same transaction are stored, and it spends no seq.
    #[tokio::test]
    async fn a_repeat_inside_a_batch_spends_no_seq_and_fails_alone() {
        let (_dir, store) = store_gathering_for(Duration::from_millis(200));
        store.insert_once(message("m0")).await.unwrap();

        let mut stored = Vec::new();
        let mut repeats = Vec::new();
        for insert in insert_together(&store, &["m1", "m0", "m1", "m2"]).await {
            match insert {
                Insert::Stored(row) => stored.push(row.receipt.seq),
                Insert::AlreadyStored(row) => repeats.push(row.receipt.seq),
            }
        }
        stored.sort_unstable();
        repeats.sort_unstable();
        assert_eq!(stored, [2, 3], "m1 and m2, after m0's 1");
        assert_eq!(repeats.len(), 2, "m0 and m1's second copy");
        assert_eq!(seqs(&store).await, [1, 2, 3]);
    }

    #[tokio::test]
    async fn a_commit_delay_gathers_a_message_and_its_resend_into_one_commit() {
        let (_dir, store) = store_gathering_for(Duration::from_millis(200));

        let started = Instant::now();
        let first = tokio::spawn({
            let store = Arc::clone(&store);
            async move { store.insert_once(message("m1")).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let resend = store.insert_once(message("m1")).await.unwrap();
        let first = first.await.unwrap().unwrap();
        // Neither is answered before the commit that waited for the other.
        assert!(started.elapsed() >= Duration::from_millis(200));
        let (Insert::Stored(stored), Insert::AlreadyStored(again)) = (&first, &resend) else {
            panic!("expected stored, then already stored: {first:?}, {resend:?}");
        };
        assert_eq!(stored.receipt, again.receipt);
        let query = HistoryQuery::new(ConversationId::parse("ana-ben").unwrap(), 0, 10).unwrap();
        assert_eq!(store.history(&query).await.unwrap().len(), 1);
    }
}
