//! Backend benchmark: prints, in one run against the real Redis and CQL
//! database of `tests/services/services.sh`,
//! 1. the raw rate of `INSERT … IF NOT EXISTS` against the database alone
//!    (the ceiling), and of the plain history-row write beside it, and what
//!    the pipeline's mix of requests allows from those two alone; and, as
//!    a probe of the one-round design the record weighs (docs/decisions.md,
//!    "Three database writes per message"), the rate of a conditional batch
//!    that writes a key row and a history row in one partition and moves
//!    the partition's static last seq on under a condition;
//! 2. the ingest pipeline's rate of new messages (Redis claim, LWT insert,
//!    history row, Redis remember) against the same database, and its ratio
//!    to the ceiling;
//! 3. the share of in-window repeats answered without a database operation,
//!    counted by a store wrapper;
//! 4. Redis memory per remembered ID (used_memory delta / keys).
//!
//! Run: `eval "$(tests/services/services.sh up)"; cargo bench -p imdedup-ingest --bench backends`
//! Steps 1 and 2 run as BENCH_ROUNDS (5) rounds that alternate which goes
//! first, and report medians: wall-clock rates on a shared box drift, the
//! ratio measured side by side much less.
//! Sizes: BENCH_MESSAGES (default 20000), BENCH_CONCURRENCY (64),
//! BENCH_MEMORY_KEYS (200000), BENCH_WARMUP (5000 through each, unmeasured).
//! With BENCH_DB_PID (the database's process,
//! `$(cat /tmp/imdedup-services/cassandra/pid)` with services.sh) it also
//! prints the database's CPU per raw LWT, plain write, conditional batch
//! and pipeline message (line 1d).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use ::scylla::{
    client::session::Session,
    serialize::row::SerializeRow,
    statement::{
        batch::{Batch, BatchType},
        prepared::PreparedStatement,
    },
};
use async_trait::async_trait;
use futures_util::{StreamExt, stream};
use imdedup_domain::{
    Error,
    model::{
        Body, ClientMsgId, ConversationId, Fingerprint, HistoryQuery, MessageKey, NewMessage,
        Outcome, Receipt, Remembered, Sender, StoredMessage,
    },
    store::{Insert, MessageStore},
    window::{Claim, RecentWindow},
};
use imdedup_ingest::{Dedup, RedisWindow, RedisWindowOptions};
use imdedup_storage::metrics::DB_CASSANDRA;
use imdedup_storage::{ScyllaOptions, ScyllaStore, scylla, scylla::RequestKind};

/// Run `op` for `0..count`, `concurrency` at a time: operations per second.
async fn per_second<F, Fut>(count: usize, concurrency: usize, op: F) -> f64
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = ()>,
{
    let started = Instant::now();
    stream::iter(0..count)
        .for_each_concurrent(concurrency, op)
        .await;
    count as f64 / started.elapsed().as_secs_f64()
}

/// Executions per second of one prepared statement, `count` times at
/// `concurrency`, the i-th bound to `row` of the i-th message.
async fn statement_per_second<V: SerializeRow>(
    session: &Session,
    statement: &PreparedStatement,
    prefix: String,
    count: usize,
    concurrency: usize,
    row: fn(&NewMessage, i64) -> V,
) -> f64 {
    per_second(count, concurrency, |i| {
        let values = row(&message(&prefix, i, 1000), i as i64);
        async move {
            session.execute_unpaged(statement, values).await.unwrap();
        }
    })
    .await
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median; sorts `values` in place.
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len().is_multiple_of(2) {
        (values[mid - 1] + values[mid]) / 2.0
    } else {
        values[mid]
    }
}

/// CPU seconds a process has used so far (user + system), from
/// `/proc/PID/stat`; `None` where it cannot be read (not Linux, gone).
fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold
    // spaces: state is field 3, utime and stime fields 14 and 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // USER_HZ is 100 on every Linux this runs on.
    Some(ticks / 100.0)
}

/// The database's and this process's CPU seconds so far: the database's
/// process from `BENCH_DB_PID` (services.sh writes it to
/// `/tmp/imdedup-services/cassandra/pid`), this one from `/proc/self`.
fn cpu_now() -> (Option<f64>, Option<f64>) {
    let db = std::env::var("BENCH_DB_PID")
        .ok()
        .and_then(|pid| cpu_seconds(&pid));
    (db, cpu_seconds("self"))
}

/// The store's database requests so far, by kind (as `RequestKind::ALL`).
fn requests(options: &ScyllaOptions) -> [u64; 4] {
    RequestKind::ALL.map(|kind| options.metrics.requests(DB_CASSANDRA, kind.as_str()))
}

/// Requests of each kind between two counts, per message.
fn per_message(before: [u64; 4], after: [u64; 4], messages: usize) -> [f64; 4] {
    std::array::from_fn(|k| (after[k] - before[k]) as f64 / messages as f64)
}

fn required(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        eprintln!("{name} is not set: run `eval \"$(tests/services/services.sh up)\"` first");
        std::process::exit(2);
    })
}

/// Counts the database operations that reach the store.
struct CountingStore {
    inner: Arc<dyn MessageStore>,
    inserts: AtomicU64,
}

#[async_trait]
impl MessageStore for CountingStore {
    async fn insert_once(&self, message: NewMessage) -> Result<Insert, Error> {
        self.inserts.fetch_add(1, Ordering::Relaxed);
        self.inner.insert_once(message).await
    }
    async fn lookup(&self, key: &MessageKey) -> Result<Option<StoredMessage>, Error> {
        self.inner.lookup(key).await
    }
    async fn history(&self, query: &HistoryQuery) -> Result<Vec<StoredMessage>, Error> {
        self.inner.history(query).await
    }
}

fn message(run: &str, i: usize, conversations: usize) -> NewMessage {
    NewMessage {
        key: MessageKey {
            sender: Sender::parse(format!("user{:06}", i % 5000)).unwrap(),
            client_msg_id: ClientMsgId::parse(format!("{run}{i:020}").into_bytes()).unwrap(),
        },
        conversation: ConversationId::parse(format!("conv{:05}", i % conversations)).unwrap(),
        body: Body::parse(
            "a message body of a typical length, about sixty bytes..",
            16384,
        )
        .unwrap(),
    }
}

#[tokio::main]
async fn main() {
    let scylla_node = required("IMDEDUP_TEST_SCYLLA");
    let redis_url = required("IMDEDUP_TEST_REDIS_URL");
    let messages = env_or("BENCH_MESSAGES", 20_000);
    let concurrency = env_or("BENCH_CONCURRENCY", 64);
    let memory_keys = env_or("BENCH_MEMORY_KEYS", 200_000);
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();

    let mut options = ScyllaOptions::single_node(vec![scylla_node]);
    options.keyspace = format!("bench{run}");
    let session = Arc::new(scylla::connect(&options).await.unwrap());
    scylla::migrate(&session, &options).await.unwrap();
    println!(
        "backend benchmark: {messages} messages, {concurrency} in flight, Cassandra/ScyllaDB keyspace {}",
        options.keyspace
    );

    // 1. The ceiling: LWT inserts alone, same table, same concurrency.
    let mut insert = session
        .prepare(format!(
            "INSERT INTO {}.messages_by_key (sender, client_msg_id, conversation, body, server_id, seq, stored_at_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS",
            options.keyspace
        ))
        .await
        .unwrap();
    insert.set_consistency(options.consistency);
    insert.set_serial_consistency(Some(options.serial_consistency));
    // Warm the database's JIT and caches first, unmeasured.
    let warmup = env_or("BENCH_WARMUP", 5000);
    let raw = |prefix: String, count: usize| {
        statement_per_second(&session, &insert, prefix, count, concurrency, |m, i| {
            (
                m.key.sender.as_str().to_owned(),
                m.key.client_msg_id.as_bytes().to_vec(),
                m.conversation.as_str().to_owned(),
                m.body.as_str().to_owned(),
                i,
                i,
                0_i64,
            )
        })
    };

    // 2. The ingest pipeline, new messages only.
    let store = Arc::new(CountingStore {
        inner: Arc::new(
            ScyllaStore::with_session(Arc::clone(&session), options.clone())
                .await
                .unwrap(),
        ),
        inserts: AtomicU64::new(0),
    });
    let mut redis_options = RedisWindowOptions::new(vec![redis_url.clone()]);
    redis_options.key_prefix = format!("b{run}:");
    let window = Arc::new(RedisWindow::connect(redis_options).await.unwrap());
    let dedup = Arc::new(Dedup::new(
        window.clone(),
        store.clone(),
        Duration::from_secs(5),
    ));
    let pipeline = |prefix: String, count: usize| {
        let dedup = Arc::clone(&dedup);
        per_second(count, concurrency, move |i| {
            let dedup = Arc::clone(&dedup);
            let m = message(&prefix, i, 1000);
            async move {
                let ack = dedup.send(m).await.unwrap();
                assert_eq!(ack.outcome, Outcome::Stored);
            }
        })
    };

    // Both warm, unmeasured; then rounds that alternate which goes first, so
    // a drift of the shared box's speed lands on both alike.
    let _ = raw(format!("warm{run}"), warmup).await;
    let _ = pipeline(format!("pwarm{run}"), warmup).await;
    // 1b. A plain write of a history row, as the pipeline's pending write
    // and commit are, same concurrency.
    let mut write = session
        .prepare(format!(
            "INSERT INTO {}.messages_by_conversation \
             (conversation, seq, sender, client_msg_id, server_id, body, stored_at_ms, pending, abandoned) \
             VALUES (?, ?, ?, ?, ?, ?, ?, true, false)",
            options.keyspace
        ))
        .await
        .unwrap();
    write.set_consistency(options.consistency);
    let raw_write = |prefix: String, count: usize| {
        statement_per_second(&session, &write, prefix, count, concurrency, |m, i| {
            (
                m.conversation.as_str().to_owned(),
                i,
                m.key.sender.as_str().to_owned(),
                m.key.client_msg_id.as_bytes().to_vec(),
                i,
                m.body.as_str().to_owned(),
                0_i64,
            )
        })
    };
    let _ = raw_write(format!("wwarm{run}"), warmup).await;

    // 1c. The one-round design the record weighs, probed: the key row and
    // the history row in one table partitioned by conversation, and the
    // partition's static `last` moved on under a condition (which keeps
    // batches in seq order), written by one conditional batch (one Paxos
    // round). The rows are the same sizes as the pipeline's; one
    // conversation is never in two batches at once here (64 in flight over
    // 1,000 conversations of the step's own, in order), as the owner's lock
    // guarantees in the design, so message i's condition is i - 1000 (none
    // before the first).
    session
        .query_unpaged(
            format!(
                "CREATE TABLE IF NOT EXISTS {}.probe_log (conversation text, kind tinyint, \
                 pos bigint, sender text, client_msg_id blob, body text, server_id bigint, \
                 stored_at_ms bigint, last bigint static, \
                 PRIMARY KEY ((conversation), kind, pos, sender, client_msg_id))",
                options.keyspace
            ),
            (),
        )
        .await
        .unwrap();
    let probe_row = format!(
        "INSERT INTO {}.probe_log (conversation, kind, pos, sender, client_msg_id, body, server_id, stored_at_ms) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        options.keyspace
    );
    let key_row = session
        .prepare(format!("{probe_row} IF NOT EXISTS"))
        .await
        .unwrap();
    let history_row = session.prepare(probe_row).await.unwrap();
    let moved_on = session
        .prepare(format!(
            "UPDATE {}.probe_log SET last = ? WHERE conversation = ? IF last = ?",
            options.keyspace
        ))
        .await
        .unwrap();
    let mut batch = Batch::new(BatchType::Unlogged);
    batch.append_statement(key_row);
    batch.append_statement(history_row);
    batch.append_statement(moved_on);
    batch.set_consistency(options.consistency);
    batch.set_serial_consistency(Some(options.serial_consistency));
    let raw_batch = |prefix: String, count: usize| {
        let (session, batch) = (&session, &batch);
        per_second(count, concurrency, move |i| {
            let m = message(&prefix, i, 1000);
            let conversation = format!("{prefix}{}", m.conversation.as_str());
            async move {
                let (conversation, sender) = (conversation.as_str(), m.key.sender.as_str());
                let (id, body, n) = (m.key.client_msg_id.as_bytes(), m.body.as_str(), i as i64);
                let before = i.checked_sub(1000).map(|b| b as i64);
                let rows = (
                    (conversation, 0_i8, 0_i64, sender, id, "", n, 0_i64),
                    (conversation, 1_i8, n, sender, id, body, n, 0_i64),
                    (n, conversation, before),
                );
                let result = session.batch(batch, rows).await.unwrap();
                let applied = result.into_rows_result().unwrap().first_row::<(bool,)>();
                assert!(matches!(applied, Ok((true,))), "a new key is applied");
            }
        })
    };
    let _ = raw_batch(format!("bwarm{run}"), warmup).await;
    let rounds = env_or("BENCH_ROUNDS", 5).max(1);

    let (mut ceilings, mut pipelines, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut writes, mut mix_ratios, mut batch_ratios) = (Vec::new(), Vec::new(), Vec::new());
    // What the pipeline's new messages cost the database, every request the
    // store sent counted (seq and server-id leases and the membership's
    // heartbeats included, spread over the messages).
    let mut new_requests = [0u64; 4];
    let (mut raw_cpu, mut pipeline_cpu) = (Vec::new(), Vec::new());
    let (mut write_cpu, mut batch_cpu) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let (raw_prefix, pipeline_prefix) = (format!("raw{round}{run}"), format!("p{round}{run}"));
        let counted = |rate: f64, before: [u64; 4], new_requests: &mut [u64; 4]| {
            let after = requests(&options);
            for k in 0..4 {
                new_requests[k] += after[k] - before[k];
            }
            rate
        };
        // CPU per message of the database and of this process (the whole
        // ingest pipeline and its driver), over each step.
        let timed = |before: (Option<f64>, Option<f64>), cpu: &mut Vec<[f64; 2]>| {
            let after = cpu_now();
            if let ((Some(d0), Some(s0)), (Some(d1), Some(s1))) = (before, after) {
                let per = |a: f64, b: f64| (b - a) * 1e6 / messages as f64;
                cpu.push([per(d0, d1), per(s0, s1)]);
            }
        };
        let (ceiling, rate) = if round % 2 == 0 {
            let cpu = cpu_now();
            let ceiling = raw(raw_prefix, messages).await;
            timed(cpu, &mut raw_cpu);
            let before = requests(&options);
            let cpu = cpu_now();
            let rate = pipeline(pipeline_prefix, messages).await;
            timed(cpu, &mut pipeline_cpu);
            (ceiling, counted(rate, before, &mut new_requests))
        } else {
            let before = requests(&options);
            let cpu = cpu_now();
            let rate = pipeline(pipeline_prefix, messages).await;
            timed(cpu, &mut pipeline_cpu);
            let rate = counted(rate, before, &mut new_requests);
            let cpu = cpu_now();
            let ceiling = raw(raw_prefix, messages).await;
            timed(cpu, &mut raw_cpu);
            (ceiling, rate)
        };
        let cpu = cpu_now();
        let write_rate = raw_write(format!("w{round}{run}"), messages).await;
        timed(cpu, &mut write_cpu);
        let cpu = cpu_now();
        let batch_rate = raw_batch(format!("b{round}{run}"), messages).await;
        timed(cpu, &mut batch_cpu);
        batch_ratios.push(batch_rate / ceiling);
        // The database's time per message if it did nothing but the
        // pipeline's requests, each at its raw rate: one LWT, two writes.
        let mix = 1.0 / (1.0 / ceiling + 2.0 / write_rate);
        println!(
            "   round {}: raw {ceiling:>6.0} inserts/s, pipeline {rate:>6.0} msgs/s, ratio {:.2}; plain writes {write_rate:>6.0}/s, the mix allows {:.2}; conditional batches {batch_rate:>6.0}/s ({:.2})",
            round + 1,
            rate / ceiling,
            mix / ceiling,
            batch_rate / ceiling,
        );
        writes.push(write_rate);
        mix_ratios.push(mix / ceiling);
        ceilings.push(ceiling);
        pipelines.push(rate);
        ratios.push(rate / ceiling);
    }
    println!(
        "1. raw INSERT … IF NOT EXISTS:            {:>9.0} inserts/s (the ceiling; median of {rounds} rounds)",
        median(&mut ceilings)
    );
    let ratio = median(&mut ratios);
    println!(
        "2. ingest pipeline, new messages:          {:>9.0} msgs/s; ratio to the ceiling, median of {rounds} rounds: {ratio:.2} (range {:.2}-{:.2}; goal >= 0.80)",
        median(&mut pipelines),
        ratios[0],
        ratios[ratios.len() - 1],
    );

    let (write_rate, mix_ratio) = (median(&mut writes), median(&mut mix_ratios));
    let lwt_in_writes = write_rate / median(&mut ceilings);
    println!(
        "1b. raw plain history-row write:           {write_rate:>9.0} writes/s; an LWT costs the database {lwt_in_writes:.1} plain writes, so 1 LWT + 2 writes per message allow {mix_ratio:.2} of the ceiling at best (median of {rounds} rounds), 1 LWT + 1 write {:.2}",
        lwt_in_writes / (lwt_in_writes + 1.0),
    );
    println!(
        "1c. conditional batch, key + history row + last seq in one partition (the one-round design, not used: decisions.md): {:.2} of the ceiling (median of {rounds} rounds)",
        median(&mut batch_ratios)
    );
    if [&raw_cpu, &pipeline_cpu, &write_cpu, &batch_cpu]
        .iter()
        .all(|cpu| !cpu.is_empty())
    {
        let column =
            |cpu: &[[f64; 2]], k: usize| median(&mut cpu.iter().map(|c| c[k]).collect::<Vec<_>>());
        let raw_db = column(&raw_cpu, 0);
        let db = |cpu: &[[f64; 2]]| {
            let us = column(cpu, 0);
            format!("{us:.0} µs ({:.2}x)", us / raw_db)
        };
        println!(
            "1d. database CPU per request or message: raw LWT {raw_db:.0} µs; plain write {}; conditional batch alone {}; pipeline message {}; this process (the ingest pipeline and its driver) {:.0} µs per pipeline message (medians of {rounds} rounds)",
            db(&write_cpu),
            db(&batch_cpu),
            db(&pipeline_cpu),
            column(&pipeline_cpu, 1),
        );
    }
    let per_new = per_message([0; 4], new_requests, messages * rounds);
    println!(
        "   per new message: LWT {:.3}, writes {:.3}, reads {:.3}, serial reads {:.3} (every request the store sent, leases and heartbeats included; goal <= 1 LWT + 1 write)",
        per_new[0], per_new[1], per_new[2], per_new[3]
    );

    // 3. Every message again, inside the window.
    let requests_before = requests(&options);
    let inserts_before = store.inserts.load(Ordering::Relaxed);
    let caught = AtomicU64::new(0);
    let last = format!("p{}{run}", rounds - 1);
    stream::iter(0..messages)
        .for_each_concurrent(concurrency, |i| {
            let (dedup, caught) = (Arc::clone(&dedup), &caught);
            let m = message(&last, i, 1000);
            async move {
                let ack = dedup.send(m).await.unwrap();
                if ack.outcome == Outcome::DuplicateWindow {
                    caught.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
        .await;
    let db_ops = store.inserts.load(Ordering::Relaxed) - inserts_before;
    let per_repeat: f64 = per_message(requests_before, requests(&options), messages)
        .iter()
        .sum();
    let without_db = messages as u64 - db_ops;
    println!(
        "3. in-window repeats without a DB operation: {without_db}/{messages} = {:.1}% ({} window hits, {db_ops} store calls; goal 100%)",
        100.0 * without_db as f64 / messages as f64,
        caught.load(Ordering::Relaxed)
    );

    // 4. Redis memory per remembered ID, on realistic keys.
    // A database of its own (15), so FLUSHDB and DBSIZE touch only the benchmark.
    let memory_url = format!("{}/15", redis_url.trim_end_matches('/'));
    let client = redis::Client::open(memory_url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let used = |info: String| -> i64 {
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap()
    };
    let mut memory_options = RedisWindowOptions::new(vec![memory_url.clone()]);
    memory_options.key_prefix = "i:".to_owned();
    let memory_window = Arc::new(RedisWindow::connect(memory_options).await.unwrap());
    let _: () = redis::cmd("FLUSHDB").query_async(&mut conn).await.unwrap();
    let before = used(
        redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut conn)
            .await
            .unwrap(),
    );
    stream::iter(0..memory_keys)
        .for_each_concurrent(concurrency, |i| {
            let window = Arc::clone(&memory_window);
            async move {
                // A 16-byte random ID from one of 100,000 users, as phones send.
                let key = MessageKey {
                    sender: Sender::parse(format!("u{:06}", i % 100_000)).unwrap(),
                    client_msg_id: ClientMsgId::parse(uuid::Uuid::new_v4().into_bytes().to_vec())
                        .unwrap(),
                };
                let Claim::Owned(token) = window.claim(&key).await.unwrap() else {
                    panic!("fresh key")
                };
                window
                    .remember(
                        &key,
                        &token,
                        Remembered {
                            receipt: Receipt {
                                server_id: i as u64 + 1,
                                seq: i as u64 + 1,
                            },
                            fingerprint: Some(Fingerprint(i as u64)),
                        },
                    )
                    .await
                    .unwrap();
            }
        })
        .await;
    let after = used(
        redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut conn)
            .await
            .unwrap(),
    );
    let hashes: i64 = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    let per_id = (after - before) as f64 / memory_keys as f64;
    println!(
        "4. Redis memory per remembered ID:          {per_id:>9.1} bytes ({memory_keys} IDs in {hashes} bucket hashes, used_memory +{} bytes; goal <= 100)",
        after - before
    );
    println!(
        "   at the book's v3 window (4.2 million IDs): {:.0} MB",
        per_id * 4.2e6 / 1e6
    );
    println!(
        "pipeline {ratio:.2} of the ceiling; per new message: LWT {:.2}, writes {:.2}, reads {:.2}; per in-window repeat: {per_repeat:.2} requests",
        per_new[0],
        per_new[1],
        per_new[2] + per_new[3],
    );
    let _: () = redis::cmd("FLUSHDB").query_async(&mut conn).await.unwrap();
    session
        .query_unpaged(format!("DROP KEYSPACE {}", options.keyspace), ())
        .await
        .unwrap();
    let _ = window;
}
