//! `#[repr(C)]` mirrors of the kernels' argument structs (kernels/cuda/common/attend.cuh and each
//! family's policies; field for field, same C types), and the device copies of a codec's spec
//! that fill them: uploaded once per codec and device, kept in the codec's `DeviceCache`.

use super::{address, device_key, upload};
use crate::codec::KernelData;
use crate::spec::{KeySpec, ScalarSpec, SketchSpec, ValueSpec, VqSpec};
use candle_core::cuda_backend::CudaDevice;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr};
use candle_core::{Result, bail};
use std::sync::Arc;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AttendArgs {
    pub q: u64,
    pub q_bstride: i64,
    pub q_hstride: i64,
    pub q_tstride: i64,
    pub kc: u64,
    pub k_bstride: i64,
    pub k_hstride: i64,
    pub vc: u64,
    pub v_bstride: i64,
    pub v_hstride: i64,
    pub kcb: i32,
    pub vcb: i32,
    pub nh: i32,
    pub kvh: i32,
    pub t: i32,
    pub group: i32,
    pub gb: i32,
    pub hchunks: i32,
    pub scale: f32,
    pub first_pos: i64,
    pub window: i64,
    pub sinks: i64,
    pub sliding: i64,
    pub code_first: i64,
    pub exact_before: i64,
    pub n_rows: i64,
    pub split_rows: i32,
    pub n_splits: i32,
    pub kstride: i32,
    pub vstride: i32,
    pub aligned: i32,
    pub tile: i32,
    pub split_base: i32,
    pub part: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CombineArgs {
    pub part: u64,
    pub n_splits: i32,
    pub nh: i32,
    pub t: i32,
    pub out: u64,
    pub normalize: i32,
    /// `[B][nh][t]` f32 added to the code splits' maxima (0: none).
    pub shift: u64,
    pub shift_splits: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ScalarParams {
    pub levels: u64,
    pub signs: u64,
    pub bits: i32,
    pub sigma: f32,
    /// The fast kernels' f16 level tables hold `levels * lev` ([`crate::fast_geometry::f16_scale`]).
    pub lev: f32,
}

/// The version-5/6 kernels' extra arguments (kernels/cuda/common/fast_frame.cuh `FastArgs`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct FastArgs {
    /// Exact fp16 rows: segment s of (b, kv head) at `xk[s] + 2 * (b * xb[s] + kh * xh[s])`.
    pub xk: [u64; 2],
    pub xv: [u64; 2],
    pub xb: [i64; 2],
    pub xh: [i64; 2],
    pub xn: [i32; 2],
    /// `[kvh][d]` f32 key center, or 0.
    pub mu: u64,
    /// `[B][nh][T][ostride]` f32.
    pub out: u64,
    /// `[B*T][kvh*hchunks]` u32 arrival counters, zero between launches.
    pub counters: u64,
    pub ostride: i32,
    pub normalize: i32,
    pub exact: i32,
    /// `[B][nh][T]` f32 added to the code logits when `mu` is 0, or 0.
    pub shift: u64,
    /// `[blocks][32]` u64 phase marks (cuda/trace.rs, `KVQ_FAST_TRACE`), or 0.
    pub trace: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SketchParams {
    pub mats: u64,
    pub m: i32,
    /// Filled per launch: the queries' projections (kernels' `sketch_project`).
    pub proj: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ProjectArgs {
    pub q: u64,
    pub q_bstride: i64,
    pub q_hstride: i64,
    pub q_tstride: i64,
    pub mats: u64,
    pub m: i32,
    pub nh: i32,
    pub t: i32,
    pub group: i32,
    pub proj: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ProdParams {
    pub scalar: ScalarParams,
    pub sketch: SketchParams,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct QjlKeyParams {
    pub sketch: SketchParams,
    pub outliers: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GroupParams {
    pub bits: i32,
    pub group: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct VqParams {
    pub books: u64,
    pub signs: u64,
    pub lambda: u64,
    pub nb: i32,
    pub sub: i32,
    pub books_in_smem: i32,
    /// The codebooks in f16 (the version-5 kernel copies them to shared memory).
    pub books16: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DenseParams {
    pub unused: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct EncodeArgs {
    pub x: u64,
    pub rows: i64,
    pub t: i32,
    pub out: u64,
    pub cb: i32,
    /// Bytes between heads' code rows (`t * cb`: contiguous `[rows][cb]`).
    pub out_hstride: i64,
    /// `[heads][d]` f32: the kernel codes `f16(x) - mu` (a centered cache's keys), or 0.
    pub mu: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ScalarEncodeParams {
    pub thresholds: u64,
    pub code_of: u64,
    pub signs: u64,
    pub bits: i32,
    pub sigma: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ProdEncodeParams {
    pub scalar: ScalarEncodeParams,
    pub levels: u64,
    pub mats: u64,
    pub m: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct QjlKeyEncodeParams {
    pub mats: u64,
    pub m: i32,
    pub outliers: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct VqEncodeParams {
    pub books: u64,
    pub signs: u64,
    pub lambda: u64,
    pub nb: i32,
    pub sub: i32,
}

// SAFETY: plain #[repr(C)] structs of integers, floats and device addresses, laid out as the
// kernels' structs of the same fields (both sides LP64).
unsafe impl DeviceRepr for AttendArgs {}
unsafe impl DeviceRepr for ProjectArgs {}
unsafe impl DeviceRepr for CombineArgs {}
unsafe impl DeviceRepr for ScalarParams {}
unsafe impl DeviceRepr for FastArgs {}
unsafe impl DeviceRepr for ProdParams {}
unsafe impl DeviceRepr for QjlKeyParams {}
unsafe impl DeviceRepr for GroupParams {}
unsafe impl DeviceRepr for VqParams {}
unsafe impl DeviceRepr for DenseParams {}
unsafe impl DeviceRepr for EncodeArgs {}
unsafe impl DeviceRepr for ScalarEncodeParams {}
unsafe impl DeviceRepr for ProdEncodeParams {}
unsafe impl DeviceRepr for QjlKeyEncodeParams {}
unsafe impl DeviceRepr for VqEncodeParams {}

/// Device copies of one scalar codebook stage.
pub struct ScalarDev {
    levels: CudaSlice<f32>,
    thresholds: CudaSlice<f32>,
    code_of: CudaSlice<u8>,
    signs: CudaSlice<f32>,
    bits: i32,
    sigma: f32,
    lev: f32,
}

impl ScalarDev {
    fn new(dev: &CudaDevice, s: &ScalarSpec) -> Result<Self> {
        if !(1..=6).contains(&s.bits) || s.levels.len() != 1 << s.bits {
            bail!("cuda: scalar codebooks of 1 to 6 bits, got {} bits", s.bits)
        }
        Ok(Self {
            levels: upload(dev, &s.levels)?,
            thresholds: upload(dev, &s.thresholds)?,
            code_of: upload(dev, &s.code_of)?,
            signs: upload(dev, &s.signs)?,
            bits: s.bits as i32,
            sigma: s.sigma,
            // Only the version-5 kernels (up to 4 bits) read it.
            lev: match s.bits <= 4 {
                true => crate::fast_geometry::f16_scale(&s.levels),
                false => 1.0,
            },
        })
    }

    fn attend(&self, dev: &CudaDevice) -> ScalarParams {
        let st = dev.cuda_stream();
        ScalarParams {
            levels: address(&self.levels, &st, 0),
            signs: address(&self.signs, &st, 0),
            bits: self.bits,
            sigma: self.sigma,
            lev: self.lev,
        }
    }

    fn encode(&self, dev: &CudaDevice) -> ScalarEncodeParams {
        let st = dev.cuda_stream();
        ScalarEncodeParams {
            thresholds: address(&self.thresholds, &st, 0),
            code_of: address(&self.code_of, &st, 0),
            signs: address(&self.signs, &st, 0),
            bits: self.bits,
            sigma: self.sigma,
        }
    }
}

fn sketch_dev(dev: &CudaDevice, s: &SketchSpec) -> Result<(CudaSlice<f32>, i32)> {
    if s.m == 0 || !s.m.is_multiple_of(8) {
        bail!(
            "cuda: sketch dimension {} is not a positive multiple of 8",
            s.m
        )
    }
    Ok((upload(dev, &s.matrices)?, s.m as i32))
}

pub struct VqDev {
    books: CudaSlice<f32>,
    books16: CudaSlice<half::f16>,
    signs: CudaSlice<f32>,
    lambda: Option<CudaSlice<f32>>,
    nb: i32,
    sub: i32,
}

impl VqDev {
    fn new(dev: &CudaDevice, v: &VqSpec) -> Result<Self> {
        if v.sub != 4 && v.sub != 8 {
            bail!("cuda: vecinfer sub-vectors of 4 or 8, got {}", v.sub)
        }
        // Rounded so that each coordinate's errors cancel over a book (fast_geometry.rs).
        let books16 = crate::fast_geometry::balanced_f16(&v.books, v.sub);
        Ok(Self {
            books: upload(dev, &v.books)?,
            books16: upload(dev, &books16)?,
            signs: upload(dev, &v.signs)?,
            lambda: match v.lambda.is_empty() {
                true => None,
                false => Some(upload(dev, &v.lambda)?),
            },
            nb: (v.books.len() / (256 * v.sub)) as i32,
            sub: v.sub as i32,
        })
    }

    fn params(&self, dev: &CudaDevice) -> VqParams {
        let st = dev.cuda_stream();
        VqParams {
            books: address(&self.books, &st, 0),
            signs: address(&self.signs, &st, 0),
            lambda: self.lambda.as_ref().map_or(0, |l| address(l, &st, 0)),
            nb: self.nb,
            sub: self.sub,
            books_in_smem: 0,
            books16: address(&self.books16, &st, 0),
        }
    }
}

/// A key codec's spec on one device: the kernel family and its parameters.
pub enum KeyDev {
    Scalar(ScalarDev),
    Prod {
        scalar: ScalarDev,
        mats: CudaSlice<f32>,
        m: i32,
    },
    Sketch {
        mats: CudaSlice<f32>,
        m: i32,
        outliers: i32,
    },
    Vq(VqDev),
}

/// A value codec's spec on one device.
pub enum ValueDev {
    Scalar(ScalarDev),
    Group(GroupParams),
    Vq(VqDev),
}

/// The parameters of a key family's attend kernel.
#[derive(Debug, Clone, Copy)]
pub enum KeyArgs {
    Scalar(ScalarParams),
    Prod(ProdParams),
    Sketch(QjlKeyParams),
    Vq(VqParams),
    Dense(DenseParams),
}

/// The parameters of a value family's attend kernel.
#[derive(Debug, Clone, Copy)]
pub enum ValueArgs {
    Scalar(ScalarParams),
    Group(GroupParams),
    Vq(VqParams),
    Dense(DenseParams),
}

impl KeyDev {
    /// The device copy of `data` on `dev`, uploaded the first time.
    pub fn of(dev: &CudaDevice, data: &KernelData<KeySpec>) -> Result<Arc<Self>> {
        data.device.get_or_try_insert(&device_key(dev), || {
            Ok(match &data.spec {
                KeySpec::Scalar(s) => KeyDev::Scalar(ScalarDev::new(dev, s)?),
                KeySpec::ScalarSketch { scalar, sketch } => {
                    let (mats, m) = sketch_dev(dev, sketch)?;
                    KeyDev::Prod {
                        scalar: ScalarDev::new(dev, scalar)?,
                        mats,
                        m,
                    }
                }
                KeySpec::Sketch { sketch, outliers } => {
                    let (mats, m) = sketch_dev(dev, sketch)?;
                    KeyDev::Sketch {
                        mats,
                        m,
                        outliers: *outliers as i32,
                    }
                }
                KeySpec::ProductVq(v) => KeyDev::Vq(VqDev::new(dev, v)?),
            })
        })
    }

    pub fn attend_args(&self, dev: &CudaDevice) -> KeyArgs {
        let st = dev.cuda_stream();
        match self {
            KeyDev::Scalar(s) => KeyArgs::Scalar(s.attend(dev)),
            KeyDev::Prod { scalar, mats, m } => KeyArgs::Prod(ProdParams {
                scalar: scalar.attend(dev),
                sketch: SketchParams {
                    mats: address(mats, &st, 0),
                    m: *m,
                    proj: 0,
                },
            }),
            KeyDev::Sketch { mats, m, outliers } => KeyArgs::Sketch(QjlKeyParams {
                sketch: SketchParams {
                    mats: address(mats, &st, 0),
                    m: *m,
                    proj: 0,
                },
                outliers: *outliers,
            }),
            KeyDev::Vq(v) => KeyArgs::Vq(v.params(dev)),
        }
    }

    /// The encode kernel's name stem and parameters.
    pub fn encode_args(&self, dev: &CudaDevice) -> EncodeParams {
        let st = dev.cuda_stream();
        match self {
            KeyDev::Scalar(s) => EncodeParams::Scalar(s.encode(dev)),
            KeyDev::Prod { scalar, mats, m } => EncodeParams::Prod(ProdEncodeParams {
                scalar: scalar.encode(dev),
                levels: address(&scalar.levels, &st, 0),
                mats: address(mats, &st, 0),
                m: *m,
            }),
            KeyDev::Sketch { mats, m, outliers } => EncodeParams::QjlKeys(QjlKeyEncodeParams {
                mats: address(mats, &st, 0),
                m: *m,
                outliers: *outliers,
            }),
            KeyDev::Vq(v) => {
                let p = v.params(dev);
                EncodeParams::Vq(VqEncodeParams {
                    books: p.books,
                    signs: p.signs,
                    lambda: p.lambda,
                    nb: p.nb,
                    sub: p.sub,
                })
            }
        }
    }
}

impl ValueDev {
    /// The device copy of `data` on `dev`, uploaded the first time.
    pub fn of(dev: &CudaDevice, data: &KernelData<ValueSpec>) -> Result<Arc<Self>> {
        data.device.get_or_try_insert(&device_key(dev), || {
            Ok(match &data.spec {
                ValueSpec::Scalar(s) => ValueDev::Scalar(ScalarDev::new(dev, s)?),
                ValueSpec::Group { bits, group } => {
                    if ![2, 4, 8].contains(bits) || group % 8 != 0 {
                        bail!("cuda: group values need 2, 4 or 8 bits and groups of 8k")
                    }
                    ValueDev::Group(GroupParams {
                        bits: *bits as i32,
                        group: *group as i32,
                    })
                }
                ValueSpec::ProductVq(v) => ValueDev::Vq(VqDev::new(dev, v)?),
            })
        })
    }

    pub fn attend_args(&self, dev: &CudaDevice) -> ValueArgs {
        match self {
            ValueDev::Scalar(s) => ValueArgs::Scalar(s.attend(dev)),
            ValueDev::Group(g) => ValueArgs::Group(*g),
            ValueDev::Vq(v) => ValueArgs::Vq(v.params(dev)),
        }
    }

    pub fn encode_args(&self, dev: &CudaDevice) -> EncodeParams {
        match self {
            ValueDev::Scalar(s) => EncodeParams::Scalar(s.encode(dev)),
            ValueDev::Group(g) => EncodeParams::Group(*g),
            ValueDev::Vq(v) => {
                let p = v.params(dev);
                EncodeParams::Vq(VqEncodeParams {
                    books: p.books,
                    signs: p.signs,
                    lambda: 0,
                    nb: p.nb,
                    sub: p.sub,
                })
            }
        }
    }
}

/// An encode kernel's parameters, by family.
#[derive(Debug, Clone, Copy)]
pub enum EncodeParams {
    Scalar(ScalarEncodeParams),
    Prod(ProdEncodeParams),
    QjlKeys(QjlKeyEncodeParams),
    Group(GroupParams),
    Vq(VqEncodeParams),
}
