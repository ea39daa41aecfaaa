//! `POST /v1/completions` (legacy): a raw prompt (text or token ids) continued as a
//! `text_completion`, whole or streamed, with optional `echo` and legacy `logprobs`.

use crate::cache_select::resolve_cache;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generation::{Collected, collect_all, new_id, submit_all, unix_now};
use crate::openai::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, TextCompletion, UsageOut,
};
use crate::routes::{stop_signal, stream_response, tokenize_blocking, with_cache_header};
use crate::sse::{StreamKind, StreamMeta};
use crate::state::AppState;
use crate::validate::{Prompt, check_token_ids, validate_completion};
use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use kvq_engine::Engine;

const PROMPT_PARAM: &str = "prompt";

/// Tokenizes the prompt (token ids are checked against the vocabulary) and, with `echo`,
/// returns the prompt text to prepend.
pub fn encode_prompt(
    engine: &Engine,
    prompt: &Prompt,
    echo: bool,
) -> Result<(Vec<u32>, Option<String>), ApiError> {
    let tokenizer = engine.tokenizer();
    match prompt {
        Prompt::Text(text) => {
            let ids = tokenizer
                .encode(text, true)
                .map_err(|e| ApiError::from_model(e, PROMPT_PARAM))?;
            Ok((ids, echo.then(|| text.clone())))
        }
        Prompt::Tokens(ids) => {
            let vocab = engine.model_info().vocab_size.max(tokenizer.vocab_size());
            check_token_ids(ids, vocab)?;
            let echoed = if echo {
                Some(
                    tokenizer
                        .decode(ids, false)
                        .map_err(|e| ApiError::from_model(e, PROMPT_PARAM))?,
                )
            } else {
                None
            };
            Ok((ids.clone(), echoed))
        }
    }
}

/// The handler.
pub async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let served = state.engine.model_info().id.clone();
    let v = validate_completion(&req, &served, &state.limits)?;
    let cache = resolve_cache(&state.registry, &headers, v.params.kv_cache.as_ref())?;
    let engine = state.engine.clone();
    let (prompt, echo) = (v.prompt.clone(), v.echo);
    let (ids, echo_text) = tokenize_blocking(move || encode_prompt(&engine, &prompt, echo)).await?;
    let rxs = submit_all(
        &state.engine,
        &state.registry,
        &ids,
        &v.params,
        &cache,
        PROMPT_PARAM,
        None,
    )?;
    let id = new_id("cmpl-");
    let created = unix_now();

    if v.params.stream {
        let meta = StreamMeta {
            id,
            created,
            model: v.model,
        };
        return Ok(stream_response(
            StreamKind::Completion,
            meta,
            &v.params,
            rxs,
            echo_text.as_deref(),
            &cache.name,
            None,
            stop_signal(&state),
        ));
    }

    let results = tokio::select! {
        r = collect_all(rxs, PROMPT_PARAM) => r?,
        err = stop_signal(&state) => return Err(err),
    };
    let body = text_completion(
        id,
        created,
        v.model,
        v.params.logprobs.is_some(),
        echo_text.as_deref(),
        results,
    );
    Ok(with_cache_header(Json(body).into_response(), &cache.name))
}

/// Builds the non-streaming response from the collected choices.
pub fn text_completion(
    id: String,
    created: u64,
    model: String,
    want_logprobs: bool,
    echo: Option<&str>,
    results: Vec<Collected>,
) -> TextCompletion {
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
            let prefix = echo.unwrap_or("");
            let logprobs = want_logprobs.then(|| {
                let mut lp = CompletionLogprobs::default();
                let mut offset = prefix.len();
                lp.push_all(&c.logprobs, &mut offset);
                lp
            });
            CompletionChoice {
                text: format!("{prefix}{}", c.text),
                index,
                logprobs,
                finish_reason: Some(c.finish.as_str()),
            }
        })
        .collect();
    TextCompletion {
        id,
        object: "text_completion",
        created,
        model,
        choices,
        usage: Some(Some(usage.unwrap_or(UsageOut {
            prompt_tokens: 0,
            completion_tokens: 0,
            total_tokens: 0,
            prompt_tokens_details: Default::default(),
            kv_cache_bytes: 0,
        }))),
    }
}
