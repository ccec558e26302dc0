//! An adaptive limit on the inserts in flight to the database (AIMD, as
//! TCP's congestion window), in front of the store: while inserts succeed
//! in good time and the limit is used, it grows by about one per round trip
//! (1/limit per insert); an insert that fails or takes longer than `slow`
//! cuts it by a tenth, at most once per round trip (a slow insert that
//! started before the last cut says nothing new), so when the database
//! stalls the limit falls by a tenth per round trip until what is in flight
//! comes back in time. Below half the limit it had when it was last cut
//! after growing, it grows by one per good insert instead (TCP's slow
//! start), so after a stall has cut it to the floor it is back to half its
//! old size within a few round trips. An insert beyond the limit waits for a place (in
//! arrival order) at most `queue_wait`, just under a phone's first resend
//! interval: a short burst is absorbed without a refusal and an extra try.
//! It is never queued to time out: once the wait is over it is refused with
//! `overloaded` and a retry-after hint (`tower-acc`'s limit layer, whose
//! semaphore is the queue), costing the database nothing.
//!
//! Measured on a freshly started Cassandra, the two simpler rules fail:
//! `tower-acc`'s AIMD (one up per good insert, a tenth down per slow one)
//! swung 64 → 8 → 94 → 8 within three seconds, refusing three sends in four;
//! cutting once per round trip but still growing by one per insert grew the
//! limit to 900 in flight, and 4,909 inserts timed out in the database.
//!
//! The retry-after hint spreads the refused sends over time: while the
//! database answers, the wait grows with how many sends the shard refuses
//! per insert it completes (refusing as many as it serves: about a second),
//! from [`DB_BUSY_RETRY_AFTER`] to [`DB_BUSY_MAX_RETRY_AFTER`]; while it does
//! not answer, the wait is the time since it last did (up to
//! [`DB_DOWN_RETRY_AFTER`]). Each hint is jittered (×0.5 to ×1.5) so the
//! refused phones do not all come back in the same tick.
//!
//! Why AIMD and not a latency gradient (Gradient2, Vegas): on a busy shared
//! machine an insert's latency also climbs when the *CPU* is short, not the
//! database; a gradient then shrinks the limit until the shard refuses most
//! sends it could have served (measured: 86 msgs/s acknowledged of 3,000
//! offered). A loss signal with a generous threshold reacts to the stalls
//! that matter and leaves a slow-but-working database alone.

use std::{
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use rand::Rng;

use imdedup_core::{
    Error, ErrorKind,
    metrics::IngestMetrics,
    model::NewMessage,
    store::{Insert, MessageStore},
};
use tower::{BoxError, Service, ServiceBuilder, ServiceExt, util::BoxCloneSyncService};
use tower_acc::{Algorithm, ConcurrencyLimitLayer};

/// How long a send refused at the limit is asked to wait, at least.
pub const DB_BUSY_RETRY_AFTER: Duration = Duration::from_millis(250);
/// The longest wait asked for while the database answers but the shard
/// refuses more than it serves.
pub const DB_BUSY_MAX_RETRY_AFTER: Duration = Duration::from_secs(4);
/// The longest wait asked for while the database does not answer.
pub const DB_DOWN_RETRY_AFTER: Duration = Duration::from_secs(4);

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
    /// How long an insert beyond the limit may wait for a place before it
    /// is refused (zero: refused at once).
    pub queue_wait: Duration,
}

impl Default for DbLimitOptions {
    fn default() -> Self {
        Self {
            initial: 64,
            min: 8,
            max: 1024,
            slow: Duration::from_millis(500),
            queue_wait: Duration::from_millis(800),
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
    /// Inserts completed and sends refused, this second and the last.
    pressure: Arc<Mutex<Pressure>>,
    queue_wait: Duration,
}

/// Counts of the current second and the one before, for the retry-after
/// hint.
#[derive(Debug)]
struct Pressure {
    since: Instant,
    served: [u64; 2],
    refused: [u64; 2],
}

impl Pressure {
    fn new(now: Instant) -> Self {
        Self {
            since: now,
            served: [0; 2],
            refused: [0; 2],
        }
    }

    /// Move to the current second, dropping counts older than the last.
    fn roll(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.since);
        if elapsed >= Duration::from_secs(2) {
            *self = Self::new(now);
        } else if elapsed >= Duration::from_secs(1) {
            self.served = [0, self.served[0]];
            self.refused = [0, self.refused[0]];
            self.since += Duration::from_secs(1);
        }
    }

    fn served(&mut self, now: Instant) {
        self.roll(now);
        self.served[0] += 1;
    }

    fn refused(&mut self, now: Instant) {
        self.roll(now);
        self.refused[0] += 1;
    }

    /// Sends refused per insert completed, over the last second or two.
    fn ratio(&mut self, now: Instant) -> f64 {
        self.roll(now);
        let served = self.served.iter().sum::<u64>().max(1);
        self.refused.iter().sum::<u64>() as f64 / served as f64
    }
}

impl DbLimit {
    pub fn new(
        store: Arc<dyn MessageStore>,
        options: DbLimitOptions,
        metrics: IngestMetrics,
    ) -> Self {
        let min = options.min.max(1);
        let max = options.max.max(min);
        let algorithm = Aimd {
            limit: options.initial.clamp(min, max) as f64,
            min,
            max,
            slow: options.slow,
            last_cut: None,
            threshold: 0.0,
            grew: true,
            metrics: metrics.clone(),
        };
        metrics.set_db_limit(algorithm.max_concurrency());
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
            .layer(ConcurrencyLimitLayer::new(algorithm))
            .service(insert);
        Self {
            service: BoxCloneSyncService::new(service),
            metrics,
            last_ok_ms: Arc::default(),
            epoch: Instant::now(),
            pressure: Arc::new(Mutex::new(Pressure::new(Instant::now()))),
            queue_wait: options.queue_wait,
        }
    }

    fn since_epoch_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn pressure(&self) -> std::sync::MutexGuard<'_, Pressure> {
        self.pressure.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The wait to ask a refused send for (see the module's comment).
    fn retry_after(&self) -> Duration {
        let quiet = Duration::from_millis(
            self.since_epoch_ms()
                .saturating_sub(self.last_ok_ms.load(Ordering::Relaxed)),
        );
        let wait = if quiet > DB_BUSY_RETRY_AFTER {
            quiet.min(DB_DOWN_RETRY_AFTER)
        } else {
            let ratio = self.pressure().ratio(Instant::now());
            Duration::from_secs_f64(ratio.min(DB_BUSY_MAX_RETRY_AFTER.as_secs_f64()))
                .max(DB_BUSY_RETRY_AFTER)
        };
        wait.mul_f64(rand::rng().random_range(0.5..=1.5))
    }

    /// Insert `message` within `timeout`, or refuse it at once when the
    /// limit is reached.
    pub async fn insert(&self, message: NewMessage, timeout: Duration) -> Result<Insert, Error> {
        let mut service = self.service.clone();
        // A place under the limit, waited for a little at most (and never
        // longer than half the caller's time: the insert needs the rest).
        let arrived = Instant::now();
        let wait = self.queue_wait.min(timeout / 2);
        match tokio::time::timeout(wait, service.ready()).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(Error::internal(format!("insert: {e}"))),
            Err(_) => {
                self.metrics.shed("db_limit");
                self.pressure().refused(Instant::now());
                return Err(Error::overloaded(
                    "the database is at its limit of inserts in flight; not stored: resend later",
                    self.retry_after(),
                ));
            }
        }
        let left = timeout.saturating_sub(arrived.elapsed());
        match service.call((message, left)).await {
            Ok(insert) => {
                self.last_ok_ms
                    .fetch_max(self.since_epoch_ms(), Ordering::Relaxed);
                self.pressure().served(Instant::now());
                Ok(insert)
            }
            Err(e) => Err(match e.downcast::<Error>() {
                Ok(e) => *e,
                Err(e) => Error::internal(format!("insert: {e}")),
            }),
        }
    }
}

/// The limit: additive increase per round trip, multiplicative decrease
/// at most once per round trip (see the module's comment), shown as a gauge
/// after every change.
#[derive(Clone)]
struct Aimd {
    limit: f64,
    min: usize,
    max: usize,
    /// An insert slower than this is a sign of overload.
    slow: Duration,
    /// When the limit was last cut.
    last_cut: Option<Instant>,
    /// Below this the limit grows by one per good insert (doubling per
    /// round trip, TCP's slow start), above it by one per round trip: half
    /// the limit at the first cut after it last grew, so after a long
    /// stall has cut it to the floor it gets back to half its old size in
    /// a few round trips rather than one step per round trip.
    threshold: f64,
    /// Whether it grew since the last cut.
    grew: bool,
    metrics: IngestMetrics,
}

/// What a cut leaves of the limit.
const BACKOFF: f64 = 0.9;

impl Algorithm for Aimd {
    fn max_concurrency(&self) -> usize {
        (self.limit as usize).clamp(self.min, self.max)
    }

    fn update(&mut self, rtt: Duration, num_inflight: usize, is_error: bool, is_canceled: bool) {
        if is_canceled {
            return;
        }
        let before = self.max_concurrency();
        if is_error || rtt > self.slow {
            let now = Instant::now();
            let started = now.checked_sub(rtt).unwrap_or(now);
            if self.last_cut.is_some_and(|cut| started < cut) {
                return;
            }
            self.last_cut = Some(now);
            if std::mem::take(&mut self.grew) {
                self.threshold = self.limit / 2.0;
            }
            self.limit = (self.limit * BACKOFF).max(self.min as f64);
        } else if num_inflight * 2 >= before {
            // Grow only while the limit is used: an idle shard's limit
            // says nothing about the database.
            let step = if self.limit < self.threshold {
                1.0
            } else {
                1.0 / self.limit
            };
            self.limit = (self.limit + step).min(self.max as f64);
            self.grew = true;
        }
        if self.max_concurrency() != before {
            self.metrics.set_db_limit(self.max_concurrency());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aimd() -> Aimd {
        Aimd {
            limit: 64.0,
            min: 8,
            max: 1024,
            slow: Duration::from_millis(500),
            last_cut: None,
            threshold: 0.0,
            grew: true,
            metrics: IngestMetrics::default(),
        }
    }

    #[test]
    fn a_stall_that_slows_every_insert_in_flight_cuts_the_limit_once() {
        let mut limit = aimd();
        // 64 inserts caught in one 2 s stall all finish slow, together.
        for inflight in (0..64).rev() {
            limit.update(Duration::from_secs(2), inflight, false, false);
        }
        assert_eq!(limit.max_concurrency(), 57, "one cut of a tenth, not 64");
        // An insert sent after that cut and slow too is news: cut again.
        std::thread::sleep(Duration::from_millis(5));
        limit.update(Duration::from_millis(1), 10, true, false);
        assert_eq!(limit.max_concurrency(), 51);
        // Inserts in good time grow it by about one per round trip (one
        // limit's worth of inserts) while it is used, not while it is idle.
        for _ in 0..51 {
            limit.update(Duration::from_millis(20), 40, false, false);
        }
        assert_eq!(limit.max_concurrency(), 52);
        for _ in 0..500 {
            limit.update(Duration::from_millis(20), 3, false, false);
        }
        assert_eq!(limit.max_concurrency(), 52);
        // A long stall still brings it down, a tenth per round trip.
        for _ in 0..30 {
            std::thread::sleep(Duration::from_millis(2));
            limit.update(Duration::from_millis(1), 8, true, false);
        }
        assert_eq!(limit.max_concurrency(), 8, "to the floor, not below");
        // Once it answers again the limit doubles per round trip up to half
        // what it was before the stall (52 / 2), then grows by one per
        // round trip: 18 good inserts take it from 8 to 26, not to 8.4.
        for _ in 0..18 {
            let busy = limit.max_concurrency();
            limit.update(Duration::from_millis(20), busy, false, false);
        }
        assert_eq!(limit.max_concurrency(), 26);
        for _ in 0..26 {
            limit.update(Duration::from_millis(20), 26, false, false);
        }
        // (one more step of one takes it past 26.4, then about one per
        // round trip of 27)
        assert_eq!(limit.max_concurrency(), 27, "one per round trip above it");
    }

    #[test]
    fn the_wait_asked_for_grows_with_the_sends_refused_per_insert_served() {
        let start = Instant::now();
        let mut pressure = Pressure::new(start);
        for _ in 0..100 {
            pressure.served(start);
        }
        for _ in 0..250 {
            pressure.refused(start);
        }
        assert!((pressure.ratio(start) - 2.5).abs() < 1e-9);
        // The last second still counts; older ones do not.
        let next = start + Duration::from_millis(1500);
        for _ in 0..100 {
            pressure.served(next);
        }
        assert!((pressure.ratio(next) - 1.25).abs() < 1e-9);
        assert_eq!(pressure.ratio(next + Duration::from_secs(3)), 0.0);
    }
}
