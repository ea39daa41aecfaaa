//! What the dense and the compressed caches' tiled CPU attention share (flash-attention style,
//! `methods/dense/prefill.rs` and `compressed/merge.rs`): the work item (one kv head and up to
//! [`TILE_POSITIONS`] query positions, all its GQA group's heads), gathering its query rows,
//! scattering its outputs back, and one row's online-softmax state.

/// Query positions per work item: with GQA group g an item scores `g * TILE_POSITIONS` rows per
/// key it converts.
pub const TILE_POSITIONS: usize = 16;

/// One row's online-softmax state over the keys folded so far; the unnormalized output lives
/// beside it in the item's accumulator.
#[derive(Clone, Copy)]
pub(crate) struct RowState {
    pub max: f32,
    pub sum: f32,
}

impl RowState {
    /// Nothing seen yet.
    pub const EMPTY: Self = Self {
        max: f32::NEG_INFINITY,
        sum: 0.0,
    };

    /// Folds a span's scaled scores `row` into the state: on a new max, rescales the sum and
    /// the row's output `acc`; then turns `row` into its weights `exp(s - max)` in place (for
    /// the caller's value pass) and adds them up. An empty `row` changes nothing.
    pub fn fold(&mut self, row: &mut [f32], acc: &mut [f32]) {
        let span_max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if span_max > self.max {
            // exp(-inf) = 0 the first time.
            let c = (self.max - span_max).exp();
            self.sum *= c;
            acc.iter_mut().for_each(|x| *x *= c);
            self.max = span_max;
        }
        if !row.is_empty() {
            self.sum += kvq_kernels::exp_sub_sum(row, self.max);
        }
    }
}

/// The shape of a chunk's tiled attention: `t` query positions of `n_heads` heads over
/// `n_kv_heads` kv heads of dimension `d`.
#[derive(Clone, Copy)]
pub(crate) struct TileGrid {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub t: usize,
    pub d: usize,
}

impl TileGrid {
    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Tiles per kv head.
    pub fn tiles(&self) -> usize {
        self.t.div_ceil(TILE_POSITIONS)
    }

    /// Floats of one item's output (`[group, TILE_POSITIONS, d]`, the last tile using less).
    pub fn item_width(&self) -> usize {
        self.group() * TILE_POSITIONS * self.d
    }

    /// Item `item`'s kv head, first position and positions.
    pub fn item(&self, item: usize) -> (usize, usize, usize) {
        let tiles = self.tiles();
        let (kh, tile) = (item / tiles, item % tiles);
        let p0 = tile * TILE_POSITIONS;
        (kh, p0, (p0 + TILE_POSITIONS).min(self.t) - p0)
    }

    /// The item's query rows `[group * n][d]` from `q` (`[n_heads, t, d]`): row `g * n + r` is
    /// head `kh * group + g` at chunk position `p0 + r`.
    pub fn gather_queries(&self, q: &[f32], (kh, p0, n): (usize, usize, usize)) -> Vec<f32> {
        let (group, d, t) = (self.group(), self.d, self.t);
        let mut qt = vec![0f32; group * n * d];
        for g in 0..group {
            let head = kh * group + g;
            qt[g * n * d..(g + 1) * n * d].copy_from_slice(&q[(head * t + p0) * d..][..n * d]);
        }
        qt
    }

    /// The items' outputs (each `[group, n, d]` at the start of its `item_width`) scattered to
    /// `[n_heads, t, d]`.
    pub fn scatter(&self, items: &[f32]) -> Vec<f32> {
        let (group, d, t) = (self.group(), self.d, self.t);
        let width = self.item_width();
        let mut out = vec![0f32; self.n_heads * t * d];
        for (i, item) in items.chunks_exact(width).enumerate() {
            let (kh, p0, n) = self.item(i);
            for g in 0..group {
                let head = kh * group + g;
                let src = &item[g * n * d..(g + 1) * n * d];
                out[(head * t + p0) * d..][..n * d].copy_from_slice(src);
            }
        }
        out
    }
}
