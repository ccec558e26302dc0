//! Which sends the gateway takes in now, and when the others are to come
//! back.
//!
//! Past its capacity a service must keep serving at capacity. Two things
//! broke that before: the gateway took in up to a fixed number of sends, far
//! more than could be answered before the phones' first resend, so the work
//! inside was late work; and every refusal asked the phone back after the
//! same half second, so the refused came back together, were refused again,
//! and the refusals (a frame read, decoded, answered and read again, dozens
//! of times per message) took the CPU the sends needed. Goodput fell to a
//! tenth of capacity for as long as the load lasted.
//!
//! Two rules replace that.
//!
//! **A limit driven by time.** At most `limit` sends are in flight from
//! this gateway. The limit adapts like TCP's congestion window (AIMD): a
//! send answered later than `target`, or refused by its shard as
//! overloaded, cuts it by a tenth (at most once per round trip: a late send
//! that started before the last cut says nothing new); while sends come
//! back in time and the limit is used, it grows by one per round trip, or by
//! one per send below half the limit of the last cut (slow start). So
//! whatever the offered load, the work inside is work that finishes within
//! about `target`: Little's law makes the limit settle near capacity x
//! target.
//!
//! **Appointments.** A send that finds no room is refused at once (no
//! allocation, no backend call) with an appointment: `retry_after_ms` tells
//! the phone when its turn comes. Appointments are handed out one after the
//! other, spaced by what the gateway serves per second while it is full
//! (measured over quarter-second windows), so the phones come back at the
//! rate they can be served, not together. A phone that comes back for its
//! appointment goes in even if the limit is reached (up to twice the
//! limit); below the limit, a free place is taken by whoever comes, new
//! send or appointment, so no place is kept idle for a later appointment
//! (new sends go first when there is room, as in adaptive LIFO). A refused
//! message is therefore tried about twice, however long the queue of
//! appointments, and the wait it is given grows with the overload.
//! Appointments go no further than `horizon`; past it the phone is told to
//! come back after the horizon (jittered), without an appointment, and the
//! refusal is counted as shed.
//!
//! **Held sends.** A phone that asks for `queue` is not refused: the
//! gateway holds its send with its appointment (past the horizon, with the
//! wait it would be told), in one queue in the order of the appointments
//! ([`Admission::hold`]), and presents it itself. A
//! place given back goes to the oldest held send when its appointment has
//! come (up to twice the limit, as for a phone back on time), or whatever
//! its appointment when the gateway is less than [`door::PULL_FORWARD`] full:
//! then no new send is there to take the place, and keeping it for the
//! appointment would leave capacity idle while sends wait. Nothing waits
//! on a clock: the places given back drive the queue (and while fewer than
//! that are in flight, nothing is held). A held send still there long
//! after its appointment ([`STALE_AFTER`] the horizon) is given up.
//!
//! **New sends first once the surge is over.** Once new sends arrive
//! slower than the gateway answers ([`rates::DRAIN_SHARE`], smoothed over quarter
//! seconds, or in each of two quarter seconds in a row), and until they
//! arrive as fast again as it answered lately ([`rates::SURGE_SHARE`]; a
//! quarter second in which the answers stall is not a surge), the
//! backlog is draining: a new send then goes in up to twice
//! the limit, and the backlog's sends (held sends, and phones back for
//! their appointments with messages older than [`FRESH_FOR`]) take places
//! only within the backlog's share of the limit; a phone back on time that
//! finds none is booked again at the end. New
//! messages flow at their usual latency while the backlog drains with what
//! they leave; in order of arrival they would wait behind all of it. The
//! new messages held behind the backlog in the moments before the drain
//! was seen (since the quarter second in which the backlog last grew)
//! move to its front when it is ([`Call::Ahead`]); the new messages
//! refused then (the budget for held sends full), asked back at the end of
//! the appointments, go ahead of the backlog when their phones come back,
//! old by then, if the drain has lasted a few seconds (one begun for a
//! moment in the middle of a surge does not mark the surge's refusals).
//! A send going ahead
//! that the gateway cannot hold (its budget for held sends full) is
//! asked back at a time on a line of its own, paced as the appointments
//! are, or booked at the end if its message would be old by then
//! ([`Admission::no_room_ahead`]).
//! During a surge (more arriving than answered) the queue stays in order
//! of arrival, so no held send is starved by the surge's new sends. A send
//! behind a held send of its conversation still waits for it, so while
//! the backlog drains that conversation's held sends go first
//! ([`Admission::hold_urgent`]): ahead of the rest of the backlog, up to
//! twice the limit, each once the one before it is answered (the caller's
//! rule), so that none holds a place while it waits for its turn. There
//! they go before the new sends held with them, which go youngest message
//! first ([`held::Urgent`]). Every
//! send in flight waits at the shards, so a backlog holding the whole
//! limit would still make a new send wait for all of it; while new sends
//! are in flight the backlog keeps to a share of the limit that adapts to
//! their latency against the latency measured before the surge
//! ([`drain::DrainCap`]).
//!
//! Appointments are by (sender, message ID), hashed: another connection of
//! the same phone with the same message keeps the same turn, and a hash
//! collision only gives a stranger's message a turn early.

use std::{
    hash::{BuildHasher, Hash, Hasher, RandomState},
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use imdedup_domain::{Error, ErrorKind, model::Ack};
use imdedup_runtime::metrics::GaugeGuard;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::oneshot;

mod door;
mod drain;
mod held;
mod rates;

use door::State;
pub use held::Lane;
use held::Waiter;

/// Bounds of the admission limit and of the appointments.
#[derive(Debug, Clone, Copy)]
pub struct AdmissionOptions {
    /// Sends in flight allowed at start.
    pub initial: usize,
    /// The limit never falls below this.
    pub min: usize,
    /// The limit never grows above this (`--max-sends-in-flight`).
    pub max: usize,
    /// A send answered later than this cuts the limit.
    pub target: Duration,
    /// The furthest appointment given out.
    pub horizon: Duration,
}

impl Default for AdmissionOptions {
    fn default() -> Self {
        Self {
            initial: 512,
            min: 16,
            max: 20_000,
            target: Duration::from_millis(600),
            horizon: Duration::from_secs(20),
        }
    }
}

impl AdmissionOptions {
    /// The defaults, with `max` sends in flight at most.
    pub fn with_max(max: usize) -> Self {
        let max = max.max(1);
        let defaults = Self::default();
        Self {
            initial: defaults.initial.min(max),
            min: defaults.min.min(max),
            max,
            ..defaults
        }
    }
}

/// A message its phone has had longer than this (the send's `age_ms`) is
/// old: the phone held it back through a surge, or comes back with it
/// after a long wait. While the backlog drains it goes with the backlog,
/// not ahead of it: it takes a free place within the backlog's share or
/// waits its turn. Five seconds: the phones' throttle holds a send back up
/// to 1.5 s at a time, and a phone busy through a surge tries a message
/// written after it a few seconds late; with two, such messages were taken
/// for the surge's and waited behind it. The protocol's
/// [`imdedup_proto::FRESH_FOR`], which the phones' throttle uses too.
pub const FRESH_FOR: Duration = imdedup_proto::FRESH_FOR;

/// A message its phone has had for less than this is arriving now: it is
/// counted as an arrival for the drain rule. One second: counted up to
/// [`FRESH_FOR`], the messages of a 3x surge's last seconds, which the
/// phones' throttle let go after it, arrived at 6,000-12,000 a second
/// beside 4,200 new ones, and the drain was seen 3-5 s after the surge,
/// while the new messages of those seconds were booked behind the
/// backlog (20-30 s).
pub const ARRIVING_FOR: Duration = Duration::from_secs(1);

/// Whether a message its phone has had for `age` goes ahead of a draining
/// backlog ([`FRESH_FOR`]).
pub fn fresh(age: Duration) -> bool {
    age < FRESH_FOR
}

/// Whether a message its phone has had for `age` is arriving now
/// ([`ARRIVING_FOR`]).
pub fn arriving(age: Duration) -> bool {
    age < ARRIVING_FOR
}

/// A message as the admission sees it, by how long its phone has had it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Newness {
    /// Written just now ([`ARRIVING_FOR`]): an arrival, and fresh.
    Arriving,
    /// Fresh ([`FRESH_FOR`]) but not arriving now.
    Recent,
    /// Older: with the backlog.
    Old,
}

impl Newness {
    fn of(age: Duration) -> Self {
        if arriving(age) {
            Self::Arriving
        } else if fresh(age) {
            Self::Recent
        } else {
            Self::Old
        }
    }

    fn fresh(self) -> bool {
        self != Self::Old
    }
}

/// A send held this many horizons is given up (refused): its phone has
/// resent it or given up long ago.
const STALE_AFTER: f64 = 1.5;

/// Why a send was not taken in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Come back after `retry_after`: the send has an appointment then.
    Appointment { retry_after: Duration },
    /// A new send while the backlog drains, and no place free, some taken
    /// by phones back for their appointments: it has an appointment one
    /// send's time from now, ahead of theirs (not behind them, where it
    /// would wait for all of them). Held, it goes ahead of the backlog
    /// ([`Admission::hold_urgent`]).
    AheadOfBacklog { retry_after: Duration },
    /// No appointment could be given (past the horizon, or too many
    /// booked): come back after `retry_after`, jittered.
    Shed { retry_after: Duration },
}

impl Refusal {
    pub fn retry_after(self) -> Duration {
        match self {
            Self::Appointment { retry_after }
            | Self::AheadOfBacklog { retry_after }
            | Self::Shed { retry_after } => retry_after,
        }
    }
}

/// What the admission's gauges show: [`Admission::gauges`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionGauges {
    pub limit: usize,
    pub booked: usize,
    pub backlog_places: usize,
    /// Held sends waiting for a place now.
    pub held: usize,
    /// Whether the backlog drains ([`Admission::draining`]).
    pub draining: bool,
}

/// How an admitted send ended, for the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// Answered by its shard (an ACK or a final error).
    Answered,
    /// Refused by its shard as overloaded, or past its deadline: a sign of
    /// congestion whatever it took.
    Congested,
}

impl Completion {
    /// What a send's answer says about congestion behind the gateway.
    pub fn of(result: &Result<Ack, Error>) -> Self {
        match result {
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::Overloaded | ErrorKind::DeadlineExceeded
                ) =>
            {
                Self::Congested
            }
            _ => Self::Answered,
        }
    }
}

/// The gateway's admission: see the module's comment.
pub struct Admission {
    state: Mutex<State>,
    /// Held sends waiting for a place ([`Ticket`]s not called yet).
    waiting: Gauge,
    options: AdmissionOptions,
    keys: RandomState,
}

/// A held send's place in the queue: it receives the send's place of the
/// limit when its turn comes, or word that it is to move to the front of
/// the backlog.
pub struct Ticket {
    call: oneshot::Receiver<Call>,
    /// [`Call::Ahead`] came while asking whether the place had.
    ahead: bool,
    /// Counted among the sends waiting for a place until its call came
    /// (or the ticket is dropped).
    waiting: Option<GaugeGuard>,
}

/// What a held send's [`Ticket`] receives.
pub enum Call {
    /// Its place of the limit.
    Place(Pass),
    /// A new message held behind the backlog just before the gateway saw
    /// that the surge was over: it is out of the queue, to go to the front
    /// of the backlog ([`Admission::hold_ahead`]), its conversation's
    /// earlier held sends ahead of it.
    Ahead,
}

impl Ticket {
    /// The place, if it came already.
    pub fn ready(&mut self) -> Option<Pass> {
        match self.call.try_recv() {
            Ok(Call::Place(pass)) => {
                self.waiting = None;
                Some(pass)
            }
            Ok(Call::Ahead) => {
                self.waiting = None;
                self.ahead = true;
                None
            }
            Err(_) => None,
        }
    }

    /// Wait for the place or the word to go ahead; `None` if the send was
    /// held too long and given up. Once either came the ticket is spent.
    pub async fn call(&mut self) -> Option<Call> {
        if std::mem::take(&mut self.ahead) {
            return Some(Call::Ahead);
        }
        let call = (&mut self.call).await.ok();
        self.waiting = None;
        call
    }
}
/// A place taken by an admitted send; given back when dropped. A pass
/// dropped without [`Pass::finish`] (the send was refused further on, by
/// the user's rate) says nothing about congestion.
pub struct Pass {
    admission: Arc<Admission>,
    started: Instant,
    holder: Holder,
    completion: Option<Completion>,
}

/// Whose a place is, for what the draining backlog is allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// A new send (taken at once, or held ahead of the backlog).
    New,
    /// A held send of the backlog, a phone back for its appointment, or an
    /// old message (not [`fresh`]) taken in within the backlog's share.
    Backlog,
}

impl Pass {
    pub fn finish(mut self, completion: Completion) {
        self.completion = Some(completion);
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        Admission::release(
            &self.admission,
            self.started,
            self.holder,
            Instant::now(),
            self.completion,
        );
    }
}

impl Admission {
    pub fn new(options: AdmissionOptions) -> Arc<Self> {
        let now = Instant::now();
        Arc::new(Self {
            state: Mutex::new(State::new(options, now)),
            waiting: Gauge::default(),
            options,
            keys: RandomState::new(),
        })
    }

    /// Take in the send of (`sender`, `id`), a message its phone has had
    /// for `age`, or say when to come back.
    pub fn admit(
        self: &Arc<Self>,
        sender: &str,
        id: &[u8],
        age: Duration,
    ) -> Result<Pass, Refusal> {
        let key = self.key(sender, id);
        let now = Instant::now();
        let mut rng = rand::rng();
        self.lock()
            .admit(key, Newness::of(age), now, &self.options, &mut rng)
            .map(|holder| self.pass(now, holder))
    }

    /// The place just taken, for a send admitted at `started`.
    fn pass(self: &Arc<Self>, started: Instant, holder: Holder) -> Pass {
        Pass {
            admission: Arc::clone(self),
            started,
            holder,
            completion: None,
        }
    }

    /// An appointment for the send of (`sender`, `id`) even if there is
    /// room now: for a send that must not overtake an earlier send of its
    /// conversation that waits for its own appointment, a message its
    /// phone has had for `age`. Always a refusal: an appointment (ahead of
    /// the backlog for a new message while the backlog drains), or shed
    /// past the horizon.
    pub fn appoint(&self, sender: &str, id: &[u8], age: Duration) -> Refusal {
        let key = self.key(sender, id);
        let now = Instant::now();
        self.lock()
            .appoint(key, Newness::of(age), now, &self.options, &mut rand::rng())
    }

    /// The send of (`sender`, `id`), going ahead of the backlog, a message
    /// its phone has had for `age`, found no room to be held: when to come
    /// back ([`State::no_room_ahead`]).
    pub fn no_room_ahead(&self, sender: &str, id: &[u8], age: Duration) -> Refusal {
        let key = self.key(sender, id);
        let now = Instant::now();
        self.lock()
            .no_room_ahead(key, age, now, &self.options, &mut rand::rng())
    }

    /// Hold the send of (`sender`, `id`), a message its phone has had for
    /// `age` and whose appointment is `wait` from now, until a place is
    /// given to it (see the module's comment).
    pub fn hold(
        self: &Arc<Self>,
        sender: &str,
        id: &[u8],
        wait: Duration,
        age: Duration,
    ) -> Ticket {
        self.enqueue(sender, id, wait, Lane::Backlog, Holder::Backlog, age)
    }

    /// Hold the send of (`sender`, `id`) at the front of the backlog: a
    /// new message held behind it before the drain was seen
    /// ([`Call::Ahead`]), once the send before it in its conversation was
    /// answered. It takes a place within the backlog's share, before any
    /// other held send of the backlog, so the new sends arriving meanwhile
    /// do not wait behind it (in the queue of [`Admission::hold_urgent`]
    /// they did: 0.5-1 s in the 3rd-5th second after a 3x surge).
    pub fn hold_ahead(self: &Arc<Self>, sender: &str, id: &[u8], age: Duration) -> Ticket {
        self.enqueue(
            sender,
            id,
            Duration::ZERO,
            Lane::Ahead,
            Holder::Backlog,
            age,
        )
    }

    /// Hold the send of (`sender`, `id`) ahead of the backlog, up to twice
    /// the limit: while the backlog drains, for the held sends of a
    /// conversation that a new send waits behind, each once the send
    /// before it was answered (it gives up any ticket it held: that
    /// waiter is dropped from the queue as it comes up); and for a `new`
    /// send that found every place taken ([`Refusal::AheadOfBacklog`]),
    /// a message its phone has had for `age` ([`held::Urgent`]: the held
    /// sends a new send waits behind first, then the youngest message).
    pub fn hold_urgent(
        self: &Arc<Self>,
        sender: &str,
        id: &[u8],
        new: bool,
        age: Duration,
    ) -> Ticket {
        let holder = if new { Holder::New } else { Holder::Backlog };
        self.enqueue(sender, id, Duration::ZERO, Lane::Urgent, holder, age)
    }

    fn enqueue(
        self: &Arc<Self>,
        sender: &str,
        id: &[u8],
        wait: Duration,
        lane: Lane,
        holder: Holder,
        age: Duration,
    ) -> Ticket {
        let (tx, call) = oneshot::channel();
        let now = Instant::now();
        let waiter = Waiter {
            key: self.key(sender, id),
            due: now + wait,
            held_at: now,
            age,
            place: tx,
            holder,
        };
        self.lock().hold(waiter, lane);
        self.dispatch();
        Ticket {
            call,
            ahead: false,
            waiting: Some(GaugeGuard::up(&self.waiting)),
        }
    }

    /// Whether the backlog is draining: a backlog is held and new sends
    /// arrive slower than the gateway answers.
    pub fn draining(&self) -> bool {
        self.lock().draining()
    }

    /// Give the held sends the places that are theirs, oldest first.
    fn dispatch(self: &Arc<Self>) {
        loop {
            let now = Instant::now();
            let Some(waiter) = self.lock().next_held(now, self.stale()) else {
                return;
            };
            self.give(waiter, now);
        }
    }

    /// Hand `waiter` the place taken for it. A held send whose connection
    /// closed just now gives the place back as it is dropped.
    fn give(self: &Arc<Self>, waiter: Waiter, now: Instant) {
        let _ = waiter
            .place
            .send(Call::Place(self.pass(now, waiter.holder)));
    }

    /// How long after its appointment a held send is given up.
    fn stale(&self) -> Duration {
        self.options.horizon.mul_f64(STALE_AFTER)
    }

    /// Sends holding a place now.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.lock().in_flight
    }

    /// The limit, the appointments open, the sends in flight below which
    /// held sends may take a place at their appointment (see
    /// [`drain::DrainCap`]), the sends held and whether the backlog
    /// drains, read at once, for the gauges.
    pub fn gauges(&self) -> AdmissionGauges {
        let now = Instant::now();
        let mut state = self.lock();
        AdmissionGauges {
            limit: state.aimd.limit(),
            booked: state.booked(now),
            backlog_places: state.backlog_room(now),
            held: usize::try_from(self.waiting.get()).unwrap_or(0),
            draining: state.draining(),
        }
    }

    /// As if the end of a surge had just been seen, the surge last seen
    /// at `since` ([`State::drain_began`]).
    #[cfg(test)]
    pub(crate) fn drain_began(&self, since: Instant) {
        self.lock().drain_began(since, Instant::now());
    }

    /// Appointments given out and not kept yet (held sends included).
    pub fn booked(&self) -> usize {
        self.lock().booked(Instant::now())
    }

    fn key(&self, sender: &str, id: &[u8]) -> u64 {
        let mut hasher = self.keys.build_hasher();
        sender.hash(&mut hasher);
        id.hash(&mut hasher);
        hasher.finish()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn release(
        self: &Arc<Self>,
        started: Instant,
        holder: Holder,
        now: Instant,
        completion: Option<Completion>,
    ) {
        let next = {
            let mut state = self.lock();
            state.in_flight = state.in_flight.saturating_sub(1);
            match holder {
                Holder::New => state.new_in_flight = state.new_in_flight.saturating_sub(1),
                Holder::Backlog => {}
            }
            if let Some(completion) = completion {
                let in_flight = state.in_flight + 1;
                state.completed(started, now, in_flight, completion);
            }
            state.next_held(now, self.stale())
        };
        if let Some(waiter) = next {
            self.give(waiter, now);
            // A grown limit may have room for more.
            self.dispatch();
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    /// Options with a fixed limit of `max`, for the tests of this module
    /// and of the door's rules.
    pub(super) fn options(max: usize) -> AdmissionOptions {
        AdmissionOptions {
            initial: max,
            min: 1,
            max,
            target: Duration::from_millis(250),
            horizon: Duration::from_secs(20),
        }
    }

    /// A send refused with an appointment, held until it.
    fn hold(admission: &Arc<Admission>, id: &[u8]) -> Ticket {
        match admission.admit("ana", id, Duration::ZERO) {
            Err(Refusal::Appointment { retry_after }) => {
                admission.hold("ana", id, retry_after, Duration::ZERO)
            }
            other => panic!("expected an appointment, got {:?}", other.map(|_| ())),
        }
    }

    #[tokio::test]
    async fn held_sends_take_places_at_their_appointment_or_when_the_gateway_idles() {
        // A limit of ten: new sends first while it is busy.
        let admission = Admission::new(options(10));
        let mut first: Vec<Pass> = (0..10u8)
            .map(|i| admission.admit("ana", &[i], Duration::ZERO).unwrap())
            .collect();
        let mut a = hold(&admission, b"a");
        let mut b = hold(&admission, b"b");
        let gauges = admission.gauges();
        assert_eq!(
            (gauges.held, gauges.draining),
            (2, false),
            "held in a surge"
        );
        // A held send whose connection closes gives up its turn.
        drop(hold(&admission, b"gone"));
        let mut c = hold(&admission, b"c");
        assert_eq!(admission.booked(), 4);
        // Four in the queue, three waiting: the gauge counts the living.
        assert_eq!(admission.gauges().held, 3);
        // A place given back while the gateway stays busy goes to a new
        // send, not to a held send before its appointment.
        first.pop();
        assert!(a.ready().is_none());
        first.push(
            admission
                .admit("ana", b"new", Duration::ZERO)
                .expect("the free place"),
        );
        // Once fewer than seven eighths of the limit are in flight, the
        // held sends go, oldest first, past the closed one.
        first.truncate(9);
        assert!(a.ready().is_none(), "9 in flight of 10");
        first.truncate(8);
        let a = a.ready().expect("pulled forward");
        first.truncate(7);
        let b = b.ready().expect("pulled forward");
        assert!(c.ready().is_none(), "9 in flight");
        first.push(admission.admit("ana", b"x", Duration::ZERO).unwrap());
        // At its appointment a held send goes in even above the limit (up
        // to twice it), as a phone back for its appointment does: the
        // appointments are paced at what the gateway serves. (Before the
        // pace is measured it is ten sends a second: c's appointment is
        // 0.4 s away, the late phone's 0.5 s.)
        assert!(matches!(
            admission.admit("ana", b"late", Duration::ZERO),
            Err(Refusal::Appointment { .. })
        ));
        tokio::time::sleep(Duration::from_millis(700)).await;
        first.push(
            admission
                .admit("ana", b"late", Duration::ZERO)
                .expect("its appointment"),
        );
        assert!(c.ready().is_none(), "no place given back yet");
        first.pop();
        let c = c.ready().expect("in at its appointment, above the limit");
        assert_eq!(admission.lock().in_flight, 11);
        drop((a, b, c, first));
        assert_eq!(admission.lock().in_flight, 0);
        assert_eq!(admission.lock().new_in_flight, 0);
        assert_eq!(admission.booked(), 0, "every appointment used or dropped");
        assert_eq!(admission.gauges().held, 0);
    }

    /// A new send held ahead of the backlog takes a new send's place: the
    /// draining backlog keeps to its share while it is in flight (counted
    /// as the backlog's, it let the backlog fill the limit and every new
    /// send waited behind it at the shards). A held send of the backlog
    /// moved ahead with its conversation stays the backlog's.
    #[tokio::test]
    async fn a_new_send_held_ahead_of_the_backlog_takes_a_new_sends_place() {
        let admission = Admission::new(options(10));
        let mut new = admission.hold_urgent("ana", b"new", true, Duration::ZERO);
        let mut old = admission.hold_urgent("ana", b"old", false, Duration::ZERO);
        let new = new.ready().expect("a free place");
        let old = old.ready().expect("a free place");
        assert_eq!(admission.lock().in_flight, 2);
        assert_eq!(admission.lock().new_in_flight, 1);
        drop(new);
        assert_eq!(admission.lock().new_in_flight, 0);
        drop(old);
        assert_eq!(admission.lock().in_flight, 0);
    }
}
