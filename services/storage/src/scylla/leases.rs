//! Numbers handed out without a serial read: blocks of seqs per
//! conversation and of server ids, leased with LWTs on the `leases` table.
//!
//! A conversation's lease row also names its owner, the instance (see
//! [`super::members`]) that writes its seqs. Leasing takes the row over
//! only from ourselves, from no one, or from an instance that is gone; an
//! instance still alive keeps it, and the send is refused with a retryable
//! error until that instance leaves. So during a change of the shard map,
//! two ingests never write one conversation, and a new owner's seqs start
//! past everything the old owner leased.

use super::{
    Block, Inner,
    rows::{Column, LwtColumns, db_error, lwt, to_i64, value},
};
use crate::metrics::DB_CASSANDRA;
use imdedup_domain::Error;

/// What a lease LWT that did not apply says of the row: its `next_free` and
/// `owner`, when it exists (Cassandra sends the condition's columns,
/// ScyllaDB every column).
#[derive(Debug, Default)]
struct LeaseRow {
    next_free: Option<i64>,
    owner: Option<String>,
}

impl LwtColumns for LeaseRow {
    fn take(&mut self, column: Column<'_, '_>) -> Result<(), Error> {
        match column.spec.name() {
            "next_free" => self.next_free = value(column)?,
            "owner" => self.owner = value(column)?,
            _ => {}
        }
        Ok(())
    }
}

impl Inner {
    /// Lease the next block of `conversation`'s seqs as its owner.
    pub(super) async fn lease_seqs(
        &self,
        conversation: &str,
        hint: Option<u64>,
        epoch: u64,
    ) -> Result<Block, Error> {
        let me = self.member.instance();
        let size = self.options.seq_block;
        // (next_free, owner) as last seen; the owner is us when we hold a
        // block already.
        let mut known: Option<(u64, Option<String>)> =
            hint.filter(|h| *h > 0).map(|h| (h, Some(me.to_owned())));
        for _ in 0..64 {
            let (start, reply) = match &known {
                None => (
                    1,
                    self.statements
                        .lease_seq_init
                        .execute(&self.session, ("seq", conversation, to_i64(1 + size), me))
                        .await,
                ),
                Some((start, owner)) => {
                    if let Some(owner) = owner.as_deref().filter(|o| *o != me)
                        && self.member.is_alive(owner).await?
                    {
                        self.options
                            .metrics
                            .leased(DB_CASSANDRA, "conversation", true);
                        return Err(Error::unavailable(format!(
                            "conversation {conversation} is still written by {owner}; retry"
                        )));
                    }
                    (
                        *start,
                        self.statements
                            .lease_seq_take
                            .execute(
                                &self.session,
                                (
                                    to_i64(start + size),
                                    me,
                                    "seq",
                                    conversation,
                                    to_i64(*start),
                                    owner.as_deref(),
                                ),
                            )
                            .await,
                    )
                }
            };
            let (applied, current) = lwt::<LeaseRow>(reply.map_err(|e| db_error("lease", e))?)?;
            self.options
                .metrics
                .leased(DB_CASSANDRA, "conversation", !applied);
            if applied {
                if known
                    .as_ref()
                    .is_some_and(|(_, owner)| owner.as_deref() != Some(me))
                {
                    tracing::info!(conversation, start, "took a conversation over");
                }
                return Ok(Block {
                    next: start,
                    end: start + size,
                    epoch,
                });
            }
            // None: the row does not exist yet (an UPDATE … IF on no row).
            known = current
                .next_free
                .map(|v| (u64::try_from(v).unwrap_or_default(), current.owner));
        }
        Err(Error::unavailable(format!(
            "could not lease seqs of {conversation}: too much contention"
        )))
    }

    /// Lease the next `size` numbers of (scope, name): an LWT on the lease
    /// row, retried when another process leased first. No owner: for
    /// numbers every process draws from (server ids).
    pub(super) async fn lease(
        &self,
        scope: &str,
        name: &str,
        size: u64,
        hint: Option<u64>,
    ) -> Result<Block, Error> {
        // No read first: an LWT that is not applied returns the current
        // value, which the next try starts from. `hint` is where our last
        // block ended, usually where the next one starts.
        let mut known = hint.filter(|h| *h > 0);
        for _ in 0..64 {
            let (start, reply) = match known {
                None => (
                    1,
                    self.statements
                        .lease_init
                        .execute(&self.session, (scope, name, to_i64(1 + size)))
                        .await,
                ),
                Some(start) => (
                    start,
                    self.statements
                        .lease_cas
                        .execute(
                            &self.session,
                            (to_i64(start + size), scope, name, to_i64(start)),
                        )
                        .await,
                ),
            };
            let (applied, current) = lwt::<LeaseRow>(reply.map_err(|e| db_error("lease", e))?)?;
            self.options
                .metrics
                .leased(DB_CASSANDRA, "server_id", !applied);
            if applied {
                tracing::debug!(scope, name, start, size, "leased a block");
                return Ok(Block {
                    next: start,
                    end: start + size,
                    epoch: 0,
                });
            }
            // None: the row does not exist yet (an UPDATE … IF on no row).
            known = current
                .next_free
                .map(|v| u64::try_from(v).unwrap_or_default());
        }
        Err(Error::unavailable(format!(
            "could not lease {scope} numbers: too much contention"
        )))
    }

    pub(super) async fn next_server_id(&self) -> Result<u64, Error> {
        let mut block = self.server_ids.lock().await;
        if block.next >= block.end {
            let hint = Some(block.end);
            *block = self
                .lease("server_id", "", self.options.id_block, hint)
                .await?;
        }
        let id = block.next;
        block.next += 1;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use scylla::frame::response::result::NativeType;

    use super::{
        super::rows::tests::{applied, big, reply, text},
        LeaseRow,
    };

    #[test]
    fn a_lease_that_did_not_apply_says_where_the_row_stands_on_either_database() {
        // Cassandra answers a failed `UPDATE … IF next_free = ? AND owner = ?`
        // with the condition's columns.
        let (ok, row) = reply::<LeaseRow>(&[
            applied(false),
            ("next_free", NativeType::BigInt, big(300)),
            ("owner", NativeType::Text, text("ingest-1")),
        ])
        .unwrap();
        assert!(!ok);
        assert_eq!(row.next_free, Some(300));
        assert_eq!(row.owner.as_deref(), Some("ingest-1"));
        // ScyllaDB with every column; a row without an owner yet.
        let (ok, row) = reply::<LeaseRow>(&[
            applied(false),
            ("scope", NativeType::Text, text("seq")),
            ("name", NativeType::Text, text("dm:ana:ben")),
            ("next_free", NativeType::BigInt, big(100)),
            ("owner", NativeType::Text, None),
        ])
        .unwrap();
        assert!(!ok);
        assert_eq!((row.next_free, row.owner), (Some(100), None));
        // An UPDATE … IF on no row: nothing known.
        let (ok, row) =
            reply::<LeaseRow>(&[applied(false), ("next_free", NativeType::BigInt, None)]).unwrap();
        assert!(!ok);
        assert_eq!(row.next_free, None);
    }
}
