//! What tests/cuda_parity.rs checks its kernels with, none of it CUDA: every method's codecs,
//! random inputs with printed seeds, the normalized output and log-sum-exp of partial rows, the
//! relative L2 error, the bounds and the report table.

use candle_core::{Device, Tensor};
use kvq_cache::codec::rng::SplitMix;
use kvq_cache::compressed::{KeyCodec, ValueCodec};
use kvq_cache::methods::qjl::{GroupCodec, QjlKeyCodec};
use kvq_cache::methods::turboquant_mse::MseCodec;
use kvq_cache::methods::turboquant_prod::ProdKeyCodec;
use kvq_cache::methods::turboquant_rvq::RvqCodec;
use kvq_cache::methods::vecinfer::codec::{ValueAccum, VqKeyCodec, VqValueCodec};
use kvq_kernels::AttendParams;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub const KVH: usize = 2;

/// A fresh seed per call, printed so a failure can be replayed.
pub fn seed() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = *BASE.get_or_init(|| {
        let s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(7, |d| d.as_nanos() as u64);
        eprintln!("parity seed base {s}");
        s
    });
    base ^ NEXT
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}
pub static BASE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

pub fn gauss(n: usize, seed: u64) -> Vec<f32> {
    SplitMix::new(seed).gauss_vec(n)
}

pub struct Case {
    pub name: String,
    pub keys: Arc<dyn KeyCodec>,
    pub values: Arc<dyn ValueCodec>,
}

pub fn case(name: &str, keys: impl KeyCodec + 'static, values: impl ValueCodec + 'static) -> Case {
    Case {
        name: name.into(),
        keys: Arc::new(keys),
        values: Arc::new(values),
    }
}

/// Every method's codecs at head dim `d` (QJL at the sketch sizes of its 3- and 4-bit presets,
/// VecInfer on random codebooks, shared and per sub-position).
pub fn cases(d: usize) -> Vec<Case> {
    let s = 0x5eed;
    let mse = |b| MseCodec::new(d, KVH, b, 3, s).unwrap();
    let rvq = |b| RvqCodec::new(d, KVH, b, 3, s).unwrap();
    let group = GroupCodec::new(d, 2, 64.min(d)).unwrap();
    let lambda: Vec<f32> = gauss(KVH * d, 11).iter().map(|x| 0.5 + x.abs()).collect();
    let book = |sub: usize, n: usize, seed| gauss(n * 256 * sub, seed);
    let vq = |sub: usize, per_pos: bool| {
        let n = if per_pos { d / sub } else { 1 };
        (
            VqKeyCodec::new(d, sub, 3, s, &lambda, &book(sub, n, 21)).unwrap(),
            VqValueCodec::new(d, sub, 3, s, KVH, &book(sub, n, 22), ValueAccum::Auto(64)).unwrap(),
        )
    };
    let (vk4, vv4) = vq(4, true);
    let (vk4s, vv4s) = vq(4, false);
    let (vk8, vv8) = vq(8, true);
    vec![
        case("turboquant-mse-2", mse(2), mse(2)),
        case("turboquant-mse-3", mse(3), mse(3)),
        case("turboquant-mse-4", mse(4), mse(4)),
        case("turboquant-rvq-2", rvq(2), rvq(2)),
        case("turboquant-rvq-4", rvq(4), rvq(4)),
        case("turboquant-rvq-6", rvq(6), rvq(6)),
        case(
            "turboquant-prod-3",
            ProdKeyCodec::new(d, KVH, 3, 3, s).unwrap(),
            mse(3),
        ),
        case(
            "turboquant-prod-4",
            ProdKeyCodec::new(d, KVH, 4, 3, s).unwrap(),
            mse(3),
        ),
        case(
            "qjl-3",
            QjlKeyCodec::new(d, KVH, 3 * d - d / 8 * 3, 1, 3, s).unwrap(),
            group.clone(),
        ),
        case(
            "qjl-4",
            QjlKeyCodec::new(d, KVH, 4 * d + 8, 4, 3, s).unwrap(),
            GroupCodec::new(d, 4, 64.min(d)).unwrap(),
        ),
        case("vecinfer-2", vk4, vv4),
        case("vecinfer-2-shared", vk4s, vv4s),
        case("vecinfer-1", vk8, vv8),
    ]
}

pub fn host(x: &[f32], dims: &[usize]) -> Tensor {
    Tensor::from_vec(x.to_vec(), dims, &Device::Cpu).unwrap()
}

/// Normalized outputs and log-sum-exps of `[.., d + 2]` partial rows.
pub fn normalized(rows: &[f32], d: usize) -> (Vec<f32>, Vec<f32>) {
    let mut out = Vec::new();
    let mut lse = Vec::new();
    for r in rows.chunks_exact(d + 2) {
        let (m, l) = (r[d], r[d + 1]);
        assert!(
            r.iter().all(|x| !x.is_nan()),
            "NaN in a partial row (unwritten?)"
        );
        if l > 0.0 {
            out.extend(r[..d].iter().map(|x| x / l));
            lse.push(m + l.ln());
        } else {
            assert!(m == f32::NEG_INFINITY && r[..d].iter().all(|&x| x == 0.0));
            out.extend(std::iter::repeat_n(0.0, d));
            lse.push(f32::NEG_INFINITY);
        }
    }
    (out, lse)
}

pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

pub fn decode_params(n: usize, d: usize) -> AttendParams {
    AttendParams {
        scale: 1.0 / (d as f32).sqrt(),
        first_pos: n,
        window: 1,
        sinks: 0,
        sliding_window: None,
        code_first: 0,
        exact_before: 0,
    }
}

/// The log-sum-exp's bound, relative (see `attend_check`). It is a check of the partial state
/// besides the output's bound, looser than it: the version-5 kernels score from f16 operands
/// (levels' tables, VecInfer's codebooks), and with one position the lse is one logit, whose f16
/// rounding error does not average out. H100 runs gave up to 2.3e-4 for TurboQuant, and for
/// VecInfer at one position 9.6e-4 (this relative form) and 1.1e-3 (an earlier, absolute form);
/// the outputs of those cases stayed under 2.8e-4.
pub const LSE_BOUND: f64 = 2e-3;

pub fn report(rows: &[(String, f64, f64)], bound: f64) {
    eprintln!(
        "{:<44} {:>12} {:>12}",
        "kernel / shape", "rel L2", "rel dlse"
    );
    for (name, e, l) in rows {
        eprintln!("{name:<44} {e:>12.3e} {l:>12.3e}");
    }
    let bad: Vec<_> = rows
        .iter()
        .filter(|(_, e, l)| !(*e < bound && *l < LSE_BOUND))
        .collect();
    assert!(bad.is_empty(), "over the bound {bound}: {bad:?}");
}
