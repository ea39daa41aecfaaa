//! A corpus of malformed HTTP requests against the real `kvq serve` binary over raw TCP (so that
//! bytes no HTTP client would send reach it): bad JSON, wrong types, NaN and huge numbers, invalid
//! UTF-8 in bodies and header values, duplicate keys, deep nesting, huge stop lists, unknown
//! fields. Every one is answered with a 4xx and OpenAI's error shape; the server logs no panic,
//! gives no 5xx, and answers a normal request afterwards.

use kvq_tests::default_gguf;
use kvq_tests::server::Server;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const OK_MSGS: &str = r#""messages": [{"role": "user", "content": "hi"}]"#;

/// One malformed request: a name, the method and path, extra header lines (raw bytes) and the body.
struct Case {
    name: String,
    method: &'static str,
    path: &'static str,
    headers: Vec<Vec<u8>>,
    body: Vec<u8>,
}

fn case(name: &str, path: &'static str, body: impl Into<Vec<u8>>) -> Case {
    Case {
        name: name.to_string(),
        method: "POST",
        path,
        headers: Vec::new(),
        body: body.into(),
    }
}

/// A chat body with `field: value` added to a valid request.
fn chat_with(name: &str, field_and_value: &str) -> Case {
    case(name, CHAT, format!("{{{OK_MSGS}, {field_and_value}}}"))
}

fn completion_with(name: &str, field_and_value: &str) -> Case {
    case(
        name,
        COMPLETIONS,
        format!(r#"{{"prompt": "hi", {field_and_value}}}"#),
    )
}

fn with_header(mut c: Case, header: &[u8]) -> Case {
    c.headers.push(header.to_vec());
    c
}

fn corpus() -> Vec<Case> {
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let many_stops = |n: usize| {
        let list: Vec<String> = (0..n).map(|i| format!("\"s{i}\"")).collect();
        format!("\"stop\": [{}]", list.join(","))
    };
    let mut c = vec![
        // Not JSON, or not one object.
        case("empty body", CHAT, ""),
        case("whitespace body", CHAT, "  \n\t "),
        case("truncated object", CHAT, r#"{"messages": [{"role": "us"#),
        case("array body", CHAT, "[]"),
        case("string body", CHAT, r#""hello""#),
        case("null body", CHAT, "null"),
        case("number body", CHAT, "42"),
        case("trailing garbage", CHAT, format!("{{{OK_MSGS}}} trailing")),
        case("two objects", CHAT, format!("{{{OK_MSGS}}}{{{OK_MSGS}}}")),
        case("byte order mark", CHAT, format!("\u{feff}{{{OK_MSGS}}}")),
        case("single quotes", CHAT, "{'messages': []}"),
        case("trailing comma", CHAT, format!("{{{OK_MSGS},}}")),
        case("comment", CHAT, format!("{{/* c */ {OK_MSGS}}}")),
        case("unquoted key", CHAT, "{messages: []}"),
        // Invalid UTF-8 and bad escapes.
        case(
            "invalid utf-8 in a string",
            CHAT,
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
        ),
        case(
            "invalid utf-8 outside strings",
            CHAT,
            b"{\"messages\": \xc3\x28}".to_vec(),
        ),
        case(
            "overlong utf-8",
            CHAT,
            b"{\"model\": \"\xc0\xaf\", \"messages\": []}".to_vec(),
        ),
        case(
            "lone surrogate escape",
            CHAT,
            r#"{"messages": [{"role": "user", "content": "\ud800"}]}"#,
        ),
        case(
            "bad escape",
            CHAT,
            r#"{"messages": [{"role": "user", "content": "\q"}]}"#,
        ),
        case(
            "control character in string",
            CHAT,
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"a\x01b\"}]}".to_vec(),
        ),
        // NaN, infinities and huge numbers.
        chat_with("NaN literal", r#""temperature": NaN"#),
        chat_with("Infinity literal", r#""temperature": Infinity"#),
        chat_with("number past f64", r#""temperature": 1e400"#),
        chat_with("huge temperature", r#""temperature": 1e308"#),
        chat_with("negative temperature", r#""temperature": -1"#),
        chat_with("top_p above 1", r#""top_p": 2"#),
        chat_with("negative top_p", r#""top_p": -0.5"#),
        chat_with("negative max_tokens", r#""max_tokens": -1"#),
        chat_with(
            "max_tokens past u64",
            r#""max_tokens": 99999999999999999999999"#,
        ),
        chat_with("fractional max_tokens", r#""max_tokens": 1.5"#),
        chat_with("max_tokens as exponent", r#""max_tokens": 1e20"#),
        chat_with("huge n", r#""n": 1000000"#),
        chat_with("zero n", r#""n": 0"#),
        chat_with(
            "frequency_penalty out of range",
            r#""frequency_penalty": 5"#,
        ),
        chat_with("presence_penalty out of range", r#""presence_penalty": -3"#),
        chat_with(
            "top_logprobs out of range",
            r#""logprobs": true, "top_logprobs": 50"#,
        ),
        chat_with("top_logprobs without logprobs", r#""top_logprobs": 2"#),
        chat_with("fractional seed", r#""seed": 1.5"#),
        // Wrong types.
        chat_with("temperature as string", r#""temperature": "hot""#),
        chat_with("max_tokens as string", r#""max_tokens": "10""#),
        chat_with("max_tokens as bool", r#""max_tokens": true"#),
        chat_with("stream as string", r#""stream": "yes""#),
        chat_with(
            "stream_options as array",
            r#""stream": true, "stream_options": [1]"#,
        ),
        chat_with("logprobs as string", r#""logprobs": "x""#),
        chat_with("seed as string", r#""seed": "abc""#),
        chat_with("stop as number", r#""stop": 5"#),
        chat_with("stop list of numbers", r#""stop": [1, 2]"#),
        chat_with("stop as object", r#""stop": {"a": 1}"#),
        chat_with("model as number", r#""model": 5"#),
        chat_with("unknown model", r#""model": "no-such-model""#),
        chat_with(
            "kv_cache unknown method",
            r#""kv_cache": {"method": "no-such-method"}"#,
        ),
        chat_with(
            "kv_cache bad bits",
            r#""kv_cache": {"method": "qjl", "bits": 99}"#,
        ),
        chat_with("kv_cache as number", r#""kv_cache": 5"#),
        // Huge stop lists.
        chat_with("five stop strings", &many_stops(5)),
        chat_with("ten thousand stop strings", &many_stops(10_000)),
        chat_with(
            "a stop string of 100 KB",
            &format!("\"stop\": \"{}\"", "x".repeat(100_000)),
        ),
        // Messages.
        case("no messages", CHAT, r#"{"model": "x"}"#),
        case("messages as string", CHAT, r#"{"messages": "hi"}"#),
        case("empty messages", CHAT, r#"{"messages": []}"#),
        case("message as number", CHAT, r#"{"messages": [1]}"#),
        case("message without role", CHAT, r#"{"messages": [{}]}"#),
        case(
            "unknown role",
            CHAT,
            r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#,
        ),
        case(
            "role as number",
            CHAT,
            r#"{"messages": [{"role": 5, "content": "hi"}]}"#,
        ),
        case(
            "content as number",
            CHAT,
            r#"{"messages": [{"role": "user", "content": 5}]}"#,
        ),
        case(
            "content as object",
            CHAT,
            r#"{"messages": [{"role": "user", "content": {"a": 1}}]}"#,
        ),
        case(
            "image content part",
            CHAT,
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}"#,
        ),
        case(
            "text part without text",
            CHAT,
            r#"{"messages": [{"role": "user", "content": [{"type": "text"}]}]}"#,
        ),
        // Duplicate keys, deep nesting, unknown fields.
        case(
            "duplicate messages key",
            CHAT,
            format!("{{{OK_MSGS}, {OK_MSGS}}}"),
        ),
        chat_with("duplicate model key", r#""model": "a", "model": "b""#),
        case(
            "duplicate key in a message",
            CHAT,
            r#"{"messages": [{"role": "user", "role": "user", "content": "hi"}]}"#,
        ),
        case(
            "deeply nested content",
            CHAT,
            format!(
                r#"{{"messages": [{{"role": "user", "content": {}}}]}}"#,
                deep(100_000)
            ),
        ),
        chat_with("deeply nested stop", &format!("\"stop\": {}", deep(5_000))),
        chat_with(
            "deeply nested unknown field",
            &format!("\"x\": {}", deep(5_000)),
        ),
        chat_with("unknown field", r#""foo": 1"#),
        chat_with(
            "llama.cpp's grammar field",
            r#""grammar": "root ::= \"a\"""#,
        ),
        case(
            "unknown field in a message",
            CHAT,
            r#"{"messages": [{"role": "user", "content": "hi", "foo": 1}]}"#,
        ),
        // The legacy completions endpoint.
        case(
            "completion without prompt",
            COMPLETIONS,
            r#"{"max_tokens": 2}"#,
        ),
        case("prompt as number", COMPLETIONS, r#"{"prompt": 5}"#),
        case(
            "prompt of mixed types",
            COMPLETIONS,
            r#"{"prompt": [1, "a"]}"#,
        ),
        case("negative token id", COMPLETIONS, r#"{"prompt": [-1]}"#),
        case(
            "token id past the vocabulary",
            COMPLETIONS,
            r#"{"prompt": [99999999]}"#,
        ),
        case("empty prompt list", COMPLETIONS, r#"{"prompt": []}"#),
        completion_with("logprobs above 5", r#""logprobs": 10"#),
        completion_with("echo as string", r#""echo": "x""#),
        completion_with("unknown field in completions", r#""bar": true"#),
        // Header values.
        with_header(
            case(
                "invalid utf-8 in the method header",
                CHAT,
                format!("{{{OK_MSGS}}}"),
            ),
            b"x-kv-cache-method: \xff\xfe",
        ),
        with_header(
            case(
                "unknown method in the header",
                CHAT,
                format!("{{{OK_MSGS}}}"),
            ),
            b"x-kv-cache-method: no-such-method",
        ),
        with_header(
            case("bits header not a number", CHAT, format!("{{{OK_MSGS}}}")),
            b"x-kv-cache-bits: abc",
        ),
        with_header(
            case("bits header past u8", CHAT, format!("{{{OK_MSGS}}}")),
            b"x-kv-cache-bits: 300",
        ),
        case(
            "body over the limit",
            CHAT,
            format!("{{\"x\": \"{}\"}}", "y".repeat(300_000)),
        ),
    ];
    let mut wrong_method = case("GET on the chat route", CHAT, "");
    wrong_method.method = "GET";
    c.push(wrong_method);
    c.push(case("unknown route", "/v1/no-such-route", "{}"));
    c
}

/// Sends one case on its own connection; (status, body).
fn send(addr: &str, c: &Case) -> (u16, String) {
    let mut req = format!(
        "{} {} HTTP/1.1\r\nHost: kvq\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        c.method,
        c.path,
        c.body.len()
    )
    .into_bytes();
    for h in &c.headers {
        req.extend_from_slice(h);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"\r\n");
    req.extend_from_slice(&c.body);
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    // A server that answers before the whole body is read may reset the rest: fine.
    let _ = s.write_all(&req);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{}: no status line in {text:?}", c.name));
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    (status, body)
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

#[test]
fn every_malformed_request_is_a_4xx_with_openai_error_shape() {
    let model = default_gguf();
    let server = Server::start(&[
        "--model",
        model.to_str().expect("utf-8 path"),
        "--max-body-bytes",
        "262144",
    ]);
    let addr = server.base.trim_start_matches("http://").to_string();
    let cases = corpus();
    assert!(cases.len() >= 60, "only {} cases", cases.len());
    let mut failures = Vec::new();
    for c in &cases {
        let (status, body) = send(&addr, c);
        let shape_ok = serde_json::from_str::<Value>(&body).is_ok_and(|v| {
            let e = &v["error"];
            e["message"].as_str().is_some_and(|m| !m.is_empty())
                && e["type"].is_string()
                && e.get("param").is_some()
                && e.get("code").is_some()
        });
        if !(400..500).contains(&status) || !shape_ok {
            failures.push(format!("{}: {status} {body}", c.name));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    // The server still answers, and never panicked.
    let ok = case("valid", CHAT, format!("{{{OK_MSGS}, \"max_tokens\": 2}}"));
    let (status, body) = send(&addr, &ok);
    assert_eq!(status, 200, "{body}");
    let log = server.log_text();
    assert!(!log.contains("panicked"), "{log}");
    eprintln!(
        "{} malformed requests, all 4xx with OpenAI's error shape",
        cases.len()
    );
}
