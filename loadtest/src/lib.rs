//! imdedup's load-test driver. It speaks the gateway's WebSocket protocol as
//! phones do: each message gets its client ID before the first send and
//! keeps it on every resend; sends and ACKs are lost per leg with their own
//! probabilities; resends follow exponential backoff with jitter. Load is
//! open-loop (messages are due at a constant rate whether or not earlier
//! ones were answered), and at the end an audit pulls every conversation's
//! history and checks that nothing was lost or stored twice, and that the
//! followers, readers that pulled every conversation with a cursor while the
//! load ran, missed nothing.

pub mod audit;
pub mod business;
pub mod config;
pub mod cpu;
pub mod follow;
pub mod html;
pub mod link;
mod names;
pub mod overload;
pub mod phone;
pub mod report;
pub mod run;
pub mod search;

pub use config::{LoadConfig, Target};
pub use run::{RunResult, run};
