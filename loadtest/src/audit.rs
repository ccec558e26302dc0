//! The audit: what receivers see, checked against what phones sent.

use std::collections::{HashMap, HashSet};

use imdedup_client::HistoryMessage;
use serde::Serialize;

use crate::phone::Trace;

/// One message as the driver sent it.
#[derive(Debug, Clone)]
pub struct Sent {
    pub sender: String,
    pub id: Vec<u8>,
    pub conversation: String,
    pub trace: Trace,
}

/// Every check as a count. `passed` is false when any must-be-zero count is
/// not zero.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Audit {
    pub messages: u64,
    pub stored_rows: u64,
    /// The server ACKed it (the ACK may have been lost), but no row: must be 0.
    pub lost: u64,
    /// One sender and ID stored more than once: must be 0.
    pub repeats: u64,
    /// An ACK whose server id or seq differs from the first ACK or the row:
    /// must be 0.
    pub ack_mismatches: u64,
    /// Seqs in a conversation not unique or not increasing: must be 0.
    pub seq_order_violations: u64,
    /// Missing seqs between stored ones (harmless; counted).
    pub seq_gaps: u64,
    /// Never ACKed to the phone within its give-up time; the phone shows
    /// them as failed, and a later resend would store or find them.
    pub failed: u64,
    /// Failed on the phone but stored (the last ACK was lost).
    pub failed_but_stored: u64,
    /// Stored, but never delivered to a follower: the row appeared below a
    /// cursor that had already passed its seq. Must be 0.
    pub missed_by_followers: u64,
    /// Delivered to a follower out of seq order: must be 0.
    pub delivered_out_of_order: u64,
    /// Rows the followers received (0 when the run had no followers).
    pub delivered_to_followers: u64,
    /// Two messages a phone sent one after the other into one conversation
    /// on one connection, stored in the opposite order: must be 0.
    pub stored_out_of_send_order: u64,
}

impl Audit {
    pub fn passed(&self) -> bool {
        self.lost == 0
            && self.repeats == 0
            && self.ack_mismatches == 0
            && self.seq_order_violations == 0
            && self.missed_by_followers == 0
            && self.delivered_out_of_order == 0
            && self.stored_out_of_send_order == 0
    }

    /// Compare what the followers received (`delivered`, per conversation
    /// in the order received) with the final `histories`.
    pub fn add_followers(
        &mut self,
        histories: &HashMap<String, Vec<HistoryMessage>>,
        delivered: &HashMap<String, Vec<HistoryMessage>>,
    ) {
        for (conversation, rows) in histories {
            let received = delivered.get(conversation).map_or(&[][..], Vec::as_slice);
            self.delivered_to_followers += received.len() as u64;
            self.delivered_out_of_order += received
                .windows(2)
                .filter(|pair| pair[1].seq <= pair[0].seq)
                .count() as u64;
            let seen: HashSet<(&str, &[u8])> = received
                .iter()
                .map(|row| (row.sender.as_str(), row.id.as_slice()))
                .collect();
            self.missed_by_followers += rows
                .iter()
                .filter(|row| !seen.contains(&(row.sender.as_str(), row.id.as_slice())))
                .count() as u64;
        }
    }
}

/// Check `sent` against the stored `histories` (conversation → rows in seq
/// order, as pulled).
pub fn audit(sent: &[Sent], histories: &HashMap<String, Vec<HistoryMessage>>) -> Audit {
    let mut audit = Audit {
        messages: sent.len() as u64,
        ..Audit::default()
    };
    let mut rows: HashMap<(&str, &[u8]), Vec<&HistoryMessage>> = HashMap::new();
    for history in histories.values() {
        audit.stored_rows += history.len() as u64;
        let mut seen = HashSet::new();
        for pair in history.windows(2) {
            if pair[1].seq <= pair[0].seq {
                audit.seq_order_violations += 1;
            } else {
                audit.seq_gaps += pair[1].seq - pair[0].seq - 1;
            }
        }
        for row in history {
            if !seen.insert(row.seq) {
                audit.seq_order_violations += 1;
            }
            rows.entry((row.sender.as_str(), row.id.as_slice()))
                .or_default()
                .push(row);
        }
    }
    audit.repeats = rows.values().map(|r| r.len() as u64 - 1).sum();

    // Per phone connection and conversation: the seqs of the sends that
    // stored, in the order their frames were written.
    // (sender, conversation, connection) -> (frame, seq)
    type Stores<'a> = HashMap<(&'a str, &'a str, u64), Vec<(u64, u64)>>;
    let mut stores = Stores::new();
    for message in sent {
        if let Some((connection, frame, seq)) = message.trace.stored_by_frame {
            stores
                .entry((
                    message.sender.as_str(),
                    message.conversation.as_str(),
                    connection,
                ))
                .or_default()
                .push((frame, seq));
        }
    }
    for stored in stores.values_mut() {
        stored.sort_unstable();
        audit.stored_out_of_send_order += stored
            .windows(2)
            .filter(|pair| pair[1].1 < pair[0].1)
            .count() as u64;
    }

    for message in sent {
        let stored = rows.get(&(message.sender.as_str(), message.id.as_slice()));
        let acked = !message.trace.server_acks.is_empty();
        if acked && stored.is_none() {
            audit.lost += 1;
        }
        if message.trace.received.is_none() {
            audit.failed += 1;
            if stored.is_some() {
                audit.failed_but_stored += 1;
            }
        }
        let reference = stored
            .and_then(|r| r.first())
            .map(|row| (row.server_id, row.seq))
            .or_else(|| {
                message
                    .trace
                    .server_acks
                    .first()
                    .map(|a| (a.server_id, a.seq))
            });
        audit.ack_mismatches += message
            .trace
            .server_acks
            .iter()
            .filter(|a| Some((a.server_id, a.seq)) != reference)
            .count() as u64;
    }
    audit
}

#[cfg(test)]
mod tests {
    use imdedup_client::AckReply;

    use super::*;

    fn row(sender: &str, id: &str, seq: u64) -> HistoryMessage {
        HistoryMessage {
            sender: sender.into(),
            id: id.as_bytes().to_vec(),
            server_id: seq + 100,
            seq,
            body: String::new(),
        }
    }

    fn sent(id: &str, acks: &[(u64, u64)], received: bool) -> Sent {
        let acks: Vec<AckReply> = acks
            .iter()
            .map(|(server_id, seq)| AckReply {
                id: id.as_bytes().to_vec(),
                server_id: *server_id,
                seq: *seq,
                duplicate: false,
                outcome: "stored".into(),
            })
            .collect();
        Sent {
            sender: "ana".into(),
            id: id.as_bytes().to_vec(),
            conversation: "c".into(),
            trace: Trace {
                received: received.then(|| acks[0].clone()),
                server_acks: acks,
                ..Trace::default()
            },
        }
    }

    #[test]
    fn a_clean_run_passes_and_counts_gaps() {
        let histories =
            HashMap::from([("c".to_owned(), vec![row("ana", "a", 1), row("ana", "b", 3)])]);
        let result = audit(
            &[sent("a", &[(101, 1)], true), sent("b", &[(103, 3)], true)],
            &histories,
        );
        assert!(result.passed(), "{result:?}");
        assert_eq!(result.seq_gaps, 1);
    }

    #[test]
    fn lost_repeated_mismatched_and_misordered_are_all_caught() {
        let histories = HashMap::from([(
            "c".to_owned(),
            vec![row("ana", "a", 2), row("ana", "a", 1), row("ana", "b", 3)],
        )]);
        let result = audit(
            &[
                sent("a", &[(102, 2), (999, 9)], true),
                sent("b", &[(103, 3)], false),
                sent("x", &[(104, 4)], false),
            ],
            &histories,
        );
        assert_eq!(result.repeats, 1);
        assert_eq!(result.lost, 1, "x was ACKed but is not stored");
        assert_eq!(result.ack_mismatches, 1);
        assert_eq!(result.seq_order_violations, 1);
        assert_eq!(result.failed, 2);
        assert_eq!(result.failed_but_stored, 1);
        assert!(!result.passed());
    }

    #[test]
    fn a_row_that_appears_behind_a_followers_cursor_is_counted_as_missed() {
        let history = |rows: &[(&str, u64)]| {
            HashMap::from([(
                "c".to_owned(),
                rows.iter()
                    .map(|(id, seq)| row("ana", id, *seq))
                    .collect::<Vec<_>>(),
            )])
        };
        // Stored in the end: 41, 42. The follower got 42 first and moved its
        // cursor past 41, which was published later.
        let stored = history(&[("a", 41), ("b", 42)]);
        let mut audit = Audit::default();
        audit.add_followers(&stored, &history(&[("b", 42)]));
        assert_eq!(audit.missed_by_followers, 1);
        assert!(!audit.passed());

        let mut audit = Audit::default();
        audit.add_followers(&stored, &history(&[("b", 42), ("a", 41)]));
        assert_eq!(audit.delivered_out_of_order, 1);
        assert_eq!(audit.missed_by_followers, 0);

        let mut audit = Audit::default();
        audit.add_followers(&stored, &stored);
        assert!(audit.passed());
    }

    #[test]
    fn sends_stored_in_another_order_than_written_are_counted() {
        let histories =
            HashMap::from([("c".to_owned(), vec![row("ana", "a", 1), row("ana", "b", 2)])]);
        let mut a = sent("a", &[(101, 1)], true);
        let mut b = sent("b", &[(102, 2)], true);
        // Frame 1 (a) got seq 1, frame 2 (b) seq 2: in order.
        a.trace.stored_by_frame = Some((1, 1, 1));
        b.trace.stored_by_frame = Some((1, 2, 2));
        assert!(audit(&[a.clone(), b.clone()], &histories).passed());
        // Another connection has its own order.
        b.trace.stored_by_frame = Some((2, 1, 2));
        assert!(audit(&[a.clone(), b.clone()], &histories).passed());
        // b was written first but stored after a.
        b.trace.stored_by_frame = Some((1, 0, 2));
        let result = audit(&[a, b], &histories);
        assert_eq!(result.stored_out_of_send_order, 1);
        assert!(!result.passed());
    }
}
