//! QJL: keys as a 1-bit Johnson-Lindenstrauss sign sketch, values groupwise scalar-quantized.
//!
//! Keys (see `keys.rs`): per layer and kv head a seeded Gaussian matrix S (m x d); a key stores
//! `sign(S k)` in m bits and `||k||` in fp16 (plus, optionally, its `outliers` largest channels
//! exactly), and is scored as `sqrt(pi/2)/m * ||k|| * <S q, sign(S k)>`, unbiased over S. `S q`
//! is computed once per query and turned into a byte lookup table. Values (see `values.rs`):
//! per token, groups of `group_size` coordinates at `value_bits` (2 or 4; 8 allowed) with an
//! fp16 scale and an fp16 minimum per group.
//!
//! **What `bits` means.** `bits` (2, 3 or 4; default 3) is the average number of bits per
//! element over keys and values together, counting everything a compressed token holds (signs,
//! norm, outliers, codes, scales, minima; the fp16 window and sinks come on top, as for every
//! method). Each token and kv head gets `2 * bits * d` bits: the values take
//! `d * (value_bits + 32 / group_size)`, and the key sketch takes what is left after its 16-bit
//! norm and 24 bits per outlier, rounded down to a multiple of 8:
//! `m = floor8(2 * bits * d - d * (value_bits + 32 / group_size) - 16 - 24 * outliers)`.
//!
//! | bits | value_bits | group_size | outliers | keys, bits/elem | values, bits/elem | m, d = 64 | m, d = 128 |
//! |------|------------|------------|----------|-----------------|-------------------|-----------|------------|
//! | 2    | 2          | 64         | 0        | 1.5             | 2.5               | 80        | 176        |
//! | 3    | 2          | 64         | 1        | 3.5             | 2.5               | 184       | 408        |
//! | 4    | 2          | 64         | 4        | 5.5             | 2.5               | 240       | 592        |
//!
//! So the `qjl-3bit` preset at SmolLM2's d = 64 is: keys = 184 sign bits + fp16 norm + one exact
//! outlier channel (u8 index + fp16 value) = 23 + 2 + 3 = 28 bytes (3.5 bits per element),
//! values = 2-bit codes in one group of 64 with an fp16 scale and minimum = 16 + 4 = 20 bytes
//! (2.5 bits per element): 48 bytes per token and kv head, exactly 3.0 bits per element on
//! average (against 256 bytes in fp16).
//!
//! The split was measured on SmolLM2-135M (perplexity of 8 chunks of 512 tokens of Paradise
//! Lost, window 64; fp16 75.3): the sketch's noise dominates, so bits go to the keys: at 3 bits
//! groups of 32 and no outliers give 229, groups of 64 190, plus one outlier 139 (two: 164); at
//! 4 bits 4-bit values with a 3-bit sketch give 243, 2-bit values with groups of 64 and 4
//! outliers 97; at 2 bits an outlier costs more than it saves (821 without, 1233 with). Real
//! keys have outlier channels (keeping 4 of them exactly at m = 176 takes 247 to 113); on
//! Gaussian keys outliers neither help nor hurt much (tests.rs). Even so QJL stays far from
//! TurboQuant-MSE at equal bits (3 bits: 77.0): a 1-bit sketch's noise, sqrt(pi/2 * d/m) of
//! |q| |k|, is large next to the logit differences that matter. The 2-bit value codes search a
//! trimmed range per group (values.rs), which cuts their RMS error by about a fifth.
//!
//! Params (a preset's `[params]`): `value_bits`, `group_size`, `outliers` override the table's
//! split (m then fills the rest of the budget; a split that leaves no room is an error);
//! `sketch_dim` sets m directly unless the request sets bits (which then fill their budget);
//! `window` (64), `sinks` (0), `seed`, `center_keys` (true) and
//! `center_min_share` (0): see `crate::compressed`.

pub mod keys;
pub mod values;

use crate::compressed::CodecFactory;
use crate::params::QjlParams;
use crate::registry::{BuildArgs, MethodEntry};
use crate::traits::CacheGeometry;
use crate::{CacheError, Result};
pub use keys::{OUTLIER_BYTES, QjlKeyCodec};
use std::sync::Arc;
pub use values::{GroupCodec, VALUE_BITS};

/// Registry name.
pub const METHOD: &str = "qjl";

/// Largest sketch dimension a preset may set (the matrices are m x d f32 per head).
pub const MAX_SKETCH_DIM: usize = 8192;

/// The bits a request may ask for.
pub const BITS: [u8; 3] = [2, 3, 4];

/// How the key sketch dimension is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SketchSize {
    /// Fill an average of `bits` bits per element over keys and values (see the module doc).
    Budget(u32),
    /// A fixed sketch dimension m.
    Fixed(usize),
}

/// Builds QJL caches.
#[derive(Debug, Clone)]
pub struct QjlFactory {
    pub sketch: SketchSize,
    /// Bits per value code (2, 4 or 8).
    pub value_bits: u32,
    /// Coordinates per value group (capped at head_dim; must then divide it).
    pub group_size: usize,
    /// Largest-magnitude key channels kept exactly per token.
    pub outliers: usize,
    /// Recent tokens kept in fp16.
    pub window: usize,
    /// First tokens kept in fp16.
    pub sinks: usize,
    /// Seed of the sketch matrices.
    pub seed: u64,
    /// Code keys centered (see `crate::compressed`) in the kv heads whose center carries at
    /// least `center_min_share` percent of their first keys' energy (0: all).
    pub center_keys: bool,
    pub center_min_share: u32,
}

impl QjlFactory {
    /// The configuration for `bits` bits per element (see the table in the module doc).
    pub fn new(bits: u32) -> Self {
        let outliers = match bits {
            0..=2 => 0,
            3 => 1,
            _ => 4,
        };
        Self {
            sketch: SketchSize::Budget(bits),
            value_bits: 2,
            group_size: 64,
            outliers,
            window: 64,
            sinks: 0,
            seed: 0x51_4A4C,
            center_keys: true,
            center_min_share: 0,
        }
    }

    /// Builds from a registry request: bits (or the default 3) and a preset's params.
    pub fn from_args(a: &BuildArgs<'_>) -> Result<Self> {
        let base = Self::new(a.bits().map_or(3, u32::from));
        let p: QjlParams = a.typed(METHOD)?;
        let w = &p.frame.window;
        let sketch = match (a.request_bits, p.sketch_dim) {
            (None, Some(m)) => SketchSize::Fixed(m),
            _ => base.sketch,
        };
        let f = Self {
            sketch,
            value_bits: p.value_bits.unwrap_or(base.value_bits),
            group_size: p.group_size.unwrap_or(base.group_size),
            outliers: p.outliers.unwrap_or(base.outliers),
            window: w.window.unwrap_or(base.window),
            sinks: w.sinks.unwrap_or(base.sinks),
            seed: w.seed.unwrap_or(base.seed),
            center_keys: p.frame.center_keys.unwrap_or(base.center_keys),
            center_min_share: p.frame.center_min_share.unwrap_or(base.center_min_share),
        };
        f.validate()?;
        Ok(f)
    }

    /// Checks what does not depend on the head dimension.
    fn validate(&self) -> Result<()> {
        let bad = |message: String| CacheError::Preset {
            path: METHOD.to_string(),
            message,
        };
        if !VALUE_BITS.contains(&self.value_bits) {
            return Err(bad(format!(
                "value_bits must be 2, 4 or 8, got {}",
                self.value_bits
            )));
        }
        if self.group_size == 0 {
            return Err(bad("group_size must be positive".into()));
        }
        match self.sketch {
            SketchSize::Budget(b) => {
                // Keys need at least one bit per element before their norm.
                let values = self.value_bits as f64 + 32.0 / self.group_size as f64;
                if 2.0 * b as f64 - values < 1.0 {
                    return Err(bad(format!(
                        "{b} bits per element leave the key sketch less than 1 bit per element \
                         next to {values} bits per value"
                    )));
                }
            }
            SketchSize::Fixed(m) if m == 0 || !m.is_multiple_of(8) || m > MAX_SKETCH_DIM => {
                return Err(bad(format!(
                    "sketch_dim must be a positive multiple of 8 up to {MAX_SKETCH_DIM}, got {m}"
                )));
            }
            SketchSize::Fixed(_) => {}
        }
        Ok(())
    }

    /// The value group size used at head dimension `d`.
    pub fn group_for(&self, d: usize) -> usize {
        self.group_size.min(d)
    }

    /// The sketch dimension m used at head dimension `d` (see the module doc).
    pub fn sketch_dim_for(&self, d: usize) -> Result<usize> {
        match self.sketch {
            SketchSize::Fixed(m) => Ok(m),
            SketchSize::Budget(b) => {
                let g = self.group_for(d);
                let total = 2 * b as usize * d;
                let values = d * self.value_bits as usize + 32 * d.div_ceil(g);
                let fixed = values + 16 + 8 * OUTLIER_BYTES * self.outliers;
                match total.checked_sub(fixed).map(|k| k / 8 * 8) {
                    Some(m) if m >= 8 => Ok(m),
                    _ => Err(CacheError::Shape(format!(
                        "{METHOD}: {b} bits per element leave no room for a key sketch at \
                         head_dim {d}"
                    ))),
                }
            }
        }
    }
}

impl CodecFactory for QjlFactory {
    type Keys = QjlKeyCodec;
    type Values = GroupCodec;

    fn method(&self) -> &'static str {
        METHOD
    }

    fn codecs(&self, layer: usize, geom: &CacheGeometry) -> Result<(QjlKeyCodec, GroupCodec)> {
        let d = geom.head_dim;
        let m = self.sketch_dim_for(d)?;
        let keys = QjlKeyCodec::new(d, geom.n_kv_heads, m, self.outliers, layer, self.seed)?;
        let values = GroupCodec::new(d, self.value_bits, self.group_for(d))?;
        Ok((keys, values))
    }

    fn window(&self) -> usize {
        self.window
    }

    fn sinks(&self) -> usize {
        self.sinks
    }

    fn key_centering(&self) -> Option<f32> {
        self.center_keys
            .then_some(self.center_min_share.min(100) as f32 / 100.0)
    }
}

/// The registry entry: bits 2, 3 or 4 (default 3), params as in the module doc.
pub fn entry() -> MethodEntry {
    MethodEntry {
        name: METHOD,
        bits: BITS.to_vec(),
        default_bits: 3,
        build: |a| Ok(Arc::new(QjlFactory::from_args(a)?)),
        check: |params, bits| {
            QjlFactory::from_args(&BuildArgs::check_only(params, bits)).map(|_| ())
        },
    }
}

#[cfg(test)]
mod tests;
