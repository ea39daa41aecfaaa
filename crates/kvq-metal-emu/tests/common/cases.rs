//! The cases the emulated attention tests run: every method's key and value codecs as
//! kvq-cache builds them, and the specs their Metal kernels read.

use super::KVH;
use kvq_cache::codec::rng::SplitMix;
use kvq_cache::compressed::{KeyCodec, ValueCodec};
use kvq_cache::methods::qjl::{GroupCodec, QjlKeyCodec};
use kvq_cache::methods::turboquant_mse::MseCodec;
use kvq_cache::methods::turboquant_prod::ProdKeyCodec;
use kvq_cache::methods::turboquant_rvq::RvqCodec;
use kvq_cache::methods::vecinfer::codec::{ValueAccum, VqKeyCodec, VqValueCodec};
use kvq_kernels::spec::{KeySpec, ScalarSpec, SketchSpec, ValueSpec, VqSpec};
use std::sync::Arc;

/// What the emulated kernel reads besides the codes: the codecs' specs.
pub enum Spec {
    Scalar {
        k: ScalarSpec,
        v: ScalarSpec,
    },
    Prod {
        k: ScalarSpec,
        sketch: SketchSpec,
        v: ScalarSpec,
    },
    Qjl {
        m: usize,
        outliers: usize,
        mats: Vec<f32>,
        vbits: u32,
        vgroup: usize,
    },
    Vq {
        k: VqSpec,
        v: VqSpec,
    },
}

impl Spec {
    /// The attention kernel of this layout.
    pub fn kernel(&self) -> &'static str {
        match self {
            Spec::Scalar { .. } => "kvq_attend_scalar",
            Spec::Prod { .. } => "kvq_attend_prod",
            Spec::Qjl { .. } => "kvq_attend_qjl",
            Spec::Vq { .. } => "kvq_attend_vq",
        }
    }
}

pub struct Case {
    pub name: String,
    pub keys: Arc<dyn KeyCodec>,
    pub values: Arc<dyn ValueCodec>,
    pub spec: Spec,
}

pub fn case(name: String, keys: Arc<dyn KeyCodec>, values: Arc<dyn ValueCodec>) -> Case {
    let ks = keys.kernel_data().map(|k| k.spec.clone());
    let vs = values.kernel_data().map(|v| v.spec.clone());
    let spec = match (ks, vs) {
        (Some(KeySpec::Scalar(k)), Some(ValueSpec::Scalar(v))) => Spec::Scalar { k, v },
        (Some(KeySpec::ScalarSketch { scalar, sketch }), Some(ValueSpec::Scalar(v))) => {
            Spec::Prod {
                k: scalar,
                sketch,
                v,
            }
        }
        (Some(KeySpec::Sketch { sketch, outliers }), Some(ValueSpec::Group { bits, group })) => {
            Spec::Qjl {
                m: sketch.m,
                outliers,
                mats: sketch.matrices.to_vec(),
                vbits: bits,
                vgroup: group,
            }
        }
        (Some(KeySpec::ProductVq(k)), Some(ValueSpec::ProductVq(v))) => Spec::Vq { k, v },
        other => panic!("{name}: no Metal attention for {other:?}"),
    };
    Case {
        name,
        keys,
        values,
        spec,
    }
}

/// TurboQuant-MSE at `bits` (keys and values with their own rotations: other seeds).
pub fn mse(d: usize, bits: u32) -> Case {
    let k = MseCodec::new(d, KVH, bits, 3, 11).expect("mse keys");
    let v = MseCodec::new(d, KVH, bits, 3, 12).expect("mse values");
    case(format!("mse-{bits}"), Arc::new(k), Arc::new(v))
}

pub fn rvq(d: usize, bits: u32) -> Case {
    let k = RvqCodec::new(d, KVH, bits, 3, 11).expect("rvq keys");
    let v = RvqCodec::new(d, KVH, bits, 3, 12).expect("rvq values");
    case(format!("rvq-{bits}"), Arc::new(k), Arc::new(v))
}

/// TurboQuant-Prod at `bits` (an MSE stage of `bits - 1`, the residual sketch, MSE values of
/// `bits`), as the method builds it.
pub fn prod(d: usize, bits: u32) -> Case {
    let k = ProdKeyCodec::new(d, KVH, bits, 3, 11).expect("prod keys");
    let v = MseCodec::new(d, KVH, bits, 3, 12).expect("mse values");
    case(format!("prod-{bits}"), Arc::new(k), Arc::new(v))
}

/// QJL at sketch dimension `m` with `outliers` exact channels, values at `vbits` in groups of
/// `vgroup`.
pub fn qjl(d: usize, m: usize, outliers: usize, vbits: u32, vgroup: usize) -> Case {
    let k = QjlKeyCodec::new(d, KVH, m, outliers, 3, 11).expect("qjl keys");
    let v = GroupCodec::new(d, vbits, vgroup).expect("qjl values");
    case(
        format!("qjl m{m} o{outliers} v{vbits}/{vgroup}"),
        Arc::new(k),
        Arc::new(v),
    )
}

/// QJL's codecs as cuda_parity.rs runs them: the sketch sizes of the 3- and 4-bit presets (one
/// and four exact outlier channels), values at 2 and 4 bits in groups of 64; and 8-bit values in
/// groups of 32 with no outliers.
pub fn qjl_cases(d: usize) -> Vec<Case> {
    vec![
        qjl(d, 3 * d - d / 8 * 3, 1, 2, 64.min(d)),
        qjl(d, 4 * d + 8, 4, 4, 64.min(d)),
        qjl(d, 2 * d, 0, 8, 32),
    ]
}

/// VecInfer codebooks and smoothing factors as calibration would give them, made up: `[books]
/// [256][sub]` Gaussian centroids (scaled to the coded vectors' spread), lambdas in [0.5, 2).
pub fn vq_books(d: usize, sub: usize, per_position: bool, seed: u64) -> Vec<f32> {
    let books = if per_position { d / sub } else { 1 };
    let mut r = SplitMix::new(seed);
    r.gauss_vec(books * 256 * sub)
        .into_iter()
        .map(|x| 0.9 * x)
        .collect()
}

pub fn vq_lambda(d: usize, seed: u64) -> Vec<f32> {
    let mut r = SplitMix::new(seed);
    (0..KVH * d)
        .map(|_| 0.5 + 1.5 * (r.next_u64() >> 11) as f32 / (1u64 << 53) as f32)
        .collect()
}

/// VecInfer's key and value codecs at sub-vector length `sub`, codebooks shared or one per
/// sub-position, values accumulated as the method does (histogram for long runs).
pub fn vq(d: usize, sub: usize, per_position: bool) -> Case {
    let lambda = vq_lambda(d, 41);
    let k = VqKeyCodec::new(d, sub, 3, 11, &lambda, &vq_books(d, sub, per_position, 42))
        .expect("vq keys");
    let v = VqValueCodec::new(
        d,
        sub,
        3,
        11,
        KVH,
        &vq_books(d, sub, per_position, 43),
        ValueAccum::Auto(256),
    )
    .expect("vq values");
    let books = if per_position {
        "per position"
    } else {
        "shared"
    };
    case(format!("vq s{sub} {books}"), Arc::new(k), Arc::new(v))
}
