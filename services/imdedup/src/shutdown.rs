//! Serve until SIGINT or SIGTERM, then drain within a grace period.

use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

/// Resolves on Ctrl-C or SIGTERM (what Kubernetes sends).
pub async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
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
    let stop = CancellationToken::new();
    let mut task = tokio::spawn(serve(stop.clone()));
    tokio::select! {
        result = &mut task => {
            return result.context("server task failed")?.with_context(|| format!("{name} stopped"));
        }
        () = signal() => {}
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
