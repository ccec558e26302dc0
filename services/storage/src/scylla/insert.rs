//! One new message, one Paxos round.
//!
//! The unique key lives in its conversation's partition of
//! `messages_by_conversation`, beside the history: a *key row* at a negative
//! `seq` (its slot, from a hash of sender and ID), holding the message's
//! receipt and fingerprint. One conditional batch on that partition writes
//! the key row `IF NOT EXISTS` and the history row at the message's seq:
//! both or neither, in one Paxos round. So:
//! - a new message costs one LWT and, for [`ScyllaStore::lookup`] and
//!   older versions of this store, one plain write of its `messages_by_key`
//!   row (the *global row*);
//! - a history row exists only with its key: no row is ever pending, and a
//!   repeat's seq was never written, so the next message takes it;
//! - readers never pass a seq that may still appear: the batch also moves
//!   the conversation's `last_seq` (a static cell of the partition) to its
//!   seq, `IF last_seq` is still the seq its writer saw last. Batches of a
//!   conversation apply in seq order, each after the one before, so once
//!   seq N is visible every earlier seq is visible or never will be. A
//!   batch whose answer was lost (a timeout) may still reach a server
//!   later, in a coordinator's queue or a paused node; by then a later
//!   batch has moved `last_seq` on, so its condition is false for good and
//!   it never applies behind a reader's cursor. It holds across writers
//!   too: a process that takes a conversation over leases seqs above every
//!   earlier block.
//! - what it costs: nothing per message; after an unknown outcome, a
//!   takeover or a restart the writer does not know `last_seq`, guesses,
//!   and when wrong its batch is refused with the value (one more round).
//!
//! Two keys may hash to one slot: a key row holds its sender and ID, and a
//! key that finds another's row tries the next slot. Key rows are never
//! deleted, so every try of one key meets its row at the same slot.
//!
//! What this changes: an ID is unique per sender *within a conversation*.
//! An ID reused for another conversation is answered `id_reused` while the
//! recent-ID window remembers it, and stored as a message of its own after.
//! On a keyspace upgraded from the layout with one key table for all
//! conversations, each insert also reads that table (a serial read, which
//! settles an LWT still in flight there) until `legacy_key_horizon` after
//! the upgrade, so resends of messages stored before it are recognised.
//!
//! [`ScyllaStore::lookup`]: super::ScyllaStore

#[cfg(feature = "testing")]
use std::sync::Arc;
#[cfg(feature = "testing")]
use std::time::Duration;

use imdedup_domain::{
    Error,
    model::{Fingerprint, MessageKey, NewMessage, Receipt, StoredMessage},
    routing::stable_hash,
    store::Insert,
};
use tracing::Instrument;

use super::{
    Block, Inner, columns,
    rows::{
        ExistingSlot, HistoryRow, KeyRow, SlotHolder, db_error, fingerprint_cell, lwt,
        maybe_stored, rows, to_i64,
    },
    unix_millis,
};
use crate::metrics::DB_CASSANDRA;

/// Most slots one key tries. Each is taken by another key with a chance
/// of about (conversation's messages) / 2^62.
const MAX_PROBES: u64 = 32;

/// The slot of `key`'s row on its `probe`-th try: a negative seq, below
/// every history row and so out of every reader's range. `hash` is the
/// key's [`slot_hash`].
pub(super) fn key_slot(hash: u64, probe: u64) -> i64 {
    -1 - to_i64((hash >> 2) + probe)
}

/// A stable hash of (sender, ID), the same in every version of the store.
pub(super) fn slot_hash(key: &MessageKey) -> u64 {
    stable_hash(&[
        b"imdedup key slot",
        key.sender.as_str().as_bytes(),
        key.client_msg_id.as_bytes(),
    ])
}

/// A conversation's `last_seq` as this process last saw it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum LastSeq {
    /// Not seen since this process took the conversation, or the last batch
    /// got no answer.
    #[default]
    Unknown,
    /// Its value (None: never set).
    Known(Option<u64>),
}

/// A conversation's seqs as this process hands them out.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Seqs {
    block: Block,
    last_seq: LastSeq,
}

/// Most times one insert learns that `last_seq` moved on since its writer
/// saw it: after a lost answer or a takeover, once; more only when batches
/// sent before keep landing.
const MAX_MOVES: u32 = 4;

/// What the conditional batch found.
enum Claim {
    /// The key row and the history row are written.
    Stored,
    /// The key is held by this message, stored before.
    Repeat(SlotHolder),
}

impl Inner {
    pub(super) async fn insert(&self, message: NewMessage) -> Result<Insert, Error> {
        let conversation = message.conversation.as_str().to_owned();
        // One insert at a time per conversation: seqs follow storage order.
        let locked = self.locks.lock(&conversation).await?;
        let (seq, last_seq) = self.take_seq(&conversation).await?;
        let fingerprint = message.fingerprint();
        let row = StoredMessage {
            receipt: Receipt {
                server_id: self.next_server_id().await?,
                seq,
            },
            key: message.key,
            conversation: message.conversation,
            body: message.body.into_string(),
            stored_at_ms: unix_millis(),
        };
        if let Some(original) = self.stored_before_the_upgrade(&row).await? {
            self.give_back(&conversation, seq);
            drop(locked);
            // Publishes its history row, if its writer left it pending.
            self.commit(&original).await?;
            return Ok(Insert::AlreadyStored(original));
        }
        let claim = self.claim(&row, fingerprint, last_seq).await;
        // What the batch left `last_seq` at, as far as this process knows.
        self.saw(
            &conversation,
            match &claim {
                Ok((Claim::Stored, _)) => LastSeq::Known(Some(seq)),
                Ok((Claim::Repeat(_), seen)) => LastSeq::Known(*seen),
                Err(_) => LastSeq::Unknown,
            },
        );
        let (claim, _) = claim?;
        self.options
            .metrics
            .inserted(DB_CASSANDRA, matches!(claim, Claim::Stored));
        match claim {
            Claim::Stored => {
                drop(locked);
                self.write_global(&row).await?;
                Ok(Insert::Stored(row))
            }
            Claim::Repeat(holder) => {
                // The seq was not written: the next message takes it.
                self.give_back(&conversation, seq);
                drop(locked);
                let original = self.original(&row, fingerprint, holder).await?;
                // The original's global row, in case its own write failed.
                if let Err(e) = self.write_global(&original).await {
                    tracing::warn!(error = %e, "could not write a repeat's global key row");
                }
                Ok(Insert::AlreadyStored(original))
            }
        }
    }

    /// The conditional batch, on the key's slots in turn until one is free
    /// or holds this key, and again with the conversation's `last_seq` as
    /// the database gives it when it moved on since `last_seq` (a guess when
    /// unknown). Also what `last_seq` is now, when the key was held.
    async fn claim(
        &self,
        row: &StoredMessage,
        fingerprint: Fingerprint,
        last_seq: LastSeq,
    ) -> Result<(Claim, Option<u64>), Error> {
        let seq = row.receipt.seq;
        let hash = self.slot_hash(&row.key);
        let mut expected = match last_seq {
            LastSeq::Known(value) => value,
            // The likeliest: the seq before this one, written; none before
            // a conversation's first.
            LastSeq::Unknown => seq.checked_sub(1).filter(|before| *before > 0),
        };
        let (mut probe, mut moves) = (0, 0);
        while probe < MAX_PROBES && moves <= MAX_MOVES {
            let key_row = (
                row.conversation.as_str(),
                key_slot(hash, probe),
                row.key.sender.as_str(),
                row.key.client_msg_id.as_bytes(),
                to_i64(row.receipt.server_id),
                to_i64(seq),
                fingerprint_cell(fingerprint),
                row.stored_at_ms,
            );
            let moved_on = (to_i64(seq), row.conversation.as_str(), expected.map(to_i64));
            #[cfg(feature = "testing")]
            if let Some(delay) = self.options.faults.late_batch() {
                let (a, b, c, d, e, f, g) = columns(row);
                self.send_late(
                    delay,
                    (
                        (
                            key_row.0.to_owned(),
                            key_row.1,
                            key_row.2.to_owned(),
                            key_row.3.to_vec(),
                            key_row.4,
                            key_row.5,
                            key_row.6,
                            key_row.7,
                        ),
                        (
                            a.to_owned(),
                            b.to_vec(),
                            c.to_owned(),
                            d.to_owned(),
                            e,
                            f,
                            g,
                        ),
                        (moved_on.0, moved_on.1.to_owned(), moved_on.2),
                    ),
                );
                return Err(maybe_stored("insert", "injected: the batch is late"));
            }
            let reply = self
                .statements
                .insert_message
                .execute(&self.session, (key_row, columns(row), moved_on))
                .instrument(tracing::info_span!(
                    "cassandra.lwt",
                    otel.name = "BATCH messages_by_conversation",
                    otel.kind = "client",
                    db.system = "cassandra",
                    db.operation = "BATCH",
                    db.name = %self.options.keyspace,
                    db.cassandra.table = "messages_by_conversation",
                ))
                .await
                // Unknown outcome: the seq stays spent. If the batch reaches
                // a server later, it applies only if nothing was written
                // after it.
                .map_err(|e| maybe_stored("insert", e))?;
            let (applied, existing) = lwt::<ExistingSlot>(reply)?;
            if applied {
                return Ok((Claim::Stored, Some(seq)));
            }
            let (now, holder) = existing.into_parts();
            let Some(holder) = holder else {
                // The slot is free: `last_seq` is not what this process saw.
                if now == expected {
                    return Err(Error::internal(format!(
                        "a batch of {} was refused with its conditions true",
                        row.conversation.as_str()
                    )));
                }
                if now.is_some_and(|now| now >= seq) {
                    // Written past this block: another process holds the
                    // conversation now.
                    self.seq_blocks.invalidate(row.conversation.as_str());
                    return Err(Error::unavailable(format!(
                        "conversation {} was written past seq {seq} by another writer; retry",
                        row.conversation.as_str()
                    )));
                }
                expected = now;
                moves += 1;
                continue;
            };
            let holder = holder?;
            if holder.key != row.key {
                // Another key's slot.
                expected = now;
                probe += 1;
                continue;
            }
            if holder.receipt == row.receipt {
                // This very batch, sent twice (the driver's speculative
                // execution): the copy answered second found the first's
                // rows. A server id is never handed out twice.
                return Ok((Claim::Stored, Some(seq)));
            }
            return Ok((Claim::Repeat(holder), now));
        }
        Err(Error::internal(format!(
            "no free key slot for a message of {} in {probe} tries, \
             or its last seq moved on {moves} times",
            row.conversation.as_str()
        )))
    }

    /// The message that holds the key: a resend has the original's
    /// fingerprint, and so its body; for an ID reused for other content the
    /// original's history row is read.
    async fn original(
        &self,
        row: &StoredMessage,
        fingerprint: Fingerprint,
        holder: SlotHolder,
    ) -> Result<StoredMessage, Error> {
        if holder.fingerprint == fingerprint {
            return Ok(StoredMessage {
                receipt: holder.receipt,
                stored_at_ms: holder.stored_at_ms,
                ..row.clone()
            });
        }
        let result = self
            .statements
            .history_row
            .execute(
                &self.session,
                (row.conversation.as_str(), to_i64(holder.receipt.seq)),
            )
            .await
            .map_err(|e| db_error("original", e))?;
        rows::<HistoryRow>(result)?
            .into_iter()
            .next()
            .map(HistoryRow::into_message)
            .transpose()?
            .ok_or_else(|| {
                Error::internal(format!(
                    "key row of {}/{} without its history row",
                    row.conversation.as_str(),
                    holder.receipt.seq
                ))
            })
    }

    /// `row`'s row in `messages_by_key`, for lookups and for versions of the
    /// store that kept the unique key there.
    async fn write_global(&self, row: &StoredMessage) -> Result<(), Error> {
        #[cfg(feature = "testing")]
        if self.options.faults.commit_fails() {
            return Err(maybe_stored("global key row", "injected fault"));
        }
        self.statements
            .insert_global
            .execute(&self.session, columns(row))
            .await
            // The message is stored and readable; the resend writes it again.
            .map_err(|e| maybe_stored("global key row", e))?;
        Ok(())
    }

    /// On a keyspace upgraded from one key table for all conversations,
    /// until the horizon: the message stored under this key before, found
    /// there.
    async fn stored_before_the_upgrade(
        &self,
        row: &StoredMessage,
    ) -> Result<Option<StoredMessage>, Error> {
        if unix_millis() >= self.legacy_keys_until_ms {
            return Ok(None);
        }
        // A serial read: an LWT of the old layout still in flight for this
        // key is finished first.
        let result = self
            .statements
            .select_key_serial
            .execute(
                &self.session,
                (row.key.sender.as_str(), row.key.client_msg_id.as_bytes()),
            )
            .await
            .map_err(|e| db_error("old key table", e))?;
        rows::<KeyRow>(result)?
            .into_iter()
            .next()
            .map(KeyRow::into_message)
            .transpose()
    }

    /// The next seq of `conversation`, leasing a block (as its owner) when
    /// needed, and its `last_seq` as this process last saw it. Reserved
    /// now: whatever happens next, it is never handed out twice.
    async fn take_seq(&self, conversation: &str) -> Result<(u64, LastSeq), Error> {
        // Writes start only while this process's membership holds.
        let epoch = self.member.writable()?;
        let mut seqs = self.seq_blocks.get(conversation).unwrap_or_default();
        if seqs.block.epoch != epoch || seqs.block.next >= seqs.block.end {
            seqs.block = self
                .lease_seqs(conversation, Some(seqs.block.end), epoch)
                .await?;
        }
        let seq = seqs.block.next;
        seqs.block.next += 1;
        self.seq_blocks.insert(conversation.to_owned(), seqs);
        Ok((seq, seqs.last_seq))
    }

    /// Hand `seq` out again: nothing was written at it.
    fn give_back(&self, conversation: &str, seq: u64) {
        if let Some(mut seqs) = self.seq_blocks.get(conversation)
            && seqs.block.next == seq + 1
        {
            seqs.block.next = seq;
            self.seq_blocks.insert(conversation.to_owned(), seqs);
        }
    }

    /// Remember `conversation`'s `last_seq` (while its block is cached).
    fn saw(&self, conversation: &str, last_seq: LastSeq) {
        if let Some(mut seqs) = self.seq_blocks.get(conversation) {
            seqs.last_seq = last_seq;
            self.seq_blocks.insert(conversation.to_owned(), seqs);
        }
    }

    /// The fault of a late batch: sent after `delay`, its answer ignored.
    #[cfg(feature = "testing")]
    fn send_late<V>(&self, delay: Duration, values: V)
    where
        V: scylla::serialize::batch::BatchValues + Send + Sync + 'static,
    {
        let (session, batch) = (
            Arc::clone(&self.session),
            self.statements.insert_message.clone(),
        );
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = batch.execute(&session, values).await;
        });
    }

    fn slot_hash(&self, key: &MessageKey) -> u64 {
        #[cfg(feature = "testing")]
        if self.options.faults.key_slots_collide() {
            return 0;
        }
        slot_hash(key)
    }
}

#[cfg(test)]
mod tests {
    use imdedup_domain::model::{ClientMsgId, Sender};

    use super::*;

    fn key(sender: &str, id: &str) -> MessageKey {
        MessageKey {
            sender: Sender::parse(sender).unwrap(),
            client_msg_id: ClientMsgId::parse(id.as_bytes().to_vec()).unwrap(),
        }
    }

    #[test]
    fn key_slots_are_negative_and_apart_for_keys_that_print_alike() {
        let a = slot_hash(&key("a:b", "c"));
        let b = slot_hash(&key("a", "b:c"));
        assert_ne!(a, b);
        for hash in [0, a, b, u64::MAX] {
            for probe in [0, 1, MAX_PROBES] {
                assert!(key_slot(hash, probe) < 0, "{hash} {probe}");
            }
            assert_ne!(key_slot(hash, 0), key_slot(hash, 1));
        }
    }

    #[test]
    fn a_keys_slot_is_the_same_in_every_version() {
        // Stored rows are found again by this value: it must never change.
        assert_eq!(
            key_slot(slot_hash(&key("ana", "m-1")), 0),
            -4_531_889_530_825_687_476
        );
    }
}
