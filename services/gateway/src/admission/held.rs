//! The held sends: three queues a place given back is offered to in turn
//! (which one takes it is the door's rule, [`super::door`]).

use std::{
    collections::{HashMap, VecDeque},
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
    pub(super) arriving: bool,
    pub(super) place: oneshot::Sender<Call>,
    /// Whose its place will be: a new send's when it was held ahead of the
    /// backlog ([`super::Refusal::AheadOfBacklog`]), so the draining
    /// backlog keeps to its share while it is in flight; the backlog's
    /// otherwise.
    pub(super) holder: Holder,
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
    /// Held sends that go before the rest: of conversations a new send
    /// waits in while the backlog drains.
    pub(super) urgent: VecDeque<Waiter>,
}

impl Queues {
    pub(super) fn push(&mut self, waiter: Waiter, lane: Lane) {
        // Appointments are handed out in order, so the backlog stays in
        // their order (a send held behind its conversation's held send may
        // repeat an earlier appointment; it still goes after that send).
        self.queue(lane).push_back(waiter);
    }

    pub(super) fn is_empty(&self) -> bool {
        self.backlog.is_empty() && self.ahead.is_empty() && self.urgent.is_empty()
    }

    pub(super) fn queue(&mut self, lane: Lane) -> &mut VecDeque<Waiter> {
        match lane {
            Lane::Backlog => &mut self.backlog,
            Lane::Ahead => &mut self.ahead,
            Lane::Urgent => &mut self.urgent,
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
        let queue = self.queue(lane);
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
            if waiter.arriving {
                arriving.push(waiter);
            } else {
                self.backlog.push_back(waiter);
            }
        }
        arriving
    }
}
