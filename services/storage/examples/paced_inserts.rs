//! The embedded store alone, at a paced rate: the process's CPU per insert
//! and the inserts' latency, to judge a change to the store by alternating
//! runs without the noise of the rest of the cluster
//! (docs/performance.md).
//!
//! ```sh
//! cargo run --release -p imdedup-storage --example paced_inserts -- [RATE [SECONDS]]
//! ```
//!
//! 3,000 inserts a second for 10 s by default, into a new database in a
//! temporary directory, with the deployed 3 ms commit delay: 200 senders
//! writing 100-byte messages into direct conversations between them, each
//! insert a task of its own, as the storage service runs them.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use imdedup_domain::{
    model::{Body, ClientMsgId, ConversationId, MessageKey, NewMessage, Sender},
    store::{Insert, MessageStore},
};
use imdedup_runtime::process::ProcessStats;
use imdedup_storage::{SqliteOptions, SqliteStore};
use rand::Rng;
use tokio::task::JoinSet;

const USERS: u32 = 200;

/// Past this the pace's period rounds to nothing.
const MAX_RATE: u32 = 1_000_000;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let rate = argument(args.next(), "RATE", 3_000)?;
    let seconds = argument(args.next(), "SECONDS", 10)?;
    let count = rate
        .checked_mul(seconds)
        .filter(|_| rate <= MAX_RATE)
        .ok_or(format!(
            "at most {MAX_RATE} inserts a second and {} in all",
            u32::MAX
        ))?;

    let dir = tempfile::tempdir()?;
    let mut options = SqliteOptions::new(dir.path().join("messages.db"));
    options.commit_delay = Duration::from_millis(3);
    let store = Arc::new(SqliteStore::open(&options)?);
    let body = Body::parse("x".repeat(100), 4_096)?;

    let mut pace = tokio::time::interval(Duration::from_secs(1) / rate);
    let mut inserts = JoinSet::new();
    let mut latencies = Vec::new();
    let (cpu_before, started) = (process_cpu()?, Instant::now());
    for i in 0..count {
        pace.tick().await;
        let message = message(i, body.clone())?;
        let store = Arc::clone(&store);
        inserts.spawn(async move {
            let sent = Instant::now();
            let insert = store.insert_once(message).await;
            (insert, sent.elapsed())
        });
        while let Some(done) = inserts.try_join_next() {
            latencies.push(stored(done?)?);
        }
    }
    while let Some(done) = inserts.join_next().await {
        latencies.push(stored(done?)?);
    }
    let cpu = process_cpu()? - cpu_before;
    let wall = started.elapsed();

    latencies.sort_unstable();
    let quantile = |q: f64| {
        // A quantile's index into the sorted latencies, in milliseconds.
        let at = ((latencies.len() as f64 * q) as usize).min(latencies.len() - 1);
        latencies[at].as_secs_f64() * 1_000.0
    };
    println!(
        "paced-inserts: {rate}/s for {:.1} s: {} stored, {:.1} µs CPU per insert, \
         latency p50 {:.1} ms, p99 {:.1} ms, p99.9 {:.1} ms, max {:.1} ms",
        wall.as_secs_f64(),
        latencies.len(),
        cpu.as_secs_f64() * 1e6 / latencies.len() as f64,
        quantile(0.5),
        quantile(0.99),
        quantile(0.999),
        quantile(1.0),
    );
    Ok(())
}

/// A whole number above 0, or `default` when not given.
fn argument(given: Option<String>, name: &str, default: u32) -> Result<u32, String> {
    match given.map(|a| a.parse::<u32>()) {
        None => Ok(default),
        Some(Ok(n)) if n > 0 => Ok(n),
        _ => Err(format!("{name} must be a whole number above 0")),
    }
}

/// Message `i`: from a random sender to a random other user.
fn message(i: u32, body: Body) -> Result<NewMessage, imdedup_domain::Error> {
    let mut rng = rand::rng();
    let from = rng.random_range(0..USERS);
    let to = (from + rng.random_range(1..USERS)) % USERS;
    Ok(NewMessage {
        key: MessageKey {
            sender: Sender::parse(format!("u{from}"))?,
            client_msg_id: ClientMsgId::parse(format!("m-{i}").into_bytes())?,
        },
        conversation: ConversationId::parse(format!("u{}-u{}", from.min(to), from.max(to)))?,
        body,
    })
}

/// An insert's latency, if it stored its message.
fn stored(
    (insert, latency): (Result<Insert, imdedup_domain::Error>, Duration),
) -> Result<Duration, String> {
    match insert {
        Ok(Insert::Stored(_)) => Ok(latency),
        Ok(Insert::AlreadyStored(_)) => Err("a new message was taken for a repeat".into()),
        Err(e) => Err(format!("insert failed: {e}")),
    }
}

/// CPU time of this process so far (user and system, every thread), as
/// its `process_cpu_seconds_total` metric reads it.
fn process_cpu() -> Result<Duration, &'static str> {
    let stats = ProcessStats::read().ok_or("no /proc/self/stat to read the CPU time from")?;
    Ok(Duration::from_secs_f64(stats.cpu_seconds))
}
