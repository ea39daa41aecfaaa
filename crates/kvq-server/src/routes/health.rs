//! `GET /health`: liveness plus the queue depth.

use crate::state::AppState;
use axum::Json;
use axum::extract::State;
use serde::Serialize;

/// `{"status": "ok", "model": id, "running": n, "waiting": n}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Health {
    pub status: &'static str,
    pub model: String,
    pub running: usize,
    pub waiting: usize,
}

pub async fn health(State(state): State<AppState>) -> Json<Health> {
    let stats = state.engine.stats();
    Json(Health {
        status: "ok",
        model: state.engine.model_info().id.clone(),
        running: stats.running,
        waiting: stats.waiting,
    })
}
