//! Followers: readers that follow every conversation with a cursor while
//! the load runs, as receiving phones do (`after_seq` = the last seq they
//! have). A message that shows up below a cursor that already passed it is
//! never delivered to such a reader: the audit counts those.

use std::{collections::HashMap, time::Duration};

use futures_util::StreamExt;
use imdedup_client::{Client, HistoryMessage};
use tokio_util::sync::CancellationToken;

use crate::link::Link;

/// The run's phones: each one's reconnecting link (and second connection).
pub type Phones = std::sync::Arc<Vec<(Link, Option<Client>)>>;

/// Pulls in flight at once during a sweep.
const PULLS_IN_FLIGHT: usize = 32;
/// Shortest pause between two sweeps over every conversation; a long sweep
/// is followed by a pause twice as long, so following costs the driver and
/// the cluster at most a third of one reader's time.
const SWEEP_PAUSE: Duration = Duration::from_millis(500);
/// Rows asked for per pull.
const PAGE: u32 = 1000;

/// What followers received, per conversation, in the order received.
pub type Delivered = HashMap<String, Vec<HistoryMessage>>;

/// Follow each conversation through its reader's phone until `stop`, then
/// sweep once more and return what was delivered. Pull errors are retried
/// on the next sweep (the cursor stays where it was).
pub async fn follow(
    phones: Phones,
    readers: Vec<(String, usize)>,
    stop: CancellationToken,
) -> Delivered {
    let mut delivered: Delivered = readers
        .iter()
        .map(|(c, _)| (c.clone(), Vec::new()))
        .collect();
    let readers: HashMap<String, usize> = readers.into_iter().collect();
    loop {
        let stopping = stop.is_cancelled();
        let started = tokio::time::Instant::now();
        sweep(&phones, &readers, &mut delivered).await;
        if stopping {
            return delivered;
        }
        tokio::select! {
            () = stop.cancelled() => {}
            () = tokio::time::sleep(SWEEP_PAUSE.max(started.elapsed() * 2)) => {}
        }
    }
}

/// After the load, keep following the conversations whose followers have
/// not yet reached the end of the final history (`ends`: conversation →
/// last stored seq), until they do or `within` has passed. A follower can
/// only be behind, not past, a row here: a reader stops before a row that
/// may still be settled (a pending row younger than the store's fence, or
/// a settling write that failed) and gets it on a later pull, as a phone
/// does. What is still undelivered after this is counted as missed.
pub async fn catch_up(
    phones: &Phones,
    readers: &[(String, usize)],
    delivered: &mut Delivered,
    ends: &HashMap<String, u64>,
    within: Duration,
) {
    let readers: HashMap<String, usize> = readers.iter().cloned().collect();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let lagging = behind(delivered, ends);
        if lagging.is_empty() || tokio::time::Instant::now() >= deadline {
            return;
        }
        let started = tokio::time::Instant::now();
        let cursors = lagging
            .into_iter()
            .map(|c| {
                let cursor = delivered[&c].last().map_or(0, |r| r.seq);
                (c, cursor)
            })
            .collect();
        pull_from(phones, &readers, delivered, cursors).await;
        if !behind(delivered, ends).is_empty() {
            tokio::time::sleep(SWEEP_PAUSE.max(started.elapsed() * 2)).await;
        }
    }
}

/// Conversations whose follower has not reached `ends`.
fn behind(delivered: &Delivered, ends: &HashMap<String, u64>) -> Vec<String> {
    delivered
        .iter()
        .filter(|(c, rows)| {
            let cursor = rows.last().map_or(0, |r| r.seq);
            ends.get(*c).is_some_and(|&end| cursor < end)
        })
        .map(|(c, _)| c.clone())
        .collect()
}

/// Most waits a sweep spends on one conversation's retry-after hints.
const MAX_WAITS: u32 = 50;

/// Pull every conversation from its cursor to its end. A phone the gateway
/// dropped dials again; one that cannot connect is retried on the next
/// sweep, cursors unchanged.
async fn sweep(phones: &Phones, readers: &HashMap<String, usize>, delivered: &mut Delivered) {
    let cursors: Vec<(String, u64)> = delivered
        .iter()
        .map(|(c, rows)| (c.clone(), rows.last().map_or(0, |r| r.seq)))
        .collect();
    pull_from(phones, readers, delivered, cursors).await;
}

/// Pull each conversation from its cursor to its end.
async fn pull_from(
    phones: &Phones,
    readers: &HashMap<String, usize>,
    delivered: &mut Delivered,
    cursors: Vec<(String, u64)>,
) {
    let mut pulls = futures_util::stream::iter(cursors)
        .map(|(conversation, mut cursor)| async move {
            let mut new = Vec::new();
            let Some(&reader) = readers.get(&conversation) else {
                return (conversation, new);
            };
            let Ok((_, client)) = phones[reader].0.client().await else {
                return (conversation, new);
            };
            // A pull the gateway asks to repeat later is repeated after
            // the wait it names, as a phone should.
            let mut waits = 0;
            loop {
                match client.history(&conversation, cursor, PAGE).await {
                    Ok(Ok(page)) if !page.messages.is_empty() => {
                        cursor = page.messages.last().map_or(cursor, |m| m.seq);
                        new.extend(page.messages);
                    }
                    Ok(Err(e)) if e.retryable && waits < MAX_WAITS => match e.retry_after {
                        Some(wait) => {
                            waits += 1;
                            tokio::time::sleep(wait).await;
                        }
                        None => break,
                    },
                    _ => break,
                }
            }
            (conversation, new)
        })
        .buffer_unordered(PULLS_IN_FLIGHT);
    while let Some((conversation, new)) = pulls.next().await {
        if let Some(rows) = delivered.get_mut(&conversation) {
            rows.extend(new);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(seq: u64) -> HistoryMessage {
        HistoryMessage {
            sender: "u1".into(),
            id: seq.to_be_bytes().to_vec(),
            server_id: seq,
            seq,
            body: String::new(),
        }
    }

    #[test]
    fn only_followers_short_of_a_historys_end_are_behind() {
        let delivered: Delivered = [
            ("at-end".to_owned(), vec![row(1), row(2)]),
            ("short".to_owned(), vec![row(1)]),
            ("nothing-yet".to_owned(), vec![]),
            ("empty-history".to_owned(), vec![]),
        ]
        .into();
        let ends: HashMap<String, u64> = [
            ("at-end".to_owned(), 2),
            ("short".to_owned(), 3),
            ("nothing-yet".to_owned(), 1),
        ]
        .into();
        let mut lagging = behind(&delivered, &ends);
        lagging.sort();
        assert_eq!(lagging, ["nothing-yet", "short"]);
    }
}
