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
//! old size within a few round trips.
//!
//! An insert beyond the limit waits for a place, in arrival order, at most
//! `queue_wait` (just under a phone's first resend interval): a burst is
//! absorbed without a refusal and an extra try. It is never queued to time
//! out: once the wait is over it is refused with `overloaded` and a
//! retry-after hint, costing the database nothing.
//!
//! Measured on a freshly started Cassandra, two simpler rules failed:
//! `tower-acc`'s AIMD (one up per good insert, a tenth down per slow one)
//! swung 64 → 8 → 94 → 8 within three seconds, refusing three sends in four;
//! cutting once per round trip but still growing by one per insert grew the
//! limit to 900 in flight, and 4,909 inserts timed out in the database. And
//! `tower-acc`'s limit layer cannot lower its limit while sends wait (see
//! [`limiter`]), so the permits are ours.
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
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use rand::Rng;

use crate::metrics::IngestMetrics;

use imdedup_domain::{
    Error, ErrorKind,
    model::NewMessage,
    store::{Insert, MessageStore},
};

mod limiter;

use limiter::{Aimd, Limiter};

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

/// The store's insert behind the adaptive limit.
#[derive(Clone)]
pub struct DbLimit {
    store: Arc<dyn MessageStore>,
    limiter: Arc<Limiter>,
    metrics: IngestMetrics,
    /// Inserts completed and sends refused, for the retry-after hint.
    pressure: Arc<Mutex<Pressure>>,
    queue_wait: Duration,
}

/// Inserts completed and sends refused in the current second and the one
/// before, and when an insert last succeeded: what the retry-after hint is
/// made of.
#[derive(Debug)]
struct Pressure {
    since: Instant,
    served: [u64; 2],
    refused: [u64; 2],
    last_served: Instant,
}

impl Pressure {
    fn new(now: Instant) -> Self {
        Self {
            since: now,
            served: [0; 2],
            refused: [0; 2],
            last_served: now,
        }
    }

    /// Move to the current second, dropping counts older than the last.
    fn roll(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.since);
        if elapsed >= Duration::from_secs(2) {
            self.since = now;
            self.served = [0; 2];
            self.refused = [0; 2];
        } else if elapsed >= Duration::from_secs(1) {
            self.served = [0, self.served[0]];
            self.refused = [0, self.refused[0]];
            self.since += Duration::from_secs(1);
        }
    }

    fn served(&mut self, now: Instant) {
        self.roll(now);
        self.served[0] += 1;
        self.last_served = now;
    }

    /// Count a refused send; the wait to ask it for, before jitter (see the
    /// module's comment).
    fn refused(&mut self, now: Instant) -> Duration {
        self.roll(now);
        self.refused[0] += 1;
        let quiet = now.saturating_duration_since(self.last_served);
        if quiet > DB_BUSY_RETRY_AFTER {
            quiet.min(DB_DOWN_RETRY_AFTER)
        } else {
            let ratio = self.ratio(now);
            Duration::from_secs_f64(ratio.min(DB_BUSY_MAX_RETRY_AFTER.as_secs_f64()))
                .max(DB_BUSY_RETRY_AFTER)
        }
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
        let aimd = Aimd::new(options.initial, options.min, options.max, options.slow);
        Self {
            store,
            limiter: Arc::new(Limiter::new(aimd, metrics.clone())),
            metrics,
            pressure: Arc::new(Mutex::new(Pressure::new(Instant::now()))),
            queue_wait: options.queue_wait,
        }
    }

    fn pressure(&self) -> std::sync::MutexGuard<'_, Pressure> {
        self.pressure.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Insert `message` within `timeout`; when the limit is reached, wait
    /// for a place a little at most, then refuse it.
    pub async fn insert(&self, message: NewMessage, timeout: Duration) -> Result<Insert, Error> {
        let arrived = Instant::now();
        // Never longer than half the caller's time: the insert needs the rest.
        let wait = self.queue_wait.min(timeout / 2);
        let Some(slot) = self.limiter.acquire(wait).await else {
            self.metrics.shed("db_limit");
            let wait = self.pressure().refused(Instant::now());
            // Jittered, so the refused phones do not come back together.
            return Err(Error::overloaded(
                "the database is at its limit of inserts in flight; not stored: resend later",
                wait.mul_f64(rand::rng().random_range(0.5..=1.5)),
            ));
        };
        let _in_flight = self.metrics.db_insert_started();
        let left = timeout.saturating_sub(arrived.elapsed());
        let result = tokio::time::timeout(left, self.store.insert_once(message))
            .await
            .unwrap_or_else(|_| {
                Err(Error::new(
                    ErrorKind::DeadlineExceeded,
                    format!("storage did not answer within {timeout:?}"),
                ))
            });
        slot.finished(result.is_err());
        if result.is_ok() {
            self.pressure().served(Instant::now());
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
