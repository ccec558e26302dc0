//! Dialling a gRPC server over mutual TLS.

use std::{
    future::Future,
    io,
    pin::Pin,
    task::{Context, Poll},
};

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::{TlsConnector, client::TlsStream};
use tonic::{
    codegen::http::Uri,
    transport::{Channel, Endpoint},
};

use super::InternalTls;
use imdedup_domain::Error;

/// A lazily connecting channel to `endpoint`, over TLS when `tls` says so.
/// The server's certificate must be valid for the URL's host.
pub fn channel(endpoint: Endpoint, tls: &InternalTls) -> Result<Channel, Error> {
    match tls {
        InternalTls::Plaintext => Ok(endpoint.connect_lazy()),
        InternalTls::Mutual(identity) => {
            if endpoint.uri().host().is_none() {
                return Err(Error::invalid(format!(
                    "{} has no host to check the certificate against",
                    endpoint.uri()
                )));
            }
            let connect = Connect(TlsConnector::from(identity.client_config()?));
            Ok(endpoint.connect_with_connector_lazy(connect))
        }
    }
}

/// TCP, then the TLS handshake, for each connection the channel opens.
#[derive(Clone)]
struct Connect(TlsConnector);

type Connecting = Pin<Box<dyn Future<Output = io::Result<TokioIo<TlsStream<TcpStream>>>> + Send>>;

impl tower::Service<Uri> for Connect {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connector = self.0.clone();
        Box::pin(async move {
            let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
            let host = uri
                .host()
                .ok_or_else(|| invalid(format!("{uri} has no host")))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let port = uri
                .port_u16()
                .unwrap_or(if uri.scheme_str() == Some("http") {
                    80
                } else {
                    443
                });
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let name = ServerName::try_from(host).map_err(|e| invalid(format!("{uri}: {e}")))?;
            let tls = connector.connect(name, tcp).await?;
            Ok(TokioIo::new(tls))
        })
    }
}
