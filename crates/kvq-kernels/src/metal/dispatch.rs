//! One function per Metal kernel decides its dispatch. Every function here returns a
//! [`Dispatch`] in threadgroups: it feeds `dispatchThreadgroups` (candle's
//! `ComputeCommandEncoder::dispatch_thread_groups(threadgroups, threads_per_threadgroup)`), never
//! `dispatchThreads`, whose grid counts threads (MLX's `grid=`: the seed's "grid = total
//! threads" bug was a threadgroup count passed where threads were meant).

/// Threadgroups of threads, for `dispatchThreadgroups`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dispatch {
    /// Threadgroups in the grid (x, y, z).
    pub threadgroups: [u32; 3],
    /// Threads per threadgroup (x, y, z); their product is at most 1024.
    pub threads: [u32; 3],
}

impl Dispatch {
    /// `groups` threadgroups of `threads` threads along x.
    pub fn linear(groups: usize, threads: usize) -> Self {
        Self {
            threadgroups: [to_u32(groups), 1, 1],
            threads: [to_u32(threads), 1, 1],
        }
    }

    /// Threads in the whole grid.
    pub fn total_threads(&self) -> u64 {
        let n = |v: [u32; 3]| v.iter().map(|&x| u64::from(x)).product::<u64>();
        n(self.threadgroups) * n(self.threads)
    }
}

fn to_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Threads per threadgroup of the one-thread-per-item kernels.
pub const LINEAR_THREADS: usize = 256;

/// `kvq_pack_bits` / `kvq_unpack_bits` (kernels/metal/common/bitpack.metal): one thread per group
/// of 8 of the `n` codes, in threadgroups of [`LINEAR_THREADS`].
pub fn pack_bits(n: usize) -> Dispatch {
    let threads = n.div_ceil(8);
    let per = threads.clamp(1, LINEAR_THREADS);
    Dispatch::linear(threads.div_ceil(per).max(1), per)
}

/// `kvq_encode_scalar` (kernels/metal/turboquant_mse/encode.metal): one threadgroup of `d`
/// threads per code row (`d` in 64, 128, 256).
pub fn encode_scalar(rows: usize, d: usize) -> Dispatch {
    Dispatch::linear(rows, d)
}

/// `kvq_encode_qjl_keys` (kernels/metal/qjl/encode.metal): one threadgroup of `d` threads per
/// code row.
pub fn encode_qjl_keys(rows: usize, d: usize) -> Dispatch {
    Dispatch::linear(rows, d)
}

/// `kvq_encode_prod` (kernels/metal/turboquant_prod/encode.metal): one threadgroup of `d`
/// threads per code row.
pub fn encode_prod(rows: usize, d: usize) -> Dispatch {
    Dispatch::linear(rows, d)
}

/// `kvq_encode_group` (kernels/metal/qjl/encode.metal): one threadgroup of `d` threads per code
/// row.
pub fn encode_group(rows: usize, d: usize) -> Dispatch {
    Dispatch::linear(rows, d)
}

/// `kvq_encode_vq` (kernels/metal/vecinfer/encode.metal): one threadgroup of `d` threads per
/// code row.
pub fn encode_vq(rows: usize, d: usize) -> Dispatch {
    Dispatch::linear(rows, d)
}

/// `kvq_nearest` (kernels/metal/vecinfer/encode.metal): one thread per sub-vector of the `n`,
/// in threadgroups of [`LINEAR_THREADS`] (each copies the codebook once).
pub fn nearest(n: usize) -> Dispatch {
    let per = n.clamp(1, LINEAR_THREADS);
    Dispatch::linear(n.div_ceil(per).max(1), per)
}

/// Threads per threadgroup of the attention and combine kernels (`KVQ_ATTEND_THREADS`,
/// `KVQ_COMBINE_THREADS`): 4 simdgroups. Also the rows of one attention tile.
pub const ATTEND_THREADS: usize = 128;
/// Most query heads one attention threadgroup serves (`KVQ_ATTEND_GB`): its threadgroup memory
/// (query, token lanes' accumulators) stays under 32 KiB at head dim 256.
pub const ATTEND_HEADS: usize = 4;
/// Most splits the combine takes (`KVQ_COMBINE_MAX_SPLITS`).
pub const MAX_SPLITS: usize = 1024;
/// Fewest code rows per split: below it a split's fixed cost (rotating the query, rotating the
/// output back) outweighs its rows.
pub const MIN_SPLIT_ROWS: usize = 256;
/// Threadgroups a decode attention dispatch aims for before it stops splitting: a few per GPU
/// core on the largest Apple GPUs (76 to 80 cores).
pub const TARGET_THREADGROUPS: usize = 256;

/// The geometry of one fused decode attention over all heads and query rows of a layer: which
/// query heads share a threadgroup, how the code rows are split, and the two dispatches
/// (attention, then the split merge where the attention's own last threadgroups do not merge:
/// without MSL 3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttendPlan {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Query rows.
    pub t: usize,
    /// Query heads per kv head.
    pub group: usize,
    /// Query heads per threadgroup (at most [`ATTEND_HEADS`]).
    pub gb: usize,
    /// Threadgroups per kv head and split: `ceil(group / gb)`.
    pub hchunks: usize,
    /// Code rows per split, a multiple of [`ATTEND_THREADS`].
    pub split_rows: usize,
    pub n_splits: usize,
    /// `kvq_attend_scalar`: one threadgroup per (query row, kv head, head chunk, split), 1-D.
    pub attend: Dispatch,
    /// `kvq_combine`: one threadgroup per (query head, query row); dispatched only when the
    /// rows are split and the attention library is not MSL 3.2 (`backend::merges`).
    pub combine: Dispatch,
}

/// `kvq_attend_scalar` (kernels/metal/turboquant_mse/attend.metal) and `kvq_combine`
/// (kernels/metal/common/combine.metal): both `Dispatch`es feed `dispatchThreadgroups`
/// (candle's `dispatch_thread_groups`), the attention first, the combine on its partial rows
/// `[n_heads][t][n_splits][d + 2]`. `max_rows`: the most code rows one query row reads. The
/// rows are split only as far as needed to give the GPU about [`TARGET_THREADGROUPS`]
/// threadgroups, never below [`MIN_SPLIT_ROWS`] rows a split nor past [`MAX_SPLITS`] splits.
pub fn attend_scalar(
    n_heads: usize,
    n_kv_heads: usize,
    t: usize,
    d: usize,
    max_rows: usize,
) -> Result<AttendPlan, String> {
    attend_plan(n_heads, n_kv_heads, t, d, max_rows)
}

/// Most sketch dimensions `kvq_attend_qjl` takes (`KVQ_QJL_MAX_M`).
pub const QJL_MAX_M: usize = 1088;

/// `kvq_attend_qjl` (kernels/metal/qjl/attend.metal) and `kvq_combine`: both `Dispatch`es feed
/// `dispatchThreadgroups` (candle's `dispatch_thread_groups`), the attention first; the same
/// geometry as [`attend_scalar`], for sketch dimension `m` (a multiple of 8, at most
/// [`QJL_MAX_M`]).
pub fn attend_qjl(
    n_heads: usize,
    n_kv_heads: usize,
    t: usize,
    d: usize,
    m: usize,
    max_rows: usize,
) -> Result<AttendPlan, String> {
    if m == 0 || !m.is_multiple_of(8) || m > QJL_MAX_M {
        return Err(format!(
            "metal attend: sketch dimension {m} (a multiple of 8 up to {QJL_MAX_M})"
        ));
    }
    attend_plan(n_heads, n_kv_heads, t, d, max_rows)
}

/// `kvq_attend_prod` (kernels/metal/turboquant_prod/attend.metal) and `kvq_combine`: both
/// `Dispatch`es feed `dispatchThreadgroups` (candle's `dispatch_thread_groups`), the attention
/// first; the geometry of [`attend_scalar`], for a residual sketch of dimension `m` (a multiple
/// of 8, at most `d`: its projection shares the query's threadgroup array size).
pub fn attend_prod(
    n_heads: usize,
    n_kv_heads: usize,
    t: usize,
    d: usize,
    m: usize,
    max_rows: usize,
) -> Result<AttendPlan, String> {
    if m == 0 || !m.is_multiple_of(8) || m > d {
        return Err(format!(
            "metal attend: residual sketch dimension {m} (a multiple of 8 up to {d})"
        ));
    }
    attend_plan(n_heads, n_kv_heads, t, d, max_rows)
}

/// `kvq_attend_vq` (kernels/metal/vecinfer/attend.metal) and `kvq_combine`: both `Dispatch`es
/// feed `dispatchThreadgroups` (candle's `dispatch_thread_groups`), the attention first; the
/// geometry of [`attend_scalar`]. The kernel for the shapes [`attend_vq_table`] declines.
pub fn attend_vq(
    n_heads: usize,
    n_kv_heads: usize,
    t: usize,
    d: usize,
    max_rows: usize,
) -> Result<AttendPlan, String> {
    attend_plan(n_heads, n_kv_heads, t, d, max_rows)
}

/// Most query heads one `kvq_attend_vq_lut` threadgroup serves (`KVQ_LUT_GB`).
pub const VQ_LUT_HEADS: usize = 2;
/// Entries of that threadgroup's key table, 16 bits each (`KVQ_LUT_ENTRIES`: 16 KiB).
pub const VQ_LUT_ENTRIES: usize = 8192;
/// Fewest code rows for which the table kernel is picked, and the fewest a split of it takes:
/// building the table costs 256 x d multiply-adds per query head, what gathering centroids
/// costs for 256 rows, and a row then takes d / sub table loads instead of d multiply-adds.
pub const VQ_LUT_MIN_ROWS: usize = 512;

/// `kvq_attend_vq_lut` (kernels/metal/vecinfer/attend.metal) and `kvq_combine`, for key
/// sub-vectors of `ksub`: both `Dispatch`es feed `dispatchThreadgroups` (candle's
/// `dispatch_thread_groups`), the attention first. `Ok(None)` where [`attend_vq`]'s gather is
/// the kernel: the table of one query head (`d / ksub x 256` entries) does not fit
/// [`VQ_LUT_ENTRIES`] (head dim 256 at sub-vectors of 4), or the rows are fewer than
/// [`VQ_LUT_MIN_ROWS`]. Otherwise the geometry of [`attend_scalar`] with as many query heads a
/// threadgroup as their tables fit (at most [`VQ_LUT_HEADS`]) and splits of at least
/// [`VQ_LUT_MIN_ROWS`] rows.
pub fn attend_vq_table(
    n_heads: usize,
    n_kv_heads: usize,
    t: usize,
    d: usize,
    ksub: usize,
    max_rows: usize,
) -> Result<Option<AttendPlan>, String> {
    if ksub == 0 || !d.is_multiple_of(ksub) {
        return Err(format!(
            "metal attend: sub-vectors of {ksub} at head dim {d}"
        ));
    }
    let heads = (VQ_LUT_ENTRIES / (d / ksub * 256)).min(VQ_LUT_HEADS);
    if heads == 0 || max_rows < VQ_LUT_MIN_ROWS {
        return Ok(None);
    }
    plan_within(n_heads, n_kv_heads, t, d, max_rows, heads, VQ_LUT_MIN_ROWS).map(Some)
}

fn attend_plan(
    n_heads: usize,
    n_kv_heads: usize,
    t: usize,
    d: usize,
    max_rows: usize,
) -> Result<AttendPlan, String> {
    plan_within(
        n_heads,
        n_kv_heads,
        t,
        d,
        max_rows,
        ATTEND_HEADS,
        MIN_SPLIT_ROWS,
    )
}

/// The attention geometry with at most `heads` query heads a threadgroup and splits of at least
/// `min_split` rows.
fn plan_within(
    n_heads: usize,
    n_kv_heads: usize,
    t: usize,
    d: usize,
    max_rows: usize,
    heads: usize,
    min_split: usize,
) -> Result<AttendPlan, String> {
    if ![64, 128, 256].contains(&d) {
        return Err(format!("metal attend: head dim {d} (64, 128 or 256)"));
    }
    if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
        return Err(format!(
            "metal attend: {n_heads} query heads over {n_kv_heads} kv heads"
        ));
    }
    if t == 0 {
        return Err("metal attend: no query rows".into());
    }
    let group = n_heads / n_kv_heads;
    let gb = group.min(heads);
    let hchunks = group.div_ceil(gb);
    let base = t * n_kv_heads * hchunks;
    let want = TARGET_THREADGROUPS.div_ceil(base).max(1);
    let split_rows = max_rows
        .div_ceil(want)
        .max(max_rows.div_ceil(MAX_SPLITS))
        .div_ceil(ATTEND_THREADS)
        .max(1)
        .saturating_mul(ATTEND_THREADS)
        .max(min_split);
    let n_splits = max_rows.div_ceil(split_rows).max(1);
    Ok(AttendPlan {
        n_heads,
        n_kv_heads,
        t,
        group,
        gb,
        hchunks,
        split_rows,
        n_splits,
        attend: Dispatch::linear(base * n_splits, ATTEND_THREADS),
        combine: Dispatch::linear(n_heads * t, ATTEND_THREADS),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_gets_a_thread() {
        for n in [1, 7, 8, 9, 2047, 2048, 2049, 100_000] {
            let g = pack_bits(n);
            assert!(g.total_threads() >= n.div_ceil(8) as u64, "{n}");
            assert!(g.total_threads() < n.div_ceil(8) as u64 + LINEAR_THREADS as u64);
        }
        let e = encode_scalar(33, 128);
        assert_eq!((e.threadgroups, e.threads), ([33, 1, 1], [128, 1, 1]));
    }

    #[test]
    fn attend_splits_cover_every_row() {
        for (nh, kvh, t, n) in [
            (8, 2, 1, 1),
            (8, 8, 1, 300),
            (32, 8, 1, 100_000),
            (4, 1, 7, 5000),
        ] {
            let pl = attend_scalar(nh, kvh, t, 128, n).unwrap();
            assert!(pl.split_rows * pl.n_splits >= n, "{nh} {kvh} {n}");
            assert!(pl.split_rows * (pl.n_splits - 1) < n.max(1));
            assert!(pl.n_splits <= MAX_SPLITS && pl.split_rows.is_multiple_of(ATTEND_THREADS));
            assert!(pl.gb * pl.hchunks >= pl.group && pl.gb <= ATTEND_HEADS);
            let groups = t * kvh * pl.hchunks * pl.n_splits;
            assert_eq!(pl.attend.threadgroups, [groups as u32, 1, 1]);
            assert_eq!(pl.combine.threadgroups, [(nh * t) as u32, 1, 1]);
        }
        assert!(attend_scalar(6, 4, 1, 128, 10).is_err());
        assert!(attend_scalar(8, 2, 1, 96, 10).is_err());
    }

    #[test]
    fn every_attention_has_the_scalar_geometry_within_its_limits() {
        let base = attend_scalar(32, 8, 1, 128, 5000).unwrap();
        assert_eq!(attend_prod(32, 8, 1, 128, 128, 5000).unwrap(), base);
        assert_eq!(attend_qjl(32, 8, 1, 128, 520, 5000).unwrap(), base);
        assert_eq!(attend_vq(32, 8, 1, 128, 5000).unwrap(), base);
        // Prod's sketch shares the query's array (at most d); QJL's has its own.
        assert!(attend_prod(8, 2, 1, 64, 72, 10).is_err());
        assert!(attend_prod(8, 2, 1, 64, 60, 10).is_err());
        assert!(attend_qjl(8, 2, 1, 256, QJL_MAX_M + 8, 10).is_err());
        assert!(attend_vq(8, 2, 1, 512, 10).is_err());
        let e = encode_vq(10, 256);
        assert_eq!((e.threadgroups, e.threads), ([10, 1, 1], [256, 1, 1]));
    }

    #[test]
    fn the_vq_table_is_picked_where_it_fits_and_pays() {
        // (d, sub): query heads whose tables fit 8192 entries; none at d 256, sub 4.
        for (d, sub, heads) in [
            (64, 4, 2),
            (64, 8, 2),
            (128, 4, 1),
            (128, 8, 2),
            (256, 8, 1),
        ] {
            let pl = attend_vq_table(32, 8, 1, d, sub, 5000).unwrap().unwrap();
            assert_eq!(pl.gb, heads, "d {d} sub {sub}");
            assert!(pl.gb * (d / sub) * 256 <= VQ_LUT_ENTRIES);
            assert!(pl.split_rows >= VQ_LUT_MIN_ROWS && pl.split_rows * pl.n_splits >= 5000);
            assert_eq!(pl.hchunks, 4_usize.div_ceil(heads));
        }
        assert_eq!(attend_vq_table(32, 8, 1, 256, 4, 5000), Ok(None));
        assert_eq!(
            attend_vq_table(32, 8, 1, 128, 4, VQ_LUT_MIN_ROWS - 1),
            Ok(None)
        );
        assert!(
            attend_vq_table(32, 8, 1, 128, 4, VQ_LUT_MIN_ROWS)
                .unwrap()
                .is_some()
        );
        assert!(attend_vq_table(32, 8, 1, 128, 0, 5000).is_err());
        assert!(attend_vq_table(6, 4, 1, 128, 4, 5000).is_err());
    }
}
