//! Token sampling: penalties, logit bias, temperature, top-k, top-p, min-p, a seeded RNG per
//! request, and logprobs.

use crate::request::SamplingParams;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Samples one request's tokens; owns its RNG so the same seed gives the same output.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// A sampler seeded from `params.seed`, or from the OS when none is given.
    pub fn new(params: &SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self {
            params: params.clone(),
            rng,
        }
    }

    /// Applies the penalties and the logit bias to `logits` in place, then picks a token.
    /// `prompt` and `generated` feed the repetition, frequency and presence penalties.
    pub fn sample(&mut self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) -> u32 {
        self.apply_penalties(logits, prompt, generated);
        let p = &self.params;
        if p.temperature <= 0.0 || p.top_k == 1 {
            return argmax(logits);
        }
        let inv_t = 1.0 / p.temperature;
        // Candidates sorted by logit, descending. Tokens whose probability is below 1e-9 of the
        // best can never matter to top-p, min-p or the draw (their total mass is < vocab * 1e-9),
        // so they are dropped before sorting: the sort then covers hundreds of tokens, not the
        // whole vocabulary.
        let best = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let floor = best - 9.0 * std::f32::consts::LN_10 * p.temperature;
        let mut idx: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize] >= floor)
            .collect();
        if idx.is_empty() {
            // Only possible with non-finite logits; fall back to the plain maximum.
            return argmax(logits);
        }
        let k = if p.top_k > 0 {
            p.top_k.min(idx.len())
        } else {
            idx.len()
        };
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, |&a, &b| {
                logits[b as usize].total_cmp(&logits[a as usize])
            });
            idx.truncate(k);
        }
        idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let max = logits[idx[0] as usize];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i as usize] - max) * inv_t).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        // min-p: drop tokens below min_p times the most likely one.
        let mut keep = probs.len();
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
        }
        // top-p: the smallest prefix whose mass reaches top_p.
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, &x) in probs.iter().enumerate().take(keep) {
                acc += x;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        let mass: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.random::<f32>() * mass;
        for (i, &x) in probs[..keep].iter().enumerate() {
            r -= x;
            if r <= 0.0 {
                return idx[i];
            }
        }
        idx[keep - 1]
    }

    fn apply_penalties(&self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let mut seen = vec![false; logits.len()];
            for &t in prompt.iter().chain(generated) {
                let i = t as usize;
                if i < logits.len() && !seen[i] {
                    seen[i] = true;
                    let l = &mut logits[i];
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            let mut counts: HashMap<u32, usize> = HashMap::new();
            for &t in generated {
                *counts.entry(t).or_default() += 1;
            }
            for (t, c) in counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.frequency_penalty * c as f32 + p.presence_penalty;
                }
            }
        }
        for &(t, bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += bias;
            }
        }
    }
}

/// Index of the largest value (the first one on ties).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Log-probabilities of the model's distribution: the chosen token's and the `top` best.
pub fn logprobs(logits: &[f32], chosen: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln() + max;
    let chosen_lp = logits
        .get(chosen as usize)
        .map_or(f32::NEG_INFINITY, |&l| l - lse);
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let top = top.min(idx.len());
    if top > 0 && top < idx.len() {
        idx.select_nth_unstable_by(top - 1, |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize])
        });
    }
    idx.truncate(top);
    idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    let tops = idx
        .into_iter()
        .map(|i| (i, logits[i as usize] - lse))
        .collect();
    (chosen_lp, tops)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            seed: Some(7),
            ..SamplingParams::default()
        }
    }

    /// A bias moves the greedy pick and the sampled ones: -100 bans the best token, +100 forces
    /// a poor one even at temperature 1.
    #[test]
    fn logit_bias_moves_the_pick() {
        let logits = [1.0f32, 5.0, 2.0, 0.5];
        let mut ban = SamplingParams {
            logit_bias: vec![(1, -100.0)],
            ..params(0.0)
        };
        assert_eq!(Sampler::new(&ban).sample(&mut logits.clone(), &[], &[]), 2);
        ban.temperature = 1.0;
        let mut s = Sampler::new(&ban);
        for _ in 0..200 {
            assert_ne!(s.sample(&mut logits.clone(), &[], &[]), 1);
        }
        let force = SamplingParams {
            logit_bias: vec![(3, 100.0)],
            ..params(1.0)
        };
        let mut s = Sampler::new(&force);
        for _ in 0..200 {
            assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 3);
        }
    }

    #[test]
    fn greedy_takes_argmax() {
        let mut s = Sampler::new(&params(0.0));
        assert_eq!(s.sample(&mut [0.1, 3.0, 2.0], &[], &[]), 1);
    }

    #[test]
    fn same_seed_same_draws() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let draw = || {
            let mut s = Sampler::new(&params(1.0));
            (0..20)
                .map(|_| s.sample(&mut logits.clone(), &[], &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(), draw());
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let logits = vec![1.0, 5.0, 4.9, 0.0];
        let mut p = params(1.0);
        p.top_k = 1;
        let mut s = Sampler::new(&p);
        assert!((0..50).all(|_| s.sample(&mut logits.clone(), &[], &[]) == 1));
        let mut p = params(1.0);
        p.top_p = 1e-6;
        let mut s = Sampler::new(&p);
        assert!((0..50).all(|_| s.sample(&mut logits.clone(), &[], &[]) == 1));
    }

    #[test]
    fn min_p_removes_unlikely_tokens() {
        let logits = vec![10.0, 9.5, -10.0, -10.0];
        let mut p = params(1.0);
        p.min_p = 0.1;
        let mut s = Sampler::new(&p);
        assert!((0..200).all(|_| s.sample(&mut logits.clone(), &[], &[]) < 2));
    }

    #[test]
    fn penalties_steer_away_from_repeats() {
        let mut p = params(0.0);
        p.presence_penalty = 2.0;
        let mut s = Sampler::new(&p);
        assert_eq!(s.sample(&mut [1.0, 2.0, 0.5], &[], &[1]), 0);
        let mut p = params(0.0);
        p.repetition_penalty = 3.0;
        let mut s = Sampler::new(&p);
        assert_eq!(s.sample(&mut [1.0, 2.0, 0.5], &[1], &[]), 0);
    }

    #[test]
    fn logprobs_are_normalized() {
        let (lp, top) = logprobs(&[0.0, 0.0], 1, 2);
        assert!((lp - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(top.len(), 2);
        let total: f32 = logprobs(&[1.0, 2.0, 3.0], 0, 3)
            .1
            .iter()
            .map(|(_, l)| l.exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5);
    }
}
