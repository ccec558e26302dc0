//! The run's report: a terminal summary and the same figures as JSON.

use std::{collections::BTreeMap, fmt::Write as _, time::Duration};

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::{
    audit::{Audit, Sent},
    config::{LoadConfig, Target},
    cpu::ProcessCpu,
};

#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

/// One second of the run, by when ACKs reached the phones.
#[derive(Debug, Clone, Serialize)]
pub struct Second {
    pub second: u64,
    pub acked: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Outcomes {
    pub stored: u64,
    pub duplicate_window: u64,
    pub duplicate_unique_key: u64,
    /// Business API calls answered as a repeat of their idempotency key.
    pub duplicate_business_key: u64,
    /// Error frames by code.
    pub errors: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub scenario: String,
    pub target: String,
    pub messages: u64,
    pub offered_rate: f64,
    /// ACKed messages per second over the sending phase.
    pub achieved_rate: f64,
    pub sending_seconds: f64,
    /// From a message's due time to its ACK on the phone, resends included.
    pub ack_latency: Latency,
    /// What the server answered, for every copy that reached it.
    pub outcomes: Outcomes,
    pub tries: u64,
    /// Sends the phones' clients held back themselves (client-side
    /// throttling): they never reached the gateway.
    pub held_back: u64,
    pub resends: u64,
    pub sends_lost: u64,
    pub acks_lost: u64,
    pub late_resends: u64,
    pub late_resends_caught_by_unique_key: u64,
    pub audit: Audit,
    /// Throughput and latency over time, by the second of the ACK.
    pub timeline: Vec<Second>,
    /// The same by the second each message was due: how fast a message
    /// sent at that moment got through.
    pub due_timeline: Vec<Second>,
    /// When the first message was due (Unix ms): second 0 of the timeline,
    /// for lining it up with what happened elsewhere (fault scripts).
    pub started_at_unix_ms: u64,
    /// The `business` scenario's own figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub business: Option<BusinessFigures>,
    /// CPU per acknowledged message over the sending phase: each service
    /// given with `--admin`, their sum (`services`) and the driver's own;
    /// with `--embedded`, the one process (`driver+services`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cpu: Vec<ProcessCpu>,
}

/// Per second of the run: the messages acknowledged in it (by the time of
/// their ACK) or, `by_due`, the messages due in it, with their latencies.
fn timeline(sent: &[Sent], by_due: bool) -> Vec<Second> {
    let mut seconds: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for trace in sent.iter().map(|m| &m.trace) {
        if let Some(latency) = trace.latency {
            let at = if by_due {
                trace.due_offset.as_secs()
            } else {
                (trace.due_offset + latency).as_secs()
            };
            seconds
                .entry(at)
                .or_default()
                .push(latency.as_secs_f64() * 1000.0);
        }
    }
    seconds
        .into_iter()
        .map(|(second, mut latencies)| {
            latencies.sort_by(f64::total_cmp);
            let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
            Second {
                second,
                acked: latencies.len() as u64,
                p50_ms: at(0.5),
                p99_ms: at(0.99),
            }
        })
        .collect()
}

impl Report {
    pub fn new(
        config: &LoadConfig,
        sent: &[Sent],
        sending: Duration,
        late_caught: u64,
        audit: Audit,
    ) -> Self {
        let mut histogram =
            Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds");
        let mut outcomes = Outcomes::default();
        let (mut tries, mut held_back, mut sends_lost, mut acks_lost) = (0, 0, 0, 0);
        for message in sent {
            let trace = &message.trace;
            if let Some(latency) = trace.latency {
                let micros = u64::try_from(latency.as_micros())
                    .unwrap_or(u64::MAX)
                    .max(1);
                histogram.saturating_record(micros);
            }
            tries += u64::from(trace.tries);
            held_back += u64::from(trace.held_back);
            sends_lost += u64::from(trace.sends_lost);
            acks_lost += u64::from(trace.acks_lost);
            for ack in &trace.server_acks {
                match ack.outcome.as_str() {
                    "stored" => outcomes.stored += 1,
                    "duplicate_window" => outcomes.duplicate_window += 1,
                    "duplicate_unique_key" => outcomes.duplicate_unique_key += 1,
                    "duplicate_business_key" => outcomes.duplicate_business_key += 1,
                    _ => {}
                }
            }
            for code in &trace.errors {
                *outcomes.errors.entry(code.clone()).or_default() += 1;
            }
        }
        let ms = |q: f64| histogram.value_at_quantile(q) as f64 / 1000.0;
        let due_timeline = timeline(sent, true);
        let timeline = timeline(sent, false);
        let acked = sent.iter().filter(|m| m.trace.received.is_some()).count() as f64;
        Self {
            scenario: config.scenario.clone(),
            target: match &config.target {
                Target::Embedded { shards } => format!("embedded ({shards} ingest shards)"),
                Target::Gateway { url, .. } => url.clone(),
            },
            messages: sent.len() as u64,
            offered_rate: config.rate,
            achieved_rate: acked / sending.as_secs_f64().max(1e-9),
            sending_seconds: sending.as_secs_f64(),
            ack_latency: Latency {
                p50_ms: ms(0.50),
                p90_ms: ms(0.90),
                p99_ms: ms(0.99),
                p999_ms: ms(0.999),
                max_ms: histogram.max() as f64 / 1000.0,
            },
            outcomes,
            tries,
            held_back,
            resends: tries.saturating_sub(sent.len() as u64),
            sends_lost,
            acks_lost,
            late_resends: config.late_resends as u64,
            late_resends_caught_by_unique_key: late_caught,
            audit,
            timeline,
            due_timeline,
            started_at_unix_ms: 0,
            business: None,
            cpu: Vec::new(),
        }
    }

    /// Messages acknowledged over the sending phase.
    pub fn acknowledged(&self) -> u64 {
        (self.achieved_rate * self.sending_seconds).round() as u64
    }

    /// The "CPU per message" block of the summary (nothing without figures).
    fn render_cpu(&self, out: &mut String) {
        if self.cpu.is_empty() {
            return;
        }
        let _ = writeln!(
            out,
            "  CPU per message  over the sending phase, per acknowledged message ({})",
            self.acknowledged()
        );
        for process in &self.cpu {
            let _ = writeln!(
                out,
                "    {:<18} {:>9.1} µs/msg  {:>8.2} CPU s",
                process.name, process.us_per_message, process.cpu_seconds
            );
        }
        if self
            .cpu
            .iter()
            .any(|p| p.name == crate::cpu::EMBEDDED_PROCESS)
        {
            let _ = writeln!(
                out,
                "    (--embedded: the services run in the driver's process, so this is their \
                 sum with the driver's; --url with --admin splits it per service)"
            );
        }
    }

    /// The terminal summary.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let a = &self.audit;
        let o = &self.outcomes;
        let l = &self.ack_latency;
        let _ = writeln!(out, "scenario {}  target {}", self.scenario, self.target);
        let _ = writeln!(
            out,
            "  messages {:>9}   offered {:>8.0}/s   achieved {:>8.0}/s over {:.1} s",
            self.messages, self.offered_rate, self.achieved_rate, self.sending_seconds
        );
        let _ = writeln!(
            out,
            "  ACK latency ms   p50 {:.2}  p90 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
            l.p50_ms, l.p90_ms, l.p99_ms, l.p999_ms, l.max_ms
        );
        let _ = writeln!(
            out,
            "  tries {}  resends {}  sends lost {}  ACKs lost {}  held back by the phones {}",
            self.tries, self.resends, self.sends_lost, self.acks_lost, self.held_back
        );
        let _ = writeln!(
            out,
            "  server answers   stored {}  caught by the window {}  caught by the unique key {}  errors {:?}",
            o.stored, o.duplicate_window, o.duplicate_unique_key, o.errors
        );
        if let Some(b) = &self.business {
            b.render(&mut out);
        }
        if self.late_resends > 0 {
            let _ = writeln!(
                out,
                "  late resends     {} sent an hour later, {} caught by the unique key",
                self.late_resends, self.late_resends_caught_by_unique_key
            );
        }
        self.render_cpu(&mut out);
        let _ = writeln!(out, "audit ({} rows stored)", a.stored_rows);
        for (name, value, must_be_zero) in [
            ("lost (ACKed, not stored)", a.lost, true),
            ("repeats receivers see", a.repeats, true),
            ("ACKs differing from the first", a.ack_mismatches, true),
            ("seq order violations", a.seq_order_violations, true),
            ("missed by followers", a.missed_by_followers, true),
            ("delivered out of seq order", a.delivered_out_of_order, true),
            ("stored out of send order", a.stored_out_of_send_order, true),
            ("seq gaps", a.seq_gaps, false),
            (
                "rows delivered to followers",
                a.delivered_to_followers,
                false,
            ),
            ("failed on the phone (never ACKed)", a.failed, false),
            ("  of which stored anyway", a.failed_but_stored, false),
        ] {
            let verdict = match (must_be_zero, value) {
                (true, 0) => "ok",
                (true, _) => "FAIL",
                (false, _) => "",
            };
            let _ = writeln!(out, "  {name:<36} {value:>8}  {verdict}");
        }
        let _ = writeln!(out, "{}", if a.passed() { "PASSED" } else { "FAILED" });
        out
    }
}

/// The business scenario's own figures (see [`crate::business`]).
#[derive(Debug, Clone, Default, Serialize)]
pub struct BusinessFigures {
    pub systems: u64,
    /// HTTP calls made, retries included.
    pub calls: u64,
    /// Calls the system stopped waiting for (its client timeout).
    pub timed_out: u64,
    /// Calls after a notice's first.
    pub retries: u64,
    /// Retries answered `duplicate_business_key`: the key recognised a
    /// notice an earlier, timed-out or failed call had stored.
    pub retries_caught_by_business_key: u64,
    /// Notices answered (stored now or recognised).
    pub answered: u64,
    /// Notices never answered within `max_tries`.
    pub gave_up: u64,
    /// Answers the driver received but dropped (`--loss-ack`), as if they
    /// were lost on the way back.
    pub answers_lost: u64,
    /// `idempotency_key_reused` answers: each notice keeps its key and
    /// body, so this must be 0.
    pub key_reused: u64,
    pub call_timeout_ms: f64,
}

impl BusinessFigures {
    pub fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "  business API     {} systems, {} calls ({} retries), {} timed out on the client (first try after {} ms), {} answers lost",
            self.systems,
            self.calls,
            self.retries,
            self.timed_out,
            self.call_timeout_ms,
            self.answers_lost
        );
        let _ = writeln!(
            out,
            "                   {} retries caught by the business key; {} notices answered, {} given up, key reused {}{}",
            self.retries_caught_by_business_key,
            self.answered,
            self.gave_up,
            self.key_reused,
            if self.key_reused == 0 { "" } else { "  FAIL" }
        );
    }
}
