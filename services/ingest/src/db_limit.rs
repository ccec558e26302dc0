//! An adaptive limit on the inserts in flight to the database (AIMD, from
//! `tower-acc`), in front of the store: while inserts succeed in good time
//! the limit grows by one; an insert that fails or takes longer than `slow`
//! cuts it by a tenth, so when the database stalls the limit falls to what
//! it can do in a few round trips. An insert beyond the limit is not queued
//! to time out: it is refused at once with `overloaded` and a retry-after
//! hint (tower's `LoadShed`), costing the database nothing.
//!
//! Why AIMD and not a latency gradient (Gradient2, Vegas): on a busy shared
//! machine an insert's latency also climbs when the *CPU* is short, not the
//! database; a gradient then shrinks the limit until the shard refuses most
//! sends it could have served (measured: 86 msgs/s acknowledged of 3,000
//! offered). A loss signal with a generous threshold reacts to the stalls
//! that matter and leaves a slow-but-working database alone.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use imdedup_core::{
    Error, ErrorKind,
    metrics::IngestMetrics,
    model::NewMessage,
    store::{Insert, MessageStore},
};
use tower::{
    BoxError, ServiceBuilder, ServiceExt, load_shed::error::Overloaded, util::BoxCloneSyncService,
};
use tower_acc::{Aimd, Algorithm, ConcurrencyLimitLayer};

/// How long a send refused at the limit is asked to wait, at least: more
/// when the database has not answered for a while (the time since it last
/// did, up to [`DB_DOWN_RETRY_AFTER`]), so phones do not come back sooner
/// than it is likely to.
pub const DB_BUSY_RETRY_AFTER: Duration = Duration::from_millis(250);
pub const DB_DOWN_RETRY_AFTER: Duration = Duration::from_secs(2);

/// Bounds of the adaptive limit.
#[derive(Debug, Clone, Copy)]
pub struct DbLimitOptions {
    /// Inserts in flight allowed at start.
    pub initial: usize,
    /// The limit never falls below this.
    pub min: usize,
    /// The limit never grows above this.
    pub max: usize,
    /// An insert slower than this counts as a sign of overload.
    pub slow: Duration,
}

impl Default for DbLimitOptions {
    fn default() -> Self {
        Self {
            initial: 64,
            min: 8,
            max: 1024,
            slow: Duration::from_millis(500),
        }
    }
}

type Request = (NewMessage, Duration);

/// The store's insert behind the adaptive limit.
#[derive(Clone)]
pub struct DbLimit {
    service: BoxCloneSyncService<Request, Insert, BoxError>,
    metrics: IngestMetrics,
    /// When an insert last succeeded, in ms after `epoch`.
    last_ok_ms: Arc<AtomicU64>,
    epoch: Instant,
}

impl DbLimit {
    pub fn new(
        store: Arc<dyn MessageStore>,
        options: DbLimitOptions,
        metrics: IngestMetrics,
    ) -> Self {
        let min = options.min.max(1);
        let max = options.max.max(min);
        let algorithm = Aimd::builder()
            .initial_limit(options.initial.clamp(min, max))
            .min_limit(min)
            .max_limit(max)
            .backoff_ratio(0.9)
            .timeout(options.slow)
            .build();
        metrics.set_db_limit(algorithm.max_concurrency());
        let observed = Observed {
            inner: algorithm,
            metrics: metrics.clone(),
        };
        let counting = metrics.clone();
        let insert = tower::service_fn(move |(message, timeout): Request| {
            let store = Arc::clone(&store);
            let _in_flight = counting.db_insert_started();
            async move {
                let _in_flight = _in_flight;
                tokio::time::timeout(timeout, store.insert_once(message))
                    .await
                    .unwrap_or_else(|_| {
                        Err(Error::new(
                            ErrorKind::DeadlineExceeded,
                            format!("storage did not answer within {timeout:?}"),
                        ))
                    })
                    .map_err(BoxError::from)
            }
        });
        let service = ServiceBuilder::new()
            .load_shed()
            .layer(ConcurrencyLimitLayer::new(observed))
            .service(insert);
        Self {
            service: BoxCloneSyncService::new(service),
            metrics,
            last_ok_ms: Arc::default(),
            epoch: Instant::now(),
        }
    }

    fn since_epoch_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The wait to ask for: the time since the database last answered,
    /// within the two bounds.
    fn retry_after(&self) -> Duration {
        let quiet = self
            .since_epoch_ms()
            .saturating_sub(self.last_ok_ms.load(Ordering::Relaxed));
        Duration::from_millis(quiet).clamp(DB_BUSY_RETRY_AFTER, DB_DOWN_RETRY_AFTER)
    }

    /// Insert `message` within `timeout`, or refuse it at once when the
    /// limit is reached.
    pub async fn insert(&self, message: NewMessage, timeout: Duration) -> Result<Insert, Error> {
        match self.service.clone().oneshot((message, timeout)).await {
            Ok(insert) => {
                self.last_ok_ms
                    .fetch_max(self.since_epoch_ms(), Ordering::Relaxed);
                Ok(insert)
            }
            Err(e) => Err(match e.downcast::<Error>() {
                Ok(e) => *e,
                Err(e) if e.is::<Overloaded>() => {
                    self.metrics.shed("db_limit");
                    Error::overloaded(
                        "the database is at its limit of inserts in flight; not stored: resend later",
                        self.retry_after(),
                    )
                }
                Err(e) => Error::internal(format!("insert: {e}")),
            }),
        }
    }
}

/// The algorithm, with its limit shown as a gauge after every change.
#[derive(Clone)]
struct Observed<A> {
    inner: A,
    metrics: IngestMetrics,
}

impl<A: Algorithm> Algorithm for Observed<A> {
    fn max_concurrency(&self) -> usize {
        self.inner.max_concurrency()
    }

    fn update(&mut self, rtt: Duration, num_inflight: usize, is_error: bool, is_canceled: bool) {
        self.inner.update(rtt, num_inflight, is_error, is_canceled);
        self.metrics.set_db_limit(self.inner.max_concurrency());
    }
}
