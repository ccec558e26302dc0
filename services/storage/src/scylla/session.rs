//! Connecting to the cluster: contact points, credentials, TLS, and the
//! datacenter every LWT of this process goes to.

use std::{collections::BTreeSet, sync::Arc, time::Duration};

use imdedup_runtime::secret::Secret;

use imdedup_domain::Error;
use scylla::{
    client::{
        execution_profile::ExecutionProfile, session::Session, session_builder::SessionBuilder,
    },
    policies::{
        load_balancing::DefaultPolicy, speculative_execution::SimpleSpeculativeExecutionPolicy,
        timestamp_generator::MonotonicTimestampGenerator,
    },
    statement::SerialConsistency,
};

use super::{
    ScyllaOptions,
    rows::db_error,
    stalls::{AvoidStalled, STALL_AFTER_SHARE},
};

/// Connect to the cluster.
pub async fn connect(options: &ScyllaOptions) -> Result<Session, Error> {
    if options.nodes.is_empty() {
        return Err(Error::invalid("no ScyllaDB contact point"));
    }
    // Client-side timestamps, increasing within this process: a later write
    // of a cell (a heartbeat, then its relinquishing) never loses to an
    // earlier one because two coordinators' clocks differ.
    let mut builder = SessionBuilder::new()
        .connection_timeout(Duration::from_secs(5))
        .timestamp_generator(Arc::new(MonotonicTimestampGenerator::new()));
    for node in &options.nodes {
        builder = builder.known_node(node);
    }
    if let Some(user) = &options.user {
        let password = options.password.as_ref().map_or("", Secret::expose);
        builder = builder.user(user, password);
    }
    if let Some(ca) = &options.tls_ca {
        builder = builder.tls_context(Some(tls_config(ca)?));
    }
    // A replica that stops answering (a long GC pause, a frozen VM) keeps
    // its connections open, and the driver notices only after its
    // keepalives go unanswered for up to a minute. Meanwhile an idempotent
    // request (every write and read of ours, and the unique key's LWT, see
    // `Inner::insert`) that has had no answer for half its time is sent
    // once more, to the next replica in its plan.
    let mut profile = ExecutionProfile::builder().speculative_execution_policy(Some(Arc::new(
        SimpleSpeculativeExecutionPolicy {
            max_retry_count: 1,
            retry_interval: options.request_timeout / 2,
        },
    )));
    // Speculative execution rescues a request from a node that stopped
    // answering only after half its time; `AvoidStalled` sends the requests
    // after it to the other replicas first, until the node answers again.
    let mut policy = DefaultPolicy::builder().token_aware(true);
    if let Some(dc) = &options.local_dc {
        policy = policy
            .prefer_datacenter(dc.clone())
            .permit_dc_failover(false);
    }
    profile = profile.load_balancing_policy(Arc::new(AvoidStalled::new(
        policy.build(),
        options.request_timeout.mul_f64(STALL_AFTER_SHARE),
        options.request_timeout / 2,
        options.metrics.clone(),
    )));
    builder = builder.default_execution_profile_handle(profile.build().into_handle());
    let session = builder.build().await.map_err(|e| db_error("connect", e))?;
    let datacenters: BTreeSet<String> = session
        .get_cluster_state()
        .get_nodes_info()
        .iter()
        .filter_map(|node| node.datacenter.clone())
        .collect();
    check_datacenters(options, &datacenters)?;
    Ok(session)
}

/// LWTs under LOCAL_SERIAL are linearizable only within one datacenter: two
/// coordinators in two datacenters could both apply `IF NOT EXISTS` for one
/// key. So on several datacenters, LOCAL_SERIAL needs a local datacenter
/// with no failover (every LWT of this deployment in one datacenter), and
/// the local datacenter must exist.
fn check_datacenters(options: &ScyllaOptions, datacenters: &BTreeSet<String>) -> Result<(), Error> {
    let listed = || datacenters.iter().cloned().collect::<Vec<_>>().join(", ");
    match &options.local_dc {
        Some(dc) if !datacenters.contains(dc) => Err(Error::invalid(format!(
            "--scylla-local-dc {dc:?} is not a datacenter of this cluster ({})",
            listed()
        ))),
        None if datacenters.len() > 1
            && options.serial_consistency == SerialConsistency::LocalSerial =>
        {
            Err(Error::invalid(format!(
                "the cluster has several datacenters ({}): LOCAL_SERIAL lightweight \
                 transactions are linearizable within one datacenter only, so set \
                 --scylla-local-dc (every ingest of a deployment in the same one), or \
                 use --scylla-serial-consistency serial",
                listed()
            )))
        }
        _ => Ok(()),
    }
}

/// A TLS client configuration that trusts the CA certificates in `ca`.
fn tls_config(ca: &std::path::Path) -> Result<Arc<rustls::ClientConfig>, Error> {
    use rustls_pki_types::{CertificateDer, pem::PemObject};
    let bad = |e: &dyn std::fmt::Display| {
        Error::invalid(format!("ScyllaDB CA file {}: {e}", ca.display()))
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).map_err(|e| bad(&e))? {
        roots.add(cert.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
    }
    if roots.is_empty() {
        return Err(bad(&"no certificate in the file"));
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| bad(&e))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_serial_on_several_datacenters_needs_a_local_datacenter() {
        let dcs = |names: &[&str]| names.iter().map(|n| n.to_string()).collect();
        let mut options = ScyllaOptions::new(vec!["n:9042".into()]);
        assert!(check_datacenters(&options, &dcs(&["dc1"])).is_ok());
        let err = check_datacenters(&options, &dcs(&["dc1", "dc2"])).unwrap_err();
        assert!(err.message().contains("--scylla-local-dc"), "{err}");

        options.local_dc = Some("dc2".into());
        assert!(check_datacenters(&options, &dcs(&["dc1", "dc2"])).is_ok());
        let err = check_datacenters(&options, &dcs(&["dc1", "dc3"])).unwrap_err();
        assert!(err.message().contains("not a datacenter"), "{err}");

        options.local_dc = None;
        options.serial_consistency = SerialConsistency::Serial;
        assert!(check_datacenters(&options, &dcs(&["dc1", "dc2"])).is_ok());
    }
}
