//! Tests of the chunk sequence `ChunkWriter` produces: role first, content, finish, usage, [DONE],
//! mid-stream errors, logprobs, completions chunks and `n > 1`.

use super::*;
use kvq_engine::{EngineError, FinishReason, TopLogprob, Usage};
use serde_json::{Value, json};
use std::time::Duration;

fn meta() -> StreamMeta {
    StreamMeta {
        id: "chatcmpl-abc".into(),
        created: 42,
        model: "m".into(),
    }
}

fn delta(text: &str) -> GenerationEvent {
    GenerationEvent::Delta {
        text: text.into(),
        token: Some(1),
        logprob: None,
    }
}

fn usage(completion: usize) -> Usage {
    Usage {
        prompt_tokens: 5,
        cached_tokens: 0,
        completion_tokens: completion,
        kv_cache_bytes: 1000,
        kv_cache_method: "fp16".into(),
        time_to_first_token: Duration::from_millis(10),
        decode_time: Duration::from_millis(100),
        grammar: None,
    }
}

fn finished(reason: FinishReason, completion: usize) -> GenerationEvent {
    GenerationEvent::Finished {
        reason,
        usage: usage(completion),
    }
}

fn parse(items: &[SseItem]) -> Vec<Value> {
    items
        .iter()
        .map(|i| match i {
            SseItem::Data(s) => serde_json::from_str(s).unwrap(),
            SseItem::Done => Value::String("[DONE]".into()),
        })
        .collect()
}

fn run(writer: &mut ChunkWriter, events: Vec<GenerationEvent>) -> Vec<Value> {
    let mut items = writer.opening(None);
    for ev in events {
        items.extend(writer.on_event(0, ev));
    }
    parse(&items)
}

#[test]
fn chat_sequence_without_usage() {
    let mut w = ChunkWriter::new(StreamKind::Chat, meta(), 1, false, false);
    let out = run(
        &mut w,
        vec![
            delta("Hel"),
            delta(""),
            delta("lo"),
            finished(FinishReason::Stop, 3),
        ],
    );
    assert_eq!(out.len(), 5, "{out:#?}");
    assert_eq!(out[0]["object"], "chat.completion.chunk");
    assert_eq!(
        out[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(out[0]["choices"][0]["finish_reason"], Value::Null);
    assert!(out[0].get("usage").is_none());
    assert_eq!(out[1]["choices"][0]["delta"], json!({"content": "Hel"}));
    assert_eq!(out[2]["choices"][0]["delta"], json!({"content": "lo"}));
    assert_eq!(out[3]["choices"][0]["delta"], json!({}));
    assert_eq!(out[3]["choices"][0]["finish_reason"], "stop");
    assert_eq!(out[4], "[DONE]");
    for chunk in &out[..4] {
        assert_eq!(chunk["id"], "chatcmpl-abc");
        assert_eq!(chunk["created"], 42);
        assert_eq!(chunk["model"], "m");
    }
    assert!(w.is_done());
}

#[test]
fn chat_sequence_with_usage() {
    let mut w = ChunkWriter::new(StreamKind::Chat, meta(), 1, true, false);
    let out = run(&mut w, vec![delta("Hi"), finished(FinishReason::Length, 2)]);
    assert_eq!(out.len(), 5, "{out:#?}");
    for chunk in &out[..3] {
        assert_eq!(chunk["usage"], Value::Null);
        assert!(chunk.get("usage").is_some());
    }
    assert_eq!(out[2]["choices"][0]["finish_reason"], "length");
    assert_eq!(out[3]["choices"], json!([]));
    assert_eq!(
        out[3]["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}, "kv_cache_bytes": 1000})
    );
    assert_eq!(out[4], "[DONE]");
}

#[test]
fn error_mid_stream_then_done() {
    let mut w = ChunkWriter::new(StreamKind::Chat, meta(), 1, true, false);
    let out = run(
        &mut w,
        vec![
            delta("a"),
            GenerationEvent::Error(EngineError::Internal("oom".into())),
            delta("b"),
        ],
    );
    assert_eq!(out.len(), 4, "{out:#?}");
    assert_eq!(out[2]["error"]["type"], "server_error");
    assert!(out[2]["error"]["message"].as_str().unwrap().contains("oom"));
    assert_eq!(out[3], "[DONE]");
    assert!(w.is_done());
    assert!(w.on_event(0, delta("c")).is_empty());
    assert!(w.on_closed().is_empty());
}

#[test]
fn engine_gone_is_an_error_event() {
    let mut w = ChunkWriter::new(StreamKind::Chat, meta(), 1, false, false);
    let mut items = w.opening(None);
    items.extend(w.on_event(0, delta("x")));
    items.extend(w.on_closed());
    let out = parse(&items);
    assert_eq!(out[2]["error"]["code"], "unavailable");
    assert_eq!(out[3], "[DONE]");
}

#[test]
fn chat_logprobs_wait_for_text() {
    let mut w = ChunkWriter::new(StreamKind::Chat, meta(), 1, false, true);
    let lp = |t: &str| LogprobInfo {
        id: 1,
        token: t.into(),
        logprob: -0.5,
        bytes: t.as_bytes().to_vec(),
        top: vec![TopLogprob {
            id: 2,
            token: t.into(),
            logprob: f32::NEG_INFINITY,
            bytes: t.as_bytes().to_vec(),
        }],
    };
    let ev = |text: &str, tok: &str| GenerationEvent::Delta {
        text: text.into(),
        token: Some(1),
        logprob: Some(lp(tok)),
    };
    let out = run(
        &mut w,
        vec![ev("", "a"), ev("ab", "b"), finished(FinishReason::Stop, 2)],
    );
    let content = &out[1]["choices"][0]["logprobs"]["content"];
    assert_eq!(content.as_array().unwrap().len(), 2);
    assert_eq!(content[0]["token"], "a");
    assert_eq!(content[0]["bytes"], json!([97]));
    assert_eq!(content[0]["top_logprobs"][0]["logprob"], json!(-9999.0));
    assert_eq!(out[2]["choices"][0]["logprobs"]["content"], json!([]));
}

#[test]
fn completion_chunks() {
    let mut w = ChunkWriter::new(StreamKind::Completion, meta(), 1, true, false);
    let mut items = w.opening(Some("Once"));
    items.extend(w.on_event(0, delta(" upon")));
    items.extend(w.on_event(0, finished(FinishReason::Length, 1)));
    let out = parse(&items);
    assert_eq!(out.len(), 5, "{out:#?}");
    assert_eq!(out[0]["object"], "text_completion");
    assert_eq!(out[0]["choices"][0]["text"], "Once");
    assert_eq!(out[1]["choices"][0]["text"], " upon");
    assert_eq!(out[1]["choices"][0]["finish_reason"], Value::Null);
    assert_eq!(out[1]["usage"], Value::Null);
    assert_eq!(out[2]["choices"][0]["text"], "");
    assert_eq!(out[2]["choices"][0]["finish_reason"], "length");
    assert_eq!(out[3]["choices"], json!([]));
    assert_eq!(out[3]["usage"]["completion_tokens"], 1);
    assert_eq!(out[4], "[DONE]");
}

#[test]
fn completion_without_echo_has_no_opening() {
    let mut w = ChunkWriter::new(StreamKind::Completion, meta(), 1, false, false);
    assert!(w.opening(None).is_empty());
}

#[test]
fn two_choices_finish_before_done() {
    let mut w = ChunkWriter::new(StreamKind::Chat, meta(), 2, true, false);
    let mut items = w.opening(None);
    assert_eq!(items.len(), 2);
    items.extend(w.on_event(1, delta("b")));
    items.extend(w.on_event(0, finished(FinishReason::Stop, 1)));
    assert!(!w.is_done());
    items.extend(w.on_event(1, finished(FinishReason::Stop, 2)));
    let out = parse(&items);
    assert_eq!(out[1]["choices"][0]["index"], 1);
    assert_eq!(out[0]["choices"][0]["index"], 0);
    let last_usage = &out[out.len() - 2]["usage"];
    assert_eq!(last_usage["completion_tokens"], 3);
    assert_eq!(last_usage["prompt_tokens"], 5);
    assert_eq!(out[out.len() - 1], "[DONE]");
}

#[tokio::test]
async fn sse_stream_drops_receivers_when_done_or_dropped() {
    use futures::StreamExt;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let w = ChunkWriter::new(StreamKind::Chat, meta(), 1, false, false);
    let mut w2 = ChunkWriter::new(StreamKind::Chat, meta(), 1, false, false);
    let opening = w2.opening(None);
    let stream = sse_stream(
        crate::generation::merge(vec![rx]),
        w,
        opening,
        |_| {},
        std::future::pending::<crate::error::ApiError>(),
    );
    let mut stream = Box::pin(stream);
    assert!(stream.next().await.is_some());
    tx.send(delta("hi")).unwrap();
    assert!(stream.next().await.is_some());
    drop(stream);
    assert!(
        tx.is_closed(),
        "dropping the SSE stream must drop the engine receiver"
    );

    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let w = ChunkWriter::new(StreamKind::Chat, meta(), 1, false, false);
    let stream = sse_stream(
        crate::generation::merge(vec![rx]),
        w,
        Vec::new(),
        |_| {},
        std::future::pending::<crate::error::ApiError>(),
    );
    tx.send(finished(FinishReason::Stop, 1)).unwrap();
    let events: Vec<_> = stream.collect().await;
    assert_eq!(events.len(), 2);
    assert!(tx.is_closed());
}

#[test]
fn a_streamed_tool_call_is_sent_whole_and_finishes_with_tool_calls() {
    let tools = json!([{"type": "function", "function": {"name": "get_time"}}]);
    let plan = crate::validate::tools::tool_plan(Some(&tools), None, None).unwrap();
    let mode = crate::tool_calls::ToolMode::of(plan.as_ref());
    let mut w = ChunkWriter::new(StreamKind::Chat, meta(), 1, false, false).with_tools(mode);
    let out = run(
        &mut w,
        vec![
            delta("One moment. <tool"),
            delta("_call>\n{\"name\": \"get_time\", "),
            delta("\"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>"),
            finished(FinishReason::Stop, 20),
        ],
    );
    assert_eq!(out.len(), 5, "{out:#?}");
    assert_eq!(
        out[1]["choices"][0]["delta"],
        json!({"content": "One moment. "})
    );
    let calls = &out[2]["choices"][0]["delta"]["tool_calls"];
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["type"], "function");
    assert!(
        calls[0]["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_"))
    );
    assert_eq!(
        calls[0]["function"],
        json!({"name": "get_time", "arguments": "{\"zone\":\"UTC\"}"})
    );
    assert_eq!(out[3]["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(out[4], "[DONE]");

    // A reply without a call streams as text and finishes as the engine says.
    let mut w = ChunkWriter::new(StreamKind::Chat, meta(), 1, false, false)
        .with_tools(crate::tool_calls::ToolMode::of(plan.as_ref()));
    let out = run(
        &mut w,
        vec![delta("It is noon."), finished(FinishReason::Stop, 4)],
    );
    assert_eq!(
        out[1]["choices"][0]["delta"],
        json!({"content": "It is noon."})
    );
    assert_eq!(out[2]["choices"][0]["finish_reason"], "stop");
}
