//! Accepting TLS connections for a gRPC server: handshakes run beside the
//! accept loop (a slow or hostile peer holds up no one), bounded in time
//! and in number.

use std::{io, net::SocketAddr, sync::Arc, time::Duration};

use rustls::ServerConfig;
use tokio::{
    net::{TcpListener, TcpStream},
    sync::{Semaphore, mpsc},
};
use tokio_rustls::{TlsAcceptor, server::TlsStream};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

/// Longest a peer may take to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most handshakes in progress at once; connections beyond are closed.
const MAX_HANDSHAKES: usize = 256;

/// Connections whose handshake succeeded, for `serve_with_incoming`.
pub type TlsIncoming = ReceiverStream<Result<TlsStream<TcpStream>, io::Error>>;

/// Accept on `listener` until `shutdown`, and hand over the connections
/// whose caller passed `config`'s checks. A refused caller is logged with
/// its address and the reason.
pub fn incoming(
    listener: TcpListener,
    config: Arc<ServerConfig>,
    shutdown: CancellationToken,
) -> TlsIncoming {
    let acceptor = TlsAcceptor::from(config);
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    let (accepted, incoming) = mpsc::channel(MAX_HANDSHAKES);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                () = shutdown.cancelled() => break,
                () = accepted.closed() => break,
                result = listener.accept() => match result {
                    Ok(connection) => connection,
                    Err(e) => {
                        // Out of file descriptors, or the peer left before
                        // accept: wait a little rather than spin.
                        tracing::debug!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                },
            };
            let Ok(permit) = Arc::clone(&handshakes).try_acquire_owned() else {
                tracing::warn!(%peer, "too many TLS handshakes in progress; connection closed");
                continue;
            };
            let (acceptor, accepted) = (acceptor.clone(), accepted.clone());
            tokio::spawn(async move {
                let _permit = permit;
                if let Some(tls) = handshake(&acceptor, tcp, peer).await {
                    let _ = accepted.send(Ok(tls)).await;
                }
            });
        }
    });
    ReceiverStream::new(incoming)
}

async fn handshake(
    acceptor: &TlsAcceptor,
    tcp: TcpStream,
    peer: SocketAddr,
) -> Option<TlsStream<TcpStream>> {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY");
    }
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => Some(tls),
        Ok(Err(e)) => {
            tracing::warn!(%peer, error = %e, "caller refused in the TLS handshake");
            None
        }
        Err(_) => {
            tracing::warn!(%peer, "TLS handshake timed out");
            None
        }
    }
}
