//! A process's certificate, key and trusted CA, kept current, and the
//! rustls configurations built on them.

use std::{fmt, path::PathBuf, sync::Arc};

use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore,
    ServerConfig, SignatureScheme,
    client::{
        ResolvesClientCert, WebPkiServerVerifier,
        danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
        verify_server_name,
    },
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject},
    server::{
        ClientHello, ParsedCertificate, ResolvesServerCert, WebPkiClientVerifier,
        danger::{ClientCertVerified, ClientCertVerifier},
    },
    sign::CertifiedKey,
};

use super::TlsFiles;
use crate::watched::WatchedFile;
use imdedup_domain::Error;

/// ALPN: gRPC is HTTP/2.
const H2: &[u8] = b"h2";

/// This process's certificate and key, and the CA it trusts; read again
/// when any of the three files changes (a change that does not load is
/// logged and the previous material stays).
pub struct Identity {
    files: TlsFiles,
    material: WatchedFile<Material>,
    provider: Arc<CryptoProvider>,
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identity")
            .field("cert", &self.files.cert)
            .field("ca", &self.files.ca)
            .finish_non_exhaustive()
    }
}

struct Material {
    key: Arc<CertifiedKey>,
    clients: Arc<dyn ClientCertVerifier>,
    servers: Arc<WebPkiServerVerifier>,
}

impl Identity {
    /// Read `files` now; an error here is an error at start.
    pub fn open(files: TlsFiles) -> Result<Self, Error> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let paths = vec![files.cert.clone(), files.key.clone(), files.ca.clone()];
        let reading = Arc::clone(&provider);
        let material = WatchedFile::open_all(paths, move |paths| read(paths, &reading))?;
        Ok(Self {
            files,
            material,
            provider,
        })
    }

    fn current(&self) -> Arc<Material> {
        self.material.get()
    }

    /// A client's configuration: the server must show a certificate from
    /// the CA valid for the host dialled; this process shows its own.
    pub(crate) fn client_config(self: &Arc<Self>) -> Result<Arc<ClientConfig>, Error> {
        let mut config = ClientConfig::builder_with_provider(Arc::clone(&self.provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_error)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(CurrentCa(Arc::clone(self))))
            .with_client_cert_resolver(Arc::new(CurrentKey(Arc::clone(self))));
        config.alpn_protocols = vec![H2.to_vec()];
        Ok(Arc::new(config))
    }

    /// A server's configuration: every caller must show a certificate from
    /// the CA that names one of `allowed_clients` (DNS names).
    pub(crate) fn server_config(
        self: &Arc<Self>,
        allowed_clients: &[String],
    ) -> Result<Arc<ServerConfig>, Error> {
        if allowed_clients.is_empty() {
            return Err(Error::invalid(
                "mutual TLS needs the names of the clients allowed to call (--tls-allow-clients)",
            ));
        }
        let allowed = allowed_clients
            .iter()
            .map(|name| {
                ServerName::try_from(name.clone())
                    .ok()
                    .filter(|parsed| matches!(parsed, ServerName::DnsName(_)))
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "{name:?} is not a DNS name a certificate can carry"
                        ))
                    })
            })
            .collect::<Result<_, _>>()?;
        let mut config = ServerConfig::builder_with_provider(Arc::clone(&self.provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_error)?
            .with_client_cert_verifier(Arc::new(AllowedClients {
                identity: Arc::clone(self),
                allowed,
            }))
            .with_cert_resolver(Arc::new(CurrentKey(Arc::clone(self))));
        config.alpn_protocols = vec![H2.to_vec()];
        Ok(Arc::new(config))
    }

    fn verify_tls12(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

fn tls_error(e: rustls::Error) -> Error {
    Error::invalid(format!("TLS configuration: {e}"))
}

/// Read the certificate chain, the key and the CA, and check they fit.
fn read(paths: &[PathBuf], provider: &Arc<CryptoProvider>) -> Result<Material, Error> {
    let [cert, key, ca] = paths else {
        return Err(Error::internal("TLS material is three files"));
    };
    let chain = certificates(cert)?;
    let private = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| Error::invalid(format!("no usable private key in {}: {e}", key.display())))?;
    let key = CertifiedKey::from_der(chain, private, provider).map_err(|e| {
        Error::invalid(format!(
            "{} and {} do not make a usable certificate and key: {e}",
            cert.display(),
            key.display()
        ))
    })?;
    let mut roots = RootCertStore::empty();
    for ca_cert in certificates(ca)? {
        roots.add(ca_cert).map_err(|e| {
            Error::invalid(format!("{} is not a CA certificate: {e}", ca.display()))
        })?;
    }
    let roots = Arc::new(roots);
    let clients =
        WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(provider))
            .build()
            .map_err(|e| Error::invalid(format!("{}: {e}", ca.display())))?;
    let servers = WebPkiServerVerifier::builder_with_provider(roots, Arc::clone(provider))
        .build()
        .map_err(|e| Error::invalid(format!("{}: {e}", ca.display())))?;
    Ok(Material {
        key: Arc::new(key),
        clients,
        servers,
    })
}

fn certificates(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let unreadable = |e: rustls::pki_types::pem::Error| {
        Error::invalid(format!(
            "cannot read certificates from {}: {e}",
            path.display()
        ))
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(unreadable)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(unreadable)?;
    if certs.is_empty() {
        return Err(Error::invalid(format!(
            "no PEM certificate in {}",
            path.display()
        )));
    }
    Ok(certs)
}

/// This process's certificate as it is now, for either side.
#[derive(Debug)]
struct CurrentKey(Arc<Identity>);

impl ResolvesServerCert for CurrentKey {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0.current().key))
    }
}

impl ResolvesClientCert for CurrentKey {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0.current().key))
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// A server's certificate is checked against the CA as it is now.
#[derive(Debug)]
struct CurrentCa(Arc<Identity>);

impl ServerCertVerifier for CurrentCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0.current().servers.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.schemes()
    }
}

/// A caller's certificate must chain to the CA as it is now and name one
/// of the allowed identities.
#[derive(Debug)]
struct AllowedClients {
    identity: Arc<Identity>,
    allowed: Vec<ServerName<'static>>,
}

impl ClientCertVerifier for AllowedClients {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // No hints: our clients have one certificate and always show it.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.identity
            .current()
            .clients
            .verify_client_cert(end_entity, intermediates, now)?;
        let cert = ParsedCertificate::try_from(end_entity)?;
        if self
            .allowed
            .iter()
            .any(|name| verify_server_name(&cert, name).is_ok())
        {
            Ok(ClientCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.identity.verify_tls12(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.identity.verify_tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.identity.schemes()
    }
}
