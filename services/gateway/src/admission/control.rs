//! The admission's two adaptive limits: the sends in flight (AIMD on the
//! sends' latency against the target) and, while a backlog drains, the
//! places it may hold (on new sends' latency against the calm one).

use std::time::{Duration, Instant};

use super::AdmissionOptions;

/// How many places the backlog may hold while it drains and new sends are
/// in flight. New sends go in above the limit then, but every send in
/// flight is queued at the shards, so a backlog filling the limit makes a
/// new send wait for all of it: about the limit's worth of sends divided
/// by what the gateway serves, a hundred milliseconds and more where the
/// gateway answered in a few before the surge. The cap keeps the queue
/// short enough for new sends to be answered about as fast as before the
/// surge: a send answered later than [`DRAIN_LATENCY_FACTOR`] times the
/// latency measured while the gateway was calm, plus
/// [`DRAIN_LATENCY_SLACK`], cuts it by a tenth (at most once per round
/// trip), sends in time grow it by one per round trip. It stays between
/// [`DRAIN_MIN_SHARE`] of the limit (the backlog always drains) and the
/// limit. With no new send in flight it does not apply: nobody waits
/// behind the backlog then; nor while the backlog is more than
/// [`DRAIN_BEHIND`] behind its appointments.
#[derive(Debug)]
pub(super) struct DrainCap {
    /// The mean latency, in seconds, of the sends answered while no
    /// backlog was held and less than half the limit was in flight; `None`
    /// until one was.
    calm: Option<f64>,
    cap: f64,
    last_cut: Option<Instant>,
}

/// A send answered, while new sends are in flight behind the draining
/// backlog, later than this many times the calm latency...
const DRAIN_LATENCY_FACTOR: f64 = 4.0;
/// ... plus this waited too long behind the backlog.
const DRAIN_LATENCY_SLACK: Duration = Duration::from_millis(20);
/// The least share of the limit the backlog may hold while it drains.
const DRAIN_MIN_SHARE: f64 = 0.125;
/// A backlog whose oldest held send is this far past its appointment
/// drains with the whole limit: the cap would delay it further while its
/// phones already wait longer than they were told (a slow box, a surge
/// served below the pace its appointments were booked at), and some
/// would give up (measured: 14,751 phones in one such run).
pub(super) const DRAIN_BEHIND: Duration = Duration::from_secs(5);
/// Weight of one calm send's latency in the mean.
const CALM_WEIGHT: f64 = 1.0 / 256.0;

impl DrainCap {
    pub(super) fn new(initial: f64) -> Self {
        Self {
            calm: None,
            cap: initial,
            last_cut: None,
        }
    }

    /// A send answered in `rtt` while the gateway was calm.
    pub(super) fn calm(&mut self, rtt: Duration) {
        let rtt = rtt.as_secs_f64();
        self.calm = Some(
            self.calm
                .map_or(rtt, |mean| mean + CALM_WEIGHT * (rtt - mean)),
        );
    }

    /// The latency a send may have while the backlog drains, at most
    /// `target`; `None` (no cap) before any send was answered calmly.
    pub(super) fn bound(&self, target: Duration) -> Option<Duration> {
        let calm = self.calm?;
        Some(
            Duration::from_secs_f64(calm * DRAIN_LATENCY_FACTOR)
                .saturating_add(DRAIN_LATENCY_SLACK)
                .min(target),
        )
    }

    /// A send admitted at `started` ended at `now`, `late` or not, while
    /// new sends were in flight behind the draining backlog.
    pub(super) fn update(&mut self, started: Instant, now: Instant, late: bool, limit: usize) {
        let limit = limit as f64;
        self.cap = self.cap.clamp(limit * DRAIN_MIN_SHARE, limit);
        if late {
            if self.last_cut.is_some_and(|cut| started < cut) {
                return;
            }
            self.last_cut = Some(now);
            self.cap = (self.cap * BACKOFF).max(limit * DRAIN_MIN_SHARE);
        } else {
            self.cap = (self.cap + 1.0 / self.cap).min(limit);
        }
    }

    /// Places the backlog may hold under `limit`.
    pub(super) fn room(&self, limit: usize) -> usize {
        let limit = limit as f64;
        self.cap.clamp(limit * DRAIN_MIN_SHARE, limit) as usize
    }
}

/// The limit: additive increase per round trip, multiplicative decrease at
/// most once per round trip, slow start below the threshold.
#[derive(Debug)]
pub(super) struct Aimd {
    limit: f64,
    min: usize,
    max: usize,
    pub(super) target: Duration,
    last_cut: Option<Instant>,
    /// Below this the limit grows by one per send in time (half the limit
    /// at the first cut after it last grew).
    threshold: f64,
    grew: bool,
}

/// What a cut leaves of the limit.
const BACKOFF: f64 = 0.9;

impl Aimd {
    pub(super) fn new(options: AdmissionOptions) -> Self {
        let min = options.min.max(1);
        let max = options.max.max(min);
        Self {
            limit: options.initial.clamp(min, max) as f64,
            min,
            max,
            target: options.target,
            last_cut: None,
            threshold: 0.0,
            grew: true,
        }
    }

    pub(super) fn limit(&self) -> usize {
        (self.limit as usize).clamp(self.min, self.max)
    }

    /// A send admitted at `started` ended at `now`, with `in_flight` in
    /// flight (itself included), congested or not.
    pub(super) fn update(
        &mut self,
        started: Instant,
        now: Instant,
        in_flight: usize,
        congested: bool,
    ) {
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
    use super::*;

    #[test]
    fn late_answers_cut_the_limit_once_per_round_trip_and_timely_ones_grow_it() {
        let now = Instant::now();
        let mut aimd = Aimd::new(AdmissionOptions {
            initial: 100,
            min: 10,
            max: 1000,
            target: Duration::from_millis(250),
            horizon: Duration::from_secs(20),
        });
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
        let mut low = Aimd::new(AdmissionOptions {
            initial: 1000,
            min: 10,
            max: 1000,
            ..AdmissionOptions::default()
        });
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
