//! The engine handle (`Engine`): validates and admits requests, and hands them to the worker
//! thread (`worker.rs`) that owns the model.

use crate::EngineError;
use crate::request::{GenerationRequest, GenerationStream};
use crate::worker::{Job, Worker};
use kvq_models::{ChatTemplate, LoadedModel, ModelInfo, Tokenizer};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
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
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_running: 16,
            max_waiting: 256,
            prefill_chunk: 512,
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
}

/// A cheap, clonable handle to the engine.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

pub(crate) struct Shared {
    pub(crate) waiting: AtomicUsize,
    pub(crate) stats: Mutex<EngineStats>,
}

struct Inner {
    info: ModelInfo,
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    config: EngineConfig,
    jobs: Mutex<mpsc::Sender<Job>>,
    shared: Arc<Shared>,
}

impl Engine {
    /// Starts the worker thread that owns `model`.
    pub fn start(model: LoadedModel, config: EngineConfig) -> Engine {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            waiting: AtomicUsize::new(0),
            stats: Mutex::new(EngineStats::default()),
        });
        let LoadedModel {
            model,
            tokenizer,
            template,
            info,
        } = model;
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
                jobs: Mutex::new(tx),
                shared,
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

    /// The model's chat template (ChatML when the model has none).
    pub fn chat_template(&self) -> &ChatTemplate {
        &self.inner.template
    }

    /// Checks `req` against the model (prompt and max_tokens within the context, token ids in
    /// the vocabulary, sane sampling values) and returns how many tokens it may generate.
    pub fn validate(&self, req: &GenerationRequest) -> Result<usize, EngineError> {
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
        let max_tokens = self.validate(&req)?;
        let shared = &self.inner.shared;
        let waiting = shared.waiting.fetch_add(1, Ordering::SeqCst);
        if waiting >= self.inner.config.max_waiting {
            shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::Overloaded(format!(
                "{waiting} requests are already waiting"
            )));
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            req,
            max_tokens,
            events: tx,
            submitted: Instant::now(),
        };
        let sent = self
            .inner
            .jobs
            .lock()
            .map_err(|_| EngineError::Shutdown)?
            .send(job);
        if sent.is_err() {
            shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::Shutdown);
        }
        Ok(rx)
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
        s.waiting = self.inner.shared.waiting.load(Ordering::SeqCst);
        s
    }
}

fn invalid(param: &str, message: String) -> EngineError {
    EngineError::InvalidParameter {
        param: param.to_string(),
        message,
    }
}
