//! Prometheus metrics: installing the recorder once per process, the request-counting
//! middleware, per-request usage (tokens, time to first token, decode speed) and the engine
//! gauges refreshed on each scrape.

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use kvq_engine::{EngineStats, Usage};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

pub const REQUESTS_TOTAL: &str = "kvq_requests_total";
pub const PROMPT_TOKENS_TOTAL: &str = "kvq_prompt_tokens_total";
pub const COMPLETION_TOKENS_TOTAL: &str = "kvq_completion_tokens_total";
pub const TIME_TO_FIRST_TOKEN: &str = "kvq_time_to_first_token_seconds";
pub const DECODE_TOKENS_PER_SECOND: &str = "kvq_decode_tokens_per_second";
pub const KV_CACHE_BYTES: &str = "kvq_kv_cache_bytes";
pub const REQUESTS_RUNNING: &str = "kvq_requests_running";
pub const REQUESTS_WAITING: &str = "kvq_requests_waiting";
pub const KV_BUDGET_BYTES: &str = "kvq_kv_budget_bytes";
pub const KV_RESERVED_BYTES: &str = "kvq_kv_reserved_bytes";
pub const REQUESTS_ADMITTED: &str = "kvq_requests_admitted_total";
pub const REQUESTS_REJECTED: &str = "kvq_requests_rejected_total";
pub const PREFIX_CACHE_ENTRIES: &str = "kvq_prefix_cache_entries";
pub const PREFIX_CACHE_BYTES: &str = "kvq_prefix_cache_bytes";
pub const PREFIX_CACHE_HITS: &str = "kvq_prefix_cache_hits_total";
pub const PREFIX_CACHED_TOKENS: &str = "kvq_prefix_cached_tokens_total";
pub const KV_STORE_FILES: &str = "kvq_kv_store_prefixes";
pub const KV_STORE_BYTES: &str = "kvq_kv_store_bytes";
pub const KV_STORE_LOADS: &str = "kvq_kv_store_restored_total";
pub const KV_STORE_SAVES: &str = "kvq_kv_store_saved_total";
pub const KV_STORE_SKIPPED: &str = "kvq_kv_store_skipped_total";
pub const GRAMMAR_MASK_SECONDS: &str = "kvq_grammar_mask_seconds";

const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const MASK_BUCKETS: &[f64] = &[
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1,
];
const TPS_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder (once per process) and returns a handle to render it.
/// Safe to call any number of times. If another recorder was installed first, the returned
/// handle renders an empty, detached registry instead of failing.
pub fn install_metrics() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(TIME_TO_FIRST_TOKEN.into()), TTFT_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(DECODE_TOKENS_PER_SECOND.into()),
                        TPS_BUCKETS,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(GRAMMAR_MASK_SECONDS.into()),
                        MASK_BUCKETS,
                    )
                })
                .unwrap_or_else(|_| PrometheusBuilder::new());
            match builder.install_recorder() {
                Ok(handle) => {
                    describe();
                    handle
                }
                Err(err) => {
                    tracing::warn!(%err, "a metrics recorder was already installed; /metrics will be empty");
                    PrometheusBuilder::new().build_recorder().handle()
                }
            }
        })
        .clone()
}

fn describe() {
    metrics::describe_counter!(REQUESTS_TOTAL, "HTTP requests by endpoint and status");
    metrics::describe_counter!(PROMPT_TOKENS_TOTAL, "Prompt tokens of finished requests");
    metrics::describe_counter!(
        COMPLETION_TOKENS_TOTAL,
        "Generated tokens of finished requests"
    );
    metrics::describe_histogram!(
        TIME_TO_FIRST_TOKEN,
        metrics::Unit::Seconds,
        "From admission to the first generated token"
    );
    metrics::describe_histogram!(
        DECODE_TOKENS_PER_SECOND,
        "Generated tokens per second of decode, per request"
    );
    metrics::describe_gauge!(
        KV_CACHE_BYTES,
        metrics::Unit::Bytes,
        "Resident KV cache bytes of running sequences, by method"
    );
    metrics::describe_gauge!(REQUESTS_RUNNING, "Sequences generating now");
    metrics::describe_gauge!(REQUESTS_WAITING, "Requests queued for admission");
    metrics::describe_gauge!(
        KV_BUDGET_BYTES,
        metrics::Unit::Bytes,
        "KV bytes the running sequences may reserve together (absent: no limit)"
    );
    metrics::describe_gauge!(
        KV_RESERVED_BYTES,
        metrics::Unit::Bytes,
        "KV bytes reserved by running sequences (their worst case), by method"
    );
    metrics::describe_counter!(REQUESTS_ADMITTED, "Requests admitted to run");
    metrics::describe_counter!(
        REQUESTS_REJECTED,
        "Requests refused: reason queue_full (429) or kv_budget (400)"
    );
    metrics::describe_gauge!(
        PREFIX_CACHE_ENTRIES,
        "Ended sequences' caches held for prompts that start with their tokens"
    );
    metrics::describe_gauge!(
        PREFIX_CACHE_BYTES,
        metrics::Unit::Bytes,
        "Resident bytes of the held prefixes (inside the KV budget, beside the reservations)"
    );
    metrics::describe_counter!(
        PREFIX_CACHE_HITS,
        "Requests that continued from a held prefix or a running sequence"
    );
    metrics::describe_counter!(
        PREFIX_CACHED_TOKENS,
        "Prompt tokens not prefilled because a prefix was reused"
    );
    metrics::describe_gauge!(
        KV_STORE_FILES,
        "Prefixes saved in the KV store (--kv-store)"
    );
    metrics::describe_gauge!(
        KV_STORE_BYTES,
        metrics::Unit::Bytes,
        "Bytes the KV store's files take (at most --kv-store-max)"
    );
    metrics::describe_histogram!(
        GRAMMAR_MASK_SECONDS,
        metrics::Unit::Seconds,
        "Per request with a response_format: mean time per generated token spent masking the \
         logits to the grammar and following it"
    );
    metrics::describe_counter!(KV_STORE_LOADS, "Saved prefixes restored from the KV store");
    metrics::describe_counter!(KV_STORE_SAVES, "Held prefixes written to the KV store");
    metrics::describe_counter!(
        KV_STORE_SKIPPED,
        "KV store files skipped as unusable (another model or version, cut short, corrupted)"
    );
}

/// Middleware counting every response in `kvq_requests_total{endpoint,status}`. Unmatched
/// paths are counted as `endpoint="unmatched"` so random URLs cannot blow up the label set.
pub async fn track_requests(req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let response = next.run(req).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!(REQUESTS_TOTAL, "endpoint" => endpoint, "status" => status).increment(1);
    response
}

/// Records a finished request's token counts and timings.
pub fn record_usage(usage: &Usage) {
    metrics::counter!(PROMPT_TOKENS_TOTAL).increment(usage.prompt_tokens as u64);
    metrics::counter!(COMPLETION_TOKENS_TOTAL).increment(usage.completion_tokens as u64);
    metrics::histogram!(TIME_TO_FIRST_TOKEN).record(usage.time_to_first_token.as_secs_f64());
    if let Some(tps) = decode_tokens_per_second(usage) {
        metrics::histogram!(DECODE_TOKENS_PER_SECOND).record(tps);
    }
    if let Some((time, masks)) = usage.grammar
        && masks > 0
    {
        metrics::histogram!(GRAMMAR_MASK_SECONDS).record(time.as_secs_f64() / masks as f64);
    }
}

/// completion_tokens / decode_time, when decode took measurable time.
pub fn decode_tokens_per_second(usage: &Usage) -> Option<f64> {
    let secs = usage.decode_time.as_secs_f64();
    (secs > 0.0 && usage.completion_tokens > 0).then(|| usage.completion_tokens as f64 / secs)
}

/// Sets the engine gauges from a stats snapshot. `methods` are all registry names, so a method
/// with no running sequence reads 0 rather than its last value.
pub fn set_engine_gauges(stats: &EngineStats, methods: &[String]) {
    metrics::gauge!(REQUESTS_RUNNING).set(stats.running as f64);
    metrics::gauge!(REQUESTS_WAITING).set(stats.waiting as f64);
    for method in methods {
        if !stats.kv_bytes_by_method.contains_key(method) {
            metrics::gauge!(KV_CACHE_BYTES, "method" => method.clone()).set(0.0);
        }
    }
    for (method, bytes) in &stats.kv_bytes_by_method {
        metrics::gauge!(KV_CACHE_BYTES, "method" => method.clone()).set(*bytes as f64);
    }
    for method in methods {
        let reserved = stats
            .kv_reserved_by_method
            .get(method)
            .copied()
            .unwrap_or(0);
        metrics::gauge!(KV_RESERVED_BYTES, "method" => method.clone()).set(reserved as f64);
    }
    if let Some(budget) = stats.kv_budget {
        metrics::gauge!(KV_BUDGET_BYTES).set(budget as f64);
    }
    metrics::counter!(REQUESTS_ADMITTED).absolute(stats.admitted);
    metrics::counter!(REQUESTS_REJECTED, "reason" => "queue_full").absolute(stats.rejected.0);
    metrics::counter!(REQUESTS_REJECTED, "reason" => "kv_budget").absolute(stats.rejected.1);
    metrics::gauge!(PREFIX_CACHE_ENTRIES).set(stats.prefix_entries as f64);
    metrics::gauge!(PREFIX_CACHE_BYTES).set(stats.prefix_bytes as f64);
    metrics::counter!(PREFIX_CACHE_HITS).absolute(stats.prefix_hits);
    metrics::counter!(PREFIX_CACHED_TOKENS).absolute(stats.prefix_reused_tokens);
    if let Some(st) = &stats.store {
        metrics::gauge!(KV_STORE_FILES).set(st.files as f64);
        metrics::gauge!(KV_STORE_BYTES).set(st.bytes as f64);
        metrics::counter!(KV_STORE_LOADS).absolute(st.loads);
        metrics::counter!(KV_STORE_SAVES).absolute(st.saves);
        metrics::counter!(KV_STORE_SKIPPED).absolute(st.skipped);
    }
}
