//! Mutual TLS on the internal gRPC hops (gateway → ingest → storage).
//!
//! Every process holds one [`Identity`]: its certificate and key, and the CA
//! it trusts, from PEM files read again when they change (a cert-manager
//! Secret mounted as a directory rotates this way; handshakes after the
//! change use the new files, connections already open keep theirs).
//!
//! - A server asks every caller for a certificate signed by the CA, and
//!   accepts it only if it names one of the identities allowed to call that
//!   server (a DNS name among the certificate's subject alternative names;
//!   wildcards in the certificate match as they do for host names): ingest
//!   accepts gateways, storage accepts ingest and gateways. Anyone else is
//!   refused in the handshake, before a byte of gRPC.
//! - A client checks the server's certificate against the host of the URL
//!   it dials, as HTTPS does, and shows its own.
//!
//! [`InternalTls::Plaintext`] exists for local runs and must be asked for.

mod client;
mod identity;
mod server;

use std::{path::PathBuf, sync::Arc};

pub use client::channel;
pub use identity::Identity;
pub use server::{TlsIncoming, incoming};

use imdedup_domain::Error;

/// The names each service's certificate carries by default (a DNS subject
/// alternative name), and that the servers check their callers for: ingest
/// accepts [`GATEWAY`]; storage accepts [`INGEST`] and [`GATEWAY`].
pub mod names {
    pub const GATEWAY: &str = "imdedup-gateway";
    pub const INGEST: &str = "imdedup-ingest";
    pub const STORAGE: &str = "imdedup-storage";
}

/// Where a process's certificate, key and trusted CA are.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// PEM certificate chain, this process's first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM certificates of the CA(s) that sign the other services'.
    pub ca: PathBuf,
}

/// How one process talks to the others.
#[derive(Clone, Debug)]
pub enum InternalTls {
    /// No encryption, no authentication: local runs only.
    Plaintext,
    /// Mutual TLS with this identity.
    Mutual(Arc<Identity>),
}

impl InternalTls {
    /// Mutual TLS with the certificate, key and CA in `files`, read now.
    pub fn mutual(files: TlsFiles) -> Result<Self, Error> {
        Ok(Self::Mutual(Arc::new(Identity::open(files)?)))
    }

    pub fn is_plaintext(&self) -> bool {
        matches!(self, Self::Plaintext)
    }

    /// A server's side: `None` for plaintext, else a TLS configuration that
    /// accepts callers whose certificate names one of `allowed_clients`.
    pub fn server(
        &self,
        allowed_clients: &[String],
    ) -> Result<Option<Arc<rustls::ServerConfig>>, Error> {
        match self {
            Self::Plaintext => Ok(None),
            Self::Mutual(identity) => identity.server_config(allowed_clients).map(Some),
        }
    }
}
