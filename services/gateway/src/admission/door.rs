//! The door's rules (see [`super`]): whether a send goes in now, the
//! appointments of those that do not, and which held send a place given
//! back goes to.

use std::{
    collections::{HashMap, VecDeque},
    time::{Duration, Instant},
};

use imdedup_runtime::aimd::Aimd;
use rand::Rng;

use super::{
    AdmissionOptions, Call, Completion, Holder, Newness, Refusal,
    drain::{DRAIN_BEHIND, DrainCap},
    held::{Lane, Queues, Waiter},
    rates::{Flow, Pace},
};

/// A phone comes back this much early for its appointment and still has it.
const EARLY: Duration = Duration::from_millis(20);
/// The shortest wait asked for.
const MIN_WAIT: Duration = Duration::from_millis(5);
/// Appointments kept at most; beyond, refusals are shed without one.
const MAX_BOOKED: usize = 1 << 20;
/// An appointment nobody came for is forgotten this long after its time.
const FORGET_AFTER: Duration = Duration::from_secs(60);
/// Arriving messages refused are remembered this long, for
/// [`State::drain_began`]: longer than the gateway takes to see a surge's
/// end (two to four quarter seconds).
const REFUSED_ARRIVING_FOR: Duration = Duration::from_secs(2);
/// A drain that lasts this long is the end of a surge, and the messages
/// refused as it began go ahead when they come back
/// ([`State::drain_began`]); one that ends sooner was a moment in the
/// middle of a surge (its phones' throttles holding most of it back for
/// two quarter seconds), and those messages are the surge's.
const DRAIN_CONFIRMED_AFTER: Duration = Duration::from_secs(3);
/// Below this share of the limit in flight, held sends go before their
/// appointment.
pub(super) const PULL_FORWARD: f64 = 0.875;
/// A send going ahead of the backlog that could not be held is asked back
/// no sooner than this ([`State::no_room_ahead`]), not at the end of the
/// appointments, where it waited for the whole backlog it was to go ahead
/// of: the reserve it found full frees as the sends in it are answered
/// (after a 3x surge on the pinned wiring it stayed full for 1.5-2 s;
/// docs/overload-log.md, "Whose are the 20-40 s after a 3x surge").
pub(super) const AHEAD_RETRY: Duration = Duration::from_millis(125);

/// The door's state: see the module's comment.
#[derive(Debug)]
pub(super) struct State {
    pub(super) aimd: Aimd,
    /// A send answered later than this cuts the limit.
    target: Duration,
    pub(super) in_flight: usize,
    /// Of those, new sends (see [`super::Pass`]).
    pub(super) new_in_flight: usize,
    /// The backlog's share of the places while it drains.
    drain: DrainCap,
    /// What the gateway serves per second when it is full: the pace of
    /// appointments.
    pace: Pace,
    /// New sends arriving against sends answered.
    flow: Flow,
    /// The last appointment given out.
    last_slot: Instant,
    /// The last appointment given to a send going ahead of the backlog
    /// that could not be held ([`State::no_room_ahead`]).
    ahead_slot: Instant,
    pub(super) book: HashMap<u64, Instant>,
    last_sweep: Instant,
    /// Messages refused as they arrived in the last
    /// [`REFUSED_ARRIVING_FOR`], the latest last.
    refused_arriving: VecDeque<(Instant, u64)>,
    /// Messages refused as they arrived after a surge, before its end was
    /// seen: new messages, however old when their phones come back; each
    /// with when it was marked, forgotten after [`FORGET_AFTER`] (its phone
    /// gave up).
    late_new: HashMap<u64, Instant>,
    /// Messages refused as a drain began that has not lasted
    /// [`DRAIN_CONFIRMED_AFTER`] yet, and when it began.
    late_new_pending: Option<(Instant, Vec<u64>)>,
    /// The held sends.
    queues: Queues,
}

impl State {
    pub(super) fn new(options: AdmissionOptions, now: Instant) -> Self {
        Self {
            aimd: Aimd::new(options.initial, options.min, options.max),
            target: options.target,
            in_flight: 0,
            new_in_flight: 0,
            drain: DrainCap::new(options.initial as f64),
            pace: Pace::new(now),
            flow: Flow::new(now),
            last_slot: now,
            ahead_slot: now,
            book: HashMap::new(),
            last_sweep: now,
            refused_arriving: VecDeque::new(),
            late_new: HashMap::new(),
            late_new_pending: None,
            queues: Queues::default(),
        }
    }

    /// Take in `key`'s send, of a message as new as `newness`, or refuse
    /// it.
    pub(super) fn admit(
        &mut self,
        key: u64,
        newness: Newness,
        now: Instant,
        options: &AdmissionOptions,
        rng: &mut impl Rng,
    ) -> Result<Holder, Refusal> {
        let limit = self.aimd.limit();
        let appointment = self.book.get(&key).copied();
        self.confirm_late_new(now);
        let late_new = self.late_new.contains_key(&key);
        let fresh = newness.fresh() || late_new;
        let new = fresh && (appointment.is_none() || late_new);
        if appointment.is_none() && newness == Newness::Arriving {
            self.arrived(now);
        }
        let draining = self.draining();
        let on_time = appointment.is_some_and(|slot| slot <= now + EARLY);
        let admitted = match appointment {
            // While the backlog drains, an old message is one of the
            // backlog, whether the gateway sees it for the first time or
            // its phone is back on time for an appointment: within the
            // backlog's share of the places, so that the places above the
            // limit are the new sends'. Up to the limit, the phones refused
            // past the horizon in a 3x surge, back 20 s later at up to
            // 18,000 a second, could fill the places, and every new send
            // waited behind them at the shards; up to twice the limit, the
            // phones back for appointments paced at what the gateway served
            // while full took the places new sends needed, and those were
            // asked back until their messages were old and booked at the
            // end (a fifth to a half of the new messages of the first
            // seconds after the surge answered after 20-40 s).
            _ if draining && !fresh && (on_time || appointment.is_none()) => {
                self.in_flight < self.backlog_room(now)
            }
            // Its turn: in, even above the limit (the appointments are
            // paced at what the gateway serves), up to twice the limit.
            Some(_) if on_time => self.in_flight < limit.saturating_mul(2),
            // The surge is over: a new send goes before the backlog.
            None if new && draining => self.in_flight < limit.saturating_mul(2),
            // A free place is taken by whoever comes, new or early: a place
            // kept for a later appointment would be capacity lost for good.
            Some(_) | None => self.in_flight < limit,
        };
        if admitted {
            let holder = if new {
                self.new_in_flight += 1;
                if late_new {
                    self.late_new.remove(&key);
                    self.book.remove(&key);
                }
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
            Some(slot) if !on_time => {
                return Err(Refusal::Appointment {
                    retry_after: (slot - now).max(MIN_WAIT),
                });
            }
            // The surge is over and every place is taken: a new send
            // still goes before the backlog, at the next place. Booked
            // behind it, new messages waited for all of it (14-20 s after a
            // 3x surge against the chart's budget for held sends, which
            // leaves most of the backlog with the phones). So does a fresh
            // message back on time for its appointment: booked at the end
            // as an old one is, a new message asked back in a quarter
            // second ahead of the backlog (the budget for held sends full)
            // was asked back in 20 s when it came (a fifth to a half of
            // the new messages of the second second after a 3x surge).
            _ if fresh && draining && self.book.len() < MAX_BOOKED => {
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
        if newness == Newness::Arriving {
            self.refused_arriving.push_back((now, key));
        }
        Err(self.book(key, now, options, rng))
    }

    /// A new send arrived: counted for the drain rule.
    fn arrived(&mut self, now: Instant) {
        if let Some(since) = self.flow.arrived(now) {
            self.drain_began(since, now);
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
    ///
    /// So are the messages refused as they arrived from then on (the
    /// budget for held sends full): their phones come back with them at
    /// their appointments, 20 s out, old by then, and were refused again
    /// as the backlog's and booked at the end (~40 s, or given up: 560 and
    /// 367 of the first second's 4,173 new messages after a 3x surge on
    /// the pinned wiring). Now they go ahead of the backlog when they come,
    /// if the drain lasts [`DRAIN_CONFIRMED_AFTER`]: a drain begun for a
    /// moment in the middle of a 3x surge marked two seconds of the surge's
    /// refusals, and those came back 20 s later as new sends, asked back
    /// every few milliseconds ahead of the backlog.
    pub(super) fn drain_began(&mut self, since: Instant, now: Instant) {
        for waiter in self.queues.take_arriving_since(since) {
            self.book.remove(&waiter.key);
            let _ = waiter.place.send(Call::Ahead);
        }
        let late = self.refused_arriving.iter().rev();
        let late = late.take_while(|&&(at, _)| at >= since);
        self.late_new_pending = Some((now, late.map(|&(_, key)| key).collect()));
    }

    /// The messages refused as the last drain began are new ones if it has
    /// lasted [`DRAIN_CONFIRMED_AFTER`], the surge's if it ended sooner.
    fn confirm_late_new(&mut self, now: Instant) {
        let Some((began, _)) = self.late_new_pending else {
            return;
        };
        if !self.flow.draining() {
            self.late_new_pending = None;
        } else if now.saturating_duration_since(began) >= DRAIN_CONFIRMED_AFTER
            && let Some((_, keys)) = self.late_new_pending.take()
        {
            self.late_new.extend(keys.into_iter().map(|key| (key, now)));
        }
    }

    /// [`super::Admission::appoint`].
    pub(super) fn appoint(
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
        self.ahead_at(key, now + self.pace.spacing(), now)
    }

    /// `key`'s appointment ahead of the backlog, at `slot`.
    fn ahead_at(&mut self, key: u64, slot: Instant, now: Instant) -> Refusal {
        self.book.insert(key, slot);
        Refusal::AheadOfBacklog {
            retry_after: (slot - now).max(MIN_WAIT),
        }
    }

    /// A send going ahead of the backlog, of a message its phone has had
    /// for `age`, that found no room to be held (the budget for held sends
    /// full up to what it may take): an appointment on a line of its own,
    /// one send's time after the last one given there, so that the sends
    /// refused together come back spread at the pace the gateway serves;
    /// at the end of the backlog's, with the backlog, if the message would
    /// be old by then. Asked back in a quarter second each, the messages
    /// of a 3x surge's last seconds that their phones let go after it
    /// (26,000 on the pinned wiring) came back up to 14 times each,
    /// 20,000-40,000 refusals a second for four seconds, and three in four
    /// were booked at the end after all, once old; their refusals kept the
    /// phones' throttles holding back the new messages of those seconds.
    pub(super) fn no_room_ahead(
        &mut self,
        key: u64,
        age: Duration,
        now: Instant,
        options: &AdmissionOptions,
        rng: &mut impl Rng,
    ) -> Refusal {
        let slot = (self.ahead_slot + self.pace.spacing()).max(now + AHEAD_RETRY);
        if !super::fresh(age + (slot - now)) && !self.late_new.contains_key(&key) {
            return self.book(key, now, options, rng);
        }
        self.ahead_slot = slot;
        self.ahead_at(key, slot, now)
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

    pub(super) fn hold(&mut self, waiter: Waiter, lane: Lane) {
        self.queues.push(waiter, lane);
    }

    /// The oldest held send, if a place is its (taken for it): its
    /// appointment has come and there is a place for an appointment, or
    /// the gateway is far enough from its limit that no new send needs the
    /// place. Held sends whose connection closed are dropped on the way,
    /// and so are those held longer than `stale` (their phones are told).
    pub(super) fn next_held(&mut self, now: Instant, stale: Duration) -> Option<Waiter> {
        let limit = self.aimd.limit();
        let room = self.backlog_room(now);
        let queues = &mut self.queues;
        let (lane, goes) = if queues
            .live_front(Lane::Urgent, &mut self.book, now, stale)
            .is_some()
        {
            // Up to twice the limit, as a phone back for its appointment:
            // new sends wait for these in their conversation's turn.
            (Lane::Urgent, self.in_flight < limit.saturating_mul(2))
        } else if queues
            .live_front(Lane::Ahead, &mut self.book, now, stale)
            .is_some()
        {
            // The front of the backlog, within its share.
            (Lane::Ahead, self.in_flight < room)
        } else {
            let front = queues.live_front(Lane::Backlog, &mut self.book, now, stale)?;
            let due = front.due <= now + EARLY && self.in_flight < room;
            let idle = (self.in_flight as f64) < (limit.min(room) as f64) * PULL_FORWARD;
            (Lane::Backlog, due || idle)
        };
        if !goes {
            return None;
        }
        let waiter = queues.pop_front(lane)?;
        self.book.remove(&waiter.key);
        self.in_flight += 1;
        if waiter.holder == Holder::New {
            self.new_in_flight += 1;
        }
        Some(waiter)
    }

    pub(super) fn completed(
        &mut self,
        started: Instant,
        now: Instant,
        in_flight: usize,
        completion: Completion,
    ) {
        let rtt = now.saturating_duration_since(started);
        self.pace.answered(now);
        if let Some(since) = self.flow.answered(now) {
            self.drain_began(since, now);
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
            && self.queues.is_empty()
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
    pub(super) fn backlog_room(&self, now: Instant) -> usize {
        let limit = self.aimd.limit();
        let behind = self
            .queues
            .backlog
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
    pub(super) fn draining(&self) -> bool {
        !self.queues.is_empty() && self.flow.draining()
    }

    /// Appointments given out and not kept yet, those nobody came for
    /// forgotten first: read by the gauges each second, so that a gateway
    /// no send reaches any more does not show the appointments of its last
    /// surge for good (90,000 after a 3x surge on the pinned wiring).
    pub(super) fn booked(&mut self, now: Instant) -> usize {
        self.sweep(now);
        self.book.len()
    }

    /// Forget appointments nobody came for, now and then.
    fn sweep(&mut self, now: Instant) {
        if now.saturating_duration_since(self.last_sweep) < Duration::from_secs(1) {
            return;
        }
        self.last_sweep = now;
        self.book
            .retain(|_, slot| now.saturating_duration_since(*slot) < FORGET_AFTER);
        while self
            .refused_arriving
            .front()
            .is_some_and(|&(at, _)| now.saturating_duration_since(at) > REFUSED_ARRIVING_FOR)
        {
            self.refused_arriving.pop_front();
        }
        // With no backlog, nothing to go ahead of.
        if self.queues.is_empty() {
            self.late_new.clear();
        } else {
            self.late_new
                .retain(|_, marked| now.saturating_duration_since(*marked) < FORGET_AFTER);
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{SeedableRng, rngs::StdRng};

    use tokio::sync::oneshot;

    use super::{
        super::{ARRIVING_FOR, Admission, FRESH_FOR, Pass, rates::PACE_WINDOW, tests::options},
        *,
    };

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

        /// A door with `limit` places, every one taken by a new send, that
        /// serves `rate` sends a second when full.
        fn full(limit: usize, rate: f64, now: Instant) -> Self {
            let mut door = Self::new(options(limit), now);
            door.state.pace.rate = Some(rate);
            for key in 0..limit as u64 {
                door.admit(key, now).unwrap();
            }
            door
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
            age: FRESH_FOR,
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
        // Back for it with every place still taken (its budget for held
        // sends full, the gateway asked it back in a quarter second): ahead
        // again, not at the end as an old message back on time is.
        let again = match door.admit(key, now + ahead) {
            Err(Refusal::AheadOfBacklog { retry_after }) => retry_after,
            other => panic!("expected a place ahead of the backlog again, got {other:?}"),
        };
        assert!(again < behind / 10, "{again:?} against {behind:?}");
        assert_eq!(door.state.last_slot, last_slot);
        let old = wait(door.admit_old(key + 100, now + ahead));
        assert_eq!(door.state.last_slot, now + ahead + old, "booked at the end");
        // Back for it, the phone goes in as soon as a place is free, above
        // the limit.
        door.state.in_flight = 19;
        assert!(
            door.admit(key, now + ahead + again).is_ok(),
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

    /// A new message refused as it arrived in the moment before the end of
    /// a surge was seen goes ahead of the backlog when its phone comes
    /// back for its appointment, old by then, not with the backlog, once
    /// the drain has lasted; one refused earlier in the surge goes with the
    /// backlog.
    #[test]
    fn a_message_refused_as_the_surge_ended_goes_ahead_when_it_comes_back() {
        let (mut door, mut now, mut key, _backlog) = in_a_surge(2);
        let full = 2 * door.state.aimd.limit();
        let (early, late) = (900_000, 900_001);
        door.state.in_flight = full;
        let early_slot = now + wait(door.admit(early, now));
        // The surge goes on for a second, then ends, and the backlog drains
        // for four seconds.
        traffic(&mut door, &mut now, &mut key, 4, 30, 10);
        door.state.in_flight = full;
        let late_slot = now + wait(door.admit(late, now));
        traffic(&mut door, &mut now, &mut key, 16, 5, 10);
        assert!(door.state.draining(), "the surge is seen to be over");
        let at = now.max(early_slot).max(late_slot);
        door.state.in_flight = door.state.aimd.limit();
        wait(door.send(early, Newness::Old, at));
        assert!(
            door.send(late, Newness::Old, at).is_ok(),
            "in above the limit, as a new send"
        );
        assert!(!door.state.book.contains_key(&late));
        assert!(!door.state.late_new.contains_key(&late));
    }

    /// A drain begun for a moment in the middle of a surge (new sends
    /// arriving slower than answered for two quarter seconds) does not make
    /// the messages refused then new: they are the surge's, and go with the
    /// backlog when their phones come back after the surge's real end.
    #[test]
    fn a_moment_of_drain_in_a_surge_does_not_make_its_refusals_new() {
        let (mut door, mut now, mut key, _backlog) = in_a_surge(2);
        let full = 2 * door.state.aimd.limit();
        let mid = 900_000;
        door.state.in_flight = full;
        let slot = now + wait(door.admit(mid, now));
        // Quiet quarter seconds (the second one seen as the third begins):
        // a drain, for a moment.
        traffic(&mut door, &mut now, &mut key, 3, 5, 10);
        assert!(door.state.draining(), "a drain begins");
        // The surge again, then its real end and a long drain.
        traffic(&mut door, &mut now, &mut key, 8, 30, 10);
        assert!(!door.state.draining(), "the surge again");
        traffic(&mut door, &mut now, &mut key, 16, 5, 10);
        assert!(door.state.draining(), "the surge is over");
        door.state.in_flight = door.state.aimd.limit();
        assert!(
            door.send(mid, Newness::Old, now.max(slot)).is_err(),
            "with the backlog, within its share of the places"
        );
        assert!(!door.state.late_new.contains_key(&mid));
    }

    /// Sends going ahead of the backlog that could not be held come back
    /// spread at the pace the gateway serves, each about once, not all in
    /// the same quarter second; a message that would be old by its time on
    /// that line is booked at the end, with the backlog.
    #[test]
    fn sends_ahead_that_could_not_be_held_are_asked_back_spread() {
        let now = Instant::now();
        let mut door = Door::full(10, 1_000.0, now);
        let spacing = Duration::from_millis(1);
        let mut no_room = |key: u64, age: Duration, at: Instant| {
            door.state
                .no_room_ahead(key, age, at, &door.options, &mut door.rng)
        };
        let waits: Vec<_> = (0..1_000)
            .map(|key| match no_room(key, Duration::ZERO, now) {
                Refusal::AheadOfBacklog { retry_after } => retry_after,
                other => panic!("expected a time ahead of the backlog, got {other:?}"),
            })
            .collect();
        assert_eq!(waits[0], AHEAD_RETRY, "the reserve frees in milliseconds");
        assert!(
            waits.windows(2).all(|two| two[1] == two[0] + spacing),
            "one send's time apart"
        );
        // A quarter second later the line's next time is 1.125 s from the
        // start: a message its phone has had for 4 s would still be fresh
        // at its time on it, one had for 4.2 s would not.
        let later = now + Duration::from_millis(250);
        let fresh = no_room(5_000, Duration::from_secs(4), later);
        assert_eq!(
            fresh,
            Refusal::AheadOfBacklog {
                retry_after: Duration::from_millis(875)
            }
        );
        let old = no_room(5_001, Duration::from_millis(4_200), later);
        assert!(
            matches!(old, Refusal::Appointment { .. }),
            "booked with the backlog: {old:?}"
        );
        assert_eq!(door.state.book[&5_001], door.state.last_slot, "at the end");
        assert_eq!(door.state.book[&5_000], later + fresh.retry_after());
    }

    /// Appointments nobody came for are forgotten a minute after their
    /// time even if no send arrives after them to sweep them out.
    #[test]
    fn appointments_nobody_came_for_are_forgotten_without_another_send() {
        let now = Instant::now();
        let mut door = Door::full(10, 1_000.0, now);
        for key in 100..110 {
            wait(door.admit(key, now));
        }
        assert_eq!(door.state.booked(now), 10);
        let slot = door.state.last_slot;
        assert_eq!(door.state.booked(slot + FORGET_AFTER / 2), 10);
        assert_eq!(door.state.booked(slot + FORGET_AFTER), 0);
    }

    /// A message marked to go ahead whose phone never came back (it gave
    /// up) is forgotten a minute after it was marked, though the backlog is
    /// still there: the marks do not grow with every surge's give-ups.
    #[test]
    fn marks_of_phones_that_never_came_back_are_forgotten() {
        let now = Instant::now();
        let mut door = Door::new(options(10), now);
        let _backlog = held(&mut door.state, 1, now);
        door.state.late_new.insert(7, now);
        door.state.late_new.insert(8, now + FORGET_AFTER / 2);
        door.state.booked(now + FORGET_AFTER / 2);
        assert!(door.state.late_new.contains_key(&7));
        door.state.booked(now + FORGET_AFTER);
        assert!(!door.state.late_new.contains_key(&7), "forgotten");
        assert!(door.state.late_new.contains_key(&8), "not yet");
    }

    /// While the backlog drains, a phone back on time for its appointment
    /// with an old message is the backlog's: it takes a place within the
    /// backlog's share of the limit, not above it, where the new sends go;
    /// without one it is booked again at the end.
    #[test]
    fn while_the_backlog_drains_an_old_message_on_time_takes_only_the_backlogs_places() {
        let (mut door, mut now, mut key, _backlog) = in_a_surge(2);
        let old = key;
        key += 1;
        door.state.in_flight = 2 * door.state.aimd.limit();
        wait(door.admit_old(old, now));
        let slot = door.state.book[&old];
        traffic(&mut door, &mut now, &mut key, 6, 5, 10);
        assert!(door.state.draining(), "the surge is seen to be over");
        let at = now.max(slot);
        let limit = door.state.aimd.limit();
        assert!(door.state.backlog_room(at) <= limit);
        // On time, above the limit: booked again, at the end.
        door.state.in_flight = limit;
        let again = wait(door.admit_old(old, at));
        assert_eq!(door.state.last_slot, at + again, "booked at the end");
        // A new send at that moment goes in above the limit.
        assert!(door.admit(key, at).is_ok());
        // Within the backlog's share, the old message goes in at its
        // appointment.
        door.state.in_flight = 0;
        assert!(door.admit_old(old, at + again).is_ok());
        assert!(!door.state.book.contains_key(&old));
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
                age: if arriving {
                    Duration::ZERO
                } else {
                    ARRIVING_FOR
                },
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
        assert!(
            !door
                .state
                .queues
                .backlog
                .iter()
                .any(|waiter| waiter.key == 101)
        );
        assert!(!door.state.book.contains_key(&101));
        assert!(in_surge.try_recv().is_err(), "held in the surge: stays");
        assert!(old.try_recv().is_err(), "an old message: stays");
        let queued: Vec<u64> = door
            .state
            .queues
            .backlog
            .iter()
            .map(|waiter| waiter.key)
            .collect();
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
        door.state.queues.backlog.push_front(waiter(
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
        assert!(state.queues.backlog.is_empty());
        assert!(matches!(
            rx.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        ));
    }

    #[test]
    fn refused_sends_get_appointments_spaced_by_what_the_gateway_serves() {
        let now = Instant::now();
        // It serves 100 sends a second: one per 10 ms.
        let mut door = Door::full(10, 100.0, now);
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
        let mut door = Door::full(4, 100.0, now);
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
        let mut door = Door::full(2, 20.0, now);
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
        // Ten sends a second: 200 appointments fit in 20 s.
        let mut door = Door::full(1, 10.0, now);
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
