//! A hop between two services over one long-lived bidirectional stream.
//!
//! Callers hand in one request each and wait for their own answer
//! ([`StreamHop::call`]); every request travels as one message on a stream
//! that stays open, tagged so that its answer, in any order, finds its
//! caller. The serving side ([`answer_each`]) decides each request in its
//! own task and answers it as soon as it is decided, so no request waits for
//! a slower one. A quiet hop thus pays one message each way per request,
//! not a new HTTP/2 stream (headers, trailers, a call through the server's
//! layers) as a call per request or per batch does; a busy one still
//! shares writes, as HTTP/2 coalesces the frames that queue up.
//!
//! The ingest's inserts into storage use it ([`crate::storage`]). The
//! gateway's sends to the shards do not: a stream lets every send reach the
//! shard at once, where under a slow database they wait and come back
//! refused; the gateway's batches in flight (see [`crate::batch`] and
//! [`crate::ingest`]) hold them back instead.

mod client;
mod server;

pub use client::{HopAnswers, HopCall, HopLimits, StreamHop};
pub use server::answer_each;
pub use tokio_stream::wrappers::ReceiverStream;
