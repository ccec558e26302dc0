//! Compiles `imdedup/v1/*.proto` with protox (pure Rust, no `protoc` to
//! install) and writes the file descriptor set used by gRPC reflection.

use std::{env, fs, io, path::PathBuf};

use prost::Message;

const PROTOS: &[&str] = &[
    "imdedup/v1/common.proto",
    "imdedup/v1/ingest.proto",
    "imdedup/v1/storage.proto",
    "imdedup/v1/gateway.proto",
    "imdedup/v1/membership.proto",
    "imdedup/v1/business.proto",
];

fn main() -> io::Result<()> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(PROTOS, ["."]).map_err(io::Error::other)?;
    fs::write(out_dir.join("imdedup_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().compile_fds(fds)
}
