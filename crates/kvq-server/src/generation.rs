//! Running a validated request on the engine: submitting one sequence per choice, collecting
//! a whole answer (non-streaming), merging choices into one event stream (streaming), and
//! response ids and timestamps.

use crate::error::ApiError;
use crate::metrics::record_usage;
use crate::validate::ValidatedParams;
use futures::{Stream, StreamExt};
use kvq_cache::{CacheRegistry, CacheSpec, ResolvedCache};
use kvq_engine::error::human_bytes;
use kvq_engine::{
    Constraint, Engine, EngineError, FinishReason, GenerationEvent, GenerationRequest,
    GenerationStream, LogprobInfo, Usage,
};
use rand::Rng;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// A response id: `prefix` and 24 random alphanumerics (e.g. `chatcmpl-...`).
pub fn new_id(prefix: &str) -> String {
    let suffix: String = rand::rng()
        .sample_iter(rand::distr::Alphanumeric)
        .take(24)
        .map(char::from)
        .collect();
    format!("{prefix}{suffix}")
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The engine request for choice `index`: with a seed, each choice gets `seed + index` so
/// choices differ while staying reproducible.
pub fn generation_request(
    prompt: Vec<u32>,
    params: &ValidatedParams,
    cache: ResolvedCache,
    index: usize,
    constraint: Option<&Constraint>,
) -> GenerationRequest {
    let mut sampling = params.sampling.clone();
    if let Some(seed) = sampling.seed {
        sampling.seed = Some(seed.wrapping_add(index as u64));
    }
    GenerationRequest {
        prompt,
        max_tokens: params.max_tokens,
        sampling,
        stop: params.stop.clone(),
        stop_on_eos: !params.ignore_eos,
        logprobs: params.logprobs,
        cache,
        constraint: constraint.cloned(),
    }
}

/// Submits `params.n` sequences. If one is refused, those already queued are dropped (and so
/// cancelled) and the refusal is returned; a request too big for the KV budget is told which
/// of `registry`'s methods would fit it.
pub fn submit_all(
    engine: &Engine,
    registry: &CacheRegistry,
    prompt: &[u32],
    params: &ValidatedParams,
    cache: &ResolvedCache,
    prompt_param: &str,
    constraint: Option<&Constraint>,
) -> Result<Vec<GenerationStream>, ApiError> {
    (0..params.n.max(1))
        .map(|i| {
            let req = generation_request(prompt.to_vec(), params, cache.clone(), i, constraint);
            engine.submit(req).map_err(|e| match e {
                EngineError::ExceedsBudget { budget, tokens, .. } => {
                    let fits = methods_that_fit(engine, registry, tokens, budget);
                    ApiError::KvBudgetExceeded(format!("{e}. {fits}"))
                }
                e => ApiError::from_engine(e, prompt_param),
            })
        })
        .collect()
}

/// "turboquant-mse-3bit needs 0.30 GiB, ..." for the methods whose reservation for `tokens`
/// positions fits `budget`, least compressed first. VecInfer is left out: resolving it may start
/// a calibration run.
fn methods_that_fit(
    engine: &Engine,
    registry: &CacheRegistry,
    tokens: usize,
    budget: usize,
) -> String {
    let mut fits: Vec<(String, usize)> = registry
        .names()
        .into_iter()
        .filter(|name| registry.base_method(name) != Some("vecinfer"))
        .filter_map(|name| {
            let spec = CacheSpec {
                method: Some(name.clone()),
                bits: None,
            };
            let need = engine
                .kv_need(&registry.resolve(&spec).ok()?, tokens)
                .ok()?;
            (need <= budget).then_some((name, need))
        })
        .collect();
    if fits.is_empty() {
        return "No kv cache method of this server fits it: lower max_tokens or shorten the prompt."
            .into();
    }
    fits.sort_by_key(|(name, need)| (std::cmp::Reverse(*need), name.clone()));
    let list: Vec<String> = fits
        .iter()
        .map(|(name, need)| format!("{name} needs {}", human_bytes(*need)))
        .collect();
    format!(
        "Methods that would fit (header x-kv-cache-method): {}",
        list.join(", ")
    )
}

/// One choice, generated to the end.
#[derive(Debug, Clone)]
pub struct Collected {
    pub text: String,
    pub logprobs: Vec<LogprobInfo>,
    pub finish: FinishReason,
    pub usage: Usage,
}

/// Reads a stream to its `Finished` (recording usage metrics) or its error.
pub async fn collect(mut rx: GenerationStream, prompt_param: &str) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    while let Some(event) = rx.recv().await {
        match event {
            GenerationEvent::Delta {
                text: t, logprob, ..
            } => {
                text.push_str(&t);
                logprobs.extend(logprob);
            }
            GenerationEvent::Finished { reason, usage } => {
                record_usage(&usage);
                return Ok(Collected {
                    text,
                    logprobs,
                    finish: reason,
                    usage,
                });
            }
            GenerationEvent::Error(err) => return Err(ApiError::from_engine(err, prompt_param)),
        }
    }
    Err(ApiError::Unavailable(
        "the engine stopped before the request finished".into(),
    ))
}

/// Collects every choice concurrently; the first error wins (dropping the other receivers).
pub async fn collect_all(
    rxs: Vec<GenerationStream>,
    prompt_param: &str,
) -> Result<Vec<Collected>, ApiError> {
    futures::future::try_join_all(rxs.into_iter().map(|rx| collect(rx, prompt_param))).await
}

/// Merges the choices' receivers into one stream of `(choice index, event)`. The stream owns
/// the receivers: dropping it cancels every choice.
pub fn merge(
    rxs: Vec<GenerationStream>,
) -> impl Stream<Item = (usize, GenerationEvent)> + Send + Unpin + 'static {
    futures::stream::select_all(rxs.into_iter().enumerate().map(|(i, rx)| {
        UnboundedReceiverStream::new(rx)
            .map(move |event| (i, event))
            .boxed()
    }))
}

/// The metrics hook for streaming: records usage when a choice finishes.
pub fn record_finished(event: &GenerationEvent) {
    if let GenerationEvent::Finished { usage, .. } = event {
        record_usage(usage);
    }
}
