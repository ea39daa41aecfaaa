//! The parameter structs the Metal kernels read from their `constant` buffer, laid out as the
//! MSL structs of the same name (`#[repr(C)]`, 4-byte fields: the same layout in MSL and in the
//! emulator's C++). `as_bytes` is what `set_bytes` (or the emulator) is given.

use crate::AttendParams;
use crate::metal::dispatch::AttendPlan;
use crate::spec::{ScalarSpec, VqSpec};

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

/// kernels/metal/turboquant_prod/encode.metal `ProdEncodeParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProdEncodeParams {
    pub rows: u32,
    pub t: u32,
    pub d: u32,
    /// The scalar stage's bits.
    pub bits: u32,
    pub cb: u32,
    pub sigma: f32,
    pub m: u32,
}

/// kernels/metal/qjl/encode.metal `GroupEncodeParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupEncodeParams {
    pub rows: u32,
    pub d: u32,
    pub bits: u32,
    pub group: u32,
    pub cb: u32,
}

/// kernels/metal/vecinfer/encode.metal `VqEncodeParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VqEncodeParams {
    pub rows: u32,
    pub t: u32,
    pub d: u32,
    pub sub: u32,
    pub books: u32,
    /// 1: keys (divided by lambda before the rotation).
    pub smooth: u32,
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
/// ([`crate::AttendParams`], positions as u32) and both codecs' widths; for the scalar layout
/// ([`Self::new`]), TurboQuant-Prod's ([`Self::prod`]) and VecInfer's ([`Self::vq`]).
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
    /// TurboQuant-Prod: the residual sketch's dimension.
    pub m: u32,
    /// VecInfer: sub-vector lengths and codebook counts of keys and values.
    pub ksub: u32,
    pub vsub: u32,
    pub kbooks: u32,
    pub vbooks: u32,
    /// 1: the last split threadgroup merges the splits into the merged rows (one dispatch; the
    /// library must be MSL 3.2, `backend::merges`); 0: `kvq_combine` does, or one split.
    pub merge: u32,
}

impl ScalarAttendParams {
    /// The fields every layout shares: `plan`'s dispatch over `n_rows` code rows per kv head,
    /// range `p`, head dim `d`; the codecs' fields zero. `None` when a position or count does
    /// not fit the kernel's 32-bit fields (`exact_before` saturates: every position below it is
    /// below `u32::MAX` too).
    fn shape(plan: &AttendPlan, p: &AttendParams, n_rows: usize, d: usize) -> Option<Self> {
        let u = |x: usize| u32::try_from(x).ok();
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
            kbits: 0,
            vbits: 0,
            kcb: 0,
            vcb: 0,
            scale: p.scale,
            ksigma: 0.0,
            vsigma: 0.0,
            m: 0,
            ksub: 0,
            vsub: 0,
            kbooks: 0,
            vbooks: 0,
            merge: 0,
        })
    }

    /// The scalar layout's (`kvq_attend_scalar`): key and value specs `k` / `v`. `None` as
    /// [`Self::shape`] says, or when a spec has other than 1..=6 bits.
    pub fn new(
        plan: &AttendPlan,
        p: &AttendParams,
        n_rows: usize,
        d: usize,
        k: &ScalarSpec,
        v: &ScalarSpec,
    ) -> Option<Self> {
        let bits_ok = |s: &ScalarSpec| (1..=6).contains(&s.bits) && s.levels.len() == 1 << s.bits;
        if !bits_ok(k) || !bits_ok(v) {
            return None;
        }
        Some(Self {
            kbits: k.bits,
            vbits: v.bits,
            kcb: u32::try_from(k.code_bytes(d)).ok()?,
            vcb: u32::try_from(v.code_bytes(d)).ok()?,
            ksigma: k.sigma,
            vsigma: v.sigma,
            ..Self::shape(plan, p, n_rows, d)?
        })
    }

    /// TurboQuant-Prod's (`kvq_attend_prod`): the scalar stage `k`, then a residual sketch of
    /// dimension `m` (a multiple of 8, at most the head dim); values `v`.
    #[allow(clippy::too_many_arguments)]
    pub fn prod(
        plan: &AttendPlan,
        p: &AttendParams,
        n_rows: usize,
        d: usize,
        k: &ScalarSpec,
        m: usize,
        v: &ScalarSpec,
    ) -> Option<Self> {
        if m == 0 || !m.is_multiple_of(8) || m > d {
            return None;
        }
        let base = Self::new(plan, p, n_rows, d, k, v)?;
        Some(Self {
            kcb: u32::try_from(k.code_bytes(d) + 2 + m / 8).ok()?,
            m: m as u32,
            ..base
        })
    }

    /// VecInfer's (`kvq_attend_vq`): one byte per sub-vector of keys `k` and values `v`,
    /// sub-vectors of 4 or 8, codebooks `[books][256][sub]` shared (1) or one per sub-position.
    pub fn vq(
        plan: &AttendPlan,
        p: &AttendParams,
        n_rows: usize,
        d: usize,
        k: &VqSpec,
        v: &VqSpec,
    ) -> Option<Self> {
        let (kbooks, vbooks) = (vq_books(k, d)?, vq_books(v, d)?);
        if k.signs.len() != v.signs.len() || k.lambda.len() != k.signs.len() {
            return None;
        }
        Some(Self {
            kcb: u32::try_from(d / k.sub).ok()?,
            vcb: u32::try_from(d / v.sub).ok()?,
            ksigma: 1.0,
            vsigma: 1.0,
            ksub: k.sub as u32,
            vsub: v.sub as u32,
            kbooks,
            vbooks,
            ..Self::shape(plan, p, n_rows, d)?
        })
    }
}

/// The codebook count of a VecInfer spec at head dim `d` (1 shared, or `d / sub`), if the
/// Metal kernels take its layout: sub-vectors of 4 or 8, `[books][256][sub]` codebooks, signs
/// (and lambdas, keys) of whole heads.
pub fn vq_books(s: &VqSpec, d: usize) -> Option<u32> {
    if !matches!(s.sub, 4 | 8) || d == 0 || !d.is_multiple_of(s.sub) {
        return None;
    }
    let one = 256 * s.sub;
    let books = s.books.len() / one;
    let whole = |x: &[f32]| !x.is_empty() && x.len().is_multiple_of(d);
    let ok = (books == 1 || books == d / s.sub) && books * one == s.books.len() && whole(&s.signs);
    ok.then(|| u32::try_from(books).ok()).flatten()
}

/// The largest centroid norm of each codebook of a VecInfer key spec (`[books]`), the bound
/// `kvq_attend_vq_lut` scales its 16-bit table by (every entry `q_sp . c` lies within
/// `|q_sp|` times it). Rounded up by a relative 2^-20 so that the f32 bound the kernel computes
/// still covers an f32 dot product's rounding.
pub fn vq_book_norms(s: &VqSpec) -> Vec<f32> {
    let one = 256 * s.sub.max(1);
    s.books
        .chunks(one)
        .map(|book| {
            let max = book
                .chunks(s.sub.max(1))
                .map(|c| c.iter().map(|x| f64::from(*x) * f64::from(*x)).sum::<f64>())
                .fold(0.0, f64::max)
                .sqrt();
            (max * (1.0 + 1.0 / f64::from(1u32 << 20))) as f32
        })
        .collect()
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
    /// As [`ScalarAttendParams::merge`].
    pub merge: u32,
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
            merge: 0,
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
as_bytes!(ProdEncodeParams, rows, t, d, bits, cb, sigma, m);
as_bytes!(GroupEncodeParams, rows, d, bits, group, cb);
as_bytes!(VqEncodeParams, rows, t, d, sub, books, smooth);
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
    vsigma,
    m,
    ksub,
    vsub,
    kbooks,
    vbooks,
    merge
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
    scale,
    merge
);
as_bytes!(CombineParams, rows, n_splits, d, normalize);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metal::dispatch;

    fn vq_spec(sub: usize, books: usize, d: usize, keys: bool) -> VqSpec {
        VqSpec {
            sub,
            books: vec![0.5; books * 256 * sub],
            signs: vec![1.0; 2 * d],
            lambda: if keys { vec![1.0; 2 * d] } else { Vec::new() },
        }
    }

    #[test]
    fn vecinfer_layouts_the_kernels_take() {
        assert_eq!(vq_books(&vq_spec(4, 1, 64, true), 64), Some(1));
        assert_eq!(vq_books(&vq_spec(8, 8, 64, false), 64), Some(8));
        assert_eq!(vq_books(&vq_spec(4, 3, 64, true), 64), None);
        assert_eq!(vq_books(&vq_spec(2, 1, 64, true), 64), None);
        let plan = dispatch::attend_vq(8, 2, 1, 64, 300).unwrap();
        let p = AttendParams {
            scale: 0.125,
            first_pos: 300,
            window: 1,
            sinks: 0,
            sliding_window: None,
            code_first: 0,
            exact_before: 0,
        };
        let (k, v) = (vq_spec(4, 16, 64, true), vq_spec(8, 1, 64, false));
        let prm = ScalarAttendParams::vq(&plan, &p, 300, 64, &k, &v).unwrap();
        assert_eq!((prm.kcb, prm.vcb, prm.kbooks, prm.vbooks), (16, 8, 16, 1));
        assert_eq!((prm.ksub, prm.vsub, prm.m), (4, 8, 0));
        // Keys without their smoothing factors are not a layout the kernel reads.
        assert!(ScalarAttendParams::vq(&plan, &p, 300, 64, &v, &v).is_none());
        assert_eq!(
            prm.as_bytes().len(),
            std::mem::size_of::<ScalarAttendParams>()
        );
    }

    #[test]
    fn book_norms_bound_every_centroid() {
        // Two books of sub-vectors of 4: the largest norms are 2 (book 0) and 5 (book 1).
        let mut books = vec![0.0f32; 2 * 256 * 4];
        books[7 * 4..8 * 4].copy_from_slice(&[1.0, 1.0, 1.0, -1.0]);
        books[256 * 4 + 3 * 4..256 * 4 + 4 * 4].copy_from_slice(&[3.0, 0.0, -4.0, 0.0]);
        books[9] = 0.5;
        let s = VqSpec {
            sub: 4,
            books,
            signs: vec![1.0; 8],
            lambda: vec![1.0; 8],
        };
        let n = vq_book_norms(&s);
        assert_eq!(n.len(), 2);
        assert!(n[0] >= 2.0 && n[0] < 2.0 * (1.0 + 1e-5), "{}", n[0]);
        assert!(n[1] >= 5.0 && n[1] < 5.0 * (1.0 + 1e-5), "{}", n[1]);
    }

    #[test]
    fn prod_rows_hold_the_stage_then_the_sketch() {
        let s = ScalarSpec {
            bits: 2,
            levels: vec![-1.5, -0.5, 0.5, 1.5],
            thresholds: vec![-1.0, 0.0, 1.0],
            code_of: vec![0, 1, 2, 3],
            sigma: 0.125,
            signs: vec![1.0; 128],
        };
        let plan = dispatch::attend_prod(8, 2, 1, 64, 64, 300).unwrap();
        let p = AttendParams {
            scale: 0.125,
            first_pos: 300,
            window: 1,
            sinks: 0,
            sliding_window: None,
            code_first: 0,
            exact_before: 0,
        };
        let prm = ScalarAttendParams::prod(&plan, &p, 300, 64, &s, 64, &s).unwrap();
        assert_eq!((prm.kcb, prm.vcb, prm.m), (2 + 16 + 2 + 8, 2 + 16, 64));
        assert!(ScalarAttendParams::prod(&plan, &p, 300, 64, &s, 72, &s).is_none());
    }
}
