//! Client-side adaptive throttling, as the Google SRE book describes it
//! ("Handling Overload"): a phone that sees the gateway refuse much of what
//! it sends holds some of its new sends back itself, so that a gateway past
//! its capacity is not also made to read, decode and refuse them.
//!
//! Over the last few seconds the phone counts its *requests* (every send it
//! wanted to make, held back or not, once however often it is held back)
//! and the sends the gateway *accepted*
//! (sent and not answered `overloaded`; a `queued` send is accepted). A new
//! send is held back with probability
//!
//! ```text
//! max(0, (requests − k × accepted) / (requests + 1))
//! ```
//!
//! While the gateway accepts everything, that is 0. When it refuses, the
//! sends that reach it settle near `k` times what it accepts: `k = 2` (the
//! book's value) lets it refuse at most about half of what it reads.
//! Counting the held-back sends as requests keeps a trickle of sends
//! reaching the gateway, so the phone notices when it accepts again.
//!
//! That trickle alone lets go slowly: with the held-back sends counted,
//! what the phone sends can only double per window (the counts of the
//! window before shrink the chance by `1 - k × sent / requests`), so a
//! phone that saw nearly every send refused would need four or five
//! windows, 10-15 s, to send freely again, while the gateway sat idle: a
//! database stall that ends leaves the phones throttling long after it.
//! So the throttle holds back only while the gateway's last refusal asked
//! to wait (its `retry_after_ms`, at least [`MIN_WAIT`]): once that time has
//! passed with no refusal since, every send goes, and the next refusal
//! brings the counts, which still cover the last seconds, back into play.
//!
//! A phone keeps two such throttles ([`Throttles`]): one over all its
//! sends, which decides for its old messages, and one over its fresh
//! messages only ([`FRESH_FOR`](imdedup_proto::FRESH_FOR)), which decides
//! for those. After a surge the gateway serves new messages ahead of its
//! backlog while it still refuses the backlog's: a phone's old messages
//! come back for their appointments and are booked again. Counted with
//! its new messages, those refusals kept the phone holding back a quarter
//! of its new messages for 1-4 s through the ten seconds after a 3x
//! surge, when the gateway refused almost none of them (the p99 of new
//! messages 3.4-4.3 s, each one's steps read with the load driver's
//! `--events`). Old messages keep the throttle over all sends, so the
//! backlog's phones still hold back what the gateway would refuse (old
//! messages by counts of their own, tried, held back no more of them and
//! made the new ones slower).

use std::time::{Duration, Instant};

/// A phone's throttles: over all its sends, and over its fresh messages
/// (see the module docs). Every send is counted in the first; a fresh one
/// in the second too, which alone decides whether it is held back.
#[derive(Debug)]
pub(crate) struct Throttles {
    all: Throttle,
    fresh: Throttle,
}

impl Throttles {
    pub(crate) fn new(k: f64, now: Instant) -> Self {
        Self {
            all: Throttle::new(k, now),
            fresh: Throttle::new(k, now),
        }
    }

    /// [`Throttle::hold_back`] for a send of a message `fresh` or not.
    pub(crate) fn hold_back(&mut self, now: Instant, draw: f64, again: bool, fresh: bool) -> bool {
        if !fresh {
            return self.all.hold_back(now, draw, again);
        }
        let held = self.fresh.hold_back(now, draw, again);
        self.all.count(now, again, held);
        held
    }

    /// [`Throttle::refused`], for a send of a message `fresh` or not.
    pub(crate) fn refused(&mut self, now: Instant, hint: Option<Duration>, fresh: bool) {
        self.all.refused(now, hint);
        if fresh {
            self.fresh.refused(now, hint);
        }
    }

    /// [`Throttle::wait`] of the throttle that held back a send of a message
    /// `fresh` or not.
    pub(crate) fn wait(&self, now: Instant, stretch: f64, fresh: bool) -> Duration {
        if fresh {
            self.fresh.wait(now, stretch)
        } else {
            self.all.wait(now, stretch)
        }
    }
}

/// The counts cover two buckets of this length: the current one and the
/// one before it. Short, because a phone must notice a surge within a few
/// seconds (the book's 2 minutes suit a server's steady stream of calls).
const BUCKET: Duration = Duration::from_secs(2);

/// A send held back is tried again soon: after what is left of the wait
/// the gateway last asked for, but never more than this, stretched by ±50%
/// so that the sends held back together do not come back together. Trying
/// again is the phone's own decision, which costs no frame, while a wait
/// as long as the gateway's appointments (up to 20 s at the end of a 3x
/// surge) outlived the surge: new messages held back in its last seconds
/// waited 20-30 s while the gateway served new sends in 60 ms. Also the
/// hold-back's own duration when a refusal asked for no wait.
const DEFAULT_WAIT: Duration = Duration::from_secs(1);
const MIN_WAIT: Duration = Duration::from_millis(200);

#[derive(Debug)]
pub(crate) struct Throttle {
    k: f64,
    bucket_started: Instant,
    current: Tally,
    previous: Tally,
    /// When the gateway's last `overloaded` answer asked to come back.
    come_back_at: Option<Instant>,
    /// Until when the last `overloaded` answer holds sends back: its wait,
    /// or [`DEFAULT_WAIT`] without one, at least [`MIN_WAIT`].
    holding_until: Option<Instant>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    /// Sends wanted, held back or not.
    requests: u64,
    /// Sends written to the gateway.
    sent: u64,
    /// Sends answered `overloaded`.
    refused: u64,
}

impl Throttle {
    pub(crate) fn new(k: f64, now: Instant) -> Self {
        Self {
            k,
            bucket_started: now,
            current: Tally::default(),
            previous: Tally::default(),
            come_back_at: None,
            holding_until: None,
        }
    }

    /// A send is wanted: whether to hold it back (`draw` is uniform in
    /// [0, 1)). Counted either way, as a request only the first time:
    /// `again` is a send held back before and tried again, and counting
    /// each try would raise the chance with every wait a held-back send
    /// sits out, holding sends back long after the gateway accepts again.
    pub(crate) fn hold_back(&mut self, now: Instant, draw: f64, again: bool) -> bool {
        self.rotate(now);
        let held = draw < self.chance(now);
        self.count(now, again, held);
        held
    }

    /// Count a send wanted (a request unless `again`), and sent unless
    /// `held`.
    fn count(&mut self, now: Instant, again: bool, held: bool) {
        self.rotate(now);
        if !again {
            self.current.requests += 1;
        }
        if !held {
            self.current.sent += 1;
        }
    }

    /// The gateway answered a send `overloaded`, asking to wait `hint`.
    pub(crate) fn refused(&mut self, now: Instant, hint: Option<Duration>) {
        self.rotate(now);
        self.current.refused += 1;
        if let Some(hint) = hint {
            self.come_back_at = Some(now + hint);
        }
        self.holding_until = Some(now + hint.unwrap_or(DEFAULT_WAIT).max(MIN_WAIT));
    }

    /// How long a send held back now waits before it is tried again
    /// (`stretch` is uniform in [0.5, 1.5]): see [`DEFAULT_WAIT`].
    pub(crate) fn wait(&self, now: Instant, stretch: f64) -> Duration {
        self.come_back_at
            .map(|at| at.saturating_duration_since(now))
            .filter(|left| !left.is_zero())
            .map_or(DEFAULT_WAIT, |left| left.min(DEFAULT_WAIT))
            .mul_f64(stretch)
            .max(MIN_WAIT)
    }

    /// The chance that a new send is held back now: none once the last
    /// refusal's wait has run out.
    fn chance(&self, now: Instant) -> f64 {
        if self.holding_until.is_none_or(|until| now >= until) {
            return 0.0;
        }
        let requests = (self.current.requests + self.previous.requests) as f64;
        let sent = self.current.sent + self.previous.sent;
        let refused = self.current.refused + self.previous.refused;
        let accepted = sent.saturating_sub(refused) as f64;
        ((requests - self.k * accepted) / (requests + 1.0)).max(0.0)
    }

    fn rotate(&mut self, now: Instant) {
        let age = now.saturating_duration_since(self.bucket_started);
        if age >= 2 * BUCKET {
            self.previous = Tally::default();
            self.current = Tally::default();
            self.bucket_started = now;
        } else if age >= BUCKET {
            self.previous = std::mem::take(&mut self.current);
            self.bucket_started += BUCKET;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `i`th of a phone's draws, spread evenly over [0, 1).
    fn draw(i: u32) -> f64 {
        (f64::from(i) * 0.618_033_988_7).fract()
    }

    /// A hundred sends of messages `fresh` or not, every one the phone
    /// writes refused with `hint`.
    fn all_refused(throttles: &mut Throttles, now: Instant, fresh: bool, hint: Duration) {
        for i in 0..100 {
            if !throttles.hold_back(now, draw(i), false, fresh) {
                throttles.refused(now, Some(hint), fresh);
            }
        }
    }

    /// Of a hundred sends of messages `fresh` or not, how many are held
    /// back.
    fn held_of_100(throttles: &mut Throttles, now: Instant, fresh: bool) -> usize {
        (0..100)
            .filter(|&i| throttles.hold_back(now, draw(i), false, fresh))
            .count()
    }

    /// The phone wants `n` sends (draws spread evenly over [0, 1)); the
    /// gateway accepts the first `accepts` it reads and refuses the rest,
    /// asking each to come back after `hint`. How many reached it.
    fn round_hinted(
        throttle: &mut Throttle,
        now: Instant,
        n: u32,
        accepts: u32,
        hint: Duration,
    ) -> u32 {
        let mut sent = 0;
        for i in 0..n {
            if !throttle.hold_back(now, draw(i), false) {
                sent += 1;
                if sent > accepts {
                    throttle.refused(now, Some(hint));
                }
            }
        }
        sent
    }

    /// [`round_hinted`] with the waits of a lasting overload: appointments
    /// a few seconds ahead.
    fn round(throttle: &mut Throttle, now: Instant, n: u32, accepts: u32) -> u32 {
        round_hinted(throttle, now, n, accepts, Duration::from_secs(3))
    }

    /// The gateway accepts everything, or nothing.
    const ALL: u32 = u32::MAX;
    const NONE: u32 = 0;

    #[test]
    fn a_gateway_that_accepts_everything_gets_every_send() {
        let start = Instant::now();
        let mut throttle = Throttle::new(2.0, start);
        for second in 0..30 {
            let now = start + Duration::from_secs(second);
            assert_eq!(round(&mut throttle, now, 100, ALL), 100, "second {second}");
        }
    }

    #[test]
    fn a_gateway_that_refuses_most_sends_reads_about_k_times_what_it_accepts() {
        let start = Instant::now();
        let mut throttle = Throttle::new(2.0, start);
        // It accepts 10 sends a second and refuses the rest; the phone
        // wants to send 100.
        let mut reached = Vec::new();
        for second in 0..20 {
            let now = start + Duration::from_secs(second);
            reached.push(round(&mut throttle, now, 100, 10));
        }
        // Without the throttle it would read 100 a second; once the counts
        // cover the overload it reads about k x 10.
        let settled = &reached[10..];
        let mean = settled.iter().sum::<u32>() as f64 / settled.len() as f64;
        assert!((15.0..=30.0).contains(&mean), "{reached:?}");
    }

    #[test]
    fn sends_flow_again_once_the_refusals_are_out_of_the_window() {
        let start = Instant::now();
        let mut throttle = Throttle::new(2.0, start);
        // Every send refused: once that shows, most are held back.
        let sent = round(&mut throttle, start, 100, NONE);
        assert!(sent < 50, "sent {sent} of 100");
        // Two buckets later the refusals no longer count.
        let later = start + 2 * BUCKET + Duration::from_secs(1);
        assert_eq!(round(&mut throttle, later, 100, ALL), 100);
    }

    #[test]
    fn sends_flow_again_once_the_last_refusals_wait_has_run_out() {
        // A stalled database: every send refused for a second, each asked
        // to come back in 500 ms.
        let start = Instant::now();
        let mut throttle = Throttle::new(2.0, start);
        let hint = Duration::from_millis(500);
        assert!(round_hinted(&mut throttle, start, 100, NONE, hint) < 50);
        // While that wait runs, most sends are held back.
        let waiting = start + Duration::from_millis(300);
        assert!(round_hinted(&mut throttle, waiting, 100, NONE, hint) < 20);
        // Once it has run out every send goes, though the refusals are
        // still in the counts (without this rule only about 10 of 100
        // would).
        let after = waiting + Duration::from_millis(600);
        assert!(after < start + BUCKET);
        assert_eq!(round_hinted(&mut throttle, after, 100, ALL, hint), 100);
    }

    #[test]
    fn a_refusal_after_a_pause_brings_the_counts_back_at_once() {
        let start = Instant::now();
        let mut throttle = Throttle::new(2.0, start);
        let hint = Duration::from_millis(500);
        round_hinted(&mut throttle, start, 100, NONE, hint);
        // Past the wait, the gateway refuses again: the next sends are held
        // back at the chance the counts give, not from zero.
        let after = start + Duration::from_secs(1);
        let sent = round_hinted(&mut throttle, after, 100, NONE, hint);
        assert!(sent < 10, "sent {sent} of 100");
    }

    #[test]
    fn a_send_held_back_is_tried_again_within_about_a_second() {
        let start = Instant::now();
        let mut throttle = Throttle::new(2.0, start);
        assert_eq!(throttle.wait(start, 1.0), DEFAULT_WAIT);
        // A gateway booking appointments 8 s out: the phone asks its
        // throttle again within a second (±50%), not after 8 s.
        throttle.refused(start, Some(Duration::from_secs(8)));
        assert_eq!(throttle.wait(start, 0.5), DEFAULT_WAIT / 2);
        assert_eq!(throttle.wait(start, 1.5), DEFAULT_WAIT.mul_f64(1.5));
        // Less than that left of the wait asked for: what is left.
        let later = start + Duration::from_millis(7_600);
        assert_eq!(throttle.wait(later, 1.0), Duration::from_millis(400));
        // Once its time has passed, the default.
        let past = start + Duration::from_secs(9);
        assert_eq!(throttle.wait(past, 1.0), DEFAULT_WAIT);
        // Never shorter than the floor.
        throttle.refused(start, Some(Duration::from_millis(10)));
        assert_eq!(throttle.wait(start, 0.5), MIN_WAIT);
        throttle.refused(start, Some(Duration::ZERO));
        assert_eq!(throttle.wait(start, 1.0), DEFAULT_WAIT);
    }

    /// After a surge the gateway refuses a phone's old messages (back for
    /// their appointments and booked again) while it takes the new ones
    /// ahead of its backlog.
    #[test]
    fn refusals_of_old_messages_hold_back_old_messages_only() {
        let start = Instant::now();
        let mut throttles = Throttles::new(2.0, start);
        all_refused(&mut throttles, start, false, Duration::from_secs(20));
        let now = start + Duration::from_millis(500);
        let old_held = held_of_100(&mut throttles, now, false);
        assert!(old_held > 90, "{old_held} of 100 old messages held back");
        assert_eq!(held_of_100(&mut throttles, now, true), 0);
    }

    /// While the gateway refuses new messages (a surge), they are held back,
    /// and the count over all sends sees those refusals too.
    #[test]
    fn refusals_of_fresh_messages_hold_back_fresh_and_old_messages() {
        let start = Instant::now();
        let mut throttles = Throttles::new(2.0, start);
        all_refused(&mut throttles, start, true, Duration::from_secs(3));
        let now = start + Duration::from_millis(500);
        for fresh in [true, false] {
            let held = held_of_100(&mut throttles, now, fresh);
            assert!(held > 50, "{held} of 100 held back (fresh: {fresh})");
        }
        // Each waits what is left of its own throttle's last wait asked for.
        assert_eq!(
            throttles.wait(start + Duration::from_millis(2_600), 1.0, true),
            Duration::from_millis(400)
        );
    }

    #[test]
    fn a_send_held_back_again_is_not_a_new_request() {
        let start = Instant::now();
        let counted_once = &mut Throttle::new(2.0, start);
        let counted_each_time = &mut Throttle::new(2.0, start);
        for throttle in [&mut *counted_once, &mut *counted_each_time] {
            round(throttle, start, 100, 10);
        }
        let before = counted_once.chance(start);
        assert!(before > 0.0);
        // The held-back sends are tried again (and held back again) ten
        // times each while the gateway's wait runs.
        let later = start + Duration::from_millis(500);
        for _ in 0..10 {
            for _ in 0..50 {
                counted_once.hold_back(later, 0.0, true);
                counted_each_time.hold_back(later, 0.0, false);
            }
        }
        assert_eq!(counted_once.chance(later), before);
        assert!(counted_each_time.chance(later) > before);
    }
}
