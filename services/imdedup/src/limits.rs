//! The gateway's limits as flags: what one phone, or all of them, may cost.

use std::{num::NonZeroU32, time::Duration};

use clap::Args;
use imdedup_gateway::limits::Limits;

use crate::services::duration;

#[derive(Debug, Clone, Args)]
pub struct LimitArgs {
    /// Time from TCP accept to an authenticated WebSocket upgrade; a
    /// connection that takes longer is cut.
    #[arg(long, env = "IMDEDUP_UPGRADE_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub upgrade_timeout: Duration,
    /// Most connections accepted but not authenticated yet; more are
    /// closed at once.
    #[arg(long, env = "IMDEDUP_MAX_UNAUTHENTICATED", default_value_t = 1024)]
    pub max_unauthenticated: usize,
    /// A WebSocket ping after this long without pinging.
    #[arg(long, env = "IMDEDUP_PING_INTERVAL", default_value = "30s", value_parser = duration)]
    pub ping_interval: Duration,
    /// A connection that sent nothing, not even a pong, this long is closed.
    #[arg(long, env = "IMDEDUP_IDLE_TIMEOUT", default_value = "90s", value_parser = duration)]
    pub idle_timeout: Duration,
    /// Most connections of one user at once; more are refused with HTTP 429.
    #[arg(long, env = "IMDEDUP_MAX_CONNECTIONS_PER_USER", default_value_t = 16)]
    pub max_connections_per_user: usize,
    /// Sends per second one user may make, over all of its connections;
    /// beyond, `overloaded` with `retry_after_ms`.
    #[arg(long, env = "IMDEDUP_USER_SENDS_PER_SECOND", default_value = "50")]
    pub user_sends_per_second: NonZeroU32,
    /// Sends one user may make at once above that rate.
    #[arg(long, env = "IMDEDUP_USER_SEND_BURST", default_value = "200")]
    pub user_send_burst: NonZeroU32,
    /// Most sends in flight in the gateway: the ceiling of its adaptive
    /// admission limit; beyond the limit, `overloaded` with
    /// `retry_after_ms` (an appointment).
    #[arg(long, env = "IMDEDUP_MAX_SENDS_IN_FLIGHT", default_value_t = 20_000)]
    pub max_sends_in_flight: usize,
    /// A send answered later than this cuts the gateway's admission limit,
    /// so the work it takes in finishes in about this time.
    #[arg(long, env = "IMDEDUP_SEND_LATENCY_TARGET", default_value = "600ms", value_parser = duration)]
    pub send_latency_target: Duration,
    /// Most bytes of memory the gateway spends on sends held for their
    /// appointment (phones that ask for `queue` get a `queued` answer
    /// instead of a refusal), each counted as its content and ~1,600 bytes
    /// of task and bookkeeping; beyond, such sends are refused with their
    /// appointment. 0 holds none.
    #[arg(long, env = "IMDEDUP_MAX_HELD_BYTES", default_value_t = 256 << 20)]
    pub max_held_bytes: usize,
    /// Most bytes of message bodies in one history page (a page holds at
    /// least one message).
    #[arg(long, env = "IMDEDUP_MAX_HISTORY_PAGE_BYTES", default_value_t = 1 << 20)]
    pub max_history_page_bytes: usize,
    /// Most history pulls in flight on one connection; beyond,
    /// `overloaded`.
    #[arg(long, env = "IMDEDUP_MAX_PULLS_PER_CONNECTION", default_value_t = 2)]
    pub max_pulls_per_connection: usize,
}

impl LimitArgs {
    pub fn limits(&self) -> Limits {
        Limits {
            upgrade_timeout: self.upgrade_timeout,
            max_unauthenticated: self.max_unauthenticated.max(1),
            ping_interval: self.ping_interval.max(Duration::from_secs(1)),
            idle_timeout: self.idle_timeout.max(Duration::from_secs(1)),
            max_connections_per_user: self.max_connections_per_user.max(1),
            user_sends_per_second: self.user_sends_per_second,
            user_send_burst: self.user_send_burst,
            max_sends_in_flight: self.max_sends_in_flight.max(1),
            send_latency_target: self.send_latency_target.max(Duration::from_millis(1)),
            max_held_bytes: self.max_held_bytes,
            max_history_page_bytes: self.max_history_page_bytes.max(1),
            max_pulls_per_connection: self.max_pulls_per_connection.max(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        limits: LimitArgs,
    }

    #[test]
    fn the_flags_defaults_are_the_libraries() {
        let flags = Wrap::try_parse_from(["gateway"]).unwrap().limits.limits();
        let library = Limits::default();
        assert_eq!(format!("{flags:?}"), format!("{library:?}"));
    }

    #[test]
    fn a_zero_rate_is_refused_by_name() {
        let err = Wrap::try_parse_from(["gateway", "--user-sends-per-second", "0"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--user-sends-per-second"), "{err}");
    }
}
