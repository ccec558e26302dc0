//! The held sends: three queues a place given back is offered to in turn
//! (which one takes it is the door's rule, [`super::door`]).

use std::{
    cmp::Reverse,
    collections::{BTreeMap, HashMap, VecDeque},
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

use super::{Call, Holder};

/// A held send in a queue.
pub(super) struct Waiter {
    pub(super) key: u64,
    /// Its appointment.
    pub(super) due: Instant,
    /// When it was held, and whether its message was arriving then
    /// ([`super::Newness::Arriving`]): such sends held just before the end
    /// of a surge was seen move to the front of the backlog once it is
    /// ([`Queues::take_arriving_since`]).
    pub(super) held_at: Instant,
    /// How long its phone had had the message when it was held.
    pub(super) age: Duration,
    pub(super) place: oneshot::Sender<Call>,
    /// Whose its place will be: a new send's when it was held ahead of the
    /// backlog ([`super::Refusal::AheadOfBacklog`]), so the draining
    /// backlog keeps to its share while it is in flight; the backlog's
    /// otherwise.
    pub(super) holder: Holder,
}

impl Waiter {
    /// Whether its message was arriving when held.
    pub(super) fn arriving(&self) -> bool {
        super::arriving(self.age)
    }

    /// When its message was written: in the urgent lane the youngest new
    /// message goes first. Only a fresh message's is compared (a new
    /// send's), and it is seconds old: an age beyond the clock's start
    /// belongs to an old one.
    fn written(&self) -> Instant {
        self.held_at.checked_sub(self.age).unwrap_or(self.held_at)
    }
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("due", &self.due)
            .finish_non_exhaustive()
    }
}

/// Which queue a held send waits in; the urgent one is served first, the
/// backlog last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Lane {
    /// With the backlog, at its appointment ([`super::Admission::hold`]).
    Backlog,
    /// At the front of the backlog ([`super::Admission::hold_ahead`]).
    Ahead,
    /// Ahead of the backlog ([`super::Admission::hold_urgent`]).
    Urgent,
}

/// The held sends, one queue per [`Lane`].
#[derive(Debug, Default)]
pub(super) struct Queues {
    /// The backlog, in the order of its appointments.
    pub(super) backlog: VecDeque<Waiter>,
    /// Held sends at the front of the backlog.
    pub(super) ahead: VecDeque<Waiter>,
    /// Held sends that go before the rest: new sends while the backlog
    /// drains, and the held sends of their conversations before them.
    pub(super) urgent: Urgent,
}

/// The urgent lane. The held sends a new send waits behind go first, in
/// the order held (the new send waits for each); then the new sends, the
/// youngest message first, as in adaptive LIFO: in the seconds after a 3x
/// surge, in the order held, the new messages of the moment waited 1-5 s
/// behind messages written in the surge's last seconds and sent when their
/// phones' throttles let them (two thirds of the new sends answered in the
/// first three seconds were of the surge). While the backlog drains more
/// is answered than arrives, so the lane empties, the oldest last.
#[derive(Debug, Default)]
pub(super) struct Urgent {
    /// By rank, the last first.
    ranked: BTreeMap<Rank, Waiter>,
    /// Sends pushed so far: the order held, among equals.
    pushed: u64,
}

/// Which urgent send goes first: the greater (each is unique).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Rank {
    /// A new send: the youngest message, then the first held.
    New(Instant, Reverse<u64>),
    /// A held send a new send waits behind: before every new send, in the
    /// order held.
    Before(Reverse<u64>),
}

impl Urgent {
    fn push(&mut self, waiter: Waiter) {
        let order = Reverse(self.pushed);
        self.pushed += 1;
        let rank = match waiter.holder {
            Holder::New => Rank::New(waiter.written(), order),
            Holder::Backlog => Rank::Before(order),
        };
        self.ranked.insert(rank, waiter);
    }

    fn front(&self) -> Option<&Waiter> {
        self.ranked.last_key_value().map(|(_, waiter)| waiter)
    }

    fn pop_front(&mut self) -> Option<Waiter> {
        self.ranked.pop_last().map(|(_, waiter)| waiter)
    }

    fn is_empty(&self) -> bool {
        self.ranked.is_empty()
    }
}

impl Queues {
    pub(super) fn push(&mut self, waiter: Waiter, lane: Lane) {
        // Appointments are handed out in order, so the backlog stays in
        // their order (a send held behind its conversation's held send may
        // repeat an earlier appointment; it still goes after that send).
        match lane {
            Lane::Backlog => self.backlog.push_back(waiter),
            Lane::Ahead => self.ahead.push_back(waiter),
            Lane::Urgent => self.urgent.push(waiter),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.backlog.is_empty() && self.ahead.is_empty() && self.urgent.is_empty()
    }

    fn front(&self, lane: Lane) -> Option<&Waiter> {
        match lane {
            Lane::Backlog => self.backlog.front(),
            Lane::Ahead => self.ahead.front(),
            Lane::Urgent => self.urgent.front(),
        }
    }

    /// The first send of `lane`, out of it.
    pub(super) fn pop_front(&mut self, lane: Lane) -> Option<Waiter> {
        match lane {
            Lane::Backlog => self.backlog.pop_front(),
            Lane::Ahead => self.ahead.pop_front(),
            Lane::Urgent => self.urgent.pop_front(),
        }
    }

    /// The first send of `lane` still worth a place: those before it whose
    /// connection closed, or held longer than `stale` after their
    /// appointment, are dropped (their phones are told) and their
    /// appointments forgotten from `book`.
    pub(super) fn live_front(
        &mut self,
        lane: Lane,
        book: &mut HashMap<u64, Instant>,
        now: Instant,
        stale: Duration,
    ) -> Option<&Waiter> {
        while let Some(front) = self.front(lane) {
            if !front.place.is_closed() && now.saturating_duration_since(front.due) <= stale {
                break;
            }
            if let Some(gone) = self.pop_front(lane) {
                book.remove(&gone.key);
            }
        }
        self.front(lane)
    }

    /// The backlog's sends held since `since` whose messages were arriving
    /// when held, out of the queue in their order; the others stay.
    pub(super) fn take_arriving_since(&mut self, since: Instant) -> Vec<Waiter> {
        // Held sends are pushed at the back as they come, so those held
        // since then are the end of the queue.
        let from = self
            .backlog
            .iter()
            .rposition(|waiter| waiter.held_at < since)
            .map_or(0, |before| before + 1);
        let recent: Vec<Waiter> = self.backlog.drain(from..).collect();
        let mut arriving = Vec::new();
        for waiter in recent {
            if waiter.arriving() {
                arriving.push(waiter);
            } else {
                self.backlog.push_back(waiter);
            }
        }
        arriving
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held at `now`, of a message `age_ms` old.
    fn urgent(queues: &mut Queues, key: u64, holder: Holder, now: Instant, age_ms: u64) {
        let (place, _) = oneshot::channel();
        let waiter = Waiter {
            key,
            due: now,
            held_at: now,
            age: Duration::from_millis(age_ms),
            place,
            holder,
        };
        queues.push(waiter, Lane::Urgent);
    }

    /// After a surge, new sends of messages written in its last seconds
    /// and of messages written now are held together: the youngest go
    /// first, except the held sends new sends wait behind, which go before
    /// all of them in the order held.
    #[test]
    fn the_urgent_lane_serves_what_new_sends_wait_for_then_the_youngest() {
        let now = Instant::now();
        let mut queues = Queues::default();
        urgent(&mut queues, 1, Holder::New, now, 4_000);
        urgent(&mut queues, 2, Holder::New, now, 100);
        urgent(&mut queues, 3, Holder::Backlog, now, 30_000);
        urgent(&mut queues, 4, Holder::New, now, 2_000);
        urgent(&mut queues, 5, Holder::New, now, 100);
        urgent(&mut queues, 6, Holder::Backlog, now, 20_000);
        let mut served = Vec::new();
        while let Some(waiter) = queues.pop_front(Lane::Urgent) {
            served.push(waiter.key);
        }
        assert_eq!(served, [3, 6, 2, 5, 4, 1]);
        assert!(queues.is_empty());
    }
}
