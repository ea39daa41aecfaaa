//! Graceful shutdown. On SIGTERM or ctrl-c the server drains: every new request is answered 503
//! (with `Retry-After`, so a load balancer or client goes elsewhere), the requests in flight
//! run on for up to the shutdown grace, then the streams still open are cut (an SSE error event
//! and `[DONE]`, their sequences freed), the listener closes and the process exits 0.

use crate::error::ApiError;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::watch;

/// Whether the server drains, and the signal that cuts the streams still open.
#[derive(Debug)]
pub struct Lifecycle {
    draining: AtomicBool,
    cut: watch::Sender<bool>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            draining: AtomicBool::new(false),
            cut: watch::Sender::new(false),
        }
    }
}

impl Lifecycle {
    /// Whether new requests are refused.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Refuse new requests from now on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Ends every open stream (each resolves its [`Self::cut_signal`]).
    pub fn cut_streams(&self) {
        self.cut.send_replace(true);
    }

    /// Resolves when the open streams are cut; never, if they are not.
    pub fn cut_signal(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.cut.subscribe();
        async move {
            if rx.wait_for(|cut| *cut).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Middleware: 503 for every request while the server drains.
pub async fn refuse_while_draining(
    State(lifecycle): State<Arc<Lifecycle>>,
    req: Request,
    next: Next,
) -> Response {
    match lifecycle.is_draining() {
        true => ApiError::Unavailable(
            "The server is shutting down and takes no new requests; retry on another replica \
             or after it restarts."
                .into(),
        )
        .into_response(),
        false => next.run(req).await,
    }
}

/// What happens after the signal: drain while `busy()` says requests are in flight, for at
/// most `grace`, then cut the streams still open. Returns when the listener may close.
pub async fn drain(lifecycle: &Lifecycle, grace: Duration, busy: impl Fn() -> usize) {
    lifecycle.start_draining();
    let n = busy();
    tracing::info!(
        in_flight = n,
        grace_s = grace.as_secs_f64(),
        "shutting down: new requests get 503, open ones may finish"
    );
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        let n = busy();
        if n == 0 {
            tracing::info!("drained");
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(
                in_flight = n,
                "shutdown grace over: ending the open streams with an error event"
            );
            lifecycle.cut_streams();
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[tokio::test]
    async fn drains_until_idle_or_cuts_at_the_grace() {
        let l = Lifecycle::default();
        assert!(!l.is_draining());
        drain(&l, Duration::from_secs(5), || 0).await;
        assert!(l.is_draining());
        let mut cut = Box::pin(l.cut_signal());
        assert!(
            futures::poll!(&mut cut).is_pending(),
            "idle: nothing was cut"
        );

        let l = Lifecycle::default();
        let polls = AtomicUsize::new(0);
        let start = tokio::time::Instant::now();
        let signal = l.cut_signal();
        drain(&l, Duration::from_millis(200), || {
            polls.fetch_add(1, Ordering::SeqCst);
            1
        })
        .await;
        assert!(start.elapsed() >= Duration::from_millis(200));
        assert!(polls.load(Ordering::SeqCst) >= 3);
        // Cut: a signal taken before and one taken after both resolve.
        tokio::time::timeout(Duration::from_secs(1), signal)
            .await
            .expect("cut");
        tokio::time::timeout(Duration::from_secs(1), l.cut_signal())
            .await
            .expect("cut after");
    }
}
