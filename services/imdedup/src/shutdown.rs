//! Serve until SIGINT or SIGTERM, then drain within a grace period.

use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

/// Resolves on Ctrl-C or SIGTERM (what Kubernetes sends). The handlers are
/// installed when this is called, not when the future is first polled: a
/// signal that arrives in between (a supervisor or a test that stops the
/// process as soon as it printed its addresses) would otherwise meet the
/// default action and kill the process without its drain.
pub fn signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{Signal, SignalKind, signal};
        async fn recv(signal: std::io::Result<Signal>) {
            match signal {
                Ok(mut signal) => {
                    signal.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        }
        let interrupt = recv(signal(SignalKind::interrupt()));
        let terminate = recv(signal(SignalKind::terminate()));
        async move {
            tokio::select! {
                () = interrupt => {}
                () = terminate => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Run the server built by `serve` until a signal, then cancel its token
/// and give it `grace` to finish what is in flight.
pub async fn serve_until_signal<F, E>(
    name: &str,
    grace: Duration,
    serve: impl FnOnce(CancellationToken) -> F,
) -> anyhow::Result<()>
where
    F: Future<Output = Result<(), E>> + Send + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    let signal = signal();
    let stop = CancellationToken::new();
    let mut task = tokio::spawn(serve(stop.clone()));
    tokio::select! {
        result = &mut task => {
            return result.context("server task failed")?.with_context(|| format!("{name} stopped"));
        }
        () = signal => {}
    }
    tracing::info!(
        service = name,
        ?grace,
        "shutting down, draining in-flight work"
    );
    stop.cancel();
    match tokio::time::timeout(grace, &mut task).await {
        Ok(result) => result
            .context("server task failed")?
            .with_context(|| format!("{name} stopped")),
        Err(_) => {
            tracing::warn!(
                service = name,
                "grace period over, stopping with work in flight"
            );
            task.abort();
            Ok(())
        }
    }
}
