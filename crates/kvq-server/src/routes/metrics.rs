//! `GET /metrics`: refreshes the engine gauges, then renders the Prometheus text format.

use crate::metrics::set_engine_gauges;
use crate::state::AppState;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    set_engine_gauges(&state.engine.stats(), &state.registry.names());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
}
