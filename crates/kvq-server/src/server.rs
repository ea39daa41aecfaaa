//! `serve`: runs the router on a bound listener until ctrl-c (or SIGTERM), drains it (see
//! `lifecycle.rs`), and keeps the metrics registry trimmed in the background while it runs.

use crate::routes::router;
use crate::state::AppState;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// How often histogram samples are folded into their buckets between scrapes.
const METRICS_UPKEEP: Duration = Duration::from_secs(5);

/// How long the process may take, after the open streams were cut, to flush them and close.
const CLOSE_AFTER_CUT: Duration = Duration::from_secs(5);

/// How the connections are served.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// How long open requests may run on after the signal.
    pub grace: Duration,
    /// How long a client may take to send a request's headers (slow clients are dropped).
    pub header_timeout: Duration,
    /// Largest request head (request line and headers), in bytes: 431 past it.
    pub max_header_bytes: usize,
    /// Most connections open at once; further ones wait in the listen backlog.
    pub max_connections: usize,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(30),
            header_timeout: Duration::from_secs(10),
            max_header_bytes: 64 * 1024,
            max_connections: 1024,
        }
    }
}

/// Serves `state` on `listener` until ctrl-c / SIGTERM, then drains (`lifecycle.rs`): new
/// requests get 503, the open ones run on for up to `opts.grace`, the streams still open are
/// cut, and it returns once the connections have closed (or `CLOSE_AFTER_CUT` later).
/// Connections are served by hyper's HTTP/1 directly (axum's `serve` does not expose the
/// header limits and timeouts), at most `opts.max_connections` at once.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    opts: ServeOptions,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
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
        crate::lifecycle::drain(&lifecycle, opts.grace, || {
            let s = engine.stats();
            s.running + s.waiting
        })
        .await;
    };
    let cut = state.lifecycle.cut_signal();
    let app = router(state);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(opts.header_timeout)
        // hyper's read buffer bounds the head it parses (431 past it); at least 8 KiB.
        .max_buf_size(opts.max_header_bytes.max(8192));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(opts.max_connections.max(1)));
    tokio::pin!(drained);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p,
            () = &mut drained => break,
        };
        let Ok(permit) = permit else { break };
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait, do not spin or stop.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut drained => break,
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = async {
            cut.await;
            tokio::time::sleep(CLOSE_AFTER_CUT).await;
        } => tracing::warn!("connections still open {CLOSE_AFTER_CUT:?} after the cut: closing"),
    }
    upkeep.abort();
    Ok(())
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
