//! The domain of imdedup, shared by every service: what a message is, what
//! can go wrong, and the two backends' contracts. No networking, gRPC,
//! HTTP, TLS or telemetry crate is a dependency of this one; the wire
//! (generated types, JSON frames, the conversions and the error codec) is
//! `imdedup-proto`'s, and the process runtime is `imdedup-runtime`'s.
//!
//! - [`model`]: validated types (sender, client message ID, conversation,
//!   body) and what storage and ACKs carry ([`receipt`]: what a stored
//!   message is given, named by ACKs and by errors alike);
//! - [`error`]: the small set of error kinds and the `retryable` flag that
//!   phones see;
//! - [`store`] and [`window`]: the two backend traits, the durable store with
//!   its unique key and the recent-ID window in front of it;
//! - [`routing`]: which ingest shard owns a conversation, and the stable hash
//!   behind it;
//! - [`direct`]: the naming rule of direct conversations (`dm:ana:ben`);
//! - [`clock`]: time that tests can move by hand.

pub mod clock;
pub mod direct;
pub mod error;
pub mod model;
pub mod receipt;
pub mod routing;
pub mod store;
pub mod window;

pub use error::{Error, ErrorKind};
