//! One message's life on a phone: send, lose, wait, resend, give up.

use std::time::Duration;

use imdedup_client::{AckReply, HELD_BACK};

use crate::link::Link;
use rand::Rng;
use tokio::time::Instant;

/// When a phone resends: try k at `base × (2^k − 1)` (the book's 0, 1, 3,
/// 7, 15 s for a 1 s base), each delay stretched by up to ±`jitter`, and it
/// gives up (shows "failed") at `give_up` after the first try.
#[derive(Debug, Clone)]
pub struct ResendPolicy {
    pub base: Duration,
    pub tries: u32,
    pub give_up: Duration,
    pub jitter: f64,
}

impl ResendPolicy {
    /// The book's schedule, scaled by `time_scale` (0.01 plays 1 s as 10 ms).
    pub fn book(time_scale: f64) -> Self {
        Self {
            base: Duration::from_secs_f64(time_scale),
            tries: 5,
            give_up: Duration::from_secs_f64(31.0 * time_scale),
            jitter: 0.0,
        }
    }

    /// Offsets of every try after the first send.
    pub fn offsets(&self, rng: &mut impl Rng) -> Vec<Duration> {
        (0..self.tries)
            .map(|k| {
                let nominal = self.base.as_secs_f64() * f64::from((1u32 << k.min(20)) - 1);
                let stretch = if self.jitter > 0.0 {
                    1.0 + rng.random_range(-self.jitter..=self.jitter)
                } else {
                    1.0
                };
                Duration::from_secs_f64((nominal * stretch).max(0.0))
            })
            .collect()
    }
}

/// The network's fate for one try.
#[derive(Debug, Clone, Copy)]
pub struct Fate {
    pub send_lost: bool,
    pub ack_lost: bool,
}

/// What happened to one message.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// Every ACK the server sent, including those lost on the way back.
    pub server_acks: Vec<AckReply>,
    /// The ACK the phone finally received.
    pub received: Option<AckReply>,
    /// From the moment the message was due to the ACK reaching the phone.
    pub latency: Option<Duration>,
    pub tries: u32,
    /// Sends the phone's client held back (nothing reached the gateway;
    /// not counted in `tries`).
    pub held_back: u32,
    pub sends_lost: u32,
    pub acks_lost: u32,
    /// Error codes of tries answered with an error frame.
    pub errors: Vec<String>,
    /// When the message was due, from the start of the run.
    pub due_offset: Duration,
    /// The try that stored the message: the phone's connection (1 for the
    /// first, more after reconnects), its frame's number on it, and the seq
    /// it got.
    pub stored_by_frame: Option<(u64, u64, u64)>,
    /// Every try and its answer, in order (`--events`).
    pub events: Vec<Event>,
}

/// One step of a message's delivery: when, after the message was due
/// (for an answer, when it came back).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub at: Duration,
    pub kind: EventKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    /// A try the network lost on the way up.
    SendLost,
    /// The phone's throttle held the send back, to try again after the wait.
    HeldBack { retry_after: Option<Duration> },
    /// An error frame, with the wait it asked for.
    Refused {
        code: String,
        retry_after: Option<Duration>,
    },
    /// An ACK, received or lost on the way down.
    Acked { lost: bool },
    /// No connection, or it closed before the answer.
    NoConnection,
}

impl Trace {
    fn record(&mut self, due: Instant, kind: EventKind) {
        self.events.push(Event {
            at: due.elapsed(),
            kind,
        });
    }

    /// The message as one tab-separated line of `--events`: when it was
    /// due and its latency (ms; `-` if the phone gave up), tries, sends
    /// held back, then each step as a letter, the ms after due it
    /// happened (an answer: when it came back; a lost send: when it was
    /// sent), and the wait asked for (`+ms`): `L` lost on the way up,
    /// `H` held back, `R` an error (`:code`), `A` an ACK (`a` if lost on the
    /// way down), `C` no connection.
    pub fn events_line(&self) -> String {
        use std::fmt::Write as _;
        let ms = |d: Duration| d.as_millis();
        let mut line = format!(
            "{}\t{}\t{}\t{}\t",
            ms(self.due_offset),
            self.latency.map_or("-".to_owned(), |l| ms(l).to_string()),
            self.tries,
            self.held_back
        );
        for (i, event) in self.events.iter().enumerate() {
            if i > 0 {
                line.push(' ');
            }
            let at = ms(event.at);
            let wait = |w: &Option<Duration>| w.map_or(String::new(), |w| format!("+{}", ms(w)));
            let _ = match &event.kind {
                EventKind::SendLost => write!(line, "L{at}"),
                EventKind::HeldBack { retry_after } => write!(line, "H{at}{}", wait(retry_after)),
                EventKind::Refused { code, retry_after } => {
                    write!(line, "R{at}{}:{code}", wait(retry_after))
                }
                EventKind::Acked { lost: false } => write!(line, "A{at}"),
                EventKind::Acked { lost: true } => write!(line, "a{at}"),
                EventKind::NoConnection => write!(line, "C{at}"),
            };
        }
        line
    }
}

/// A message in the outbox.
#[derive(Debug, Clone, Copy)]
pub struct Outgoing<'a> {
    pub id: &'a [u8],
    pub conversation: &'a str,
    pub body: &'a str,
}

/// Sleep until `deadline`, or not at all when it has passed: the timer
/// wakes at millisecond ticks, so at thousands of messages a second most
/// are already due, and skipping the timer for them saves a wake-up each.
pub async fn wait_until(deadline: Instant) {
    if deadline > Instant::now() {
        tokio::time::sleep_until(deadline).await;
    }
}

/// Tries sent and error answers received, per second of the run: what the
/// server had to read, and what it refused.
#[derive(Debug)]
pub struct TryCounts {
    started: Instant,
    tries: Vec<std::sync::atomic::AtomicU64>,
    refused: Vec<std::sync::atomic::AtomicU64>,
}

impl TryCounts {
    /// Counts for `seconds` from `started` (later ones go in the last).
    pub fn new(started: Instant, seconds: usize) -> Self {
        let zeros = || (0..seconds.max(1)).map(|_| Default::default()).collect();
        Self {
            started,
            tries: zeros(),
            refused: zeros(),
        }
    }

    fn slot(&self) -> usize {
        (self.started.elapsed().as_secs() as usize).min(self.tries.len() - 1)
    }

    fn tried(&self) {
        self.tries[self.slot()].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn was_refused(&self) {
        self.refused[self.slot()].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Per second: (tries, error answers).
    pub fn per_second(&self) -> Vec<(u64, u64)> {
        let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        self.tries
            .iter()
            .zip(&self.refused)
            .map(|(t, r)| (load(t), load(r)))
            .collect()
    }
}

/// The shortest wait a retry-after hint buys: a server answering 0 ms (or
/// 1 ms) must not turn a phone into a busy loop.
const MIN_PUSHBACK: Duration = Duration::from_millis(20);

/// Deliver one message the way a phone does, starting at `due`: a try at
/// each offset, the network's fate for each, and no more tries after
/// `give_up`. The offsets are for silence (no answer: maybe the send was
/// lost, maybe its ACK). An answer that asks to wait (a retryable error with
/// a retry-after hint, gRPC's "pushback") is not silence: the phone tries
/// again once that wait is over, and the try does not use up a step of the
/// schedule, so a phone the server keeps asking to wait keeps trying until
/// `give_up` instead of running out of steps.
pub async fn deliver(
    link: &Link,
    message: Outgoing<'_>,
    due: Instant,
    offsets: &[Duration],
    fates: &[Fate],
    give_up: Duration,
    counts: &TryCounts,
) -> Trace {
    let mut trace = Trace::default();
    // When the server last asked for the next try.
    let mut pushed_to: Option<Instant> = None;
    let mut step = 0;
    while let (Some(offset), Some(fate)) = (offsets.get(step), fates.get(step)) {
        wait_until(pushed_to.take().unwrap_or(due + *offset)).await;
        if fate.send_lost {
            trace.record(due, EventKind::SendLost);
            trace.tries += 1;
            counts.tried();
            trace.sends_lost += 1;
            step += 1;
            continue;
        }
        // A connection the gateway closed is dialled again.
        let sent = match link.client().await {
            Ok((connection, client)) => client
                .send_numbered_since(
                    message.id,
                    message.conversation,
                    message.body,
                    // The message was written when it was due, however
                    // late the driver got to it.
                    due.into_std(),
                )
                .await
                .map(|(frame, reply)| (connection, frame, reply)),
            Err(e) => Err(e),
        };
        // Held back by the client: no try; the same step once the wait is
        // over.
        let held_back = matches!(&sent, Ok((_, _, Err(e))) if e.code == HELD_BACK);
        if !held_back {
            trace.tries += 1;
            counts.tried();
        }
        match sent {
            Ok((_, _, Err(e))) if held_back => {
                trace.record(
                    due,
                    EventKind::HeldBack {
                        retry_after: e.retry_after,
                    },
                );
                trace.held_back += 1;
                pushed_to = e.retry_after.map(|wait| Instant::now() + wait);
            }
            Ok((connection, frame, Ok(ack))) => {
                trace.record(
                    due,
                    EventKind::Acked {
                        lost: fate.ack_lost,
                    },
                );
                if ack.outcome == "stored" {
                    trace.stored_by_frame = Some((connection, frame, ack.seq));
                }
                trace.server_acks.push(ack.clone());
                if fate.ack_lost {
                    trace.acks_lost += 1;
                } else {
                    trace.latency = Some(due.elapsed());
                    trace.received = Some(ack);
                    return trace;
                }
            }
            Ok((_, _, Err(e))) => {
                trace.record(
                    due,
                    EventKind::Refused {
                        code: e.code.clone(),
                        retry_after: e.retry_after,
                    },
                );
                counts.was_refused();
                let retryable = e.retryable;
                trace.errors.push(e.code);
                if !retryable {
                    return trace;
                }
                if let Some(wait) = e.retry_after {
                    // The same step again, once the wait is over.
                    pushed_to = Some(Instant::now() + wait.max(MIN_PUSHBACK));
                }
            }
            Err(e) => {
                trace.record(due, EventKind::NoConnection);
                trace.errors.push(format!("connection: {e}"));
            }
        }
        if pushed_to.is_none() {
            step += 1;
        }
        let next = pushed_to.or_else(|| offsets.get(step).map(|offset| due + *offset));
        if due.elapsed() >= give_up || next.is_some_and(|next| next >= due + give_up) {
            break;
        }
    }
    trace
}

#[cfg(test)]
mod tests {
    use rand::{SeedableRng, rngs::StdRng};

    use super::*;

    #[test]
    fn the_book_schedule_is_0_1_3_7_15_and_31() {
        let policy = ResendPolicy::book(1.0);
        let secs: Vec<f64> = policy
            .offsets(&mut StdRng::seed_from_u64(1))
            .iter()
            .map(Duration::as_secs_f64)
            .collect();
        assert_eq!(secs, [0.0, 1.0, 3.0, 7.0, 15.0]);
        assert_eq!(policy.give_up, Duration::from_secs(31));
    }

    #[test]
    fn a_messages_events_line_says_each_try_its_answer_and_when() {
        let ms = Duration::from_millis;
        let event = |at, kind| Event { at: ms(at), kind };
        let trace = Trace {
            due_offset: ms(55_250),
            latency: Some(ms(1_731)),
            tries: 3,
            held_back: 1,
            events: vec![
                event(
                    0,
                    EventKind::HeldBack {
                        retry_after: Some(ms(700)),
                    },
                ),
                event(
                    702,
                    EventKind::Refused {
                        code: "overloaded".to_owned(),
                        retry_after: Some(ms(250)),
                    },
                ),
                event(960, EventKind::SendLost),
                event(1_020, EventKind::Acked { lost: true }),
                event(1_731, EventKind::Acked { lost: false }),
            ],
            ..Trace::default()
        };
        assert_eq!(
            trace.events_line(),
            "55250\t1731\t3\t1\tH0+700 R702+250:overloaded L960 a1020 A1731"
        );
        let gave_up = Trace {
            events: vec![event(31_000, EventKind::NoConnection)],
            ..Trace::default()
        };
        assert_eq!(gave_up.events_line(), "0\t-\t0\t0\tC31000");
    }

    #[test]
    fn jitter_stays_within_its_bounds() {
        let policy = ResendPolicy {
            jitter: 0.2,
            ..ResendPolicy::book(1.0)
        };
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..100 {
            let offsets = policy.offsets(&mut rng);
            assert!((0.8..=1.2).contains(&offsets[1].as_secs_f64()));
            assert!((12.0..=18.0).contains(&offsets[4].as_secs_f64()));
        }
    }
}
