//! How many requests a [`super::StreamHop`] keeps unanswered: fixed, or
//! adaptive (AIMD, as TCP's congestion window) when the server's answers
//! can say it is overloaded ([`super::HopCall::is_pushback`]).
//!
//! The adaptive window starts small and grows only while it is used (every
//! place taken when an answer comes back): by one per good answer up to the
//! size it was last cut to (slow start, so a busy hop finds its size within
//! a few round trips), by one per window's worth of good answers beyond it.
//! A pushback answer to a request sent after the last cut halves it, down
//! to its floor; answers to requests sent before the cut say nothing new.
//! Requests beyond the window wait in the caller's process, bounded by
//! their callers' deadlines, rather than at a server that would refuse
//! them. A pushback while the window is already at its floor (the server
//! refuses even the fewest, as one whose database is out of reach does at
//! once) also stops new requests for `rest`: a fast refusal would otherwise
//! free its place at once, and the window would hold nothing back.

use std::time::Duration;

/// The window's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowLimits {
    /// Requests unanswered allowed at start.
    pub initial: usize,
    /// Pushback never takes the window below this.
    pub min: usize,
    /// The window never grows above this.
    pub max: usize,
    /// How long to send nothing more after a pushback at the floor.
    pub rest: Duration,
}

impl WindowLimits {
    /// A window that stays at `size`.
    pub fn fixed(size: usize) -> Self {
        Self {
            initial: size,
            min: size,
            max: size,
            rest: Duration::ZERO,
        }
    }
}

#[derive(Debug)]
pub(super) struct Window {
    size: f64,
    min: f64,
    max: f64,
    /// Slow start below this.
    threshold: f64,
    /// The last tag sent when the window was last cut.
    cut_at: u64,
    rest: Duration,
}

impl Window {
    pub(super) fn new(limits: WindowLimits) -> Self {
        let max = limits.max.max(1) as f64;
        let min = (limits.min.max(1) as f64).min(max);
        Self {
            size: (limits.initial as f64).clamp(min, max),
            min,
            max,
            threshold: max,
            cut_at: 0,
            rest: limits.rest,
        }
    }

    /// Whether one more request may go with `in_flight` unanswered.
    pub(super) fn has_room(&self, in_flight: usize) -> bool {
        in_flight < self.places()
    }

    /// The window's size: how many requests may be unanswered.
    pub(super) fn places(&self) -> usize {
        self.size as usize
    }

    /// A good answer came back while `in_flight` were unanswered (itself
    /// included).
    pub(super) fn answered(&mut self, in_flight: usize) {
        if in_flight < self.places() {
            // Not every place was taken: nothing says it is too small.
            return;
        }
        let step = if self.size < self.threshold {
            1.0
        } else {
            1.0 / self.size
        };
        self.size = (self.size + step).min(self.max);
    }

    /// A pushback answer to the request tagged `tag`; `last_sent` is the
    /// newest tag sent. Returns how long to send nothing more, if at all.
    pub(super) fn pushed_back(&mut self, tag: u64, last_sent: u64) -> Option<Duration> {
        let at_floor = self.size <= self.min;
        if tag > self.cut_at {
            self.size = (self.size / 2.0).max(self.min);
            self.threshold = self.size;
            self.cut_at = last_sent;
        }
        (at_floor && !self.rest.is_zero()).then_some(self.rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adaptive() -> Window {
        Window::new(WindowLimits {
            initial: 64,
            min: 16,
            max: 1024,
            rest: Duration::from_millis(250),
        })
    }

    #[test]
    fn a_fixed_window_stays_at_its_size() {
        let mut window = Window::new(WindowLimits::fixed(8));
        for tag in 1..100 {
            window.answered(8);
            assert_eq!(window.pushed_back(tag, tag), None);
        }
        assert!(window.has_room(7));
        assert!(!window.has_room(8));
    }

    #[test]
    fn it_grows_only_while_every_place_is_taken() {
        let mut window = adaptive();
        for _ in 0..1000 {
            window.answered(10);
        }
        assert!(
            !window.has_room(64),
            "a hop using 10 of 64 places kept growing"
        );
        // Used: slow start, one place per good answer.
        for _ in 0..36 {
            window.answered(window.places());
        }
        assert_eq!(window.places(), 100);
        for _ in 0..10_000 {
            window.answered(window.places());
        }
        assert_eq!(window.places(), 1024, "capped at its most");
    }

    #[test]
    fn pushback_halves_it_once_per_round_trip_down_to_its_floor() {
        let mut window = adaptive();
        // Requests 1..=64 are out; the first refusals cut it once.
        assert_eq!(window.pushed_back(3, 64), None);
        window.pushed_back(5, 64);
        window.pushed_back(64, 64);
        assert_eq!(window.places(), 32);
        // A refusal of a request sent after the cut cuts again.
        assert_eq!(window.pushed_back(65, 80), None);
        assert_eq!(window.places(), 16);
        // At the floor, every refusal (even of a request sent before the
        // last cut) says to rest.
        assert_eq!(window.pushed_back(81, 90), Some(Duration::from_millis(250)));
        assert_eq!(window.places(), 16, "not below its floor");
        assert_eq!(window.pushed_back(70, 90), Some(Duration::from_millis(250)));
    }

    #[test]
    fn after_a_cut_it_grows_by_about_one_per_window_of_good_answers() {
        let mut window = adaptive();
        window.pushed_back(1, 64);
        assert_eq!(window.places(), 32);
        for _ in 0..32 {
            window.answered(window.places());
        }
        assert_eq!(window.places(), 32, "{window:?}");
        for _ in 0..32 {
            window.answered(window.places());
        }
        assert_eq!(window.places(), 33, "{window:?}");
    }
}
