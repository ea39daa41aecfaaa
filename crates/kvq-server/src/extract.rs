//! `ApiJson<T>`: the JSON body extractor. Unlike axum's `Json` it answers every rejection with an
//! OpenAI-style `ApiError` (400 with the offending `param`, 413 past the body limit), and parses
//! the body even without a JSON `Content-Type` (curl users forget it).

use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::header;
use serde::de::DeserializeOwned;

/// The body limit in force, inserted into request extensions by [`crate::router`] so the
/// extractor can name it in its 413 message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyLimit(pub usize);

/// A JSON body parsed into `T`; every failure is an [`ApiError`].
#[derive(Debug, Clone)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let limit = req.extensions().get::<BodyLimit>().map(|l| l.0);
        let Some(limit) = limit else {
            let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
                ApiError::invalid_body(format!("Could not read the request body: {rejection}"))
            })?;
            return parse_json(&bytes).map(ApiJson);
        };
        let declared = content_length(&req);
        let bytes = read_limited(req.into_body(), limit, declared).await?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// The most of an oversized body read and thrown away before answering 413, and for how
/// long: a client that writes its whole body before reading the answer (Python's http.client,
/// most simple clients) then gets the 413 instead of a reset connection, as nginx's lingering
/// close does. A body larger still is cut off (the connection closes).
const DRAIN_BYTES: usize = 64 << 20;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads `body` up to `limit` bytes. Past the limit (or when `declared` already says so) the
/// rest is drained, within `DRAIN_BYTES` and `DRAIN_TIME`, and the answer is a 413.
async fn read_limited(
    body: axum::body::Body,
    limit: usize,
    declared: Option<usize>,
) -> Result<Bytes, ApiError> {
    use futures::StreamExt;
    let mut frames = body.into_data_stream();
    let mut buf = Vec::with_capacity(declared.unwrap_or(0).min(limit));
    let mut seen = 0usize;
    let too_large = || ApiError::RequestTooLarge { limit: Some(limit) };
    if declared.is_none_or(|n| n <= limit) {
        while let Some(frame) = frames.next().await {
            let frame = frame.map_err(|e| {
                ApiError::invalid_body(format!("Could not read the request body: {e}"))
            })?;
            seen += frame.len();
            if seen > limit {
                break;
            }
            buf.extend_from_slice(&frame);
        }
        if seen <= limit {
            return Ok(Bytes::from(buf));
        }
    }
    if declared.is_some_and(|n| n > DRAIN_BYTES) {
        return Err(too_large());
    }
    let drain = async {
        while let Some(Ok(frame)) = frames.next().await {
            seen += frame.len();
            if seen > DRAIN_BYTES {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIME, drain).await;
    Err(too_large())
}

fn content_length(req: &Request) -> Option<usize> {
    req.headers()
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Parses `bytes` as JSON into `T`, naming the offending field (`param`) on a type error.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid_body(
            "The request body is empty; expected a JSON object.",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        json_error(&path, &inner)
    })?;
    de.end().map_err(|e| json_error(".", &e))?;
    Ok(value)
}

fn json_error(path: &str, err: &serde_json::Error) -> ApiError {
    use serde_json::error::Category;
    match err.classify() {
        Category::Syntax | Category::Eof | Category::Io => ApiError::invalid_body(format!(
            "We could not parse the JSON body of your request: {err}. The body must be a valid JSON object."
        )),
        Category::Data => {
            let message = err.to_string();
            let param = data_error_param(path, &message);
            let text = match &param {
                Some(p) => format!("Invalid value for '{p}': {message}"),
                None => format!("Invalid request body: {message}"),
            };
            ApiError::InvalidRequest {
                message: text,
                param,
                code: None,
            }
        }
    }
}

/// The parameter a serde data error concerns: its path, plus the field a "missing field" names.
fn data_error_param(path: &str, message: &str) -> Option<String> {
    let missing = message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split('`').next())
        .filter(|f| !f.is_empty());
    let path = (path != "." && !path.is_empty()).then_some(path);
    match (path, missing) {
        (Some(p), Some(f)) => Some(format!("{p}.{f}")),
        (None, Some(f)) => Some(f.to_string()),
        (Some(p), None) => Some(p.to_string()),
        (None, None) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        role: String,
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Body {
        temperature: Option<f64>,
        max_tokens: Option<i64>,
        messages: Option<Vec<Inner>>,
    }

    fn param_of(json: &str) -> Option<String> {
        match parse_json::<Body>(json.as_bytes()) {
            Err(ApiError::InvalidRequest { param, .. }) => param,
            other => panic!("expected InvalidRequest, got {other:?}"),
        }
    }

    #[test]
    fn syntax_error_is_400_without_param() {
        let err = parse_json::<Body>(b"{\"temperature\": ").unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        assert_eq!(err.param(), None);
        let err = parse_json::<Body>(b"{} trailing").unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        let err = parse_json::<Body>(b"").unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn wrong_types_name_the_field() {
        assert_eq!(
            param_of(r#"{"temperature": "hot"}"#).as_deref(),
            Some("temperature")
        );
        assert_eq!(
            param_of(r#"{"messages": "hi"}"#).as_deref(),
            Some("messages")
        );
        assert_eq!(
            param_of(r#"{"max_tokens": 1.5}"#).as_deref(),
            Some("max_tokens")
        );
        assert_eq!(
            param_of(r#"{"messages": [{"role": 5}]}"#).as_deref(),
            Some("messages[0].role")
        );
        assert_eq!(
            param_of(r#"{"messages": [{}]}"#).as_deref(),
            Some("messages[0].role")
        );
    }

    #[test]
    fn invalid_utf8_is_400() {
        let err = parse_json::<Body>(b"{\"messages\": [{\"role\": \"\xff\"}]}").unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn non_object_is_400() {
        let err = parse_json::<Body>(b"[1, 2]").unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn valid_body_parses() {
        let b: Body = parse_json(br#"{"temperature": 0.5, "unknown": {"a": 1}}"#).unwrap();
        assert_eq!(b.temperature, Some(0.5));
    }
}
