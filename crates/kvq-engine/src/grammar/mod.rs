//! Constrained decoding: a response format (any JSON object, or JSON that validates against a
//! schema) compiled by llguidance into a per-request `Constraint` that masks the logits before
//! every pick and follows every token picked, so the output cannot leave the grammar.

#[cfg(test)]
mod tests;
mod tokenv;

use kvq_models::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI's `json_object` mode).
    JsonObject,
    /// JSON that validates against this schema (OpenAI's `json_schema` mode).
    JsonSchema(Value),
}

/// Why a grammar could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The schema uses something the grammar compiler does not support, or is not a schema.
    #[error("{0}")]
    Schema(String),
    /// The tokenizer cannot carry a grammar (no end-of-sequence token).
    #[error("constrained decoding is not available for this tokenizer: {0}")]
    Tokenizer(String),
}

/// Separators of the JSON the constraint admits: OpenAI's compact `{"a": 1, "b": [2, 3]}` form,
/// with no free whitespace (a small model left free whitespace can emit newlines forever).
fn compile_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// Builds constraints for one tokenizer. Creating it walks the whole vocabulary once (tens of
/// milliseconds), so a server makes one, on first use, and shares it.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl GrammarCompiler {
    /// The compiler for `tokenizer`'s vocabulary.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, GrammarError> {
        let start = Instant::now();
        let vocab = tokenizer.vocab_size();
        let env = tokenv::KvqTokEnv::new(tokenizer).map_err(GrammarError::Tokenizer)?;
        let env: llguidance::toktrie::TokEnv = Arc::new(env);
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        tracing::info!(
            "grammar compiler ready: {vocab} tokens in {:.0} ms",
            start.elapsed().as_secs_f64() * 1e3
        );
        Ok(Self { factory, vocab })
    }

    /// A fresh constraint for `spec`; an unsupported or malformed schema is an error whose text
    /// names what is wrong.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        let mut schema = match spec {
            GrammarSpec::JsonObject => json!({"type": "object"}),
            GrammarSpec::JsonSchema(s) => s.clone(),
        };
        let Some(obj) = schema.as_object_mut() else {
            return Err(GrammarError::Schema(
                "the schema must be a JSON object (a boolean schema is not supported)".into(),
            ));
        };
        obj.insert("x-guidance".into(), compile_options());
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_json_schema(schema))
            .map_err(|e| GrammarError::Schema(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Schema(e));
        }
        Ok(Constraint {
            matcher,
            vocab: self.vocab,
            mask_time: Duration::ZERO,
            steps: 0,
        })
    }
}

/// One sequence's grammar state. `Clone` gives an independent copy (one per choice).
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
    mask_time: Duration,
    steps: u64,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            vocab: self.vocab,
            mask_time: self.mask_time,
            steps: self.steps,
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("steps", &self.steps)
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

/// What following a token did to the grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Followed {
    /// More tokens may come.
    Open,
    /// The grammar is complete: nothing may follow (or the token was an end of sequence the
    /// grammar accepted).
    Complete,
}

impl Constraint {
    /// Sets every logit the grammar forbids now to -inf (ids past the vocabulary too). Errs if
    /// the grammar is in an error state or forbids everything.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let start = Instant::now();
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Schema(e.to_string()))?;
        let mut any = false;
        for (id, l) in logits.iter_mut().enumerate() {
            if id < self.vocab && allowed.is_allowed(id as u32) {
                any |= *l != f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        self.mask_time += start.elapsed();
        self.steps += 1;
        match any {
            true => Ok(()),
            false => Err(GrammarError::Schema(
                "the grammar admits no token the model can produce here".into(),
            )),
        }
    }

    /// Advances the grammar past `token` (one `mask` allowed).
    pub fn follow(&mut self, token: u32) -> Result<Followed, GrammarError> {
        let start = Instant::now();
        let r = self.matcher.consume_token(token);
        self.mask_time += start.elapsed();
        r.map_err(|e| GrammarError::Schema(e.to_string()))?;
        Ok(match self.matcher.is_stopped() {
            true => Followed::Complete,
            false => Followed::Open,
        })
    }

    /// Whether the grammar could end here (an end of sequence would be allowed).
    pub fn accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Time spent computing masks and following tokens so far, and the masks computed.
    pub fn cost(&self) -> (Duration, u64) {
        (self.mask_time, self.steps)
    }
}
