//! The gateway's metrics (`imdedup_gateway_*`): names, types and labels
//! are a contract with the dashboards and alert rules (see
//! `imdedup_runtime::metrics`).

use std::time::Duration;

use imdedup_domain::{ErrorKind, model::Outcome};
use imdedup_runtime::metrics::{
    CodeLabels, GaugeGuard, OUTCOMES, OutcomeLabels, ReasonLabels, Registry, duration_histogram,
    outcome_label,
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Unit,
};

use crate::admission::AdmissionGauges;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardLabels {
    shard: String,
}

/// The gateway's `outcome` of a business API call answered as a repeat of
/// an earlier call with its idempotency key, whichever catcher (window or
/// unique key) recognised it. The gateway's sends counter only.
pub const DUPLICATE_BUSINESS_KEY: &str = "duplicate_business_key";

imdedup_runtime::opaque_debug!(GatewayMetrics);

/// The gateway's metrics (`imdedup_gateway_*`).
#[derive(Clone)]
pub struct GatewayMetrics {
    connections: Gauge,
    sends_in_flight: Gauge,
    sends: Family<OutcomeLabels, Counter>,
    send_errors: Family<CodeLabels, Counter>,
    ack_duration: Histogram,
    shard_up: Family<ShardLabels, Gauge>,
    shard_window: Family<ShardLabels, Gauge>,
    limited: Family<ReasonLabels, Counter>,
    resends_joined: Counter,
    sends_queued: Counter,
    admission_limit: Gauge,
    appointments: Gauge,
    backlog_places: Gauge,
    held_sends: Gauge,
    draining: Gauge,
    held_bytes: Gauge,
}

/// Why the gateway refused or ended something to protect itself (the
/// `reason` label of `imdedup_gateway_limited_total`).
pub const GATEWAY_LIMITS: [&str; 9] = [
    "connections",
    "unauthenticated",
    "upgrade_timeout",
    "user_connections",
    "user_send_rate",
    "in_flight",
    "held_bytes",
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
            shard_window: Family::default(),
            limited: Family::default(),
            resends_joined: Counter::default(),
            sends_queued: Counter::default(),
            admission_limit: Gauge::default(),
            appointments: Gauge::default(),
            backlog_places: Gauge::default(),
            held_sends: Gauge::default(),
            draining: Gauge::default(),
            held_bytes: Gauge::default(),
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
            "imdedup_gateway_sends_queued",
            "Sends held until their appointment and answered queued, instead of refused (the phone asked for queue)",
            m.sends_queued.clone(),
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
            "imdedup_gateway_backlog_places",
            "Sends in flight below which held sends take a place: twice the admission limit during a surge, the limit while the backlog drains, less while new sends wait behind it (adaptive)",
            m.backlog_places.clone(),
        );
        registry.register(
            "imdedup_gateway_held_sends",
            "Sends held now, waiting for a place (for their appointment, or going ahead of a draining backlog); sampled with the admission limit",
            m.held_sends.clone(),
        );
        registry.register(
            "imdedup_gateway_draining",
            "1 while a backlog of held sends drains (new sends arrive slower than the gateway answers, and go first), 0 otherwise; sampled with the admission limit",
            m.draining.clone(),
        );
        registry.register(
            "imdedup_gateway_held_bytes",
            "Memory counted for the sends held for their appointment, of the --max-held-bytes budget (each its content and ~1.6 KB); sampled with the admission limit",
            m.held_bytes.clone(),
        );
        registry.register(
            "imdedup_gateway_shard_up",
            "1 when the link to the ingest shard works, 0 when it failed last",
            m.shard_up.clone(),
        );
        registry.register(
            "imdedup_gateway_shard_window",
            "Sends the gateway lets unanswered by the ingest shard now (adaptive: halved when the shard pushes back; the rest wait in the gateway)",
            m.shard_window.clone(),
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

    /// A send was held for its appointment and answered `queued`.
    pub fn send_queued(&self) {
        self.sends_queued.inc();
    }

    pub fn sends_queued_count(&self) -> u64 {
        self.sends_queued.get()
    }

    pub fn resends_joined_count(&self) -> u64 {
        self.resends_joined.get()
    }

    /// The admission limit, the appointments open now, the places the
    /// held sends may take, the sends held and whether they drain.
    pub fn set_admission(&self, gauges: AdmissionGauges) {
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.admission_limit.set(gauge(gauges.limit));
        self.appointments.set(gauge(gauges.booked));
        self.backlog_places.set(gauge(gauges.backlog_places));
        self.held_sends.set(gauge(gauges.held));
        self.draining.set(i64::from(gauges.draining));
    }

    /// The bytes of the budget for held sends in use.
    pub fn set_held_bytes(&self, bytes: usize) {
        self.held_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// How many times `reason` was counted.
    pub fn limited_count(&self, reason: &'static str) -> u64 {
        self.limited.get_or_create(&ReasonLabels { reason }).get()
    }

    /// The bytes of held sends the gauge shows.
    #[cfg(test)]
    pub fn held_bytes_shown(&self) -> i64 {
        self.held_bytes.get()
    }

    /// The held sends the gauge shows.
    #[cfg(test)]
    pub fn held_sends_shown(&self) -> i64 {
        self.held_sends.get()
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

    /// Set each shard's window: `(shard, sends it may have unanswered)`.
    pub fn set_shard_windows<'a>(&self, windows: impl Iterator<Item = (&'a str, usize)>) {
        for (shard, size) in windows {
            self.shard_window
                .get_or_create(&ShardLabels {
                    shard: shard.to_owned(),
                })
                .set(i64::try_from(size).unwrap_or(i64::MAX));
        }
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

#[cfg(test)]
mod tests {
    use imdedup_runtime::metrics::render;
    use imdedup_testkit::prom::{assert_samples, sum_samples};

    use super::*;

    #[test]
    fn names_and_labels_match_the_contract() {
        let mut registry = Registry::default();
        let gateway = GatewayMetrics::register(&mut registry);
        let _connection = gateway.connection_opened();
        gateway.send_answered(Ok(Outcome::Stored), Duration::from_millis(3));
        gateway.send_answered(Err(ErrorKind::InvalidArgument), Duration::from_millis(1));
        gateway.shard_replied("http://a", Err(ErrorKind::Unavailable));
        gateway.set_shard_windows([("shard-0", 64), ("shard-1", 16)].into_iter());
        gateway.set_admission(AdmissionGauges {
            limit: 400,
            booked: 7,
            backlog_places: 50,
            held: 12,
            draining: true,
        });
        gateway.set_held_bytes(3_370);

        let text = render(&registry);
        assert_samples(
            &text,
            &[
                ("imdedup_gateway_connections", &[], 1.0),
                ("imdedup_gateway_sends_total", &[("outcome", "stored")], 1.0),
                (
                    "imdedup_gateway_sends_total",
                    &[("outcome", "rejected")],
                    1.0,
                ),
                (
                    "imdedup_gateway_send_errors_total",
                    &[("code", "invalid_argument")],
                    1.0,
                ),
                ("imdedup_gateway_ack_duration_seconds_count", &[], 2.0),
                (
                    "imdedup_gateway_ack_duration_seconds_bucket",
                    &[("le", "0.0025")],
                    1.0,
                ),
                ("imdedup_gateway_shard_up", &[("shard", "http://a")], 0.0),
                ("imdedup_gateway_admission_limit", &[], 400.0),
                ("imdedup_gateway_appointments", &[], 7.0),
                ("imdedup_gateway_backlog_places", &[], 50.0),
                ("imdedup_gateway_held_sends", &[], 12.0),
                ("imdedup_gateway_draining", &[], 1.0),
                ("imdedup_gateway_held_bytes", &[], 3_370.0),
                (
                    "imdedup_gateway_shard_window",
                    &[("shard", "shard-0")],
                    64.0,
                ),
                (
                    "imdedup_gateway_shard_window",
                    &[("shard", "shard-1")],
                    16.0,
                ),
            ],
        );
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
}
