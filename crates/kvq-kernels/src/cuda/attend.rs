//! Launching the fused decode attention on CUDA: picks the family's kernel, the heads per block
//! (GQA: one pass over a kv head's codes serves up to 8 query heads), the split of the rows over
//! the sequence (flash-decoding: enough blocks to fill every multiprocessor), the shared memory,
//! then merges the splits with the combine kernel; the exact fp16 rows (sinks, window), when
//! given, are one more split: one more block of the same launch for the tensor-core kernels
//! (TurboQuant MSE/RVQ/Prod), a launch of the fp16 kernel for the others. Two to four launches
//! per layer and decode step (sketch projection, codes, fp16 rows, combine), whatever the context
//! length.

use super::{
    AttendArgs, CombineArgs, DenseParams, KeyArgs, ProjectArgs, ValueArgs, check_launch, drv,
    function, sm_count,
};
use crate::attend::AttendParams;
use candle_core::cuda_backend::CudaDevice;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::{Result, bail};

/// Threads per attend block and most rows per tile (kernels/cuda/common/attend.cuh).
const THREADS: usize = 128;
const TILE: usize = 64;
/// Copy stages per warp of the tensor-core kernels (`KVQ_MMA_STAGES`).
const MMA_STAGES: usize = 3;
/// Shared memory per block under which four blocks share a multiprocessor (latency hiding).
const SMEM_TARGET: usize = 56 * 1024;

/// Queries: row (b, h, t) at `addr + (b*b_stride + h*h_stride + t*t_stride) * 4`.
#[derive(Debug, Clone, Copy)]
pub struct QueryView {
    pub addr: u64,
    pub b_stride: i64,
    pub h_stride: i64,
    pub t_stride: i64,
}

/// Code rows: row (b, kv head, r) at `addr + b*b_stride + kh*h_stride + r*row_bytes` (bytes).
#[derive(Debug, Clone, Copy)]
pub struct CodeView {
    pub addr: u64,
    pub b_stride: i64,
    pub h_stride: i64,
    pub row_bytes: usize,
    /// Rows present per head.
    pub rows: usize,
}

/// Exact fp16 rows every query row also attends (the sinks and the recent window):
/// `[B][kvh][n][d]` f16 keys and values.
#[derive(Debug, Clone, Copy)]
pub struct ExtraRows {
    pub keys: u64,
    pub values: u64,
    pub n: usize,
    /// `[B][nh]` f32 added to the codes' logits before they meet these rows (a centered
    /// cache's `scale * q . mu`), or 0.
    pub shift: u64,
}

/// One launch: the codecs' kernel parameters and the geometry.
#[derive(Debug, Clone, Copy)]
pub struct AttendLaunch {
    pub keys: KeyArgs,
    pub values: ValueArgs,
    pub d: usize,
    pub batch: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Query rows per sequence.
    pub t: usize,
    pub p: AttendParams,
}

/// Shared-memory floats of each family's per-block state (the kernels' `state_floats`).
fn state_floats(k: &KeyArgs, v: &ValueArgs, d: usize, gb: usize) -> usize {
    let sketch = |m: usize| (m / 4) * gb * 16 + gb * m;
    let kf = match k {
        KeyArgs::Scalar(_) => 2 * d * gb + 64,
        KeyArgs::Prod(p) => 2 * d * gb + 64 + sketch(p.sketch.m as usize),
        KeyArgs::Sketch(p) => sketch(p.sketch.m as usize) + d * gb,
        KeyArgs::Vq(p) => (d / p.sub as usize) * gb * 256 + gb * d,
        KeyArgs::Dense(_) => d * gb,
    };
    let vf = match v {
        ValueArgs::Scalar(_) => 64,
        ValueArgs::Group(_) | ValueArgs::Dense(_) => 0,
        ValueArgs::Vq(p) => match p.books_in_smem {
            0 => 0,
            _ => p.nb as usize * 256 * p.sub as usize,
        },
    };
    kf + vf
}

/// Bytes of shared memory per row of an fp16 tile, read 16 bytes at a time: an odd multiple of
/// 16, so the 8 lanes of a quarter warp never share a bank. (Code rows keep their own width: they
/// are copied as they lie in memory.)
fn smem_stride(row_bytes: usize) -> usize {
    let s = row_bytes.div_ceil(16) * 16;
    if (s / 16).is_multiple_of(2) {
        s + 16
    } else {
        s
    }
}

fn attend_smem(l: &AttendLaunch, gb: usize, tile: usize, kstride: usize, vstride: usize) -> usize {
    let d = l.d;
    let nl = THREADS / (d / 8);
    let mut floats = state_floats(&l.keys, &l.values, d, gb) + gb * TILE + 3 * gb;
    floats = floats.div_ceil(4) * 4;
    // Two buffers of each (double buffering), 32 bytes of slack each for unaligned row starts;
    // after the last tile the same space holds the lane reduction and the result.
    let tiles = 2 * (tile * (kstride + vstride) + 64);
    let after = (if nl > 1 { nl * gb * d } else { 0 } + gb * d) * 4;
    floats * 4 + tiles.max(after)
}

/// The module, kernel stem and whether rows are fp16 (16-byte reads) for a family pair.
fn family(k: &KeyArgs, v: &ValueArgs) -> Result<(&'static str, &'static str, bool)> {
    Ok(match (k, v) {
        (KeyArgs::Scalar(_), ValueArgs::Scalar(_)) => {
            ("turboquant_mse_attend", "kvq_attend_scalar", false)
        }
        (KeyArgs::Prod(_), ValueArgs::Scalar(_)) => {
            ("turboquant_prod_attend", "kvq_attend_prod", false)
        }
        (KeyArgs::Sketch(_), ValueArgs::Group(_)) => ("qjl_attend", "kvq_attend_qjl", false),
        (KeyArgs::Vq(_), ValueArgs::Vq(_)) => ("vecinfer_attend", "kvq_attend_vq", false),
        (KeyArgs::Dense(_), ValueArgs::Dense(_)) => ("dense_attend", "kvq_attend_dense", true),
        _ => bail!("cuda: no fused attention kernel for keys {k:?} with values {v:?}"),
    })
}

/// How one attend kernel is launched: which kernel, heads per block, rows per tile, shared
/// memory and the tile strides.
struct Plan {
    module: &'static str,
    name: String,
    gb: usize,
    tile: usize,
    smem: usize,
    hchunks: usize,
    kstride: usize,
    vstride: usize,
    aligned: bool,
    /// A tensor-core kernel: takes the exact rows' arguments too (`xa`, `extra`), and runs
    /// them as the last block of each row when `extra` is set.
    mma: bool,
}

/// Whether the tensor-core kernels may run (`KVQ_CUDA_MMA=0` selects the CUDA-core ones, for
/// comparisons).
fn mma_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVQ_CUDA_MMA").map_or(true, |v| v != "0"))
}

/// Shared-memory bytes of the tensor-core scalar kernel (turboquant_mse/mma.cuh
/// `scalar_mma_smem`): rotated queries, level tables, per-warp softmax state, the sketch's and
/// the query's fragments, then three stages of 16 key and value rows per warp (or, after the
/// loop, the warps' outputs).
fn scalar_mma_smem(d: usize, kcb: usize, vcb: usize) -> usize {
    let nw = THREADS / 32;
    let stage = |cb: usize| (16 * cb + 32).div_ceil(16) * 16;
    let head = 8 * d * 4 + 512 + 2 * nw * 8 * 4 + d / 16 * 32 * 16 + 32 * (d / 16 + 1) * 16;
    let merge = nw * 8 * (d + d / 16 + 1) * 4;
    head + (nw * MMA_STAGES * (stage(kcb) + stage(vcb))).max(merge)
}

/// The tensor-core kernel for scalar-codebook keys (TurboQuant-MSE, -RVQ; with the residual's
/// sign sketch, -Prod) and values, for the bit widths it is instantiated for: up to 8 query
/// heads per block, tiles of 16 rows per warp.
fn scalar_mma_plan(l: &AttendLaunch, k: &CodeView, v: &CodeView, aligned: bool) -> Option<Plan> {
    let (module, name) = match (&l.keys, &l.values) {
        (KeyArgs::Scalar(kp), ValueArgs::Scalar(vp))
            if kp.bits == vp.bits && (1..=6).contains(&kp.bits) =>
        {
            let name = format!("kvq_attend_scalar_mma_d{}_b{}", l.d, kp.bits);
            ("turboquant_mse_attend", name)
        }
        (KeyArgs::Prod(kp), ValueArgs::Scalar(vp))
            if (1..=4).contains(&kp.scalar.bits)
                && (vp.bits == kp.scalar.bits || vp.bits == kp.scalar.bits + 1)
                && kp.sketch.m as usize == l.d =>
        {
            let name = format!(
                "kvq_attend_prod_mma_d{}_k{}_v{}",
                l.d, kp.scalar.bits, vp.bits
            );
            ("turboquant_prod_attend", name)
        }
        _ => return None,
    };
    if !mma_enabled() {
        return None;
    }
    let group = l.n_heads / l.n_kv_heads;
    let gb = group.min(8);
    let smem = scalar_mma_smem(l.d, k.row_bytes, v.row_bytes);
    (smem <= super::MAX_SMEM).then(|| Plan {
        module,
        name,
        gb,
        tile: TILE,
        smem,
        hchunks: group.div_ceil(gb),
        kstride: k.row_bytes,
        vstride: v.row_bytes,
        aligned,
        mma: true,
    })
}

fn plan(l: &AttendLaunch, k: &CodeView, v: &CodeView) -> Result<Plan> {
    let (d, group) = (l.d, l.n_heads / l.n_kv_heads);
    let (module, stem, wide) = family(&l.keys, &l.values)?;
    // Code rows are copied as they lie, from the 16-byte boundary below each tile, whatever the
    // heads' alignment; fp16 rows are re-laid at a padded stride 16 bytes at a time and need
    // aligned heads.
    let aligned = !wide
        || [k, v]
            .iter()
            .all(|c| c.addr % 16 == 0 && c.h_stride % 16 == 0 && c.b_stride % 16 == 0);
    if let Some(p) = scalar_mma_plan(l, k, v, aligned) {
        return Ok(p);
    }
    if wide && !(aligned && k.row_bytes.is_multiple_of(16) && v.row_bytes.is_multiple_of(16)) {
        bail!("cuda: fp16 rows must be 16-byte aligned")
    }
    let stride = |c: &CodeView| match wide {
        true => smem_stride(c.row_bytes),
        false => c.row_bytes,
    };
    let (kstride, vstride) = (stride(k), stride(v));
    // Heads per block: the group (up to 8: one pass over the codes serves them all), and rows
    // per tile: the largest that keeps three blocks on a multiprocessor, else the first that
    // fits at all (more heads per block first).
    let gb0 = [1usize, 2, 4, 8]
        .into_iter()
        .find(|&g| g >= group.min(8))
        .unwrap_or(8);
    let options: Vec<(usize, usize)> = [8, 4, 2, 1]
        .into_iter()
        .filter(|&g| g <= gb0)
        .flat_map(|g| [64, 32, 16].map(|t| (g, t)))
        .collect();
    let fits = |&(g, t): &(usize, usize)| attend_smem(l, g, t, kstride, vstride);
    let Some(&(gb, tile)) = options
        .iter()
        .filter(|o| o.0 == gb0)
        .find(|o| fits(o) <= SMEM_TARGET)
        .or_else(|| options.iter().find(|o| fits(o) <= super::MAX_SMEM))
    else {
        bail!(
            "cuda: {} bytes of shared memory per block needed, {} available",
            fits(&(1, 16)),
            super::MAX_SMEM
        )
    };
    Ok(Plan {
        module,
        name: format!("{stem}_d{d}_g{gb}"),
        gb,
        tile,
        smem: attend_smem(l, gb, tile, kstride, vstride),
        hchunks: group.div_ceil(gb),
        kstride,
        vstride,
        aligned,
        mma: false,
    })
}

/// Where one launch's splits go: splits of `split_rows` rows, written to slots `split_base..`
/// of the `slots` per row of `part`.
#[derive(Debug, Clone, Copy)]
struct Splits {
    split_rows: usize,
    split_base: usize,
    slots: usize,
    part: u64,
}

/// The kernels' argument struct for one plan over the views `k`, `v`.
fn attend_args(
    l: &AttendLaunch,
    pl: &Plan,
    q: QueryView,
    k: &CodeView,
    v: &CodeView,
    sp: Splits,
) -> AttendArgs {
    let group = l.n_heads / l.n_kv_heads;
    AttendArgs {
        q: q.addr,
        q_bstride: q.b_stride,
        q_hstride: q.h_stride,
        q_tstride: q.t_stride,
        kc: k.addr,
        k_bstride: k.b_stride,
        k_hstride: k.h_stride,
        vc: v.addr,
        v_bstride: v.b_stride,
        v_hstride: v.h_stride,
        kcb: k.row_bytes as i32,
        vcb: v.row_bytes as i32,
        nh: l.n_heads as i32,
        kvh: l.n_kv_heads as i32,
        t: l.t as i32,
        group: group as i32,
        gb: pl.gb.min(group) as i32,
        hchunks: pl.hchunks as i32,
        scale: l.p.scale,
        first_pos: l.p.first_pos as i64,
        window: l.p.window as i64,
        sinks: l.p.sinks as i64,
        sliding: l.p.sliding_window.map_or(0, |w| w as i64),
        code_first: l.p.code_first as i64,
        exact_before: i64::try_from(l.p.exact_before).unwrap_or(i64::MAX),
        n_rows: k.rows.min(v.rows) as i64,
        split_rows: sp.split_rows as i32,
        n_splits: sp.slots as i32,
        kstride: pl.kstride as i32,
        vstride: pl.vstride as i32,
        aligned: i32::from(pl.aligned),
        tile: pl.tile as i32,
        split_base: sp.split_base as i32,
        part: sp.part,
    }
}

/// Launches one attend kernel over `n_splits` splits; a tensor-core plan given `extra` (the
/// exact rows' arguments) runs them as one more block per row.
fn run_plan(
    dev: &CudaDevice,
    l: &AttendLaunch,
    pl: &Plan,
    a: &AttendArgs,
    keys: &KeyArgs,
    n_splits: usize,
    extra: Option<&AttendArgs>,
) -> Result<()> {
    let stream = dev.cuda_stream();
    let f = super::function_smem(dev, pl.module, &pl.name, pl.smem)?;
    let cfg = LaunchConfig {
        grid_dim: (
            (n_splits + usize::from(extra.is_some())) as u32,
            (l.n_kv_heads * pl.hchunks) as u32,
            (l.batch * l.t) as u32,
        ),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: pl.smem as u32,
    };
    let name = &pl.name;
    let mut b = stream.launch_builder(&f);
    b.arg(a);
    match (keys, &l.values) {
        (KeyArgs::Scalar(kp), ValueArgs::Scalar(vp)) => b.arg(kp).arg(vp),
        (KeyArgs::Prod(kp), ValueArgs::Scalar(vp)) => b.arg(kp).arg(vp),
        (KeyArgs::Sketch(kp), ValueArgs::Group(vp)) => b.arg(kp).arg(vp),
        (KeyArgs::Vq(kp), ValueArgs::Vq(vp)) => b.arg(kp).arg(vp),
        (KeyArgs::Dense(kp), ValueArgs::Dense(vp)) => b.arg(kp).arg(vp),
        _ => bail!("cuda: no fused attention kernel for this key / value pair"),
    };
    let flag = i32::from(extra.is_some());
    if pl.mma {
        b.arg(extra.unwrap_or(a));
        b.arg(&flag);
    }
    // SAFETY: the arguments are the kernel's structs, by value, in its parameter order; their
    // addresses point into allocations that outlive the launch.
    drv(unsafe { b.launch(cfg) }, name)?;
    check_launch(&stream, name)
}

/// Every query row's sketch projection `sqrt(pi/2)/m S q`, once before the attention (sketch
/// keys only); fills the key parameters' `proj`.
pub(super) fn project(
    dev: &CudaDevice,
    l: &AttendLaunch,
    module: &'static str,
    q: QueryView,
    keys: &mut KeyArgs,
) -> Result<Option<CudaSlice<f32>>> {
    let sk = match keys {
        KeyArgs::Prod(p) => &mut p.sketch,
        KeyArgs::Sketch(p) => &mut p.sketch,
        _ => return Ok(None),
    };
    let (m, rows) = (sk.m as usize, l.batch * l.n_heads * l.t);
    let stream = dev.cuda_stream();
    // SAFETY: sketch_project writes every element before the attention reads it.
    let proj = unsafe { dev.alloc::<f32>(rows * m)? };
    sk.proj = super::address(&proj, &stream, 0);
    let pa = ProjectArgs {
        q: q.addr,
        q_bstride: q.b_stride,
        q_hstride: q.h_stride,
        q_tstride: q.t_stride,
        mats: sk.mats,
        m: m as i32,
        nh: l.n_heads as i32,
        t: l.t as i32,
        group: (l.n_heads / l.n_kv_heads) as i32,
        proj: sk.proj,
    };
    let name = format!("kvq_sketch_project_d{}", l.d);
    let f = function(dev, module, &name)?;
    // One block per (sequence, query row, kv head, up to 8 of its query heads) and 64 sketch
    // rows (common/sketch.cuh).
    let group = l.n_heads / l.n_kv_heads;
    let head_blocks = l.batch * l.t * l.n_kv_heads * group.div_ceil(8);
    let cfg = LaunchConfig {
        grid_dim: (head_blocks as u32, m.div_ceil(64) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(&pa);
    // SAFETY: by-value argument struct; q, the matrices and `proj` outlive the launch.
    drv(unsafe { b.launch(cfg) }, &name)?;
    check_launch(&stream, &name)?;
    Ok(Some(proj))
}

/// Runs the fused attention and the combine. Returns `[B][n_heads][t][d + 2]` f32: per row the
/// partial state over its compressed range and the extra rows (unnormalized output, max, sum),
/// or with `normalize` the attention output in the first `d` slots. Launches: the sketch
/// projection (sketch keys only), the attention over the codes split over the sequence, the
/// fp16 kernel over the extra rows (when given: decode, `t == 1`) as one more split, and the
/// combine.
pub fn launch(
    dev: &CudaDevice,
    l: &AttendLaunch,
    q: QueryView,
    k: CodeView,
    v: CodeView,
    extra: Option<ExtraRows>,
    normalize: bool,
) -> Result<CudaSlice<f32>> {
    let d = l.d;
    if ![64, 128, 256].contains(&d) {
        bail!("cuda: attention kernels for head_dim 64, 128 and 256, not {d}")
    }
    if l.n_kv_heads == 0 || !l.n_heads.is_multiple_of(l.n_kv_heads) {
        bail!(
            "cuda: {} query heads over {} kv heads",
            l.n_heads,
            l.n_kv_heads
        )
    }
    if extra.is_some() && l.t != 1 {
        bail!(
            "cuda: exact extra rows are for decode (one query row), got {}",
            l.t
        )
    }
    // Decode over scalar-codebook codes: the version-5 kernel, one launch with the merge.
    if let Some(fp) = super::fast::plan(l, &k, &v) {
        let mut extras = super::fast::Extras::default();
        if let Some(x) = extra {
            let (n, d) = (x.n as i64, d as i64);
            extras.segments[0] = super::fast::Segment {
                keys: x.keys,
                values: x.values,
                b_stride: l.n_kv_heads as i64 * n * d,
                h_stride: n * d,
                n: x.n,
            };
            extras.shift = x.shift;
        }
        if extras.aligned(d) {
            return super::fast::launch(dev, l, &fp, q, &k, &v, &extras, d + 2, normalize);
        }
    }
    let pl = plan(l, &k, &v)?;
    // Rows the longest query row reads; splits so that every multiprocessor gets blocks.
    let max_rows = (0..l.t)
        .map(|r| {
            let (r0, r1) = l.p.code_rows(l.p.first_pos + r);
            r1.min(k.rows).saturating_sub(r0)
        })
        .max()
        .unwrap_or(0);
    let stream = dev.cuda_stream();
    let sms = sm_count(stream.context());
    let base = (l.batch * l.t * l.n_kv_heads * pl.hchunks).max(1);
    let want = (4 * sms).div_ceil(base).max(1);
    let min_split = match l.keys {
        KeyArgs::Vq(_) => 1024, // each block builds its lookup tables first
        _ => 256,
    };
    // At most 1023 splits plus the exact rows' (the combine's KVQ_MAX_SPLITS).
    let split_rows = max_rows
        .div_ceil(want)
        .max(max_rows.div_ceil(1023))
        .div_ceil(pl.tile)
        .max(1)
        .saturating_mul(pl.tile)
        .max(min_split);
    let n_splits = max_rows.div_ceil(split_rows).max(1);
    let slots = n_splits + usize::from(extra.is_some());
    let rows_out = l.batch * l.n_heads * l.t;
    // SAFETY: every element is written by the kernels below (empty splits write their empty
    // state), before anything reads it.
    let part = unsafe { dev.alloc::<f32>(rows_out * slots * (d + 2))? };
    let out = unsafe { dev.alloc::<f32>(rows_out * (d + 2))? };
    super::poison(&part, &stream)?;
    super::poison(&out, &stream)?;
    let part_addr = super::address(&part, &stream, 0);
    let mut keys = l.keys;
    let _proj = project(dev, l, pl.module, q, &mut keys)?;
    let sp = Splits {
        split_rows,
        split_base: 0,
        slots,
        part: part_addr,
    };
    let a = attend_args(l, &pl, q, &k, &v, sp);
    match extra {
        None => run_plan(dev, l, &pl, &a, &keys, n_splits, None)?,
        Some(x) => {
            // The sinks and the recent window: the fp16 kernel over rows [0, n) of `extra`, as
            // one more split (in the same launch for a tensor-core plan).
            let dense = DenseParams { unused: 0 };
            let xl = AttendLaunch {
                keys: KeyArgs::Dense(dense),
                values: ValueArgs::Dense(dense),
                p: AttendParams {
                    first_pos: x.n,
                    window: 1,
                    sinks: 0,
                    sliding_window: None,
                    code_first: 0,
                    exact_before: 0,
                    ..l.p
                },
                ..*l
            };
            let row = 2 * d;
            let view = |addr| CodeView {
                addr,
                b_stride: (l.n_kv_heads * x.n * row) as i64,
                h_stride: (x.n * row) as i64,
                row_bytes: row,
                rows: x.n,
            };
            let (xk, xv) = (view(x.keys), view(x.values));
            let xp = plan(&xl, &xk, &xv)?;
            let rows = x.n.div_ceil(xp.tile).max(1) * xp.tile;
            let xs = Splits {
                split_rows: rows,
                split_base: n_splits,
                ..sp
            };
            // In the same launch: the tensor-core kernel reads the rows straight from global
            // memory, 16 bytes at a time, and splits heads as the code blocks do.
            let fused = pl.mma && x.keys % 16 == 0 && x.values % 16 == 0;
            if fused {
                let xa = attend_args(&xl, &pl, q, &xk, &xv, xs);
                run_plan(dev, l, &pl, &a, &keys, n_splits, Some(&xa))?;
            } else {
                run_plan(dev, l, &pl, &a, &keys, n_splits, None)?;
                let xa = attend_args(&xl, &xp, q, &xk, &xv, xs);
                run_plan(dev, &xl, &xp, &xa, &xl.keys, 1, None)?;
            }
        }
    }
    let c = CombineArgs {
        part: part_addr,
        n_splits: slots as i32,
        nh: l.n_heads as i32,
        t: l.t as i32,
        out: super::address(&out, &stream, 0),
        normalize: i32::from(normalize),
        shift: extra.map_or(0, |x| x.shift),
        shift_splits: n_splits as i32,
    };
    let cname = format!("kvq_combine_d{d}");
    let cf = function(dev, "common_combine", &cname)?;
    let ccfg = LaunchConfig {
        grid_dim: (rows_out as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&cf);
    b.arg(&c);
    // SAFETY: the argument is the kernel's struct, by value; every address in it points into
    // allocations that outlive the launch (`part` and `out`).
    drv(unsafe { b.launch(ccfg) }, &cname)?;
    check_launch(&stream, &cname)?;
    // `part` is freed on drop: the stream orders the free after the combine kernel.
    drop(part);
    Ok(out)
}
