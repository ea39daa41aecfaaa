//! The worker thread: owns the model, admits queued requests, runs every running sequence's next
//! step in one batched forward pass (continuous batching, chunked prefill), samples, detokenizes,
//! matches stop strings, and drops a sequence (freeing its cache) as soon as its client is gone.

use crate::engine::{EngineConfig, Shared};
use crate::request::{
    FinishReason, GenerationEvent, GenerationRequest, LogprobInfo, TopLogprob, Usage,
};
use crate::sampling::{Sampler, logprobs};
use crate::stop::{StopMatcher, StopOutcome};
use crate::{EngineError, EngineStats};
use kvq_cache::LayerCaches;
use kvq_models::Tokenizer;
use kvq_models::model::{Model, SeqStep};
use kvq_models::tokenizer::IncrementalDecoder;
use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// A validated request on its way to the worker.
pub(crate) struct Job {
    pub(crate) req: GenerationRequest,
    pub(crate) max_tokens: usize,
    pub(crate) events: UnboundedSender<GenerationEvent>,
    pub(crate) submitted: Instant,
}

/// One running sequence.
struct Seq {
    job: Job,
    caches: LayerCaches,
    prefilled: usize,
    generated: Vec<u32>,
    sampler: Sampler,
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    first_token: Option<Instant>,
    peak_kv: usize,
}

pub(crate) struct Worker {
    model: Model,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    shared: Arc<Shared>,
    jobs: mpsc::Receiver<Job>,
    waiting: VecDeque<Job>,
    running: Vec<Seq>,
}

impl Worker {
    pub(crate) fn new(
        model: Model,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        shared: Arc<Shared>,
        jobs: mpsc::Receiver<Job>,
    ) -> Self {
        Self {
            model,
            tokenizer,
            config,
            shared,
            jobs,
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    /// Runs until every `Engine` handle is gone and no work is left.
    pub(crate) fn run(mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match self.jobs.recv() {
                    Ok(job) => self.waiting.push_back(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = self.jobs.try_recv() {
                self.waiting.push_back(job);
            }
            self.admit();
            // A client that went away stops its generation; its caches are dropped here.
            self.running.retain(|s| !s.job.events.is_closed());
            if !self.running.is_empty() {
                self.step();
            }
            self.publish_stats();
        }
    }

    fn admit(&mut self) {
        while self.running.len() < self.config.max_running {
            let Some(job) = self.waiting.pop_front() else {
                break;
            };
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            if job.events.is_closed() {
                continue;
            }
            match self.model.new_caches(job.req.cache.factory.as_ref()) {
                Ok(caches) => {
                    let sampler = Sampler::new(&job.req.sampling);
                    let stop = StopMatcher::new(&job.req.stop);
                    let decoder = IncrementalDecoder::new(self.tokenizer.clone(), true);
                    self.running.push(Seq {
                        job,
                        caches,
                        prefilled: 0,
                        generated: Vec::new(),
                        sampler,
                        decoder,
                        stop,
                        first_token: None,
                        peak_kv: 0,
                    });
                }
                Err(e) => {
                    let _ = job
                        .events
                        .send(GenerationEvent::Error(EngineError::Internal(e.to_string())));
                }
            }
        }
    }

    /// One batched forward pass over every running sequence, then sampling.
    fn step(&mut self) {
        let chunk = self.config.prefill_chunk.max(1);
        let mut inputs: Vec<Vec<u32>> = Vec::with_capacity(self.running.len());
        for s in &self.running {
            let prompt = &s.job.req.prompt;
            if s.prefilled < prompt.len() {
                let end = (s.prefilled + chunk).min(prompt.len());
                inputs.push(prompt[s.prefilled..end].to_vec());
            } else {
                // Decoding: feed the last sampled token.
                inputs.push(s.generated.last().copied().into_iter().collect());
            }
        }
        let model = &self.model;
        let running = &mut self.running;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut steps: Vec<SeqStep<'_>> = running
                .iter_mut()
                .zip(&inputs)
                .map(|(s, toks)| SeqStep {
                    tokens: toks,
                    cache: &mut s.caches,
                    all_logits: false,
                })
                .collect();
            model.forward(&mut steps)
        }));
        let logits = match result {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => return self.fail_all(e.to_string()),
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic in the model".into());
                tracing::error!("model step panicked: {msg}");
                return self.fail_all(msg);
            }
        };
        let mut finished = vec![false; self.running.len()];
        for (i, (seq, (input, logit))) in self
            .running
            .iter_mut()
            .zip(inputs.iter().zip(logits))
            .enumerate()
        {
            seq.peak_kv = seq.peak_kv.max(seq.caches.resident_bytes());
            if seq.prefilled < seq.job.req.prompt.len() {
                seq.prefilled += input.len();
                if seq.prefilled < seq.job.req.prompt.len() {
                    continue;
                }
            }
            let row = match logit.squeeze(0).and_then(|t| t.to_vec1::<f32>()) {
                Ok(r) => r,
                Err(e) => {
                    let _ = seq
                        .job
                        .events
                        .send(GenerationEvent::Error(EngineError::Internal(e.to_string())));
                    finished[i] = true;
                    continue;
                }
            };
            finished[i] = emit_token(seq, row, &self.tokenizer);
        }
        let mut i = 0;
        self.running.retain(|_| {
            i += 1;
            !finished[i - 1]
        });
    }

    fn fail_all(&mut self, msg: String) {
        for s in self.running.drain(..) {
            let _ = s
                .job
                .events
                .send(GenerationEvent::Error(EngineError::Internal(msg.clone())));
        }
    }

    fn publish_stats(&self) {
        let mut st = EngineStats {
            running: self.running.len(),
            ..EngineStats::default()
        };
        for s in &self.running {
            *st.kv_bytes_by_method
                .entry(s.caches.method().to_string())
                .or_default() += s.caches.resident_bytes();
        }
        if let Ok(mut g) = self.shared.stats.lock() {
            *g = st;
        }
    }
}

/// Samples the next token of `seq` from `logits`, sends its text, and says whether it finished.
fn emit_token(seq: &mut Seq, mut logits: Vec<f32>, tok: &Tokenizer) -> bool {
    let req = &seq.job.req;
    let lp = req.logprobs.map(|top| {
        // Logprobs of the model's own distribution, before penalties and temperature.
        let raw = logits.clone();
        (raw, top)
    });
    let id = seq.sampler.sample(&mut logits, &req.prompt, &seq.generated);
    seq.generated.push(id);
    let now = Instant::now();
    seq.first_token.get_or_insert(now);
    let logprob = lp.map(|(raw, top)| {
        let (chosen, tops) = logprobs(&raw, id, top);
        LogprobInfo {
            id,
            token: tok.decode(&[id], false).unwrap_or_default(),
            logprob: chosen,
            bytes: tok.token_bytes(id),
            top: tops
                .into_iter()
                .map(|(t, l)| TopLogprob {
                    id: t,
                    token: tok.decode(&[t], false).unwrap_or_default(),
                    logprob: l,
                    bytes: tok.token_bytes(t),
                })
                .collect(),
        }
    });
    let is_eos = req.stop_on_eos && tok.eos_token_ids().contains(&id);
    let text = if is_eos {
        String::new()
    } else {
        match seq.decoder.push(id) {
            Ok(t) => t,
            Err(e) => {
                let _ = seq
                    .job
                    .events
                    .send(GenerationEvent::Error(EngineError::Internal(e.to_string())));
                return true;
            }
        }
    };
    let (text, stopped) = match seq.stop.push(&text) {
        StopOutcome::Emit(t) => (t, is_eos),
        StopOutcome::Stopped(t) => (t, true),
    };
    let at_limit = seq.generated.len() >= seq.job.max_tokens;
    let mut text = text;
    if !stopped && at_limit {
        text.push_str(&seq.decoder.flush().unwrap_or_default());
        text.push_str(&seq.stop.flush());
    }
    let _ = seq.job.events.send(GenerationEvent::Delta {
        text,
        token: Some(id),
        logprob,
    });
    if !(stopped || at_limit) {
        return false;
    }
    let first = seq.first_token.unwrap_or(now);
    let usage = Usage {
        prompt_tokens: req.prompt.len(),
        completion_tokens: seq.generated.len(),
        kv_cache_bytes: seq.peak_kv.max(seq.caches.resident_bytes()),
        kv_cache_method: req.cache.name.clone(),
        time_to_first_token: first.duration_since(seq.job.submitted),
        decode_time: now.duration_since(first),
    };
    let reason = if stopped {
        FinishReason::Stop
    } else {
        FinishReason::Length
    };
    let _ = seq
        .job
        .events
        .send(GenerationEvent::Finished { reason, usage });
    true
}
