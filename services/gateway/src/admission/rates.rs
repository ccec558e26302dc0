//! What the admission measures: what the gateway serves per second while
//! it is full (the pace of appointments) and new sends arriving against
//! sends answered (whether a backlog is draining).

use std::time::{Duration, Instant};

/// What the gateway serves per second while it is full, measured over
/// short windows: a window in which a send was refused measured the
/// capacity (smoothed), unless it answered almost nothing (a stall, which
/// lowers the estimate slowly); one without refusals served all that came,
/// so it only raises the estimate. Appointments are spaced by it. (Sends in
/// flight divided by their latency is not it: under a CPU-bound surge the
/// latency includes the time spent refusing, and appointments booked that
/// slow left the gateway idle later with tens of thousands waiting.)
#[derive(Debug)]
pub(super) struct Pace {
    /// Sends per second; `None` until a window ended.
    pub(super) rate: Option<f64>,
    window_start: Instant,
    answered: u32,
    full: bool,
}

/// A measuring window.
pub(super) const PACE_WINDOW: Duration = Duration::from_millis(250);
/// Weight of a full window's measure in the estimate.
const PACE_WEIGHT: f64 = 0.3;
/// The pace assumed before a window ended, and the slowest.
const PACE_MIN: f64 = 10.0;
/// A full window that answered less than this share of the pace is a
/// stall (a database paused, a shard gone), not a measure of capacity: the
/// pace then only decays by [`STALL_DECAY`] a window, halving in about
/// 3.4 s, so the appointments of a short stall end soon after it instead of
/// tens of seconds later.
const STALL_SHARE: f64 = 0.1;
const STALL_DECAY: f64 = 0.95;

impl Pace {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            rate: None,
            window_start: now,
            answered: 0,
            full: false,
        }
    }

    pub(super) fn answered(&mut self, now: Instant) {
        self.answered = self.answered.saturating_add(1);
        self.roll(now);
    }

    pub(super) fn refused(&mut self, now: Instant) {
        self.roll(now);
        self.full = true;
    }

    fn roll(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.window_start);
        if elapsed < PACE_WINDOW {
            return;
        }
        let served = f64::from(self.answered) / elapsed.as_secs_f64();
        self.rate = Some(match self.rate {
            Some(rate) if self.full && served < STALL_SHARE * rate => rate * STALL_DECAY,
            Some(rate) if self.full => rate + PACE_WEIGHT * (served - rate),
            Some(rate) => rate.max(served),
            None => served,
        });
        self.restart(now);
    }

    fn restart(&mut self, now: Instant) {
        self.window_start = now;
        self.answered = 0;
        self.full = false;
    }

    /// The time between two appointments.
    pub(super) fn spacing(&self) -> Duration {
        Duration::from_secs_f64(1.0 / self.rate.unwrap_or(PACE_MIN).max(PACE_MIN))
    }
}

/// New sends arriving and sends answered per second, smoothed over
/// [`PACE_WINDOW`]s.
#[derive(Debug)]
pub(super) struct Flow {
    window_start: Instant,
    arrived: u32,
    answered: u32,
    arrivals: f64,
    answers: f64,
    /// The most the gateway answered lately: the smoothed answers, or
    /// this decaying by [`SERVED_DECAY`] a window, whichever is higher.
    served: f64,
    /// The surge is over: set when new sends arrive at less than
    /// [`DRAIN_SHARE`] of the sends answered, cleared only when they arrive
    /// at [`SURGE_SHARE`] of what the gateway answered lately or more, both
    /// smoothed and in the window just ended.
    draining: bool,
    /// The start of the last window in which, by its own counts (not
    /// smoothed), new sends arrived at [`SURGE_SHARE`] of the answers or
    /// more: where the backlog last grew.
    surge_seen: Instant,
    /// Windows in a row each a drain's by its own counts.
    quiet: u32,
}

/// Weight of a window's counts in the smoothed rates.
const FLOW_WEIGHT: f64 = 0.5;
/// New sends arriving at less than this share of the sends answered: the
/// surge is over, new sends go before the backlog. Near 1, so that a load
/// back just below the capacity is seen as a drain too: at 0.6, with 0.8 C
/// offered after a surge, no drain was seen and new messages waited
/// 10-29 s behind the backlog. (0.6 was to leave the backlog at least 40%
/// of the capacity; now it drains with what the new sends leave, and one
/// more than [`super::drain::DRAIN_BEHIND`] behind its appointments is not
/// held to a share of the places.)
pub(super) const DRAIN_SHARE: f64 = 0.9;
/// New sends arriving at this share of what the gateway answered lately
/// or more, smoothed and in the quarter second just ended: a surge again
/// (the backlog no longer shrinks), the queue back in order of arrival.
/// Between the two shares nothing changes: the smoothed rates move by a
/// fifth from one quarter second to the next, and a send booked behind the
/// backlog in a quarter second that looked like a surge waited for all of
/// it (a whole second of new messages 13.7 s, in the middle of a drain).
pub(super) const SURGE_SHARE: f64 = 1.0;
/// How fast what the gateway answered lately forgets a higher rate: by
/// this a quarter second, about a fifth in 3 s. A surge is new sends
/// arriving faster than the gateway answers when it answers at its pace;
/// a quarter second in which the answers stall (a commit waiting for the
/// disk, a paused process) with the new sends as before is not one.
/// Compared with the answers of the moment, such a stall ended the drain
/// with the base load at ~0.9 of what the box served, and the new messages
/// of the moment were booked behind the backlog (~40 s, in five runs of
/// eight on 2026-12-07). At 0.97 (a tenth a second) a slowdown of the
/// answers to below the new sends for 3 s, the phones of the backlog back
/// for their appointments, ended it in one run of two. A slowdown that
/// lasts still ends it, once the higher rate is forgotten.
const SERVED_DECAY: f64 = 0.98;
/// A drain also begins after this many windows in a row each a drain's by
/// its own counts: the smoothed rates see the end of a 1.5x surge about a
/// second after it, and the new messages read meanwhile are held behind
/// the backlog until then. One window is not enough: a surge's arrivals
/// come in bursts.
const QUIET_WINDOWS: u32 = 2;

impl Flow {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            window_start: now,
            arrived: 0,
            answered: 0,
            arrivals: 0.0,
            answers: 0.0,
            served: 0.0,
            draining: false,
            surge_seen: now,
            quiet: 0,
        }
    }

    /// A new send arrived. If the surge is seen to be over just now: where
    /// it was last seen (see [`Flow::roll`]).
    pub(super) fn arrived(&mut self, now: Instant) -> Option<Instant> {
        self.arrived = self.arrived.saturating_add(1);
        self.roll(now)
    }

    /// A send was answered; what [`Flow::arrived`] returns.
    pub(super) fn answered(&mut self, now: Instant) -> Option<Instant> {
        self.answered = self.answered.saturating_add(1);
        self.roll(now)
    }

    /// End the window if it is over; if the drain begins with it, where
    /// the backlog last grew.
    fn roll(&mut self, now: Instant) -> Option<Instant> {
        let elapsed = now.saturating_duration_since(self.window_start);
        if elapsed < PACE_WINDOW {
            return None;
        }
        let seconds = elapsed.as_secs_f64();
        let arrivals = f64::from(std::mem::take(&mut self.arrived)) / seconds;
        let answers = f64::from(std::mem::take(&mut self.answered)) / seconds;
        if arrivals < DRAIN_SHARE * answers {
            self.quiet = self.quiet.saturating_add(1);
        } else {
            self.quiet = 0;
        }
        // Not the last window that was not a drain's: after a surge, a
        // quarter second in which the answers dip looks like one, and the
        // new messages held before it were not moved ahead (p99 17 s).
        if arrivals >= SURGE_SHARE * answers {
            self.surge_seen = self.window_start;
        }
        self.arrivals += FLOW_WEIGHT * (arrivals - self.arrivals);
        self.answers += FLOW_WEIGHT * (answers - self.answers);
        self.served = self.answers.max(SERVED_DECAY * self.served);
        self.window_start = now;
        let was_draining = self.draining;
        if self.draining {
            // In this quarter second too, not only smoothed: after a 3x
            // surge the smoothed arrivals stay above the answers for a
            // second, and the drain seen by quiet windows went off and on a
            // quarter second apart.
            self.draining = arrivals.min(self.arrivals) < SURGE_SHARE * self.served;
        } else {
            self.draining =
                self.arrivals < DRAIN_SHARE * self.answers || self.quiet >= QUIET_WINDOWS;
        }
        (self.draining && !was_draining).then_some(self.surge_seen)
    }

    /// New sends arrived at less than [`DRAIN_SHARE`] of those answered
    /// (smoothed, or in each of the last [`QUIET_WINDOWS`]), and not at
    /// [`SURGE_SHARE`] of what the gateway answered lately or more (smoothed
    /// and in one window) since.
    pub(super) fn draining(&self) -> bool {
        self.draining
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `count` sends answered `every` apart, not full, then the window
    /// ends: the pace measured.
    fn serve(pace: &mut Pace, now: &mut Instant, every: Duration, count: u32) -> f64 {
        for _ in 0..count {
            *now += every;
            pace.answered(*now);
        }
        *now += PACE_WINDOW;
        pace.answered(*now);
        pace.rate.expect("a window ended")
    }

    #[test]
    fn appointments_are_paced_at_what_the_gateway_serves_while_full() {
        let mut now = Instant::now();
        let mut pace = Pace::new(now);
        // Not full, serving 4,000 a second: at least that much.
        let open = serve(&mut pace, &mut now, Duration::from_micros(250), 1000);
        assert!((3_900.0..=4_100.0).contains(&open), "{open}");
        // Full (refusing) and serving 2,000 a second: the pace comes down to
        // it within a few windows.
        for _ in 0..4000 {
            now += Duration::from_micros(500);
            pace.refused(now);
            pace.answered(now);
        }
        let full = pace.rate.unwrap();
        assert!((1_900.0..=2_150.0).contains(&full), "{full}");
        assert!(
            (pace.spacing().as_secs_f64() - 1.0 / full).abs() < 1e-9,
            "one appointment per send served"
        );
        // Windows serving less without refusing (demand fell) do not lower
        // it.
        now += PACE_WINDOW;
        pace.answered(now);
        let settled = pace.rate.unwrap();
        for _ in 0..200 {
            now += Duration::from_millis(5);
            pace.answered(now);
        }
        assert_eq!(pace.rate.unwrap(), settled);
    }

    #[test]
    fn a_stall_is_not_taken_for_the_capacity() {
        let mut now = Instant::now();
        let mut pace = Pace::new(now);
        // Serving 200 a second, not full.
        let before = serve(&mut pace, &mut now, Duration::from_millis(5), 200);
        // The database stops for 4 s: every send refused, none answered.
        // Appointments stay near the pace before it (phones refused in the
        // stall come back soon after it), not one every 100 ms.
        let stall = |pace: &mut Pace, now: &mut Instant, seconds: u64| {
            for _ in 0..seconds * 100 {
                *now += Duration::from_millis(10);
                pace.refused(*now);
            }
        };
        stall(&mut pace, &mut now, 4);
        let spacing = pace.spacing().as_secs_f64();
        assert!(spacing < 3.0 / before, "{spacing} s between appointments");
        // A long outage spreads the phones out.
        stall(&mut pace, &mut now, 30);
        assert_eq!(pace.spacing(), Duration::from_secs_f64(1.0 / PACE_MIN));
    }

    /// One quarter second of `arrived` new sends and `answered` answers,
    /// spread over it; where the backlog last grew, if a drain began in it.
    fn flow_window(
        flow: &mut Flow,
        now: &mut Instant,
        arrived: u32,
        answered: u32,
    ) -> Option<Instant> {
        let events = arrived + answered;
        let step = PACE_WINDOW / events;
        let mut began = None;
        for n in 0..events {
            *now += step;
            let drain = if n < arrived {
                flow.arrived(*now)
            } else {
                flow.answered(*now)
            };
            began = began.or(drain);
        }
        began
    }

    /// `windows` quarter seconds alike of [`flow_window`].
    fn flow_windows(
        flow: &mut Flow,
        now: &mut Instant,
        windows: usize,
        arrived: u32,
        answered: u32,
    ) {
        for _ in 0..windows {
            flow_window(flow, now, arrived, answered);
        }
    }

    /// Two seconds of a surge, `arrived` new sends per 1,000 answers a
    /// quarter second.
    fn surged(arrived: u32) -> (Flow, Instant) {
        let mut now = Instant::now();
        let mut flow = Flow::new(now);
        flow_windows(&mut flow, &mut now, 8, arrived, 1_000);
        (flow, now)
    }

    #[test]
    fn a_drain_is_not_undone_by_a_dip_only_by_a_surge() {
        // A surge: three times as many new sends as answers.
        let (mut flow, mut now) = surged(3_000);
        assert!(!flow.draining());
        // Between the shares, no drain begins.
        flow_windows(&mut flow, &mut now, 8, 950, 1_000);
        assert!(!flow.draining());
        // The surge is over: half as many new sends as answers.
        flow_windows(&mut flow, &mut now, 8, 500, 1_000);
        assert!(flow.draining());
        // The answers dip for a second (the same new sends at 0.8 of
        // them): still draining, new sends keep going first.
        flow_windows(&mut flow, &mut now, 4, 500, 625);
        assert!(flow.draining());
        // More new sends than answers: a surge again.
        flow_windows(&mut flow, &mut now, 4, 1_500, 1_000);
        assert!(!flow.draining());
    }

    /// A drain seen by quarter seconds each a drain's by its own counts
    /// holds while they last, though the smoothed arrivals still show the
    /// surge (it went off and on a quarter second apart, and the new
    /// messages of the off quarter seconds were booked behind the backlog).
    #[test]
    fn a_drain_seen_by_quiet_quarter_seconds_holds_while_they_last() {
        let (mut flow, mut now) = surged(4_000);
        let mut windows = 0;
        while !flow.draining() {
            flow_window(&mut flow, &mut now, 800, 1_000);
            windows += 1;
            // (A quarter second's counts are read at the next one's first
            // event.)
            assert!(windows <= QUIET_WINDOWS + 1, "not seen");
        }
        for _ in 0..8 {
            flow_window(&mut flow, &mut now, 800, 1_000);
            assert!(flow.draining(), "{flow:?}");
        }
    }

    /// In a slow hour the base load after a surge is ~0.9 of what the box
    /// answers, and a quarter second in which the answers stall is not a
    /// surge: the drain goes on (ended by it, the new messages of the
    /// moment were booked behind the backlog, ~40 s). Answers slower for
    /// good than the new sends do end it.
    #[test]
    fn a_stall_of_the_answers_mid_drain_is_not_a_surge() {
        let (mut flow, mut now) = surged(3_000);
        flow_windows(&mut flow, &mut now, 3, 880, 1_000);
        assert!(flow.draining());
        // A quarter second answering 400, then one answering 700, with the
        // new sends as before.
        flow_window(&mut flow, &mut now, 880, 400);
        flow_window(&mut flow, &mut now, 880, 700);
        assert!(flow.draining(), "a stall of the answers");
        flow_windows(&mut flow, &mut now, 8, 880, 1_000);
        assert!(flow.draining());
        // The box slows for good: 800 answered a quarter second.
        let mut windows = 0;
        while flow.draining() {
            flow_window(&mut flow, &mut now, 880, 800);
            windows += 1;
            assert!(windows <= 12, "still draining after three seconds");
        }
        assert!(windows >= 3, "ended after {windows} quarter seconds");
    }

    /// After a surge, new sends arriving at 0.85 of the answers (a load
    /// back below the capacity, if not far below it) are a drain: the
    /// backlog shrinks, and new messages must not wait behind it. (Seen
    /// only below 0.6 until 2026-12-06: with 0.8 C offered after a surge,
    /// new messages waited 10-15 s after 1.5x and 20-29 s after 3x.)
    #[test]
    fn a_load_just_below_the_answers_after_a_surge_is_a_drain() {
        let (mut flow, mut now) = surged(1_500);
        assert!(!flow.draining());
        flow_windows(&mut flow, &mut now, 3, 850, 1_000);
        assert!(flow.draining(), "seen within three quarter seconds");
    }

    /// The end of a 1.5x surge is seen within two quarter seconds of
    /// fewer arrivals, not after the smoothed rates come down (a second),
    /// while one quiet quarter second within a surge is not taken for its
    /// end. When it is seen, the flow says where the surge was last seen.
    #[test]
    fn the_end_of_a_surge_is_seen_within_two_quiet_windows() {
        let (mut flow, mut now) = surged(1_500);
        flow_window(&mut flow, &mut now, 400, 1_000);
        flow_window(&mut flow, &mut now, 1_500, 1_000);
        assert!(!flow.draining(), "a burst's gap is not the end");
        let last_surge_window = now;
        flow_window(&mut flow, &mut now, 1_500, 1_000);
        // After it, the answers dip for a quarter second: the backlog does
        // not grow, it is not where the surge was last seen.
        flow_window(&mut flow, &mut now, 600, 800);
        let mut began = None;
        for _ in 0..3 {
            began = began.or(flow_window(&mut flow, &mut now, 500, 1_000));
        }
        assert!(flow.draining(), "seen within three quarter seconds");
        let since = began.expect("the drain began here");
        let off = since
            .saturating_duration_since(last_surge_window)
            .max(last_surge_window.saturating_duration_since(since));
        assert!(
            off < PACE_WINDOW,
            "the surge was last seen in the window from {last_surge_window:?}, not {since:?}"
        );
    }
}
