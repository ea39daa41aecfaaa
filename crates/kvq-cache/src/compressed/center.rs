//! Key centering and sharp layers of a compressed cache (see the parent module's docs): the
//! center's state, encoding keys around it, the query statistics it keeps, and the one decision
//! made from the first queries (whether the layer stays in fp16).
//!
//! Invariant: a [`KeyCenter`] depends only on the keys and queries at positions below
//! `sinks + CENTER_ROWS`: the center is the mean of the keys at `sinks..sinks + CENTER_ROWS`
//! (fixed once all of them are appended, from their fp16 rows), and the sharpness decision is
//! made from those keys and the queries at the same positions, once a query at or past
//! `sinks + CENTER_ROWS` comes. So neither depends on how the text was split into appends. A
//! truncation below `sinks + CENTER_ROWS` forgets both (while the fp16 rows to re-encode from
//! are still there), so they are made again from the keys and queries that come next.

use super::exact_rows::ExactRows;
use crate::Result;
use crate::state::{StateReader, put_f32, put_f64, put_usize, state_err};
use crate::traits::{CacheGeometry, CacheState};
use candle_core::{DType, Device, Tensor};
use half::f16;

/// Keys past the sinks the key center is the mean of; it is fixed once a layer has seen them.
/// Few and early on purpose: Qwen2.5 makes secondary attention sinks of its system prompt's
/// punctuation (positions 2-23 hold 35% of the attention in its middle layers), and a center
/// close to them codes them best. Measured (KL divergence vs fp16 on SmolLM2, ctx 512, 8 chunks;
/// raw / 16 rows / 64 rows): MSE 4-bit 0.0075 / 0.0066 / 0.0074, Prod 3-bit 0.343 / 0.160 /
/// 0.177, QJL 3-bit 0.648 / 0.643 / 0.484, RVQ 2-bit 0.141 / 0.174 / 0.180 (every head
/// centered). Qwen2.5's chat answer at MSE 4-bit and 4 sinks stayed clean with 16 and 28 rows
/// and broke with 64 (raw, after ~70 tokens), before its layer 0 stayed fp16 ([`SHARP_LOGITS`]),
/// which also cleaned up Prod's and QJL's answers.
pub const CENTER_ROWS: usize = 16;

/// The key center of a cache (see the module docs).
#[derive(Clone)]
enum Center {
    /// Not fixed yet: codes so far are of raw keys and get re-encoded when it is.
    Pending,
    /// Keys are coded raw and no layer is sharp: the early keys' fp16 rows were gone when the
    /// center could have been fixed (only after a truncation).
    Off,
    /// Fixed. `mu`: `[kv head][d]`, subtracted from every key before encoding (zeros for a head
    /// coded raw); `spread`: the RMS distance of the keys it was fixed from to their mean; `exact`:
    /// whether this layer's logits are too sharp for codes ([`SHARP_LOGITS`]), once known.
    On {
        mu: Vec<f32>,
        spread: f32,
        exact: Option<bool>,
    },
}

/// A layer whose typical logit spread at the first keys past the sinks, `scale * rms|q| *
/// rms|k - mean k|`, exceeds this keeps every key in fp16: its softmax is so sharp that any code
/// error moves it. Measured on the first 16 keys past 4 sinks of a 2048-token Shakespeare chunk:
/// Qwen2.5-Coder-0.5B's layer 0 345 (rms |q| 63, spread 44; its attention error at 4 bits 0.96
/// against <= 0.17 in every other layer; with it in fp16, perplexity at 4 bits goes from +165% to
/// +0.6%); every other layer at most 32 (Qwen2.5), 21 (SmolLM2), 73 (Gemma-3-270M).
pub const SHARP_LOGITS: f32 = 150.0;

/// The key center of one layer and what is decided with it (see the module docs).
#[derive(Clone)]
pub(super) struct KeyCenter {
    center: Center,
    /// Heads whose center carries less of their first keys' energy code raw keys.
    share: f32,
    /// Squared norms of the query rows at the positions that fix the center, and their count.
    q_sq: f64,
    q_rows: usize,
    /// The center as a device tensor `[kv heads, d, 1]`, when the cache lives on a GPU. Never
    /// written in place: a clone (a fork) shares it as a copy would.
    mu_dev: Option<Tensor>,
    /// The first position whose key fixes the center (the sinks come before it).
    sinks: usize,
    geom: CacheGeometry,
}

impl KeyCenter {
    /// Not fixed yet, every head centered (`share` 0).
    pub(super) fn new(geom: CacheGeometry, sinks: usize) -> Self {
        Self {
            center: Center::Pending,
            share: 0.0,
            q_sq: 0.0,
            q_rows: 0,
            mu_dev: None,
            sinks,
            geom,
        }
    }

    /// Centers the heads whose center carries at least `centering` of their first keys'
    /// energy; none with `None` (see `CodecFactory::key_centering`). Not fixed yet.
    pub(super) fn set_centering(&mut self, centering: Option<f32>) {
        self.center = Center::Pending;
        self.share = centering.unwrap_or(f32::INFINITY);
    }

    /// Whether the queries of positions `first..first + t` include some at the positions that
    /// fix the center (`sinks..sinks + CENTER_ROWS`), which [`Self::observe_queries`] counts.
    pub(super) fn observes(&self, first: usize, t: usize) -> bool {
        first < self.sinks + CENTER_ROWS && first + t > self.sinks
    }

    /// Counts the squared norms of the query rows at positions `sinks..sinks + CENTER_ROWS` (the
    /// positions whose keys fix the center); `qv` is `[heads][t][d]` for positions from `first`.
    pub(super) fn observe_queries(&mut self, qv: &[f32], t: usize, first: usize) {
        let d = self.geom.head_dim;
        let (lo, hi) = (self.sinks, self.sinks + CENTER_ROWS);
        for h in 0..self.geom.n_heads {
            for r in 0..t {
                if (lo..hi).contains(&(first + r)) {
                    let row = &qv[(h * t + r) * d..(h * t + r + 1) * d];
                    self.q_sq += row.iter().map(|v| f64::from(v * v)).sum::<f64>();
                    self.q_rows += 1;
                }
            }
        }
    }

    /// Once a query at or past `sinks + CENTER_ROWS` comes (every query before it has been
    /// observed, however the text was split), decides whether this layer stays in fp16.
    pub(super) fn decide_exact(&mut self, last_pos: usize, scale: f32) {
        if last_pos < self.sinks + CENTER_ROWS {
            return;
        }
        let q_rms = (self.q_sq / self.q_rows.max(1) as f64).sqrt() as f32;
        if let Center::On { spread, exact, .. } = &mut self.center
            && exact.is_none()
        {
            let sharp = scale * q_rms * *spread;
            *exact = Some(sharp > SHARP_LOGITS);
        }
    }

    /// Whether this layer reads every key from fp16 (its logits are too sharp for codes).
    pub(super) fn is_exact(&self) -> bool {
        matches!(
            self.center,
            Center::On {
                exact: Some(true),
                ..
            }
        )
    }

    /// Whether the fp16 rows must all stay: the center is not fixed, or the layer's sharpness is
    /// not decided yet, or it is exact.
    pub(super) fn holds_rows(&self) -> bool {
        matches!(
            self.center,
            Center::Pending
                | Center::On {
                    exact: None | Some(true),
                    ..
                }
        )
    }

    /// How a device cache codes the keys of an append of `t` rows at `len` without reading them
    /// back: `Some(None)` raw, `Some(Some(mu))` centered by `mu` (`[kv heads, d, 1]` f32; the
    /// encode kernel rounds to f16 and subtracts, as [`Self::keys_to_encode`] does); `None` when
    /// the append must go through `keys_to_encode` (it fixes the center, or the cache is on the
    /// host).
    #[cfg(feature = "cuda")]
    pub(super) fn device_encoding(&self, len: usize, t: usize) -> Option<Option<&Tensor>> {
        match &self.center {
            Center::Off => Some(None),
            Center::Pending if len + t < self.sinks + CENTER_ROWS => Some(None),
            Center::Pending => None,
            Center::On { .. } => self.mu_dev.as_ref().map(Some),
        }
    }

    /// The center on the device (`[kv heads, d, 1]` f32), when keys are coded centered there.
    #[cfg(feature = "cuda")]
    pub(super) fn mu_device(&self) -> Option<&Tensor> {
        self.mu_dev.as_ref()
    }

    /// `q . mu` of kv head `kh`: what the codes' scores lack.
    pub(super) fn center_score(&self, kh: usize, q: &[f32]) -> f32 {
        let d = self.geom.head_dim;
        match &self.center {
            Center::On { mu, .. } => crate::attention::dot(q, &mu[kh * d..(kh + 1) * d]),
            _ => 0.0,
        }
    }

    /// The key rows to encode for an append of `k` (`[kv heads, t, d]`; `kd` its values, read
    /// back here when not given: a GPU cache) at position `len` of a cache whose fp16 rows are
    /// `exact`, and the position they start at: `len`, or 0 when the center is fixed now (every
    /// key so far is re-encoded around it, from its fp16 row). Centered keys are rounded to
    /// fp16 first, so a center fixed in a prefill chunk and one fixed by single decode steps
    /// (from the fp16 rows) code alike: what a query sees does not depend on how the text was
    /// split into appends.
    pub(super) fn keys_to_encode(
        &mut self,
        k: &Tensor,
        kd: Option<&[f32]>,
        len: usize,
        exact: &ExactRows,
    ) -> Result<(Tensor, usize)> {
        let (kvh, t, d) = k.dims3()?;
        let (end, want) = (len + t, self.sinks + CENTER_ROWS);
        let round = |x: &f32| f16::from_f32(*x).to_f32();
        let fix_now = match self.center {
            Center::Off => return Ok((k.clone(), len)),
            Center::Pending if end < want => return Ok((k.clone(), len)),
            // Not reached (fp16 rows are kept while pending); the codes so far are raw.
            Center::Pending if exact.first() > 0 => {
                self.center = Center::Off;
                return Ok((k.clone(), len));
            }
            Center::Pending => true,
            Center::On { .. } => false,
        };
        if let (false, Some(mu)) = (fix_now, &self.mu_dev) {
            // On the device: the same rounding and subtraction, in tensor ops.
            let x = k.to_dtype(DType::F16)?.to_dtype(DType::F32)?;
            return Ok((x.broadcast_sub(&mu.transpose(1, 2)?)?, len));
        }
        let read;
        let kd = match kd {
            Some(kd) => kd,
            None => {
                read = k.flatten_all()?.to_vec1::<f32>()?;
                &read
            }
        };
        // The early keys from the fp16 rows (all kept while the center was pending); a GPU
        // cache reads them back once, here.
        let early = match fix_now {
            true => Some(exact.keys_from_start(len)?),
            false => None,
        };
        let (from, rows) = if fix_now { (0, end) } else { (len, t) };
        // `[kv head][rows][d]`: every key so far when the center is fixed now (the earlier ones
        // from their fp16 rows, all kept while it was pending), else the new ones.
        let mut x = vec![0f32; kvh * rows * d];
        for (h, dst) in x.chunks_mut(rows * d).enumerate() {
            let (dst_early, new) = dst.split_at_mut((len - from) * d);
            if let Some(e) = &early {
                dst_early.copy_from_slice(&e[h * len * d..(h + 1) * len * d]);
            }
            for (o, v) in new.iter_mut().zip(&kd[h * t * d..(h + 1) * t * d]) {
                *o = round(v);
            }
        }
        if fix_now {
            let mut mu = vec![0f32; kvh * d];
            let mut spread = 0f32;
            for (h, m) in mu.chunks_mut(d).enumerate() {
                for r in self.sinks..want {
                    let row = &x[(h * rows + r) * d..(h * rows + r + 1) * d];
                    m.iter_mut().zip(row).for_each(|(m, v)| *m += v);
                }
                m.iter_mut().for_each(|m| *m /= CENTER_ROWS as f32);
                let mean_sq = m.iter().map(|v| v * v).sum::<f32>();
                let energy = (self.sinks..want)
                    .map(|r| x[(h * rows + r) * d..(h * rows + r + 1) * d].iter())
                    .map(|row| row.map(|v| v * v).sum::<f32>())
                    .sum::<f32>()
                    / CENTER_ROWS as f32;
                // Mean squared distance to the mean = mean squared norm - squared norm of the mean.
                spread += (energy - mean_sq).max(0.0) / kvh as f32;
                let share = mean_sq / energy.max(f32::MIN_POSITIVE);
                if share < self.share {
                    m.fill(0.0);
                }
            }
            if exact.on_device() {
                self.mu_dev = Some(Tensor::from_vec(mu.clone(), (kvh, d, 1), k.device())?);
            }
            self.center = Center::On {
                mu,
                spread: spread.sqrt(),
                exact: None,
            };
        }
        if let Center::On { mu, .. } = &self.center {
            for (h, dst) in x.chunks_mut(rows * d).enumerate() {
                let m = &mu[h * d..(h + 1) * d];
                for row in dst.chunks_mut(d) {
                    row.iter_mut().zip(m).for_each(|(v, m)| *v -= m);
                }
            }
        }
        Ok((Tensor::from_vec(x, (kvh, rows, d), k.device())?, from))
    }

    /// The positions below which a query reads every key from fp16 (`exact_before` of the
    /// attention parameters): none once centering is off, every one in an exact layer, else
    /// those whose queries come before the center is fixed.
    pub(super) fn exact_before(&self) -> usize {
        match self.center {
            Center::Off => 0,
            _ if self.is_exact() => usize::MAX,
            Center::Pending | Center::On { .. } => self.sinks + CENTER_ROWS,
        }
    }

    /// After a truncation to `n` positions (`first`: the first position the fp16 rows still
    /// hold): a center fixed from keys that are gone is forgotten, to be fixed again from the
    /// next ones as a fresh cache would (every fp16 row is still here to re-encode the kept
    /// codes from), and sharpness is decided from the queries that come from now on. Without
    /// those rows the old center stays: every code was made with it.
    pub(super) fn truncate(&mut self, n: usize, first: usize) {
        if n < self.sinks + CENTER_ROWS && first == 0 && matches!(self.center, Center::On { .. }) {
            self.center = Center::Pending;
            self.mu_dev = None;
            (self.q_sq, self.q_rows) = (0.0, 0);
        }
    }

    /// `scale * q . mu` per query row (`q`: `[heads, t, d]` on the device), `[heads, t, 1]`,
    /// or None for a cache without a device center.
    pub(super) fn shift(&self, q: &Tensor, scale: f32) -> Result<Option<Tensor>> {
        let Some(mu) = &self.mu_dev else {
            return Ok(None);
        };
        let (nh, t, d) = q.dims3()?;
        let kvh = self.geom.n_kv_heads;
        let qs = q.reshape((kvh, nh / kvh * t, d))?;
        Ok(Some(
            (qs.matmul(mu)? * f64::from(scale))?.reshape((nh, t, 1))?,
        ))
    }

    /// Writes this center's state: `center.kind` (0 pending, 1 off, 2 on), `center.share`
    /// (f32), `center.q_sq` (f64, its bits kept), `center.q_rows`, and once on `center.mu`
    /// (`[kv heads, d]` f32), `center.spread` (f32) and `center.exact` (0 undecided, 1 codes,
    /// 2 every key in fp16).
    pub(super) fn save(&self, state: &mut CacheState) -> Result<()> {
        let kind = match &self.center {
            Center::Pending => 0,
            Center::Off => 1,
            Center::On { .. } => 2,
        };
        put_usize(state, "center.kind", kind)?;
        put_f32(state, "center.share", self.share)?;
        put_f64(state, "center.q_sq", self.q_sq)?;
        put_usize(state, "center.q_rows", self.q_rows)?;
        if let Center::On { mu, spread, exact } = &self.center {
            let (kvh, d) = (self.geom.n_kv_heads, self.geom.head_dim);
            let mu = Tensor::from_vec(mu.clone(), (kvh, d), &Device::Cpu)?;
            state.insert("center.mu".into(), mu);
            put_f32(state, "center.spread", *spread)?;
            let exact = match exact {
                None => 0,
                Some(false) => 1,
                Some(true) => 2,
            };
            put_usize(state, "center.exact", exact)?;
        }
        Ok(())
    }

    /// A center like this (fresh) one in the state [`Self::save`] wrote, its device copy of
    /// `mu` on `dev` when `on_device` (as a device cache fixing it builds it). The share must
    /// be this one's (the factory's centering), the numbers finite.
    pub(super) fn restore(
        &self,
        reader: &mut StateReader<'_>,
        dev: &Device,
        on_device: bool,
    ) -> Result<Self> {
        let (kvh, d) = (self.geom.n_kv_heads, self.geom.head_dim);
        let kind = reader.choice("center.kind", 3)?;
        let share = reader.f32("center.share")?;
        if share.to_bits() != self.share.to_bits() {
            return Err(state_err(format!(
                "tensor center.share: {share}, made with another key centering than this \
                 cache's ({})",
                self.share
            )));
        }
        let q_sq = reader.f64("center.q_sq")?;
        if !(q_sq.is_finite() && q_sq >= 0.0) {
            return Err(state_err(format!(
                "tensor center.q_sq: expected a finite sum of squares, got {q_sq}"
            )));
        }
        let q_rows = reader.usize("center.q_rows")?;
        let center = match kind {
            0 => Center::Pending,
            1 => Center::Off,
            _ => {
                let mu = reader
                    .tensor("center.mu", DType::F32, &[kvh, d])?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let spread = reader.f32("center.spread")?;
                if !(spread.is_finite() && spread >= 0.0) || mu.iter().any(|m| !m.is_finite()) {
                    return Err(state_err(
                        "tensors center.mu, center.spread: expected finite values, a spread >= 0",
                    ));
                }
                let exact = match reader.choice("center.exact", 3)? {
                    0 => None,
                    1 => Some(false),
                    _ => Some(true),
                };
                Center::On { mu, spread, exact }
            }
        };
        let mu_dev = match (&center, on_device) {
            (Center::On { mu, .. }, true) => Some(Tensor::from_vec(mu.clone(), (kvh, d, 1), dev)?),
            _ => None,
        };
        Ok(Self {
            center,
            share,
            q_sq,
            q_rows,
            mu_dev,
            sinks: self.sinks,
            geom: self.geom,
        })
    }
}
