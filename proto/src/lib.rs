//! Wire types of imdedup: the gRPC services between gateway, ingest and
//! storage, and the binary client frames. Shared by clients and servers.
//!
//! Nothing here is validated: handlers convert these types into the domain
//! types of `imdedup-core` once, at the edge.
//!
//! [`json`] holds the JSON text frames of the client protocol.

pub mod json;

/// Version 1 of the protocol, package `imdedup.v1`.
pub mod v1 {
    tonic::include_proto!("imdedup.v1");
}

/// The encoded file descriptor set of every `.proto` file, for gRPC server
/// reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("imdedup_descriptor");
