//! The store's settings and the names of consistency levels.

use std::time::Duration;

use imdedup_runtime::secret::Secret;

use crate::metrics::StoreMetrics;

use imdedup_domain::Error;
use scylla::statement::{Consistency, SerialConsistency};

/// Settings of the ScyllaDB store.
#[derive(Debug, Clone)]
pub struct ScyllaOptions {
    /// Contact points, `host:port`.
    pub nodes: Vec<String>,
    pub keyspace: String,
    /// Replication factor for the keyspace the migration creates.
    pub replication_factor: u32,
    pub consistency: Consistency,
    pub serial_consistency: SerialConsistency,
    pub user: Option<String>,
    pub password: Option<Secret>,
    pub request_timeout: Duration,
    /// Seqs leased per conversation at a time.
    pub seq_block: u64,
    /// Server ids leased at a time.
    pub id_block: u64,
    /// Connect with TLS, trusting the CA in this PEM file.
    pub tls_ca: Option<std::path::PathBuf>,
    /// Most inserts queued behind the one running for a conversation; more
    /// are refused with `overloaded`.
    pub max_waiting_per_conversation: usize,
    /// The datacenter this process talks to: requests (and so every LWT's
    /// Paxos round) go to its nodes only, never failing over to another.
    /// Required on a cluster of several datacenters when the serial
    /// consistency is LOCAL_SERIAL, which is linearizable within one
    /// datacenter only.
    pub local_dc: Option<String>,
    /// Where inserts, leases, errors and durations are counted.
    pub metrics: StoreMetrics,
    /// Create or update the schema when opening the store. Off where a
    /// separate step migrates (`imdedup migrate`, the Helm hook), so pods
    /// never race on schema changes.
    pub migrate: bool,
    /// The name this process registers under (an ingest's shard name); a
    /// random suffix makes each process's instance unique.
    pub member_name: String,
    /// How long one heartbeat keeps this process's membership: the
    /// conversations it leased stay its own while it renews. Past it (a
    /// crash, a partition), another process may take them over.
    pub member_ttl: Duration,
    /// Most difference between two processes' clocks this store allows for.
    pub clock_skew: Duration,
    /// Age past which a reader settles a pending history row itself (its
    /// writer crashed, or its commit failed and the phone never resent).
    /// Until then, readers stop at it.
    pub pending_fence: Duration,
    /// Faults to inject, for tests and the fault scenarios.
    #[cfg(feature = "testing")]
    pub faults: super::faults::Faults,
}

impl ScyllaOptions {
    /// Production defaults: LOCAL_QUORUM and LOCAL_SERIAL, RF 3.
    pub fn new(nodes: Vec<String>) -> Self {
        Self {
            nodes,
            keyspace: "imdedup".to_owned(),
            replication_factor: 3,
            consistency: Consistency::LocalQuorum,
            serial_consistency: SerialConsistency::LocalSerial,
            user: None,
            password: None,
            request_timeout: Duration::from_secs(2),
            seq_block: 100,
            id_block: 10_000,
            tls_ca: None,
            max_waiting_per_conversation: 512,
            local_dc: None,
            metrics: StoreMetrics::default(),
            migrate: true,
            member_name: "imdedup".to_owned(),
            member_ttl: Duration::from_secs(10),
            clock_skew: Duration::from_secs(2),
            pending_fence: Duration::from_secs(30),
            #[cfg(feature = "testing")]
            faults: super::faults::Faults::default(),
        }
    }

    /// How long after another process's last heartbeat ran out its
    /// conversations may be taken: its last writes have landed or failed.
    pub fn handover_grace(&self) -> Duration {
        self.request_timeout + self.clock_skew
    }

    /// Refuse timings under which a fence would not hold.
    pub fn check(&self) -> Result<(), Error> {
        if self.member_ttl < self.request_timeout * 2 {
            return Err(Error::invalid(format!(
                "the membership TTL ({:?}) must be at least twice the request timeout ({:?})",
                self.member_ttl, self.request_timeout
            )));
        }
        let least = self.request_timeout * 2 + self.clock_skew + LWT_SERVER_MARGIN;
        if self.pending_fence < least {
            return Err(Error::invalid(format!(
                "the pending fence ({:?}) must be at least {least:?}: twice the request \
                 timeout, the clock skew and {LWT_SERVER_MARGIN:?} for the servers' own timeouts",
                self.pending_fence
            )));
        }
        Ok(())
    }

    /// Settings for a single local node: RF 1. LOCAL_QUORUM of one is one.
    pub fn single_node(nodes: Vec<String>) -> Self {
        Self {
            replication_factor: 1,
            ..Self::new(nodes)
        }
    }
}

/// How long a server may keep working on an LWT after its client gave up
/// (ScyllaDB's and Cassandra's CAS contention and write timeouts, 1 s and 2 s
/// by default).
pub const LWT_SERVER_MARGIN: Duration = Duration::from_secs(5);

/// Parse a consistency level name (`local_quorum`, `quorum`, `one`, …).
pub fn parse_consistency(raw: &str) -> Result<Consistency, Error> {
    Ok(match raw.to_ascii_lowercase().as_str() {
        "one" => Consistency::One,
        "two" => Consistency::Two,
        "three" => Consistency::Three,
        "quorum" => Consistency::Quorum,
        "all" => Consistency::All,
        "local_quorum" => Consistency::LocalQuorum,
        "each_quorum" => Consistency::EachQuorum,
        "local_one" => Consistency::LocalOne,
        other => {
            return Err(Error::invalid(format!(
                "unknown consistency level {other:?}"
            )));
        }
    })
}

/// Parse a serial consistency level name (`local_serial` or `serial`).
pub fn parse_serial_consistency(raw: &str) -> Result<SerialConsistency, Error> {
    match raw.to_ascii_lowercase().as_str() {
        "serial" => Ok(SerialConsistency::Serial),
        "local_serial" => Ok(SerialConsistency::LocalSerial),
        other => Err(Error::invalid(format!(
            "unknown serial consistency {other:?}"
        ))),
    }
}

pub(super) fn check_keyspace_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "keyspace name {name:?} must be 1 to 48 letters, digits or underscores"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consistency_names_parse() {
        assert_eq!(
            parse_consistency("LOCAL_QUORUM").unwrap(),
            Consistency::LocalQuorum
        );
        assert_eq!(
            parse_serial_consistency("serial").unwrap(),
            SerialConsistency::Serial
        );
        assert!(parse_consistency("most").is_err());
    }

    #[test]
    fn keyspace_names_are_plain_identifiers() {
        assert!(check_keyspace_name("imdedup_test").is_ok());
        assert!(check_keyspace_name("x; DROP").is_err());
        assert!(check_keyspace_name("").is_err());
    }
}
