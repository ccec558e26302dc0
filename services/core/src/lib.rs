//! The domain of imdedup, shared by every service.
//!
//! - [`model`]: validated types (sender, client message ID, conversation,
//!   body) and what storage and ACKs carry;
//! - [`error`]: the small set of error kinds, mapped once to gRPC codes and to
//!   the client frame's `retryable` flag;
//! - [`store`] and [`window`]: the two backend traits, the durable store with
//!   its unique key and the recent-ID window in front of it;
//! - [`remote_store`]: the storage service over gRPC, as a store;
//! - [`batch`]: natural batching for the gateway's hop to the shards;
//! - [`stream_hop`]: the ingest's hop to storage, one long-lived stream;
//! - [`routing`]: which ingest shard owns a conversation;
//! - [`token`]: the JWTs that name a connection's sender, and their
//!   verification (HS256 secret or JWKS public keys);
//! - [`watched`]: configuration files read again when they change;
//! - [`clock`]: time that tests can move by hand;
//! - [`server`]: gRPC serving with health, optional reflection and a
//!   graceful stop;
//! - [`tls`]: mutual TLS between the services, certificates read again when
//!   they change;
//! - [`metrics`] and [`admin`]: the Prometheus metrics and the admin HTTP
//!   port (`/metrics`, `/healthz`, `/readyz`).
//! - [`telemetry`]: the log, OpenTelemetry traces, and the trace context
//!   carried between services.

pub mod admin;
pub mod batch;
pub mod clock;
pub mod convert;
pub mod error;
pub mod metrics;
pub mod model;
pub mod process;
pub mod remote_store;
pub mod routing;
pub mod secret;
pub mod server;
pub mod store;
pub mod stream_hop;
pub mod telemetry;
pub mod tls;
pub mod token;
pub mod watched;
pub mod window;

pub use error::{Error, ErrorKind};
