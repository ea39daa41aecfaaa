//! Which OpenAI request fields kvq honors, which it accepts and ignores by design, and which it
//! refuses until they are implemented (a 400 naming the field, code `unsupported_parameter`),
//! so that no field that would change the answer is ever silently dropped. README's "OpenAI
//! request fields" table lists the same three groups.

use crate::error::ApiError;
use crate::openai::{ChatCompletionRequest, InputMessage};
use serde_json::Value;

/// Fields OpenAI defines that kvq accepts and does not act on, because acting on them would not
/// change the output: identifiers for abuse monitoring (`user`, `safety_identifier`), OpenAI's
/// stored-completions bookkeeping (`metadata`, `store`: kvq stores nothing), routing and latency
/// hints (`service_tier`: one tier; `prompt_cache_key`; `prediction`: predicted outputs only
/// make OpenAI faster, the tokens are the same).
pub const IGNORED_BY_DESIGN: &[&str] = &[
    "user",
    "safety_identifier",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "prediction",
];

fn refuse(param: &str, message: String) -> ApiError {
    ApiError::unsupported(param, message)
}

fn absent(v: &Option<Value>) -> bool {
    matches!(v, None | Some(Value::Null))
}

fn absent_or_empty(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Array(a)) => a.is_empty(),
        _ => false,
    }
}

fn is_str(v: &Option<Value>, s: &str) -> bool {
    matches!(v, Some(Value::String(x)) if x == s)
}

/// Refuses every chat field (and message field) that is not implemented.
pub fn check_chat(req: &ChatCompletionRequest) -> Result<(), ApiError> {
    let use_tools = "Use 'tools' and 'tool_choice' instead (the deprecated function-calling \
                     fields are not served).";
    if !absent_or_empty(&req.functions) {
        return Err(refuse(
            "functions",
            format!("'functions' is not supported. {use_tools}"),
        ));
    }
    if !(absent(&req.function_call) || is_str(&req.function_call, "none")) {
        return Err(refuse(
            "function_call",
            format!("'function_call' other than \"none\" is not supported. {use_tools}"),
        ));
    }
    modalities(req.modalities.as_ref())?;
    if !absent(&req.audio) {
        return Err(refuse(
            "audio",
            "'audio' (audio output) is not supported: this server generates text only.".into(),
        ));
    }
    if !absent(&req.web_search_options) {
        return Err(refuse(
            "web_search_options",
            "'web_search_options' (web search) is not supported: this server answers from the \
             model alone."
                .into(),
        ));
    }
    if !absent(&req.reasoning_effort) {
        return Err(refuse(
            "reasoning_effort",
            "'reasoning_effort' is not supported: the served model has no reasoning effort \
             setting. Send the request without it."
                .into(),
        ));
    }
    if !absent(&req.verbosity) {
        return Err(refuse(
            "verbosity",
            "'verbosity' is not supported: the served model has no verbosity setting; limit the \
             answer with 'max_tokens' or the prompt instead."
                .into(),
        ));
    }
    for (i, m) in req.messages.iter().flatten().enumerate() {
        message(i, m)?;
    }
    Ok(())
}

/// A message's fields beyond `role` and `content`: `name` and `refusal` are accepted and not
/// used (the supported chat templates render neither); `tool_calls` and `tool_call_id` are
/// checked with the tools (`crate::validate::tools`); `function_call` and audio are refused.
fn message(i: usize, m: &InputMessage) -> Result<(), ApiError> {
    if !absent(&m.function_call) {
        return Err(refuse(
            &format!("messages[{i}].function_call"),
            format!(
                "'messages[{i}].function_call' (deprecated) is not supported: send the call \
                 as 'tool_calls'."
            ),
        ));
    }
    if !absent(&m.audio) {
        return Err(refuse(
            &format!("messages[{i}].audio"),
            format!("'messages[{i}].audio' is not supported: this server handles text only."),
        ));
    }
    Ok(())
}

/// `modalities`: only `["text"]`.
fn modalities(v: Option<&Value>) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(items)) if items.iter().all(|m| m.as_str() == Some("text")) => Ok(()),
        Some(_) => Err(refuse(
            "modalities",
            "'modalities' other than [\"text\"] are not supported: this server generates text \
             only."
                .into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{validate_chat, validate_completion};
    use crate::error::ApiError;
    use crate::extract::parse_json;
    use crate::state::ServerLimits;
    use serde_json::{Value, json};

    fn chat(extra: Value) -> Result<super::super::ValidatedChat, ApiError> {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().into_iter().flatten() {
            body[k] = v.clone();
        }
        let req = parse_json(body.to_string().as_bytes())?;
        validate_chat(&req, "m", &ServerLimits::default())
    }

    /// Every field that would change the answer and is not implemented is a 400 naming it, with
    /// code `unsupported_parameter`.
    #[test]
    fn unimplemented_fields_are_refused_by_name() {
        let cases = [
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (json!({"function_call": "auto"}), "function_call"),
            (json!({"modalities": ["text", "audio"]}), "modalities"),
            (
                json!({"audio": {"voice": "alloy", "format": "wav"}}),
                "audio",
            ),
            (json!({"web_search_options": {}}), "web_search_options"),
            (json!({"reasoning_effort": "low"}), "reasoning_effort"),
            (json!({"verbosity": "low"}), "verbosity"),
            (
                json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                    "content": null, "function_call": {"name": "f", "arguments": "{}"}}]}),
                "messages[1].function_call",
            ),
            (
                json!({"messages": [{"role": "user", "content": "hi", "audio": {"id": "a"}}]}),
                "messages[0].audio",
            ),
        ];
        for (extra, param) in cases {
            let err = chat(extra.clone()).expect_err(&extra.to_string());
            assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST, "{extra}");
            assert_eq!(err.param(), Some(param), "{extra}: {err}");
            assert_eq!(err.code(), Some("unsupported_parameter"), "{extra}");
            assert!(
                err.to_string()
                    .contains(param.rsplit('.').next().unwrap_or(param))
            );
        }
    }

    /// What does not change the answer, and the neutral forms of the refused fields, pass.
    #[test]
    fn neutral_forms_and_ignored_fields_pass() {
        for extra in [
            json!({"tools": [], "tool_choice": "none", "functions": [], "function_call": "none"}),
            json!({"tools": null, "tool_choice": null, "parallel_tool_calls": null}),
            json!({"response_format": {"type": "text"}, "modalities": ["text"]}),
            json!({"user": "u", "safety_identifier": "s", "metadata": {"a": "b"}, "store": true,
                "service_tier": "auto", "prompt_cache_key": "k",
                "prediction": {"type": "content", "content": "x"}}),
            json!({"messages": [{"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": "", "refusal": "no", "tool_calls": []}]}),
        ] {
            chat(extra.clone()).unwrap_or_else(|e| panic!("{extra}: {e}"));
        }
        assert_eq!(super::IGNORED_BY_DESIGN.len(), 7);
    }

    /// `logit_bias` is honored: parsed into the sampler's (id, bias) list, range-checked.
    #[test]
    fn logit_bias_is_parsed_and_checked() {
        let v = chat(json!({"logit_bias": {"50256": -100, "7": 2.5}})).unwrap();
        assert_eq!(
            v.params.sampling.logit_bias,
            vec![(7, 2.5), (50256, -100.0)]
        );
        for (bad, why) in [
            (json!({"logit_bias": {"x": 1}}), "token ids"),
            (json!({"logit_bias": {"-1": 1}}), "token ids"),
            (json!({"logit_bias": {"3": 101}}), "from -100"),
            (json!({"logit_bias": {"3": "high"}}), "from -100"),
            (json!({"logit_bias": [1, 2]}), "an object"),
        ] {
            let err = chat(bad.clone()).expect_err(&bad.to_string());
            assert_eq!(err.param(), Some("logit_bias"), "{bad}");
            assert!(err.to_string().contains(why), "{bad}: {err}");
        }
        let req = parse_json(br#"{"prompt": "a", "logit_bias": {"1": 5}}"#).unwrap();
        let v = validate_completion(&req, "m", &ServerLimits::default()).unwrap();
        assert_eq!(v.params.sampling.logit_bias, vec![(1, 5.0)]);
    }
}
