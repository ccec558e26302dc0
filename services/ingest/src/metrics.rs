//! An ingest shard's metrics (`imdedup_ingest_*`, `imdedup_window_*` and
//! its calls to storage): names, types and labels are a contract with the
//! dashboards and alert rules (see `imdedup_runtime::metrics`).

use std::time::Duration;

use imdedup_domain::{ErrorKind, model::Outcome};
use imdedup_runtime::metrics::{
    CodeLabels, Durations, GaugeGuard, OUTCOMES, OutcomeLabels, ReasonLabels, Registry,
    duration_histogram, durations, outcome_label,
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Unit,
};

imdedup_runtime::opaque_debug!(IngestMetrics, WindowMetrics);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    operation: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WindowOperationLabels {
    operation: &'static str,
    backend: &'static str,
}

/// The recent-ID window's metrics (`imdedup_window_*`), shared by the dedup
/// decision (claims, bypasses) and the window backends (call durations).
#[derive(Clone)]
pub struct WindowMetrics {
    claims: Family<ResultLabels, Counter>,
    bypassed: Counter,
    warming: Counter,
    operations: Durations<WindowOperationLabels>,
}

impl Default for WindowMetrics {
    fn default() -> Self {
        Self {
            claims: Family::default(),
            bypassed: Counter::default(),
            warming: Counter::default(),
            operations: durations(),
        }
    }
}

impl WindowMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "imdedup_window_claims",
            "Window claims by result (owned, seen, in_flight, error)",
            m.claims.clone(),
        );
        registry.register(
            "imdedup_window_bypassed",
            "Sends decided without the window (window down, breaker open, or warming up)",
            m.bypassed.clone(),
        );
        registry.register(
            "imdedup_window_warmup_skipped",
            "Claims sent past the window while it warms up after an outage (a growing share goes to it)",
            m.warming.clone(),
        );
        for result in ["owned", "seen", "in_flight", "error"] {
            drop(m.claims.get_or_create(&ResultLabels { result }));
        }
        registry.register_with_unit(
            "imdedup_window_operation_duration",
            "Window calls by operation (claim, remember, release) and backend",
            Unit::Seconds,
            m.operations.clone(),
        );
        m
    }

    /// A claim answered `result`: `owned`, `seen`, `in_flight` or `error`.
    pub fn claimed(&self, result: &'static str) {
        self.claims.get_or_create(&ResultLabels { result }).inc();
    }

    /// A claim went past the window because it is warming up.
    pub fn warmup_skipped(&self) {
        self.warming.inc();
    }

    pub fn bypassed(&self) {
        self.bypassed.inc();
    }

    /// One window call: `operation` is claim, remember or release; `backend`
    /// is redis or memory.
    pub fn observe(&self, operation: &'static str, backend: &'static str, elapsed: Duration) {
        self.operations
            .get_or_create(&WindowOperationLabels { operation, backend })
            .observe(elapsed.as_secs_f64());
    }
}

/// One ingest shard's metrics (`imdedup_ingest_*`, its window's and its
/// calls to the store). Register them in [`shard_registry`].
#[derive(Clone)]
pub struct IngestMetrics {
    shard_info: Gauge,
    in_flight: Gauge,
    sends: Family<OutcomeLabels, Counter>,
    errors: Family<CodeLabels, Counter>,
    decision_duration: Histogram,
    storage_operations: Durations<OperationLabels>,
    storage_errors: Family<OperationLabels, Counter>,
    shed: Family<ReasonLabels, Counter>,
    db_limit: Gauge,
    db_in_flight: Gauge,
    pub window: WindowMetrics,
}

impl Default for IngestMetrics {
    fn default() -> Self {
        Self {
            shed: Family::default(),
            db_limit: Gauge::default(),
            db_in_flight: Gauge::default(),
            shard_info: Gauge::default(),
            in_flight: Gauge::default(),
            sends: Family::default(),
            errors: Family::default(),
            decision_duration: duration_histogram(),
            storage_operations: durations(),
            storage_errors: Family::default(),
            window: WindowMetrics::default(),
        }
    }
}

impl IngestMetrics {
    /// Register the shard's metrics, its window's included. `registry`
    /// should come from [`shard_registry`].
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            window: WindowMetrics::register(registry),
            ..Self::default()
        };
        m.shard_info.set(1);
        registry.register(
            "imdedup_ingest_shard_info",
            "Always 1: this process owns this shard",
            m.shard_info.clone(),
        );
        registry.register(
            "imdedup_ingest_sends_in_flight",
            "Dedup decisions in progress",
            m.in_flight.clone(),
        );
        registry.register(
            "imdedup_ingest_sends",
            "Dedup decisions by outcome",
            m.sends.clone(),
        );
        registry.register(
            "imdedup_ingest_send_errors",
            "Rejected or failed sends by error code",
            m.errors.clone(),
        );
        registry.register_with_unit(
            "imdedup_ingest_decision_duration",
            "One dedup decision, window and store",
            Unit::Seconds,
            m.decision_duration.clone(),
        );
        registry.register_with_unit(
            "imdedup_storage_operation_duration",
            "The ingest's calls to the store by operation (insert, lookup)",
            Unit::Seconds,
            m.storage_operations.clone(),
        );
        registry.register(
            "imdedup_storage_errors",
            "The ingest's failed calls to the store by operation",
            m.storage_errors.clone(),
        );
        registry.register(
            "imdedup_ingest_shed",
            "Sends dropped before their database operation, by reason (deadline: nobody waits for the answer any more; db_limit: the adaptive limit on inserts in flight was reached)",
            m.shed.clone(),
        );
        for reason in ["deadline", "db_limit"] {
            drop(m.shed.get_or_create(&ReasonLabels { reason }));
        }
        registry.register(
            "imdedup_ingest_db_concurrency_limit",
            "The adaptive limit on inserts in flight to the database, now",
            m.db_limit.clone(),
        );
        registry.register(
            "imdedup_ingest_db_in_flight",
            "Inserts in flight to the database",
            m.db_in_flight.clone(),
        );
        for outcome in OUTCOMES {
            drop(m.sends.get_or_create(&OutcomeLabels { outcome }));
        }
        for kind in ErrorKind::ALL {
            drop(m.errors.get_or_create(&CodeLabels {
                code: kind.as_str(),
            }));
        }
        for operation in ["insert", "lookup"] {
            drop(
                m.storage_errors
                    .get_or_create(&OperationLabels { operation }),
            );
        }
        m
    }

    /// One more decision in progress, until the guard is dropped.
    pub fn decision_started(&self) -> GaugeGuard {
        GaugeGuard::up(&self.in_flight)
    }

    /// A decision ended with `result` after `elapsed`.
    pub fn decided(&self, result: Result<Outcome, ErrorKind>, elapsed: Duration) {
        self.count(result);
        self.decision_duration.observe(elapsed.as_secs_f64());
    }

    /// A send refused before any decision (a malformed request): counted as
    /// `rejected` (or `failed`) with its code, without a duration.
    pub fn refused(&self, kind: ErrorKind) {
        self.count(Err(kind));
    }

    fn count(&self, result: Result<Outcome, ErrorKind>) {
        self.sends
            .get_or_create(&OutcomeLabels {
                outcome: outcome_label(result),
            })
            .inc();
        if let Err(kind) = result {
            self.errors
                .get_or_create(&CodeLabels {
                    code: kind.as_str(),
                })
                .inc();
        }
    }

    /// A send dropped before its database operation.
    /// The adaptive limit on inserts in flight moved to `limit`.
    pub fn set_db_limit(&self, limit: usize) {
        self.db_limit.set(i64::try_from(limit).unwrap_or(i64::MAX));
    }

    /// One more insert in flight to the database, until the guard drops.
    pub fn db_insert_started(&self) -> GaugeGuard {
        GaugeGuard::up(&self.db_in_flight)
    }

    /// How many sends were shed for `reason`.
    pub fn shed_count(&self, reason: &'static str) -> u64 {
        self.shed.get_or_create(&ReasonLabels { reason }).get()
    }

    pub fn shed(&self, reason: &'static str) {
        self.shed.get_or_create(&ReasonLabels { reason }).inc();
    }

    /// One call to the store: `operation` is insert or lookup.
    pub fn storage_call(&self, operation: &'static str, elapsed: Duration, ok: bool) {
        let labels = OperationLabels { operation };
        self.storage_operations
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
        if !ok {
            self.storage_errors.get_or_create(&labels).inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use imdedup_runtime::metrics::render;
    use imdedup_runtime::metrics::shard_registry;
    use imdedup_testkit::prom::assert_samples;

    use super::*;

    #[test]
    fn names_and_labels_match_the_contract() {
        let mut registry = Registry::default();
        let ingest = IngestMetrics::register(shard_registry(&mut registry, "ingest-0"));
        ingest.decided(Ok(Outcome::DuplicateWindow), Duration::from_millis(1));
        ingest.window.claimed("seen");
        ingest
            .window
            .observe("claim", "memory", Duration::from_micros(10));
        ingest.storage_call("insert", Duration::from_millis(2), false);

        let text = render(&registry);
        let shard = ("shard", "ingest-0");
        assert_samples(
            &text,
            &[
                ("imdedup_ingest_shard_info", &[shard], 1.0),
                (
                    "imdedup_ingest_sends_total",
                    &[shard, ("outcome", "duplicate_window")],
                    1.0,
                ),
                (
                    "imdedup_ingest_decision_duration_seconds_count",
                    &[shard],
                    1.0,
                ),
                (
                    "imdedup_window_claims_total",
                    &[shard, ("result", "seen")],
                    1.0,
                ),
                (
                    "imdedup_window_operation_duration_seconds_count",
                    &[shard, ("operation", "claim"), ("backend", "memory")],
                    1.0,
                ),
                (
                    "imdedup_storage_errors_total",
                    &[shard, ("operation", "insert")],
                    1.0,
                ),
            ],
        );
        assert!(text.contains("# TYPE imdedup_ingest_shard_info gauge\n"));
    }
}
