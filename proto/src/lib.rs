//! Wire types of imdedup: the gRPC services between gateway, ingest and
//! storage, and the binary client frames. Shared by clients and servers.
//!
//! The generated types are not validated: handlers convert them into the
//! domain types of `imdedup-domain` once, at the edge ([`convert`]).
//!
//! - [`json`]: the JSON text frames of the client protocol;
//! - [`convert`]: wire types to domain types (validating) and back;
//! - [`status`]: the one codec between domain errors and gRPC statuses.

pub mod convert;
pub mod json;
pub mod status;

use std::time::Duration;

/// A send whose message its phone has had this long (`age_ms`) is of an
/// old message: the gateway serves it with the backlog of a surge, not
/// ahead of it, and a phone's throttle decides for it by other counts than
/// for its fresh messages. One value for both sides.
pub const FRESH_FOR: Duration = Duration::from_secs(5);

/// Version 1 of the protocol, package `imdedup.v1`.
pub mod v1 {
    tonic::include_proto!("imdedup.v1");
}

/// The encoded file descriptor set of every `.proto` file, for gRPC server
/// reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("imdedup_descriptor");
