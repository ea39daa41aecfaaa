//! QJL's key codec: `sign(S k)` packed in m bits and `||k||` in fp16, scored as
//! `sqrt(pi/2)/m * ||k|| * <S q, sign(S k)>` (unbiased over S) through the per-query byte table
//! of [`SignSketch`]. Optionally the `outliers` largest-magnitude channels of each key are kept
//! exactly (index u8 + fp16 value) and only the rest is sketched:
//! `q . k ~ sum_outliers q_c k_c + sketch estimate of q . k_rest`, still unbiased.
//!
//! Code row layout: `||k_rest||` (f16 LE), `m / 8` sign bytes, then `outliers` channel indices
//! (u8) and `outliers` fp16 values.

use crate::codec::sketch::SignSketch;
use crate::compressed::{KernelKind, KeyCodec};
use crate::{CacheError, Result};
use half::f16;
use kvq_kernels::KernelData;
use kvq_kernels::spec::KeySpec;
use std::sync::{Arc, OnceLock};

/// Bytes one exact outlier channel costs in a code row (u8 index + fp16 value).
pub const OUTLIER_BYTES: usize = 3;

/// One layer's QJL key codec.
#[derive(Debug, Clone)]
pub struct QjlKeyCodec {
    sketch: SignSketch,
    d: usize,
    outliers: usize,
    data: Arc<OnceLock<KernelData<KeySpec>>>,
}

impl QjlKeyCodec {
    /// Sketch dimension `m` (multiple of 8), `outliers` exact channels per token (at most
    /// `d / 2`, and `d <= 256` when there are any), matrices seeded by (`seed`, `layer`, head).
    pub fn new(
        d: usize,
        heads: usize,
        m: usize,
        outliers: usize,
        layer: usize,
        seed: u64,
    ) -> Result<Self> {
        if outliers > 0 && (d > 256 || outliers > d / 2) {
            return Err(CacheError::Shape(format!(
                "qjl: {outliers} outlier channels of head_dim {d} (at most d/2, d <= 256)"
            )));
        }
        Ok(Self {
            sketch: SignSketch::new(m, d, heads, layer, seed)?,
            d,
            outliers,
            data: Arc::default(),
        })
    }

    /// The sketch dimension.
    pub fn sketch_dim(&self) -> usize {
        self.sketch.m()
    }

    fn norm_of(code: &[u8]) -> f32 {
        f16::from_le_bytes([code[0], code[1]]).to_f32()
    }

    /// Offset of the outlier indices in a code row.
    fn outlier_at(&self) -> usize {
        2 + self.sketch.sign_bytes()
    }

    /// The exact outlier channels of a code row: (channel, value).
    fn outlier_iter<'a>(&self, code: &'a [u8]) -> impl Iterator<Item = (usize, f32)> + 'a {
        let at = self.outlier_at();
        let (idx, vals) = code[at..].split_at(self.outliers);
        idx.iter()
            .zip(vals.chunks_exact(2))
            .map(|(&c, v)| (usize::from(c), f16::from_le_bytes([v[0], v[1]]).to_f32()))
    }
}

impl KeyCodec for QjlKeyCodec {
    fn head_dim(&self) -> usize {
        self.d
    }

    fn code_bytes(&self) -> usize {
        self.outlier_at() + OUTLIER_BYTES * self.outliers
    }

    fn encode(&self, head: usize, k: &[f32], out: &mut [u8]) {
        let mut rest = k.to_vec();
        if self.outliers > 0 {
            let mut order: Vec<usize> = (0..self.d).collect();
            order.select_nth_unstable_by(self.outliers - 1, |&a, &b| {
                k[b].abs().total_cmp(&k[a].abs())
            });
            let at = self.outlier_at();
            let (idx, vals) = out[at..].split_at_mut(self.outliers);
            for ((i, v), &c) in idx.iter_mut().zip(vals.chunks_exact_mut(2)).zip(&order) {
                let x = f16::from_f32(k[c]);
                *i = c as u8;
                v.copy_from_slice(&x.to_le_bytes());
                // Sketch what the fp16 value leaves out, so the estimate stays unbiased.
                rest[c] = k[c] - x.to_f32();
            }
        }
        let norm = rest.iter().map(|v| v * v).sum::<f32>().sqrt();
        out[..2].copy_from_slice(&f16::from_f32(norm).to_le_bytes());
        self.sketch.encode(head, &rest, &mut out[2..]);
    }

    fn decode(&self, head: usize, code: &[u8], out: &mut [f32]) {
        out.fill(0.0);
        let signs = &code[2..self.outlier_at()];
        self.sketch
            .decode_add(head, signs, Self::norm_of(code), out);
        for (c, v) in self.outlier_iter(code) {
            if let Some(o) = out.get_mut(c) {
                *o += v;
            }
        }
    }

    fn state_len(&self) -> usize {
        self.sketch.table_len() + if self.outliers > 0 { self.d } else { 0 }
    }

    fn prepare(&self, head: usize, q: &[f32], state: &mut [f32]) {
        let (table, qcopy) = state.split_at_mut(self.sketch.table_len());
        self.sketch.prepare(head, q, table);
        if self.outliers > 0 {
            qcopy.copy_from_slice(q);
        }
    }

    fn scores(&self, _head: usize, state: &[f32], codes: &[u8], out: &mut [f32]) {
        let cb = self.code_bytes();
        let end = self.outlier_at();
        let (table, q) = state.split_at(self.sketch.table_len());
        for (s, code) in out.iter_mut().zip(codes.chunks_exact(cb)) {
            let mut x = Self::norm_of(code) * SignSketch::dot(table, &code[2..end]);
            if self.outliers > 0 {
                // Indices come from `encode` (< d); `get` keeps a corrupt row from panicking.
                x += self
                    .outlier_iter(code)
                    .map(|(c, v)| q.get(c).copied().unwrap_or(0.0) * v)
                    .sum::<f32>();
            }
            *s = x;
        }
    }

    fn kernel(&self) -> KernelKind {
        KernelKind::SignSketch
    }

    fn kernel_data(&self) -> Option<&KernelData<KeySpec>> {
        Some(self.data.get_or_init(|| {
            KernelData::new(KeySpec::Sketch {
                sketch: self.sketch.spec(),
                outliers: self.outliers,
            })
        }))
    }
}
