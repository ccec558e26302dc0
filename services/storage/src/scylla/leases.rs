//! Numbers handed out without a serial read: blocks of seqs per
//! conversation and of server ids, leased with LWTs on the `leases` table.

use imdedup_core::{Error, metrics::DB_CASSANDRA};
use scylla::value::CqlValue;

use super::{
    Block, Inner,
    rows::{db_error, lwt, to_i64},
};

impl Inner {
    /// Lease the next `size` numbers of (scope, name): an LWT on the lease
    /// row, retried when another process leased first.
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
                    self.session
                        .execute_unpaged(
                            &self.statements.lease_init,
                            (scope, name, to_i64(1 + size)),
                        )
                        .await,
                ),
                Some(start) => (
                    start,
                    self.session
                        .execute_unpaged(
                            &self.statements.lease_cas,
                            (to_i64(start + size), scope, name, to_i64(start)),
                        )
                        .await,
                ),
            };
            let (applied, current) = lwt(reply.map_err(|e| db_error("lease", e))?)?;
            let kind = if scope == "seq" {
                "conversation"
            } else {
                "server_id"
            };
            self.options.metrics.leased(DB_CASSANDRA, kind, !applied);
            if applied {
                tracing::debug!(scope, name, start, size, "leased a block");
                return Ok(Block {
                    next: start,
                    end: start + size,
                });
            }
            known = match current.get("next_free") {
                Some(Some(CqlValue::BigInt(v))) => Some(u64::try_from(*v).unwrap_or_default()),
                // The row does not exist yet (an UPDATE … IF on no row).
                _ => None,
            };
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
