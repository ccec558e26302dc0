//! The sends a connection holds for their turn (phones that ask for
//! `queue`), and how each is sent when its place comes.

use std::{collections::HashMap, sync::Arc};

use imdedup_domain::{Error, model::Sender};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{
    Reply,
    order::{Turn, answered, prune},
    send,
};
use crate::{
    Gateway, Held,
    admission::{Call, Completion, Lane, Pass},
    frames::{ReplyTo, SendCmd},
    resends::Leader,
};

/// The sends this connection holds for their appointments.
#[derive(Default)]
pub(super) struct HeldSends {
    /// Per conversation with held sends, the signal that moves them ahead
    /// of the backlog; each of its held sends still waiting for a place
    /// holds a clone (see [`HeldSends::waiting`]).
    promote: HashMap<String, Arc<Notify>>,
    /// Size of `promote` at which the conversations without held sends are
    /// forgotten next.
    prune_at: usize,
    /// Cancelled when the connection ends: held sends not started yet are
    /// answered `unavailable` then.
    pub(super) closing: CancellationToken,
}

/// Whether a held send of the conversation whose promotion signal this is
/// still waits for a place: each such send keeps a clone until its place
/// comes.
fn still_held(promote: &Arc<Notify>) -> bool {
    Arc::strong_count(promote) > 1
}

impl HeldSends {
    /// Whether a send of `conversation` is held and still waits for a
    /// place, whether or not its appointment has come: a send behind it
    /// must then be held too. Taken in, it would wait for that send's turn
    /// holding a place of the limit, and sends waiting like that, once
    /// they hold every place, leave none for the held sends they wait for
    /// (on Redis + Cassandra at 3x the capacity every send in flight waited
    /// so and nothing was answered for a minute).
    pub(super) fn waiting(&self, conversation: &str) -> bool {
        self.promote.get(conversation).is_some_and(still_held)
    }

    /// Hold a send of `conversation`: the signal it listens to for
    /// promotion, to keep until its place comes.
    pub(super) fn hold(&mut self, conversation: &str) -> Arc<Notify> {
        prune(&mut self.promote, &mut self.prune_at, |_, promote| {
            still_held(promote)
        });
        Arc::clone(self.promote.entry(conversation.to_owned()).or_default())
    }

    /// A new send of `conversation` came: while the backlog drains, its
    /// held sends go ahead of the backlog, so that this one does not wait
    /// behind all of it.
    pub(super) fn promote_if_draining(&self, conversation: &str, gateway: &Gateway) {
        if let Some(promote) = self.promote.get(conversation)
            && still_held(promote)
            && gateway.draining()
        {
            promote.notify_waiters();
        }
    }
}

/// Send a held send when its place comes, after the sends of its
/// conversation before it, and answer it; or answer `unavailable` if the
/// connection ends first.
pub(super) async fn serve_held(
    reply: Reply,
    sender: Sender,
    cmd: SendCmd,
    hold: Held,
    turn: Turn,
    closing: CancellationToken,
    promote: Arc<Notify>,
) {
    let Held {
        mut ticket,
        promoted,
        new,
        leader,
        ..
    } = hold;
    let Turn { mut after, done } = turn;
    // The queue its ticket is for, and the one it is to move to.
    let mut lane = Lane::Backlog;
    let mut wanted = if promoted {
        Lane::Urgent
    } else {
        Lane::Backlog
    };
    // The ticket's word to go ahead came: it is out of the queue until
    // moved.
    let mut spent = false;
    let placed = loop {
        tokio::select! {
            () = closing.cancelled() => break Err(Error::unavailable(
                "the connection closed before the queued send's turn; not stored: resend with the same id",
            )),
            call = ticket.call(), if !spent => match call {
                Some(Call::Place(pass)) => break Ok(pass),
                // A new message held just before the end of the surge was
                // seen: to the front of the backlog, and its conversation's
                // held sends ahead of it.
                Some(Call::Ahead) => {
                    promote.notify_waiters();
                    wanted = wanted.max(Lane::Ahead);
                    spent = true;
                }
                None => break Err(reply.gateway.held_too_long()),
            },
            // Its conversation has a new send while the backlog drains:
            // ahead of the backlog,
            () = promote.notified(), if wanted < Lane::Urgent => wanted = Lane::Urgent,
            // once the sends before it are answered (the old ticket,
            // dropped, leaves the queue). Ahead of them it would take a
            // place and wait for their turn in it, and sends waiting so,
            // once they hold every place, leave none for those before them.
            () = answered(&mut after), if wanted > lane => {
                let age = cmd.age + reply.read_at.elapsed();
                ticket = if wanted == Lane::Urgent {
                    reply.gateway.hold_urgent(&sender, &cmd.id, new, age)
                } else {
                    reply.gateway.hold_ahead(&sender, &cmd.id, age)
                };
                (lane, spent) = (wanted, false);
            }
        }
    };
    let turn = Turn { after, done };
    // No longer waiting for a place: a new send of the conversation may
    // take one and wait for this send's turn.
    drop(promote);
    // Tens of thousands wait here in a surge, each a task: the send's own
    // state (2 KB of gRPC call) is allocated when its place comes, not for
    // the whole wait (632 bytes a held task instead of 2,560).
    Box::pin(send_held(reply, sender, cmd, placed, turn, leader)).await;
}

/// A held send, once its place came (or never will): sent in its
/// conversation's turn, and answered.
async fn send_held(
    reply: Reply,
    sender: Sender,
    cmd: SendCmd,
    placed: Result<Pass, Error>,
    turn: Turn,
    leader: Option<Leader>,
) {
    let to = ReplyTo::send(&cmd);
    let id_b64 = cmd.id_b64;
    let in_flight = reply.gateway.metrics().send_started();
    let result = match placed {
        Ok(pass) => {
            let going = turn.wait().await;
            let result = send(&reply.gateway, sender, cmd).await;
            drop(going);
            pass.finish(Completion::of(&result));
            result
        }
        Err(error) => Err(error),
    };
    if let Some(leader) = leader {
        leader.answer(&result);
    }
    reply.send(to, id_b64, result, in_flight).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A held send whose appointment passed while the gateway was behind
    /// still waits for a place, so a new send of its conversation must be
    /// held behind it (not take a place and wait for its turn there); once
    /// its place came, a new send may go.
    #[test]
    fn a_held_send_holds_back_its_conversation_until_its_place_comes() {
        let mut held = HeldSends::default();
        assert!(!held.waiting("dm:ana:bo"));
        let listening = held.hold("dm:ana:bo");
        assert!(held.waiting("dm:ana:bo"));
        assert!(!held.waiting("dm:ana:carl"));
        let second = held.hold("dm:ana:bo");
        drop(listening);
        assert!(held.waiting("dm:ana:bo"), "one of its sends still waits");
        drop(second);
        assert!(!held.waiting("dm:ana:bo"));
    }
}
