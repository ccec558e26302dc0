//! Ordered publication: a reader following a conversation with a cursor
//! never passes a seq that may still appear.
//!
//! An insert writes its history row *pending* before the unique-key LWT,
//! and commits it after. Readers return rows up to the first pending one
//! and stop there, so a seq whose LWT may have applied is never skipped:
//! - the LWT applied and the commit failed (or the process died): the row
//!   stays pending; the phone's resend finds the key and commits it;
//! - the LWT was not applied (a repeat): the writer marks the row
//!   abandoned, and readers skip it;
//! - nobody settled it: once the row is older than the pending fence (every
//!   LWT for it has ended by then), a reader reads the key with a serial
//!   read and commits or abandons the row itself.
//!
//! The three states are three cells (`pending`, `committed`, `abandoned`).
//! Writers in different processes only ever write them `true`, so they
//! never overwrite each other whatever their clocks. One exception, within
//! one process: a repeat's seq, once abandoned, is taken by the next
//! message, whose pending write sets `abandoned` back to false; the
//! session's client-side timestamps, increasing in the process, order the
//! two writes. Rows from before these columns have none of them and are
//! visible.

use std::time::Instant;

use imdedup_domain::{
    Error,
    model::{HistoryQuery, StoredMessage},
};

use super::{
    Inner, columns, millis,
    rows::{HistoryRow, KeyRow, db_error, maybe_stored, rows, to_i64},
    unix_millis,
};

/// Where a history row stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Publication {
    Visible,
    Pending,
    Abandoned,
}

/// A history row's state from its three cells (`pending`, `committed`,
/// `abandoned`), each set or not (null or false).
fn publication([pending, committed, abandoned]: [bool; 3]) -> Publication {
    if abandoned {
        Publication::Abandoned
    } else if committed || !pending {
        Publication::Visible
    } else {
        Publication::Pending
    }
}

impl Inner {
    /// Write `row` pending, before its LWT. A failure means nothing is
    /// stored: the LWT is never sent.
    pub(super) async fn write_pending(&self, row: &StoredMessage) -> Result<(), Error> {
        self.statements
            .insert_pending
            .execute(&self.session, columns(row))
            .await
            .map_err(|e| db_error("pending history write", e))?;
        Ok(())
    }

    /// Publish `row`: its key is stored. Also writes the whole row, so it
    /// repairs a history row that was never written.
    pub(super) async fn commit(&self, row: &StoredMessage) -> Result<(), Error> {
        #[cfg(feature = "testing")]
        if self.options.faults.commit_fails() {
            return Err(maybe_stored("history commit", "injected fault"));
        }
        self.statements
            .commit_history
            .execute(&self.session, columns(row))
            .await
            // The key is stored; the history row stays pending until the
            // resend (or a reader, after the fence) commits it.
            .map_err(|e| maybe_stored("history commit", e))?;
        Ok(())
    }

    /// Mark `row`'s seq as never used: its key was not stored with it.
    pub(super) async fn abandon(&self, row: &StoredMessage) -> Result<(), Error> {
        self.statements
            .abandon_history
            .execute(
                &self.session,
                (row.conversation.as_str(), to_i64(row.receipt.seq)),
            )
            .await
            .map_err(|e| db_error("abandon history row", e))?;
        Ok(())
    }

    /// Rows after the cursor, in seq order, up to the first row that may
    /// still change.
    pub(super) async fn published(
        &self,
        query: &HistoryQuery,
    ) -> Result<Vec<StoredMessage>, Error> {
        let limit = i32::try_from(query.limit).unwrap_or(i32::MAX);
        let result = self
            .statements
            .history
            .execute(
                &self.session,
                (query.conversation.as_str(), to_i64(query.after_seq), limit),
            )
            .await
            .map_err(|e| db_error("history", e))?;
        let mut out = Vec::new();
        for row in rows::<HistoryRow>(result)? {
            let set = |cell: Option<bool>| cell == Some(true);
            match publication([set(row.pending), set(row.committed), set(row.abandoned)]) {
                Publication::Abandoned => {}
                Publication::Visible => out.push(row.into_message()?),
                Publication::Pending => {
                    let message = row.into_message()?;
                    if unix_millis() - message.stored_at_ms < millis(self.options.pending_fence) {
                        // Its writer may still be at it: stop before it.
                        break;
                    }
                    if self.settle(&message).await? {
                        out.push(message);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Settle a pending row whose writer is long done: commit it if its key
    /// holds it, abandon it otherwise. True when committed.
    async fn settle(&self, pending: &StoredMessage) -> Result<bool, Error> {
        let started = Instant::now();
        let result = self.settle_uncounted(pending).await;
        self.record("settle", started, &result);
        result
    }

    async fn settle_uncounted(&self, pending: &StoredMessage) -> Result<bool, Error> {
        // A serial read: an LWT accepted but not yet committed is finished
        // first, so "absent" here is final (the fence has passed, no new
        // LWT for this row can start).
        let result = self
            .statements
            .select_key_serial
            .execute(
                &self.session,
                (
                    pending.key.sender.as_str(),
                    pending.key.client_msg_id.as_bytes(),
                ),
            )
            .await
            .map_err(|e| db_error("serial lookup", e))?;
        let stored = rows::<KeyRow>(result)?
            .into_iter()
            .next()
            .map(KeyRow::into_message)
            .transpose()?;
        let holds = stored.is_some_and(|s| {
            s.receipt == pending.receipt && s.conversation == pending.conversation
        });
        if holds {
            // The reader's pull fails, retryably; for a reader the row is
            // not a send of its own that "may be stored".
            self.commit(pending)
                .await
                .map_err(|e| Error::unavailable(e.message().to_owned()))?;
        } else {
            self.abandon(pending).await?;
        }
        tracing::info!(
            conversation = %pending.conversation.as_str(),
            seq = pending.receipt.seq,
            committed = holds,
            "settled a pending history row"
        );
        Ok(holds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cells of a row, by the names of those set to true.
    fn row(cells: &[(&str, bool)]) -> [bool; 3] {
        ["pending", "committed", "abandoned"]
            .map(|name| cells.iter().any(|&(cell, set)| cell == name && set))
    }

    #[test]
    fn a_row_is_pending_until_committed_or_abandoned() {
        assert_eq!(publication(row(&[("pending", true)])), Publication::Pending);
        assert_eq!(
            publication(row(&[("pending", true), ("committed", true)])),
            Publication::Visible
        );
        assert_eq!(
            publication(row(&[("pending", true), ("abandoned", true)])),
            Publication::Abandoned
        );
        // An abandon that reached a row whose pending write never landed.
        assert_eq!(
            publication(row(&[("abandoned", true)])),
            Publication::Abandoned
        );
        // Rows from before publication states existed.
        assert_eq!(publication(row(&[])), Publication::Visible);
    }
}
