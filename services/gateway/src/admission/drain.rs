//! The places a draining backlog may hold, adapted to new sends' latency
//! against the calm one. (The limit on sends in flight is
//! `imdedup_runtime::aimd`.)

use std::time::{Duration, Instant};

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
/// What a cut leaves of the cap.
const BACKOFF: f64 = 0.9;
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
