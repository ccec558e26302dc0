//! What one client, or all of them together, may cost a gateway: each limit
//! answered with a clear error and counted in
//! `imdedup_gateway_limited_total{reason}`.

use std::{
    collections::HashMap,
    num::NonZeroU32,
    sync::{Arc, Mutex},
    time::Duration,
};

use governor::{
    Quota, RateLimiter,
    clock::{Clock, DefaultClock},
    middleware::NoOpMiddleware,
    state::keyed::DashMapStateStore,
};
use imdedup_domain::model::Sender;

/// The gateway's limits; every one is a flag (see docs/operations.md).
#[derive(Debug, Clone)]
pub struct Limits {
    /// From TCP accept to an authenticated WebSocket upgrade.
    pub upgrade_timeout: Duration,
    /// Connections accepted but not authenticated yet (slowloris).
    pub max_unauthenticated: usize,
    /// A ping to a connection quiet this long.
    pub ping_interval: Duration,
    /// A connection that sent nothing (not even a pong) this long is
    /// closed, freeing its slot.
    pub idle_timeout: Duration,
    /// Connections of one user at once.
    pub max_connections_per_user: usize,
    /// Sends per second of one user (token bucket rate), over all of its
    /// connections.
    pub user_sends_per_second: NonZeroU32,
    /// Sends one user may make at once above that rate (bucket size).
    pub user_send_burst: NonZeroU32,
    /// Sends in flight in the whole gateway, at most: the ceiling of the
    /// adaptive admission limit (see [`crate::admission`]).
    pub max_sends_in_flight: usize,
    /// A send answered later than this cuts the admission limit.
    pub send_latency_target: Duration,
    /// Bytes of memory the gateway may spend on sends held for their
    /// appointment, over all connections (the phones asked for `queue`),
    /// each counted as its content and what holding it costs besides
    /// (`HELD_SEND_OVERHEAD`); beyond, such sends are refused with their
    /// appointment instead.
    pub max_held_bytes: usize,
    /// Message bodies in one history page, in bytes (a page holds at least
    /// one message).
    pub max_history_page_bytes: usize,
    /// History pulls in flight on one connection.
    pub max_pulls_per_connection: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            upgrade_timeout: Duration::from_secs(10),
            max_unauthenticated: 1024,
            ping_interval: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(90),
            max_connections_per_user: 16,
            user_sends_per_second: NonZeroU32::new(50).expect("non-zero"),
            user_send_burst: NonZeroU32::new(200).expect("non-zero"),
            max_sends_in_flight: 20_000,
            send_latency_target: Duration::from_millis(600),
            max_held_bytes: 256 << 20,
            max_history_page_bytes: 1 << 20,
            max_pulls_per_connection: 2,
        }
    }
}

/// Open connections per user.
#[derive(Debug)]
pub struct UserConnections {
    max: usize,
    open: Arc<Mutex<HashMap<String, usize>>>,
}

/// One of a user's connection slots, given back on drop.
#[derive(Debug)]
pub struct UserSlot {
    user: String,
    open: Arc<Mutex<HashMap<String, usize>>>,
}

impl UserConnections {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            open: Arc::default(),
        }
    }

    /// A slot for `user`, unless the user has `max` connections open.
    pub fn open(&self, user: &Sender) -> Option<UserSlot> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(user.as_str().to_owned()).or_default();
        if *count >= self.max {
            return None;
        }
        *count += 1;
        Some(UserSlot {
            user: user.as_str().to_owned(),
            open: Arc::clone(&self.open),
        })
    }
}

impl Drop for UserSlot {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.user) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.user);
            }
        }
    }
}

/// Sends per user: a token bucket per user (GCRA, from `governor`).
pub struct SendRate<C: Clock = DefaultClock> {
    limiter: RateLimiter<String, DashMapStateStore<String>, C, NoOpMiddleware<C::Instant>>,
    clock: C,
}

impl SendRate {
    pub fn new(per_second: NonZeroU32, burst: NonZeroU32) -> Self {
        Self::with_clock(per_second, burst, DefaultClock::default())
    }
}

impl<C: Clock + Clone> SendRate<C> {
    pub fn with_clock(per_second: NonZeroU32, burst: NonZeroU32, clock: C) -> Self {
        let quota = Quota::per_second(per_second).allow_burst(burst);
        Self {
            limiter: RateLimiter::dashmap_with_clock(quota, clock.clone()),
            clock,
        }
    }

    /// Take one send from `user`'s bucket, or say how long until one is
    /// there.
    pub fn check(&self, user: &Sender) -> Result<(), Duration> {
        // Only users who sent recently are kept: forget the others now and
        // then, so the map stays as large as the active users.
        if self.limiter.len() > 100_000 {
            self.limiter.retain_recent();
        }
        // The key is cloned only the first time a user is seen.
        match self.limiter.check_key(&user.as_str().to_owned()) {
            Ok(()) => Ok(()),
            Err(not_until) => Err(not_until.wait_time_from(self.clock.now())),
        }
    }
}

#[cfg(test)]
mod tests {
    use governor::clock::FakeRelativeClock;

    use super::*;

    fn user(name: &str) -> Sender {
        Sender::parse(name).unwrap()
    }

    #[test]
    fn a_user_gets_the_burst_then_the_rate_and_says_when_to_come_back() {
        let clock = FakeRelativeClock::default();
        let rate = SendRate::with_clock(
            NonZeroU32::new(10).unwrap(),
            NonZeroU32::new(3).unwrap(),
            clock.clone(),
        );
        for _ in 0..3 {
            assert_eq!(rate.check(&user("ana")), Ok(()));
        }
        let wait = rate.check(&user("ana")).unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_millis(100),
            "{wait:?}"
        );
        // Another user has a bucket of their own.
        assert_eq!(rate.check(&user("ben")), Ok(()));
        clock.advance(wait);
        assert_eq!(rate.check(&user("ana")), Ok(()));
        assert!(rate.check(&user("ana")).is_err());
    }

    #[test]
    fn a_user_has_at_most_max_connections_and_a_closed_one_frees_its_slot() {
        let connections = UserConnections::new(2);
        let first = connections.open(&user("ana")).unwrap();
        let _second = connections.open(&user("ana")).unwrap();
        assert!(connections.open(&user("ana")).is_none());
        assert!(connections.open(&user("ben")).is_some());
        drop(first);
        assert!(connections.open(&user("ana")).is_some());
    }
}
