//! The factory and registry entry the TurboQuant methods share (MSE, RVQ, Prod): rotated codecs
//! built from bits per coordinate, one setting for keys and one for values.

use crate::compressed::{CodecFactory, KeyCodec, ValueCodec};
use crate::params::TurboQuantParams;
use crate::registry::{BuildArgs, MethodEntry};
use crate::traits::{CacheFactory, CacheGeometry};
use crate::{CacheError, Result};
use std::marker::PhantomData;
use std::sync::Arc;

/// A TurboQuant method as [`BitsFactory`] builds it: its name, bits and per-layer codecs.
pub trait BitsMethod: 'static {
    /// Registry name.
    const METHOD: &'static str;
    /// Bits per coordinate a request may ask for.
    const VALID_BITS: &'static [u8];
    /// Bits when neither request nor preset names them.
    const DEFAULT_BITS: u8;
    /// Seed of the rotations (values use `seed ^ 0xA5A5`).
    const SEED: u64;
    /// Default `center_min_share` (percent, see [`BitsFactory`]).
    const CENTER_MIN_SHARE: u32;
    type Keys: KeyCodec + 'static;
    type Values: ValueCodec + 'static;
    /// The key codec of one layer, seeded by (`seed`, layer, head).
    fn keys(d: usize, heads: usize, bits: u32, layer: usize, seed: u64) -> Result<Self::Keys>;
    /// The value codec of one layer, seeded by (`seed`, layer, head).
    fn values(d: usize, heads: usize, bits: u32, layer: usize, seed: u64) -> Result<Self::Values>;
    /// Whether a preset's (or request's) key and value bits are allowed; by default both must be
    /// among [`Self::VALID_BITS`].
    fn check_bits(key_bits: u32, value_bits: u32) -> Result<()> {
        for b in [key_bits, value_bits] {
            if !Self::VALID_BITS.contains(&(b.min(255) as u8)) {
                return Err(invalid_bits::<Self>(b));
            }
        }
        Ok(())
    }
}

/// The error for `bits` that `M` does not take.
pub fn invalid_bits<M: BitsMethod + ?Sized>(bits: u32) -> CacheError {
    CacheError::InvalidBits {
        method: M::METHOD.into(),
        bits: bits.min(255) as u8,
        valid: M::VALID_BITS.to_vec(),
    }
}

/// Builds the caches of TurboQuant method `M`.
pub struct BitsFactory<M> {
    /// Bits per coordinate for keys and for values.
    pub key_bits: u32,
    pub value_bits: u32,
    /// Recent tokens kept in fp16.
    pub window: usize,
    /// First tokens kept in fp16.
    pub sinks: usize,
    /// Seed of the rotations.
    pub seed: u64,
    /// Code keys centered (see `crate::compressed`) ...
    pub center_keys: bool,
    /// ... in the kv heads whose center carries at least this percentage of their first keys'
    /// energy.
    pub center_min_share: u32,
    pub method: PhantomData<fn() -> M>,
}

impl<M> Clone for BitsFactory<M> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<M> Copy for BitsFactory<M> {}

impl<M: BitsMethod> std::fmt::Debug for BitsFactory<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(M::METHOD)
            .field("key_bits", &self.key_bits)
            .field("value_bits", &self.value_bits)
            .field("window", &self.window)
            .field("sinks", &self.sinks)
            .field("seed", &self.seed)
            .field("center_keys", &self.center_keys)
            .field("center_min_share", &self.center_min_share)
            .finish()
    }
}

impl<M: BitsMethod> BitsFactory<M> {
    /// `bits` for keys and values, the default window (64) and no sinks.
    pub fn new(bits: u32) -> Self {
        Self {
            key_bits: bits,
            value_bits: bits,
            window: 64,
            sinks: 0,
            seed: M::SEED,
            center_keys: true,
            center_min_share: M::CENTER_MIN_SHARE,
            method: PhantomData,
        }
    }

    /// Builds from a registry request; a preset may set `key_bits`, `value_bits`, `window`,
    /// `sinks`, `seed`, `center_keys` and `center_min_share` in its `[params]`, and request bits override both key and value bits.
    pub fn from_args(a: &BuildArgs<'_>) -> Result<Self> {
        let base = Self::new(u32::from(M::DEFAULT_BITS));
        let p: TurboQuantParams = a.typed(M::METHOD)?;
        let (f, w) = (&p.frame, &p.frame.window);
        let f = Self {
            key_bits: a.part_bits(p.key_bits, base.key_bits),
            value_bits: a.part_bits(p.value_bits, base.value_bits),
            window: w.window.unwrap_or(base.window),
            sinks: w.sinks.unwrap_or(base.sinks),
            seed: w.seed.unwrap_or(base.seed),
            center_keys: f.center_keys.unwrap_or(base.center_keys),
            center_min_share: f.center_min_share.unwrap_or(base.center_min_share),
            method: PhantomData,
        };
        M::check_bits(f.key_bits, f.value_bits)?;
        Ok(f)
    }

    /// The registry entry of `M`.
    pub fn entry() -> MethodEntry {
        MethodEntry {
            name: M::METHOD,
            bits: M::VALID_BITS.to_vec(),
            default_bits: M::DEFAULT_BITS,
            build: |a| Ok(Arc::new(Self::from_args(a)?) as Arc<dyn CacheFactory>),
            check: |params, preset_bits| {
                Self::from_args(&BuildArgs::check_only(params, preset_bits)).map(|_| ())
            },
        }
    }
}

impl<M: BitsMethod> CodecFactory for BitsFactory<M> {
    type Keys = M::Keys;
    type Values = M::Values;

    fn method(&self) -> &'static str {
        M::METHOD
    }

    fn codecs(&self, layer: usize, geom: &CacheGeometry) -> Result<(M::Keys, M::Values)> {
        let (d, h) = (geom.head_dim, geom.n_kv_heads);
        let keys = M::keys(d, h, self.key_bits, layer, self.seed)?;
        let values = M::values(d, h, self.value_bits, layer, self.seed ^ 0xA5A5)?;
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
