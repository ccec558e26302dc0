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
//! **A short waiting room.** A send that finds the limit reached waits in
//! the gateway, in order of arrival, for the next place, if its place
//! comes within half a second (well inside a phone's first resend): a
//! burst, or phones back a little early or late, costs no refusal and no
//! second try. A place freed goes to the room first. The wait is not part
//! of the latency the limit is driven by; past a second in the room the
//! send gets an appointment like a refused one.
//!
//! **Appointments.** A send the room cannot take in time is refused at once
//! (no backend call) with an appointment: `retry_after_ms` tells the phone
//! when its turn comes. Appointments are handed out one after the other,
//! after the room, spaced by the time the gateway needs per send at its
//! current limit and latency (limit / latency is what it serves per
//! second), so the phones come back at the rate they can be served, not
//! together. A phone that comes back for its appointment goes in, or into
//! the room if the limit is reached and the room is served in time (if the
//! gateway has fallen further behind, it gets a new appointment at the
//! end); a new send does not jump ahead of the appointments given out,
//! unless more than half the limit is free. A refused message is therefore
//! tried about twice, however long the queue of appointments, and the wait
//! it is given grows with the overload.
//! Appointments go no further than `horizon`; past it the phone is told to
//! come back after the horizon (jittered), without an appointment, and the
//! refusal is counted as shed.
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

use imdedup_core::{Error, ErrorKind, model::Ack};
use rand::Rng;
use tokio::sync::oneshot;

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
            target: Duration::from_millis(250),
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

/// A phone comes back this much early for its appointment and still has it.
const EARLY: Duration = Duration::from_millis(20);
/// The shortest wait asked for.
const MIN_WAIT: Duration = Duration::from_millis(5);
/// A new send waits in the room, rather than being refused, if its place
/// comes within this: well inside a phone's first resend (1 s), with the
/// send's own time after it.
const WAIT_IN_ROOM: Duration = Duration::from_millis(500);
/// The longest a send waits in the room (one promised its turn may find
/// more ahead of it than a new one would); past it, an appointment.
pub const MAX_WAIT_IN_ROOM: Duration = Duration::from_secs(1);
/// Appointments kept at most; beyond, refusals are shed without one.
const MAX_BOOKED: usize = 1 << 20;
/// An appointment nobody came for is forgotten this long after its time.
const FORGET_AFTER: Duration = Duration::from_secs(60);

/// Why a send was not taken in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Come back after `retry_after`: the send has an appointment then.
    Appointment { retry_after: Duration },
    /// No appointment could be given (past the horizon, or too many
    /// booked): come back after `retry_after`, jittered.
    Shed { retry_after: Duration },
}

impl Refusal {
    pub fn retry_after(self) -> Duration {
        match self {
            Self::Appointment { retry_after } | Self::Shed { retry_after } => retry_after,
        }
    }
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

/// A place taken by an admitted send; given back when dropped. A pass
/// dropped without [`Pass::finish`] (the send was refused further on, by
/// the user's rate) says nothing about congestion.
///
/// A pass may be a place in the waiting room: [`Pass::ready`] waits for
/// the place itself, and must be awaited before the send goes on.
pub struct Pass {
    admission: Arc<Admission>,
    key: u64,
    started: Instant,
    completion: Option<Completion>,
    /// Still waiting for a place: it comes through this.
    waiting: Option<oneshot::Receiver<()>>,
}

impl Pass {
    /// Wait in the room until a place is free, at most `max_wait`; past
    /// it, the send gets an appointment (or is shed) like a refused one.
    pub async fn ready(&mut self, max_wait: Duration) -> Result<(), Refusal> {
        let Some(place) = self.waiting.as_mut() else {
            return Ok(());
        };
        if let Ok(Ok(())) = tokio::time::timeout(max_wait, place).await {
            self.waiting = None;
            self.started = Instant::now();
            return Ok(());
        }
        // Not handed a place in time: leave the room (a place handed over
        // meanwhile goes back in `drop`) and book a turn.
        self.give_back_waiting();
        Err(self.admission.appoint(self.key))
    }

    pub fn finish(mut self, completion: Completion) {
        self.completion = Some(completion);
    }

    /// Leave the room; a place handed over in the meantime is given back.
    fn give_back_waiting(&mut self) {
        if let Some(mut place) = self.waiting.take() {
            place.close();
            if place.try_recv().is_ok() {
                self.admission.release(self.started, Instant::now(), None);
            }
        }
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        if self.waiting.is_some() {
            self.give_back_waiting();
        } else {
            self.admission
                .release(self.started, Instant::now(), self.completion);
        }
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

    /// Take in the send of (`sender`, `id`), or say when to come back.
    pub fn admit(self: &Arc<Self>, sender: &str, id: &[u8]) -> Result<Pass, Refusal> {
        let key = self.key(sender, id);
        let now = Instant::now();
        let mut rng = rand::rng();
        let door = self.lock().admit(key, now, &self.options, &mut rng)?;
        Ok(Pass {
            admission: Arc::clone(self),
            key,
            started: now,
            completion: None,
            waiting: match door {
                Door::In => None,
                Door::Wait(place) => Some(place),
            },
        })
    }

    /// An appointment for a send that waited too long in the room.
    fn appoint(&self, key: u64) -> Refusal {
        let mut rng = rand::rng();
        self.lock()
            .book(key, Instant::now(), &self.options, &mut rng)
    }

    /// The limit now.
    pub fn limit(&self) -> usize {
        self.lock().aimd.limit()
    }

    /// Appointments given out and not kept yet.
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

    fn release(&self, started: Instant, now: Instant, completion: Option<Completion>) {
        let mut state = self.lock();
        state.in_flight = state.in_flight.saturating_sub(1);
        if let Some(completion) = completion {
            let in_flight = state.in_flight + 1;
            state.completed(started, now, in_flight, completion);
        }
        state.hand_over();
    }
}

/// What the door says to a send it takes in.
#[derive(Debug)]
enum Door {
    /// In now.
    In,
    /// In the waiting room: the place comes through this.
    Wait(oneshot::Receiver<()>),
}

#[derive(Debug)]
struct State {
    aimd: Aimd,
    in_flight: usize,
    /// Latency of admitted sends, smoothed, in seconds.
    latency: f64,
    /// The last appointment given out.
    last_slot: Instant,
    book: HashMap<u64, Instant>,
    last_sweep: Instant,
    /// Sends waiting for a place, in order of arrival.
    waiting: VecDeque<oneshot::Sender<()>>,
}

/// Weight of one answered send in the smoothed latency.
const LATENCY_WEIGHT: f64 = 0.02;

impl State {
    fn new(options: AdmissionOptions, now: Instant) -> Self {
        Self {
            aimd: Aimd::new(options),
            in_flight: 0,
            latency: 0.005,
            last_slot: now,
            book: HashMap::new(),
            last_sweep: now,
            waiting: VecDeque::new(),
        }
    }

    /// The time the gateway needs per send at its limit and latency.
    fn spacing(&self) -> Duration {
        Duration::from_secs_f64(self.latency / self.aimd.limit().max(1) as f64)
    }

    /// Places freed go to the waiting room first, in order.
    fn hand_over(&mut self) {
        while self.in_flight < self.aimd.limit() {
            let Some(waiter) = self.waiting.pop_front() else {
                break;
            };
            // A waiter whose connection has gone takes no place.
            if waiter.send(()).is_ok() {
                self.in_flight += 1;
            }
        }
    }

    /// A place in the waiting room.
    fn wait(&mut self) -> Door {
        let (place, waiting) = oneshot::channel();
        self.waiting.push_back(place);
        Door::Wait(waiting)
    }

    fn admit(
        &mut self,
        key: u64,
        now: Instant,
        options: &AdmissionOptions,
        rng: &mut impl Rng,
    ) -> Result<Door, Refusal> {
        // Places free (the limit grew) or waiters gone: settle that first.
        self.hand_over();
        let limit = self.aimd.limit();
        let queue = !self.waiting.is_empty();
        let free = self.in_flight < limit && !queue;
        let idle = self.in_flight * 2 < limit && !queue;
        let pending = self.last_slot > now;
        match self.book.get(&key).copied() {
            // Its turn: in, or into the room while the room is served in
            // time; if the gateway has fallen further behind its
            // appointments than that, a new appointment at the end (an
            // unbounded room filled with 11,900 sends at 1.5x, which timed
            // out there and were booked again).
            Some(slot) if slot <= now + EARLY => {
                if free || self.room_takes_one_more() {
                    self.book.remove(&key);
                    Ok(self.enter(free))
                } else {
                    Err(self.book(key, now, options, rng))
                }
            }
            Some(_) if idle => {
                self.book.remove(&key);
                Ok(self.enter(true))
            }
            // Early: the same appointment.
            Some(slot) => Err(Refusal::Appointment {
                retry_after: (slot - now).max(MIN_WAIT),
            }),
            None if idle || (free && !pending) => Ok(self.enter(true)),
            // A short wait in the room rather than a refusal and a second
            // try, when no appointment is ahead of it and the room is
            // served within `WAIT_IN_ROOM`.
            None if !pending && self.room_takes_one_more() => Ok(self.wait()),
            None => Err(self.book(key, now, options, rng)),
        }
    }

    /// In now if a place is `free`, else into the room.
    fn enter(&mut self, free: bool) -> Door {
        if free {
            self.in_flight += 1;
            Door::In
        } else {
            self.wait()
        }
    }

    /// How long the sends in the room will wait for their places.
    fn room_wait(&self) -> Duration {
        self.spacing() * self.waiting.len() as u32
    }

    /// One more in the room would have its place within `WAIT_IN_ROOM`.
    fn room_takes_one_more(&self) -> bool {
        self.room_wait() + self.spacing() <= WAIT_IN_ROOM
    }

    /// The next appointment, one send's time after the last one and after
    /// the room is served; past the horizon, shed.
    fn book(
        &mut self,
        key: u64,
        now: Instant,
        options: &AdmissionOptions,
        rng: &mut impl Rng,
    ) -> Refusal {
        self.sweep(now);
        let slot = self.last_slot.max(now + self.room_wait()) + self.spacing();
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

    fn completed(
        &mut self,
        started: Instant,
        now: Instant,
        in_flight: usize,
        completion: Completion,
    ) {
        let rtt = now.saturating_duration_since(started);
        self.latency += LATENCY_WEIGHT * (rtt.as_secs_f64() - self.latency);
        let congested = completion == Completion::Congested || rtt > self.aimd.target;
        self.aimd.update(started, now, in_flight, congested);
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

/// The limit: additive increase per round trip, multiplicative decrease at
/// most once per round trip, slow start below the threshold.
#[derive(Debug)]
struct Aimd {
    limit: f64,
    min: usize,
    max: usize,
    target: Duration,
    last_cut: Option<Instant>,
    /// Below this the limit grows by one per send in time (half the limit
    /// at the first cut after it last grew).
    threshold: f64,
    grew: bool,
}

/// What a cut leaves of the limit.
const BACKOFF: f64 = 0.9;

impl Aimd {
    fn new(options: AdmissionOptions) -> Self {
        let min = options.min.max(1);
        let max = options.max.max(min);
        Self {
            limit: options.initial.clamp(min, max) as f64,
            min,
            max,
            target: options.target,
            last_cut: None,
            threshold: 0.0,
            grew: true,
        }
    }

    fn limit(&self) -> usize {
        (self.limit as usize).clamp(self.min, self.max)
    }

    /// A send admitted at `started` ended at `now`, with `in_flight` in
    /// flight (itself included), congested or not.
    fn update(&mut self, started: Instant, now: Instant, in_flight: usize, congested: bool) {
        if congested {
            if self.last_cut.is_some_and(|cut| started < cut) {
                return;
            }
            self.last_cut = Some(now);
            if std::mem::take(&mut self.grew) {
                self.threshold = self.limit / 2.0;
            }
            self.limit = (self.limit * BACKOFF).max(self.min as f64);
        } else if in_flight * 2 >= self.limit() {
            let step = if self.limit < self.threshold {
                1.0
            } else {
                1.0 / self.limit
            };
            self.limit = (self.limit + step).min(self.max as f64);
            self.grew = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{SeedableRng, rngs::StdRng};

    use super::*;

    fn options(max: usize) -> AdmissionOptions {
        AdmissionOptions {
            initial: max,
            min: 1,
            max,
            target: Duration::from_millis(250),
            horizon: Duration::from_secs(20),
        }
    }

    /// The door's state without the lock and the passes.
    struct Gate {
        state: State,
        options: AdmissionOptions,
        rng: StdRng,
    }

    impl Gate {
        fn new(options: AdmissionOptions, now: Instant) -> Self {
            Self {
                state: State::new(options, now),
                options,
                rng: StdRng::seed_from_u64(1),
            }
        }

        fn admit(&mut self, key: u64, now: Instant) -> Result<Door, Refusal> {
            self.state.admit(key, now, &self.options, &mut self.rng)
        }

        fn admit_now(&mut self, key: u64, now: Instant) {
            assert!(
                matches!(self.admit(key, now), Ok(Door::In)),
                "{key} in at once"
            );
        }

        fn wait_in_room(&mut self, key: u64, now: Instant) -> oneshot::Receiver<()> {
            match self.admit(key, now) {
                Ok(Door::Wait(place)) => place,
                other => panic!("{key}: expected the waiting room, got {other:?}"),
            }
        }

        fn done(&mut self, started: Instant, now: Instant) {
            let in_flight = self.state.in_flight;
            self.state.in_flight -= 1;
            self.state
                .completed(started, now, in_flight, Completion::Answered);
            self.state.hand_over();
        }
    }

    fn wait(door: Result<Door, Refusal>) -> Duration {
        match door {
            Err(Refusal::Appointment { retry_after }) => retry_after,
            other => panic!("expected an appointment, got {other:?}"),
        }
    }

    #[test]
    fn past_the_limit_sends_wait_in_the_room_then_get_appointments_spaced_by_what_the_gateway_serves()
     {
        let now = Instant::now();
        let mut gate = Gate::new(options(10), now);
        // Sends take 100 ms: at a limit of 10, one send per 10 ms, so the
        // room (500 ms) holds 50.
        gate.state.latency = 0.1;
        for key in 0..10 {
            gate.admit_now(key, now);
        }
        let _room: Vec<_> = (10..60).map(|key| gate.wait_in_room(key, now)).collect();
        assert_eq!(gate.state.waiting.len(), 50);
        // Then appointments, one send's time apart, after the room.
        let waits: Vec<Duration> = (60..70).map(|key| wait(gate.admit(key, now))).collect();
        for (n, w) in waits.iter().enumerate() {
            let expected = 0.5 + 0.01 * (n + 1) as f64;
            assert!(
                (w.as_secs_f64() - expected).abs() < 1e-6,
                "appointment {n}: {w:?}"
            );
        }
        assert_eq!(gate.state.book.len(), 10);
    }

    #[test]
    fn a_freed_place_goes_to_the_room_in_order_and_a_gone_waiter_takes_none() {
        let now = Instant::now();
        let mut gate = Gate::new(options(2), now);
        gate.state.latency = 0.1;
        gate.admit_now(0, now);
        gate.admit_now(1, now);
        let gone = gate.wait_in_room(2, now);
        let mut second = gate.wait_in_room(3, now);
        let mut third = gate.wait_in_room(4, now);
        drop(gone);
        gate.done(now, now + Duration::from_millis(50));
        assert!(
            second.try_recv().is_ok(),
            "the first live waiter gets the place"
        );
        assert!(third.try_recv().is_err(), "one place, one waiter");
        assert_eq!(gate.state.in_flight, 2);
        assert_eq!(gate.state.waiting.len(), 1);
    }

    #[test]
    fn a_phone_back_for_its_appointment_goes_in_before_new_sends() {
        let now = Instant::now();
        let mut gate = Gate::new(options(4), now);
        // 10 ms per send: the room holds 50.
        gate.state.latency = 0.04;
        for key in 0..4 {
            gate.admit_now(key, now);
        }
        let _room: Vec<_> = (4..54).map(|key| gate.wait_in_room(key, now)).collect();
        let back = now + wait(gate.admit(100, now));
        // A new send before the appointment gets one after it.
        let later = wait(gate.admit(200, back - Duration::from_millis(4)));
        assert!(back - Duration::from_millis(4) + later > back);
        // Coming early keeps the same appointment.
        let early = back - Duration::from_millis(30);
        assert_eq!(wait(gate.admit(100, early)), Duration::from_millis(30));
        // On time, with the limit reached and the room full: the gateway
        // is further behind than the room can make up, a new appointment.
        let again = wait(gate.admit(100, back));
        assert!(back + again > back + Duration::from_millis(10));
        // Once the room has moved on, on time: not sent away, it waits for
        // the next place; an appointment is used once.
        gate.done(back, back);
        gate.done(back, back);
        let turn = back + again;
        let _place = gate.wait_in_room(100, turn);
        assert!(!gate.state.book.contains_key(&100));
    }

    #[test]
    fn appointments_end_at_the_horizon_and_are_shed_beyond_it() {
        let now = Instant::now();
        let mut gate = Gate::new(options(1), now);
        // One send per second: no room (a place is further than 500 ms),
        // and 20 appointments fit in 20 s.
        gate.state.latency = 1.0;
        gate.admit_now(0, now);
        for key in 1..=20 {
            assert!(wait(gate.admit(key, now)) <= Duration::from_secs(20));
        }
        match gate.admit(21, now) {
            Err(Refusal::Shed { retry_after }) => {
                assert!(retry_after >= Duration::from_secs(18), "{retry_after:?}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_free_gateway_takes_everyone_at_once() {
        let now = Instant::now();
        let mut gate = Gate::new(options(100), now);
        for key in 0..100 {
            gate.admit_now(key, now);
        }
        assert!(gate.state.book.is_empty());
        assert!(gate.state.waiting.is_empty());
    }

    #[tokio::test]
    async fn a_pass_that_waits_too_long_in_the_room_gets_an_appointment_and_leaves_no_place_taken()
    {
        let admission = Admission::new(options(1));
        let first = admission.admit("ana", b"m-1").expect("in");
        let mut waiting = admission.admit("ana", b"m-2").expect("the room");
        assert_eq!(admission.lock().waiting.len(), 1);
        let refusal = waiting
            .ready(Duration::from_millis(20))
            .await
            .expect_err("no place came");
        assert!(
            matches!(refusal, Refusal::Appointment { .. }),
            "{refusal:?}"
        );
        drop(waiting);
        drop(first);
        // The place the first gave back is free for the next send.
        let mut next = admission.admit("ben", b"m-1").expect("in");
        next.ready(Duration::from_millis(20)).await.unwrap();
        assert_eq!(admission.lock().in_flight, 1);
    }

    #[tokio::test]
    async fn a_place_handed_to_a_pass_that_is_dropped_is_given_back() {
        let admission = Admission::new(options(1));
        let first = admission.admit("ana", b"m-1").expect("in");
        let waiting = admission.admit("ana", b"m-2").expect("the room");
        drop(first);
        assert_eq!(admission.lock().in_flight, 1, "handed to the waiter");
        drop(waiting);
        assert_eq!(admission.lock().in_flight, 0, "and back when it left");
    }

    #[test]
    fn late_answers_cut_the_limit_once_per_round_trip_and_timely_ones_grow_it() {
        let now = Instant::now();
        let mut aimd = Aimd::new(AdmissionOptions {
            initial: 100,
            min: 10,
            max: 1000,
            target: Duration::from_millis(250),
            horizon: Duration::from_secs(20),
        });
        // 100 sends caught together in one slow second: one cut.
        let end = now + Duration::from_secs(1);
        for in_flight in (1..=100).rev() {
            aimd.update(now, end, in_flight, true);
        }
        assert_eq!(aimd.limit(), 90);
        // A send started after that cut and late again: another cut.
        aimd.update(end, end + Duration::from_secs(1), 90, true);
        assert_eq!(aimd.limit(), 81);
        // Below half the limit it had, timely sends grow it by one each.
        let mut low = Aimd::new(AdmissionOptions {
            initial: 1000,
            min: 10,
            max: 1000,
            ..AdmissionOptions::default()
        });
        for round in 0..50 {
            let t = now + Duration::from_secs(round);
            low.update(t, t, 1000, true);
        }
        assert_eq!(low.limit(), 10);
        let t = now + Duration::from_secs(100);
        for _ in 0..100 {
            low.update(t, t, 1000, false);
        }
        assert_eq!(low.limit(), 110, "slow start after a collapse");
        // An idle gateway's limit does not grow.
        let before = aimd.limit();
        aimd.update(t, t, 1, false);
        assert_eq!(aimd.limit(), before);
    }

    #[test]
    fn offered_three_times_what_it_serves_the_door_keeps_it_busy_and_in_time() {
        // A gateway serving one send per millisecond (a CPU-bound box at
        // 1,000 sends/s), offered three new sends per millisecond for 20 s;
        // refused phones come back when told. The work inside stays within
        // the target, the gateway stays busy, and a message is tried about
        // twice.
        let start = Instant::now();
        let mut gate = Gate::new(AdmissionOptions::default(), start);
        let mut room: Vec<oneshot::Receiver<()>> = Vec::new();
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
                late += u64::from(end - started > Duration::from_millis(600));
                gate.done(started, end);
            }
            // Places handed to the room go in now.
            room.retain_mut(|place| match place.try_recv() {
                Ok(()) => {
                    let from = inside.back().map_or(now, |(_, last)| (*last).max(now));
                    inside.push_back((now, from + Duration::from_millis(1)));
                    false
                }
                Err(_) => true,
            });
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
                match gate.admit(k, now) {
                    Ok(Door::Wait(place)) => {
                        admitted_keys.insert(k);
                        room.push(place);
                    }
                    Ok(Door::In) => {
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
        // twice the target.
        assert!(served >= 19_000, "served {served} in 20 s");
        assert!(late * 100 < served, "{late} of {served} answered late");
        // Of the messages served, about two tries each (the appointments
        // beyond the horizon are retried more).
        let per_served = tries as f64 / admitted_keys.len() as f64;
        assert!(per_served < 4.0, "{per_served:.2} tries per served message");
        let limit = gate.state.aimd.limit();
        assert!((100..=400).contains(&limit), "limit {limit}");
    }
}
