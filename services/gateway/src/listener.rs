//! The phones' TCP listener, guarded against connections that never
//! authenticate (slowloris): at most so many connections may be between
//! accept and an authenticated WebSocket upgrade, and each has a deadline
//! for getting there; past it the connection is cut.

use std::{
    future::Future,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use crate::metrics::GatewayMetrics;
use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Sleep,
};

/// A TCP listener whose connections must authenticate in time.
pub struct GuardedListener {
    inner: TcpListener,
    unauthenticated: Arc<Semaphore>,
    upgrade_timeout: Duration,
    metrics: GatewayMetrics,
}

impl GuardedListener {
    pub fn new(
        inner: TcpListener,
        max_unauthenticated: usize,
        upgrade_timeout: Duration,
        metrics: GatewayMetrics,
    ) -> Self {
        Self {
            inner,
            unauthenticated: Arc::new(Semaphore::new(max_unauthenticated.max(1))),
            upgrade_timeout,
            metrics,
        }
    }
}

impl Listener for GuardedListener {
    type Io = GuardedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (GuardedStream, SocketAddr) {
        loop {
            let (tcp, peer) = match self.inner.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, or the peer left before
                    // accept: wait a little rather than spin.
                    tracing::debug!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            };
            let Ok(permit) = Arc::clone(&self.unauthenticated).try_acquire_owned() else {
                // Closing at once is the cheapest answer to a flood.
                self.metrics.limited("unauthenticated");
                continue;
            };
            // ACKs are small and latency-bound: never hold them for Nagle.
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "cannot set TCP_NODELAY");
            }
            let pending = Pending {
                authenticated: AtomicBool::new(false),
                permit: Mutex::new(Some(permit)),
            };
            let stream = GuardedStream {
                tcp,
                deadline: Some(Box::pin(tokio::time::sleep(self.upgrade_timeout))),
                pending: Arc::new(pending),
                metrics: self.metrics.clone(),
            };
            return (stream, peer);
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

#[derive(Debug)]
struct Pending {
    authenticated: AtomicBool,
    /// One of the unauthenticated slots, held until authentication.
    permit: Mutex<Option<OwnedSemaphorePermit>>,
}

/// A connection's handle for the upgrade handler (as axum connect info).
#[derive(Debug, Clone)]
pub struct Admission(Arc<Pending>);

impl Admission {
    /// The connection authenticated: it no longer has a deadline, and its
    /// unauthenticated slot is free for another.
    pub fn authenticated(&self) {
        self.0.authenticated.store(true, Ordering::Release);
        drop(
            self.0
                .permit
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
    }
}

impl Connected<IncomingStream<'_, GuardedListener>> for Admission {
    fn connect_info(stream: IncomingStream<'_, GuardedListener>) -> Self {
        Self(Arc::clone(&stream.io().pending))
    }
}

/// A phone's TCP connection, cut if it has not authenticated by its
/// deadline.
pub struct GuardedStream {
    tcp: TcpStream,
    deadline: Option<Pin<Box<Sleep>>>,
    pending: Arc<Pending>,
    metrics: GatewayMetrics,
}

impl GuardedStream {
    /// `Err` once the deadline has passed without authentication.
    fn check_deadline(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.pending.authenticated.load(Ordering::Acquire) {
            self.deadline = None;
            return Ok(());
        }
        if let Some(deadline) = self.deadline.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            self.deadline = None;
            self.metrics.limited("upgrade_timeout");
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no authenticated WebSocket upgrade in time",
            ));
        }
        Ok(())
    }
}

impl AsyncRead for GuardedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Err(e) = self.check_deadline(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for GuardedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}
