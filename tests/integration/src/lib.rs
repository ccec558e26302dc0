//! No code: imdedup's integration tests are this package's one test binary,
//! `tests/main.rs`, with a module per crate under test. They use the crates
//! through their public APIs only, on the embedded backends and, where the
//! `IMDEDUP_TEST_*` variables name them, on real Redis and Cassandra
//! (`tests/services/services.sh` starts them; `tests/run.sh` does it all).
//!
//! Each crate's unit tests stay beside its code; the `imdedup` binary's
//! process and trace tests stay in its package, where Cargo builds the
//! binary for them.
