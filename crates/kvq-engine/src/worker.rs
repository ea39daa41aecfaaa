//! The worker thread: owns the model, admits queued requests, runs every running sequence's next
//! step in one batched forward pass (continuous batching, chunked prefill), hands each sequence
//! its logits (`sequence.rs` masks, samples, decodes and matches stops), and drops a sequence
//! (freeing its cache) as soon as its client is gone.
//! A sequence that ends (or whose client left) leaves its caches in the prefix cache
//! (`prefix/`), from which a later prompt with the same first tokens continues.

use crate::engine::{EngineConfig, Shared};
use crate::prefix::{self, MIN_REUSE, PrefixCache, REWIND};
use crate::request::{GenerationEvent, GenerationRequest};
use crate::sampling::Sampler;
use crate::sequence::{After, Seq, emit_token};
use crate::stop::StopMatcher;
use crate::{EngineError, EngineStats};
use kvq_cache::LayerCaches;
use kvq_models::model::{Model, SeqStep};
use kvq_models::tokenizer::IncrementalDecoder;
use kvq_models::{ModelError, Tokenizer};
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
    /// The KV bytes it reserves when admitted (`Engine::kv_need`).
    pub(crate) kv_need: usize,
    pub(crate) events: UnboundedSender<GenerationEvent>,
    pub(crate) submitted: Instant,
}

/// What the engine handle sends the worker.
pub(crate) enum Msg {
    Job(Box<Job>),
    /// Save every held prefix to the KV store and answer how many (`Engine::persist`).
    Persist(mpsc::Sender<usize>),
}

pub(crate) struct Worker {
    model: Model,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    shared: Arc<Shared>,
    jobs: mpsc::Receiver<Msg>,
    waiting: VecDeque<Job>,
    running: Vec<Seq>,
    admitted: u64,
    /// Ended sequences' caches (`None`: the prefix cache is off).
    prefixes: Option<PrefixCache>,
}

impl Worker {
    pub(crate) fn new(
        model: Model,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        shared: Arc<Shared>,
        jobs: mpsc::Receiver<Msg>,
    ) -> Self {
        Self {
            model,
            tokenizer,
            prefixes: config
                .prefix_cache
                .map(|b| PrefixCache::new(b).with_store(config.kv_store.clone())),
            config,
            shared,
            jobs,
            waiting: VecDeque::new(),
            running: Vec::new(),
            admitted: 0,
        }
    }

    /// Runs until every `Engine` handle is gone and no work is left.
    pub(crate) fn run(mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                crate::release::free_heap_to_os();
                match self.jobs.recv() {
                    Ok(msg) => self.take(msg),
                    Err(_) => {
                        // Every handle is gone: what is held goes to the store.
                        self.persist();
                        return;
                    }
                }
            }
            while let Ok(msg) = self.jobs.try_recv() {
                self.take(msg);
            }
            self.admit();
            // A client that went away stops its generation; its caches go to the prefix cache
            // (it may send the same conversation again) or are dropped.
            let gone: Vec<After> = self
                .running
                .iter()
                .map(|s| match s.job.events.is_closed() {
                    true => After::Ended,
                    false => After::Runs,
                })
                .collect();
            self.retire(&gone);
            if !self.running.is_empty() {
                self.step();
            }
            self.publish_stats();
        }
    }

    fn take(&mut self, msg: Msg) {
        match msg {
            Msg::Job(job) => self.waiting.push_back(*job),
            Msg::Persist(done) => {
                let n = self.persist();
                let _ = done.send(n);
            }
        }
    }

    /// Saves the held prefixes to the KV store (`PrefixCache::persist`).
    fn persist(&mut self) -> usize {
        let n = self.prefixes.as_mut().map_or(0, PrefixCache::persist);
        self.publish_stats();
        n
    }

    /// Bytes the running sequences have reserved.
    fn reserved(&self) -> usize {
        self.running.iter().map(|s| s.reserved).sum()
    }

    /// Evicts held prefixes until they fit beside the running sequences' reservations in the
    /// KV budget.
    fn fit_held(&mut self) {
        let room = match self.config.kv_budget {
            Some(b) => b.saturating_sub(self.reserved()),
            None => usize::MAX,
        };
        if let Some(p) = &mut self.prefixes {
            p.evict_to(room);
        }
    }

    /// Removes the sequences whose entry in `after` is not `Runs`, keeping the caches of those
    /// that ended in the prefix cache.
    fn retire(&mut self, after: &[After]) {
        if after.iter().all(|a| *a == After::Runs) {
            return;
        }
        let chunk = self.config.prefill_chunk.max(1);
        let mut ended = Vec::new();
        for (s, a) in std::mem::take(&mut self.running).into_iter().zip(after) {
            match a {
                After::Runs => self.running.push(s),
                After::Failed => {}
                After::Ended => {
                    let (tokens, exact) = (s.held_tokens(), s.exact_upto(chunk));
                    let prefilled = s.prefilled.min(tokens.len());
                    ended.push((
                        s.job.req.cache.key.clone(),
                        tokens,
                        (prefilled, exact),
                        s.caches,
                    ));
                }
            }
        }
        if let Some(p) = &mut self.prefixes {
            for (key, tokens, exact, caches) in ended {
                p.insert(key, tokens, exact, caches);
            }
        }
        self.fit_held();
    }

    /// Where a job's caches come from: they, how many of its prompt positions they hold, its
    /// `exact_limit`, and where its prefill holds a copy for prompts sharing its prefix
    /// (`prefix::snapshot_point`: where the longest common prefix with a held or running
    /// sequence reaches past what it could reuse, as a compressed cache's does; never after a
    /// reuse of decoded positions, which a fresh prefill does not compute).
    fn start_caches(&mut self, job: &Job) -> kvq_models::Result<Start> {
        let mut start = self.reuse(job)?;
        let chunk = self.config.prefill_chunk.max(1);
        // A copy claims every position exact: not after reused decoded ones.
        if let (Some(prefixes), None) = (&self.prefixes, start.exact_limit) {
            let (key, prompt) = (&job.req.cache.key, &job.req.prompt);
            let common = self
                .running
                .iter()
                .filter(|s| &s.job.req.cache.key == key)
                .map(|s| prefix::reusable(&s.held_tokens(), prompt))
                .chain([prefixes.longest_common(key, prompt)])
                .max()
                .unwrap_or(0);
            start.snapshot_at = prefix::snapshot_point(common, start.cached, prompt.len(), chunk);
        }
        Ok(start)
    }

    /// The caches a job starts from, how many of its prompt positions they hold, and its
    /// `exact_limit`: the longest usable prefix among the held ones and the running sequences'
    /// under its cache key (planned by `prefix::plan`), else fresh caches.
    fn reuse(&mut self, job: &Job) -> kvq_models::Result<Start> {
        let chunk = self.config.prefill_chunk.max(1);
        let Some(prefixes) = &mut self.prefixes else {
            return Ok(Start::fresh(
                self.model.new_caches(job.req.cache.factory.as_ref())?,
            ));
        };
        let (key, prompt) = (&job.req.cache.key, &job.req.prompt);
        let running = self
            .running
            .iter()
            .enumerate()
            .filter(|(_, s)| &s.job.req.cache.key == key)
            .map(|(i, s)| {
                let tokens = s.held_tokens();
                let can = |n: usize| s.caches.can_truncate(n);
                let held = prefix::Held {
                    tokens: &tokens,
                    prefilled: s.prefilled.min(tokens.len()),
                    exact: s.exact_upto(chunk),
                    can_truncate: &can,
                };
                (i, prefix::plan(&held, prompt, chunk))
            })
            .filter(|&(_, (n, _))| n >= MIN_REUSE)
            .max_by_key(|&(_, (n, _))| n);
        let mut held = prefixes.best(key, prompt, chunk);
        if prefixes.store().is_some() {
            // A saved prefix serving more than memory does is restored and held first.
            let in_memory = running
                .map_or(0, |(_, (n, _))| n)
                .max(held.map_or(0, |m| m.n));
            let geoms = self.model.cache_geometries();
            let at = (
                job.req.cache.factory.as_ref(),
                geoms.as_slice(),
                self.model.device(),
            );
            prefixes.restore(key, prompt, chunk, in_memory, at);
            held = prefixes.best(key, prompt, chunk);
        }
        let mut found = None;
        if let Some((i, (n, exact))) = running.filter(|&(_, (n, _))| held.is_none_or(|h| n > h.n)) {
            found = self.running[i]
                .caches
                .fork()
                .ok()
                .and_then(|c| prefix::continue_from(c, n))
                .map(|c| (c, n, exact));
        }
        if found.is_none()
            && let Some(m) = held
        {
            found = prefixes.take(m).map(|c| (c, m.n, m.exact));
        }
        let Some((mut caches, n, exact)) = found else {
            let mut caches = self.model.new_caches(job.req.cache.factory.as_ref())?;
            caches.allow_rewind(REWIND);
            return Ok(Start::fresh(caches));
        };
        prefixes.count_hit(n);
        caches.allow_rewind(REWIND);
        Ok(Start {
            caches,
            cached: n,
            exact_limit: (exact < n).then_some(exact),
            snapshot_at: None,
        })
    }

    /// Admits waiting requests in order while they fit: under `max_running`, and their KV
    /// reservation beside the running ones' within the budget. The first that does not fit
    /// waits at the head of the queue and nothing passes it, so a stream of small requests
    /// cannot starve a large one. (One that fits the budget alone always runs once nothing
    /// else does; `validate` refused those that never fit.)
    fn admit(&mut self) {
        while self.running.len() < self.config.max_running {
            let Some(job) = self.waiting.front() else {
                break;
            };
            if job.events.is_closed() {
                self.waiting.pop_front();
                self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            // Held prefixes never make a request wait: they are evicted for it below.
            if let Some(budget) = self.config.kv_budget
                && !self.running.is_empty()
                && self.reserved() + job.kv_need > budget
            {
                break;
            }
            let Some(mut job) = self.waiting.pop_front() else {
                break;
            };
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            match self.start_caches(&job) {
                Ok(Start {
                    caches,
                    cached,
                    exact_limit,
                    snapshot_at,
                }) => {
                    let total = job.req.prompt.len() + job.max_tokens;
                    let job_need = job
                        .kv_need
                        .max(caches.reserve_bytes(total, self.config.prefill_chunk.max(1)));
                    let sampler = Sampler::new(&job.req.sampling);
                    let constraint = job.req.constraint.take();
                    let stop = StopMatcher::new(&job.req.stop);
                    let decoder = IncrementalDecoder::new(self.tokenizer.clone(), true);
                    self.running.push(Seq {
                        job,
                        caches,
                        prefilled: cached,
                        generated: Vec::new(),
                        sampler,
                        constraint,
                        decoder,
                        stop,
                        first_token: None,
                        peak_kv: 0,
                        reserved: job_need,
                        cached,
                        exact_limit,
                        snapshot_at,
                    });
                    self.admitted += 1;
                    self.fit_held();
                }
                Err(e) => {
                    let _ = job.events.send(GenerationEvent::Error(engine_error(e)));
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
                // Where a fresh prefill's chunk ends, also after a reused prefix; cut once
                // where a copy is held for prompts sharing this prefix.
                let mut end = prefix::chunk_end(s.prefilled, prompt.len(), chunk);
                if let Some(at) = s.snapshot_at.filter(|&at| at > s.prefilled) {
                    end = end.min(at);
                }
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
            model.forward_each(&mut steps)
        }));
        // A sequence's own failure (its cache erring) is in its slot; only what fails the batch
        // as a whole (a dense layer, a panic) fails every sequence.
        let logits = match result {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                tracing::error!("model step failed: {e}");
                return self.fail_all(e.to_string());
            }
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
        let mut after = vec![After::Runs; self.running.len()];
        let mut branches = Vec::new();
        for (i, (seq, (input, logit))) in self
            .running
            .iter_mut()
            .zip(inputs.iter().zip(logits))
            .enumerate()
        {
            let logit = match logit {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!("sequence failed: {e}");
                    let _ = seq.job.events.send(GenerationEvent::Error(engine_error(e)));
                    after[i] = After::Failed;
                    continue;
                }
            };
            seq.peak_kv = seq.peak_kv.max(seq.caches.resident_bytes());
            let need = seq.caches.reserve_bytes(seq.max_len(), chunk);
            if need > seq.reserved {
                tracing::debug!(
                    "a sequence's KV reservation grew from {} to {need} bytes",
                    seq.reserved
                );
                seq.reserved = need;
            }
            if seq.prefilled < seq.job.req.prompt.len() {
                seq.prefilled += input.len();
                if seq.snapshot_at == Some(seq.prefilled) {
                    seq.snapshot_at = None;
                    match seq.caches.fork() {
                        Ok(c) => branches.push((
                            seq.job.req.cache.key.clone(),
                            seq.job.req.prompt[..seq.prefilled].to_vec(),
                            c,
                        )),
                        Err(e) => tracing::debug!("could not copy a shared prefix: {e}"),
                    }
                }
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
                    after[i] = After::Failed;
                    continue;
                }
            };
            after[i] = emit_token(seq, row, &self.tokenizer);
        }
        if let Some(p) = &mut self.prefixes {
            for (key, tokens, caches) in branches {
                tracing::debug!("holding a copy of a {}-token shared prefix", tokens.len());
                p.insert_branch(key, tokens, caches);
            }
        }
        self.retire(&after);
        // Reservations may have grown: held prefixes give way.
        self.fit_held();
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
            kv_budget: self.config.kv_budget,
            admitted: self.admitted,
            ..EngineStats::default()
        };
        if let Some(p) = &self.prefixes {
            st.prefix_entries = p.len();
            st.prefix_bytes = p.bytes();
            st.prefix_hits = p.hits;
            st.prefix_reused_tokens = p.reused_tokens;
            st.store = p.store().map(|s| s.stats());
        }
        for s in &self.running {
            let method = s.caches.method().to_string();
            *st.kv_reserved_by_method.entry(method.clone()).or_default() += s.reserved;
            *st.kv_bytes_by_method.entry(method).or_default() += s.caches.resident_bytes();
        }
        if let Ok(mut g) = self.shared.stats.lock() {
            *g = st;
        }
    }
}

/// What a job starts from (`Worker::start_caches`).
struct Start {
    caches: LayerCaches,
    cached: usize,
    exact_limit: Option<usize>,
    snapshot_at: Option<usize>,
}

impl Start {
    fn fresh(caches: LayerCaches) -> Self {
        Self {
            caches,
            cached: 0,
            exact_limit: None,
            snapshot_at: None,
        }
    }
}

/// The engine's error for a model error: a cache's own stays typed.
fn engine_error(e: ModelError) -> EngineError {
    match e {
        ModelError::Cache(c) => EngineError::Cache(c),
        other => EngineError::Internal(other.to_string()),
    }
}
