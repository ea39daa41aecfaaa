//! One running sequence: its caches, sampler, grammar, decoder and stop state, and what each
//! sampled token does to it (`emit_token`: mask, sample, follow the grammar, decode, match
//! stops, send the text and, at the end, the usage).

use crate::EngineError;
use crate::grammar::{Constraint, Followed};
use crate::prefix;
use crate::request::{FinishReason, GenerationEvent, LogprobInfo, TopLogprob, Usage};
use crate::sampling::{Sampler, logprobs};
use crate::stop::{StopMatcher, StopOutcome};
use crate::worker::Job;
use kvq_cache::LayerCaches;
use kvq_models::Tokenizer;
use kvq_models::tokenizer::IncrementalDecoder;
use std::time::Instant;

/// One running sequence.
pub(crate) struct Seq {
    pub(crate) job: Job,
    pub(crate) caches: LayerCaches,
    pub(crate) prefilled: usize,
    pub(crate) generated: Vec<u32>,
    pub(crate) sampler: Sampler,
    /// The response format's grammar, if the request has one.
    pub(crate) constraint: Option<Constraint>,
    pub(crate) decoder: IncrementalDecoder,
    pub(crate) stop: StopMatcher,
    pub(crate) first_token: Option<Instant>,
    pub(crate) peak_kv: usize,
    /// KV bytes reserved: its worst case, raised if a step finds it larger (a layer found
    /// sharp keeps its keys in fp16).
    pub(crate) reserved: usize,
    /// Prompt positions it continued from instead of prefilling (a held prefix's).
    pub(crate) cached: usize,
    /// `Some(x)`: it continued from positions of which only the first `x` are what a fresh
    /// prefill computes (a reply's decoded ones followed); `None`: all its prefill is.
    pub(crate) exact_limit: Option<usize>,
    /// Where its prefill stops once to hold a copy of its caches for other prompts sharing
    /// that prefix (`prefix::snapshot_point`); `None` once done, or when none is due.
    pub(crate) snapshot_at: Option<usize>,
}

impl Seq {
    /// Positions this sequence may reach: prompt plus max_tokens.
    pub(crate) fn max_len(&self) -> usize {
        self.job.req.prompt.len() + self.job.max_tokens
    }

    /// Positions of its caches a fresh prefill of a prompt starting with them computes the
    /// same (see `prefix/mod.rs`).
    pub(crate) fn exact_upto(&self, chunk: usize) -> usize {
        if let Some(x) = self.exact_limit {
            return x;
        }
        let p = self.job.req.prompt.len();
        match self.prefilled < p {
            // Every chunk so far ended where a fresh prefill's does.
            true => self.prefilled,
            false => prefix::exact_prefix(p, chunk),
        }
    }

    /// The token ids of the positions its caches hold: the prompt's, then the generated ones
    /// fed back (the last sampled token is not in the caches yet).
    pub(crate) fn held_tokens(&self) -> Vec<u32> {
        let (n, prompt) = (self.caches.len(), &self.job.req.prompt);
        let mut t = prompt[..n.min(prompt.len())].to_vec();
        let fed = n.saturating_sub(prompt.len()).min(self.generated.len());
        t.extend_from_slice(&self.generated[..fed]);
        t
    }
}

/// What becomes of a sequence after a step.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    /// It runs on.
    Runs,
    /// It ended normally: its caches may serve a later prompt.
    Ended,
    /// It failed: its caches are dropped.
    Failed,
}

/// Samples the next token of `seq` from `logits`, sends its text, and says whether it runs on.
pub(crate) fn emit_token(seq: &mut Seq, mut logits: Vec<f32>, tok: &Tokenizer) -> After {
    let req = &seq.job.req;
    let lp = req.logprobs.map(|top| {
        // Logprobs of the model's own distribution, before penalties and temperature.
        let raw = logits.clone();
        (raw, top)
    });
    if let Some(c) = seq.constraint.as_mut()
        && let Err(e) = c.mask(&mut logits)
    {
        return fail(seq, grammar_error(e));
    }
    let id = seq.sampler.sample(&mut logits, &req.prompt, &seq.generated);
    seq.generated.push(id);
    let eos_token = tok.eos_token_ids().contains(&id);
    // A grammar ends the reply when it completes; an end of sequence it allowed ends it too.
    let mut grammar_done = false;
    if let Some(c) = seq.constraint.as_mut() {
        match c.follow(id) {
            Ok(followed) => grammar_done = followed == Followed::Complete || eos_token,
            Err(e) => return fail(seq, grammar_error(e)),
        }
    }
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
    let req = &seq.job.req;
    let is_eos = (req.stop_on_eos || seq.constraint.is_some()) && eos_token;
    let text = if is_eos {
        String::new()
    } else {
        match seq.decoder.push(id) {
            Ok(t) => t,
            Err(e) => return fail(seq, EngineError::Internal(e.to_string())),
        }
    };
    let (text, stopped) = match seq.stop.push(&text) {
        StopOutcome::Emit(t) => (t, is_eos || grammar_done),
        StopOutcome::Stopped(t) => (t, true),
    };
    let at_limit = seq.generated.len() >= seq.job.max_tokens;
    let mut text = text;
    if grammar_done || (!stopped && at_limit) {
        text.push_str(&seq.decoder.flush().unwrap_or_default());
        text.push_str(&seq.stop.flush());
    }
    let _ = seq.job.events.send(GenerationEvent::Delta {
        text,
        token: Some(id),
        logprob,
    });
    if !(stopped || at_limit) {
        return After::Runs;
    }
    let first = seq.first_token.unwrap_or(now);
    let usage = Usage {
        prompt_tokens: req.prompt.len(),
        cached_tokens: seq.cached,
        completion_tokens: seq.generated.len(),
        kv_cache_bytes: seq.peak_kv.max(seq.caches.resident_bytes()),
        kv_cache_method: req.cache.name.clone(),
        time_to_first_token: first.duration_since(seq.job.submitted),
        decode_time: now.duration_since(first),
        grammar: seq.constraint.as_ref().map(Constraint::cost),
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
    After::Ended
}

/// Ends `seq` with an error event.
pub(crate) fn fail(seq: &mut Seq, err: EngineError) -> After {
    let _ = seq.job.events.send(GenerationEvent::Error(err));
    After::Failed
}

/// A grammar that reached a dead end (it allows no token the model has) is the request's
/// schema at fault: a 400 naming `response_format`, not a server error.
fn grammar_error(e: crate::grammar::GrammarError) -> EngineError {
    EngineError::InvalidParameter {
        param: "response_format".into(),
        message: format!("the response format's grammar cannot continue: {e}"),
    }
}
