//! The order of a conversation's sends on one connection: each waits until
//! the one before it is answered, so seqs follow the order the phone sent
//! them in.

use std::collections::HashMap;

use tokio::sync::oneshot;

/// Keeps the sends of one conversation on one connection in the order the
/// phone sent them: each waits until the one before it has been answered, so
/// seqs follow send order. Sends to other conversations do not wait.
#[derive(Default)]
pub(super) struct SendOrder {
    /// Per conversation, the signal that its latest send was answered.
    last: HashMap<String, oneshot::Receiver<()>>,
    /// Size of `last` at which the answered conversations are forgotten
    /// next.
    prune_at: usize,
}

/// A send's place in its conversation's order.
pub(super) struct Turn {
    pub(super) after: Option<oneshot::Receiver<()>>,
    pub(super) done: oneshot::Sender<()>,
}

/// Held while a send is in progress; dropping it (and so its sender) lets
/// the next one go.
pub(super) struct Going {
    _done: oneshot::Sender<()>,
}

impl SendOrder {
    pub(super) fn next(&mut self, conversation: &str) -> Turn {
        // Forget conversations whose last send was answered.
        prune(&mut self.last, &mut self.prune_at, |_, rx| {
            matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty))
        });
        let (done, rx) = oneshot::channel();
        let after = self.last.insert(conversation.to_owned(), rx);
        Turn { after, done }
    }
}

/// A connection keeps this many conversations before it first forgets
/// finished ones.
const PRUNE_FROM: usize = 64;

/// Forget the entries of `map` that `keep` rejects, each time the map has
/// doubled since the last time (and from [`PRUNE_FROM`] entries). While a
/// backlog stands, hundreds of a connection's conversations have a send
/// pending; going through all of them on every send (as before) cost the
/// gateway time in proportion to its backlog, just when it had least.
pub(super) fn prune<V>(
    map: &mut HashMap<String, V>,
    prune_at: &mut usize,
    keep: impl FnMut(&String, &mut V) -> bool,
) {
    if map.len() >= *prune_at {
        map.retain(keep);
        *prune_at = map.len().saturating_mul(2).max(PRUNE_FROM);
    }
}

/// Wait until the send before (if any) is answered; `after` is `None`
/// from then on.
pub(super) async fn answered(after: &mut Option<oneshot::Receiver<()>>) {
    if let Some(before) = after.as_mut() {
        let _ = before.await;
    }
    *after = None;
}

impl Turn {
    /// Wait until the previous send of the conversation was answered (or
    /// dropped).
    pub(super) async fn wait(self) -> Going {
        if let Some(after) = self.after {
            let _ = after.await;
        }
        Going { _done: self.done }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn send_order_forgets_answered_conversations_and_keeps_pending_ones() {
        let mut order = SendOrder::default();
        // 300 conversations with a send pending, then thousands answered.
        let pending: Vec<Turn> = (0..300).map(|i| order.next(&format!("p{i}"))).collect();
        for i in 0..5_000 {
            drop(order.next(&format!("a{i}")));
        }
        assert!(
            order.last.len() < 2 * 300 + PRUNE_FROM,
            "answered conversations are forgotten: {} kept",
            order.last.len()
        );
        // Every pending conversation still orders its next send after it.
        let mut going = Vec::new();
        for (i, first) in pending.into_iter().enumerate() {
            let next = order.next(&format!("p{i}"));
            assert!(next.after.is_some(), "p{i} forgot its pending send");
            going.push((first.wait().await, next));
        }
        let (first, next) = going.pop().expect("a pending conversation");
        let waiting = next.wait();
        tokio::pin!(waiting);
        let early = tokio::time::timeout(Duration::from_millis(20), &mut waiting).await;
        assert!(early.is_err(), "waits for the send before it");
        drop(first);
        let after = tokio::time::timeout(Duration::from_secs(5), &mut waiting).await;
        assert!(after.is_ok(), "goes once it is answered");
    }

    #[test]
    fn prune_runs_again_only_after_the_map_doubles() {
        let mut map: HashMap<String, bool> = HashMap::new();
        let mut prune_at = 0;
        let mut sweeps = 0;
        for i in 0..10_000 {
            prune(&mut map, &mut prune_at, |_, _| {
                sweeps += 1;
                true
            });
            map.insert(i.to_string(), true);
        }
        // Everything kept: sweeps at 64, 128, 256, ... entries, each over
        // the whole map, sum under twice the final size.
        assert!(
            sweeps < 2 * 10_000,
            "{sweeps} entries visited for 10,000 inserts"
        );
    }
}
