//! `POST /v1/chat/completions`: validate, pick the cache, render the chat template (with the
//! request's tools), tokenize, then answer whole (`chat.completion`) or as SSE chunks
//! (`chat.completion.chunk`), tool calls parsed out of the reply.

use crate::cache_select::resolve_cache;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generation::{self, collect_all, new_id, submit_all, unix_now};
use crate::openai::{
    ChatChoice, ChatCompletion, ChatCompletionRequest, ChatLogprobs, ResponseMessage, UsageOut,
};
use crate::routes::{stop_signal, stream_response, tokenize_blocking, with_cache_header};
use crate::sse::{StreamKind, StreamMeta};
use crate::state::AppState;
use crate::tool_calls::{ToolMode, parse_reply};
use crate::validate::format::{schema_error, tool_schema_error};
use crate::validate::tools::{ToolChoice, ToolPlan};
use crate::validate::{Message, validate_chat};
use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use kvq_engine::Engine;
use kvq_models::{ChatMessage, ChatTemplate, Tokenizer};

const PROMPT_PARAM: &str = "messages";

/// Renders `messages` with the model's chat template (generation prompt added) and tokenizes
/// the result. Template errors (e.g. a template that rejects the role order) are 400s.
pub fn render_and_encode(
    engine: &Engine,
    messages: &[Message],
    tools: Option<&ToolPlan>,
) -> Result<Vec<u32>, ApiError> {
    render_and_encode_with(engine.chat_template(), engine.tokenizer(), messages, tools)
}

/// Whether the template renders a `tools` variable (Qwen2.5's, Hermes', Llama 3.1's do).
pub fn template_takes_tools(template: &ChatTemplate) -> bool {
    template.source().contains("tools")
}

/// Refuses what the served model cannot do with `plan`: letting the model choose to call a
/// tool needs a template that shows the tools (a forced call is written by the grammar).
pub fn check_tools(
    template: &ChatTemplate,
    plan: Option<&ToolPlan>,
    forced_format: bool,
) -> Result<(), ApiError> {
    let Some(plan) = plan else { return Ok(()) };
    if plan.choice == ToolChoice::Auto && !template_takes_tools(template) {
        return Err(ApiError::unsupported(
            "tools",
            "The served model's chat template has no tool support, so the model cannot choose \
             to call one. Set 'tool_choice' to \"required\" or to a function to force a call \
             (the grammar writes it), or send the request without 'tools'.",
        ));
    }
    if plan.forced() && forced_format {
        return Err(ApiError::invalid(
            "response_format",
            "'response_format' cannot be combined with a 'tool_choice' that forces a call: \
             the call's own schema constrains the reply.",
        ));
    }
    Ok(())
}

/// [`render_and_encode`] with a given template and tokenizer (no engine needed: the fuzz
/// targets drive it).
pub fn render_and_encode_with(
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    messages: &[Message],
    tools: Option<&ToolPlan>,
) -> Result<Vec<u32>, ApiError> {
    let mut msgs: Vec<ChatMessage> = messages
        .iter()
        .map(|m| {
            let mut c = ChatMessage::new(m.role.as_str(), m.content.clone());
            c.tool_calls = m.tool_calls.clone();
            c.tool_call_id = m.tool_call_id.clone();
            c
        })
        .collect();
    let mut extra = None;
    if let Some(plan) = tools.filter(|p| p.active()) {
        if template_takes_tools(template) {
            extra = Some(serde_json::json!({ "tools": plan.template_tools }));
        } else {
            // Only a forced call gets here: tell the model what it is calling.
            let text = plan.plain_instruction();
            match msgs.first_mut() {
                Some(first) if first.role == "system" => {
                    first.content = format!("{}\n\n{text}", first.content);
                }
                _ => msgs.insert(0, ChatMessage::new("system", text)),
            }
        }
    }
    let text = template
        .render_with(&msgs, true, extra.as_ref())
        .map_err(|e| ApiError::from_model(e, PROMPT_PARAM))?;
    // A template that writes the BOS text itself must not get a second BOS from the tokenizer.
    let add_special = !tokenizer
        .bos_token()
        .is_some_and(|bos| !bos.is_empty() && text.starts_with(bos));
    tokenizer
        .encode(&text, add_special)
        .map_err(|e| ApiError::from_model(e, PROMPT_PARAM))
}

/// The handler.
pub async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let served = state.engine.model_info().id.clone();
    let mut v = validate_chat(&req, &served, &state.limits)?;
    // The template's own answer ends (a transcript's next question) stop like the request's.
    v.params
        .stop
        .extend(state.engine.chat_template().stop_strings().iter().cloned());
    let cache = resolve_cache(&state.registry, &headers, v.params.kv_cache.as_ref())?;
    check_tools(
        state.engine.chat_template(),
        v.tools.as_ref(),
        v.params.response_format.is_some(),
    )?;
    let tool_mode = ToolMode::of(v.tools.as_ref());
    let engine = state.engine.clone();
    let messages = v.messages.clone();
    let tools = v.tools.clone();
    // The reply's grammar: the response format's, or a forced tool call's (never both).
    let (format, on_error): (_, fn(_) -> ApiError) = match v.params.response_format.clone() {
        Some(f) => (Some(f), schema_error),
        None => (
            tools.as_ref().and_then(ToolPlan::call_grammar),
            tool_schema_error,
        ),
    };
    let (prompt, constraint) = tokenize_blocking(move || {
        // Compiling a schema can take milliseconds; an unsupported one is a 400.
        let constraint = format
            .map(|f| engine.compile_grammar(&f).map_err(on_error))
            .transpose()?;
        Ok((
            render_and_encode(&engine, &messages, tools.as_ref())?,
            constraint,
        ))
    })
    .await?;
    let rxs = submit_all(
        &state.engine,
        &state.registry,
        &prompt,
        &v.params,
        &cache,
        PROMPT_PARAM,
        constraint.as_ref(),
    )?;
    let id = new_id("chatcmpl-");
    let created = unix_now();

    if v.params.stream {
        let meta = StreamMeta {
            id,
            created,
            model: v.model,
        };
        return Ok(stream_response(
            StreamKind::Chat,
            meta,
            &v.params,
            rxs,
            None,
            &cache.name,
            tool_mode,
            stop_signal(&state),
        ));
    }

    let results = tokio::select! {
        r = collect_all(rxs, PROMPT_PARAM) => r?,
        err = stop_signal(&state) => return Err(err),
    };
    let body = chat_completion(
        id,
        created,
        v.model,
        v.params.logprobs.is_some(),
        results,
        tool_mode.as_ref(),
    );
    Ok(with_cache_header(Json(body).into_response(), &cache.name))
}

/// Builds the non-streaming response from the collected choices.
pub fn chat_completion(
    id: String,
    created: u64,
    model: String,
    want_logprobs: bool,
    results: Vec<generation::Collected>,
    tools: Option<&ToolMode>,
) -> ChatCompletion {
    let mut usage: Option<UsageOut> = None;
    let choices = results
        .into_iter()
        .enumerate()
        .map(|(index, c)| {
            let u = UsageOut::from(&c.usage);
            match &mut usage {
                Some(total) => total.add_choice(&u),
                None => usage = Some(u),
            }
            let (content, calls) = match tools {
                Some(mode) => parse_reply(&c.text, mode),
                None => (Some(c.text), Vec::new()),
            };
            let finish_reason = match calls.is_empty() {
                true => c.finish.as_str(),
                false => "tool_calls",
            };
            let tool_calls = (!calls.is_empty())
                .then(|| calls.into_iter().map(|call| call.into_out()).collect());
            ChatChoice {
                index,
                message: ResponseMessage {
                    role: "assistant",
                    content,
                    tool_calls,
                },
                logprobs: want_logprobs.then(|| ChatLogprobs::from_infos(&c.logprobs)),
                finish_reason,
            }
        })
        .collect();
    ChatCompletion {
        id,
        object: "chat.completion",
        created,
        model,
        choices,
        usage: usage.unwrap_or(UsageOut {
            prompt_tokens: 0,
            completion_tokens: 0,
            total_tokens: 0,
            prompt_tokens_details: Default::default(),
            kv_cache_bytes: 0,
        }),
    }
}
