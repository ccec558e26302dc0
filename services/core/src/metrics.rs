//! The Prometheus metrics of every service, one small struct per component.
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

use std::{borrow::Cow, fmt, time::Duration};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Unit,
};

use imdedup_domain::{ErrorKind, model::Outcome};

/// The registry every service exposes on `/metrics`.
pub use prometheus_client::registry::Registry;

/// Histogram buckets of every duration, in seconds.
pub const DURATION_BUCKETS: [f64; 13] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// `db_system` of the SQLite store (OpenTelemetry's `db.system`).
pub const DB_SQLITE: &str = "sqlite";
/// `db_system` of the CQL store, ScyllaDB or Cassandra.
pub const DB_CASSANDRA: &str = "cassandra";

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}

type Durations<L> = Family<L, Histogram, fn() -> Histogram>;

fn durations<L: Clone + std::hash::Hash + Eq>() -> Durations<L> {
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
const OUTCOMES: [&str; 5] = [
    "stored",
    "duplicate_window",
    "duplicate_unique_key",
    "rejected",
    "failed",
];

/// The gateway's `outcome` of a business API call answered as a repeat of
/// an earlier call with its idempotency key, whichever catcher (window or
/// unique key) recognised it. The gateway's sends counter only.
pub const DUPLICATE_BUSINESS_KEY: &str = "duplicate_business_key";

/// Decrements its gauge when dropped: one unit of "in progress".
#[must_use = "the gauge goes down when this is dropped"]
pub struct GaugeGuard(Gauge);

impl GaugeGuard {
    fn up(gauge: &Gauge) -> Self {
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
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardLabels {
    shard: String,
}

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
struct StoreOperationLabels {
    db_system: &'static str,
    operation: &'static str,
}

macro_rules! opaque_debug {
    ($($name:ident),*) => {$(
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($name)).finish_non_exhaustive()
            }
        }
    )*};
}
opaque_debug!(GatewayMetrics, IngestMetrics, WindowMetrics, StoreMetrics);

/// The gateway's metrics (`imdedup_gateway_*`).
#[derive(Clone)]
pub struct GatewayMetrics {
    connections: Gauge,
    sends_in_flight: Gauge,
    sends: Family<OutcomeLabels, Counter>,
    send_errors: Family<CodeLabels, Counter>,
    ack_duration: Histogram,
    shard_up: Family<ShardLabels, Gauge>,
    limited: Family<ReasonLabels, Counter>,
    resends_joined: Counter,
    admission_limit: Gauge,
    appointments: Gauge,
}

/// Why the gateway refused or ended something to protect itself (the
/// `reason` label of `imdedup_gateway_limited_total`).
pub const GATEWAY_LIMITS: [&str; 8] = [
    "connections",
    "unauthenticated",
    "upgrade_timeout",
    "user_connections",
    "user_send_rate",
    "in_flight",
    "history_pulls",
    "idle",
];

impl Default for GatewayMetrics {
    fn default() -> Self {
        Self {
            connections: Gauge::default(),
            sends_in_flight: Gauge::default(),
            sends: Family::default(),
            send_errors: Family::default(),
            ack_duration: duration_histogram(),
            shard_up: Family::default(),
            limited: Family::default(),
            resends_joined: Counter::default(),
            admission_limit: Gauge::default(),
            appointments: Gauge::default(),
        }
    }
}

impl GatewayMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "imdedup_gateway_connections",
            "Open WebSocket connections",
            m.connections.clone(),
        );
        registry.register(
            "imdedup_gateway_sends_in_flight",
            "Sends received, not answered yet",
            m.sends_in_flight.clone(),
        );
        registry.register(
            "imdedup_gateway_sends",
            "Answered sends by outcome",
            m.sends.clone(),
        );
        registry.register(
            "imdedup_gateway_send_errors",
            "Error answers to sends by code",
            m.send_errors.clone(),
        );
        registry.register_with_unit(
            "imdedup_gateway_ack_duration",
            "Frame read to ACK or error written, per send",
            Unit::Seconds,
            m.ack_duration.clone(),
        );
        // Known series start at 0, so rate() and increase() see their
        // first counts too.
        for outcome in OUTCOMES.into_iter().chain([DUPLICATE_BUSINESS_KEY]) {
            drop(m.sends.get_or_create(&OutcomeLabels { outcome }));
        }
        for kind in ErrorKind::ALL {
            drop(m.send_errors.get_or_create(&CodeLabels {
                code: kind.as_str(),
            }));
        }
        registry.register(
            "imdedup_gateway_limited",
            "Connections refused or closed and sends or pulls refused by a gateway limit, by reason",
            m.limited.clone(),
        );
        for reason in GATEWAY_LIMITS {
            drop(m.limited.get_or_create(&ReasonLabels { reason }));
        }
        registry.register(
            "imdedup_gateway_resends_joined",
            "Copies of a send in flight that waited for its answer instead of going to a shard",
            m.resends_joined.clone(),
        );
        registry.register(
            "imdedup_gateway_admission_limit",
            "Sends the gateway lets in flight now (adaptive, driven by their latency)",
            m.admission_limit.clone(),
        );
        registry.register(
            "imdedup_gateway_appointments",
            "Refused sends given a time to come back, not back yet",
            m.appointments.clone(),
        );
        registry.register(
            "imdedup_gateway_shard_up",
            "1 when the link to the ingest shard works, 0 when it failed last",
            m.shard_up.clone(),
        );
        m
    }

    /// A gateway limit refused or ended something (one of
    /// [`GATEWAY_LIMITS`]).
    pub fn limited(&self, reason: &'static str) {
        self.limited.get_or_create(&ReasonLabels { reason }).inc();
    }

    /// A copy of a send in flight joined it.
    pub fn resend_joined(&self) {
        self.resends_joined.inc();
    }

    pub fn resends_joined_count(&self) -> u64 {
        self.resends_joined.get()
    }

    /// The admission limit and the appointments open now.
    pub fn set_admission(&self, limit: usize, appointments: usize) {
        self.admission_limit
            .set(i64::try_from(limit).unwrap_or(i64::MAX));
        self.appointments
            .set(i64::try_from(appointments).unwrap_or(i64::MAX));
    }

    /// How many times `reason` was counted.
    pub fn limited_count(&self, reason: &'static str) -> u64 {
        self.limited.get_or_create(&ReasonLabels { reason }).get()
    }

    /// One more open connection, until the guard is dropped.
    pub fn connection_opened(&self) -> GaugeGuard {
        GaugeGuard::up(&self.connections)
    }

    /// One more send waiting for its answer, until the guard is dropped.
    pub fn send_started(&self) -> GaugeGuard {
        GaugeGuard::up(&self.sends_in_flight)
    }

    /// A send was answered (ACK or error frame written) `elapsed` after its
    /// frame was read.
    pub fn send_answered(&self, result: Result<Outcome, ErrorKind>, elapsed: Duration) {
        self.sends
            .get_or_create(&OutcomeLabels {
                outcome: outcome_label(result),
            })
            .inc();
        if let Err(kind) = result {
            self.send_errors
                .get_or_create(&CodeLabels {
                    code: kind.as_str(),
                })
                .inc();
        }
        self.ack_duration.observe(elapsed.as_secs_f64());
    }

    /// A business API call was answered `elapsed` after it arrived: counted
    /// like a phone's send, but a repeat as [`DUPLICATE_BUSINESS_KEY`].
    pub fn business_send_answered(&self, result: Result<Outcome, ErrorKind>, elapsed: Duration) {
        match result {
            Ok(outcome) if outcome.is_duplicate() => {
                self.sends
                    .get_or_create(&OutcomeLabels {
                        outcome: DUPLICATE_BUSINESS_KEY,
                    })
                    .inc();
                self.ack_duration.observe(elapsed.as_secs_f64());
            }
            result => self.send_answered(result, elapsed),
        }
    }

    /// Set whether the link to ingest shard `shard` works.
    pub fn set_shard_up(&self, shard: &str, up: bool) {
        self.shard_up
            .get_or_create(&ShardLabels {
                shard: shard.to_owned(),
            })
            .set(i64::from(up));
    }

    /// Judge the link to `shard` by the result of one send to it: any answer
    /// (an ACK, or an error the shard sent) means it works; `unavailable`
    /// means it failed; a deadline says nothing about the link.
    pub fn shard_replied(&self, shard: &str, result: Result<(), ErrorKind>) {
        match result {
            Err(ErrorKind::DeadlineExceeded) => {}
            Err(ErrorKind::Unavailable) => self.set_shard_up(shard, false),
            Ok(()) | Err(_) => self.set_shard_up(shard, true),
        }
    }
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
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

/// The database's metrics (`imdedup_store_*`), wherever the conditional
/// insert runs.
#[derive(Clone)]
pub struct StoreMetrics {
    inserts: Family<StoreResultLabels, Counter>,
    requests: Family<StoreRequestLabels, Counter>,
    leases: Family<LeaseLabels, Counter>,
    errors: Family<StoreOperationLabels, Counter>,
    operations: Durations<StoreOperationLabels>,
}

impl Default for StoreMetrics {
    fn default() -> Self {
        Self {
            inserts: Family::default(),
            requests: Family::default(),
            leases: Family::default(),
            errors: Family::default(),
            operations: durations(),
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
        if db_system == DB_CASSANDRA {
            for kind in ["lwt", "write", "read", "serial_read"] {
                drop(
                    self.requests
                        .get_or_create(&StoreRequestLabels { db_system, kind }),
                );
            }
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

/// The registry as OpenMetrics text.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

/// The sum of the samples named `name` whose labels include all of
/// `labels`, in an exposition text (`None` when no sample matches). For
/// tests and tools reading `/metrics`; label order does not matter.
pub fn sum_samples(exposition: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut total = None;
    for line in exposition.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (series_name, series_labels) = match series.split_once('{') {
            Some((n, rest)) => (n, parse_labels(rest.strip_suffix('}').unwrap_or(rest))),
            None => (series, Vec::new()),
        };
        if series_name != name
            || !labels
                .iter()
                .all(|(k, v)| series_labels.iter().any(|(sk, sv)| sk == k && sv == v))
        {
            continue;
        }
        if let Ok(value) = value.parse::<f64>() {
            *total.get_or_insert(0.0) += value;
        }
    }
    total
}

/// `a="x",b="y\"z"` into pairs, unescaping values.
fn parse_labels(raw: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let mut chars = raw.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.is_empty() || chars.next() != Some('"') {
            break;
        }
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(other) => value.push(other),
                    None => break,
                },
                '"' => break,
                c => value.push(c),
            }
        }
        pairs.push((key.trim_start_matches(',').to_owned(), value));
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_labels_match_the_contract() {
        let mut registry = Registry::default();
        let gateway = GatewayMetrics::register(&mut registry);
        let ingest = IngestMetrics::register(shard_registry(&mut registry, "ingest-0"));
        let store = StoreMetrics::register(&mut registry);

        let _connection = gateway.connection_opened();
        gateway.send_answered(Ok(Outcome::Stored), Duration::from_millis(3));
        gateway.send_answered(Err(ErrorKind::InvalidArgument), Duration::from_millis(1));
        gateway.shard_replied("http://a", Err(ErrorKind::Unavailable));
        ingest.decided(Ok(Outcome::DuplicateWindow), Duration::from_millis(1));
        ingest.window.claimed("seen");
        ingest
            .window
            .observe("claim", "memory", Duration::from_micros(10));
        ingest.storage_call("insert", Duration::from_millis(2), false);
        store.inserted(DB_CASSANDRA, false);
        store.leased(DB_CASSANDRA, "conversation", true);
        store.operation(DB_SQLITE, "history", Duration::from_millis(1), false);

        let text = render(&registry);
        let shard = ("shard", "ingest-0");
        for (name, labels, value) in [
            ("imdedup_gateway_connections", vec![], 1.0),
            (
                "imdedup_gateway_sends_total",
                vec![("outcome", "stored")],
                1.0,
            ),
            (
                "imdedup_gateway_sends_total",
                vec![("outcome", "rejected")],
                1.0,
            ),
            (
                "imdedup_gateway_send_errors_total",
                vec![("code", "invalid_argument")],
                1.0,
            ),
            ("imdedup_gateway_ack_duration_seconds_count", vec![], 2.0),
            (
                "imdedup_gateway_ack_duration_seconds_bucket",
                vec![("le", "0.0025")],
                1.0,
            ),
            ("imdedup_gateway_shard_up", vec![("shard", "http://a")], 0.0),
            ("imdedup_ingest_shard_info", vec![shard], 1.0),
            (
                "imdedup_ingest_sends_total",
                vec![shard, ("outcome", "duplicate_window")],
                1.0,
            ),
            (
                "imdedup_ingest_decision_duration_seconds_count",
                vec![shard],
                1.0,
            ),
            (
                "imdedup_window_claims_total",
                vec![shard, ("result", "seen")],
                1.0,
            ),
            (
                "imdedup_window_operation_duration_seconds_count",
                vec![shard, ("operation", "claim"), ("backend", "memory")],
                1.0,
            ),
            (
                "imdedup_storage_errors_total",
                vec![shard, ("operation", "insert")],
                1.0,
            ),
            (
                "imdedup_store_inserts_total",
                vec![("db_system", "cassandra"), ("result", "not_applied")],
                1.0,
            ),
            (
                "imdedup_store_seq_leases_total",
                vec![
                    ("db_system", "cassandra"),
                    ("kind", "conversation"),
                    ("result", "contended"),
                ],
                1.0,
            ),
            (
                "imdedup_store_errors_total",
                vec![("db_system", "sqlite"), ("operation", "history")],
                1.0,
            ),
        ] {
            assert_eq!(
                sum_samples(&text, name, &labels),
                Some(value),
                "{name} {labels:?} in\n{text}"
            );
        }
        assert!(text.contains("# TYPE imdedup_ingest_shard_info gauge\n"));
        assert!(text.contains("# TYPE imdedup_gateway_ack_duration_seconds histogram\n"));
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn business_repeats_are_counted_under_their_own_outcome() {
        let mut registry = Registry::default();
        let gateway = GatewayMetrics::register(&mut registry);
        let sends = |outcome| {
            sum_samples(
                &render(&registry),
                "imdedup_gateway_sends_total",
                &[("outcome", outcome)],
            )
        };
        assert_eq!(sends(DUPLICATE_BUSINESS_KEY), Some(0.0), "starts at 0");
        let ms = Duration::from_millis(1);
        gateway.business_send_answered(Ok(Outcome::Stored), ms);
        gateway.business_send_answered(Ok(Outcome::DuplicateWindow), ms);
        gateway.business_send_answered(Ok(Outcome::DuplicateUniqueKey), ms);
        gateway.business_send_answered(Err(ErrorKind::IdReused), ms);
        assert_eq!(sends("stored"), Some(1.0));
        assert_eq!(sends(DUPLICATE_BUSINESS_KEY), Some(2.0));
        assert_eq!(sends("duplicate_window"), Some(0.0));
        assert_eq!(sends("rejected"), Some(1.0));
    }

    #[test]
    fn guards_bring_gauges_back_down() {
        let mut registry = Registry::default();
        let gateway = GatewayMetrics::register(&mut registry);
        {
            let _a = gateway.send_started();
            let _b = gateway.send_started();
            assert!(render(&registry).contains("imdedup_gateway_sends_in_flight 2\n"));
        }
        assert!(render(&registry).contains("imdedup_gateway_sends_in_flight 0\n"));
    }

    #[test]
    fn samples_are_summed_whatever_the_label_order() {
        let text =
            "# TYPE x counter\nx_total{b=\"2\",a=\"1\"} 3\nx_total{a=\"1\",b=\"q\\\"\"} 4\ny 1\n";
        assert_eq!(
            sum_samples(text, "x_total", &[("a", "1"), ("b", "2")]),
            Some(3.0)
        );
        assert_eq!(sum_samples(text, "x_total", &[("a", "1")]), Some(7.0));
        assert_eq!(sum_samples(text, "x_total", &[("b", "q\"")]), Some(4.0));
        assert_eq!(sum_samples(text, "y", &[]), Some(1.0));
        assert_eq!(sum_samples(text, "x_total", &[("a", "2")]), None);
    }

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
