//! Dense caches: `fp16` (the baseline) and `f32` (exact, the reference the golden test uses).
//! Keys and values are held in fixed-size blocks allocated as the sequence grows (never a
//! concatenation per token); under a sliding window the blocks no query can reach again are
//! released and recycled, so memory stops growing at the window. Attention is exact up to the
//! storage type's rounding: a decode step's few rows in spans over both cores (`decode.rs`), a
//! prompt chunk in tiles with an online softmax, never a score matrix (`prefill.rs`). On a GPU
//! the rows live in device buffers instead (`device.rs`). `state.rs` saves and restores either
//! (`KvCache::save_state`).

mod decode;
mod device;
mod prefill;
mod state;

use crate::Result;
use crate::attention::{axpy, window_start};
use crate::traits::{CacheFactory, CacheGeometry, CacheState, KvCache};
use candle_core::{DType, Device, Tensor};
use half::f16;
use half::slice::HalfFloatSliceExt;
use kvq_kernels::{KeyColumns, ScoreRows};

/// Positions per allocated block.
pub const BLOCK_TOKENS: usize = 256;

/// Query rows at or below this count take the decode loop (spans over all cores, merged);
/// more take the prompt's tiles (`prefill.rs`).
const DECODE_MAX_ROWS: usize = 8;

/// A storage element of a dense cache.
pub trait Element: Copy + Send + Sync + 'static {
    /// The registry name of the cache storing this type.
    const METHOD: &'static str;
    /// The candle dtype of this type.
    const DTYPE: DType;
    /// Zero.
    const ZERO: Self;
    /// Converts a slice to f32.
    fn to_f32_slice(src: &[Self], dst: &mut [f32]);
    /// Reads a tensor of this dtype.
    fn read(t: &Tensor) -> Result<Vec<Self>>;
    /// A host tensor of `dims` holding `data`.
    fn host_tensor(data: Vec<Self>, dims: (usize, usize, usize)) -> Result<Tensor>;
    /// Adds `scale * q_i . k_j` to the scores of the rows of `q` (`[rows, d]`) and keys `k_j`.
    fn add_scores(k: KeyColumns<'_, Self>, q: &[f32], d: usize, scale: f32, s: ScoreRows<'_>) {
        let mut col = vec![0f32; k.len];
        for dd in 0..d {
            Self::to_f32_slice(&k.keys[dd * k.stride..][..k.len], &mut col);
            for (i, qi) in q.chunks_exact(d).enumerate() {
                let row = &mut s.out[i * s.row_stride + s.offset..][..k.len];
                axpy(row, qi[dd] * scale, &col);
            }
        }
    }
}

impl Element for f16 {
    const METHOD: &'static str = "fp16";
    const DTYPE: DType = DType::F16;
    const ZERO: Self = f16::ZERO;
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn read(t: &Tensor) -> Result<Vec<Self>> {
        Ok(t.to_dtype(DType::F16)?.flatten_all()?.to_vec1::<f16>()?)
    }
    fn host_tensor(data: Vec<Self>, dims: (usize, usize, usize)) -> Result<Tensor> {
        Ok(Tensor::from_vec(data, dims, &Device::Cpu)?)
    }
    fn add_scores(k: KeyColumns<'_, Self>, q: &[f32], d: usize, scale: f32, s: ScoreRows<'_>) {
        kvq_kernels::add_scores_f16(k, q, d, scale, s);
    }
}

impl Element for f32 {
    const METHOD: &'static str = "f32";
    const DTYPE: DType = DType::F32;
    const ZERO: Self = 0.0;
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn read(t: &Tensor) -> Result<Vec<Self>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    }
    fn host_tensor(data: Vec<Self>, dims: (usize, usize, usize)) -> Result<Tensor> {
        Ok(Tensor::from_vec(data, dims, &Device::Cpu)?)
    }
}

/// Builds [`DenseCache`]s storing `E`.
#[derive(Debug, Default, Clone)]
pub struct DenseFactory<E>(std::marker::PhantomData<E>);

impl<E> DenseFactory<E> {
    /// A factory.
    pub fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<E: Element> CacheFactory for DenseFactory<E> {
    fn method(&self) -> &str {
        E::METHOD
    }

    fn create(&self, _layer: usize, geom: &CacheGeometry) -> Result<Box<dyn KvCache>> {
        Ok(Box::new(DenseCache::<E>::new(*geom)))
    }
}

/// The registry entry of the fp16 baseline.
pub fn fp16_entry() -> crate::registry::MethodEntry {
    crate::registry::MethodEntry {
        name: "fp16",
        bits: vec![16],
        default_bits: 16,
        build: |_| Ok(std::sync::Arc::new(DenseFactory::<f16>::new())),
        check: |params, _| {
            crate::params::parse::<crate::params::NoParams>("fp16", params).map(|_| ())
        },
    }
}

/// The registry entry of the exact f32 cache (the golden reference).
pub fn f32_entry() -> crate::registry::MethodEntry {
    crate::registry::MethodEntry {
        name: "f32",
        bits: vec![32],
        default_bits: 32,
        build: |_| Ok(std::sync::Arc::new(DenseFactory::<f32>::new())),
        check: |params, _| {
            crate::params::parse::<crate::params::NoParams>("f32", params).map(|_| ())
        },
    }
}

/// The fp16 baseline.
pub type Fp16Cache = DenseCache<f16>;
/// The exact f32 cache.
pub type F32Cache = DenseCache<f32>;

/// One block of `BLOCK_TOKENS` positions. Keys are held transposed, `[n_kv_heads, head_dim,
/// BLOCK_TOKENS]`, so a query's scores over a run of positions are `head_dim` contiguous
/// multiply-adds (no per-key horizontal sum), for a decode step's rows and a prompt tile's
/// alike; values are `[n_kv_heads, BLOCK_TOKENS, head_dim]`, accumulated row by row.
#[derive(Clone)]
struct Block<E> {
    k: Vec<E>,
    v: Vec<E>,
}

/// The dense cache of one layer.
pub struct DenseCache<E> {
    geom: CacheGeometry,
    /// Block `b` holds positions `b * BLOCK_TOKENS..`; under a sliding window the blocks every
    /// future query is past are released (`None`) and recycled for new positions.
    blocks: Vec<Option<Block<E>>>,
    /// A released block, reused by the next new one.
    spare: Option<Block<E>>,
    len: usize,
    /// Release blocks that left the sliding window (see [`Self::keep_all`]).
    roll: bool,
    /// The rows on the device, for a cache whose keys come from a GPU (then `blocks` is empty).
    dev: Option<device::DeviceRows>,
    /// The first position the host blocks hold: 0, but in a cache restored from rows that
    /// start inside a block (`state.rs`), where that block's earlier slots are not positions.
    host_first: usize,
}

impl<E: Element> DenseCache<E> {
    /// An empty cache; memory is allocated block by block on append.
    pub fn new(geom: CacheGeometry) -> Self {
        Self {
            geom,
            blocks: Vec::new(),
            spare: None,
            len: 0,
            roll: true,
            dev: None,
            host_first: 0,
        }
    }

    /// Keeps the rows in tensors and attends in tensor ops even on the CPU, as a GPU cache
    /// does: the tests compare that path with the CPU's.
    pub fn tensor_path(mut self) -> Self {
        self.dev = Some(device::DeviceRows::new::<E>(&self.geom));
        self
    }

    /// Keeps every block even under a sliding window: what the rolling cache must equal (tests),
    /// at the memory it saves.
    pub fn keep_all(mut self) -> Self {
        self.roll = false;
        self
    }

    /// Releases the blocks wholly before `pos`, the first position a query at `self.len` or later
    /// can see under the sliding window; one is kept for reuse.
    fn release_before(&mut self, pos: usize) {
        for slot in self.blocks.iter_mut().take(pos / BLOCK_TOKENS) {
            if let Some(b) = slot.take()
                && self.spare.is_none()
            {
                self.spare = Some(b);
            }
        }
    }

    /// Writes the host rows of keys `kd` and values `vd` (`[kv heads][t][d]`) at positions
    /// `len..len + t`, allocating (or recycling) blocks as needed; `len` is not moved.
    fn write_host(&mut self, kd: &[E], vd: &[E], t: usize) {
        let (kvh, d) = (self.geom.n_kv_heads, self.geom.head_dim);
        let elems = self.block_elems();
        for i in 0..t {
            let pos = self.len + i;
            let (b, slot) = (pos / BLOCK_TOKENS, pos % BLOCK_TOKENS);
            if b >= self.blocks.len() {
                self.blocks.resize_with(b + 1, || None);
            }
            let block = self.blocks[b].get_or_insert_with(|| {
                self.spare.take().unwrap_or_else(|| Block {
                    k: vec![E::ZERO; elems],
                    v: vec![E::ZERO; elems],
                })
            });
            for h in 0..kvh {
                let src = (h * t + i) * d;
                let dst = (h * BLOCK_TOKENS + slot) * d;
                block.v[dst..dst + d].copy_from_slice(&vd[src..src + d]);
                let kcol = h * d * BLOCK_TOKENS + slot;
                for (dd, &x) in kd[src..src + d].iter().enumerate() {
                    block.k[kcol + dd * BLOCK_TOKENS] = x;
                }
            }
        }
    }

    fn block_elems(&self) -> usize {
        self.geom.n_kv_heads * BLOCK_TOKENS * self.geom.head_dim
    }

    /// Offset of value (head, slot) inside a block.
    #[inline]
    fn offset(&self, head: usize, slot: usize) -> usize {
        (head * BLOCK_TOKENS + slot) * self.geom.head_dim
    }

    /// Calls `f(offset, slot, n, block)` for each piece of positions `start..end` that lies in
    /// one block: `n` positions from `slot` of `block`, the first at `start + offset`. Pieces of
    /// released blocks are skipped.
    fn for_each_piece(
        &self,
        start: usize,
        end: usize,
        mut f: impl FnMut(usize, usize, usize, &Block<E>),
    ) {
        let mut j = start;
        while j < end {
            let (b, slot) = (j / BLOCK_TOKENS, j % BLOCK_TOKENS);
            let n = (BLOCK_TOKENS - slot).min(end - j);
            // Positions from `start` on are live (only blocks before every query's window go).
            if let Some(block) = self.blocks.get(b).and_then(Option::as_ref) {
                f(j - start, slot, n, block);
            }
            j += n;
        }
    }

    /// Adds `scale * q_i . k_j` to `scores[i * n + j - start]` for every row `q_i` of `q`
    /// (`[rows, d]`) and position `j` in `start..end` of kv head `kh` (`n = end - start`),
    /// reading each key column once for all the rows.
    pub(super) fn add_scores(
        &self,
        kh: usize,
        q: &[f32],
        (start, end): (usize, usize),
        scale: f32,
        scores: &mut [f32],
    ) {
        let d = self.geom.head_dim;
        let n = end - start;
        self.for_each_piece(start, end, |o, slot, m, block| {
            let base = kh * d * BLOCK_TOKENS + slot;
            let k = KeyColumns {
                keys: &block.k[base..],
                stride: BLOCK_TOKENS,
                len: m,
            };
            let s = ScoreRows {
                out: &mut *scores,
                row_stride: n,
                offset: o,
            };
            E::add_scores(k, q, d, scale, s);
        });
    }

    /// Calls `f(position, row)` for the values of positions `start..end` of kv head `kh`,
    /// converting a block's piece at a time.
    fn for_each_value_block(
        &self,
        kh: usize,
        start: usize,
        end: usize,
        scratch: &mut [f32],
        mut f: impl FnMut(usize, &[f32]),
    ) {
        let d = self.geom.head_dim;
        self.for_each_piece(start, end, |o, slot, n, block| {
            let at = self.offset(kh, slot);
            E::to_f32_slice(&block.v[at..at + n * d], &mut scratch[..n * d]);
            for i in 0..n {
                f(start + o + i, &scratch[i * d..(i + 1) * d]);
            }
        });
    }
}

/// `[t, len - from]` additive mask over keys `from..len`: 0 where query row r (at position
/// `len - t + r`) may see key `from + j`, else -inf.
pub fn causal_mask(
    t: usize,
    len: usize,
    from: usize,
    window: Option<usize>,
    dev: &Device,
) -> Result<Tensor> {
    let n = len - from;
    let mut m = vec![0f32; t * n];
    for r in 0..t {
        let pos = len - t + r;
        let start = window_start(pos, window);
        for (j, x) in m[r * n..(r + 1) * n].iter_mut().enumerate() {
            let key = from + j;
            if key > pos || key < start {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    Ok(Tensor::from_vec(m, (t, n), dev)?)
}

impl<E: Element> KvCache for DenseCache<E> {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let t = self.geom.check_append(self.len, k, v)?;
        if !k.device().is_cpu() || self.dev.is_some() {
            let keep_from = match self.roll {
                true => window_start(self.len, self.geom.sliding_window),
                false => 0,
            };
            let geom = self.geom;
            let dev = self
                .dev
                .get_or_insert_with(|| device::DeviceRows::new::<E>(&geom));
            dev.append::<E>(k, v, self.len, keep_from)?;
            self.len += t;
            return Ok(());
        }
        let kd = E::read(k)?;
        let vd = E::read(v)?;
        if let (Some(w), true) = (self.geom.sliding_window, self.roll) {
            // The new rows' queries start at `len`: nothing before its window is read again.
            self.release_before(window_start(self.len, Some(w)));
        }
        self.write_host(&kd, &vd, t);
        self.len += t;
        Ok(())
    }

    fn attend(&mut self, q: &Tensor, scale: f32) -> Result<Tensor> {
        let t = self.geom.check_attend(self.len, q)?;
        if let Some(dev) = &self.dev {
            return dev.attend(&self.geom, &q.contiguous()?, self.len, scale);
        }
        let qv = q.flatten_all()?.to_vec1::<f32>()?;
        let out = match t > DECODE_MAX_ROWS {
            true => self.attend_tiled(&qv, t, scale)?,
            false => self.attend_rows(&qv, t, scale)?,
        };
        Ok(Tensor::from_vec(out, q.dims(), q.device())?)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn resident_bytes(&self) -> usize {
        if let Some(dev) = &self.dev {
            return dev.bytes();
        }
        self.blocks
            .iter()
            .flatten()
            .chain(&self.spare)
            .map(|b| (b.k.capacity() + b.v.capacity()) * std::mem::size_of::<E>())
            .sum()
    }

    fn reserve_bytes(&self, tokens: usize, chunk: usize) -> usize {
        let tokens = tokens.max(self.len);
        // Positions live at once: all, or under a rolling window the window and a chunk.
        let held = match (self.geom.sliding_window, self.roll) {
            (Some(w), true) => tokens.min(w + chunk.max(1)),
            _ => tokens,
        };
        if let Some(dev) = &self.dev {
            return dev.max_bytes(held, held < tokens);
        }
        // Blocks are allocated one per block index, so never more than `tokens` need; under
        // a window, the live span's blocks plus one at each end and the spare.
        let mut blocks = tokens.div_ceil(BLOCK_TOKENS);
        if held < tokens {
            blocks = blocks.min(held.div_ceil(BLOCK_TOKENS) + 2);
        }
        blocks * 2 * self.block_elems() * std::mem::size_of::<E>()
    }

    fn can_truncate(&self, n: usize) -> bool {
        if n >= self.len {
            return true;
        }
        // A query at position n reads from its window start on: those blocks must still be here.
        let needed = window_start(n, self.geom.sliding_window);
        !(self.dev.as_ref().is_some_and(|d| d.first() > needed)
            || (self.dev.is_none() && self.host_first > needed)
            || self
                .blocks
                .get(needed / BLOCK_TOKENS)
                .is_some_and(Option::is_none))
    }

    fn truncate(&mut self, n: usize) -> Result<()> {
        if n >= self.len {
            return Ok(());
        }
        if !self.can_truncate(n) {
            let needed = window_start(n, self.geom.sliding_window);
            return Err(crate::CacheError::Shape(format!(
                "cannot truncate to {n}: the rows from position {needed} left the sliding window"
            )));
        }
        self.len = n;
        self.blocks.truncate(n.div_ceil(BLOCK_TOKENS));
        Ok(())
    }

    fn method(&self) -> &str {
        E::METHOD
    }

    fn fork(&self) -> Result<Box<dyn KvCache>> {
        Ok(Box::new(Self {
            geom: self.geom,
            blocks: self.blocks.clone(),
            spare: None,
            len: self.len,
            roll: self.roll,
            dev: self.dev.as_ref().map(|d| d.fork()).transpose()?,
            host_first: self.host_first,
        }))
    }

    fn save_state(&self) -> Result<CacheState> {
        self.save()
    }

    fn restore_state(&mut self, state: &CacheState, device: &Device) -> Result<()> {
        self.restore(state, device)
    }
}

#[cfg(test)]
mod tests;
