//! Search mode: the highest offered rate the system sustains with its p99
//! ACK latency under a bound.
//!
//! Each step offers one rate for a fixed time (open loop, as `steady`) and
//! audits the result. A step is *sustained* when its p99 is within the bound,
//! no message failed for good and the audit passed. Rates are bisected on a
//! log scale between `min` and `max` until the bracket is within `precision`.
//! An overloaded open-loop step cannot hide: its queue, and so its p99, grows
//! for as long as it runs.

use serde::Serialize;

use crate::report::Report;

/// How one step went.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub offered_rate: f64,
    pub achieved_rate: f64,
    pub p99_ms: f64,
    pub failed: u64,
    pub errors: u64,
    pub audit_passed: bool,
    pub sustained: bool,
}

impl Step {
    /// Judge a step's report against the p99 bound.
    /// `sustained` or `not sustained`, for progress lines.
    pub fn verdict(&self) -> &'static str {
        if self.sustained {
            "sustained"
        } else {
            "not sustained"
        }
    }

    pub fn judge(report: &Report, audit_passed: bool, p99_bound_ms: f64) -> Self {
        let failed = report.audit.failed;
        let sustained = sustains(
            report.ack_latency.p99_ms,
            failed,
            audit_passed,
            p99_bound_ms,
        );
        Self {
            offered_rate: report.offered_rate,
            achieved_rate: report.achieved_rate,
            p99_ms: report.ack_latency.p99_ms,
            failed,
            errors: report.outcomes.errors.values().sum(),
            audit_passed,
            sustained,
        }
    }
}

/// Whether a step with this p99, this many messages failed for good and this
/// audit verdict sustained its rate.
fn sustains(p99_ms: f64, failed: u64, audit_passed: bool, p99_bound_ms: f64) -> bool {
    audit_passed && failed == 0 && p99_ms <= p99_bound_ms
}

/// The bisection over rates.
#[derive(Debug, Clone, Serialize)]
pub struct Search {
    pub min_rate: f64,
    pub max_rate: f64,
    /// Stop when the failing rate is within this fraction of the sustained one.
    pub precision: f64,
    pub p99_bound_ms: f64,
    /// Highest sustained rate so far.
    pub sustained: Option<f64>,
    /// Lowest unsustained rate so far.
    pub unsustained: Option<f64>,
    pub steps: Vec<Step>,
}

impl Search {
    pub fn new(min_rate: f64, max_rate: f64, precision: f64, p99_bound_ms: f64) -> Self {
        Self {
            min_rate,
            max_rate: max_rate.max(min_rate),
            precision: precision.max(0.001),
            p99_bound_ms,
            sustained: None,
            unsustained: None,
            steps: Vec::new(),
        }
    }

    /// The next rate to try, or `None` when the search is over.
    pub fn next_rate(&self) -> Option<f64> {
        let low = self.sustained.unwrap_or(self.min_rate);
        let high = self.unsustained.unwrap_or(self.max_rate);
        match (self.sustained, self.unsustained) {
            // Even the floor fails, or the ceiling holds: nothing to bisect.
            (None, Some(failed)) if failed <= self.min_rate => None,
            (Some(held), None) if held >= self.max_rate => None,
            // Try the ends first, so a result at either is exact.
            (None, None) => Some(self.max_rate),
            (None, Some(_)) if self.steps.len() == 1 => Some(self.min_rate),
            _ if high <= low * (1.0 + self.precision) => None,
            _ => Some((low * high).sqrt().round()),
        }
    }

    pub fn record(&mut self, step: Step) {
        let rate = step.offered_rate;
        if step.sustained {
            self.sustained = Some(self.sustained.map_or(rate, |r| r.max(rate)));
        } else {
            self.unsustained = Some(self.unsustained.map_or(rate, |r| r.min(rate)));
        }
        self.steps.push(step);
    }

    /// A table of the steps and the answer.
    pub fn render(&self) -> String {
        let mut out = format!(
            "search: highest rate with p99 ACK latency <= {} ms\n  {:>9}  {:>9}  {:>10}  {:>6}  {:>6}  {}\n",
            self.p99_bound_ms, "offered/s", "achieved", "p99 ms", "failed", "errors", "verdict"
        );
        for step in &self.steps {
            out.push_str(&format!(
                "  {:>9.0}  {:>9.0}  {:>10.2}  {:>6}  {:>6}  {}\n",
                step.offered_rate,
                step.achieved_rate,
                step.p99_ms,
                step.failed,
                step.errors,
                if step.sustained {
                    "sustained"
                } else if !step.audit_passed {
                    "AUDIT FAILED"
                } else {
                    "not sustained"
                }
            ));
        }
        match self.sustained {
            Some(rate) => out.push_str(&format!("highest sustained rate: {rate:.0} messages/s\n")),
            None => out.push_str(&format!(
                "not even {:.0} messages/s was sustained\n",
                self.min_rate
            )),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(rate: f64, sustained: bool) -> Step {
        Step {
            offered_rate: rate,
            achieved_rate: rate,
            p99_ms: if sustained { 5.0 } else { 500.0 },
            failed: 0,
            errors: 0,
            audit_passed: true,
            sustained,
        }
    }

    /// Run a search against a system that sustains up to `capacity`.
    fn search(capacity: f64) -> Search {
        let mut search = Search::new(1000.0, 32_000.0, 0.05, 25.0);
        let mut guard = 0;
        while let Some(rate) = search.next_rate() {
            search.record(step(rate, rate <= capacity));
            guard += 1;
            assert!(guard < 30, "the search does not end: {:?}", search.steps);
        }
        search
    }

    #[test]
    fn finds_the_capacity_within_its_precision() {
        for capacity in [1500.0, 4_400.0, 12_345.0, 20_000.0] {
            let found = search(capacity).sustained.unwrap();
            assert!(
                found <= capacity,
                "{found} is above the capacity {capacity}"
            );
            assert!(
                found >= capacity / 1.05 - 1.0,
                "{found} is too far below the capacity {capacity}"
            );
        }
    }

    #[test]
    fn a_system_that_holds_the_ceiling_is_probed_once() {
        let search = search(100_000.0);
        assert_eq!(search.steps.len(), 1);
        assert_eq!(search.sustained, Some(32_000.0));
    }

    #[test]
    fn a_system_that_fails_the_floor_has_no_answer() {
        let search = search(10.0);
        assert_eq!(search.sustained, None);
        assert_eq!(search.steps.len(), 2);
    }

    #[test]
    fn a_step_is_sustained_only_when_fast_complete_and_clean() {
        assert!(sustains(24.9, 0, true, 25.0));
        assert!(!sustains(25.1, 0, true, 25.0), "too slow");
        assert!(!sustains(5.0, 1, true, 25.0), "a message failed");
        assert!(!sustains(5.0, 0, false, 25.0), "the audit failed");
    }
}
