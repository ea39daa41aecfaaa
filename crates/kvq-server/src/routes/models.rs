//! `GET /v1/models` and `GET /v1/models/{id}`: the one served model.

use crate::error::ApiError;
use crate::openai::{ModelCard, ModelList};
use crate::state::AppState;
use axum::Json;
use axum::extract::{Path, State};
use std::sync::OnceLock;

/// When this process first described its model (OpenAI's `created`).
fn created() -> u64 {
    static CREATED: OnceLock<u64> = OnceLock::new();
    *CREATED.get_or_init(crate::generation::unix_now)
}

/// The card of the served model.
pub fn model_card(id: &str) -> ModelCard {
    ModelCard {
        id: id.to_string(),
        object: "model",
        created: created(),
        owned_by: "kvq",
    }
}

pub async fn list_models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![model_card(&state.engine.model_info().id)],
    })
}

pub async fn get_model(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    let served = &state.engine.model_info().id;
    if id.eq_ignore_ascii_case(served) {
        Ok(Json(model_card(served)))
    } else {
        Err(ApiError::ModelNotFound { model: id })
    }
}
