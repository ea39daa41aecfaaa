//! Codecs as data: the typed code layout and parameter arrays a device kernel needs to run a
//! codec (levels, thresholds, rotation signs, sketch matrices, codebooks). A codec builds its
//! spec once, when it is made; the CPU path keeps running the [`KeyCodec`](crate::KeyCodec) /
//! [`ValueCodec`](crate::ValueCodec) trait methods, and a device backend uploads the spec's
//! arrays once per device (see [`DeviceCache`]) and picks its kernel by the spec's variant.

use std::any::Any;
use std::sync::{Arc, Mutex};

/// One scalar codebook over rotated coordinates scaled to unit variance (TurboQuant MSE, the
/// RVQ stages folded into one codebook, and the first stage of TurboQuant-Prod).
///
/// Code row: `norm` (f16 LE) then `d` indices of `bits` bits packed LSB first (8 indices fill
/// exactly `bits` bytes). Row value: `norm * sigma * levels[idx_i]`, rotated back.
#[derive(Debug, Clone, PartialEq)]
pub struct ScalarSpec {
    /// Bits per index (1..=6).
    pub bits: u32,
    /// `2^bits` levels in code order.
    pub levels: Vec<f32>,
    /// The `2^bits - 1` decision thresholds between the levels sorted ascending.
    pub thresholds: Vec<f32>,
    /// The code of the `i`-th smallest level (`2^bits` entries; identity for MSE).
    pub code_of: Vec<u8>,
    /// `1/sqrt(d)`: coordinates of a unit vector rotated have this standard deviation.
    pub sigma: f32,
    /// Rotation signs of each kv head, `[heads][d]` (+1 / -1): the rotation is
    /// `x -> H diag(signs) x / sqrt(d)`.
    pub signs: Vec<f32>,
}

impl ScalarSpec {
    /// Bytes of one code row at head dim `d`.
    pub fn code_bytes(&self, d: usize) -> usize {
        2 + (d * self.bits as usize).div_ceil(8)
    }
}

/// Gaussian sign sketches, one `m x d` matrix per kv head.
#[derive(Debug, Clone, PartialEq)]
pub struct SketchSpec {
    /// Sketch dimension (a multiple of 8).
    pub m: usize,
    /// Matrices stored transposed, `[heads][d][m]` (`data[h][j][i] = S_h[i][j]`).
    pub matrices: Arc<[f32]>,
}

/// What a device kernel needs to score keys from their codes.
#[derive(Debug, Clone, PartialEq)]
pub enum KeySpec {
    /// [`ScalarSpec`] rows.
    Scalar(ScalarSpec),
    /// TurboQuant-Prod: a [`ScalarSpec`] row, then `||r||` (f16 LE) and `m / 8` sign bytes of the
    /// residual's sketch: `q . k ~ scalar(q) + sqrt(pi/2)/m ||r|| <S q, sign(S r)>`.
    ScalarSketch {
        scalar: ScalarSpec,
        sketch: SketchSpec,
    },
    /// QJL: `||k_rest||` (f16 LE), `m / 8` sign bytes, then `outliers` channel indices (u8) and
    /// `outliers` fp16 values.
    Sketch { sketch: SketchSpec, outliers: usize },
    /// VecInfer: `d / sub` one-byte centroid indices of `(k / lambda)` rotated.
    ProductVq(VqSpec),
}

/// What a device kernel needs to accumulate values from their codes.
#[derive(Debug, Clone, PartialEq)]
pub enum ValueSpec {
    /// [`ScalarSpec`] rows.
    Scalar(ScalarSpec),
    /// QJL values: per group of `group` coordinates an f16 scale and f16 minimum (all groups
    /// first), then `bits`-bit codes (2, 4 or 8) packed LSB first: `v ~ min + scale * code`.
    Group { bits: u32, group: usize },
    /// VecInfer: `d / sub` one-byte centroid indices of `v` rotated.
    ProductVq(VqSpec),
}

/// VecInfer's product quantizer of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct VqSpec {
    /// Sub-vector length (4 or 8).
    pub sub: usize,
    /// Codebooks `[books][256][sub]`, `books` = 1 (shared) or `d / sub`.
    pub books: Vec<f32>,
    /// Rotation signs `[heads][d]`.
    pub signs: Vec<f32>,
    /// Per-channel smoothing `[heads][d]` (keys: queries are multiplied by it, keys divided;
    /// empty for values).
    pub lambda: Vec<f32>,
}

/// Device copies of a spec's arrays, one per device, made on first use and kept as long as the
/// codec: a backend stores its own type (`Arc<dyn Any>`) keyed by a device id of its choosing.
#[derive(Default)]
pub struct DeviceCache {
    entries: Mutex<Vec<(String, Arc<dyn Any + Send + Sync>)>>,
}

impl std::fmt::Debug for DeviceCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.entries.lock().map_or(0, |e| e.len());
        write!(f, "DeviceCache({n} devices)")
    }
}

impl DeviceCache {
    /// The entry for `device`, made by `make` the first time.
    pub fn get_or_try_insert<T, E>(
        &self,
        device: &str,
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<Arc<T>, E>
    where
        T: Any + Send + Sync,
    {
        // A panic while holding the lock leaves a usable list (entries are only ever added).
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, found)) = entries.iter().find(|(d, _)| d == device)
            && let Ok(t) = found.clone().downcast::<T>()
        {
            return Ok(t);
        }
        let fresh = Arc::new(make()?);
        entries.push((device.to_string(), fresh.clone()));
        Ok(fresh)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_cache_makes_each_entry_once() {
        let cache = DeviceCache::default();
        let mut made = 0;
        for _ in 0..3 {
            let v: Arc<u32> = cache
                .get_or_try_insert("cuda:0", || {
                    made += 1;
                    Ok::<_, ()>(7)
                })
                .unwrap();
            assert_eq!(*v, 7);
        }
        let w: Arc<u32> = cache
            .get_or_try_insert("cuda:1", || Ok::<_, ()>(9))
            .unwrap();
        assert_eq!((*w, made), (9, 1));
        let e: Result<Arc<u64>, &str> = cache.get_or_try_insert("cuda:2", || Err("no device"));
        assert_eq!(e.unwrap_err(), "no device");
    }
}
