//! VecInfer: product vector quantization of keys and values with codebooks trained on the
//! model's own keys and values. Keys are smoothed per channel (`k / lambda`, lambda from
//! calibration), rotated by a seeded randomized Hadamard transform and cut into sub-vectors of
//! `sub_dim` (4 or 8) values, each stored as a one-byte index into the layer's 256-centroid
//! k-means codebook: `8 / sub_dim` bits per element (2-bit = sub_dim 4, 1-bit = sub_dim 8).
//! Values are rotated and coded the same way with their own codebook. Scores come from a
//! per-query lookup table, values are accumulated per code (see `codec`).
//!
//! Codebooks and lambdas come from [`calibration`] through the registry's `CalibrationSource`
//! (`kvq calibrate`, or the server calibrating on first use); the capturing cache that records
//! a model's keys for it is in [`capture`].

pub mod calibration;
pub mod capture;
pub mod codec;

use crate::compressed::CodecFactory;
use crate::params::VecInferParams;
use crate::registry::{BuildArgs, MethodEntry};
use crate::traits::CacheGeometry;
use crate::{CacheError, Result};
use calibration::VecInferCalibration;
use codec::{ValueAccum, VqKeyCodec, VqValueCodec};
use std::sync::Arc;

/// Registry name.
pub const METHOD: &str = "vecinfer";

/// The default Hadamard seed (a calibration is trained under one seed).
pub const DEFAULT_SEED: u64 = 0x7665_6369_6e66;

/// First tokens kept in fp16 by default: the first token is SmolLM2's attention sink, and
/// coding it costs far more than its 256 bytes per head (KL divergence vs fp16 on Macbeth at
/// 512 context, 2-bit: 0.36 without, 0.15 with).
pub const DEFAULT_SINKS: usize = 1;

/// Value accumulation: histogram for compressed runs of at least this many positions.
pub const HISTOGRAM_MIN: usize = 256;

/// Sub-vector length for `bits` per element.
pub fn sub_dim_for_bits(bits: u8) -> Result<usize> {
    match bits {
        2 => Ok(4),
        1 => Ok(8),
        b => Err(CacheError::InvalidBits {
            method: METHOD.into(),
            bits: b,
            valid: vec![1, 2],
        }),
    }
}

/// The registry entry: bits 1 or 2 (default 2); a preset may set `sub_dim` (4 or 8), `window`,
/// `sinks` and `seed` in its `[params]`; request bits win over the preset's `sub_dim`.
pub fn entry() -> MethodEntry {
    MethodEntry {
        name: METHOD,
        bits: vec![1, 2],
        default_bits: 2,
        build: |a| {
            let (sub_dim, p) = sub_dim_of(a)?;
            let seed = p.window.seed.unwrap_or(DEFAULT_SEED);
            let source = a.calibration.ok_or_else(|| {
                CacheError::Calibration(format!(
                    "{METHOD} needs codebooks trained on the model (`kvq calibrate`), and no \
                     calibration source is configured"
                ))
            })?;
            let cal = source
                .calibration(METHOD, a.params)?
                .downcast::<VecInferCalibration>()
                .map_err(|_| {
                    CacheError::Calibration(format!(
                        "the calibration source gave {METHOD} something other than a \
                         VecInferCalibration"
                    ))
                })?;
            let f = VecInferFactory {
                window: p.window.window.unwrap_or(64),
                sinks: p.window.sinks.unwrap_or(DEFAULT_SINKS),
                ..VecInferFactory::new(cal, sub_dim, seed)?
            };
            Ok(Arc::new(f))
        },
        // The codebooks come from the model: what can be checked without them.
        check: |params, bits| sub_dim_of(&BuildArgs::check_only(params, bits)).map(|_| ()),
    }
}

/// The sub-vector size a request builds with (request bits win over the preset's `sub_dim`,
/// which wins over its bits) and the preset's parameters.
fn sub_dim_of(a: &BuildArgs<'_>) -> Result<(usize, VecInferParams)> {
    let p: VecInferParams = a.typed(METHOD)?;
    let sub_dim = match (a.request_bits, p.sub_dim) {
        (Some(b), _) => sub_dim_for_bits(b)?,
        (None, Some(s)) if s == 4 || s == 8 => s,
        (None, Some(s)) => {
            return Err(CacheError::Preset {
                path: "sub_dim".into(),
                message: format!("parameter 'sub_dim' of {METHOD} must be 4 or 8, got {s}"),
            });
        }
        (None, None) => a.preset_bits.map_or(Ok(4), sub_dim_for_bits)?,
    };
    Ok((sub_dim, p))
}

/// Builds VecInfer caches from a calibration.
#[derive(Clone)]
pub struct VecInferFactory {
    pub calibration: Arc<VecInferCalibration>,
    pub sub_dim: usize,
    /// Recent tokens kept in fp16.
    pub window: usize,
    /// First tokens kept in fp16.
    pub sinks: usize,
    /// How values are accumulated.
    pub accum: ValueAccum,
}

impl std::fmt::Debug for VecInferFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VecInferFactory")
            .field("model", &self.calibration.meta.model_name)
            .field("sub_dim", &self.sub_dim)
            .field("window", &self.window)
            .field("sinks", &self.sinks)
            .finish()
    }
}

impl VecInferFactory {
    /// A factory for `sub_dim` with the default window (64) and [`DEFAULT_SINKS`]. The calibration
    /// must hold codebooks for `sub_dim` and have been trained under `seed`.
    pub fn new(calibration: Arc<VecInferCalibration>, sub_dim: usize, seed: u64) -> Result<Self> {
        let m = &calibration.meta;
        if !m.sub_dims.contains(&sub_dim) {
            return Err(CacheError::Calibration(format!(
                "the calibration of {} has codebooks for sub_dim {:?}, not {sub_dim}",
                m.model_name, m.sub_dims
            )));
        }
        if m.seed != seed {
            return Err(CacheError::Calibration(format!(
                "the calibration of {} was trained under seed {}, not {seed}",
                m.model_name, m.seed
            )));
        }
        Ok(Self {
            calibration,
            sub_dim,
            window: 64,
            sinks: DEFAULT_SINKS,
            accum: ValueAccum::Auto(HISTOGRAM_MIN),
        })
    }
}

impl CodecFactory for VecInferFactory {
    type Keys = VqKeyCodec;
    type Values = VqValueCodec;

    fn method(&self) -> &'static str {
        METHOD
    }

    /// The codebooks and smoothing factors were trained on raw keys.
    fn key_centering(&self) -> Option<f32> {
        None
    }

    fn codecs(&self, layer: usize, geom: &CacheGeometry) -> Result<(VqKeyCodec, VqValueCodec)> {
        let m = &self.calibration.meta;
        if layer >= m.n_layers || geom.n_kv_heads != m.n_kv_heads || geom.head_dim != m.head_dim {
            return Err(CacheError::Calibration(format!(
                "the calibration of {} covers {} layers of {} kv heads x {}, asked for layer \
                 {layer} of {} kv heads x {}",
                m.model_name, m.n_layers, m.n_kv_heads, m.head_dim, geom.n_kv_heads, geom.head_dim
            )));
        }
        let l = &self.calibration.layers[layer];
        let books = l.books(self.sub_dim).ok_or_else(|| {
            CacheError::Calibration(format!(
                "layer {layer}: no codebooks for sub_dim {}",
                self.sub_dim
            ))
        })?;
        let (d, s) = (geom.head_dim, self.sub_dim);
        Ok((
            VqKeyCodec::new(d, s, layer, m.seed, &l.key_lambda, &books.keys)?,
            VqValueCodec::new(
                d,
                s,
                layer,
                m.seed,
                geom.n_kv_heads,
                &books.values,
                self.accum,
            )?,
        ))
    }

    fn window(&self) -> usize {
        self.window
    }

    fn sinks(&self) -> usize {
        self.sinks
    }
}

#[cfg(test)]
mod tests;
