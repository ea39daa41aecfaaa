//! The perplexity protocol of llama.cpp's `llama-perplexity`, as pure functions: splitting the
//! token stream into chunks (BOS on each chunk when the vocabulary adds one), running a chunk
//! through the model in pieces on one cache, and scoring the second half of a chunk (negative
//! log-likelihood, and KL divergence / same top token against a baseline's log-probabilities).

use anyhow::{Context, ensure};
use kvq_cache::LayerCaches;
use kvq_models::model::{Model, SeqStep};
use std::ops::Range;

/// Most tokens fed to the model in one forward call, by default (`--piece`).
pub const PIECE: usize = 512;

/// The token stream cut into `n_tokens / ctx` non-overlapping chunks of `ctx` tokens (at most
/// `max_chunks`), the first token of each replaced by `bos` when given: llama.cpp's
/// `perplexity()` does so when `llama_vocab_get_add_bos` is true. Like llama.cpp, at least
/// `2 * ctx` tokens are required.
pub fn make_chunks(
    tokens: &[u32],
    ctx: usize,
    max_chunks: Option<usize>,
    bos: Option<u32>,
) -> anyhow::Result<Vec<Vec<u32>>> {
    ensure!(ctx >= 4, "--ctx must be at least 4, got {ctx}");
    ensure!(
        tokens.len() >= 2 * ctx,
        "the text tokenizes to {} tokens; a context of {ctx} needs at least {} (as llama.cpp)",
        tokens.len(),
        2 * ctx
    );
    let n = (tokens.len() / ctx).min(max_chunks.unwrap_or(usize::MAX));
    ensure!(n >= 1, "--chunks must be at least 1");
    Ok(tokens
        .chunks_exact(ctx)
        .take(n)
        .map(|c| {
            let mut c = c.to_vec();
            if let Some(b) = bos {
                c[0] = b;
            }
            c
        })
        .collect())
}

/// The positions whose logits are scored in a chunk of `ctx` tokens: `ctx/2 .. ctx-1` (the
/// logits at position j predict token j + 1), as llama.cpp's `first = n_ctx/2`.
pub fn scored_range(ctx: usize) -> Range<usize> {
    ctx / 2..ctx - 1
}

/// Runs `tokens` through `model` on `caches` in consecutive pieces of the given lengths (which
/// sum to `tokens.len()`), asking for all logits only from the pieces that overlap `want`, and
/// returns the logits of the positions in `want`, row-major (`want.len() * vocab`).
///
/// Every cache is generation-equivalent for any split: a query at position p sees the state
/// one-token-at-a-time generation would have left (tested in `tests.rs`).
pub fn feed(
    model: &Model,
    caches: &mut LayerCaches,
    tokens: &[u32],
    pieces: &[usize],
    want: Range<usize>,
) -> anyhow::Result<Vec<f32>> {
    ensure!(
        pieces.iter().sum::<usize>() == tokens.len(),
        "pieces do not cover the tokens"
    );
    ensure!(want.end <= tokens.len(), "wanted logits past the tokens");
    let vocab = model.config().vocab_size;
    let mut out = Vec::with_capacity(want.len() * vocab);
    let mut start = 0;
    for &len in pieces {
        let end = start + len;
        let (lo, hi) = (want.start.max(start), want.end.min(end));
        let all_logits = lo < hi;
        let logits = model.forward(&mut [SeqStep {
            tokens: &tokens[start..end],
            cache: caches,
            all_logits,
        }])?;
        if all_logits {
            let rows = logits
                .first()
                .context("the model returned no logits")?
                .narrow(0, lo - start, hi - lo)?;
            out.extend(rows.flatten_all()?.to_vec1::<f32>()?);
        }
        start = end;
    }
    Ok(out)
}

/// Lengths of consecutive pieces of at most `piece` tokens covering `n` tokens.
pub fn split_pieces(n: usize, piece: usize) -> Vec<usize> {
    let piece = piece.max(1);
    (0..n).step_by(piece).map(|s| piece.min(n - s)).collect()
}

/// Running sums over every scored position of one method.
#[derive(Debug, Clone, Default)]
pub struct Acc {
    /// Sum and sum of squares of the negative log-likelihoods.
    pub nll: f64,
    pub nll2: f64,
    /// Scored positions.
    pub count: usize,
    /// Sum of KL(baseline || method) over positions compared with a baseline.
    pub kld: f64,
    /// Positions where the method's top token is the baseline's.
    pub same_top: usize,
    /// Positions compared with a baseline.
    pub compared: usize,
}

impl Acc {
    /// exp(mean nll).
    pub fn ppl(&self) -> f64 {
        (self.nll / self.count.max(1) as f64).exp()
    }

    /// The standard error of the perplexity as llama.cpp prints it (`PPL = x +/- err`): the
    /// standard error of the mean nll, times PPL.
    pub fn ppl_err(&self) -> Option<f64> {
        if self.count < 2 {
            return None;
        }
        let n = self.count as f64;
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        (var > 0.0).then(|| (var / (n - 1.0)).sqrt() * self.ppl())
    }

    /// Mean KL divergence from the baseline, per compared position.
    pub fn mean_kld(&self) -> Option<f64> {
        (self.compared > 0).then(|| self.kld / self.compared as f64)
    }

    /// % of compared positions with the baseline's top token.
    pub fn same_top_pct(&self) -> Option<f64> {
        (self.compared > 0).then(|| 100.0 * self.same_top as f64 / self.compared as f64)
    }
}

/// Turns one logits row into log-probabilities in place; returns the index of the largest
/// logit (the first one on ties).
pub fn log_softmax_in_place(row: &mut [f32]) -> usize {
    let imax = argmax(row);
    let max = row[imax];
    let sum: f64 = row.iter().map(|&x| f64::from((x - max).exp())).sum();
    let ln_sum = sum.ln() as f32;
    row.iter_mut().for_each(|x| *x = (*x - max) - ln_sum);
    imax
}

/// Scores one chunk. `rows` holds the logits of the positions `scored_range(chunk.len())`,
/// row-major with `vocab` columns; they are turned into log-probabilities in place and
/// returned, so the baseline's can be kept. With `base` (the baseline's log-probabilities of
/// the same positions), the KL divergence and the top token are compared too.
pub fn score_chunk(
    chunk: &[u32],
    vocab: usize,
    mut rows: Vec<f32>,
    base: Option<&[f32]>,
    acc: &mut Acc,
) -> anyhow::Result<Vec<f32>> {
    let range = scored_range(chunk.len());
    ensure!(
        rows.len() == range.len() * vocab,
        "expected {} logits rows of {vocab}, got {} values",
        range.len(),
        rows.len()
    );
    if let Some(b) = base {
        ensure!(b.len() == rows.len(), "baseline rows differ in size");
    }
    for (r, j) in range.enumerate() {
        let row = &mut rows[r * vocab..(r + 1) * vocab];
        let top = log_softmax_in_place(row);
        let target = chunk[j + 1] as usize;
        ensure!(target < vocab, "token {target} is out of vocabulary");
        let nll = -f64::from(row[target]);
        acc.nll += nll;
        acc.nll2 += nll * nll;
        acc.count += 1;
        if let Some(b) = base {
            let b = &b[r * vocab..(r + 1) * vocab];
            acc.kld += kl_divergence(b, row);
            acc.same_top += usize::from(argmax(b) == top);
            acc.compared += 1;
        }
    }
    Ok(rows)
}

/// KL(p || q) of two log-probability rows, sum of p (log p - log q).
pub fn kl_divergence(log_p: &[f32], log_q: &[f32]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&lp, &lq)| f64::from(lp).exp() * f64::from(lp - lq))
        .sum()
}

/// Index of the largest value (the first one on ties).
pub fn argmax(row: &[f32]) -> usize {
    let (mut imax, mut max) = (0, f32::NEG_INFINITY);
    for (i, &x) in row.iter().enumerate() {
        if x > max {
            (imax, max) = (i, x);
        }
    }
    imax
}
