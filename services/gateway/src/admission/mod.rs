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
//! its appointment when the gateway is less than [`PULL_FORWARD`] full:
//! then no new send is there to take the place, and keeping it for the
//! appointment would leave capacity idle while sends wait. Nothing waits
//! on a clock: the places given back drive the queue (and while fewer than
//! that are in flight, nothing is held). A held send still there long
//! after its appointment ([`STALE_AFTER`] the horizon) is given up.
//!
//! **New sends first once the surge is over.** Once new sends arrive
//! slower than the gateway answers ([`rates::DRAIN_SHARE`], smoothed over quarter
//! seconds, or in each of two quarter seconds in a row), and until they
//! arrive as fast again ([`rates::SURGE_SHARE`]), the
//! backlog is draining: a new send then goes in up to twice
//! the limit, and held sends take places only below the limit. New
//! messages flow at their usual latency while the backlog drains with what
//! they leave; in order of arrival they would wait behind all of it. The
//! new messages held behind the backlog in the moments before the drain
//! was seen (since the quarter second in which the backlog last grew)
//! move to its front when it is ([`Call::Ahead`]).
//! During a surge (more arriving than answered) the queue stays in order
//! of arrival, so no held send is starved by the surge's new sends. A send
//! behind a held send of its conversation still waits for it, so while
//! the backlog drains that conversation's held sends go first
//! ([`Admission::hold_urgent`]): ahead of the rest of the backlog, up to
//! twice the limit, each once the one before it is answered (the caller's
//! rule), so that none holds a place while it waits for its turn. Every
//! send in flight waits at the shards, so a backlog holding the whole
//! limit would still make a new send wait for all of it; while new sends
//! are in flight the backlog keeps to a share of the limit that adapts to
//! their latency against the latency measured before the surge
//! ([`DrainCap`]).
//!
//! Appointments are by (sender, message ID), hashed: another connection of
//! the same phone with the same message keeps the same turn, and a hash
//! collision only gives a stranger's message a turn early.

use std::{
    collections::{HashMap, VecDeque},
    hash::{BuildHasher, Hash, Hasher, RandomState},
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use imdedup_domain::{Error, ErrorKind, model::Ack};
use rand::Rng;
use tokio::sync::oneshot;

mod drain;
mod rates;

use drain::{DRAIN_BEHIND, DrainCap};
use imdedup_runtime::aimd::Aimd;
use rates::{Flow, Pace};

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
/// for the surge's and waited behind it.
pub const FRESH_FOR: Duration = Duration::from_secs(5);

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
        if age < ARRIVING_FOR {
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

/// A phone comes back this much early for its appointment and still has it.
const EARLY: Duration = Duration::from_millis(20);
/// The shortest wait asked for.
const MIN_WAIT: Duration = Duration::from_millis(5);
/// Appointments kept at most; beyond, refusals are shed without one.
const MAX_BOOKED: usize = 1 << 20;
/// An appointment nobody came for is forgotten this long after its time.
const FORGET_AFTER: Duration = Duration::from_secs(60);
/// A send held this many horizons is given up (refused): its phone has
/// resent it or given up long ago.
const STALE_AFTER: f64 = 1.5;
/// Below this share of the limit in flight, held sends go before their
/// appointment.
const PULL_FORWARD: f64 = 0.875;

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
            Ok(Call::Place(pass)) => Some(pass),
            Ok(Call::Ahead) => {
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
        (&mut self.call).await.ok()
    }
}

/// A held send in the queue.
struct Waiter {
    key: u64,
    /// Its appointment.
    due: Instant,
    /// When it was held, and whether its message was arriving then
    /// ([`Newness::Arriving`]): such sends held just before the end of a
    /// surge was seen move to the front of the backlog once it is
    /// ([`State::drain_began`]).
    held_at: Instant,
    arriving: bool,
    place: oneshot::Sender<Call>,
    /// Whose its place will be: a new send's when it was held ahead of the
    /// backlog ([`Refusal::AheadOfBacklog`]), so the draining backlog keeps
    /// to its share while it is in flight; the backlog's otherwise.
    holder: Holder,
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("due", &self.due)
            .finish_non_exhaustive()
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
        let arriving = Newness::of(age) == Newness::Arriving;
        self.enqueue(sender, id, wait, Lane::Backlog, Holder::Backlog, arriving)
    }

    /// Hold the send of (`sender`, `id`) at the front of the backlog: a
    /// new message held behind it before the drain was seen
    /// ([`Call::Ahead`]), once the send before it in its conversation was
    /// answered. It takes a place within the backlog's share, before any
    /// other held send of the backlog, so the new sends arriving meanwhile
    /// do not wait behind it (in the queue of [`Admission::hold_urgent`]
    /// they did: 0.5-1 s in the 3rd-5th second after a 3x surge).
    pub fn hold_ahead(self: &Arc<Self>, sender: &str, id: &[u8]) -> Ticket {
        self.enqueue(
            sender,
            id,
            Duration::ZERO,
            Lane::Ahead,
            Holder::Backlog,
            false,
        )
    }

    /// Hold the send of (`sender`, `id`) ahead of the backlog, up to twice
    /// the limit: while the backlog drains, for the held sends of a
    /// conversation that a new send waits behind, each once the send
    /// before it was answered (it gives up any ticket it held: that
    /// waiter is dropped from the queue as it comes up); and for a `new`
    /// send that found every place taken ([`Refusal::AheadOfBacklog`]).
    pub fn hold_urgent(self: &Arc<Self>, sender: &str, id: &[u8], new: bool) -> Ticket {
        let holder = if new { Holder::New } else { Holder::Backlog };
        self.enqueue(sender, id, Duration::ZERO, Lane::Urgent, holder, false)
    }

    fn enqueue(
        self: &Arc<Self>,
        sender: &str,
        id: &[u8],
        wait: Duration,
        lane: Lane,
        holder: Holder,
        arriving: bool,
    ) -> Ticket {
        let (tx, call) = oneshot::channel();
        let now = Instant::now();
        let waiter = Waiter {
            key: self.key(sender, id),
            due: now + wait,
            held_at: now,
            arriving,
            place: tx,
            holder,
        };
        self.lock().hold(waiter, lane);
        self.dispatch();
        Ticket { call, ahead: false }
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

    /// The limit, the appointments open and the sends in flight below
    /// which held sends may take a place at their appointment (see
    /// [`DrainCap`]), read at once, for the gauges.
    pub fn gauges(&self) -> AdmissionGauges {
        let state = self.lock();
        AdmissionGauges {
            limit: state.aimd.limit(),
            booked: state.book.len(),
            backlog_places: state.backlog_room(Instant::now()),
        }
    }

    /// As if the end of a surge had just been seen, the surge last seen
    /// at `since` ([`State::drain_began`]).
    #[cfg(test)]
    pub(crate) fn drain_began(&self, since: Instant) {
        self.lock().drain_began(since);
    }

    /// Appointments given out and not kept yet (held sends included).
    pub fn booked(&self) -> usize {
        self.lock().book.len()
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

#[derive(Debug)]
struct State {
    aimd: Aimd,
    /// A send answered later than this cuts the limit.
    target: Duration,
    in_flight: usize,
    /// Of those, new sends (see [`Pass`]).
    new_in_flight: usize,
    /// The backlog's share of the places while it drains.
    drain: DrainCap,
    /// What the gateway serves per second when it is full: the pace of
    /// appointments.
    pace: Pace,
    /// New sends arriving against sends answered.
    flow: Flow,
    /// The last appointment given out.
    last_slot: Instant,
    book: HashMap<u64, Instant>,
    last_sweep: Instant,
    /// Held sends, in the order of their appointments.
    held: VecDeque<Waiter>,
    /// Held sends that go before `held`: of conversations a new send waits
    /// in while the backlog drains.
    urgent: VecDeque<Waiter>,
    /// Held sends at the front of the backlog ([`Admission::hold_ahead`]).
    ahead: VecDeque<Waiter>,
}

/// Which queue a held send waits in; the urgent one is served first, the
/// backlog last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Lane {
    /// With the backlog, at its appointment ([`Admission::hold`]).
    Backlog,
    /// At the front of the backlog ([`Admission::hold_ahead`]).
    Ahead,
    /// Ahead of the backlog ([`Admission::hold_urgent`]).
    Urgent,
}

impl State {
    fn new(options: AdmissionOptions, now: Instant) -> Self {
        Self {
            aimd: Aimd::new(options.initial, options.min, options.max),
            target: options.target,
            in_flight: 0,
            new_in_flight: 0,
            drain: DrainCap::new(options.initial as f64),
            pace: Pace::new(now),
            flow: Flow::new(now),
            last_slot: now,
            book: HashMap::new(),
            last_sweep: now,
            held: VecDeque::new(),
            urgent: VecDeque::new(),
            ahead: VecDeque::new(),
        }
    }

    /// Take in `key`'s send, of a message as new as `newness`, or refuse
    /// it.
    fn admit(
        &mut self,
        key: u64,
        newness: Newness,
        now: Instant,
        options: &AdmissionOptions,
        rng: &mut impl Rng,
    ) -> Result<Holder, Refusal> {
        let limit = self.aimd.limit();
        let appointment = self.book.get(&key).copied();
        let new = appointment.is_none() && newness.fresh();
        if appointment.is_none() && newness == Newness::Arriving {
            self.arrived(now);
        }
        let admitted = match appointment {
            // Its turn: in, even above the limit (the appointments are
            // paced at what the gateway serves), up to twice the limit.
            Some(slot) if slot <= now + EARLY => self.in_flight < limit.saturating_mul(2),
            // The surge is over: a new send goes before the backlog.
            None if new && self.draining() => self.in_flight < limit.saturating_mul(2),
            // An old message the gateway had not seen, while the backlog
            // drains: one of the backlog, within its share of the places.
            // Up to the limit, the phones refused past the horizon in a 3x
            // surge, back 20 s later at up to 18,000 a second, could fill
            // the places, and every new send waited behind them at the
            // shards.
            None if self.draining() => self.in_flight < self.backlog_room(now),
            // A free place is taken by whoever comes, new or early: a place
            // kept for a later appointment would be capacity lost for good.
            Some(_) | None => self.in_flight < limit,
        };
        if admitted {
            let holder = if new {
                self.new_in_flight += 1;
                Holder::New
            } else {
                // A phone back for its appointment, or an old message the
                // gateway had not seen: the backlog's.
                self.book.remove(&key);
                Holder::Backlog
            };
            self.in_flight += 1;
            return Ok(holder);
        }
        match appointment {
            // Early: the same appointment.
            Some(slot) if slot > now + EARLY => {
                return Err(Refusal::Appointment {
                    retry_after: (slot - now).max(MIN_WAIT),
                });
            }
            // The surge is over and every place is taken: a new send
            // still goes before the backlog, at the next place. Booked
            // behind it, new messages waited for all of it (14-20 s after a
            // 3x surge against the chart's budget for held sends, which
            // leaves most of the backlog with the phones).
            None if new && self.draining() && self.book.len() < MAX_BOOKED => {
                self.pace.refused(now);
                return Err(self.ahead_of_backlog(key, now));
            }
            // On time, but the gateway is far over its limit (the
            // appointments were paced faster than it now serves): a new
            // appointment at the end. Asking it back sooner, while the
            // gateway stays over its limit, made every such phone come
            // back a few times a second (measured: 40,000 refusals a
            // second at 12,000 sends a second offered).
            Some(_) | None => {}
        }
        self.pace.refused(now);
        Err(self.book(key, now, options, rng))
    }

    /// A new send arrived: counted for the drain rule.
    fn arrived(&mut self, now: Instant) {
        if let Some(since) = self.flow.arrived(now) {
            self.drain_began(since);
        }
    }

    /// The gateway just saw that the surge is over, the backlog having
    /// last grown in the quarter second from `since`: the
    /// sends held from then on whose messages were arriving when held are
    /// new messages written after the surge (or in its last moment), held
    /// behind the backlog only because the end was not seen yet. They move
    /// to its front. (Left in the queue, the new messages of the first
    /// second after a 3x surge waited 20-30 s.) Their connections move
    /// them once the sends before them in their conversations are
    /// answered, and move those ahead, so the conversations' order holds
    /// ([`Call::Ahead`]).
    fn drain_began(&mut self, since: Instant) {
        // Held sends are pushed at the back as they come, so those held
        // since then are the end of the queue.
        let from = self
            .held
            .iter()
            .rposition(|waiter| waiter.held_at < since)
            .map_or(0, |before| before + 1);
        let recent: Vec<Waiter> = self.held.drain(from..).collect();
        for waiter in recent {
            if waiter.arriving {
                self.book.remove(&waiter.key);
                let _ = waiter.place.send(Call::Ahead);
            } else {
                self.held.push_back(waiter);
            }
        }
    }

    /// [`Admission::appoint`].
    fn appoint(
        &mut self,
        key: u64,
        newness: Newness,
        now: Instant,
        options: &AdmissionOptions,
        rng: &mut impl Rng,
    ) -> Refusal {
        if let Some(&slot) = self.book.get(&key) {
            return Refusal::Appointment {
                retry_after: slot.saturating_duration_since(now).max(MIN_WAIT),
            };
        }
        if newness == Newness::Arriving {
            self.arrived(now);
        }
        if newness.fresh() {
            // A new message while the backlog drains waits only for its
            // conversation's held sends, which go ahead of the backlog.
            // Booked at the end, it waited for all of the backlog when it
            // could not be held (the budget for held sends full).
            if self.draining() && self.book.len() < MAX_BOOKED {
                return self.ahead_of_backlog(key, now);
            }
        }
        self.book(key, now, options, rng)
    }

    /// An appointment for `key` one send's time from now, ahead of the
    /// backlog's.
    fn ahead_of_backlog(&mut self, key: u64, now: Instant) -> Refusal {
        let slot = now + self.pace.spacing();
        self.book.insert(key, slot);
        Refusal::AheadOfBacklog {
            retry_after: (slot - now).max(MIN_WAIT),
        }
    }

    /// Give `key` the next appointment (or shed it past the horizon).
    fn book(
        &mut self,
        key: u64,
        now: Instant,
        options: &AdmissionOptions,
        rng: &mut impl Rng,
    ) -> Refusal {
        self.sweep(now);
        // The next appointment, one send's time after the last one.
        let spacing = self.pace.spacing();
        let slot = self.last_slot.max(now) + spacing;
        if slot > now + options.horizon || self.book.len() >= MAX_BOOKED {
            let retry_after = options.horizon.mul_f64(rng.random_range(0.9..=1.1));
            return Refusal::Shed { retry_after };
        }
        self.last_slot = slot;
        self.book.insert(key, slot);
        Refusal::Appointment {
            retry_after: (slot - now).max(MIN_WAIT),
        }
    }

    fn hold(&mut self, waiter: Waiter, lane: Lane) {
        match lane {
            Lane::Urgent => self.urgent.push_back(waiter),
            Lane::Ahead => self.ahead.push_back(waiter),
            // Appointments are handed out in order, so the queue stays in
            // their order (a send held behind its conversation's held send
            // may repeat an earlier appointment; it still goes after that
            // send).
            Lane::Backlog => self.held.push_back(waiter),
        }
    }

    /// The oldest held send, if a place is its (taken for it): its
    /// appointment has come and there is a place for an appointment, or
    /// the gateway is far enough from its limit that no new send needs the
    /// place. Held sends whose connection closed are dropped on the way,
    /// and so are those held longer than `stale` (their phones are told).
    fn next_held(&mut self, now: Instant, stale: Duration) -> Option<Waiter> {
        let limit = self.aimd.limit();
        let room = self.backlog_room(now);
        let (queue, goes) = if live_front(&mut self.urgent, &mut self.book, now, stale).is_some() {
            // Up to twice the limit, as a phone back for its appointment:
            // new sends wait for these in their conversation's turn.
            (&mut self.urgent, self.in_flight < limit.saturating_mul(2))
        } else if live_front(&mut self.ahead, &mut self.book, now, stale).is_some() {
            // The front of the backlog, within its share.
            (&mut self.ahead, self.in_flight < room)
        } else {
            let front = live_front(&mut self.held, &mut self.book, now, stale)?;
            let due = front.due <= now + EARLY && self.in_flight < room;
            let idle = (self.in_flight as f64) < (limit.min(room) as f64) * PULL_FORWARD;
            (&mut self.held, due || idle)
        };
        if !goes {
            return None;
        }
        let waiter = queue.pop_front()?;
        self.book.remove(&waiter.key);
        self.in_flight += 1;
        if waiter.holder == Holder::New {
            self.new_in_flight += 1;
        }
        Some(waiter)
    }

    fn completed(
        &mut self,
        started: Instant,
        now: Instant,
        in_flight: usize,
        completion: Completion,
    ) {
        let rtt = now.saturating_duration_since(started);
        self.pace.answered(now);
        if let Some(since) = self.flow.answered(now) {
            self.drain_began(since);
        }
        let congested = completion == Completion::Congested || rtt > self.target;
        self.aimd.update(started, now, in_flight, congested);
        let limit = self.aimd.limit();
        if self.draining() {
            if self.new_in_flight > 0 {
                let late = completion == Completion::Congested
                    || self
                        .drain
                        .bound(self.target)
                        .is_some_and(|bound| rtt > bound);
                self.drain.update(started, now, late, limit);
            }
        } else if completion == Completion::Answered
            && self.held.is_empty()
            && self.urgent.is_empty()
            && self.ahead.is_empty()
            && in_flight * 2 <= limit
        {
            self.drain.calm(rtt);
        }
    }

    /// The sends in flight below which the backlog's sends may take a
    /// place at their appointment: twice the limit, as a phone back on
    /// time; draining, the places above the limit are the new sends', and
    /// while new sends are in flight the backlog keeps below its cap, as
    /// long as it is not more than [`DRAIN_BEHIND`] behind its
    /// appointments (its phones wait for those, and give up in the end).
    fn backlog_room(&self, now: Instant) -> usize {
        let limit = self.aimd.limit();
        let behind = self
            .held
            .front()
            .is_some_and(|front| now.saturating_duration_since(front.due) > DRAIN_BEHIND);
        if !self.draining() {
            limit.saturating_mul(2)
        } else if self.new_in_flight > 0 && !behind {
            self.drain.room(limit)
        } else {
            limit
        }
    }

    /// Whether a backlog is held while new sends arrive slower than the
    /// gateway answers: the surge is over.
    fn draining(&self) -> bool {
        !(self.held.is_empty() && self.urgent.is_empty() && self.ahead.is_empty())
            && self.flow.draining()
    }

    /// Forget appointments nobody came for, now and then.
    fn sweep(&mut self, now: Instant) {
        if now.saturating_duration_since(self.last_sweep) < Duration::from_secs(1) {
            return;
        }
        self.last_sweep = now;
        self.book
            .retain(|_, slot| now.saturating_duration_since(*slot) < FORGET_AFTER);
    }
}

/// The first waiter of `queue` still worth a place: those before it whose
/// connection closed, or held longer than `stale` after their appointment,
/// are dropped (their phones are told) and their appointments forgotten.
fn live_front<'a>(
    queue: &'a mut VecDeque<Waiter>,
    book: &mut HashMap<u64, Instant>,
    now: Instant,
    stale: Duration,
) -> Option<&'a Waiter> {
    while let Some(front) = queue.front() {
        if !front.place.is_closed() && now.saturating_duration_since(front.due) <= stale {
            break;
        }
        if let Some(gone) = queue.pop_front() {
            book.remove(&gone.key);
        }
    }
    queue.front()
}

#[cfg(test)]
mod tests {
    use rand::{SeedableRng, rngs::StdRng};

    use super::{rates::PACE_WINDOW, *};

    fn options(max: usize) -> AdmissionOptions {
        AdmissionOptions {
            initial: max,
            min: 1,
            max,
            target: Duration::from_millis(250),
            horizon: Duration::from_secs(20),
        }
    }

    struct Door {
        state: State,
        options: AdmissionOptions,
        rng: StdRng,
    }

    impl Door {
        fn new(options: AdmissionOptions, now: Instant) -> Self {
            Self {
                state: State::new(options, now),
                options,
                rng: StdRng::seed_from_u64(1),
            }
        }

        /// A send of a message as new as `newness`.
        fn send(&mut self, key: u64, newness: Newness, now: Instant) -> Result<(), Refusal> {
            self.state
                .admit(key, newness, now, &self.options, &mut self.rng)
                .map(|_| ())
        }

        /// A send of a new message.
        fn admit(&mut self, key: u64, now: Instant) -> Result<(), Refusal> {
            self.send(key, Newness::Arriving, now)
        }

        /// A send of a message its phone has had for longer than
        /// [`FRESH_FOR`].
        fn admit_old(&mut self, key: u64, now: Instant) -> Result<(), Refusal> {
            self.send(key, Newness::Old, now)
        }

        fn appoint(&mut self, key: u64, newness: Newness, now: Instant) -> Refusal {
            self.state
                .appoint(key, newness, now, &self.options, &mut self.rng)
        }

        fn done(&mut self, started: Instant, now: Instant) {
            let in_flight = self.state.in_flight;
            self.state.in_flight -= 1;
            self.state
                .completed(started, now, in_flight, Completion::Answered);
        }
    }

    fn wait(refusal: Result<(), Refusal>) -> Duration {
        match refusal {
            Err(Refusal::Appointment { retry_after }) => retry_after,
            other => panic!("expected an appointment, got {other:?}"),
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
        // A held send whose connection closes gives up its turn.
        drop(hold(&admission, b"gone"));
        let mut c = hold(&admission, b"c");
        assert_eq!(admission.booked(), 4);
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
    }

    /// A new send held ahead of the backlog takes a new send's place: the
    /// draining backlog keeps to its share while it is in flight (counted
    /// as the backlog's, it let the backlog fill the limit and every new
    /// send waited behind it at the shards). A held send of the backlog
    /// moved ahead with its conversation stays the backlog's.
    #[tokio::test]
    async fn a_new_send_held_ahead_of_the_backlog_takes_a_new_sends_place() {
        let admission = Admission::new(options(10));
        let mut new = admission.hold_urgent("ana", b"new", true);
        let mut old = admission.hold_urgent("ana", b"old", false);
        let new = new.ready().expect("a free place");
        let old = old.ready().expect("a free place");
        assert_eq!(admission.lock().in_flight, 2);
        assert_eq!(admission.lock().new_in_flight, 1);
        drop(new);
        assert_eq!(admission.lock().new_in_flight, 0);
        drop(old);
        assert_eq!(admission.lock().in_flight, 0);
    }

    /// Each of `windows` quarter seconds, `answers` sends answered and
    /// `arrivals` new sends offered, the gateway kept at its limit of ten.
    fn traffic(
        door: &mut Door,
        now: &mut Instant,
        key: &mut u64,
        windows: u32,
        arrivals: u32,
        answers: u32,
    ) {
        for _ in 0..windows {
            *now += PACE_WINDOW;
            for _ in 0..answers {
                door.state.in_flight += 1;
                door.done(*now - Duration::from_millis(10), *now);
            }
            for _ in 0..arrivals {
                let _ = door.admit(*key, *now);
                *key += 1;
                door.state.in_flight = 10;
            }
        }
    }

    /// A held send of the backlog, held at its appointment.
    fn waiter(key: u64, due: Instant, place: oneshot::Sender<Call>) -> Waiter {
        Waiter {
            key,
            due,
            held_at: due,
            arriving: false,
            place,
            holder: Holder::Backlog,
        }
    }

    /// A place, for handing to a waiter in a test of the state alone.
    fn pass(now: Instant) -> Pass {
        Pass {
            admission: Admission::new(options(10)),
            started: now,
            holder: Holder::Backlog,
            completion: None,
        }
    }

    fn held(state: &mut State, key: u64, due: Instant) -> oneshot::Receiver<Call> {
        let (place, rx) = oneshot::channel();
        state.hold(waiter(key, due, place), Lane::Backlog);
        rx
    }

    /// A gateway with a limit of ten, `backlog` sends held, in a surge:
    /// three new sends arriving per send answered for a second. The
    /// receivers of the held sends' places, to keep while they count.
    fn in_a_surge(backlog: u64) -> (Door, Instant, u64, Vec<oneshot::Receiver<Call>>) {
        let mut now = Instant::now();
        let mut door = Door::new(options(10), now);
        let mut key = 0;
        traffic(&mut door, &mut now, &mut key, 1, 10, 0);
        let held = (0..backlog)
            .map(|i| held(&mut door.state, 1_000 + i, now))
            .collect();
        traffic(&mut door, &mut now, &mut key, 4, 30, 10);
        (door, now, key, held)
    }

    #[test]
    fn once_the_surge_is_over_new_sends_go_before_the_backlog() {
        let stale = Duration::from_secs(30);
        // A surge: the new sends queue behind the backlog, which goes in
        // at its appointments, up to twice the limit.
        let (mut door, mut now, mut key, _backlog) = in_a_surge(3);
        let behind = wait(door.admit(key, now));
        assert!(
            behind > Duration::from_secs(1),
            "a new send waits its turn behind the surge's: {behind:?}"
        );
        key += 1;
        assert!(
            door.state.next_held(now, stale).is_some(),
            "the backlog's turn"
        );
        door.state.in_flight = 10;
        // The surge is over: one new send arrives per two answered. A new
        // send goes in at once, above the limit; the backlog takes places
        // only below it.
        traffic(&mut door, &mut now, &mut key, 6, 5, 10);
        assert!(door.admit(key, now).is_ok(), "new sends first");
        key += 1;
        assert_eq!(door.state.in_flight, 11);
        assert!(
            door.state.next_held(now, stale).is_none(),
            "no place above the limit"
        );
        // Every place taken (twice the limit: new sends, phones back for
        // their appointments, the backlog's share): a new send is not
        // booked behind the backlog, but one send's time from now, ahead
        // of it.
        door.state.in_flight = 20;
        let last_slot = door.state.last_slot;
        let ahead = match door.admit(key, now) {
            Err(Refusal::AheadOfBacklog { retry_after }) => retry_after,
            other => panic!("expected a place ahead of the backlog, got {other:?}"),
        };
        assert!(ahead < behind / 10, "{ahead:?} against {behind:?}");
        assert_eq!(
            door.state.last_slot, last_slot,
            "the backlog's appointments keep their times"
        );
        // Back for it, the phone goes in as soon as a place is free, above
        // the limit.
        door.state.in_flight = 19;
        assert!(
            door.admit(key, now + ahead).is_ok(),
            "in at its appointment"
        );
        assert!(!door.state.book.contains_key(&key));
        key += 1;
        door.state.in_flight = 11;
        // A conversation a new send waits in goes before the backlog, even
        // above the limit (the new send waits for it).
        let (place, mut urgent) = oneshot::channel();
        door.state.hold(waiter(2_000, now, place), Lane::Urgent);
        door.state.in_flight = 12;
        let first = door
            .state
            .next_held(now, stale)
            .expect("a place above the limit");
        assert_eq!(first.key, 2_000, "the urgent one");
        assert!(first.place.send(Call::Place(pass(now))).is_ok());
        assert!(urgent.try_recv().is_ok());
        assert!(
            door.state.next_held(now, stale).is_none(),
            "not the backlog"
        );
        door.state.in_flight = 9;
        assert!(
            door.state.next_held(now, stale).is_some(),
            "then the backlog"
        );
        door.state.in_flight = 8;
        assert!(
            door.state.next_held(now, stale).is_some(),
            "the last of the backlog"
        );
        // With no backlog left, the limit holds for new sends again.
        door.state.in_flight = 10;
        assert!(
            door.admit(key, now).is_err(),
            "no backlog, no room above the limit"
        );
    }

    /// For 1.5 s after a surge, ten sends answered and two new ones
    /// arriving every quarter second, and twenty messages of the surge as
    /// new as `newness` that the phones held back and let go now.
    fn let_go(door: &mut Door, now: &mut Instant, key: &mut u64, newness: Newness) {
        for _ in 0..6 {
            *now += PACE_WINDOW;
            for _ in 0..10 {
                door.state.in_flight += 1;
                door.done(*now - Duration::from_millis(10), *now);
            }
            for _ in 0..2 {
                let _ = door.admit(*key, *now);
                *key += 1;
            }
            for _ in 0..20 {
                let _ = door.send(*key, newness, *now);
                *key += 1;
            }
            door.state.in_flight = 10;
        }
    }

    /// Messages of the surge's last seconds, written less than
    /// [`FRESH_FOR`] ago but not just now ([`ARRIVING_FOR`]), are not
    /// counted as arrivals: the end of the surge is seen while the phones
    /// let go of them (at five seconds they hid it for 3-5 s). They still
    /// go ahead of the draining backlog, as new ones.
    #[test]
    fn recent_messages_do_not_hide_the_end_of_a_surge_but_go_ahead_of_the_backlog() {
        let (mut door, mut now, mut key, _backlog) = in_a_surge(2);
        assert!(!door.state.draining(), "a surge");
        let_go(&mut door, &mut now, &mut key, Newness::Recent);
        assert!(door.state.draining(), "the surge is seen to be over");
        let new_in_flight = door.state.new_in_flight;
        assert!(
            door.send(key, Newness::Recent, now).is_ok(),
            "above the limit, as a new send"
        );
        assert_eq!(door.state.new_in_flight, new_in_flight + 1);
        assert!(door.state.in_flight > 10);
    }

    /// A send held now, of a message arriving now or not.
    fn held_now(
        state: &mut State,
        key: u64,
        now: Instant,
        arriving: bool,
    ) -> oneshot::Receiver<Call> {
        let (place, rx) = oneshot::channel();
        state.book.insert(key, now + Duration::from_secs(20));
        state.hold(
            Waiter {
                key,
                due: now + Duration::from_secs(20),
                held_at: now,
                arriving,
                place,
                holder: Holder::Backlog,
            },
            Lane::Backlog,
        );
        rx
    }

    /// The end of a surge is seen a second or so after it (the rates are
    /// smoothed): new messages held behind the backlog meanwhile go ahead
    /// of it once it is seen, as new sends arriving then do. Messages held
    /// while the surge was still seen, and old ones, stay in the queue.
    #[test]
    fn new_messages_held_before_the_end_of_a_surge_was_seen_go_ahead_once_it_is() {
        let (mut door, mut now, mut key, _backlog) = in_a_surge(2);
        let mut in_surge = held_now(&mut door.state, 100, now, true);
        traffic(&mut door, &mut now, &mut key, 2, 30, 10);
        // The surge is over: two new sends a quarter second, ten answered.
        traffic(&mut door, &mut now, &mut key, 1, 2, 10);
        assert!(!door.state.draining(), "not seen yet");
        let mut after = held_now(&mut door.state, 101, now, true);
        let mut old = held_now(&mut door.state, 102, now, false);
        traffic(&mut door, &mut now, &mut key, 4, 2, 10);
        assert!(door.state.draining(), "seen now");
        assert!(
            matches!(after.try_recv(), Ok(Call::Ahead)),
            "the new message goes ahead"
        );
        assert!(!door.state.held.iter().any(|waiter| waiter.key == 101));
        assert!(!door.state.book.contains_key(&101));
        assert!(in_surge.try_recv().is_err(), "held in the surge: stays");
        assert!(old.try_recv().is_err(), "an old message: stays");
        let queued: Vec<u64> = door.state.held.iter().map(|waiter| waiter.key).collect();
        assert_eq!(
            queued,
            [1_000, 1_001, 100, 102],
            "the rest keep their order"
        );
    }

    /// A new message moved ahead when the drain began waits at the front
    /// of the backlog: before the backlog's other held sends, but within
    /// its share of the places, so the new sends arriving meanwhile are
    /// not queued behind it.
    #[test]
    fn a_send_moved_ahead_is_the_first_of_the_backlog_within_its_share() {
        let stale = Duration::from_secs(30);
        let (mut door, mut now, mut key, _backlog) = in_a_surge(2);
        traffic(&mut door, &mut now, &mut key, 6, 5, 10);
        assert!(door.state.draining());
        let (place, _ahead) = oneshot::channel();
        door.state.hold(waiter(3_000, now, place), Lane::Ahead);
        door.state.in_flight = 10;
        assert!(
            door.state.next_held(now, stale).is_none(),
            "no place above the limit"
        );
        assert!(door.admit(key, now).is_ok(), "a new send goes in above it");
        door.state.in_flight = 0;
        let first = door.state.next_held(now, stale).expect("a free place");
        assert_eq!(first.key, 3_000, "before the rest of the backlog");
        assert_eq!(first.holder, Holder::Backlog, "one of the backlog's places");
        let next = door.state.next_held(now, stale).expect("a free place");
        assert_eq!(next.key, 1_000, "then the backlog in its order");
    }

    #[test]
    fn old_messages_do_not_hide_the_end_of_a_surge_and_wait_with_the_backlog() {
        let stale = Duration::from_secs(30);
        let (mut door, mut now, mut key, _backlog) = in_a_surge(2);
        assert!(!door.state.draining(), "a surge");
        // After it, few new messages, and twice as many old ones as the
        // gateway answers: messages the phones held back through the surge
        // and let go now. Counted as arrivals, they would hide the end of
        // the surge for as long as the phones let go.
        let_go(&mut door, &mut now, &mut key, Newness::Old);
        assert!(door.state.draining(), "the surge is seen to be over");
        // An old message does not go ahead of the backlog: no place above
        // the limit, and its appointment is behind the backlog's.
        let old = match door.admit_old(key, now) {
            Err(Refusal::Appointment { retry_after }) => retry_after,
            other => panic!("expected an appointment behind the backlog, got {other:?}"),
        };
        assert_eq!(door.state.last_slot, now + old, "booked at the end");
        key += 1;
        assert!(
            door.admit(key, now).is_ok(),
            "a new one goes in above the limit"
        );
        key += 1;
        door.state.in_flight = 20;
        assert!(
            matches!(door.admit(key, now), Err(Refusal::AheadOfBacklog { .. })),
            "a new one still goes ahead of the backlog"
        );
        key += 1;
        // New sends answered late behind the backlog shrink its share of
        // the places (see `DrainCap`). An old message takes a free place
        // only within that share, as the backlog's (not a new send's: the
        // share is not cut for it); past it, it waits its turn though the
        // limit is not reached (up to the limit, the surge's phones back
        // long after it filled the places, and new sends waited behind
        // them).
        for ms in 0..5 {
            let late = now + Duration::from_millis(ms);
            door.state.drain.update(late, late, true, 10);
        }
        let share = door.state.backlog_room(now);
        assert!(share < 9, "the backlog's share: {share}");
        door.state.in_flight = share;
        assert!(
            matches!(door.admit_old(key, now), Err(Refusal::Appointment { .. })),
            "past the backlog's share"
        );
        key += 1;
        door.state.in_flight = share - 1;
        let new_in_flight = door.state.new_in_flight;
        assert!(door.admit_old(key, now).is_ok());
        assert_eq!(door.state.new_in_flight, new_in_flight);
        assert!(
            door.state.next_held(now, stale).is_none(),
            "the backlog's share is taken"
        );
        // Behind a held send of its conversation, a new message is not
        // booked behind the backlog either; an old one is.
        key += 1;
        assert!(matches!(
            door.appoint(key, Newness::Arriving, now),
            Refusal::AheadOfBacklog { .. }
        ));
        key += 1;
        let behind = door.appoint(key, Newness::Old, now).retry_after();
        assert!(behind > old, "{behind:?} after {old:?}");
    }

    /// How many held sends `state` lets in from none in flight.
    fn backlog_room(state: &mut State, now: Instant, stale: Duration) -> usize {
        state.in_flight = 0;
        let mut taken = 0;
        while let Some(waiter) = state.next_held(now, stale) {
            state.hold(waiter, Lane::Backlog);
            taken += 1;
        }
        taken
    }

    #[test]
    fn new_sends_behind_a_draining_backlog_shrink_its_share_of_the_places() {
        let stale = Duration::from_secs(30);
        let mut now = Instant::now();
        let mut door = Door::new(options(100), now);
        // Calm: sends answered in 2 ms, a few in flight.
        for _ in 0..50 {
            door.state.in_flight += 1;
            door.done(now - Duration::from_millis(2), now);
        }
        // Held with appointments due as the surge ends: the backlog keeps
        // its appointments (within DRAIN_BEHIND) throughout.
        let due = now + Duration::from_secs(2);
        let _backlog: Vec<_> = (0..300)
            .map(|key| held(&mut door.state, 10_000 + key, due))
            .collect();
        let mut key = 0;
        traffic(&mut door, &mut now, &mut key, 8, 5, 10);
        assert!(door.state.draining());
        // Nobody new in flight: the backlog may fill the limit.
        door.state.new_in_flight = 0;
        assert_eq!(backlog_room(&mut door.state, now, stale), 100);
        // New sends in flight, answered a round trip of 100 ms each behind
        // the backlog where 2 ms was the calm: each round cuts the
        // backlog's places by a tenth, down to an eighth of the limit.
        door.state.new_in_flight = 1;
        assert_eq!(backlog_room(&mut door.state, now, stale), 100);
        for round in 1..=30 {
            let started = now;
            now += Duration::from_millis(100);
            door.state.in_flight = 50;
            door.done(started, now);
            // A late send that started before the cut says nothing new.
            door.state.in_flight = 50;
            door.done(started, now + Duration::from_millis(1));
            if round == 5 {
                assert_eq!(backlog_room(&mut door.state, now, stale), 59);
            }
        }
        assert!(door.state.draining());
        assert_eq!(backlog_room(&mut door.state, now, stale), 12);
        // Answered in time again, the share grows back, by about one
        // place per round trip.
        for _ in 0..200 {
            door.state.in_flight = 20;
            door.done(now - Duration::from_millis(5), now);
        }
        let grown = backlog_room(&mut door.state, now, stale);
        assert!((20..=30).contains(&grown), "{grown}");
        // A backlog more than DRAIN_BEHIND behind its appointments drains
        // with the whole limit: its phones wait already.
        let (place, _late) = oneshot::channel();
        door.state.held.push_front(waiter(
            1,
            now - DRAIN_BEHIND - Duration::from_millis(1),
            place,
        ));
        assert_eq!(door.state.backlog_room(now), 100);
    }

    #[test]
    fn without_a_calm_latency_the_draining_backlog_keeps_the_limit() {
        let stale = Duration::from_secs(30);
        let mut now = Instant::now();
        let mut door = Door::new(options(100), now);
        let _backlog: Vec<_> = (0..300)
            .map(|key| held(&mut door.state, 10_000 + key, now))
            .collect();
        let mut key = 0;
        traffic(&mut door, &mut now, &mut key, 8, 5, 10);
        door.state.new_in_flight = 1;
        for _ in 0..10 {
            let started = now;
            now += Duration::from_millis(100);
            door.done(started, now);
        }
        assert_eq!(backlog_room(&mut door.state, now, stale), 100);
    }

    #[test]
    fn a_held_send_long_past_its_appointment_is_given_up() {
        let now = Instant::now();
        let mut state = State::new(options(1), now);
        state.in_flight = 2;
        let (tx, mut rx) = oneshot::channel();
        state.hold(waiter(7, now, tx), Lane::Backlog);
        // Twice the limit in flight: not even at its appointment.
        assert!(state.next_held(now, Duration::from_secs(30)).is_none());
        let later = now + Duration::from_secs(31);
        assert!(state.next_held(later, Duration::from_secs(30)).is_none());
        assert!(state.held.is_empty());
        assert!(matches!(
            rx.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        ));
    }

    #[test]
    fn refused_sends_get_appointments_spaced_by_what_the_gateway_serves() {
        let now = Instant::now();
        let mut door = Door::new(options(10), now);
        // It serves 100 sends a second: one per 10 ms.
        door.state.pace.rate = Some(100.0);
        for key in 0..10 {
            door.admit(key, now).unwrap();
        }
        let waits: Vec<Duration> = (10..20).map(|key| wait(door.admit(key, now))).collect();
        for (n, w) in waits.iter().enumerate() {
            let expected = 0.01 * (n + 1) as f64;
            assert!(
                (w.as_secs_f64() - expected).abs() < 1e-6,
                "appointment {n}: {w:?}"
            );
        }
        assert_eq!(door.state.book.len(), 10);
    }

    #[test]
    fn a_free_place_goes_to_whoever_comes_and_an_appointment_goes_in_above_the_limit() {
        let now = Instant::now();
        let mut door = Door::new(options(4), now);
        door.state.pace.rate = Some(100.0);
        for key in 0..4 {
            door.admit(key, now).unwrap();
        }
        let back = now + wait(door.admit(100, now));
        // A place frees up before the appointment: a new send takes it
        // rather than leaving it idle.
        door.done(now, back - Duration::from_millis(5));
        door.admit(200, back - Duration::from_millis(4)).unwrap();
        // Coming early, with no place free, keeps the same appointment.
        let early = back - Duration::from_millis(30);
        assert_eq!(wait(door.admit(100, early)), Duration::from_millis(30));
        // On time: in, even though the limit is reached.
        door.admit(100, back).unwrap();
        assert_eq!(door.state.in_flight, 5);
        assert!(
            !door.state.book.contains_key(&100),
            "an appointment is used once"
        );
    }

    #[test]
    fn a_phone_on_time_while_far_over_the_limit_gets_a_new_appointment_at_the_end() {
        let now = Instant::now();
        let mut door = Door::new(options(2), now);
        door.state.pace.rate = Some(20.0);
        door.admit(0, now).unwrap();
        door.admit(1, now).unwrap();
        let back = now + wait(door.admit(2, now));
        for key in 3..10 {
            let _ = door.admit(key, now);
        }
        let last = door.state.last_slot;
        // Twice the limit in flight when it comes back.
        door.state.in_flight = 4;
        let again = back + wait(door.admit(2, back));
        assert!(again > last, "behind the ones booked after it");
        assert_eq!(door.state.last_slot, again);
    }

    #[test]
    fn appointments_end_at_the_horizon_and_are_shed_beyond_it() {
        let now = Instant::now();
        let mut door = Door::new(options(1), now);
        // Ten sends a second: 200 appointments fit in 20 s.
        door.state.pace.rate = Some(10.0);
        door.admit(0, now).unwrap();
        for key in 1..=200 {
            assert!(wait(door.admit(key, now)) <= Duration::from_secs(20));
        }
        match door.admit(201, now) {
            Err(Refusal::Shed { retry_after }) => {
                assert!(retry_after >= Duration::from_secs(18), "{retry_after:?}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_free_gateway_takes_everyone_at_once() {
        let now = Instant::now();
        let mut door = Door::new(options(100), now);
        for key in 0..100 {
            door.admit(key, now).unwrap();
        }
        assert!(door.state.book.is_empty());
    }

    #[test]
    fn offered_three_times_what_it_serves_the_door_keeps_it_busy_and_in_time() {
        // A gateway serving one send per millisecond (a CPU-bound box at
        // 1,000 sends/s), offered three new sends per millisecond for 20 s;
        // refused phones come back when told. The work inside stays within
        // the target, the gateway stays busy, and a message is tried about
        // twice.
        let start = Instant::now();
        let mut door = Door::new(AdmissionOptions::default(), start);
        let mut inside: std::collections::VecDeque<(Instant, Instant)> = Default::default();
        let mut returns: std::collections::BinaryHeap<std::cmp::Reverse<(Instant, u64)>> =
            Default::default();
        let (mut key, mut tries, mut late, mut served) = (0u64, 0u64, 0u64, 0u64);
        let mut admitted_keys = std::collections::HashSet::new();
        for ms in 0..20_000u64 {
            let now = start + Duration::from_millis(ms);
            while inside.front().is_some_and(|(_, end)| *end <= now) {
                let (started, end) = inside.pop_front().unwrap();
                served += 1;
                late += u64::from(end - started > door.options.target * 2);
                door.done(started, end);
            }
            let mut arriving: Vec<u64> = Vec::new();
            while returns.peek().is_some_and(|r| r.0.0 <= now) {
                arriving.push(returns.pop().unwrap().0.1);
            }
            for _ in 0..3 {
                key += 1;
                arriving.push(key);
            }
            for k in arriving {
                tries += 1;
                match door.admit(k, now) {
                    Ok(()) => {
                        admitted_keys.insert(k);
                        let from = inside.back().map_or(now, |(_, last)| (*last).max(now));
                        inside.push_back((now, from + Duration::from_millis(1)));
                    }
                    Err(refusal) => {
                        returns.push(std::cmp::Reverse((now + refusal.retry_after(), k)));
                    }
                }
            }
        }
        // Busy all along (it serves 1/ms), and what went in came out within
        // twice the target (phones back for their appointment may take it
        // to twice its limit).
        assert!(served >= 19_000, "served {served} in 20 s");
        assert!(late * 100 < served, "{late} of {served} answered late");
        // Of the messages served, about two tries each (the appointments
        // beyond the horizon are retried more).
        let per_served = tries as f64 / admitted_keys.len() as f64;
        assert!(per_served < 4.0, "{per_served:.2} tries per served message");
        let limit = door.state.aimd.limit();
        // Little's law: one send per millisecond times the target.
        let settled = door.options.target.as_millis() as usize;
        assert!(
            (settled * 2 / 5..=settled * 8 / 5).contains(&limit),
            "limit {limit}"
        );
    }
}
