//! Helpers shared by the store tests.
#![allow(dead_code)]

use imdedup_storage::ScyllaOptions;

pub use imdedup_testkit::fixtures::{history, message};

/// The CQL node (see [`imdedup_testkit::backends`]).
pub fn scylla_endpoint() -> Option<String> {
    imdedup_testkit::backends::real(imdedup_testkit::backends::SCYLLA)
}

/// Options for a keyspace of this test's own on the local CQL node.
pub fn scylla_options() -> Option<ScyllaOptions> {
    let mut options = ScyllaOptions::single_node(vec![scylla_endpoint()?]);
    options.keyspace = format!("s{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    Some(options)
}
