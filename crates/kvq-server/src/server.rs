//! `serve`: runs the router on a bound listener until ctrl-c (or SIGTERM), drains it (see
//! `lifecycle.rs`), and keeps the metrics registry trimmed in the background while it runs.

use crate::routes::router;
use crate::state::AppState;
use std::time::Duration;
use tokio::net::TcpListener;

/// How often histogram samples are folded into their buckets between scrapes.
const METRICS_UPKEEP: Duration = Duration::from_secs(5);

/// How long the process may take, after the open streams were cut, to flush them and close.
const CLOSE_AFTER_CUT: Duration = Duration::from_secs(5);

/// Serves `state` on `listener` until ctrl-c / SIGTERM, then drains (`lifecycle.rs`): new
/// requests get 503, the open ones run on for up to `grace`, the streams still open are cut,
/// and it returns once the connections have closed (or `CLOSE_AFTER_CUT` later).
pub async fn serve(listener: TcpListener, state: AppState, grace: Duration) -> std::io::Result<()> {
    let handle = state.metrics.clone();
    let upkeep = tokio::spawn(async move {
        let mut tick = tokio::time::interval(METRICS_UPKEEP);
        loop {
            tick.tick().await;
            handle.run_upkeep();
        }
    });
    let (lifecycle, engine) = (state.lifecycle.clone(), state.engine.clone());
    let drained = async move {
        shutdown_signal().await;
        crate::lifecycle::drain(&lifecycle, grace, || {
            let s = engine.stats();
            s.running + s.waiting
        })
        .await;
    };
    let cut = state.lifecycle.cut_signal();
    let server = axum::serve(listener, router(state)).with_graceful_shutdown(drained);
    let result = tokio::select! {
        r = server => r,
        () = async {
            cut.await;
            tokio::time::sleep(CLOSE_AFTER_CUT).await;
        } => {
            tracing::warn!("connections still open {CLOSE_AFTER_CUT:?} after the cut: closing");
            Ok(())
        }
    };
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
}
