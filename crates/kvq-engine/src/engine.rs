//! The engine handle (`Engine`): validates and admits requests, and hands them to the worker
//! thread (`worker.rs`) that owns the model.

use crate::EngineError;
use crate::grammar::{Constraint, GrammarCompiler, GrammarError, GrammarSpec};
use crate::request::{GenerationRequest, GenerationStream};
use crate::store::{KvStore, StoreStats};
use crate::worker::{Job, Msg, Worker};
use kvq_cache::{CacheGeometry, LayerCaches, ResolvedCache};
use kvq_models::{ChatTemplate, LoadedModel, ModelInfo, Tokenizer};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::time::Instant;

/// Scheduler limits.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Sequences generating at once; more wait in a queue.
    pub max_running: usize,
    /// Requests allowed to wait; past that `submit` answers `Overloaded`.
    pub max_waiting: usize,
    /// Prompt tokens processed per sequence per step (chunked prefill keeps decodes flowing).
    pub prefill_chunk: usize,
    /// Bytes the KV caches of running sequences may reserve together (`None`: no limit). A
    /// sequence reserves its worst case, prompt plus max_tokens under its own method
    /// (`KvCache::reserve_bytes`), when admitted.
    pub kv_budget: Option<usize>,
    /// Bytes the prefix cache may hold (`None`: off): ended sequences' caches, kept for
    /// prompts that start with the same tokens under the same cache configuration, inside
    /// the KV budget (evicted, least recently used first, before a request would wait).
    pub prefix_cache: Option<usize>,
    /// Where held prefixes are saved across restarts (`None`: nowhere): evicted ones and, at
    /// [`Engine::persist`], all (see `store`). Needs the prefix cache.
    pub kv_store: Option<Arc<KvStore>>,
}

/// The prefix cache's default limit.
pub const DEFAULT_PREFIX_CACHE: usize = 1 << 30;

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_running: 16,
            max_waiting: 256,
            prefill_chunk: 512,
            kv_budget: None,
            prefix_cache: Some(DEFAULT_PREFIX_CACHE),
            kv_store: None,
        }
    }
}

/// A snapshot of what the engine holds.
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    /// Resident KV bytes of all running sequences, by cache method.
    pub kv_bytes_by_method: BTreeMap<String, usize>,
    /// Bytes the running sequences have reserved, by cache method.
    pub kv_reserved_by_method: BTreeMap<String, usize>,
    /// The budget the reservations share (`None`: no limit).
    pub kv_budget: Option<usize>,
    /// Requests admitted to run since start.
    pub admitted: u64,
    /// Requests refused since start: (the wait queue was full, they could never fit the budget).
    pub rejected: (u64, u64),
    /// Prefixes the prefix cache holds, and their resident bytes (beside the running ones').
    pub prefix_entries: usize,
    pub prefix_bytes: usize,
    /// Requests that continued from a held prefix or a running sequence since start, and the
    /// prompt tokens they did not prefill.
    pub prefix_hits: u64,
    pub prefix_reused_tokens: u64,
    /// The KV store's files and what it did, when there is one.
    pub store: Option<StoreStats>,
}

impl EngineStats {
    /// Bytes reserved by every running sequence.
    pub fn kv_reserved(&self) -> usize {
        self.kv_reserved_by_method.values().sum()
    }

    /// Resident bytes of every running sequence.
    pub fn kv_resident(&self) -> usize {
        self.kv_bytes_by_method.values().sum()
    }
}

/// A cheap, clonable handle to the engine.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

pub(crate) struct Shared {
    pub(crate) waiting: AtomicUsize,
    pub(crate) stats: Mutex<EngineStats>,
    pub(crate) rejected_full: AtomicU64,
    pub(crate) rejected_budget: AtomicU64,
}

struct Inner {
    info: ModelInfo,
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    config: EngineConfig,
    /// Each layer's attention geometry, for counting a request's KV bytes before it runs.
    geoms: Vec<CacheGeometry>,
    jobs: Mutex<mpsc::Sender<Msg>>,
    shared: Arc<Shared>,
    /// Built on the first request with a response format.
    grammars: OnceLock<Result<GrammarCompiler, GrammarError>>,
}

impl Engine {
    /// Starts the worker thread that owns `model`.
    pub fn start(model: LoadedModel, config: EngineConfig) -> Engine {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            waiting: AtomicUsize::new(0),
            stats: Mutex::new(EngineStats {
                kv_budget: config.kv_budget,
                ..EngineStats::default()
            }),
            rejected_full: AtomicU64::new(0),
            rejected_budget: AtomicU64::new(0),
        });
        let LoadedModel {
            model,
            tokenizer,
            template,
            info,
        } = model;
        let geoms = model.cache_geometries();
        let worker = Worker::new(model, tokenizer.clone(), config.clone(), shared.clone(), rx);
        std::thread::Builder::new()
            .name("kvq-engine".into())
            .spawn(move || worker.run())
            .map(drop)
            .unwrap_or_else(|e| tracing::error!("could not start the engine thread: {e}"));
        Engine {
            inner: Arc::new(Inner {
                info,
                tokenizer,
                template,
                config,
                geoms,
                jobs: Mutex::new(tx),
                shared,
                grammars: OnceLock::new(),
            }),
        }
    }

    /// The loaded model's description.
    pub fn model_info(&self) -> &ModelInfo {
        &self.inner.info
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.inner.tokenizer
    }

    /// A constraint for `spec` over this model's vocabulary. The first call builds the
    /// vocabulary's token trie (tens of milliseconds); call it off the async runtime.
    pub fn compile_grammar(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        let compiler = self
            .inner
            .grammars
            .get_or_init(|| GrammarCompiler::new(self.inner.tokenizer.clone()));
        match compiler {
            Ok(c) => c.compile(spec),
            Err(e) => Err(e.clone()),
        }
    }

    /// The model's chat template (ChatML when the model has none).
    pub fn chat_template(&self) -> &ChatTemplate {
        &self.inner.template
    }

    /// The scheduler's limits.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// The KV bytes a sequence of `tokens` positions under `cache` reserves: the sum over layers
    /// of [`kvq_cache::KvCache::reserve_bytes`], prompt chunks of the engine's size (with the
    /// prefix cache on, counting the fp16 rows a compressed cache keeps to be continued from).
    pub fn kv_need(&self, cache: &ResolvedCache, tokens: usize) -> Result<usize, EngineError> {
        let mut caches = LayerCaches::new(cache.factory.as_ref(), &self.inner.geoms)?;
        if self.inner.config.prefix_cache.is_some() {
            // As the worker builds them: ready to be continued from a little before their end.
            caches.allow_rewind(crate::prefix::REWIND);
        }
        Ok(caches.reserve_bytes(tokens, self.inner.config.prefill_chunk.max(1)))
    }

    /// Checks `req` against the model (prompt and max_tokens within the context, token ids in
    /// the vocabulary, sane sampling values) and the KV budget; returns how many tokens it may
    /// generate and the KV bytes it reserves.
    pub fn validate(&self, req: &GenerationRequest) -> Result<(usize, usize), EngineError> {
        let max_tokens = self.validate_tokens(req)?;
        let tokens = req.prompt.len() + max_tokens;
        let needs = self.kv_need(&req.cache, tokens)?;
        if let Some(budget) = self.inner.config.kv_budget
            && needs > budget
        {
            self.inner
                .shared
                .rejected_budget
                .fetch_add(1, Ordering::Relaxed);
            return Err(EngineError::ExceedsBudget {
                needs,
                budget,
                tokens,
                method: req.cache.name.clone(),
            });
        }
        Ok((max_tokens, needs))
    }

    fn validate_tokens(&self, req: &GenerationRequest) -> Result<usize, EngineError> {
        let max = self.inner.info.context_length;
        let prompt = req.prompt.len();
        if prompt == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt >= max {
            return Err(EngineError::ContextLengthExceeded { prompt, max });
        }
        let vocab = self.inner.info.vocab_size;
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(
                "prompt",
                format!("token id {bad} is not in the vocabulary (size {vocab})"),
            ));
        }
        let s = &req.sampling;
        if let Some(&(bad, _)) = s.logit_bias.iter().find(|&&(t, _)| t as usize >= vocab) {
            return Err(invalid(
                "logit_bias",
                format!(
                    "logit_bias names token id {bad}, which is not in the vocabulary (size {vocab})"
                ),
            ));
        }
        if let Some(&(t, b)) = s.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return Err(invalid(
                "logit_bias",
                format!("logit_bias for token {t} must be finite; got {b}"),
            ));
        }
        let checks = [
            (
                s.temperature.is_finite() && s.temperature >= 0.0,
                "temperature",
                "must be >= 0",
            ),
            (
                s.top_p > 0.0 && s.top_p <= 1.0,
                "top_p",
                "must be in (0, 1]",
            ),
            (
                s.min_p >= 0.0 && s.min_p <= 1.0,
                "min_p",
                "must be in [0, 1]",
            ),
            (
                s.repetition_penalty.is_finite() && s.repetition_penalty > 0.0,
                "repetition_penalty",
                "must be > 0",
            ),
            (
                s.frequency_penalty.is_finite(),
                "frequency_penalty",
                "must be finite",
            ),
            (
                s.presence_penalty.is_finite(),
                "presence_penalty",
                "must be finite",
            ),
        ];
        if let Some((_, param, msg)) = checks.iter().find(|c| !c.0) {
            return Err(invalid(param, format!("{param} {msg}")));
        }
        match req.max_tokens {
            Some(0) => Err(invalid(
                "max_tokens",
                "max_tokens must be at least 1".into(),
            )),
            Some(m) if prompt + m > max => Err(EngineError::MaxTokensTooLarge {
                prompt,
                max,
                requested: m,
            }),
            Some(m) => Ok(m),
            None => Ok(max - prompt),
        }
    }

    /// Validates `req` and queues it. The returned stream yields `Delta`s then one `Finished`
    /// or `Error`; dropping it cancels the request and frees its cache.
    pub fn submit(&self, req: GenerationRequest) -> Result<GenerationStream, EngineError> {
        let (max_tokens, kv_need) = self.validate(&req)?;
        let shared = &self.inner.shared;
        let waiting = shared.waiting.fetch_add(1, Ordering::SeqCst);
        if waiting >= self.inner.config.max_waiting {
            shared.waiting.fetch_sub(1, Ordering::SeqCst);
            shared.rejected_full.fetch_add(1, Ordering::Relaxed);
            return Err(EngineError::Overloaded(format!(
                "{waiting} requests are already waiting"
            )));
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            req,
            max_tokens,
            kv_need,
            events: tx,
            submitted: Instant::now(),
        };
        let sent = self
            .inner
            .jobs
            .lock()
            .map_err(|_| EngineError::Shutdown)?
            .send(Msg::Job(Box::new(job)));
        if sent.is_err() {
            shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::Shutdown);
        }
        Ok(rx)
    }

    /// Saves every held prefix the KV store does not hold yet and waits until they are on
    /// disk (at shutdown, once the open requests are done); returns how many were saved. Blocks:
    /// call it off the async runtime.
    pub fn persist(&self) -> usize {
        let (tx, rx) = mpsc::channel();
        let sent = match self.inner.jobs.lock() {
            Ok(jobs) => jobs.send(Msg::Persist(tx)).is_ok(),
            Err(_) => false,
        };
        match sent {
            true => rx.recv().unwrap_or(0),
            false => 0,
        }
    }

    /// What is running and waiting, and the KV bytes held.
    pub fn stats(&self) -> EngineStats {
        let mut s = self
            .inner
            .shared
            .stats
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default();
        let shared = &self.inner.shared;
        s.waiting = shared.waiting.load(Ordering::SeqCst);
        s.rejected = (
            shared.rejected_full.load(Ordering::Relaxed),
            shared.rejected_budget.load(Ordering::Relaxed),
        );
        s
    }
}

fn invalid(param: &str, message: String) -> EngineError {
    EngineError::InvalidParameter {
        param: param.to_string(),
        message,
    }
}
