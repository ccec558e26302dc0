//! The `overload` scenario: the capacity C measured first (the highest rate
//! with p99 ACK latency under a bound), then phases offered at multiples of
//! it: a base at 0.5 C, 1.5 C for 20 s, a recovery at 0.5 C, 3 C for 20 s,
//! another recovery. Per second it reports goodput (ACKs reaching phones),
//! tries and refusals; per phase, give-ups, tries per message and CPU per
//! acknowledged message; and whether the p99 of new messages came back to
//! the base's once the surge's backlog was served.

use std::{fmt::Write as _, time::Duration};

use serde::Serialize;

/// One phase of a schedule: `rate` messages per second for `duration`.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub name: String,
    pub rate: f64,
    pub duration: Duration,
}

impl Phase {
    fn new(name: &str, rate: f64, duration: Duration) -> Self {
        Self {
            name: name.to_owned(),
            rate,
            duration,
        }
    }
}

/// The overload phases against capacity `capacity`, with surges of
/// `surge` each (20 s in the full run), the base and the recoveries at
/// `calm` of the capacity (0.5 in the full run; nearer 1, the backlog
/// drains slower and new sends arrive nearly as fast as it is served).
pub fn phases(capacity: f64, surge: Duration, calm: f64) -> Vec<Phase> {
    let between = surge / 2;
    vec![
        Phase::new("base", calm * capacity, between / 2),
        Phase::new("1.5x", 1.5 * capacity, surge),
        Phase::new("after 1.5x", calm * capacity, between),
        Phase::new("3x", 3.0 * capacity, surge),
        Phase::new("after 3x", calm * capacity, between),
    ]
}

/// When each message of `schedule` is due, from the start: each phase's
/// messages evenly spaced at its rate.
pub fn schedule_dues(schedule: &[Phase]) -> Vec<Duration> {
    let mut dues = Vec::new();
    let mut start = Duration::ZERO;
    for phase in schedule {
        let count = (phase.rate * phase.duration.as_secs_f64()).round() as u64;
        dues.extend((0..count).map(|n| start + Duration::from_secs_f64(n as f64 / phase.rate)));
        start += phase.duration;
    }
    dues
}

/// The messages a schedule sends.
pub fn schedule_messages(schedule: &[Phase]) -> u64 {
    schedule_dues(schedule).len() as u64
}

/// CPU seconds so far at `at` from the start.
#[derive(Debug, Clone, Copy)]
pub struct CpuSample {
    pub at: Duration,
    pub services: Option<f64>,
    pub driver: Option<f64>,
}

/// What one message went through.
#[derive(Debug, Clone, Copy)]
pub struct MessageFate {
    pub due: Duration,
    /// From due to the ACK on the phone; `None`: the phone gave up.
    pub latency: Option<Duration>,
    pub tries: u32,
}

/// What a scheduled run recorded.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Per second: (tries sent, error answers).
    pub tries: Vec<(u64, u64)>,
    pub cpu: Vec<CpuSample>,
    pub messages: Vec<MessageFate>,
}

impl Recorded {
    /// The CPU sample taken nearest `when`, if one is within `within`.
    fn sample_near(&self, when: Duration, within: Duration) -> Option<&CpuSample> {
        self.cpu
            .iter()
            .min_by_key(|s| s.at.abs_diff(when))
            .filter(|s| s.at.abs_diff(when) <= within)
    }

    /// CPU seconds `pick` read between the samples nearest `from` and `to`.
    fn spent(
        &self,
        from: Duration,
        to: Duration,
        pick: fn(&CpuSample) -> Option<f64>,
    ) -> Option<f64> {
        let (first, last) = (
            self.sample_near(from, Duration::MAX)?,
            self.sample_near(to, Duration::MAX)?,
        );
        Some(pick(last)? - pick(first)?)
    }

    /// The services' cores over the second from `from`, between the samples
    /// nearest its ends (each within half a second of it).
    fn services_cores(&self, from: Duration) -> Option<f64> {
        let half = Duration::from_millis(500);
        let first = self.sample_near(from, half)?;
        let last = self.sample_near(from + Duration::from_secs(1), half)?;
        let seconds = last.at.checked_sub(first.at)?.as_secs_f64();
        (seconds > 0.0).then_some((last.services? - first.services?) / seconds)
    }
}

/// One second of the run.
#[derive(Debug, Clone, Serialize)]
pub struct SecondFigures {
    pub second: u64,
    pub phase: String,
    pub offered: u64,
    /// ACKs that reached phones in this second.
    pub goodput: u64,
    pub tries: u64,
    pub refused: u64,
    /// p50 and p99 latency of the messages due in this second, in ms
    /// (gave-ups count as infinitely late): a slow p99 with a fast p50 is
    /// a few messages held back, a slow p50 is the whole second waiting.
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// The services' CPU in this second, in cores, and per ACK reaching a
    /// phone in it, in µs (with `--admin`; between the samples nearest the
    /// second's ends, taken once a second, so a sample late by half a
    /// second shifts work into the next second).
    pub services_cores: Option<f64>,
    pub services_us: Option<f64>,
}

/// One phase's figures.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseFigures {
    pub name: String,
    pub rate: f64,
    pub messages: u64,
    /// The lowest goodput of any second after the phase's first two, as a
    /// fraction of the capacity (phases of more than two seconds).
    pub min_goodput: Option<f64>,
    pub tries_per_message: f64,
    pub gave_up: u64,
    /// Services' CPU per message acknowledged during the phase, in µs.
    pub services_us: Option<f64>,
    /// The driver's CPU over the phase, in cores.
    pub driver_cores: Option<f64>,
    /// For a phase after a surge: seconds from its start until the p99 of
    /// new messages was back within the base's (and stayed so).
    pub recovered_after_s: Option<f64>,
}

/// The whole result.
#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    pub capacity: f64,
    pub base_p99_ms: f64,
    pub seconds: Vec<SecondFigures>,
    pub phases: Vec<PhaseFigures>,
    /// Messages of the 3x surge that no schedule could have served within
    /// the phones' give-up time at the capacity.
    pub surge_infeasible: u64,
    /// The services' CPU per ACK at the capacity, from the search's last
    /// sustained step (with `--admin`).
    pub services_us_at_capacity: Option<f64>,
}

/// p99 of `latencies` in ms, `None` counting as infinite.
fn p99_ms(latencies: &mut [Option<Duration>]) -> f64 {
    quantile_ms(latencies, 0.99)
}

/// Quantile `q` of `latencies` in ms, `None` counting as infinite.
fn quantile_ms(latencies: &mut [Option<Duration>], q: f64) -> f64 {
    if latencies.is_empty() {
        return 0.0;
    }
    latencies.sort_by_key(|l| l.unwrap_or(Duration::MAX));
    let index = ((latencies.len() - 1) as f64 * q).round() as usize;
    latencies[index].map_or(f64::INFINITY, |l| l.as_secs_f64() * 1000.0)
}

/// The per-second p99 a recovered service is back within: the base's, with
/// room for the noise of a shared box.
fn recovered_bound(base_p99_ms: f64) -> f64 {
    (base_p99_ms * 2.0).max(base_p99_ms + 50.0)
}

/// Messages of the 3x surge that no schedule at `capacity` answers within
/// `give_up` of when they were due: the whole schedule served one message
/// at a time at the capacity, in order of due time, each message that
/// could only be answered later than `give_up` after it was due skipped
/// (its phone gives up; serving it would only make later ones late).
/// Every message has the same time to be answered, so serving the oldest
/// one that can still make it is the best any schedule does; the backlog
/// left from before the surge and the load after it count.
fn surge_infeasible(capacity: f64, schedule: &[Phase], give_up: Duration) -> u64 {
    let Some(i) = schedule.iter().position(|p| p.name == "3x") else {
        return 0;
    };
    let start: Duration = schedule[..i].iter().map(|p| p.duration).sum();
    let surge = start..start + schedule[i].duration;
    let (each, give_up) = (1.0 / capacity, give_up.as_secs_f64());
    let mut free = 0.0_f64;
    let mut missed = 0;
    for due in schedule_dues(schedule) {
        let at = due.as_secs_f64();
        let answered = free.max(at) + each;
        if answered - at <= give_up {
            free = answered;
        } else if surge.contains(&due) {
            missed += 1;
        }
    }
    missed
}

impl Figures {
    pub fn new(capacity: f64, schedule: &[Phase], recorded: &Recorded, give_up: Duration) -> Self {
        let end = recorded
            .messages
            .iter()
            .map(|m| m.due + m.latency.unwrap_or_default())
            .max()
            .unwrap_or_default()
            .as_secs() as usize
            + 1;
        let mut due: Vec<Vec<Option<Duration>>> = vec![Vec::new(); end.max(1)];
        let mut goodput = vec![0u64; end.max(1)];
        for m in &recorded.messages {
            due[m.due.as_secs() as usize].push(m.latency);
            if let Some(latency) = m.latency {
                goodput[(m.due + latency).as_secs() as usize] += 1;
            }
        }
        let phase_at = |second: u64| {
            let mut start = 0.0;
            for phase in schedule {
                start += phase.duration.as_secs_f64();
                if (second as f64) < start {
                    return phase.name.clone();
                }
            }
            "tail".to_owned()
        };
        let seconds: Vec<SecondFigures> = (0..end)
            .map(|s| {
                let (tries, refused) = recorded.tries.get(s).copied().unwrap_or_default();
                let services_cores = recorded.services_cores(Duration::from_secs(s as u64));
                SecondFigures {
                    second: s as u64,
                    phase: phase_at(s as u64),
                    offered: due[s].len() as u64,
                    goodput: goodput[s],
                    tries,
                    refused,
                    p50_ms: quantile_ms(&mut due[s], 0.5),
                    p99_ms: p99_ms(&mut due[s]),
                    services_cores,
                    services_us: services_cores
                        .filter(|_| goodput[s] > 0)
                        .map(|cores| cores * 1e6 / goodput[s] as f64),
                }
            })
            .collect();

        let mut phases = Vec::new();
        let mut start = Duration::ZERO;
        let mut base_p99_ms = 0.0;
        for phase in schedule {
            let stop = start + phase.duration;
            let of_phase: Vec<&MessageFate> = recorded
                .messages
                .iter()
                .filter(|m| m.due >= start && m.due < stop)
                .collect();
            let mut latencies: Vec<Option<Duration>> = of_phase.iter().map(|m| m.latency).collect();
            let p99 = p99_ms(&mut latencies);
            if phase.name == "base" {
                base_p99_ms = p99;
            }
            let (first, last) = (start.as_secs() as usize, stop.as_secs() as usize);
            let min_goodput = seconds
                .get(first + 2..last)
                .and_then(|s| s.iter().map(|s| s.goodput).min())
                .map(|g| g as f64 / capacity);
            let messages = of_phase.len() as u64;
            let tries: u64 = of_phase.iter().map(|m| u64::from(m.tries)).sum();
            let gave_up = of_phase.iter().filter(|m| m.latency.is_none()).count() as u64;
            // CPU over the phase's seconds, per message acknowledged in them.
            let acked: u64 = goodput.get(first..last).map_or(0, |g| g.iter().sum());
            let services_us = recorded
                .spent(start, stop, |s| s.services)
                .map(|s| s * 1e6 / acked.max(1) as f64);
            let driver_cores = recorded
                .spent(start, stop, |s| s.driver)
                .map(|d| d / phase.duration.as_secs_f64().max(1e-9));
            let recovered_after_s = phase.name.starts_with("after").then(|| {
                let bound = recovered_bound(base_p99_ms);
                let inside = seconds.get(first..last).unwrap_or_default();
                let bad = inside.iter().rposition(|s| s.p99_ms > bound);
                bad.map_or(0.0, |b| (b + 1) as f64)
            });
            phases.push(PhaseFigures {
                name: phase.name.clone(),
                rate: phase.rate,
                messages,
                min_goodput,
                tries_per_message: tries as f64 / messages.max(1) as f64,
                gave_up,
                services_us,
                driver_cores,
                recovered_after_s,
            });
            start = stop;
        }
        let surge_infeasible = surge_infeasible(capacity, schedule, give_up);
        Self {
            capacity,
            base_p99_ms,
            seconds,
            phases,
            surge_infeasible,
            services_us_at_capacity: None,
        }
    }

    fn phase(&self, name: &str) -> Option<&PhaseFigures> {
        self.phases.iter().find(|p| p.name == name)
    }

    /// The scenario's report: per second, per phase, and last the line in
    /// the form `overload: capacity C/s; at 1.5x goodput …`.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "overload: per second  {:>4}  {:<11} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>8}",
            "t",
            "phase",
            "offered",
            "goodput",
            "tries",
            "refused",
            "p50 ms",
            "p99 ms",
            "svc cores",
            "µs/ACK"
        );
        let figure = |v: Option<f64>, digits: usize| {
            v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
        };
        for s in &self.seconds {
            let _ = writeln!(
                out,
                "overload: per second  {:>4}  {:<11} {:>8} {:>8} {:>8} {:>8} {:>9.0} {:>9.0} {:>9} {:>8}",
                s.second,
                s.phase,
                s.offered,
                s.goodput,
                s.tries,
                s.refused,
                s.p50_ms,
                s.p99_ms,
                figure(s.services_cores, 2),
                figure(s.services_us, 0)
            );
        }
        for p in &self.phases {
            let cpu = p
                .services_us
                .map(|us| format!(", services {us:.0} µs per ACK"))
                .unwrap_or_default();
            let driver = p
                .driver_cores
                .map(|c| format!(", driver {c:.2} cores"))
                .unwrap_or_default();
            let recovered = p
                .recovered_after_s
                .map(|s| {
                    format!(
                        ", p99 back within {:.0} ms after {s:.0} s",
                        recovered_bound(self.base_p99_ms)
                    )
                })
                .unwrap_or_default();
            let goodput = p
                .min_goodput
                .map(|g| format!(", lowest goodput {:.0}% of C", g * 100.0))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "overload: phase {:<11} {:>7.0}/s, {} messages{goodput}, tries {:.2}, gave up {}{cpu}{driver}{recovered}",
                p.name, p.rate, p.messages, p.tries_per_message, p.gave_up
            );
        }
        if let (Some(at_c), Some(surge)) = (
            self.services_us_at_capacity,
            self.phase("3x").and_then(|p| p.services_us),
        ) {
            let _ = writeln!(
                out,
                "overload: services CPU per ACK {surge:.0} µs at 3x, {at_c:.0} µs at C (the capacity search): {:.2}x",
                surge / at_c
            );
        }
        let _ = writeln!(
            out,
            "overload: base p99 {:.0} ms; of the 3x surge, {} messages could not be served within the give-up time by any schedule at C",
            self.base_p99_ms, self.surge_infeasible
        );
        let at = |name: &str| {
            self.phase(name).map_or((0.0, 0.0, 0), |p| {
                (
                    p.min_goodput.unwrap_or(0.0) * 100.0,
                    p.tries_per_message,
                    p.gave_up,
                )
            })
        };
        let (g1, t1, f1) = at("1.5x");
        let (g3, t3, f3) = at("3x");
        let _ = writeln!(
            out,
            "overload: capacity {:.0}/s; at 1.5x goodput {g1:.0}% of C, tries {t1:.2}, gave up {f1}; at 3x goodput {g3:.0}% of C, tries {t3:.2}, gave up {f3}",
            self.capacity
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_sends_each_phase_at_its_rate_one_after_the_other() {
        let schedule = [
            Phase::new("a", 10.0, Duration::from_secs(2)),
            Phase::new("b", 100.0, Duration::from_secs(1)),
        ];
        let dues = schedule_dues(&schedule);
        assert_eq!(dues.len(), 120);
        assert_eq!(dues[19], Duration::from_millis(1900));
        assert_eq!(dues[20], Duration::from_secs(2));
        assert!(dues.windows(2).all(|w| w[0] <= w[1]));
    }

    /// What no schedule serves of a 3x surge: from an empty queue, at
    /// most the capacity times the surge and the give-up time together
    /// (20 s of 300 a second against 100 a second for 51 s: 900 missed,
    /// one in three of those due after 15.5 s still served, just in time);
    /// the backlog left from the 1.5x surge, and more of it when the load
    /// between the surges is nearer the capacity, only adds to it.
    #[test]
    fn what_no_schedule_serves_counts_the_backlog_before_the_surge() {
        let give_up = Duration::from_secs(31);
        let surge = Duration::from_secs(20);
        let alone = surge_infeasible(100.0, &[Phase::new("3x", 300.0, surge)], give_up);
        assert!((895..=905).contains(&alone), "{alone}");
        let after = |calm| surge_infeasible(100.0, &phases(100.0, surge, calm), give_up);
        assert!(after(0.5) > alone, "{} against {alone}", after(0.5));
        assert!(
            after(0.8) > after(0.5),
            "{} against {}",
            after(0.8),
            after(0.5)
        );
    }

    #[test]
    fn figures_count_goodput_by_ack_time_and_give_ups_by_phase() {
        let schedule = phases(100.0, Duration::from_secs(4), 0.5);
        let dues = schedule_dues(&schedule);
        // Every message of the 1.5x surge takes 1.5 s and two tries; one of
        // the 3x surge is never answered.
        let surge = Duration::from_secs(1)..Duration::from_secs(5);
        let messages: Vec<MessageFate> = dues
            .iter()
            .enumerate()
            .map(|(n, &due)| MessageFate {
                due,
                latency: if n == dues.len() - 300 {
                    None
                } else if surge.contains(&due) {
                    Some(Duration::from_millis(1500))
                } else {
                    Some(Duration::from_millis(10))
                },
                tries: if surge.contains(&due) { 2 } else { 1 },
            })
            .collect();
        let recorded = Recorded {
            tries: Vec::new(),
            cpu: Vec::new(),
            messages,
        };
        let figures = Figures::new(100.0, &schedule, &recorded, Duration::from_secs(31));
        let surge = figures.phase("1.5x").unwrap();
        assert_eq!(surge.messages, 600);
        assert!((surge.tries_per_message - 2.0).abs() < 1e-9);
        assert_eq!(surge.gave_up, 0);
        // Seconds 3 and 4 of the run (the surge's third and fourth) carry
        // ACKs of messages due 1.5 s earlier: 150 a second.
        assert_eq!(surge.min_goodput, Some(1.5));
        assert_eq!(figures.phase("base").unwrap().min_goodput, None);
        assert_eq!(figures.phase("3x").unwrap().gave_up, 1);
        let after = figures.phase("after 1.5x").unwrap();
        assert_eq!(after.recovered_after_s, Some(0.0));
        // Per second, the p50 and p99 of the messages due in it.
        let (base, surge) = (&figures.seconds[0], &figures.seconds[2]);
        assert_eq!((base.p50_ms, base.p99_ms), (10.0, 10.0));
        assert_eq!((surge.p50_ms, surge.p99_ms), (1500.0, 1500.0));
        assert!(figures.render().lines().last().unwrap().starts_with(
            "overload: capacity 100/s; at 1.5x goodput 150% of C, tries 2.00, gave up 0; at 3x"
        ));
    }

    #[test]
    fn each_second_reports_the_services_cores_and_their_cpu_per_ack() {
        let schedule = [Phase::new("base", 100.0, Duration::from_secs(4))];
        let messages: Vec<MessageFate> = schedule_dues(&schedule)
            .into_iter()
            .map(|due| MessageFate {
                due,
                latency: Some(Duration::from_millis(10)),
                tries: 1,
            })
            .collect();
        // Sampled 0.2 s into each second; the services use half a core,
        // then a whole one from 2.2 s; the sample near 4 s is missing.
        let cpu = [0.0, 0.5, 1.0, 2.0]
            .into_iter()
            .enumerate()
            .map(|(n, services)| CpuSample {
                at: Duration::from_millis(200 + 1000 * n as u64),
                services: Some(services),
                driver: None,
            })
            .collect();
        let recorded = Recorded {
            tries: Vec::new(),
            cpu,
            messages,
        };
        let figures = Figures::new(100.0, &schedule, &recorded, Duration::from_secs(31));
        let cores: Vec<Option<f64>> = figures.seconds.iter().map(|s| s.services_cores).collect();
        assert_eq!(cores[..4], [Some(0.5), Some(0.5), Some(1.0), None]);
        // 100 ACKs in second 2, at a whole core: 10,000 µs each.
        assert_eq!(figures.seconds[2].goodput, 100);
        assert_eq!(figures.seconds[2].services_us, Some(10_000.0));
        assert_eq!(figures.seconds[3].services_us, None);
        let second_2 = figures.render().lines().nth(3).unwrap().to_owned();
        assert!(second_2.ends_with("1.00    10000"), "{second_2}");
    }
}
