//! A small circuit breaker: after `threshold` failures in a row it opens for
//! `cooldown`, during which callers skip the backend at once; then one call
//! is let through to probe, and a success closes it again.

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
}

impl Breaker {
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            cooldown,
            failures: AtomicU32::new(0),
            open_until: Mutex::new(None),
        }
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
        *self.lock() = None;
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
}
