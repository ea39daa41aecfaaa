//! Router-level tests that need no engine: JSON 404/405, the 413 body limit, bodies without a
//! JSON content type, wrong types answered 400 (never axum's plain-text 415/422), panics as 500.

use super::*;
use crate::extract::ApiJson;
use crate::openai::ChatCompletionRequest;
use axum::Json;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use serde_json::{Value, json};
use tower::ServiceExt;

const LIMIT: usize = 1024;

async fn echo(ApiJson(req): ApiJson<ChatCompletionRequest>) -> Json<Value> {
    Json(json!({"temperature": req.temperature}))
}

async fn boom() -> &'static str {
    panic!("boom")
}

fn app() -> Router {
    let routes = Router::new()
        .route("/echo", post(echo))
        .route("/boom", get(boom));
    with_layers(routes, LIMIT)
}

async fn send(req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, Value) {
    let resp = app().oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, headers, body)
}

fn post_json(body: impl Into<Body>, content_type: Option<&str>) -> Request<Body> {
    let mut b = Request::post("/echo");
    if let Some(ct) = content_type {
        b = b.header(header::CONTENT_TYPE, ct);
    }
    b.body(body.into()).unwrap()
}

#[tokio::test]
async fn unknown_route_is_json_404() {
    let (status, _, body) = send(Request::get("/nope").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"]["type"], "not_found_error");
    assert!(body["error"]["message"].as_str().unwrap().contains("/nope"));
}

#[tokio::test]
async fn wrong_method_is_json_405() {
    let (status, _, body) = send(Request::get("/echo").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(body["error"]["code"], "method_not_allowed");
}

#[tokio::test]
async fn json_without_content_type_is_accepted() {
    let (status, _, body) = send(post_json(r#"{"temperature": 0.5}"#, None)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["temperature"], 0.5);
    let (status, _, _) = send(post_json(r#"{"temperature": 0.5}"#, Some("text/plain"))).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn bad_json_is_400() {
    for bad in [
        &b"{"[..],
        b"not json",
        b"",
        b"{\"temperature\": \"hot\"}",
        b"\xff\xfe",
    ] {
        let (status, _, body) = send(post_json(bad.to_vec(), Some("application/json"))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad:?}: {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
    let (_, _, body) = send(post_json(r#"{"temperature": "hot"}"#, None)).await;
    assert_eq!(body["error"]["param"], "temperature");
}

#[tokio::test]
async fn oversized_body_is_json_413() {
    let big = format!(r#"{{"user": "{}"}}"#, "x".repeat(LIMIT * 2));
    let (status, _, body) = send(post_json(big.clone(), Some("application/json"))).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(body["error"]["code"], "request_too_large");

    // Without a Content-Length (a streamed body), the limit still answers in JSON.
    let chunks: Vec<Result<String, std::io::Error>> = vec![Ok(big)];
    let streamed = Body::from_stream(futures::stream::iter(chunks));
    let (status, _, body) = send(post_json(streamed, None)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(body["error"]["code"], "request_too_large");
}

#[tokio::test]
async fn panic_is_json_500() {
    let (status, _, body) = send(Request::get("/boom").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(body["error"]["type"], "server_error");
}

#[test]
fn install_metrics_is_idempotent() {
    let a = crate::install_metrics();
    let b = crate::install_metrics();
    ::metrics::counter!("kvq_test_counter_total").increment(1);
    assert!(a.render().contains("kvq_test_counter_total"));
    assert!(b.render().contains("kvq_test_counter_total"));
}
