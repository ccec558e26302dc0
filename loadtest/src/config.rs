//! What a load run is asked to do: where the load goes and how it is
//! shaped. A module of its own, so that the run, its report and the
//! scenarios built on it all read it without depending on each other.

use std::{path::PathBuf, time::Duration};

use imdedup_client::Encoding;
use imdedup_runtime::secret::Secret;

use crate::{cpu::AdminTarget, link::Manners, overload::Phase, phone::ResendPolicy};

/// Where the load goes.
#[derive(Debug, Clone)]
pub enum Target {
    /// A local cluster on the embedded backends, started in this process.
    Embedded { shards: usize },
    /// A running gateway, the secret to mint its users' tokens with, and the
    /// groups file it reads (`--groups-file`), where the run's groups go.
    Gateway {
        url: String,
        token_secret: Secret,
        groups_file: Option<PathBuf>,
    },
}

#[derive(Debug, Clone)]
pub struct LoadConfig {
    pub scenario: String,
    pub target: Target,
    pub messages: u64,
    /// Messages per second once the ramp is over.
    pub rate: f64,
    pub ramp: Duration,
    pub users: usize,
    /// Share of messages sent to group conversations (the rest are direct).
    pub group_share: f64,
    pub groups: usize,
    pub body_bytes: usize,
    pub loss_send: f64,
    pub loss_ack: f64,
    pub policy: ResendPolicy,
    /// Share of messages whose copy also goes, at the same moment, over the
    /// sender's second connection.
    pub concurrent_copies: f64,
    /// Messages resent after the window expired (embedded target only: the
    /// driver moves the cluster's clock an hour ahead).
    pub late_resends: usize,
    pub seed: u64,
    /// Run the embedded cluster with dedup off, to measure the repeats it
    /// prevents (the book's comparison).
    pub dedup_off: bool,
    /// Storm: when non-zero, every message is first sent once and its ACK
    /// lost (the connections drop); then all phones reconnect at once and
    /// resend their whole outbox, each message at a random moment within
    /// this window, on the resend schedule.
    pub storm_window: Duration,
    /// The phones' frames: JSON text or protobuf binary.
    pub encoding: Encoding,
    /// The phones ask the gateway to hold a send when it is full (a
    /// `queued` answer) instead of refusing it.
    pub queue: bool,
    /// Client-side adaptive throttling factor (0: off): a phone the gateway
    /// refuses holds back some new sends itself.
    pub throttle: f64,
    /// Print a progress line every second.
    pub progress: bool,
    /// Write each message's tries and answers here ([`crate::phone::Trace::events_line`]).
    pub events: Option<std::path::PathBuf>,
    /// Follow every conversation with a cursor while the load runs (see
    /// [`crate::follow`]) and audit what the followers received.
    pub followers: bool,
    /// The services' admin ports (`--admin NAME=URL`, with a gateway
    /// target): their CPU per acknowledged message goes in the report.
    pub admin: Vec<AdminTarget>,
    /// Phases of different rates, one after the other, instead of `rate`
    /// for `messages` (the `overload` scenario); the run then also records
    /// tries, refusals and CPU per second.
    pub schedule: Vec<Phase>,
}

impl LoadConfig {
    /// How the phones' clients treat a gateway past its capacity.
    pub fn manners(&self) -> Manners {
        Manners {
            queue: self.queue,
            throttle: self.throttle,
        }
    }
}
