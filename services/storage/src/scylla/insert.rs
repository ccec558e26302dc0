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
//! - readers never pass a seq that may still appear: one owner writes a
//!   conversation, one insert at a time, and a Paxos round on a partition
//!   first finishes the round left in progress there, if a quorum accepted
//!   it, or supersedes it for good; once seq N+1 is visible, N is visible
//!   or never will be;
//! - an insert whose outcome is unknown (a timeout) keeps its seq, and its
//!   conversation takes no other write for the doubt window (the request
//!   timeout and the servers' own margin): a batch that has not reached a
//!   server yet could otherwise apply after a later message and behind a
//!   reader's cursor. After the window, the next round finishes it, if a
//!   quorum accepted it, or supersedes it for good; the resend finds the
//!   key or stores the message. Another process takes a conversation over
//!   only after the same window (the handover grace), and a process that
//!   stops lets its conversations go only once its windows have passed.
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
use std::{
    sync::PoisonError,
    time::{Duration, Instant},
};

use imdedup_domain::{
    Error,
    model::{Fingerprint, MessageKey, NewMessage, Receipt, StoredMessage},
    routing::stable_hash,
    store::Insert,
};
use tracing::Instrument;

use super::{
    Inner, columns,
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
        if let Some(left) = self.in_doubt_for(&conversation) {
            return Err(Error::unavailable(format!(
                "the last write of this conversation is in doubt for {} ms more; retry",
                left.as_millis()
            ))
            .with_retry_after(left));
        }
        let seq = self.take_seq(&conversation).await?;
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
        let claim = self.claim(&row, fingerprint).await?;
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
    /// or holds this key.
    async fn claim(&self, row: &StoredMessage, fingerprint: Fingerprint) -> Result<Claim, Error> {
        let hash = self.slot_hash(&row.key);
        for probe in 0..MAX_PROBES {
            let key_row = (
                row.conversation.as_str(),
                key_slot(hash, probe),
                row.key.sender.as_str(),
                row.key.client_msg_id.as_bytes(),
                to_i64(row.receipt.server_id),
                to_i64(row.receipt.seq),
                fingerprint_cell(fingerprint),
                row.stored_at_ms,
            );
            let sent = Instant::now();
            #[cfg(feature = "testing")]
            if let Some(delay) = self.options.faults.late_batch() {
                let owned_key = (
                    key_row.0.to_owned(),
                    key_row.1,
                    key_row.2.to_owned(),
                    key_row.3.to_vec(),
                    key_row.4,
                    key_row.5,
                    key_row.6,
                    key_row.7,
                );
                let (a, b, c, d, e, f, g) = columns(row);
                let owned_row = (
                    a.to_owned(),
                    b.to_vec(),
                    c.to_owned(),
                    d.to_owned(),
                    e,
                    f,
                    g,
                );
                self.send_late(delay, (owned_key, owned_row));
                self.doubt(row.conversation.as_str(), sent);
                return Err(maybe_stored("insert", "injected: the batch is late"));
            }
            let reply = self
                .statements
                .insert_message
                .execute(&self.session, (key_row, columns(row)))
                .instrument(tracing::info_span!(
                    "cassandra.lwt",
                    otel.name = "BATCH messages_by_conversation",
                    otel.kind = "client",
                    db.system = "cassandra",
                    db.operation = "BATCH",
                    db.name = %self.options.keyspace,
                    db.cassandra.table = "messages_by_conversation",
                ))
                .await;
            // Unknown outcome: the seq stays spent, and the conversation
            // waits out the doubt window.
            let reply = match reply {
                Ok(reply) => reply,
                Err(e) => {
                    self.doubt(row.conversation.as_str(), sent);
                    return Err(maybe_stored("insert", e));
                }
            };
            let (applied, existing) = lwt::<ExistingSlot>(reply)?;
            if applied {
                return Ok(Claim::Stored);
            }
            let holder = existing.into_holder()?;
            if holder.key != row.key {
                // Another key's slot.
                continue;
            }
            if holder.receipt == row.receipt {
                // This very batch, sent twice (the driver's speculative
                // execution): the copy answered second found the first's
                // rows. A server id is never handed out twice.
                return Ok(Claim::Stored);
            }
            return Ok(Claim::Repeat(holder));
        }
        Err(Error::internal(format!(
            "no free key slot for a message of {} in {MAX_PROBES} tries",
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
    /// needed. Reserved now: whatever happens next, it is never handed out
    /// twice.
    async fn take_seq(&self, conversation: &str) -> Result<u64, Error> {
        // Writes start only while this process's membership holds.
        let epoch = self.member.writable()?;
        let cached = self.seq_blocks.get(conversation).unwrap_or_default();
        let mut seqs = cached;
        if seqs.epoch != epoch || seqs.next >= seqs.end {
            seqs = self
                .lease_seqs(conversation, Some(cached.end), epoch)
                .await?;
        }
        let seq = seqs.next;
        seqs.next += 1;
        self.seq_blocks.insert(conversation.to_owned(), seqs);
        Ok(seq)
    }

    /// Hand `seq` out again: nothing was written at it.
    fn give_back(&self, conversation: &str, seq: u64) {
        if let Some(mut block) = self.seq_blocks.get(conversation)
            && block.next == seq + 1
        {
            block.next = seq;
            self.seq_blocks.insert(conversation.to_owned(), block);
        }
    }

    /// A batch of `conversation` sent at `sent` got no answer: no other
    /// write of it until the doubt window has passed.
    fn doubt(&self, conversation: &str, sent: Instant) {
        let until = sent + self.options.doubt_window();
        let mut doubts = self.doubts.lock().unwrap_or_else(PoisonError::into_inner);
        if doubts.len() >= 1024 {
            let now = Instant::now();
            doubts.retain(|_, until| *until > now);
        }
        doubts.insert(conversation.to_owned(), until);
    }

    /// How long `conversation` is still in doubt, if it is.
    fn in_doubt_for(&self, conversation: &str) -> Option<Duration> {
        let mut doubts = self.doubts.lock().unwrap_or_else(PoisonError::into_inner);
        let left = doubts
            .get(conversation)?
            .checked_duration_since(Instant::now());
        if left.is_none() {
            doubts.remove(conversation);
        }
        left
    }

    /// When the last doubt window of this process ends (now if none is
    /// open): its conversations may go to another process after that.
    pub(super) fn doubts_end(&self) -> Instant {
        let doubts = self.doubts.lock().unwrap_or_else(PoisonError::into_inner);
        doubts.values().copied().max().unwrap_or_else(Instant::now)
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
