//! Time as the window and tokens see it, so tests and the demo can move it by
//! hand (a resend "an hour later") without sleeping.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

/// A source of monotonic and wall-clock time.
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> Instant;
    fn unix_seconds(&self) -> u64;
}

/// The real clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn unix_seconds(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    }
}

/// The real clock plus an offset that only moves forward when told to.
#[derive(Debug, Default, Clone)]
pub struct ManualClock {
    offset_nanos: Arc<AtomicU64>,
}

impl ManualClock {
    pub fn new() -> Self {
        Self::default()
    }

    /// Move time forward by `by`.
    pub fn advance(&self, by: Duration) {
        let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.offset_nanos.fetch_add(nanos, Ordering::SeqCst);
    }

    fn offset(&self) -> Duration {
        Duration::from_nanos(self.offset_nanos.load(Ordering::SeqCst))
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        Instant::now() + self.offset()
    }

    fn unix_seconds(&self) -> u64 {
        SystemClock.unix_seconds() + self.offset().as_secs()
    }
}

/// A shared clock handle.
pub type SharedClock = Arc<dyn Clock>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_forward_by_what_it_is_told() {
        let clock = ManualClock::new();
        let before = clock.now();
        clock.advance(Duration::from_secs(3600));
        let after = clock.now();
        assert!(after.duration_since(before) >= Duration::from_secs(3600));
        assert!(clock.unix_seconds() >= SystemClock.unix_seconds() + 3599);
    }
}
