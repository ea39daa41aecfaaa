//! Streaming: `ChunkWriter` turns engine events into the OpenAI chunk sequence (a pure state
//! machine, unit-tested), and `sse_stream` drives it over the engine's receivers. The SSE stream
//! owns the receivers, so a client that disconnects drops them and cancels generation.

use crate::error::ApiError;
use crate::openai::{
    ChatChunkChoice, ChatCompletionChunk, ChatDelta, ChatLogprobs, CompletionChoice,
    CompletionLogprobs, TextCompletion, ToolCallDelta, UsageOut,
};
use crate::tool_calls::{ParsedCall, ToolMode, ToolStream};
use axum::response::IntoResponse;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use kvq_engine::{GenerationEvent, LogprobInfo};
use serde::Serialize;
use std::collections::VecDeque;
use std::convert::Infallible;

/// Which chunk object to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// `chat.completion.chunk` (prompt param `messages`).
    Chat,
    /// `text_completion` (prompt param `prompt`).
    Completion,
}

impl StreamKind {
    fn prompt_param(self) -> &'static str {
        match self {
            StreamKind::Chat => "messages",
            StreamKind::Completion => "prompt",
        }
    }
}

/// What every chunk of one response repeats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// One SSE message: a JSON `data:` payload, or the final `data: [DONE]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseItem {
    Data(String),
    Done,
}

impl SseItem {
    /// The `data:` text.
    pub fn data(&self) -> &str {
        match self {
            SseItem::Data(s) => s,
            SseItem::Done => "[DONE]",
        }
    }

    /// As an axum SSE event.
    pub fn into_event(self) -> Event {
        Event::default().data(self.data())
    }
}

#[derive(Debug, Default)]
struct ChoiceState {
    finished: bool,
    /// Logprobs of tokens whose text has not been sent yet.
    pending_logprobs: Vec<LogprobInfo>,
    /// Legacy `text_offset` of the next token.
    text_offset: usize,
    /// Tool-call detection (chat with tools): holds back what may be a call.
    tools: Option<ToolStream>,
}

/// Turns engine events (tagged with their choice index) into chunks, in OpenAI's order: role
/// chunk first (chat), content chunks, one finishing chunk per choice, the usage chunk (with
/// `include_usage`), then `[DONE]`. An engine error becomes an `{"error": ...}` event and `[DONE]`.
#[derive(Debug)]
pub struct ChunkWriter {
    kind: StreamKind,
    meta: StreamMeta,
    include_usage: bool,
    logprobs: bool,
    choices: Vec<ChoiceState>,
    usage: Option<UsageOut>,
    done: bool,
}

fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|e| {
        let err = ApiError::Internal(format!("could not serialize a chunk: {e}"));
        serde_json::to_string(&err.body()).unwrap_or_default()
    })
}

impl ChunkWriter {
    pub fn new(
        kind: StreamKind,
        meta: StreamMeta,
        n: usize,
        include_usage: bool,
        logprobs: bool,
    ) -> Self {
        Self {
            kind,
            meta,
            include_usage,
            logprobs,
            choices: (0..n.max(1)).map(|_| ChoiceState::default()).collect(),
            usage: None,
            done: false,
        }
    }

    /// Replies are searched for tool calls in `mode`'s syntax: a call is sent whole as
    /// `delta.tool_calls` when the choice ends, with `finish_reason: "tool_calls"`.
    pub fn with_tools(mut self, mode: Option<ToolMode>) -> Self {
        if let Some(mode) = mode.filter(|_| self.kind == StreamKind::Chat) {
            for c in &mut self.choices {
                c.tools = Some(ToolStream::new(mode.clone()));
            }
        }
        self
    }

    /// The chunk carrying choice `index`'s calls.
    fn tool_chunk(&mut self, index: usize, calls: Vec<ParsedCall>) -> SseItem {
        let infos = self
            .choices
            .get_mut(index)
            .map(|c| std::mem::take(&mut c.pending_logprobs))
            .unwrap_or_default();
        let deltas = calls
            .into_iter()
            .enumerate()
            .map(|(i, call)| ToolCallDelta {
                index: i,
                call: call.into_out(),
            })
            .collect();
        let choice = ChatChunkChoice {
            index,
            delta: ChatDelta {
                role: None,
                content: None,
                tool_calls: Some(deltas),
            },
            logprobs: self.logprobs.then(|| ChatLogprobs::from_infos(&infos)),
            finish_reason: None,
        };
        self.chat_chunk(vec![choice], self.usage_field())
    }

    /// Whether `[DONE]` has been written.
    pub fn is_done(&self) -> bool {
        self.done
    }

    fn usage_field(&self) -> Option<Option<UsageOut>> {
        self.include_usage.then_some(None)
    }

    fn chat_chunk(
        &self,
        choices: Vec<ChatChunkChoice>,
        usage: Option<Option<UsageOut>>,
    ) -> SseItem {
        SseItem::Data(to_json(&ChatCompletionChunk {
            id: self.meta.id.clone(),
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: self.meta.model.clone(),
            choices,
            usage,
        }))
    }

    fn text_chunk(
        &self,
        choices: Vec<CompletionChoice>,
        usage: Option<Option<UsageOut>>,
    ) -> SseItem {
        SseItem::Data(to_json(&TextCompletion {
            id: self.meta.id.clone(),
            object: "text_completion",
            created: self.meta.created,
            model: self.meta.model.clone(),
            choices,
            usage,
        }))
    }

    /// A chunk for choice `index` with `text` (or the finish reason) and pending logprobs.
    fn content_chunk(
        &mut self,
        index: usize,
        text: Option<String>,
        finish: Option<&'static str>,
    ) -> SseItem {
        let infos = self
            .choices
            .get_mut(index)
            .map(|c| std::mem::take(&mut c.pending_logprobs))
            .unwrap_or_default();
        match self.kind {
            StreamKind::Chat => {
                let logprobs = self.logprobs.then(|| ChatLogprobs::from_infos(&infos));
                let choice = ChatChunkChoice {
                    index,
                    delta: ChatDelta {
                        role: None,
                        content: text,
                        tool_calls: None,
                    },
                    logprobs,
                    finish_reason: finish,
                };
                self.chat_chunk(vec![choice], self.usage_field())
            }
            StreamKind::Completion => {
                let logprobs = if self.logprobs {
                    let mut lp = CompletionLogprobs::default();
                    if let Some(c) = self.choices.get_mut(index) {
                        lp.push_all(&infos, &mut c.text_offset);
                    }
                    Some(lp)
                } else {
                    None
                };
                let choice = CompletionChoice {
                    text: text.unwrap_or_default(),
                    index,
                    logprobs,
                    finish_reason: finish,
                };
                self.text_chunk(vec![choice], self.usage_field())
            }
        }
    }

    /// What is sent before any engine event: the assistant role chunk per choice (chat), or the
    /// echoed prompt (completions with `echo`).
    pub fn opening(&mut self, echo: Option<&str>) -> Vec<SseItem> {
        let n = self.choices.len();
        match self.kind {
            StreamKind::Chat => (0..n)
                .map(|index| {
                    let choice = ChatChunkChoice {
                        index,
                        delta: ChatDelta {
                            role: Some("assistant"),
                            content: Some(String::new()),
                            tool_calls: None,
                        },
                        logprobs: None,
                        finish_reason: None,
                    };
                    self.chat_chunk(vec![choice], self.usage_field())
                })
                .collect(),
            StreamKind::Completion => match echo.filter(|e| !e.is_empty()) {
                Some(prompt) => (0..n)
                    .map(|index| {
                        if let Some(c) = self.choices.get_mut(index) {
                            c.text_offset = prompt.len();
                        }
                        let choice = CompletionChoice {
                            text: prompt.to_string(),
                            index,
                            logprobs: None,
                            finish_reason: None,
                        };
                        self.text_chunk(vec![choice], self.usage_field())
                    })
                    .collect(),
                None => Vec::new(),
            },
        }
    }

    /// The chunks for one event of choice `index`.
    pub fn on_event(&mut self, index: usize, event: GenerationEvent) -> Vec<SseItem> {
        if self.done || self.choices.get(index).is_none_or(|c| c.finished) {
            return Vec::new();
        }
        match event {
            GenerationEvent::Delta { text, logprob, .. } => {
                if let (true, Some(lp), Some(c)) =
                    (self.logprobs, logprob, self.choices.get_mut(index))
                {
                    c.pending_logprobs.push(lp);
                }
                let text = match self.choices.get_mut(index).and_then(|c| c.tools.as_mut()) {
                    Some(tools) => tools.push(&text),
                    None => text,
                };
                if text.is_empty() {
                    Vec::new()
                } else {
                    vec![self.content_chunk(index, Some(text), None)]
                }
            }
            GenerationEvent::Finished { reason, usage } => {
                let mut items = Vec::new();
                let mut finish = reason.as_str();
                if let Some(tools) = self.choices.get_mut(index).and_then(|c| c.tools.take()) {
                    let (tail, calls) = tools.finish();
                    if !tail.is_empty() {
                        items.push(self.content_chunk(index, Some(tail), None));
                    }
                    if !calls.is_empty() {
                        items.push(self.tool_chunk(index, calls));
                        finish = "tool_calls";
                    }
                }
                items.push(self.content_chunk(index, None, Some(finish)));
                if let Some(c) = self.choices.get_mut(index) {
                    c.finished = true;
                }
                let u = UsageOut::from(&usage);
                match &mut self.usage {
                    Some(total) => total.add_choice(&u),
                    None => self.usage = Some(u),
                }
                if self.choices.iter().all(|c| c.finished) {
                    if self.include_usage {
                        let usage = self.usage.clone();
                        items.push(match self.kind {
                            StreamKind::Chat => self.chat_chunk(Vec::new(), Some(usage)),
                            StreamKind::Completion => self.text_chunk(Vec::new(), Some(usage)),
                        });
                    }
                    items.push(SseItem::Done);
                    self.done = true;
                }
                items
            }
            GenerationEvent::Error(err) => {
                self.error(ApiError::from_engine(err, self.kind.prompt_param()))
            }
        }
    }

    /// The engine dropped a stream without finishing it.
    pub fn on_closed(&mut self) -> Vec<SseItem> {
        if self.done {
            return Vec::new();
        }
        self.error(ApiError::Unavailable(
            "the engine stopped before the request finished".into(),
        ))
    }

    /// An error event, then `[DONE]`; nothing more is written after it.
    pub fn error(&mut self, err: ApiError) -> Vec<SseItem> {
        if self.done {
            return Vec::new();
        }
        self.done = true;
        vec![SseItem::Data(to_json(&err.body())), SseItem::Done]
    }
}

/// Drives `writer` over the engine's events and yields SSE events until `[DONE]`.
/// `on_event` sees every engine event first (for metrics). The returned stream owns `events`
/// (and so the engine receivers): dropping it cancels the generation. When `stop` resolves
/// (the shutdown grace or the request timeout is over) the stream ends with its error as an
/// event and `[DONE]`.
pub fn sse_stream<S>(
    events: S,
    writer: ChunkWriter,
    opening: Vec<SseItem>,
    on_event: impl Fn(&GenerationEvent) + Send + 'static,
    stop: impl std::future::Future<Output = ApiError> + Send + 'static,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static
where
    S: Stream<Item = (usize, GenerationEvent)> + Send + Unpin + 'static,
{
    let queue: VecDeque<SseItem> = opening.into();
    let stop: std::pin::Pin<Box<dyn std::future::Future<Output = ApiError> + Send>> =
        Box::pin(stop);
    let state = (Some(events), writer, queue, on_event, stop);
    futures::stream::unfold(
        state,
        |(mut events, mut writer, mut queue, on_event, mut stop)| async move {
            loop {
                if let Some(item) = queue.pop_front() {
                    return Some((
                        Ok(item.into_event()),
                        (events, writer, queue, on_event, stop),
                    ));
                }
                if writer.is_done() {
                    return None;
                }
                let next = match events.as_mut() {
                    Some(s) => tokio::select! {
                        next = s.next() => Ok(next),
                        err = &mut stop => Err(err),
                    },
                    None => Ok(None),
                };
                let items = match next {
                    Ok(Some((index, event))) => {
                        on_event(&event);
                        writer.on_event(index, event)
                    }
                    Ok(None) => writer.on_closed(),
                    Err(err) => writer.error(err),
                };
                queue.extend(items);
                if writer.is_done() {
                    // Release the receivers (cancelling any choice still running) before the
                    // last items are flushed.
                    events = None;
                }
            }
        },
    )
}

/// Wraps a chunk stream as an SSE response body with keep-alive comments.
pub fn into_sse<S>(stream: S) -> impl IntoResponse
where
    S: Stream<Item = Result<Event, Infallible>> + Send + 'static,
{
    Sse::new(stream).keep_alive(KeepAlive::default())
}

#[cfg(test)]
#[path = "sse_tests.rs"]
mod tests;
