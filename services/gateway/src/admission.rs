//! Which sends the gateway lets through to its shards now, and what the
//! others do meanwhile.
//!
//! Past its capacity a service must keep serving at capacity. Two things
//! broke that before: the gateway let through up to a fixed number of
//! sends, far more than could be answered in time, so the work inside was
//! late work; and refusing what did not fit sent phones away to come back
//! later, so at 1.5 times capacity most messages were refused at least once
//! and reading, refusing and re-reading their frames took the CPU the sends
//! needed. A send waiting costs nothing but memory; a refusal costs two
//! frames and a second try.
//!
//! **A limit driven by time.** At most `limit` sends are in flight from
//! this gateway to its shards. The limit adapts like TCP's congestion
//! window (AIMD): a send answered later than `target`, or refused by its
//! shard as overloaded, cuts it by a tenth (at most once per round trip: a
//! late send that started before the last cut says nothing new); while
//! sends come back in time and the limit is used, it grows by one per round
//! trip, or by one per send below half the limit of the last cut (slow
//! start). Little's law makes the limit settle near capacity x target, so
//! what is in flight finishes within about `target` whatever the load.
//!
//! **A queue bounded by time.** A send that finds the limit reached waits
//! in the gateway for a place, at most `max_wait`; a place freed goes to a
//! waiting send at once. While the queue comes and goes (it was empty
//! within the last two targets) it is served in order of arrival, so a
//! burst costs a short wait and nothing else. Once a queue stands, the
//! gateway is over its capacity, and it serves the newest send first
//! (adaptive LIFO, as in Facebook's "Fail at Scale"): the sends it serves
//! are answered within about `target`, so phones arriving after a surge
//! are served at once instead of behind it, and the sends that wait are the
//! ones that have waited longest. A send that waits `max_wait` without a
//! place is refused `overloaded`; so is a send that finds `max_waiting`
//! sends waiting already (without waiting: no backend call, no place).
//!
//! **Refusals spread out, and served first when they come back.** A
//! refusal's `retry_after` grows with how far the gateway is over its
//! capacity (sends arriving per send served over the last seconds) and is
//! jittered (between half and all of it), so the refused come back spread
//! out. The gateway remembers whom it refused and when it first did (by
//! sender and message ID, hashed, for a minute): a refused send that comes
//! back waits in a queue of its own,
//! in order of arrival, and returned and new sends take the free places in
//! turn. So while returns are fewer than half of what the gateway serves
//! (up to twice its capacity offered) a message is refused at most once
//! and tried at most twice, and new sends still go in at once after a
//! surge. A send that comes back waits no later than two `max_wait`s after
//! its first refusal, so what is served is served within three waits of
//! its first try (inside a phone's 31 s with the default 10 s) rather than
//! after its phone gave up. A hash collision only gives a stranger's
//! message its turn early.

use std::{
    collections::{HashMap, VecDeque},
    hash::{BuildHasher, Hash, Hasher, RandomState},
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use imdedup_core::{Error, ErrorKind, model::Ack};
use rand::Rng;
use tokio::{sync::oneshot, time::Instant};

/// Bounds of the admission limit and of the queue.
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
    /// The longest a send waits for a place (`--max-send-wait`).
    pub max_wait: Duration,
    /// Sends waiting at most (`--max-sends-waiting`); beyond, refused.
    pub max_waiting: usize,
}

impl Default for AdmissionOptions {
    fn default() -> Self {
        Self {
            initial: 512,
            min: 16,
            max: 20_000,
            target: Duration::from_millis(250),
            max_wait: Duration::from_secs(10),
            max_waiting: 100_000,
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

/// The shortest wait a refusal asks for.
const MIN_RETRY_AFTER: Duration = Duration::from_millis(100);
/// How often the overload (arrivals per send served) is measured.
const RATE_WINDOW: Duration = Duration::from_secs(1);
/// Weight of the last window in the smoothed overload.
const RATE_WEIGHT: f64 = 0.5;
/// A refused send is remembered this long (a phone gives up after 31 s).
const REMEMBER_REFUSED: Duration = Duration::from_secs(60);
/// Refused sends remembered at most.
const MAX_REMEMBERED: usize = 1 << 20;

/// A send the gateway would not take: come back after `retry_after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub retry_after: Duration,
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
/// dropped without [`Pass::finish`] says nothing about congestion.
pub struct Pass {
    admission: Arc<Admission>,
    started: Instant,
    completion: Option<Completion>,
}

impl Pass {
    pub fn finish(mut self, completion: Completion) {
        self.completion = Some(completion);
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        self.admission
            .release(self.started, Instant::now(), self.completion);
    }
}

/// A send's way in: a place now, or a place in the queue.
pub enum Entry {
    Now(Pass),
    Queued(Waiting),
}

impl Entry {
    /// The place, once it comes; refused if it does not come within the
    /// queue's time bound.
    pub async fn ready(self) -> Result<Pass, Refusal> {
        match self {
            Self::Now(pass) => Ok(pass),
            Self::Queued(waiting) => waiting.ready().await,
        }
    }
}

/// A send waiting in the queue. Dropped (its connection went) it takes no
/// place, and a place handed to it meanwhile goes back.
pub struct Waiting {
    admission: Arc<Admission>,
    key: u64,
    /// When the send was first refused, if it was.
    first_refused: Option<Instant>,
    since: Instant,
    place: Option<oneshot::Receiver<()>>,
}

impl Waiting {
    async fn ready(mut self) -> Result<Pass, Refusal> {
        let deadline = self.admission.deadline(self.since, self.first_refused);
        let Some(mut place) = self.place.take() else {
            return Err(self.admission.refuse(self.key, self.first_refused));
        };
        let granted = match tokio::time::timeout_at(deadline, &mut place).await {
            Ok(result) => result.is_ok(),
            // Out of time; a place handed over at the last moment is still
            // taken.
            Err(_) => {
                place.close();
                place.try_recv().is_ok()
            }
        };
        if granted {
            return Ok(self.admission.pass());
        }
        self.admission.lock().waiting -= 1;
        Err(self.admission.refuse(self.key, self.first_refused))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some(mut place) = self.place.take() else {
            return;
        };
        place.close();
        if place.try_recv().is_ok() {
            // Handed a place nobody will use.
            let now = Instant::now();
            self.admission.release(now, now, None);
        } else {
            self.admission.lock().waiting -= 1;
        }
    }
}

impl Admission {
    pub fn new(options: AdmissionOptions) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::new(options, Instant::now())),
            options,
            keys: RandomState::new(),
        })
    }

    /// The send of (`sender`, `id`): a place now, a place in the queue, or
    /// a refusal when the queue is full.
    pub fn enter(self: &Arc<Self>, sender: &str, id: &[u8]) -> Result<Entry, Refusal> {
        let key = self.key(sender, id);
        let now = Instant::now();
        let mut state = self.lock();
        let first_refused = state.arrived(key, now);
        if state.waiting == 0 && state.in_flight < state.aimd.limit() {
            state.in_flight += 1;
            drop(state);
            return Ok(Entry::Now(self.pass()));
        }
        let late = self.deadline(now, first_refused) <= now;
        if late || state.waiting >= self.options.max_waiting {
            return Err(state.refuse(key, now, first_refused, &self.options, &mut rand::rng()));
        }
        let (tx, rx) = oneshot::channel();
        state.enqueue(tx, first_refused.is_some());
        Ok(Entry::Queued(Waiting {
            admission: Arc::clone(self),
            key,
            first_refused,
            since: now,
            place: Some(rx),
        }))
    }

    /// The limit now.
    pub fn limit(&self) -> usize {
        self.lock().aimd.limit()
    }

    /// Sends waiting for a place now.
    pub fn waiting(&self) -> usize {
        self.lock().waiting
    }

    fn key(&self, sender: &str, id: &[u8]) -> u64 {
        let mut hasher = self.keys.build_hasher();
        sender.hash(&mut hasher);
        id.hash(&mut hasher);
        hasher.finish()
    }

    fn pass(self: &Arc<Self>) -> Pass {
        Pass {
            admission: Arc::clone(self),
            started: Instant::now(),
            completion: None,
        }
    }

    /// How long a send that started waiting `since` may wait: `max_wait`,
    /// and no later than two of them after its first refusal, less the
    /// send's own time (twice the target).
    fn deadline(&self, since: Instant, first_refused: Option<Instant>) -> Instant {
        let wait = self.options.max_wait;
        let deadline = since + wait;
        let last = (wait * 2).saturating_sub(self.options.target * 2);
        first_refused.map_or(deadline, |first| deadline.min(first + last))
    }

    fn refuse(&self, key: u64, first_refused: Option<Instant>) -> Refusal {
        let now = Instant::now();
        self.lock()
            .refuse(key, now, first_refused, &self.options, &mut rand::rng())
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
        state.hand_out(now, self.options.target);
    }
}

type Waiter = oneshot::Sender<()>;

#[derive(Debug)]
struct State {
    aimd: Aimd,
    in_flight: usize,
    /// New sends waiting, oldest first. A waiter that gave up stays until
    /// it is reached or swept.
    fresh: VecDeque<Waiter>,
    /// Sends refused before and back, oldest first.
    returned: VecDeque<Waiter>,
    /// Whether the next place goes to a returned send, if one waits.
    returned_next: bool,
    /// Waiters that have not given up.
    waiting: usize,
    /// When no send was last seen waiting.
    last_empty: Instant,
    /// Sends refused, by key, and when first.
    refused: HashMap<u64, Instant>,
    last_sweep: Instant,
    rates: Rates,
}

/// Sends arriving per send served, measured over [`RATE_WINDOW`]s.
#[derive(Debug)]
struct Rates {
    since: Instant,
    arrived: u64,
    served: u64,
    /// Smoothed arrivals per send served; 1 or less is not overloaded.
    overload: f64,
}

impl State {
    fn new(options: AdmissionOptions, now: Instant) -> Self {
        Self {
            aimd: Aimd::new(options),
            in_flight: 0,
            fresh: VecDeque::new(),
            returned: VecDeque::new(),
            returned_next: true,
            waiting: 0,
            last_empty: now,
            refused: HashMap::new(),
            last_sweep: now,
            rates: Rates {
                since: now,
                arrived: 0,
                served: 0,
                overload: 1.0,
            },
        }
    }

    /// A send of `key` arrives; when it was first refused, if it was.
    fn arrived(&mut self, key: u64, now: Instant) -> Option<Instant> {
        self.roll(now);
        self.rates.arrived += 1;
        if self.waiting == 0 {
            self.last_empty = now;
        }
        if self.refused.is_empty() {
            return None;
        }
        self.refused.remove(&key)
    }

    fn roll(&mut self, now: Instant) {
        let rates = &mut self.rates;
        if now.saturating_duration_since(rates.since) < RATE_WINDOW {
            return;
        }
        let ratio = rates.arrived as f64 / rates.served.max(1) as f64;
        rates.overload += RATE_WEIGHT * (ratio.min(100.0) - rates.overload);
        rates.since = now;
        rates.arrived = 0;
        rates.served = 0;
    }

    fn enqueue(&mut self, waiter: Waiter, returned: bool) {
        let queue = if returned {
            &mut self.returned
        } else {
            &mut self.fresh
        };
        // Waiters that gave up are mostly the oldest.
        while queue.front().is_some_and(Waiter::is_closed) {
            queue.pop_front();
        }
        queue.push_back(waiter);
        self.waiting += 1;
    }

    /// Hand free places to waiting sends: returned ones and new ones in
    /// turn (returned ones in order of arrival; new ones the oldest first
    /// while the queue comes and goes, the newest first once it stands).
    fn hand_out(&mut self, now: Instant, target: Duration) {
        let standing = now.saturating_duration_since(self.last_empty) > target * 2;
        while self.in_flight < self.aimd.limit() {
            let returned_now = !self.returned.is_empty()
                && (self.fresh.is_empty() || self.returned_next);
            let next = if returned_now {
                self.returned.pop_front()
            } else if standing {
                self.fresh.pop_back()
            } else {
                self.fresh.pop_front()
            };
            let Some(next) = next else {
                break;
            };
            self.returned_next = !returned_now;
            if next.send(()).is_ok() {
                self.in_flight += 1;
                self.waiting -= 1;
            }
        }
        if self.waiting == 0 {
            self.last_empty = now;
        }
    }

    fn refuse(
        &mut self,
        key: u64,
        now: Instant,
        first_refused: Option<Instant>,
        options: &AdmissionOptions,
        rng: &mut impl Rng,
    ) -> Refusal {
        self.sweep(now);
        if self.refused.len() < MAX_REMEMBERED {
            self.refused.insert(key, first_refused.unwrap_or(now));
        }
        self.refusal(options, rng)
    }

    fn refusal(&self, options: &AdmissionOptions, rng: &mut impl Rng) -> Refusal {
        // Over capacity by a factor k, a refused send would wait about
        // (k - 1) queue-lengths for the spare capacity.
        let over = (self.rates.overload - 1.0).max(0.0);
        let wait = options
            .max_wait
            .mul_f64(over.min(1.0))
            .max(MIN_RETRY_AFTER);
        Refusal {
            retry_after: wait.mul_f64(rng.random_range(0.5..=1.0)),
        }
    }

    /// Forget refusals nobody came back for, now and then.
    fn sweep(&mut self, now: Instant) {
        if now.saturating_duration_since(self.last_sweep) < Duration::from_secs(1) {
            return;
        }
        self.last_sweep = now;
        self.refused
            .retain(|_, at| now.saturating_duration_since(*at) < REMEMBER_REFUSED);
    }

    fn completed(
        &mut self,
        started: Instant,
        now: Instant,
        in_flight: usize,
        completion: Completion,
    ) {
        self.roll(now);
        self.rates.served += 1;
        let rtt = now.saturating_duration_since(started);
        let congested = completion == Completion::Congested || rtt > self.aimd.target;
        self.aimd.update(started, now, in_flight, congested);
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
            ..AdmissionOptions::default()
        }
    }

    fn enter(door: &Arc<Admission>, n: u32) -> Result<Entry, Refusal> {
        door.enter("ana", &n.to_be_bytes())
    }

    fn now_pass(entry: Result<Entry, Refusal>) -> Pass {
        match entry {
            Ok(Entry::Now(pass)) => pass,
            Ok(Entry::Queued(_)) => panic!("queued, expected a place now"),
            Err(refusal) => panic!("refused: {refusal:?}"),
        }
    }

    fn queued(entry: Result<Entry, Refusal>) -> Waiting {
        match entry {
            Ok(Entry::Queued(waiting)) => waiting,
            Ok(Entry::Now(_)) => panic!("a place now, expected to wait"),
            Err(refusal) => panic!("refused: {refusal:?}"),
        }
    }

    type Served = tokio::sync::mpsc::UnboundedReceiver<(usize, Pass)>;
    type Waits = Vec<tokio::task::JoinHandle<Result<(), Refusal>>>;

    /// Wait for each queued send's place on a task of its own; each
    /// reports its number and its pass when the place comes.
    async fn wait_all(waiting: Vec<Waiting>) -> (Served, Waits) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let handles = waiting
            .into_iter()
            .enumerate()
            .map(|(n, w)| {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let pass = w.ready().await?;
                    let _ = tx.send((n, pass));
                    Ok(())
                })
            })
            .collect();
        tokio::task::yield_now().await;
        (rx, handles)
    }

    #[tokio::test(start_paused = true)]
    async fn a_send_beyond_the_limit_waits_and_takes_the_next_place_in_order() {
        let door = Admission::new(options(2));
        let first = now_pass(enter(&door, 0));
        let _second = now_pass(enter(&door, 1));
        let waiting: Vec<_> = (2..5).map(|n| queued(enter(&door, n))).collect();
        assert_eq!(door.waiting(), 3);
        let (mut served, _waits) = wait_all(waiting).await;
        tokio::time::advance(Duration::from_millis(100)).await;
        // A queue that came a moment ago is served in order of arrival.
        first.finish(Completion::Answered);
        let (n, pass) = served.recv().await.unwrap();
        assert_eq!(n, 0);
        assert_eq!(door.waiting(), 2);
        drop(pass);
        let (n, _pass) = served.recv().await.unwrap();
        assert_eq!(n, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn once_a_queue_stands_the_newest_send_goes_first() {
        let door = Admission::new(options(1));
        let first = now_pass(enter(&door, 0));
        let waiting: Vec<_> = (1..4).map(|n| queued(enter(&door, n))).collect();
        let (mut served, _waits) = wait_all(waiting).await;
        // The queue has stood for a second: the gateway is over capacity.
        tokio::time::advance(Duration::from_secs(1)).await;
        drop(first);
        let (n, _pass) = served.recv().await.unwrap();
        assert_eq!(n, 2, "the newest waiter");
    }

    #[tokio::test(start_paused = true)]
    async fn a_send_that_waits_too_long_is_refused_and_its_place_goes_to_the_next() {
        let door = Admission::new(options(1));
        let first = now_pass(enter(&door, 0));
        let old = queued(enter(&door, 1));
        tokio::time::advance(Duration::from_secs(5)).await;
        let young = queued(enter(&door, 2));
        let (mut served, waits) = wait_all(vec![old, young]).await;
        tokio::time::advance(Duration::from_millis(5_001)).await;
        let mut waits = waits.into_iter();
        let refused = waits.next().unwrap().await.unwrap().unwrap_err();
        assert!(refused.retry_after >= MIN_RETRY_AFTER / 2, "{refused:?}");
        assert_eq!(door.waiting(), 1);
        drop(first);
        let (n, _pass) = served.recv().await.unwrap();
        assert_eq!(n, 1, "the younger send, still in time");
        assert_eq!(door.waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_send_that_comes_back_takes_turns_with_new_ones() {
        let mut opts = options(1);
        opts.max_waiting = 2;
        let door = Admission::new(opts);
        let first = now_pass(enter(&door, 0));
        let gone = queued(enter(&door, 1));
        let older = queued(enter(&door, 2));
        // The queue is full: send 3 is refused, and remembered.
        let Err(refused) = enter(&door, 3) else {
            panic!("a third waiter");
        };
        drop(gone);
        tokio::time::advance(refused.retry_after).await;
        let back = queued(enter(&door, 3));
        let (mut served, _waits) = wait_all(vec![older, back]).await;
        drop(first);
        let (n, pass) = served.recv().await.unwrap();
        assert_eq!(n, 1, "the returned send, before the older new one");
        drop(pass);
        let (n, pass) = served.recv().await.unwrap();
        assert_eq!(n, 0, "then the new one");
        drop(pass);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_whose_connection_went_takes_no_place() {
        let door = Admission::new(options(1));
        let first = now_pass(enter(&door, 0));
        let gone = queued(enter(&door, 1));
        let stays = queued(enter(&door, 2));
        drop(gone);
        assert_eq!(door.waiting(), 1);
        let (mut served, _waits) = wait_all(vec![stays]).await;
        drop(first);
        let (_, pass) = served.recv().await.unwrap();
        assert_eq!(door.lock().in_flight, 1);
        drop(pass);
        assert_eq!(door.lock().in_flight, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_place_handed_to_a_waiter_dropped_before_it_looked_goes_back() {
        let door = Admission::new(options(1));
        let first = now_pass(enter(&door, 0));
        let waiter = queued(enter(&door, 1));
        // The place is handed over, then the connection goes before the
        // waiter runs.
        drop(first);
        assert_eq!(door.lock().in_flight, 1);
        drop(waiter);
        assert_eq!(door.lock().in_flight, 0);
        assert_eq!(door.waiting(), 0);
        now_pass(enter(&door, 2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_at_once() {
        let mut opts = options(1);
        opts.max_waiting = 2;
        let door = Admission::new(opts);
        let _first = now_pass(enter(&door, 0));
        let _a = queued(enter(&door, 1));
        let _b = queued(enter(&door, 2));
        let Err(refused) = enter(&door, 3) else {
            panic!("a third waiter");
        };
        assert!(refused.retry_after > Duration::ZERO);
    }

    #[test]
    fn the_retry_hint_grows_with_the_overload_and_is_jittered() {
        let opts = AdmissionOptions::default();
        let mut state = State::new(opts, Instant::now());
        let mut rng = StdRng::seed_from_u64(3);
        let mut hints = |state: &State| -> Vec<f64> {
            (0..200)
                .map(|_| state.refusal(&opts, &mut rng).retry_after.as_secs_f64())
                .collect()
        };
        let calm = hints(&state);
        assert!(calm.iter().all(|w| (0.05..=0.1).contains(w)), "{calm:?}");
        state.rates.overload = 1.5;
        let over = hints(&state);
        assert!(over.iter().all(|w| (2.5..=5.0).contains(w)), "{over:?}");
        let spread = over.iter().copied().fold(f64::MIN, f64::max)
            - over.iter().copied().fold(f64::MAX, f64::min);
        assert!(spread > 2.0, "jittered: {spread}");
        // Never more than the longest wait: a send waits, is refused,
        // comes back and waits again within three waits, inside a phone's
        // 31 s.
        state.rates.overload = 3.0;
        let far = hints(&state);
        assert!(far.iter().all(|w| (5.0..=10.0).contains(w)), "{far:?}");
    }

    #[test]
    fn the_overload_is_arrivals_per_send_served() {
        let start = Instant::now();
        let mut state = State::new(AdmissionOptions::default(), start);
        for second in 0..5 {
            let t = start + Duration::from_secs(second);
            for key in 0..300 {
                state.arrived(key, t);
            }
            for _ in 0..100 {
                state.completed(t, t, 1, Completion::Answered);
            }
        }
        state.roll(start + Duration::from_secs(5));
        let overload = state.rates.overload;
        assert!((2.8..=3.0).contains(&overload), "{overload}");
    }

    #[test]
    fn late_answers_cut_the_limit_once_per_round_trip_and_timely_ones_grow_it() {
        let now = Instant::now();
        let mut aimd = Aimd::new(AdmissionOptions {
            initial: 100,
            min: 10,
            max: 1000,
            ..AdmissionOptions::default()
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

    /// What the model's phones saw.
    #[derive(Default)]
    struct Seen {
        messages: u64,
        tries: u64,
        gave_up: u64,
        /// Sends served, per second of the run.
        served: Vec<u64>,
        /// (second the message was due, from due to served).
        latencies: Vec<(u64, Duration)>,
    }

    /// A gateway in front of a shard that serves one send per millisecond
    /// (a CPU-bound box at 1,000 sends/s), offered `surge` new sends per
    /// millisecond for 20 s, then half a send per millisecond for 10 s.
    /// A refused phone comes back when told; it gives up if that would be
    /// 31 s or more after its message was due.
    async fn offered(surge: f64) -> Seen {
        const SURGE: u64 = 20;
        const AFTER: u64 = 10;
        const GIVE_UP: Duration = Duration::from_secs(31);
        let door = Admission::new(AdmissionOptions::default());
        let start = Instant::now();
        let seen = Arc::new(Mutex::new(Seen {
            served: vec![0; 80],
            ..Seen::default()
        }));
        let (to_shard, mut shard) =
            tokio::sync::mpsc::unbounded_channel::<(Pass, oneshot::Sender<()>)>();
        tokio::spawn(async move {
            while let Some((pass, done)) = shard.recv().await {
                tokio::time::sleep(Duration::from_millis(1)).await;
                pass.finish(Completion::Answered);
                let _ = done.send(());
            }
        });
        let mut phones = tokio::task::JoinSet::new();
        let mut owed = 0.0;
        for ms in 0..(SURGE + AFTER) * 1000 {
            let due = start + Duration::from_millis(ms);
            tokio::time::sleep_until(due).await;
            owed += if ms < SURGE * 1000 { surge } else { 0.5 };
            while owed >= 1.0 {
                owed -= 1.0;
                let n = seen.lock().unwrap().messages as u32;
                seen.lock().unwrap().messages += 1;
                let (door, seen, to_shard) = (Arc::clone(&door), Arc::clone(&seen), to_shard.clone());
                phones.spawn(async move {
                    loop {
                        seen.lock().unwrap().tries += 1;
                        let refusal = match enter(&door, n) {
                            Ok(entry) => match entry.ready().await {
                                Ok(pass) => {
                                    let (done, served) = oneshot::channel();
                                    let _ = to_shard.send((pass, done));
                                    let _ = served.await;
                                    let now = Instant::now();
                                    let mut seen = seen.lock().unwrap();
                                    seen.served[(now - start).as_secs() as usize] += 1;
                                    seen.latencies.push(((due - start).as_secs(), now - due));
                                    return;
                                }
                                Err(refusal) => refusal,
                            },
                            Err(refusal) => refusal,
                        };
                        let back = Instant::now() + refusal.retry_after;
                        if back >= due + GIVE_UP {
                            seen.lock().unwrap().gave_up += 1;
                            return;
                        }
                        tokio::time::sleep_until(back).await;
                    }
                });
            }
        }
        while phones.join_next().await.is_some() {}
        Arc::try_unwrap(seen).ok().unwrap().into_inner().unwrap()
    }

    /// The 99th percentile of the latencies of messages due in `seconds`.
    fn p99(seen: &Seen, seconds: std::ops::Range<u64>) -> Duration {
        let mut l: Vec<Duration> = seen
            .latencies
            .iter()
            .filter(|(due, _)| seconds.contains(due))
            .map(|(_, l)| *l)
            .collect();
        l.sort();
        l[l.len() * 99 / 100]
    }

    #[tokio::test(start_paused = true)]
    async fn at_one_and_a_half_times_capacity_it_serves_at_capacity_and_every_message_in_time() {
        let seen = offered(1.5).await;
        // Busy all along after the first two seconds.
        for (second, served) in seen.served[2..20].iter().enumerate() {
            assert!(*served >= 900, "second {}: {served} served", second + 2);
        }
        assert_eq!(seen.gave_up, 0);
        assert_eq!(seen.latencies.len() as u64, seen.messages);
        let tries = seen.tries as f64 / seen.messages as f64;
        assert!(tries <= 2.0, "{tries:.2} tries per message");
        // Five seconds after the surge, new messages are served at once.
        let after = p99(&seen, 25..30);
        assert!(after <= Duration::from_millis(500), "p99 after: {after:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn at_three_times_capacity_it_serves_at_capacity_and_recovers_at_once() {
        let seen = offered(3.0).await;
        for (second, served) in seen.served[2..20].iter().enumerate() {
            assert!(*served >= 900, "second {}: {served} served", second + 2);
        }
        let served = seen.latencies.len() as u64;
        assert_eq!(served + seen.gave_up, seen.messages);
        // What was served was served within the phones' patience, but for
        // a handful: the wait ends in time, and the send itself takes
        // about the target after it, sometimes more while the limit adapts.
        let late = seen.latencies.iter().filter(|(_, l)| *l >= Duration::from_secs(31));
        let late = late.count();
        assert!(late * 1000 <= served as usize, "{late} of {served} served after 31 s");
        // Tries: about two per message, not dozens.
        let tries = seen.tries as f64 / seen.messages as f64;
        assert!(tries <= 3.0, "{tries:.2} tries per message");
        let after = p99(&seen, 25..30);
        assert!(after <= Duration::from_millis(500), "p99 after: {after:?}");
    }
}
