//! An adaptive limit on work in flight, set like TCP's congestion window:
//! multiplicative decrease at most once per round trip, additive increase
//! per round trip while the limit is used, slow start below a threshold.
//! The gateway's admission limit and the ingest's limit on inserts in
//! flight are both this rule; each decides what counts as congestion.

use std::time::Instant;

/// The limit and what it remembers of its last cut.
#[derive(Debug)]
pub struct Aimd {
    limit: f64,
    min: usize,
    max: usize,
    /// When the limit was last cut.
    last_cut: Option<Instant>,
    /// Below this the limit grows by one per good answer (doubling per
    /// round trip, TCP's slow start), above it by one per round trip: half
    /// the limit at the first cut after it last grew, so after a long stall
    /// has cut it to the floor it gets back to half its old size in a few
    /// round trips rather than one step per round trip.
    threshold: f64,
    /// Whether it grew since the last cut.
    grew: bool,
}

/// What a cut leaves of the limit.
const BACKOFF: f64 = 0.9;

impl Aimd {
    /// A limit starting at `initial`, kept between `min` (at least 1) and
    /// `max`.
    pub fn new(initial: usize, min: usize, max: usize) -> Self {
        let min = min.max(1);
        let max = max.max(min);
        Self {
            limit: initial.clamp(min, max) as f64,
            min,
            max,
            last_cut: None,
            threshold: 0.0,
            grew: true,
        }
    }

    /// The work allowed in flight now.
    pub fn limit(&self) -> usize {
        (self.limit as usize).clamp(self.min, self.max)
    }

    /// Work started at `started` ended at `now`, with `in_flight` in flight
    /// (itself included), `congested` or not. A congested answer cuts the
    /// limit unless it started before the last cut (it says nothing new); a
    /// good one grows it only while at least half the limit is used (an
    /// idle limit says nothing about capacity).
    pub fn update(&mut self, started: Instant, now: Instant, in_flight: usize, congested: bool) {
        if congested {
            if self.last_cut.is_some_and(|cut| started < cut) {
                return;
            }
            self.last_cut = Some(now);
            if std::mem::take(&mut self.grew) {
                self.threshold = self.limit / 2.0;
            }
            self.limit = (self.limit * BACKOFF).max(self.min as f64);
        } else if in_flight * 2 >= self.limit() {
            let step = if self.limit < self.threshold {
                1.0
            } else {
                1.0 / self.limit
            };
            self.limit = (self.limit + step).min(self.max as f64);
            self.grew = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn late_answers_cut_the_limit_once_per_round_trip_and_timely_ones_grow_it() {
        let now = Instant::now();
        let mut aimd = Aimd::new(100, 10, 1000);
        // 100 sends caught together in one slow second: one cut.
        let end = now + Duration::from_secs(1);
        for in_flight in (1..=100).rev() {
            aimd.update(now, end, in_flight, true);
        }
        assert_eq!(aimd.limit(), 90);
        // A send started after that cut and late again: another cut.
        aimd.update(end, end + Duration::from_secs(1), 90, true);
        assert_eq!(aimd.limit(), 81);
        // Below half the limit it had, timely sends grow it by one each.
        let mut low = Aimd::new(1000, 10, 1000);
        for round in 0..50 {
            let t = now + Duration::from_secs(round);
            low.update(t, t, 1000, true);
        }
        assert_eq!(low.limit(), 10);
        let t = now + Duration::from_secs(100);
        for _ in 0..100 {
            low.update(t, t, 1000, false);
        }
        assert_eq!(low.limit(), 110, "slow start after a collapse");
        // An idle gateway's limit does not grow.
        let before = aimd.limit();
        aimd.update(t, t, 1, false);
        assert_eq!(aimd.limit(), before);
    }
}
