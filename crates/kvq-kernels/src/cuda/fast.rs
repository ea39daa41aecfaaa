//! Launching the version-6 fused decode attention (kernels/cuda/common/fast.cuh and its
//! families: turboquant_mse/fast.cuh for TurboQuant-MSE, -RVQ (1 to 4 bits) and -Prod (stage of
//! 1 to 3 bits, values of the stage's width or one more, sketch of dimension d); qjl/fast.cu for
//! QJL (2- or 4-bit groupwise values, after the queries' sketch projection, one small launch);
//! vecinfer/fast.cu for VecInfer (both codebooks in shared memory, or the keys' alone where both
//! do not fit)).
//! One launch per layer and decode step does the code splits, the exact fp16 rows (up to two
//! segments, read in place: the sinks and the window) as one more block, and the split merge with
//! the key center's logit shift, in the last block of each (row, kv head) to finish. The splits
//! are sized so that all blocks run at once (one per multiprocessor: 64 KiB of lookup tables each
//! at 4 bits).

use super::attend::{AttendLaunch, CodeView, QueryView};
use super::{
    AttendArgs, FastArgs, KeyArgs, ValueArgs, address, check_launch, drv, function_smem, poison,
    sm_count,
};
use crate::fast_geometry::{MAX_SLOTS, MAX_SMEM, Tables, smem, splits_with_exact};
use candle_core::cuda_backend::CudaDevice;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::{Result, bail};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Rows of one warp chunk.
const CHUNK: usize = 16;

/// Whether the fast kernels may run: by default (their parity run passed on an H100,
/// docs/benchmarks/gpu-v5.md); `KVQ_CUDA_FAST=0` runs the version-4 kernels and the combine
/// instead.
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVQ_CUDA_FAST").map_or(true, |v| v != "0"))
}

/// Whether VecInfer's per-position books at d = 256 (too large for shared memory together) run
/// the `_vg` kernels, the values' centroids read from global memory (the default since their
/// parity run passed on an H100: docs/benchmarks/gpu-v8.md), or the version-4 kernels
/// (`KVQ_CUDA_FAST_VG=0`, 3-9x slower there).
fn values_in_global() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVQ_CUDA_FAST_VG").map_or(true, |v| v != "0"))
}

/// A launch knob the kernels were compiled with (`-D` of the same name; defaults as in fast.cuh).
fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

/// Warps per block at head dim `d` (fast.cuh `KVQ_FAST_NW`).
fn warps(d: usize) -> usize {
    match d > 128 {
        true => knob("KVQ_FAST_NW_LARGE", 8),
        false => knob("KVQ_FAST_NW_SMALL", 16),
    }
}

fn stages() -> usize {
    knob("KVQ_FAST_STAGES", 3)
}

/// The kernel for one launch, when a fast kernel exists for its codecs and shape.
pub(super) struct FastPlan {
    module: &'static str,
    name: String,
    nw: usize,
    smem: usize,
    gb: usize,
    hchunks: usize,
}

/// The fast kernel for decode (one query row per sequence) over scalar-codebook codes (MSE,
/// RVQ, Prod) or QJL's sketch keys and groupwise values.
pub(super) fn plan(l: &AttendLaunch, k: &CodeView, v: &CodeView) -> Option<FastPlan> {
    let d = l.d;
    if !enabled() || l.t != 1 || ![64, 128, 256].contains(&d) {
        return None;
    }
    let nw = warps(d);
    let fits = |t: Tables| smem(d, t, (nw, stages()), (k.row_bytes, v.row_bytes)) <= MAX_SMEM;
    let (module, name, tables) = match (&l.keys, &l.values) {
        (KeyArgs::Scalar(kp), ValueArgs::Scalar(vp))
            if kp.bits == vp.bits && (1..=4).contains(&kp.bits) =>
        {
            let b = kp.bits as usize;
            let name = format!("kvq_fast_scalar_d{d}_b{b}");
            (
                "turboquant_mse_fast",
                name,
                Tables::scalar(d, (b, b), false),
            )
        }
        (KeyArgs::Prod(kp), ValueArgs::Scalar(vp))
            if (1..=3).contains(&kp.scalar.bits)
                && (vp.bits == kp.scalar.bits || vp.bits == kp.scalar.bits + 1)
                && kp.sketch.m as usize == d =>
        {
            let (kb, vb) = (kp.scalar.bits as usize, vp.bits as usize);
            let name = format!("kvq_fast_prod_d{d}_k{kb}_v{vb}");
            (
                "turboquant_prod_fast",
                name,
                Tables::scalar(d, (kb, vb), true),
            )
        }
        // A lane's D/8 value coordinates must sit in one group.
        (KeyArgs::Sketch(kp), ValueArgs::Group(vp))
            if (vp.bits == 2 || vp.bits == 4)
                && vp.group > 0
                && (vp.group as usize).is_multiple_of(d / 8)
                && d.is_multiple_of(vp.group as usize)
                && kp.sketch.m > 0 =>
        {
            let vb = vp.bits as usize;
            let name = format!("kvq_fast_qjl_d{d}_v{vb}");
            let m_pad = (kp.sketch.m as usize).div_ceil(64) * 64;
            ("qjl_fast", name, Tables::qjl(vb, m_pad))
        }
        // Both codebooks (f16) in shared memory; where they do not both fit (per-position books
        // at d = 256, 256 KiB), the keys' alone and the values' read from global memory (`_vg`:
        // `values_in_global`).
        (KeyArgs::Vq(kp), ValueArgs::Vq(vp))
            if kp.sub == vp.sub
                && (kp.sub == 4 || kp.sub == 8)
                && kp.books16 != 0
                && vp.books16 != 0 =>
        {
            let sub = kp.sub as usize;
            let book = |nb: i32| nb.max(0) as usize * 256 * sub * 2;
            let both = Tables::books(book(kp.nb) + book(vp.nb));
            if fits(both) {
                ("vecinfer_fast", format!("kvq_fast_vq_d{d}_s{sub}"), both)
            } else if d == 256 && values_in_global() {
                let keys = Tables::books(book(kp.nb));
                ("vecinfer_fast", format!("kvq_fast_vq_d{d}_s{sub}_vg"), keys)
            } else {
                return None;
            }
        }
        _ => return None,
    };
    let smem = smem(d, tables, (nw, stages()), (k.row_bytes, v.row_bytes));
    let group = l.n_heads / l.n_kv_heads;
    let gb = group.min(8);
    (smem <= MAX_SMEM).then(|| FastPlan {
        module,
        name,
        nw,
        smem,
        gb,
        hchunks: group.div_ceil(gb),
    })
}

/// One segment of exact fp16 rows every query row also attends: row r of (b, kv head) at
/// `keys + 2 * (b * b_stride + kh * h_stride + r * d)` bytes (strides in elements).
#[derive(Debug, Clone, Copy, Default)]
pub struct Segment {
    pub keys: u64,
    pub values: u64,
    pub b_stride: i64,
    pub h_stride: i64,
    pub n: usize,
}

impl Segment {
    /// Whether the kernel's 16-byte loads of its rows are aligned.
    fn aligned(&self, d: usize) -> bool {
        self.n == 0
            || (self.keys.is_multiple_of(16)
                && self.values.is_multiple_of(16)
                && (self.b_stride * 2) % 16 == 0
                && (self.h_stride * 2) % 16 == 0
                && (d * 2).is_multiple_of(16))
    }
}

/// What a fast launch merges besides the codes: up to two segments of exact rows, and either a
/// key center `mu` (`[kvh][d]` f32: the shift `scale * q . mu` is computed in the kernel) or a
/// precomputed shift (`[B][nh][t]` f32), or neither (addresses 0).
#[derive(Debug, Clone, Copy, Default)]
pub struct Extras {
    pub segments: [Segment; 2],
    pub mu: u64,
    pub shift: u64,
}

impl Extras {
    pub fn rows(&self) -> usize {
        self.segments[0].n + self.segments[1].n
    }

    pub fn aligned(&self, d: usize) -> bool {
        self.segments.iter().all(|s| s.aligned(d))
    }
}

/// The arrival counters of `dev`'s context, at least `n`, zero between launches (the last block
/// of each launch resets its own).
fn counters(dev: &CudaDevice, n: usize) -> Result<u64> {
    static BUFS: OnceLock<Mutex<HashMap<usize, CudaSlice<u32>>>> = OnceLock::new();
    let stream = dev.cuda_stream();
    let id = std::sync::Arc::as_ptr(stream.context()) as usize;
    let mut bufs = BUFS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if bufs.get(&id).is_none_or(|b| b.len() < n) {
        let buf = dev.alloc_zeros::<u32>(n.max(4096).next_power_of_two())?;
        bufs.insert(id, buf);
    }
    match bufs.get(&id) {
        Some(b) => Ok(address(b, &stream, 0)),
        None => bail!("cuda: no arrival counters"),
    }
}

/// Runs a fast plan: returns `[B][n_heads][1][ostride]` f32, the merged attention of each query
/// row (normalized with `normalize`), then its max and sum when `ostride == d + 2`.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch(
    dev: &CudaDevice,
    l: &AttendLaunch,
    pl: &FastPlan,
    q: QueryView,
    k: &CodeView,
    v: &CodeView,
    extras: &Extras,
    ostride: usize,
    normalize: bool,
) -> Result<CudaSlice<f32>> {
    let d = l.d;
    if ostride != d && ostride != d + 2 {
        bail!(
            "cuda: fast attention writes rows of {d} or {} floats",
            d + 2
        )
    }
    if !extras.aligned(d) {
        bail!("cuda: exact fp16 rows must be 16-byte aligned")
    }
    let (r0, r1) = l.p.code_rows(l.p.first_pos);
    let rows = r1.min(k.rows).min(v.rows).saturating_sub(r0);
    let stream = dev.cuda_stream();
    let sms = sm_count(stream.context());
    let pairs = (l.batch * l.t * l.n_kv_heads * pl.hchunks).max(1);
    let exact = usize::from(extras.rows() > 0);
    let want = splits_with_exact(
        pairs,
        sms,
        rows.div_ceil(pl.nw * CHUNK).clamp(1, MAX_SLOTS - 1),
        rows,
        pl.nw * CHUNK,
        exact,
    );
    let split_rows = rows.div_ceil(want).div_ceil(CHUNK).max(1) * CHUNK;
    let n_splits = rows.div_ceil(split_rows).max(1);
    let slots = n_splits + exact;
    let rows_out = l.batch * l.n_heads * l.t;
    // SAFETY: every slot is written by its block (an empty split writes its empty state) and
    // every output row by the last block of its pair, before anything reads them.
    let part = unsafe { dev.alloc::<f32>(rows_out * slots * (d + 2))? };
    let out = unsafe { dev.alloc::<f32>(rows_out * ostride)? };
    poison(&part, &stream)?;
    poison(&out, &stream)?;
    let group = l.n_heads / l.n_kv_heads;
    let a = AttendArgs {
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
        split_rows: split_rows as i32,
        n_splits: slots as i32,
        kstride: 0,
        vstride: 0,
        aligned: 1,
        tile: CHUNK as i32,
        split_base: 0,
        part: address(&part, &stream, 0),
    };
    let [s0, s1] = extras.segments;
    let mut f = FastArgs {
        xk: [s0.keys, s1.keys],
        xv: [s0.values, s1.values],
        xb: [s0.b_stride, s1.b_stride],
        xh: [s0.h_stride, s1.h_stride],
        xn: [s0.n as i32, s1.n as i32],
        mu: extras.mu,
        out: address(&out, &stream, 0),
        counters: counters(dev, l.batch * l.t * l.n_kv_heads * pl.hchunks)?,
        ostride: ostride as i32,
        normalize: i32::from(normalize),
        exact: exact as i32,
        shift: extras.shift,
        trace: 0,
    };
    let func = function_smem(dev, pl.module, &pl.name, pl.smem)?;
    let cfg = LaunchConfig {
        grid_dim: (
            slots as u32,
            (l.n_kv_heads * pl.hchunks) as u32,
            (l.batch * l.t) as u32,
        ),
        block_dim: ((pl.nw * 32) as u32, 1, 1),
        shared_mem_bytes: pl.smem as u32,
    };
    let trace = super::trace::start(dev, &pl.name, cfg.grid_dim, rows)?;
    if let Some(t) = &trace {
        f.trace = t.addr(dev);
    }
    // QJL's keys need the queries' sketch projections first (one small launch).
    let mut keys = l.keys;
    let _proj = match keys {
        KeyArgs::Sketch(_) => super::attend::project(dev, l, "qjl_attend", q, &mut keys)?,
        _ => None,
    };
    let mut b = stream.launch_builder(&func);
    b.arg(&a);
    match (&keys, &l.values) {
        (KeyArgs::Scalar(kp), ValueArgs::Scalar(vp)) => b.arg(kp).arg(vp),
        (KeyArgs::Prod(kp), ValueArgs::Scalar(vp)) => b.arg(kp).arg(vp),
        (KeyArgs::Sketch(kp), ValueArgs::Group(vp)) => b.arg(kp).arg(vp),
        (KeyArgs::Vq(kp), ValueArgs::Vq(vp)) => b.arg(kp).arg(vp),
        _ => bail!("cuda: no fast attention kernel for this key / value pair"),
    };
    b.arg(&f);
    // SAFETY: the arguments are the kernel's structs, by value, in its parameter order; their
    // addresses point into allocations that outlive the launch (the caller's tensors, `part`,
    // `out` and the counters, freed in stream order).
    drv(unsafe { b.launch(cfg) }, &pl.name)?;
    check_launch(&stream, &pl.name)?;
    if let Some(t) = trace {
        super::trace::finish(dev, t)?;
    }
    drop(part);
    Ok(out)
}
