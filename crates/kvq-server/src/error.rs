//! `ApiError`: every way a request can fail, and the one place that maps an error kind to an
//! HTTP status and an OpenAI-style JSON body (`{"error": {"message", "type", "param", "code"}}`).

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvq_cache::CacheError;
use kvq_engine::EngineError;
use kvq_models::ModelError;
use serde::Serialize;

/// What a request can fail with. `IntoResponse` turns it into the status and JSON body clients see.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// A malformed or out-of-range request (400, `invalid_request_error`).
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
        code: Option<String>,
    },
    /// The `model` field names a model this server does not serve (404, `model_not_found`).
    #[error("The model `{model}` does not exist or you do not have access to it.")]
    ModelNotFound { model: String },
    /// An unknown route or resource (404, `not_found_error`).
    #[error("{0}")]
    NotFound(String),
    /// No API key, or a wrong one, on a server started with keys (401, `invalid_api_key`).
    #[error("{0}")]
    Unauthorized(String),
    /// The route exists but not for this HTTP method (405).
    #[error("{0}")]
    MethodNotAllowed(String),
    /// The body is larger than the server accepts (413, `request_too_large`).
    #[error("{}", too_large_message(*.limit))]
    RequestTooLarge { limit: Option<usize> },
    /// The prompt alone does not fit the context (400, `context_length_exceeded`).
    #[error("{message}")]
    ContextLengthExceeded { message: String, param: String },
    /// prompt + max_tokens does not fit the context (400, param `max_tokens`).
    #[error("{0}")]
    MaxTokensTooLarge(String),
    /// The request's KV cache could never fit the server's budget under its method (400,
    /// param `max_tokens`, code `kv_cache_budget_exceeded`); the message names what it needs,
    /// the budget and the methods that would fit.
    #[error("{0}")]
    KvBudgetExceeded(String),
    /// The wait queue is full; retry shortly (429 with `Retry-After: 1`).
    #[error("{0}")]
    Overloaded(String),
    /// The engine has stopped (503).
    #[error("{0}")]
    Unavailable(String),
    /// The requested KV cache method exists but this server cannot build it: its calibration
    /// failed or its preset is misconfigured (503, no retry hint; `param` names the header).
    #[error("{message}")]
    MethodUnavailable { message: String, param: String },
    /// The request ran past the server's `--request-timeout` (408, `request_timeout`).
    #[error("{0}")]
    Timeout(String),
    /// A bug or an unexpected failure (500).
    #[error("{0}")]
    Internal(String),
}

fn too_large_message(limit: Option<usize>) -> String {
    match limit {
        Some(l) => format!("The request body is too large: the limit is {l} bytes."),
        None => "The request body is too large.".to_string(),
    }
}

/// The inner object of an OpenAI error body.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorObject {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

/// `{"error": {...}}`, the body of every error response and of a mid-stream SSE error event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorBody {
    pub error: ErrorObject,
}

impl ApiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
            code: None,
        }
    }

    /// A 400 `invalid_request_error` with code `unsupported_parameter`: an OpenAI field this
    /// server does not implement (yet), refused rather than ignored.
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
            code: Some("unsupported_parameter".into()),
        }
    }

    /// A 400 `invalid_request_error` that concerns no single parameter.
    pub fn invalid_body(message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// The HTTP status this error is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. }
            | Self::ContextLengthExceeded { .. }
            | Self::MaxTokensTooLarge(_)
            | Self::KvBudgetExceeded(_) => StatusCode::BAD_REQUEST,
            Self::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::ModelNotFound { .. } | Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::RequestTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unavailable(_) | Self::MethodUnavailable { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `type` field.
    pub fn error_type(&self) -> &'static str {
        match self {
            Self::InvalidRequest { .. }
            | Self::Unauthorized(_)
            | Self::Timeout(_)
            | Self::ModelNotFound { .. }
            | Self::MethodNotAllowed(_)
            | Self::RequestTooLarge { .. }
            | Self::ContextLengthExceeded { .. }
            | Self::MaxTokensTooLarge(_)
            | Self::KvBudgetExceeded(_) => "invalid_request_error",
            Self::NotFound(_) => "not_found_error",
            Self::Overloaded(_)
            | Self::Unavailable(_)
            | Self::MethodUnavailable { .. }
            | Self::Internal(_) => "server_error",
        }
    }

    /// OpenAI's `param` field: the request parameter at fault, if one is.
    pub fn param(&self) -> Option<&str> {
        match self {
            Self::InvalidRequest { param, .. } => param.as_deref(),
            Self::ModelNotFound { .. } => Some("model"),
            Self::ContextLengthExceeded { param, .. } | Self::MethodUnavailable { param, .. } => {
                Some(param)
            }
            Self::MaxTokensTooLarge(_) | Self::KvBudgetExceeded(_) => Some("max_tokens"),
            _ => None,
        }
    }

    /// OpenAI's `code` field.
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::InvalidRequest { code, .. } => code.as_deref(),
            Self::ModelNotFound { .. } => Some("model_not_found"),
            Self::Unauthorized(_) => Some("invalid_api_key"),
            Self::Timeout(_) => Some("request_timeout"),
            Self::NotFound(_) => Some("not_found"),
            Self::MethodNotAllowed(_) => Some("method_not_allowed"),
            Self::RequestTooLarge { .. } => Some("request_too_large"),
            Self::ContextLengthExceeded { .. } => Some("context_length_exceeded"),
            Self::MaxTokensTooLarge(_) => Some("max_tokens_too_large"),
            Self::KvBudgetExceeded(_) => Some("kv_cache_budget_exceeded"),
            Self::Overloaded(_) => Some("overloaded"),
            Self::Unavailable(_) => Some("unavailable"),
            Self::MethodUnavailable { .. } => Some("kv_cache_method_unavailable"),
            Self::Internal(_) => Some("internal_error"),
        }
    }

    /// Whether a client should retry after a second (sent as `Retry-After: 1`).
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            Self::Overloaded(_) | Self::Unavailable(_) => Some(1),
            _ => None,
        }
    }

    /// The JSON body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorObject {
                message: self.to_string(),
                kind: self.error_type().to_string(),
                param: self.param().map(str::to_string),
                code: self.code().map(str::to_string),
            },
        }
    }

    /// Maps an engine error. `prompt_param` names the field holding the prompt: `messages` for
    /// chat, `prompt` for completions.
    pub fn from_engine(err: EngineError, prompt_param: &str) -> Self {
        match err {
            EngineError::ContextLengthExceeded { .. } => Self::ContextLengthExceeded {
                message: err.to_string(),
                param: prompt_param.to_string(),
            },
            EngineError::MaxTokensTooLarge { .. } => Self::MaxTokensTooLarge(err.to_string()),
            EngineError::InvalidParameter { param, message } => Self::invalid(param, message),
            EngineError::EmptyPrompt => Self::invalid(prompt_param, err.to_string()),
            EngineError::ExceedsBudget { .. } => Self::KvBudgetExceeded(err.to_string()),
            EngineError::Overloaded(_) => Self::Overloaded(err.to_string()),
            EngineError::Shutdown => Self::Unavailable(err.to_string()),
            EngineError::Cache(_) | EngineError::Internal(_) => Self::Internal(err.to_string()),
        }
    }

    /// Maps a cache error. `param` names where the method came from (`x-kv-cache-method` or
    /// `kv_cache.method`): a bad choice is a 400, a method the server cannot build (calibration,
    /// preset) a 503.
    pub fn from_cache(err: CacheError, param: &str) -> Self {
        match err {
            CacheError::UnknownMethod { .. } | CacheError::InvalidBits { .. } => {
                Self::invalid(param, err.to_string())
            }
            CacheError::Calibration(_) | CacheError::Preset { .. } => Self::MethodUnavailable {
                message: format!("This server cannot run the requested kv cache method: {err}"),
                param: param.to_string(),
            },
            other => Self::Internal(format!("kv cache: {other}")),
        }
    }

    /// Maps a model error: template and tokenizer failures are the request's fault (400).
    pub fn from_model(err: ModelError, param: &str) -> Self {
        match err {
            ModelError::Template(_) | ModelError::Tokenizer(_) => {
                Self::invalid(param, err.to_string())
            }
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(err: EngineError) -> Self {
        Self::from_engine(err, "messages")
    }
}

impl From<CacheError> for ApiError {
    fn from(err: CacheError) -> Self {
        Self::from_cache(err, crate::cache_select::HEADER_METHOD)
    }
}

impl From<ModelError> for ApiError {
    fn from(err: ModelError) -> Self {
        Self::from_model(err, "messages")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() && status != StatusCode::SERVICE_UNAVAILABLE {
            tracing::error!(error = %self, "request failed");
        } else {
            tracing::debug!(status = status.as_u16(), error = %self, "request rejected");
        }
        let mut response = (status, Json(self.body())).into_response();
        if matches!(self, Self::Unauthorized(_)) {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(secs) = self.retry_after() {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn json_of(err: ApiError) -> (StatusCode, axum::http::HeaderMap, serde_json::Value) {
        let resp = err.into_response();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap_or_default();
        let value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        (status, headers, value)
    }

    #[tokio::test]
    async fn error_json_shape() {
        let (status, headers, v) = json_of(ApiError::invalid("temperature", "too hot")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(
            headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
            Some("application/json")
        );
        assert_eq!(
            v,
            serde_json::json!({"error": {"message": "too hot", "type": "invalid_request_error", "param": "temperature", "code": null}})
        );
    }

    #[tokio::test]
    async fn model_not_found_is_404() {
        let (status, _, v) = json_of(ApiError::ModelNotFound {
            model: "gpt-9".into(),
        })
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "model");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("gpt-9"))
        );
    }

    #[tokio::test]
    async fn overloaded_has_retry_after() {
        let err = ApiError::from_engine(EngineError::Overloaded("queue full".into()), "messages");
        let (status, headers, v) = json_of(err).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            headers
                .get(header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok()),
            Some("1")
        );
        assert_eq!(v["error"]["type"], "server_error");
        assert_eq!(v["error"]["code"], "overloaded");
    }

    #[tokio::test]
    async fn too_large_is_413() {
        let (status, _, v) = json_of(ApiError::RequestTooLarge { limit: Some(10) }).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(v["error"]["code"], "request_too_large");
    }

    #[test]
    fn engine_errors_map() {
        let e = ApiError::from_engine(
            EngineError::ContextLengthExceeded {
                prompt: 9000,
                max: 8192,
            },
            "prompt",
        );
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.param(), Some("prompt"));
        assert_eq!(e.code(), Some("context_length_exceeded"));

        let e = ApiError::from_engine(
            EngineError::MaxTokensTooLarge {
                prompt: 10,
                max: 100,
                requested: 1000,
            },
            "messages",
        );
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.param(), Some("max_tokens"));

        let e = ApiError::from_engine(EngineError::Internal("boom".into()), "messages");
        assert_eq!(e.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let e = ApiError::from_engine(EngineError::Shutdown, "messages");
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn cache_errors_map() {
        let e = ApiError::from_cache(
            CacheError::UnknownMethod {
                name: "zip".into(),
                valid: vec!["fp16".into(), "qjl".into()],
            },
            "kv_cache.method",
        );
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.param(), Some("kv_cache.method"));
        assert!(e.to_string().contains("fp16, qjl"));
        let e = ApiError::from_cache(CacheError::Shape("bad".into()), "x-kv-cache-method");
        assert_eq!(e.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let e = ApiError::from_cache(
            CacheError::Calibration("the capture failed".into()),
            "x-kv-cache-method",
        );
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.retry_after(), None);
        assert_eq!(
            (e.error_type(), e.param(), e.code()),
            (
                "server_error",
                Some("x-kv-cache-method"),
                Some("kv_cache_method_unavailable")
            )
        );
        assert!(e.to_string().contains("the capture failed"), "{e}");
    }

    #[test]
    fn model_errors_map() {
        let e = ApiError::from_model(
            ModelError::Template("roles must alternate".into()),
            "messages",
        );
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.param(), Some("messages"));
        let e = ApiError::from_model(ModelError::Invalid("x".into()), "messages");
        assert_eq!(e.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
