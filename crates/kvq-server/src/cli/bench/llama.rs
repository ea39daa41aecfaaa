//! `--compare-llama-bench`: reads `llama-bench -o json` outputs and puts llama.cpp's prompt and
//! decode tokens/s and peak RSS beside each kvq row, matched on threads, lengths, decode depth
//! and the KV cache type kvq's method is compared with (`llama_cache_type`).

use super::{BenchRow, Stats};
use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// llama.cpp's numbers for the same prompt length, from `llama-bench -o json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaCpp {
    /// llama.cpp's KV cache type these numbers are for (`-ctk`/`-ctv`, e.g. `f16`, `q4_0`).
    #[serde(default = "f16")]
    pub cache_type: String,
    /// Prompt processing of `prompt_tokens` tokens (`pp N`).
    pub pp_tps: Option<Stats>,
    /// Decode of `gen_tokens` tokens after `tg_depth` tokens of context (`tg G @ dN`).
    pub tg_tps: Option<Stats>,
    /// Context depth of `tg_tps`: the prompt length when llama-bench ran with `-d`, else 0.
    pub tg_depth: usize,
    /// Decode from an empty context (`tg G`), llama-bench's default test.
    pub tg_tps_depth0: Option<Stats>,
    /// Peak RSS (model included) of the llama-bench process that ran `tg_tps`, the median over
    /// the runs that recorded one (`<output>.maxrss` beside the JSON; see `MAXRSS_SUFFIX`).
    #[serde(default)]
    pub peak_rss_bytes: Option<u64>,
    /// kvq median / llama.cpp median.
    pub pp_ratio: Option<f64>,
    pub tg_ratio: Option<f64>,
    /// kvq's peak RSS / llama.cpp's: below 1 kvq holds less.
    #[serde(default)]
    pub rss_ratio: Option<f64>,
    pub build_commit: Option<String>,
    /// llama-bench's `-t`, matched to kvq's thread count.
    pub n_threads: u64,
}

fn f16() -> String {
    "f16".into()
}

/// A llama-bench output `X.json` may have `X.json.maxrss` beside it: the process's peak RSS in
/// KiB, as `/usr/bin/time -f %M -o X.json.maxrss llama-bench ...` writes it. It is that
/// process's peak over all its tests, so a run that compares memory gives each depth a process
/// of its own (scripts/bench-vs-llamacpp does).
pub(super) const MAXRSS_SUFFIX: &str = ".maxrss";

/// The llama.cpp KV cache type a kvq row is compared with: its fp16/fp32 caches with llama.cpp's
/// `f16`; every compressed method with `q4_0`, the smallest cache type llama.cpp's CPU flash
/// attention runs (it has no 3-bit or smaller KV type).
pub(super) fn llama_cache_type(row: &BenchRow) -> &'static str {
    if row.bits >= 16 { "f16" } else { "q4_0" }
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
    #[serde(default = "f16")]
    type_k: String,
    #[serde(default = "f16")]
    type_v: String,
}

/// (threads, cache type, prompt, generated, depth).
type Key = (u64, String, usize, usize, usize);

/// Every llama-bench test read, samples pooled per key.
pub(super) struct LlamaBench {
    samples: BTreeMap<Key, Vec<f64>>,
    /// Peak RSS in bytes of each process that ran the key's test.
    rss: BTreeMap<Key, Vec<u64>>,
    build_commit: Option<String>,
}

/// `X.json.maxrss`, when it exists: KiB -> bytes.
fn read_maxrss(path: &Path) -> anyhow::Result<Option<u64>> {
    let mut name = path.as_os_str().to_owned();
    name.push(MAXRSS_SUFFIX);
    let side = PathBuf::from(name);
    let text = match std::fs::read_to_string(&side) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("could not read {}", side.display())),
    };
    let kib: u64 = text.trim().parse().with_context(|| {
        format!(
            "{} should hold a peak RSS in KiB (/usr/bin/time -f %M), not {:?}",
            side.display(),
            text.trim()
        )
    })?;
    Ok(Some(kib * 1024))
}

impl LlamaBench {
    pub(super) fn read(paths: &[PathBuf]) -> anyhow::Result<LlamaBench> {
        let mut out = LlamaBench {
            samples: BTreeMap::new(),
            rss: BTreeMap::new(),
            build_commit: None,
        };
        for path in paths {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("could not read {}", path.display()))?;
            let tests: Vec<LlamaTest> = serde_json::from_str(&text).with_context(|| {
                format!("{} is not a `llama-bench -o json` output", path.display())
            })?;
            let rss = read_maxrss(path)?;
            for t in tests {
                let cache = if t.type_k == t.type_v {
                    t.type_k
                } else {
                    format!("{}/{}", t.type_k, t.type_v)
                };
                let key = (t.n_threads, cache, t.n_prompt, t.n_gen, t.n_depth);
                if let Some(b) = rss {
                    out.rss.entry(key.clone()).or_default().push(b);
                }
                out.samples.entry(key).or_default().extend(t.samples_ts);
                out.build_commit = out.build_commit.or(t.build_commit);
            }
        }
        Ok(out)
    }

    fn stats(&self, key: &Key) -> Option<Stats> {
        self.samples.get(key).and_then(|s| Stats::new(s.clone()))
    }

    fn peak_rss(&self, key: &Key) -> Option<u64> {
        let mut v = self.rss.get(key)?.clone();
        v.sort_unstable();
        v.get(v.len() / 2).copied()
    }

    /// llama.cpp's numbers for `row`, or None when no test of its cache type and lengths was read.
    pub(super) fn compare(&self, row: &BenchRow) -> Option<LlamaCpp> {
        let (n, g, t) = (row.prompt_tokens, row.gen_tokens, row.threads as u64);
        let c = llama_cache_type(row).to_string();
        let pp_key = (t, c.clone(), n, 0, 0);
        let tg0_key = (t, c.clone(), 0, g, 0);
        let depth_key = (t, c.clone(), 0, g, n);
        let pp = self.stats(&pp_key);
        let tg0 = self.stats(&tg0_key);
        let (tg, depth, tg_key) = match self.stats(&depth_key) {
            Some(s) => (Some(s), n, depth_key),
            None => (tg0.clone(), 0, tg0_key),
        };
        if pp.is_none() && tg.is_none() {
            return None;
        }
        let peak_rss = self.peak_rss(&tg_key);
        let ratio = |kvq: &Stats, l: &Option<Stats>| l.as_ref().map(|l| kvq.median / l.median);
        Some(LlamaCpp {
            cache_type: c,
            pp_ratio: ratio(&row.pp_tps, &pp),
            tg_ratio: ratio(&row.tg_tps, &tg),
            rss_ratio: match (row.peak_rss_bytes, peak_rss) {
                (Some(k), Some(l)) if l > 0 => Some(k as f64 / l as f64),
                _ => None,
            },
            pp_tps: pp,
            tg_tps: tg,
            tg_depth: depth,
            tg_tps_depth0: tg0,
            peak_rss_bytes: peak_rss,
            build_commit: self.build_commit.clone(),
            n_threads: t,
        })
    }
}
