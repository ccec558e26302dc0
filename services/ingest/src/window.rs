//! The embedded recent-ID window: in-process, on moka, with the same claim
//! protocol as the Redis window (claim, then remember or release).
//!
//! Entries expire by the injected [`Clock`], so tests and the demo can jump
//! an hour ahead; moka's own time-to-live bounds memory in real time.

use std::{sync::Arc, time::Duration, time::Instant};

use crate::metrics::WindowMetrics;
use async_trait::async_trait;
use imdedup_domain::{
    Error,
    clock::{SharedClock, SystemClock},
    model::{MessageKey, Remembered},
    window::{Claim, ClaimToken, RecentWindow},
};
use moka::{ops::compute::Op, sync::Cache};

/// Default time a stored ID is remembered: resends come minutes later, after
/// reconnects.
pub const DEFAULT_WINDOW_TTL: Duration = Duration::from_secs(300);
/// Default life of a claim whose owner never finished (a crashed insert).
pub const DEFAULT_CLAIM_TTL: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct MemoryWindowOptions {
    pub ttl: Duration,
    pub claim_ttl: Duration,
    /// Most keys remembered; the least recently used go first beyond it.
    pub max_keys: u64,
}

impl Default for MemoryWindowOptions {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_WINDOW_TTL,
            claim_ttl: DEFAULT_CLAIM_TTL,
            max_keys: 2_000_000,
        }
    }
}

#[derive(Debug, Clone)]
enum Entry {
    Pending {
        token: ClaimToken,
        until: Instant,
    },
    Stored {
        remembered: Remembered,
        until: Instant,
    },
}

impl Entry {
    fn live_at(&self, now: Instant) -> bool {
        match self {
            Self::Pending { until, .. } | Self::Stored { until, .. } => now < *until,
        }
    }
}

/// An in-process [`RecentWindow`].
pub struct MemoryWindow {
    entries: Cache<Vec<u8>, Entry>,
    options: MemoryWindowOptions,
    clock: SharedClock,
    metrics: WindowMetrics,
}

const BACKEND: &str = "memory";

impl MemoryWindow {
    pub fn new(options: MemoryWindowOptions) -> Self {
        Self::with_clock(options, Arc::new(SystemClock))
    }

    pub fn with_clock(options: MemoryWindowOptions, clock: SharedClock) -> Self {
        let entries = Cache::builder()
            .max_capacity(options.max_keys)
            .time_to_live(options.ttl.max(options.claim_ttl))
            .build();
        Self {
            entries,
            options,
            clock,
            metrics: WindowMetrics::default(),
        }
    }

    /// Record call durations into `metrics` (the ingest's `window`).
    pub fn with_metrics(mut self, metrics: WindowMetrics) -> Self {
        self.metrics = metrics;
        self
    }
}

#[async_trait]
impl RecentWindow for MemoryWindow {
    async fn claim(&self, key: &MessageKey) -> Result<Claim, Error> {
        let started = Instant::now();
        let now = self.clock.now();
        let mut claim = None;
        self.entries
            .entry(key.to_bytes())
            .and_compute_with(|current| match current.map(|e| e.into_value()) {
                Some(Entry::Stored { remembered, until }) if now < until => {
                    claim = Some(Claim::Seen(remembered));
                    Op::Nop
                }
                Some(pending @ Entry::Pending { .. }) if pending.live_at(now) => {
                    claim = Some(Claim::InFlight);
                    Op::Nop
                }
                _ => {
                    let token = ClaimToken(uuid::Uuid::new_v4().to_string());
                    claim = Some(Claim::Owned(token.clone()));
                    Op::Put(Entry::Pending {
                        token,
                        until: now + self.options.claim_ttl,
                    })
                }
            });
        self.metrics.observe("claim", BACKEND, started.elapsed());
        claim.ok_or_else(|| Error::internal("window claim made no decision"))
    }

    async fn remember(
        &self,
        key: &MessageKey,
        _token: &ClaimToken,
        remembered: Remembered,
    ) -> Result<(), Error> {
        // Whoever stored the row, the receipt is the same for every copy.
        let started = Instant::now();
        let until = self.clock.now() + self.options.ttl;
        self.entries
            .insert(key.to_bytes(), Entry::Stored { remembered, until });
        self.metrics.observe("remember", BACKEND, started.elapsed());
        Ok(())
    }

    async fn release(&self, key: &MessageKey, token: &ClaimToken) -> Result<(), Error> {
        let started = Instant::now();
        self.entries
            .entry(key.to_bytes())
            .and_compute_with(|current| match current.map(|e| e.into_value()) {
                Some(Entry::Pending { token: held, .. }) if &held == token => Op::Remove,
                _ => Op::Nop,
            });
        self.metrics.observe("release", BACKEND, started.elapsed());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use imdedup_domain::{
        clock::ManualClock,
        model::{ClientMsgId, Sender},
    };

    use super::*;

    fn key(id: &str) -> MessageKey {
        MessageKey {
            sender: Sender::parse("ana").unwrap(),
            client_msg_id: ClientMsgId::parse(id.as_bytes().to_vec()).unwrap(),
        }
    }

    fn window(clock: &ManualClock) -> MemoryWindow {
        MemoryWindow::with_clock(MemoryWindowOptions::default(), Arc::new(clock.clone()))
    }

    const RECEIPT: Remembered = Remembered {
        receipt: imdedup_domain::model::Receipt {
            server_id: 42,
            seq: 7,
        },
        fingerprint: Some(imdedup_domain::model::Fingerprint(0xfeed)),
    };

    #[tokio::test]
    async fn a_remembered_key_is_seen_with_its_receipt_until_the_ttl() {
        let clock = ManualClock::new();
        let window = window(&clock);
        let Claim::Owned(token) = window.claim(&key("m1")).await.unwrap() else {
            panic!("first claim must be owned");
        };
        window.remember(&key("m1"), &token, RECEIPT).await.unwrap();
        assert_eq!(
            window.claim(&key("m1")).await.unwrap(),
            Claim::Seen(RECEIPT)
        );

        clock.advance(DEFAULT_WINDOW_TTL + Duration::from_secs(1));
        assert!(matches!(
            window.claim(&key("m1")).await.unwrap(),
            Claim::Owned(_)
        ));
    }

    #[tokio::test]
    async fn a_second_copy_during_the_claim_is_in_flight() {
        let clock = ManualClock::new();
        let window = window(&clock);
        assert!(matches!(
            window.claim(&key("m1")).await.unwrap(),
            Claim::Owned(_)
        ));
        assert_eq!(window.claim(&key("m1")).await.unwrap(), Claim::InFlight);
        // A claim whose owner died expires after the claim TTL.
        clock.advance(DEFAULT_CLAIM_TTL + Duration::from_millis(1));
        assert!(matches!(
            window.claim(&key("m1")).await.unwrap(),
            Claim::Owned(_)
        ));
    }

    #[tokio::test]
    async fn release_frees_only_the_holders_claim() {
        let clock = ManualClock::new();
        let window = window(&clock);
        let Claim::Owned(token) = window.claim(&key("m1")).await.unwrap() else {
            panic!("first claim must be owned");
        };
        window
            .release(&key("m1"), &ClaimToken("someone else".into()))
            .await
            .unwrap();
        assert_eq!(window.claim(&key("m1")).await.unwrap(), Claim::InFlight);
        window.release(&key("m1"), &token).await.unwrap();
        assert!(matches!(
            window.claim(&key("m1")).await.unwrap(),
            Claim::Owned(_)
        ));
    }

    #[tokio::test]
    async fn release_never_forgets_a_stored_receipt() {
        let clock = ManualClock::new();
        let window = window(&clock);
        let Claim::Owned(token) = window.claim(&key("m1")).await.unwrap() else {
            panic!("first claim must be owned");
        };
        window.remember(&key("m1"), &token, RECEIPT).await.unwrap();
        window.release(&key("m1"), &token).await.unwrap();
        assert_eq!(
            window.claim(&key("m1")).await.unwrap(),
            Claim::Seen(RECEIPT)
        );
    }
}
