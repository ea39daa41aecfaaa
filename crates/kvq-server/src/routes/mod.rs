//! The HTTP surface: `router` wires every endpoint, the body limit, request metrics, tracing
//! and panic catching; plus the JSON 404/405 fallbacks and helpers the handlers share.

pub mod chat;
pub mod completions;
pub mod health;
pub mod metrics;
pub mod models;
#[cfg(test)]
mod tests;

use crate::cache_select::HEADER_METHOD;
use crate::error::ApiError;
use crate::extract::BodyLimit;
use crate::state::AppState;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderValue, Method, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::TraceLayer;

/// Every route, with the body limit from `state.limits`, `kvq_requests_total` counting,
/// request tracing, a JSON 500 for a handler that panics, the API keys of `state.access` on
/// the `/v1` routes (and `/metrics` if asked), and 503 for everything while the server drains.
pub fn router(state: AppState) -> Router {
    let limit = state.limits.max_body_bytes;
    let mut keyed = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(models::list_models))
        .route("/v1/models/{*id}", get(models::get_model));
    let mut open = Router::new().route("/health", get(health::health));
    let metrics = get(metrics::metrics);
    match state.access.metrics_need_key {
        true => keyed = keyed.route("/metrics", metrics),
        false => open = open.route("/metrics", metrics),
    }
    if let Some(keys) = &state.access.keys {
        keyed = keyed.route_layer(axum::middleware::from_fn_with_state(
            keys.clone(),
            crate::auth::require_key,
        ));
    }
    let routes = keyed
        .merge(open)
        .layer(axum::middleware::from_fn_with_state(
            state.lifecycle.clone(),
            crate::lifecycle::refuse_while_draining,
        ));
    with_layers(routes, limit).with_state(state)
}

/// The JSON 404/405 fallbacks and the layers every route gets (body limit, metrics, panic
/// catching, tracing). Separate from `router` so it can be tested without an engine.
pub fn with_layers<S>(routes: Router<S>, max_body_bytes: usize) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::Extension(BodyLimit(max_body_bytes)))
        .layer(axum::middleware::from_fn(crate::metrics::track_requests))
        .layer(CatchPanicLayer::custom(panic_response))
        .layer(TraceLayer::new_for_http())
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound(format!("Invalid URL ({method} {})", uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!("Method {method} is not allowed for {}", uri.path()))
}

fn panic_response(panic: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let detail = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("unknown panic");
    tracing::error!(panic = detail, "a request handler panicked");
    ApiError::Internal("The server hit an internal error while handling this request.".into())
        .into_response()
}

/// The SSE response shared by chat and completions: the writer's opening chunk (`echo` text for
/// completions), every choice's events merged, usage recorded as choices finish, and the
/// resolved cache method in the `x-kv-cache-method` header; `stop` ends it early with its error.
#[allow(clippy::too_many_arguments)]
pub fn stream_response(
    kind: crate::sse::StreamKind,
    meta: crate::sse::StreamMeta,
    params: &crate::validate::ValidatedParams,
    rxs: Vec<kvq_engine::GenerationStream>,
    echo: Option<&str>,
    cache_method: &str,
    tools: Option<crate::tool_calls::ToolMode>,
    stop: impl std::future::Future<Output = ApiError> + Send + 'static,
) -> Response {
    let mut writer = crate::sse::ChunkWriter::new(
        kind,
        meta,
        params.n,
        params.include_usage,
        params.logprobs.is_some(),
    )
    .with_tools(tools);
    let opening = writer.opening(echo);
    let stream = crate::sse::sse_stream(
        crate::generation::merge(rxs),
        writer,
        opening,
        crate::generation::record_finished,
        stop,
    );
    with_cache_header(crate::sse::into_sse(stream).into_response(), cache_method)
}

/// What ends a generation early, as the error it ends with (a stream's last event, or the
/// answer of a non-streaming request): the shutdown grace running out (503) or the server's
/// `--request-timeout` (408). Dropping the generation then frees its sequences.
pub fn stop_signal(
    state: &AppState,
) -> impl std::future::Future<Output = ApiError> + Send + 'static {
    let cut = state.lifecycle.cut_signal();
    let timeout = state.limits.request_timeout;
    async move {
        let timed_out = async {
            match timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = cut => ApiError::Unavailable(
                "The server is shutting down: this request was still running when its \
                 shutdown grace period ended."
                    .into(),
            ),
            () = timed_out => ApiError::Timeout(format!(
                "The request ran past the server's limit of {:.0} s (--request-timeout); ask \
                 for fewer tokens.",
                timeout.map_or(0.0, |t| t.as_secs_f64())
            )),
        }
    }
}

/// Adds `x-kv-cache-method: <name>` to a response.
pub fn with_cache_header(mut response: Response, method: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(method) {
        response.headers_mut().insert(HEADER_METHOD, v);
    }
    response
}

/// Runs template rendering / tokenization off the async threads (long prompts take a while).
pub async fn tokenize_blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(format!("tokenization task failed: {e}")))?
}
