//! The dedup decision: the window answers most repeats; the store's unique
//! key answers the rest and has the last word.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use crate::metrics::IngestMetrics;

use imdedup_domain::{
    Error, ErrorKind,
    model::{Ack, NewMessage, Outcome, Receipt, Remembered},
    routing::Ownership,
    store::{Insert, MessageStore},
    window::{Claim, RecentWindow},
};

use crate::db_limit::{DbLimit, DbLimitOptions};
use crate::in_flight::InFlight;

/// Counts of what the ingest decided, since start.
#[derive(Debug, Default)]
pub struct DedupStats {
    pub stored: AtomicU64,
    pub duplicate_window: AtomicU64,
    pub duplicate_unique_key: AtomicU64,
    pub in_flight_conflicts: AtomicU64,
    /// Sends that waited for the insert of their key already running here
    /// instead of starting another.
    pub joined_in_flight: AtomicU64,
    /// Sends dropped before their insert: their caller's deadline passed.
    pub shed_after_deadline: AtomicU64,
    pub window_bypassed: AtomicU64,
    pub failed: AtomicU64,
}

/// A snapshot of [`DedupStats`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DedupCounts {
    pub stored: u64,
    pub duplicate_window: u64,
    pub duplicate_unique_key: u64,
    pub in_flight_conflicts: u64,
    pub joined_in_flight: u64,
    pub shed_after_deadline: u64,
    pub window_bypassed: u64,
    pub failed: u64,
}

impl DedupStats {
    pub fn snapshot(&self) -> DedupCounts {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DedupCounts {
            stored: get(&self.stored),
            duplicate_window: get(&self.duplicate_window),
            duplicate_unique_key: get(&self.duplicate_unique_key),
            in_flight_conflicts: get(&self.in_flight_conflicts),
            joined_in_flight: get(&self.joined_in_flight),
            shed_after_deadline: get(&self.shed_after_deadline),
            window_bypassed: get(&self.window_bypassed),
            failed: get(&self.failed),
        }
    }
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Decides sends for one ingest shard.
pub struct Dedup {
    window: Arc<dyn RecentWindow>,
    store: Arc<dyn MessageStore>,
    storage_timeout: Duration,
    stats: DedupStats,
    metrics: IngestMetrics,
    /// The conversations this shard may answer for; `None` answers all.
    ownership: Option<Ownership>,
    /// Inserts running, one per key.
    in_flight: Arc<InFlight>,
    /// The store's insert behind the adaptive limit.
    db: DbLimit,
    db_options: DbLimitOptions,
    bypass_log: EverySecond,
    window_log: EverySecond,
}

/// At most once a second: for a log line that would otherwise come with
/// every send during an outage.
#[derive(Default)]
struct EverySecond(std::sync::Mutex<Option<Instant>>);

impl EverySecond {
    fn allow(&self) -> bool {
        let Ok(mut last) = self.0.try_lock() else {
            return false;
        };
        let now = Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < Duration::from_secs(1)) {
            return false;
        }
        *last = Some(now);
        true
    }
}

impl Dedup {
    pub fn new(
        window: Arc<dyn RecentWindow>,
        store: Arc<dyn MessageStore>,
        storage_timeout: Duration,
    ) -> Self {
        let metrics = IngestMetrics::default();
        let db_options = DbLimitOptions::default();
        Self {
            db: DbLimit::new(Arc::clone(&store), db_options, metrics.clone()),
            db_options,
            bypass_log: EverySecond::default(),
            window_log: EverySecond::default(),
            window,
            store,
            storage_timeout,
            stats: DedupStats::default(),
            metrics,
            ownership: None,
            in_flight: Arc::default(),
        }
    }

    /// Bound the adaptive limit on inserts in flight by `options`.
    pub fn with_db_limit(mut self, options: DbLimitOptions) -> Self {
        self.db_options = options;
        self.db = DbLimit::new(Arc::clone(&self.store), options, self.metrics.clone());
        self
    }

    /// Answer only the conversations `ownership` gives this shard; refuse
    /// the others with a retryable error, so a gateway routing by another
    /// shard map never has two shards write one conversation.
    pub fn with_ownership(mut self, ownership: Ownership) -> Self {
        self.ownership = Some(ownership);
        self
    }

    /// Record into `metrics` (by default they are counted but registered
    /// nowhere). Give the window the same `metrics.window`.
    pub fn with_metrics(mut self, metrics: IngestMetrics) -> Self {
        self.db = DbLimit::new(Arc::clone(&self.store), self.db_options, metrics.clone());
        self.metrics = metrics;
        self
    }

    pub fn stats(&self) -> &DedupStats {
        &self.stats
    }

    pub fn metrics(&self) -> &IngestMetrics {
        &self.metrics
    }

    /// Store `message` once, or recognise it as a repeat; either way, return
    /// the ACK with the message's original server id and seq.
    pub async fn send(&self, message: NewMessage) -> Result<Ack, Error> {
        self.send_within(message, None).await
    }

    /// [`Dedup::send`] for a caller that waits until `deadline` at most: a
    /// send still undecided then is dropped before its insert (nothing is
    /// stored, the resend is), so no database work is done for nobody.
    #[tracing::instrument(
        name = "imdedup.dedup",
        skip_all,
        fields(
            imdedup.outcome = tracing::field::Empty,
            error.type = tracing::field::Empty,
        )
    )]
    pub async fn send_within(
        &self,
        message: NewMessage,
        deadline: Option<Instant>,
    ) -> Result<Ack, Error> {
        let _in_flight = self.metrics.decision_started();
        let started = Instant::now();
        let result = self.decide(message, deadline).await;
        let span = tracing::Span::current();
        match &result {
            Ok(ack) => span.record("imdedup.outcome", ack.outcome.as_str()),
            Err(e) => span.record("error.type", e.kind().as_str()),
        };
        self.metrics.decided(
            result.as_ref().map(|ack| ack.outcome).map_err(Error::kind),
            started.elapsed(),
        );
        result
    }

    async fn decide(&self, message: NewMessage, deadline: Option<Instant>) -> Result<Ack, Error> {
        if let Some(ownership) = &self.ownership {
            ownership.check(&message.conversation)?;
        }
        let key = message.key.clone();
        let claim = match self.window.claim(&key).await {
            Ok(claim) => {
                self.metrics.window.claimed(match claim {
                    Claim::Owned(_) => "owned",
                    Claim::Seen(_) => "seen",
                    Claim::InFlight => "in_flight",
                });
                Some(claim)
            }
            Err(e) => {
                // The window is only a fast path: without it the unique key
                // still decides, so keep sending.
                self.metrics.window.claimed("error");
                self.metrics.window.bypassed();
                bump(&self.stats.window_bypassed);
                if self.bypass_log.allow() {
                    tracing::warn!(error = %e, "recent-id window unavailable, bypassing it (logged once a second at most)");
                }
                None
            }
        };
        let token = match claim {
            Some(Claim::Seen(remembered)) => {
                if remembered
                    .fingerprint
                    .is_some_and(|f| f != message.fingerprint())
                {
                    return Err(Error::id_reused(remembered.receipt));
                }
                bump(&self.stats.duplicate_window);
                return Ok(ack(&message, remembered.receipt, Outcome::DuplicateWindow));
            }
            Some(Claim::Owned(token)) => Some(token),
            Some(Claim::InFlight) => {
                bump(&self.stats.in_flight_conflicts);
                None
            }
            None => None,
        };

        let budget = match deadline {
            None => Some(self.storage_timeout),
            Some(deadline) => deadline
                .checked_duration_since(Instant::now())
                .map(|left| left.min(self.storage_timeout)),
        };
        let inserted = match budget {
            Some(budget) => self.insert(message.clone(), budget).await,
            None => {
                bump(&self.stats.shed_after_deadline);
                self.metrics.shed("deadline");
                Err(Error::new(
                    ErrorKind::DeadlineExceeded,
                    "the send's deadline passed before its insert; nothing stored",
                ))
            }
        };
        match (&inserted, &token) {
            (Ok(insert), Some(token)) => {
                let stored = insert.message();
                let remembered = Remembered {
                    receipt: stored.receipt,
                    fingerprint: Some(stored.fingerprint()),
                };
                if let Err(e) = self.window.remember(&key, token, remembered).await
                    && self.window_log.allow()
                {
                    tracing::warn!(error = %e, "cannot remember a stored id in the window (logged once a second at most)");
                }
            }
            (Err(_), Some(token)) => {
                // Not stored: the next resend must be stored, not "seen".
                if let Err(e) = self.window.release(&key, token).await
                    && self.window_log.allow()
                {
                    tracing::warn!(error = %e, "cannot release a failed claim (logged once a second at most)");
                }
            }
            (_, None) => {}
        }
        match inserted {
            Ok(Insert::Stored(row)) => {
                bump(&self.stats.stored);
                Ok(ack(&message, row.receipt, Outcome::Stored))
            }
            Ok(Insert::AlreadyStored(row)) if row.fingerprint() != message.fingerprint() => {
                Err(Error::id_reused(row.receipt))
            }
            Ok(Insert::AlreadyStored(row)) => {
                bump(&self.stats.duplicate_unique_key);
                Ok(ack(&message, row.receipt, Outcome::DuplicateUniqueKey))
            }
            Err(e) => {
                bump(&self.stats.failed);
                Err(e)
            }
        }
    }

    /// The store's insert, or the outcome of the same key's insert already
    /// running here (answered as a repeat: this copy stored nothing).
    async fn insert(&self, message: NewMessage, timeout: Duration) -> Result<Insert, Error> {
        let started = Instant::now();
        let deadline = move || {
            Error::new(
                ErrorKind::DeadlineExceeded,
                format!("storage did not answer within {timeout:?}"),
            )
        };
        let db = self.db.clone();
        let key = message.key.clone();
        let (led, outcome) = self
            .in_flight
            .join(&key, async move { db.insert(message, timeout).await });
        let result = tokio::time::timeout(timeout, outcome)
            .await
            .unwrap_or_else(|_| Err(deadline()));
        if !led {
            bump(&self.stats.joined_in_flight);
            return result.map(|insert| match insert {
                Insert::Stored(row) => Insert::AlreadyStored(row),
                repeat => repeat,
            });
        }
        self.metrics
            .storage_call("insert", started.elapsed(), result.is_ok());
        result
    }
}

fn ack(message: &NewMessage, receipt: Receipt, outcome: Outcome) -> Ack {
    Ack {
        client_msg_id: message.key.client_msg_id.clone(),
        receipt,
        outcome,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use async_trait::async_trait;
    use imdedup_domain::{
        model::{
            Body, ClientMsgId, ConversationId, HistoryQuery, MessageKey, Sender, StoredMessage,
        },
        window::ClaimToken,
    };

    use super::*;
    use crate::window::{MemoryWindow, MemoryWindowOptions};

    /// A store in memory that can be told to fail its next inserts.
    #[derive(Default)]
    struct FlakyStore {
        rows: Mutex<Vec<StoredMessage>>,
        failures_left: Mutex<u32>,
    }

    #[async_trait]
    impl MessageStore for FlakyStore {
        async fn insert_once(&self, m: NewMessage) -> Result<Insert, Error> {
            {
                let mut left = self.failures_left.lock().unwrap();
                if *left > 0 {
                    *left -= 1;
                    return Err(Error::unavailable("injected failure"));
                }
            }
            let mut rows = self.rows.lock().unwrap();
            if let Some(row) = rows.iter().find(|r| r.key == m.key) {
                return Ok(Insert::AlreadyStored(row.clone()));
            }
            let n = rows.len() as u64 + 1;
            let row = StoredMessage {
                key: m.key,
                conversation: m.conversation,
                body: m.body.into_string(),
                receipt: Receipt {
                    server_id: 100 + n,
                    seq: n,
                },
                stored_at_ms: 0,
            };
            rows.push(row.clone());
            Ok(Insert::Stored(row))
        }

        async fn lookup(&self, _: &MessageKey) -> Result<Option<StoredMessage>, Error> {
            unreachable!("dedup never looks up")
        }

        async fn history(&self, _: &HistoryQuery) -> Result<Vec<StoredMessage>, Error> {
            unreachable!("dedup never reads history")
        }
    }

    /// A window whose backend is down.
    struct DownWindow;

    #[async_trait]
    impl RecentWindow for DownWindow {
        async fn claim(&self, _: &MessageKey) -> Result<Claim, Error> {
            Err(Error::unavailable("window down"))
        }
        async fn remember(
            &self,
            _: &MessageKey,
            _: &ClaimToken,
            _: Remembered,
        ) -> Result<(), Error> {
            Err(Error::unavailable("window down"))
        }
        async fn release(&self, _: &MessageKey, _: &ClaimToken) -> Result<(), Error> {
            Err(Error::unavailable("window down"))
        }
    }

    fn message(id: &str) -> NewMessage {
        NewMessage {
            key: MessageKey {
                sender: Sender::parse("ana").unwrap(),
                client_msg_id: ClientMsgId::parse(id.as_bytes().to_vec()).unwrap(),
            },
            conversation: ConversationId::parse("ana-ben").unwrap(),
            body: Body::parse("hi", 100).unwrap(),
        }
    }

    fn dedup(store: Arc<FlakyStore>) -> Dedup {
        let window = Arc::new(MemoryWindow::new(MemoryWindowOptions::default()));
        Dedup::new(window, store, Duration::from_secs(1))
    }

    #[tokio::test]
    async fn a_failed_insert_does_not_make_the_resend_look_seen() {
        let store = Arc::new(FlakyStore::default());
        *store.failures_left.lock().unwrap() = 1;
        let dedup = dedup(Arc::clone(&store));

        let err = dedup.send(message("m1")).await.unwrap_err();
        assert!(err.retryable());
        let ack = dedup.send(message("m1")).await.unwrap();
        assert_eq!(ack.outcome, Outcome::Stored);
        assert_eq!(store.rows.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_shard_refuses_conversations_it_does_not_own_and_stores_nothing() {
        use imdedup_domain::routing::ShardMap;

        let map = ShardMap::parse(&["a=http://a:1", "b=http://b:1"]).unwrap();
        let owner = map.shards()[map.owner(&message("m1").conversation)]
            .name
            .clone();
        let other = map.names().find(|name| *name != owner).unwrap().to_owned();
        let store = Arc::new(FlakyStore::default());
        let refusing =
            dedup(Arc::clone(&store)).with_ownership(Ownership::new(map.clone(), &other).unwrap());
        let err = refusing.send(message("m1")).await.unwrap_err();
        assert!(err.retryable(), "{err}");
        assert!(store.rows.lock().unwrap().is_empty());

        let owning = dedup(Arc::clone(&store)).with_ownership(Ownership::new(map, &owner).unwrap());
        assert_eq!(
            owning.send(message("m1")).await.unwrap().outcome,
            Outcome::Stored
        );
    }

    #[tokio::test]
    async fn a_repeat_gets_the_first_receipt_from_the_window() {
        let store = Arc::new(FlakyStore::default());
        let dedup = dedup(Arc::clone(&store));
        let first = dedup.send(message("m1")).await.unwrap();
        let again = dedup.send(message("m1")).await.unwrap();
        assert_eq!(again.receipt, first.receipt);
        assert_eq!(again.outcome, Outcome::DuplicateWindow);
        assert_eq!(dedup.stats().snapshot().stored, 1);
    }

    #[tokio::test]
    async fn decisions_show_in_the_shard_metrics() {
        use imdedup_runtime::metrics::{Registry, render, shard_registry};
        use imdedup_testkit::prom::sum_samples;

        let mut registry = Registry::default();
        let metrics = IngestMetrics::register(shard_registry(&mut registry, "ingest-7"));
        let store = Arc::new(FlakyStore::default());
        let window =
            MemoryWindow::new(MemoryWindowOptions::default()).with_metrics(metrics.window.clone());
        let dedup = Dedup::new(Arc::new(window), store.clone(), Duration::from_secs(1))
            .with_metrics(metrics);

        dedup.send(message("m1")).await.unwrap();
        dedup.send(message("m1")).await.unwrap();
        *store.failures_left.lock().unwrap() = 1;
        dedup.send(message("m2")).await.unwrap_err();

        let text = render(&registry);
        let shard = ("shard", "ingest-7");
        let value = |name: &str, labels: &[(&str, &str)]| {
            let mut all = vec![shard];
            all.extend_from_slice(labels);
            sum_samples(&text, name, &all)
        };
        let sends = "imdedup_ingest_sends_total";
        assert_eq!(value(sends, &[("outcome", "stored")]), Some(1.0), "{text}");
        assert_eq!(value(sends, &[("outcome", "duplicate_window")]), Some(1.0));
        assert_eq!(value(sends, &[("outcome", "failed")]), Some(1.0));
        assert_eq!(
            value(
                "imdedup_ingest_send_errors_total",
                &[("code", "unavailable")]
            ),
            Some(1.0)
        );
        assert_eq!(
            value("imdedup_ingest_decision_duration_seconds_count", &[]),
            Some(3.0)
        );
        assert_eq!(value("imdedup_ingest_sends_in_flight", &[]), Some(0.0));
        assert_eq!(value("imdedup_ingest_shard_info", &[]), Some(1.0));
        let claims = "imdedup_window_claims_total";
        assert_eq!(value(claims, &[("result", "owned")]), Some(2.0));
        assert_eq!(value(claims, &[("result", "seen")]), Some(1.0));
        assert_eq!(
            value(
                "imdedup_window_operation_duration_seconds_count",
                &[("operation", "claim"), ("backend", "memory")]
            ),
            Some(3.0)
        );
        assert_eq!(
            value(
                "imdedup_window_operation_duration_seconds_count",
                &[("operation", "release"), ("backend", "memory")]
            ),
            Some(1.0),
            "the failed insert released its claim"
        );
        // The window answered the repeat: the store was asked twice, not three times.
        assert_eq!(
            value(
                "imdedup_storage_operation_duration_seconds_count",
                &[("operation", "insert")]
            ),
            Some(2.0)
        );
        assert_eq!(
            value("imdedup_storage_errors_total", &[("operation", "insert")]),
            Some(1.0)
        );
        assert_eq!(value("imdedup_window_bypassed_total", &[]), Some(0.0));
    }

    #[tokio::test]
    async fn a_window_that_is_down_counts_as_bypassed() {
        use imdedup_runtime::metrics::{Registry, render};
        use imdedup_testkit::prom::sum_samples;

        let mut registry = Registry::default();
        let metrics = IngestMetrics::register(&mut registry);
        let store = Arc::new(FlakyStore::default());
        let dedup =
            Dedup::new(Arc::new(DownWindow), store, Duration::from_secs(1)).with_metrics(metrics);
        dedup.send(message("m1")).await.unwrap();
        let text = render(&registry);
        assert_eq!(
            sum_samples(&text, "imdedup_window_bypassed_total", &[]),
            Some(1.0)
        );
        assert_eq!(
            sum_samples(&text, "imdedup_window_claims_total", &[("result", "error")]),
            Some(1.0)
        );
    }

    /// A store that counts inserts and takes its time over each.
    #[derive(Default)]
    struct SlowStore {
        inner: FlakyStore,
        inserts: std::sync::atomic::AtomicU32,
    }

    #[async_trait]
    impl MessageStore for SlowStore {
        async fn insert_once(&self, m: NewMessage) -> Result<Insert, Error> {
            self.inserts.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
            self.inner.insert_once(m).await
        }
        async fn lookup(&self, k: &MessageKey) -> Result<Option<StoredMessage>, Error> {
            self.inner.lookup(k).await
        }
        async fn history(&self, q: &HistoryQuery) -> Result<Vec<StoredMessage>, Error> {
            self.inner.history(q).await
        }
    }

    #[tokio::test]
    async fn copies_of_a_key_in_flight_wait_for_its_insert_instead_of_starting_another() {
        let store = Arc::new(SlowStore::default());
        // The window is down: nothing else stops the copies.
        let dedup = Arc::new(Dedup::new(
            Arc::new(DownWindow),
            store.clone(),
            Duration::from_secs(1),
        ));
        let copies: Vec<_> = (0..8)
            .map(|_| {
                let dedup = Arc::clone(&dedup);
                tokio::spawn(async move { dedup.send(message("m1")).await.unwrap() })
            })
            .collect();
        let mut acks = Vec::new();
        for copy in copies {
            acks.push(copy.await.unwrap());
        }
        assert_eq!(
            store.inserts.load(Ordering::SeqCst),
            1,
            "one LWT for 8 copies"
        );
        assert!(acks.iter().all(|a| a.receipt == acks[0].receipt));
        let stored = acks.iter().filter(|a| a.outcome == Outcome::Stored).count();
        assert_eq!(stored, 1);
        assert_eq!(dedup.stats().snapshot().joined_in_flight, 7);
        assert!(
            dedup.in_flight.is_empty(),
            "finished inserts leave the table"
        );

        // Once it is done, a resend is a new insert (the unique key answers).
        let again = dedup.send(message("m1")).await.unwrap();
        assert_eq!(again.outcome, Outcome::DuplicateUniqueKey);
        assert_eq!(store.inserts.load(Ordering::SeqCst), 2);
    }

    fn limited_to_two(store: Arc<SlowStore>, queue_wait: Duration) -> Arc<Dedup> {
        Arc::new(
            Dedup::new(
                Arc::new(MemoryWindow::new(MemoryWindowOptions::default())),
                store,
                Duration::from_secs(1),
            )
            .with_db_limit(DbLimitOptions {
                initial: 2,
                min: 2,
                max: 2,
                queue_wait,
                ..DbLimitOptions::default()
            }),
        )
    }

    fn send_all(
        dedup: &Arc<Dedup>,
        ids: &[&'static str],
    ) -> Vec<tokio::task::JoinHandle<Result<Ack, Error>>> {
        ids.iter()
            .map(|&id| {
                let dedup = Arc::clone(dedup);
                tokio::spawn(async move { dedup.send(message(id)).await })
            })
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn beyond_the_database_limit_a_send_finding_no_place_in_time_is_refused_and_stores_nothing()
     {
        let store = Arc::new(SlowStore::default());
        // Inserts take 50 ms; a send waits 10 ms at most for a place.
        let dedup = limited_to_two(store.clone(), Duration::from_millis(10));
        // Two slow inserts hold the limit; the third send finds it full.
        let running = send_all(&dedup, &["m1", "m2"]);
        tokio::time::sleep(Duration::from_millis(1)).await;
        let err = dedup.send(message("m3")).await.unwrap_err();
        // (The clock is paused: the slow inserts cannot have finished.)
        assert!(
            running.iter().all(|send| !send.is_finished()),
            "refused after its short wait, not queued behind the slow inserts"
        );
        assert_eq!(err.kind(), ErrorKind::Overloaded);
        assert!(err.retry_after().is_some());
        assert_eq!(dedup.metrics().shed_count("db_limit"), 1);
        for send in running {
            assert_eq!(send.await.unwrap().unwrap().outcome, Outcome::Stored);
        }
        assert_eq!(store.inserts.load(Ordering::SeqCst), 2, "m3 cost nothing");
        // Its claim was released: the resend is stored.
        let ack = dedup.send(message("m3")).await.unwrap();
        assert_eq!(ack.outcome, Outcome::Stored);
    }

    #[tokio::test(start_paused = true)]
    async fn beyond_the_database_limit_a_send_waits_a_little_for_a_place_in_arrival_order() {
        let store = Arc::new(SlowStore::default());
        // Inserts take 50 ms; a send may wait 175 ms for a place.
        let dedup = limited_to_two(store.clone(), Duration::from_millis(175));
        let sends = send_all(
            &dedup,
            &["m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8", "m9", "m10"],
        );
        let mut outcomes = Vec::new();
        for send in sends {
            outcomes.push(
                send.await
                    .unwrap()
                    .map(|ack| ack.outcome)
                    .map_err(|e| e.kind()),
            );
        }
        // Two places free every 50 ms: m3-m4 get them at 50 ms, m5-m6 at
        // 100, m7-m8 at 150; m9-m10 would at 200, after their wait.
        let stored = outcomes
            .iter()
            .filter(|o| **o == Ok(Outcome::Stored))
            .count();
        let refused = outcomes
            .iter()
            .filter(|o| **o == Err(ErrorKind::Overloaded))
            .count();
        assert_eq!((stored, refused), (8, 2), "{outcomes:?}");
        assert_eq!(
            outcomes[8..],
            [Err(ErrorKind::Overloaded); 2],
            "the latest ones wait longest"
        );
        assert_eq!(store.inserts.load(Ordering::SeqCst), 8);
        assert_eq!(dedup.metrics().shed_count("db_limit"), 2);
    }

    #[tokio::test]
    async fn a_send_whose_caller_gave_up_costs_no_insert_and_its_resend_is_stored() {
        let store = Arc::new(SlowStore::default());
        let dedup = Dedup::new(
            Arc::new(MemoryWindow::new(MemoryWindowOptions::default())),
            store.clone(),
            Duration::from_secs(1),
        );
        let gone = Instant::now();
        let err = dedup
            .send_within(message("m1"), Some(gone))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
        assert!(err.retryable());
        assert_eq!(store.inserts.load(Ordering::SeqCst), 0, "no database work");
        assert_eq!(dedup.stats().snapshot().shed_after_deadline, 1);
        // The claim was released: the resend is stored, not "seen".
        let later = Instant::now() + Duration::from_secs(5);
        let ack = dedup.send_within(message("m1"), Some(later)).await.unwrap();
        assert_eq!(ack.outcome, Outcome::Stored);
        assert_eq!(store.inserts.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_copy_with_other_content_joining_an_insert_is_told_the_id_is_reused() {
        let store = Arc::new(SlowStore::default());
        let dedup = Arc::new(Dedup::new(
            Arc::new(DownWindow),
            store.clone(),
            Duration::from_secs(1),
        ));
        let first = {
            let dedup = Arc::clone(&dedup);
            tokio::spawn(async move { dedup.send(message("m1")).await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        let mut other = message("m1");
        other.body = Body::parse("something else", 100).unwrap();
        let err = dedup.send(other).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::IdReused);
        assert_eq!(first.await.unwrap().unwrap().outcome, Outcome::Stored);
    }

    #[tokio::test]
    async fn with_the_window_down_the_store_still_decides() {
        let store = Arc::new(FlakyStore::default());
        let dedup = Dedup::new(Arc::new(DownWindow), store.clone(), Duration::from_secs(1));
        let first = dedup.send(message("m1")).await.unwrap();
        let again = dedup.send(message("m1")).await.unwrap();
        assert_eq!(first.outcome, Outcome::Stored);
        assert_eq!(again.outcome, Outcome::DuplicateUniqueKey);
        assert_eq!(again.receipt, first.receipt);
        assert_eq!(store.rows.lock().unwrap().len(), 1);
        assert_eq!(dedup.stats().snapshot().window_bypassed, 2);
    }
}
