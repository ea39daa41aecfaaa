//! `--compare-llama-bench`: reads `llama-bench -o json` outputs and puts llama.cpp's prompt and
//! decode tokens/s beside each kvq row (matched on threads, lengths and decode depth).

use super::{BenchRow, Stats};
use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// llama.cpp's numbers for the same prompt length, from `llama-bench -o json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaCpp {
    /// Prompt processing of `prompt_tokens` tokens (`pp N`).
    pub pp_tps: Option<Stats>,
    /// Decode of `gen_tokens` tokens after `tg_depth` tokens of context (`tg G @ dN`).
    pub tg_tps: Option<Stats>,
    /// Context depth of `tg_tps`: the prompt length when llama-bench ran with `-d`, else 0.
    pub tg_depth: usize,
    /// Decode from an empty context (`tg G`), llama-bench's default test.
    pub tg_tps_depth0: Option<Stats>,
    /// kvq median / llama.cpp median.
    pub pp_ratio: Option<f64>,
    pub tg_ratio: Option<f64>,
    pub build_commit: Option<String>,
    /// llama-bench's `-t`, matched to kvq's thread count.
    pub n_threads: u64,
}

/// One test of `llama-bench -o json`; unknown fields are ignored.
#[derive(Debug, Deserialize)]
struct LlamaTest {
    n_prompt: usize,
    n_gen: usize,
    #[serde(default)]
    n_depth: usize,
    samples_ts: Vec<f64>,
    #[serde(default)]
    build_commit: Option<String>,
    n_threads: u64,
}

/// Every llama-bench test read, samples pooled per (threads, prompt, generated, depth).
pub(super) struct LlamaBench {
    samples: BTreeMap<(u64, usize, usize, usize), Vec<f64>>,
    build_commit: Option<String>,
}

impl LlamaBench {
    pub(super) fn read(paths: &[PathBuf]) -> anyhow::Result<LlamaBench> {
        let mut out = LlamaBench {
            samples: BTreeMap::new(),
            build_commit: None,
        };
        for path in paths {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("could not read {}", path.display()))?;
            let tests: Vec<LlamaTest> = serde_json::from_str(&text).with_context(|| {
                format!("{} is not a `llama-bench -o json` output", path.display())
            })?;
            for t in tests {
                out.samples
                    .entry((t.n_threads, t.n_prompt, t.n_gen, t.n_depth))
                    .or_default()
                    .extend(t.samples_ts);
                out.build_commit = out.build_commit.or(t.build_commit);
            }
        }
        Ok(out)
    }

    fn stats(&self, key: (u64, usize, usize, usize)) -> Option<Stats> {
        self.samples.get(&key).and_then(|s| Stats::new(s.clone()))
    }

    pub(super) fn compare(&self, row: &BenchRow) -> LlamaCpp {
        let (n, g, t) = (row.prompt_tokens, row.gen_tokens, row.threads as u64);
        let pp = self.stats((t, n, 0, 0));
        let tg0 = self.stats((t, 0, g, 0));
        let (tg, depth) = match self.stats((t, 0, g, n)) {
            Some(s) => (Some(s), n),
            None => (tg0.clone(), 0),
        };
        let ratio = |kvq: &Stats, l: &Option<Stats>| l.as_ref().map(|l| kvq.median / l.median);
        LlamaCpp {
            pp_ratio: ratio(&row.pp_tps, &pp),
            tg_ratio: ratio(&row.tg_tps, &tg),
            pp_tps: pp,
            tg_tps: tg,
            tg_depth: depth,
            tg_tps_depth0: tg0,
            build_commit: self.build_commit.clone(),
            n_threads: t,
        }
    }
}
