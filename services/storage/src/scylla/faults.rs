//! Faults the store injects on purpose, for the fault tests: built only
//! with the `testing` feature, so a production build has none of it.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Faults the store injects on purpose: failing the write that publishes a
/// stored message (the history row's commit). Off unless set; only in a
/// build with the `testing` feature.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    inner: std::sync::Arc<FaultCounters>,
}

#[derive(Debug, Default)]
struct FaultCounters {
    next_commits: AtomicU64,
    commit_rate_ppm: AtomicU32,
    rolls: AtomicU64,
}

impl Faults {
    /// Fail the next `n` commits.
    pub fn fail_next_commits(&self, n: u64) {
        self.inner.next_commits.store(n, Ordering::SeqCst);
    }

    /// Fail this share of commits (0.0 to 1.0).
    pub fn fail_commits_at_rate(&self, rate: f64) {
        let ppm = (rate.clamp(0.0, 1.0) * 1_000_000.0) as u32;
        self.inner.commit_rate_ppm.store(ppm, Ordering::SeqCst);
    }

    /// Whether this commit is to fail.
    pub(super) fn commit_fails(&self) -> bool {
        let counters = &self.inner;
        let counted = counters
            .next_commits
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let ppm = u64::from(counters.commit_rate_ppm.load(Ordering::Relaxed));
        // A cheap, evenly spread sequence: every (1e6 / ppm)-th commit.
        let roll = counters.rolls.fetch_add(1, Ordering::Relaxed);
        counted || (ppm > 0 && (roll.wrapping_mul(ppm) % 1_000_000) < ppm)
    }
}
