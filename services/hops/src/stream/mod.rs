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
//! The gateway's sends to the shards ([`crate::ingest`]) and the ingest's
//! inserts into storage ([`crate::storage`]) use it. What a hop has
//! unanswered is bounded by its window ([`window`]): adaptive for the
//! gateway's sends, which a shard can push back on; fixed for inserts,
//! which the ingest's database limit bounds before they reach the hop.

mod client;
mod server;
pub mod window;

pub use client::{HopAnswers, HopCall, HopLimits, StreamHop, grpc_answers};
pub use server::answer_each;
pub use tokio_stream::wrappers::ReceiverStream;
pub use window::WindowLimits;
