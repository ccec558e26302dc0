//! The hops between the services, each client beside the machinery its
//! server answers with:
//!
//! - [`ingest`]: the gateway's client of an ingest shard, its sends on one
//!   long-lived stream (`SendStream`);
//! - [`storage`]: the storage service as a `MessageStore`, its inserts on
//!   one long-lived stream (`InsertStream`);
//! - [`stream`]: the machinery of both ([`stream::StreamHop`]), and its
//!   serving side ([`stream::answer_each`]), which the ingest and storage
//!   servers use;
//! - [`MAX_BATCH_MESSAGE_BYTES`]: what both sides of a hop decode at most.
//!
//! The messages themselves are `imdedup-proto`'s; serving, TLS and trace
//! context are `imdedup-runtime`'s.

pub mod ingest;
pub mod storage;
pub mod stream;

/// Largest message a hop decodes: a full batch (`SendBatch`, `InsertBatch`,
/// 1,024 items) of the largest frames the gateway reads (256 KiB) and then
/// some. Answers and streamed items are far smaller.
pub const MAX_BATCH_MESSAGE_BYTES: usize = 80 << 20;
