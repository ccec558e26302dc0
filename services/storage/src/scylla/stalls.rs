//! Routing around a replica that has stopped answering.
//!
//! A node that stops answering (a long GC pause, a frozen VM) keeps its
//! connections open, so the driver goes on choosing it as the coordinator
//! of about one request in three on three replicas, and each of those waits
//! for the speculative second try (half the request timeout). An insert
//! makes three requests, so most inserts are slowed, and the ingest's
//! database limit takes one stalled replica for a stalled database.
//!
//! [`AvoidStalled`] wraps the driver's policy: a node that was asked and has
//! answered nothing for [`STALL_AFTER_SHARE`] of the request timeout is
//! *stalled*, and requests go first to the other replicas of their plan.
//! Once per probe interval one request still goes to it, so it is used
//! again as soon as it answers. When every node of a plan is stalled (a stalled
//! database, not a replica), the plan is left as the driver made it.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use crate::metrics::{DB_CASSANDRA, StoreMetrics};
use scylla::{
    cluster::{ClusterState, NodeRef},
    errors::RequestAttemptError,
    policies::load_balancing::{FallbackPlan, LoadBalancingPolicy, RoutingInfo},
    routing::Shard,
};
use uuid::Uuid;

/// The share of the request timeout a node may leave a request unanswered,
/// answering nothing else meanwhile, before it counts as stalled.
pub const STALL_AFTER_SHARE: f64 = 0.25;

/// What this process knows of one node's answers.
#[derive(Debug, Default, Clone)]
struct Health {
    /// The first time the node was asked since it last answered.
    asked_since: Option<Instant>,
    /// When a request last went to it while it was stalled.
    last_probe: Option<Instant>,
    /// Whether its stall has been logged.
    reported: bool,
}

impl Health {
    fn asked(&mut self, now: Instant) {
        self.asked_since.get_or_insert(now);
    }

    /// True when the node was stalled (worth a log line).
    fn answered(&mut self) -> bool {
        self.asked_since = None;
        self.last_probe = None;
        std::mem::take(&mut self.reported)
    }

    fn stalled(&self, now: Instant, after: Duration) -> bool {
        self.asked_since
            .is_some_and(|since| now.saturating_duration_since(since) > after)
    }

    /// Whether a request may go to the stalled node as a probe now.
    fn probe(&mut self, now: Instant, every: Duration) -> bool {
        let due = self
            .last_probe
            .is_none_or(|last| now.saturating_duration_since(last) >= every);
        if due {
            self.last_probe = Some(now);
        }
        due
    }
}

/// The driver's policy, with stalled nodes moved to the end of each plan.
#[derive(Debug)]
pub struct AvoidStalled {
    inner: Arc<dyn LoadBalancingPolicy>,
    nodes: Mutex<HashMap<Uuid, Health>>,
    stall_after: Duration,
    probe_every: Duration,
    metrics: StoreMetrics,
}

impl AvoidStalled {
    /// Wrap `inner`; a node is stalled after `stall_after` without an
    /// answer, and probed once per `probe_every` while it is.
    pub fn new(
        inner: Arc<dyn LoadBalancingPolicy>,
        stall_after: Duration,
        probe_every: Duration,
        metrics: StoreMetrics,
    ) -> Self {
        Self {
            inner,
            nodes: Mutex::new(HashMap::new()),
            stall_after,
            probe_every,
            metrics,
        }
    }

    fn nodes(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Health>> {
        self.nodes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `node` is stalled now, by what `nodes` knows of it.
    fn is_stalled(&self, nodes: &HashMap<Uuid, Health>, node: NodeRef<'_>, now: Instant) -> bool {
        nodes
            .get(&node.host_id)
            .is_some_and(|h| h.stalled(now, self.stall_after))
    }

    fn answered(&self, node: NodeRef<'_>) {
        let was_stalled = self.nodes().entry(node.host_id).or_default().answered();
        if was_stalled {
            self.metrics.node_answering(DB_CASSANDRA);
            tracing::info!(node = %node.address, "database node answering again");
        }
    }
}

impl LoadBalancingPolicy for AvoidStalled {
    fn pick<'a>(
        &'a self,
        request: &'a RoutingInfo,
        cluster: &'a ClusterState,
    ) -> Option<(NodeRef<'a>, Option<Shard>)> {
        let first = self.inner.pick(request, cluster)?;
        let now = Instant::now();
        let mut nodes = self.nodes();
        let chosen = {
            let health = nodes.entry(first.0.host_id).or_default();
            if health.stalled(now, self.stall_after) && !health.probe(now, self.probe_every) {
                if !std::mem::replace(&mut health.reported, true) {
                    self.metrics.node_stalled(DB_CASSANDRA);
                    tracing::warn!(
                        node = %first.0.address,
                        after_ms = self.stall_after.as_millis(),
                        "database node not answering: its requests go to other replicas first, if there are any"
                    );
                }
                self.inner
                    .fallback(request, cluster)
                    .find(|(node, _)| !self.is_stalled(&nodes, node, now))
                    .unwrap_or(first)
            } else {
                first
            }
        };
        nodes.entry(chosen.0.host_id).or_default().asked(now);
        Some(chosen)
    }

    fn fallback<'a>(
        &'a self,
        request: &'a RoutingInfo,
        cluster: &'a ClusterState,
    ) -> FallbackPlan<'a> {
        let now = Instant::now();
        let nodes = self.nodes();
        let plan = self.inner.fallback(request, cluster);
        if !nodes.values().any(|h| h.stalled(now, self.stall_after)) {
            // The usual case: the driver's plan as it is, not collected.
            return plan;
        }
        let (mut first, last): (Vec<_>, Vec<_>) =
            plan.partition(|(node, _)| !self.is_stalled(&nodes, node, now));
        first.extend(last);
        Box::new(first.into_iter())
    }

    fn on_request_success(&self, request: &RoutingInfo, latency: Duration, node: NodeRef<'_>) {
        self.answered(node);
        self.inner.on_request_success(request, latency, node);
    }

    fn on_request_failure(
        &self,
        request: &RoutingInfo,
        latency: Duration,
        node: NodeRef<'_>,
        error: &RequestAttemptError,
    ) {
        // An error from the database is an answer; a broken connection is
        // not (the driver marks the node down by itself).
        if matches!(error, RequestAttemptError::DbError(..)) {
            self.answered(node);
        }
        self.inner.on_request_failure(request, latency, node, error);
    }

    fn name(&self) -> String {
        format!("AvoidStalled({})", self.inner.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_millis(500);
    const EVERY: Duration = Duration::from_secs(1);

    #[test]
    fn a_node_asked_and_silent_for_long_enough_is_stalled_until_it_answers() {
        let t0 = Instant::now();
        let mut node = Health::default();
        assert!(!node.stalled(t0 + AFTER * 10, AFTER), "never asked");

        node.asked(t0);
        node.asked(t0 + AFTER / 2); // the first unanswered ask counts
        assert!(!node.stalled(t0 + AFTER, AFTER));
        assert!(node.stalled(t0 + AFTER + Duration::from_millis(1), AFTER));

        assert!(!node.answered(), "its stall was not reported");
        assert!(!node.stalled(t0 + AFTER * 10, AFTER), "it answered");
    }

    #[test]
    fn a_stalled_node_gets_one_probe_per_interval() {
        let t0 = Instant::now();
        let mut node = Health::default();
        node.asked(t0);
        let later = t0 + AFTER * 2;
        assert!(node.probe(later, EVERY));
        assert!(!node.probe(later + EVERY / 2, EVERY));
        assert!(node.probe(later + EVERY, EVERY));
        node.answered();
        assert!(
            node.probe(later + EVERY, EVERY),
            "an answer ends the probing"
        );
    }
}
