//! imdedup's integration tests, one module per crate under test (see the
//! package's `src/lib.rs`). `cargo test -p imdedup-integration-tests`
//! runs them all; a module alone: `… -- cluster::send_path`.

/// A whole cluster in one process (`imdedup-cluster`), driven through the
/// phone client, the business API and the services' gRPC surfaces.
mod cluster {
    #[macro_use]
    mod common;

    mod authz;
    mod bad_input;
    mod business;
    mod frames_fuzz;
    mod grpc_surface;
    mod internal_tls;
    mod limits;
    mod metrics;
    mod send_path;
}

/// The stores: the conformance suite on every backend (SQLite, CQL, the
/// storage service over gRPC), ordering and request counts on CQL.
mod storage {
    mod common;

    #[cfg(feature = "testing")]
    mod scylla_order;
    mod scylla_replicas;
    mod scylla_requests;
    mod store_conformance;
}

/// The recent-ID windows (in-process, Redis, Redis Cluster) under one
/// contract.
mod ingest {
    mod window_conformance;
}

/// The phone protocol's frames, property-tested.
mod gateway {
    mod frames_proptest;
}

/// Validation of tokens and wire values, property-tested.
mod runtime {
    mod validation_proptest;
}

/// The load driver against a local cluster: the book's scenario, and
/// phones that honour the server's retry-after hint.
mod loadtest {
    mod book;
    mod pushback;
}
