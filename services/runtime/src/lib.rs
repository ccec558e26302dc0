//! The process runtime shared by every service. The domain (validated
//! types, error kinds, the store and window traits, routing, clock) is
//! `imdedup-domain`'s; the wire (generated types, JSON frames, conversions,
//! the error codec) is `imdedup-proto`'s; the hops between the services
//! are `imdedup-hops`'.
//!
//! - [`token`]: the JWTs that name a connection's sender, and their
//!   verification (HS256 secret or JWKS public keys);
//! - [`watched`]: configuration files read again when they change;
//! - [`server`]: gRPC serving with health, optional reflection and a
//!   graceful stop;
//! - [`tls`]: mutual TLS between the services, certificates read again when
//!   they change;
//! - [`metrics`] and [`admin`]: the Prometheus metrics and the admin HTTP
//!   port (`/metrics`, `/healthz`, `/readyz`).
//! - [`telemetry`]: the log, OpenTelemetry traces, and the trace context
//!   carried between services;
//! - [`aimd`]: the adaptive limit on work in flight that the gateway's
//!   admission and the ingest's database limit share.

pub mod admin;
pub mod aimd;
pub mod metrics;
pub mod process;
pub mod secret;
pub mod server;
pub mod telemetry;
pub mod tls;
pub mod token;
pub mod watched;
