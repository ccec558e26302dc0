//! A small circuit breaker: after `threshold` failures in a row it opens for
//! `cooldown`, during which callers skip the backend at once; then one call
//! is let through to probe, and a success closes it again. After closing, the
//! backend warms up: over `warmup` the share of callers let through grows
//! from a tenth to all, so a backend that just came back is not hit by
//! everyone at once.

use std::{
    sync::{
        Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

#[derive(Debug)]
pub struct Breaker {
    threshold: u32,
    cooldown: Duration,
    failures: AtomicU32,
    open_until: Mutex<Option<Instant>>,
    warmup: Duration,
    /// When the breaker last closed after being open.
    closed_at: Mutex<Option<Instant>>,
    /// Calls asked during the warm-up, to let a steady share through.
    warming_calls: AtomicU32,
}

/// The share of callers let through at the start of a warm-up.
const FIRST_SHARE: f64 = 0.1;

impl Breaker {
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            cooldown,
            failures: AtomicU32::new(0),
            open_until: Mutex::new(None),
            warmup: Duration::ZERO,
            closed_at: Mutex::new(None),
            warming_calls: AtomicU32::new(0),
        }
    }

    /// Warm up over `warmup` after closing.
    pub fn with_warmup(mut self, warmup: Duration) -> Self {
        self.warmup = warmup;
        self
    }

    /// During a warm-up, whether this caller may use the backend (a share
    /// growing with the time since the breaker closed); always `true`
    /// otherwise.
    pub fn warmed_for(&self, now: Instant) -> bool {
        let mut closed_at = self.closed_at.lock().unwrap_or_else(|p| p.into_inner());
        let Some(since) = *closed_at else {
            return true;
        };
        let elapsed = now.saturating_duration_since(since);
        if elapsed >= self.warmup {
            *closed_at = None;
            return true;
        }
        let share = (elapsed.as_secs_f64() / self.warmup.as_secs_f64()).max(FIRST_SHARE);
        // Of every 100 calls, the first `share` go: an even spread, no dice.
        let slot = self.warming_calls.fetch_add(1, Ordering::Relaxed) % 100;
        f64::from(slot + 1) <= share * 100.0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.open_until.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a call may go to the backend now. While open, `false`; when
    /// the cooldown is over, one caller gets `true` to probe, and the breaker
    /// stays open for the others until that probe reports.
    pub fn allow(&self, now: Instant) -> bool {
        let mut open_until = self.lock();
        match *open_until {
            None => true,
            Some(until) if now >= until => {
                // Half-open: let this caller probe; hold the rest back.
                *open_until = Some(now + self.cooldown);
                true
            }
            Some(_) => false,
        }
    }

    pub fn is_open(&self) -> bool {
        self.lock().is_some()
    }

    pub fn success(&self) {
        self.failures.store(0, Ordering::Relaxed);
        let was_open = self.lock().take().is_some();
        if was_open && !self.warmup.is_zero() {
            *self.closed_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
            self.warming_calls.store(0, Ordering::Relaxed);
        }
    }

    pub fn failure(&self, now: Instant) {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= self.threshold {
            *self.lock() = Some(now + self.cooldown);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_the_threshold_probes_after_the_cooldown_and_closes_on_success() {
        let breaker = Breaker::new(3, Duration::from_secs(1));
        let t0 = Instant::now();
        for _ in 0..2 {
            breaker.failure(t0);
        }
        assert!(breaker.allow(t0), "below the threshold it stays closed");
        breaker.failure(t0);
        assert!(!breaker.allow(t0), "open after three failures in a row");
        let later = t0 + Duration::from_millis(1001);
        assert!(breaker.allow(later), "one probe after the cooldown");
        assert!(!breaker.allow(later), "only one probe at a time");
        breaker.success();
        assert!(breaker.allow(later));
        assert!(!breaker.is_open());
    }

    #[test]
    fn a_backend_back_from_an_outage_gets_a_growing_share_of_the_calls() {
        let breaker =
            Breaker::new(1, Duration::from_millis(1)).with_warmup(Duration::from_secs(10));
        let share = |at: Instant| (0..1000).filter(|_| breaker.warmed_for(at)).count();
        assert_eq!(share(Instant::now()), 1000, "no outage, no warm-up");
        breaker.failure(Instant::now());
        assert!(breaker.is_open());
        breaker.success();
        let closed = Instant::now();
        assert_eq!(share(closed), 100, "a tenth at first");
        assert_eq!(
            share(closed + Duration::from_secs(5)),
            500,
            "half way: half"
        );
        assert_eq!(
            share(closed + Duration::from_secs(10)),
            1000,
            "then everyone"
        );
        assert_eq!(
            share(closed + Duration::from_secs(1)),
            1000,
            "and it stays over"
        );
    }
}
