//! `serve`: runs the router on a bound listener until ctrl-c (or SIGTERM), with graceful
//! shutdown, and keeps the metrics registry trimmed in the background while it runs.

use crate::routes::router;
use crate::state::AppState;
use std::time::Duration;
use tokio::net::TcpListener;

/// How often histogram samples are folded into their buckets between scrapes.
const METRICS_UPKEEP: Duration = Duration::from_secs(5);

/// Serves `state` on `listener` until ctrl-c / SIGTERM, then stops accepting and lets the
/// open requests finish.
pub async fn serve(listener: TcpListener, state: AppState) -> std::io::Result<()> {
    let handle = state.metrics.clone();
    let upkeep = tokio::spawn(async move {
        let mut tick = tokio::time::interval(METRICS_UPKEEP);
        loop {
            tick.tick().await;
            handle.run_upkeep();
        }
    });
    let result = axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown_signal())
        .await;
    upkeep.abort();
    result
}

/// Resolves on ctrl-c or (on Unix) SIGTERM. If a signal handler cannot be installed, that
/// signal is simply never awaited.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutting down: finishing open requests");
}
