//! Every CQL request the store sends, counted by what it costs the
//! database (`imdedup_store_requests_total{kind}`): a lightweight
//! transaction (Paxos among the replicas), a plain write, a read, or a read
//! at SERIAL consistency (a Paxos read). Divided by the messages stored,
//! these say what a new message and a repeat cost the database tier.

use crate::metrics::{DB_CASSANDRA, StoreMetrics};
use scylla::{
    client::session::Session, errors::ExecutionError, response::query_result::QueryResult,
    serialize::row::SerializeRow, statement::prepared::PreparedStatement,
};

/// What one request costs the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    Lwt,
    Write,
    Read,
    SerialRead,
}

impl RequestKind {
    pub const ALL: [Self; 4] = [Self::Lwt, Self::Write, Self::Read, Self::SerialRead];

    /// The metric's label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Lwt => "lwt",
            Self::Write => "write",
            Self::Read => "read",
            Self::SerialRead => "serial_read",
        }
    }
}

/// A prepared statement that counts each request it sends.
pub(super) struct Counted {
    prepared: PreparedStatement,
    kind: RequestKind,
    metrics: StoreMetrics,
}

impl Counted {
    pub(super) fn new(
        prepared: PreparedStatement,
        kind: RequestKind,
        metrics: &StoreMetrics,
    ) -> Self {
        Self {
            prepared,
            kind,
            metrics: metrics.clone(),
        }
    }

    /// Send it once with `values` (one page: every statement of ours reads
    /// at most one partition's bounded slice).
    pub(super) async fn execute(
        &self,
        session: &Session,
        values: impl SerializeRow,
    ) -> Result<QueryResult, ExecutionError> {
        self.metrics.requested(DB_CASSANDRA, self.kind.as_str());
        session.execute_unpaged(&self.prepared, values).await
    }
}
