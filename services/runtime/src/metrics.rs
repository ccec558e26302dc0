//! What the Prometheus metrics of every service share: the registry, the
//! duration buckets, the label sets, the ingest's shard label, gauges held
//! while something is in progress, and the exposition text. Each service's
//! own metrics live in that service (`imdedup_gateway::metrics`,
//! `imdedup_ingest::metrics`, `imdedup_storage::metrics`).
//!
//! Names, types and labels are a contract with the dashboards and alert
//! rules: counters end in `_total` (prometheus-client appends it), durations
//! are histograms in seconds with [`DURATION_BUCKETS`], and no label ever
//! carries a user, conversation or message id.
//!
//! Each struct is cheap to clone (the metrics inside are shared handles).
//! `Default` gives metrics that count but are registered nowhere, for tests
//! and callers that do not expose them; `register` puts them in a registry.
//! The ingest's `shard` label comes from the registry: register its metrics
//! in [`shard_registry`].

use std::borrow::Cow;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{family::Family, gauge::Gauge, histogram::Histogram},
};

use imdedup_domain::{ErrorKind, model::Outcome};

/// The registry every service exposes on `/metrics`.
pub use prometheus_client::registry::Registry;

/// Histogram buckets of every duration, in seconds.
pub const DURATION_BUCKETS: [f64; 13] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

pub fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}

pub type Durations<L> = Family<L, Histogram, fn() -> Histogram>;

pub fn durations<L: Clone + std::hash::Hash + Eq>() -> Durations<L> {
    Family::new_with_constructor(duration_histogram)
}

/// The registry for one ingest shard: every series registered in it carries
/// `shard="<name>"`.
pub fn shard_registry<'a>(registry: &'a mut Registry, shard: &str) -> &'a mut Registry {
    registry.sub_registry_with_label((Cow::Borrowed("shard"), Cow::Owned(shard.to_owned())))
}

/// The `outcome` label of a decided or answered send: the ACK's outcome, or
/// `rejected` for a final error (the request itself is wrong) and `failed`
/// for a retryable one.
pub fn outcome_label(result: Result<Outcome, ErrorKind>) -> &'static str {
    match result {
        Ok(outcome) => outcome.as_str(),
        Err(kind) if kind.retryable() => "failed",
        Err(_) => "rejected",
    }
}

/// Every `outcome` label value of the sends counters.
pub const OUTCOMES: [&str; 5] = [
    "stored",
    "duplicate_window",
    "duplicate_unique_key",
    "rejected",
    "failed",
];

/// Decrements its gauge when dropped: one unit of "in progress".
#[must_use = "the gauge goes down when this is dropped"]
pub struct GaugeGuard(Gauge);

impl GaugeGuard {
    pub fn up(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabels {
    pub code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

/// `Debug` for a metrics struct: its name, not its series.
#[macro_export]
macro_rules! opaque_debug {
    ($($name:ident),*) => {$(
        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name)).finish_non_exhaustive()
            }
        }
    )*};
}

/// The registry as OpenMetrics text.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_errors_are_rejected_and_retryable_ones_failed() {
        assert_eq!(outcome_label(Err(ErrorKind::InvalidArgument)), "rejected");
        assert_eq!(outcome_label(Err(ErrorKind::Unavailable)), "failed");
        assert_eq!(
            outcome_label(Ok(Outcome::DuplicateUniqueKey)),
            "duplicate_unique_key"
        );
    }
}
