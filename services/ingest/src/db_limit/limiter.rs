//! The adaptive limit on inserts in flight: the AIMD rule and the permits
//! that enforce it.
//!
//! The permits are a tokio semaphore, whose waiters are served in arrival
//! order. A semaphore can only forget permits nobody holds, and tokio hands
//! a released permit straight to the first waiter, so while sends wait a
//! lower limit would never take effect (measured, with `tower-acc`'s layer
//! and waiters: 57 inserts in flight for 30 s while its limit said 26).
//! Here an insert that finishes while more permits exist than the limit
//! allows forgets its own permit instead of releasing it.

use std::{
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use crate::metrics::IngestMetrics;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The permits of inserts in flight, resized by [`Aimd`].
#[derive(Debug)]
pub(super) struct Limiter {
    semaphore: Arc<Semaphore>,
    state: Mutex<State>,
    metrics: IngestMetrics,
}

#[derive(Debug)]
struct State {
    aimd: Aimd,
    /// Permits in existence: held by inserts in flight or available.
    permits: usize,
}

impl Limiter {
    pub(super) fn new(aimd: Aimd, metrics: IngestMetrics) -> Self {
        let permits = aimd.max_concurrency();
        metrics.set_db_limit(permits);
        Self {
            semaphore: Arc::new(Semaphore::new(permits)),
            state: Mutex::new(State { aimd, permits }),
            metrics,
        }
    }

    /// A place under the limit, waiting `wait` at most, first come first
    /// served.
    pub(super) async fn acquire(self: &Arc<Self>, wait: Duration) -> Option<Slot> {
        let permit = tokio::time::timeout(wait, Arc::clone(&self.semaphore).acquire_owned())
            .await
            .ok()?
            .ok()?;
        Some(Slot {
            limiter: Arc::clone(self),
            permit: Some(permit),
            started: Instant::now(),
            failed: None,
        })
    }

    fn release(&self, permit: OwnedSemaphorePermit, rtt: Duration, failed: Option<bool>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        // An insert given up before it finished (its caller went away)
        // says nothing about the database.
        if let Some(failed) = failed {
            let in_flight = state
                .permits
                .saturating_sub(self.semaphore.available_permits());
            state.aimd.update(rtt, in_flight, failed);
        }
        let limit = state.aimd.max_concurrency();
        if state.permits > limit {
            state.permits -= self.semaphore.forget_permits(state.permits - limit);
        }
        if state.permits > limit {
            permit.forget();
            state.permits -= 1;
        } else {
            drop(permit);
            if limit > state.permits {
                self.semaphore.add_permits(limit - state.permits);
                state.permits = limit;
            }
        }
        self.metrics.set_db_limit(limit);
    }
}

/// A place under the limit, held for one insert; given back when dropped.
pub(super) struct Slot {
    limiter: Arc<Limiter>,
    permit: Option<OwnedSemaphorePermit>,
    started: Instant,
    /// Set when the insert finished: whether it failed.
    failed: Option<bool>,
}

impl Slot {
    pub(super) fn finished(mut self, failed: bool) {
        self.failed = Some(failed);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            self.limiter
                .release(permit, self.started.elapsed(), self.failed);
        }
    }
}

/// The limit ([`imdedup_runtime::aimd::Aimd`], see the comment of
/// [`super`]), with what makes an insert a sign of overload.
#[derive(Debug)]
pub(super) struct Aimd {
    limit: imdedup_runtime::aimd::Aimd,
    /// An insert slower than this is a sign of overload.
    slow: Duration,
}

impl Aimd {
    pub(super) fn new(initial: usize, min: usize, max: usize, slow: Duration) -> Self {
        Self {
            limit: imdedup_runtime::aimd::Aimd::new(initial, min, max),
            slow,
        }
    }

    pub(super) fn max_concurrency(&self) -> usize {
        self.limit.limit()
    }

    /// An insert's outcome: it took `rtt`, with `num_inflight` in flight
    /// (itself included), and failed or not. It grows the limit only while
    /// the limit is used: an idle shard's limit says nothing about the
    /// database.
    pub(super) fn update(&mut self, rtt: Duration, num_inflight: usize, is_error: bool) {
        let now = Instant::now();
        let started = now.checked_sub(rtt).unwrap_or(now);
        self.limit
            .update(started, now, num_inflight, is_error || rtt > self.slow);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aimd() -> Aimd {
        Aimd::new(64, 8, 1024, Duration::from_millis(500))
    }

    #[test]
    fn a_stall_that_slows_every_insert_in_flight_cuts_the_limit_once() {
        let mut limit = aimd();
        // 64 inserts caught in one 2 s stall all finish slow, together.
        for inflight in (0..64).rev() {
            limit.update(Duration::from_secs(2), inflight, false);
        }
        assert_eq!(limit.max_concurrency(), 57, "one cut of a tenth, not 64");
        // An insert sent after that cut and slow too is news: cut again.
        std::thread::sleep(Duration::from_millis(5));
        limit.update(Duration::from_millis(1), 10, true);
        assert_eq!(limit.max_concurrency(), 51);
        // Inserts in good time grow it by about one per round trip (one
        // limit's worth of inserts) while it is used, not while it is idle.
        for _ in 0..51 {
            limit.update(Duration::from_millis(20), 40, false);
        }
        assert_eq!(limit.max_concurrency(), 52);
        for _ in 0..500 {
            limit.update(Duration::from_millis(20), 3, false);
        }
        assert_eq!(limit.max_concurrency(), 52);
        // A long stall still brings it down, a tenth per round trip.
        for _ in 0..30 {
            std::thread::sleep(Duration::from_millis(2));
            limit.update(Duration::from_millis(1), 8, true);
        }
        assert_eq!(limit.max_concurrency(), 8, "to the floor, not below");
        // Once it answers again the limit doubles per round trip up to half
        // what it was before the stall (52 / 2), then grows by one per
        // round trip: 18 good inserts take it from 8 to 26, not to 8.4.
        for _ in 0..18 {
            let busy = limit.max_concurrency();
            limit.update(Duration::from_millis(20), busy, false);
        }
        assert_eq!(limit.max_concurrency(), 26);
        for _ in 0..26 {
            limit.update(Duration::from_millis(20), 26, false);
        }
        // (one more step of one takes it past 26.4, then about one per
        // round trip of 27)
        assert_eq!(limit.max_concurrency(), 27, "one per round trip above it");
    }

    #[tokio::test]
    async fn a_lower_limit_takes_effect_while_sends_wait_for_a_place() {
        let limiter = Arc::new(Limiter::new(
            Aimd::new(4, 1, 1024, Duration::from_millis(500)),
            IngestMetrics::default(),
        ));
        let held: Vec<Slot> = futures_util::future::join_all(
            (0..4).map(|_| limiter.acquire(Duration::from_millis(10))),
        )
        .await
        .into_iter()
        .map(Option::unwrap)
        .collect();
        // Sends queue up behind the four inserts in flight.
        let waiting: Vec<_> = (0..8)
            .map(|_| {
                let limiter = Arc::clone(&limiter);
                tokio::spawn(async move { limiter.acquire(Duration::from_secs(5)).await })
            })
            .collect();
        tokio::task::yield_now().await;
        // The four fail: the limit is cut once (the first that failed; the
        // others started before the cut), to 3.
        for slot in held {
            slot.finished(true);
        }
        assert_eq!(limiter.state.lock().unwrap().aimd.max_concurrency(), 3);
        // The waiters got three places, not four: one permit was forgotten
        // although sends were waiting for it.
        let admitted = || waiting.iter().filter(|w| w.is_finished()).count();
        for _ in 0..50 {
            if admitted() >= 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(admitted(), 3, "in flight never above the limit");
        assert_eq!(limiter.state.lock().unwrap().permits, 3);
        for w in &waiting {
            w.abort();
        }
    }
}
