//! The parameter structs the Metal kernels read from their `constant` buffer, laid out as the
//! MSL structs of the same name (`#[repr(C)]`, 4-byte fields: the same layout in MSL and in the
//! emulator's C++). `as_bytes` is what `set_bytes` (or the emulator) is given.

use crate::AttendParams;
use crate::metal::dispatch::AttendPlan;
use crate::spec::ScalarSpec;

/// kernels/metal/common/bitpack.metal `PackParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackParams {
    pub n: u32,
    pub bits: u32,
}

/// kernels/metal/turboquant_mse/encode.metal `ScalarEncodeParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalarEncodeParams {
    pub rows: u32,
    pub t: u32,
    pub d: u32,
    pub bits: u32,
    pub cb: u32,
    pub sigma: f32,
}

/// kernels/metal/qjl/encode.metal `QjlKeyEncodeParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QjlKeyEncodeParams {
    pub rows: u32,
    pub t: u32,
    pub d: u32,
    pub m: u32,
    pub outliers: u32,
    pub cb: u32,
}

/// kernels/metal/vecinfer/encode.metal `NearestParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NearestParams {
    pub n: u32,
    pub centroids: u32,
    pub sub: u32,
}

/// kernels/metal/turboquant_mse/attend.metal `ScalarAttendParams`: the shape of one decode
/// attention dispatch, its splits ([`crate::metal::dispatch::AttendPlan`]), the compressed range
/// ([`crate::AttendParams`], positions as u32) and both codecs' widths.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalarAttendParams {
    pub nh: u32,
    pub kvh: u32,
    pub t: u32,
    pub group: u32,
    pub gb: u32,
    pub hchunks: u32,
    pub d: u32,
    pub n_rows: u32,
    pub split_rows: u32,
    pub n_splits: u32,
    pub first_pos: u32,
    pub window: u32,
    pub sinks: u32,
    /// 0: no sliding window.
    pub sliding: u32,
    pub code_first: u32,
    pub exact_before: u32,
    pub kbits: u32,
    pub vbits: u32,
    pub kcb: u32,
    pub vcb: u32,
    pub scale: f32,
    pub ksigma: f32,
    pub vsigma: f32,
}

impl ScalarAttendParams {
    /// The parameters of `plan`'s dispatch over `n_rows` code rows per kv head, range `p`, key
    /// and value specs `k` / `v` at head dim `d`. `None` when a position or count does not fit
    /// the kernel's 32-bit fields (`exact_before` saturates: every position below it is below
    /// `u32::MAX` too) or a spec has other than 1..=6 bits.
    pub fn new(
        plan: &AttendPlan,
        p: &AttendParams,
        n_rows: usize,
        d: usize,
        k: &ScalarSpec,
        v: &ScalarSpec,
    ) -> Option<Self> {
        let u = |x: usize| u32::try_from(x).ok();
        let bits_ok = |s: &ScalarSpec| (1..=6).contains(&s.bits) && s.levels.len() == 1 << s.bits;
        if !bits_ok(k) || !bits_ok(v) {
            return None;
        }
        // The last position read must fit too (the kernel adds 1 to it).
        u(p.first_pos.checked_add(plan.t)?.checked_add(1)?)?;
        Some(Self {
            nh: u(plan.n_heads)?,
            kvh: u(plan.n_kv_heads)?,
            t: u(plan.t)?,
            group: u(plan.group)?,
            gb: u(plan.gb)?,
            hchunks: u(plan.hchunks)?,
            d: u(d)?,
            n_rows: u(n_rows)?,
            split_rows: u(plan.split_rows)?,
            n_splits: u(plan.n_splits)?,
            first_pos: u(p.first_pos)?,
            window: u(p.window)?,
            sinks: u(p.sinks)?,
            sliding: u(p.sliding_window.unwrap_or(0))?,
            code_first: u(p.code_first)?,
            exact_before: u32::try_from(p.exact_before).unwrap_or(u32::MAX),
            kbits: k.bits,
            vbits: v.bits,
            kcb: u(k.code_bytes(d))?,
            vcb: u(v.code_bytes(d))?,
            scale: p.scale,
            ksigma: k.sigma,
            vsigma: v.sigma,
        })
    }
}

/// kernels/metal/qjl/attend.metal `QjlAttendParams`: the dispatch's shape and splits, the
/// compressed range (positions as u32), the key sketch and the value groups.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QjlAttendParams {
    pub nh: u32,
    pub kvh: u32,
    pub t: u32,
    pub group: u32,
    pub gb: u32,
    pub hchunks: u32,
    pub d: u32,
    pub n_rows: u32,
    pub split_rows: u32,
    pub n_splits: u32,
    pub first_pos: u32,
    pub window: u32,
    pub sinks: u32,
    /// 0: no sliding window.
    pub sliding: u32,
    pub code_first: u32,
    pub exact_before: u32,
    pub m: u32,
    pub outliers: u32,
    pub kcb: u32,
    pub vbits: u32,
    pub vgroup: u32,
    pub vcb: u32,
    pub scale: f32,
}

impl QjlAttendParams {
    /// The parameters of `plan`'s dispatch over `n_rows` code rows per kv head, range `p`, at
    /// head dim `d`: keys sketched to `m` signs with `outliers` exact channels, values in groups
    /// of `vgroup` coordinates at `vbits` bits. `None` when a field does not fit 32 bits, or the
    /// codes are of a layout the kernel does not read (outlier indices are u8, value bits 2, 4
    /// or 8 with `vgroup` dividing `d`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        plan: &AttendPlan,
        p: &AttendParams,
        n_rows: usize,
        d: usize,
        m: usize,
        outliers: usize,
        vbits: u32,
        vgroup: usize,
    ) -> Option<Self> {
        let u = |x: usize| u32::try_from(x).ok();
        if !matches!(vbits, 2 | 4 | 8) || vgroup == 0 || !d.is_multiple_of(vgroup) || d > 256 {
            return None;
        }
        if outliers > d / 2 || !m.is_multiple_of(8) {
            return None;
        }
        u(p.first_pos.checked_add(plan.t)?.checked_add(1)?)?;
        Some(Self {
            nh: u(plan.n_heads)?,
            kvh: u(plan.n_kv_heads)?,
            t: u(plan.t)?,
            group: u(plan.group)?,
            gb: u(plan.gb)?,
            hchunks: u(plan.hchunks)?,
            d: u(d)?,
            n_rows: u(n_rows)?,
            split_rows: u(plan.split_rows)?,
            n_splits: u(plan.n_splits)?,
            first_pos: u(p.first_pos)?,
            window: u(p.window)?,
            sinks: u(p.sinks)?,
            sliding: u(p.sliding_window.unwrap_or(0))?,
            code_first: u(p.code_first)?,
            exact_before: u32::try_from(p.exact_before).unwrap_or(u32::MAX),
            m: u(m)?,
            outliers: u(outliers)?,
            kcb: u(2 + m / 8 + 3 * outliers)?,
            vbits,
            vgroup: u(vgroup)?,
            vcb: u(4 * (d / vgroup) + d * vbits as usize / 8)?,
            scale: p.scale,
        })
    }
}

/// kernels/metal/common/combine.metal `CombineParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CombineParams {
    pub rows: u32,
    pub n_splits: u32,
    pub d: u32,
    /// 1: the first `d` slots of each output row hold the normalized attention output.
    pub normalize: u32,
}

/// The bytes of a parameter struct (plain 4-byte fields, no padding).
pub trait AsBytes: Copy {
    fn as_bytes(&self) -> Vec<u8>;
}

macro_rules! as_bytes {
    ($t:ty, $($f:ident),+) => {
        impl AsBytes for $t {
            fn as_bytes(&self) -> Vec<u8> {
                let mut v = Vec::with_capacity(std::mem::size_of::<$t>());
                $(v.extend_from_slice(&self.$f.to_le_bytes());)+
                debug_assert_eq!(v.len(), std::mem::size_of::<$t>());
                v
            }
        }
    };
}

as_bytes!(PackParams, n, bits);
as_bytes!(ScalarEncodeParams, rows, t, d, bits, cb, sigma);
as_bytes!(QjlKeyEncodeParams, rows, t, d, m, outliers, cb);
as_bytes!(NearestParams, n, centroids, sub);
as_bytes!(
    ScalarAttendParams,
    nh,
    kvh,
    t,
    group,
    gb,
    hchunks,
    d,
    n_rows,
    split_rows,
    n_splits,
    first_pos,
    window,
    sinks,
    sliding,
    code_first,
    exact_before,
    kbits,
    vbits,
    kcb,
    vcb,
    scale,
    ksigma,
    vsigma
);
as_bytes!(
    QjlAttendParams,
    nh,
    kvh,
    t,
    group,
    gb,
    hchunks,
    d,
    n_rows,
    split_rows,
    n_splits,
    first_pos,
    window,
    sinks,
    sliding,
    code_first,
    exact_before,
    m,
    outliers,
    kcb,
    vbits,
    vgroup,
    vcb,
    scale
);
as_bytes!(CombineParams, rows, n_splits, d, normalize);
