//! The database's metrics (`imdedup_store_*`): names, types and labels
//! are a contract with the dashboards and alert rules (see
//! `imdedup_runtime::metrics`).

use std::time::Duration;

use imdedup_runtime::metrics::{Durations, Registry, durations};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Unit,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreResultLabels {
    db_system: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseLabels {
    db_system: &'static str,
    kind: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreRequestLabels {
    db_system: &'static str,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DbSystemLabels {
    db_system: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreOperationLabels {
    db_system: &'static str,
    operation: &'static str,
}

/// `db_system` of the SQLite store (OpenTelemetry's `db.system`).
pub const DB_SQLITE: &str = "sqlite";
/// `db_system` of the CQL store, ScyllaDB or Cassandra.
pub const DB_CASSANDRA: &str = "cassandra";

imdedup_runtime::opaque_debug!(StoreMetrics);

/// The database's metrics (`imdedup_store_*`), wherever the conditional
/// insert runs.
#[derive(Clone)]
pub struct StoreMetrics {
    inserts: Family<StoreResultLabels, Counter>,
    requests: Family<StoreRequestLabels, Counter>,
    leases: Family<LeaseLabels, Counter>,
    errors: Family<StoreOperationLabels, Counter>,
    operations: Durations<StoreOperationLabels>,
    nodes_stalled: Family<DbSystemLabels, Gauge>,
    node_stalls: Family<DbSystemLabels, Counter>,
    writer_queue: Family<DbSystemLabels, Gauge>,
}

impl Default for StoreMetrics {
    fn default() -> Self {
        Self {
            inserts: Family::default(),
            requests: Family::default(),
            leases: Family::default(),
            errors: Family::default(),
            operations: durations(),
            nodes_stalled: Family::default(),
            node_stalls: Family::default(),
            writer_queue: Family::default(),
        }
    }
}

impl StoreMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "imdedup_store_inserts",
            "Conditional inserts by result (applied, not_applied)",
            m.inserts.clone(),
        );
        registry.register(
            "imdedup_store_requests",
            "Database requests by kind (lwt, write, read, serial_read): what messages cost the database",
            m.requests.clone(),
        );
        registry.register(
            "imdedup_store_seq_leases",
            "Seq and server id block leases by kind and result (leased, contended)",
            m.leases.clone(),
        );
        registry.register(
            "imdedup_store_errors",
            "Failed database operations",
            m.errors.clone(),
        );
        registry.register_with_unit(
            "imdedup_store_operation_duration",
            "Database time by operation (insert, lookup, history)",
            Unit::Seconds,
            m.operations.clone(),
        );
        registry.register(
            "imdedup_store_nodes_stalled",
            "Database nodes this process routes around now: asked, and silent for a quarter of the request timeout",
            m.nodes_stalled.clone(),
        );
        registry.register(
            "imdedup_store_node_stalls",
            "Times a database node was found silent and routed around",
            m.node_stalls.clone(),
        );
        registry.register(
            "imdedup_store_writer_queue",
            "Inserts at the embedded store's single writer as it began its last commit: those in the commit and those queued behind it (at most four commits' worth; more wait to be queued, uncounted)",
            m.writer_queue.clone(),
        );
        m
    }

    /// Start the counters a store of `db_system` can move at 0, so rate()
    /// and increase() see their first counts too. Stores call this when
    /// they open.
    pub fn start_at_zero(&self, db_system: &'static str) {
        for result in ["applied", "not_applied"] {
            drop(
                self.inserts
                    .get_or_create(&StoreResultLabels { db_system, result }),
            );
        }
        for operation in ["insert", "lookup", "history"] {
            drop(self.errors.get_or_create(&StoreOperationLabels {
                db_system,
                operation,
            }));
        }
        if db_system == DB_SQLITE {
            drop(
                self.writer_queue
                    .get_or_create(&DbSystemLabels { db_system }),
            );
        }
        if db_system == DB_CASSANDRA {
            for kind in ["lwt", "write", "read", "serial_read"] {
                drop(
                    self.requests
                        .get_or_create(&StoreRequestLabels { db_system, kind }),
                );
            }
            let labels = DbSystemLabels { db_system };
            drop(self.nodes_stalled.get_or_create(&labels));
            drop(self.node_stalls.get_or_create(&labels));
            for kind in ["conversation", "server_id"] {
                for result in ["leased", "contended"] {
                    drop(self.leases.get_or_create(&LeaseLabels {
                        db_system,
                        kind,
                        result,
                    }));
                }
            }
        }
    }

    /// A conditional insert was applied (a new row) or not (the key existed).
    pub fn inserted(&self, db_system: &'static str, applied: bool) {
        let result = if applied { "applied" } else { "not_applied" };
        self.inserts
            .get_or_create(&StoreResultLabels { db_system, result })
            .inc();
    }

    /// One request of `kind` (lwt, write, read, serial_read) sent to the
    /// database.
    pub fn requested(&self, db_system: &'static str, kind: &'static str) {
        self.requests
            .get_or_create(&StoreRequestLabels { db_system, kind })
            .inc();
    }

    /// Requests of `kind` sent so far (for benchmarks and tests).
    pub fn requests(&self, db_system: &'static str, kind: &'static str) -> u64 {
        self.requests
            .get_or_create(&StoreRequestLabels { db_system, kind })
            .get()
    }

    /// A lease attempt on `kind` (conversation or server_id): won, or lost
    /// to another process and retried.
    pub fn leased(&self, db_system: &'static str, kind: &'static str, contended: bool) {
        let result = if contended { "contended" } else { "leased" };
        self.leases
            .get_or_create(&LeaseLabels {
                db_system,
                kind,
                result,
            })
            .inc();
    }

    /// A database node stopped answering and is routed around.
    pub fn node_stalled(&self, db_system: &'static str) {
        let labels = DbSystemLabels { db_system };
        self.node_stalls.get_or_create(&labels).inc();
        self.nodes_stalled.get_or_create(&labels).inc();
    }

    /// A stalled database node answered again.
    pub fn node_answering(&self, db_system: &'static str) {
        self.nodes_stalled
            .get_or_create(&DbSystemLabels { db_system })
            .dec();
    }

    /// The embedded store's writer began a commit with `inserts` at hand:
    /// those in the commit and those queued behind it (its queue holds
    /// four commits' worth; inserts waiting to enter a full one are not
    /// counted).
    pub fn writer_queue(&self, db_system: &'static str, inserts: usize) {
        self.writer_queue
            .get_or_create(&DbSystemLabels { db_system })
            .set(i64::try_from(inserts).unwrap_or(i64::MAX));
    }

    /// One database operation (insert, lookup, history) took `elapsed`.
    pub fn operation(
        &self,
        db_system: &'static str,
        operation: &'static str,
        elapsed: Duration,
        ok: bool,
    ) {
        let labels = StoreOperationLabels {
            db_system,
            operation,
        };
        self.operations
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
        if !ok {
            self.errors.get_or_create(&labels).inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use imdedup_runtime::metrics::render;
    use imdedup_testkit::prom::assert_samples;

    use super::*;

    #[test]
    fn names_and_labels_match_the_contract() {
        let mut registry = Registry::default();
        let store = StoreMetrics::register(&mut registry);
        store.inserted(DB_CASSANDRA, false);
        store.leased(DB_CASSANDRA, "conversation", true);
        store.operation(DB_SQLITE, "history", Duration::from_millis(1), false);
        store.node_stalled(DB_CASSANDRA);
        store.node_stalled(DB_CASSANDRA);
        store.node_answering(DB_CASSANDRA);
        store.writer_queue(DB_SQLITE, 700);

        let text = render(&registry);
        assert_samples(
            &text,
            &[
                (
                    "imdedup_store_inserts_total",
                    &[("db_system", "cassandra"), ("result", "not_applied")],
                    1.0,
                ),
                (
                    "imdedup_store_seq_leases_total",
                    &[
                        ("db_system", "cassandra"),
                        ("kind", "conversation"),
                        ("result", "contended"),
                    ],
                    1.0,
                ),
                (
                    "imdedup_store_errors_total",
                    &[("db_system", "sqlite"), ("operation", "history")],
                    1.0,
                ),
                (
                    "imdedup_store_nodes_stalled",
                    &[("db_system", "cassandra")],
                    1.0,
                ),
                (
                    "imdedup_store_node_stalls_total",
                    &[("db_system", "cassandra")],
                    2.0,
                ),
                (
                    "imdedup_store_writer_queue",
                    &[("db_system", "sqlite")],
                    700.0,
                ),
            ],
        );
    }
}
