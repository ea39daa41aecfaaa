//! The Metal self-test a Mac user runs in one command (`scripts/metal-selftest`, or
//! `cargo test --release -p kvq-cache --features metal --test metal_selftest -- --nocapture`):
//! every method's ops on the Metal device against the CPU ops on fresh random inputs, with a
//! table per kernel. The fused attention (and its split merge) on the same codes as the CPU op
//! (relative L2 of the normalized output, log-sum-exp difference); encode by the attention over
//! codes the GPU wrote against codes the CPU wrote; the nearest-centroid search by the distance
//! of the centroid it picks; and a whole cache of every builtin method fed the same rows on
//! both devices (VecInfer, which needs a calibration, as codecs over made-up codebooks only).
//! Every method's codecs have a Metal kernel for encode and attention. Needs the `metal` feature
//! and an Apple GPU; on Linux CI only type-checks it (scripts/test-metal typecheck).
#![cfg(feature = "metal")]

use candle_core::{Device, Tensor};
use kvq_cache::codec::rng::SplitMix;
use kvq_cache::compressed::{KeyCodec, ValueCodec};
use kvq_cache::methods::qjl::{GroupCodec, QjlKeyCodec};
use kvq_cache::methods::turboquant_mse::MseCodec;
use kvq_cache::methods::turboquant_prod::ProdKeyCodec;
use kvq_cache::methods::turboquant_rvq::RvqCodec;
use kvq_cache::methods::vecinfer::codec::{ValueAccum, VqKeyCodec, VqValueCodec};
use kvq_cache::{CacheError, CacheGeometry, CacheRegistry, CacheSpec};
use kvq_kernels::{AttendParams, compressed_attend, encode_keys, encode_values};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

const KVH: usize = 2;

fn metal() -> Device {
    Device::new_metal(0).expect("a Metal device")
}

/// A fresh seed per call, printed with a failure so it can be replayed.
fn seed() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = std::env::var("KVQ_SELFTEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    base.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))
}

fn host(x: Vec<f32>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(x, dims, &Device::Cpu).expect("tensor")
}

fn gauss(n: usize, seed: u64) -> Vec<f32> {
    SplitMix::new(seed).gauss_vec(n)
}

fn flat(x: &Tensor) -> Vec<f32> {
    x.to_device(&Device::Cpu)
        .and_then(|x| x.flatten_all())
        .and_then(|x| x.to_vec1::<f32>())
        .expect("read back")
}

struct Case {
    name: String,
    keys: Arc<dyn KeyCodec>,
    values: Arc<dyn ValueCodec>,
}

/// VecInfer's codecs over made-up codebooks (`[books][256][sub]` Gaussian centroids) and
/// smoothing factors in [0.5, 2): the kernels' parity does not need trained ones.
fn vecinfer(
    d: usize,
    sub: usize,
    per_position: bool,
    s: u64,
) -> (Arc<VqKeyCodec>, Arc<VqValueCodec>) {
    let books = if per_position { d / sub } else { 1 };
    let lambda: Vec<f32> = gauss(KVH * d, s)
        .into_iter()
        .map(|x| 0.5 + 1.5 * (0.5 + 0.5 * x.tanh()))
        .collect();
    let kb: Vec<f32> = gauss(books * 256 * sub, s + 1)
        .iter()
        .map(|x| 0.9 * x)
        .collect();
    let vb: Vec<f32> = gauss(books * 256 * sub, s + 2)
        .iter()
        .map(|x| 0.9 * x)
        .collect();
    let k = VqKeyCodec::new(d, sub, 3, s, &lambda, &kb).expect("vecinfer keys");
    let v =
        VqValueCodec::new(d, sub, 3, s, KVH, &vb, ValueAccum::Auto(256)).expect("vecinfer values");
    (Arc::new(k), Arc::new(v))
}

/// Every method's codecs, each with a fused Metal attention and Metal encode kernels.
fn cases(d: usize) -> Vec<Case> {
    let s = 0x5eed;
    let c = |name: &str, k: Arc<dyn KeyCodec>, v: Arc<dyn ValueCodec>| Case {
        name: name.into(),
        keys: k,
        values: v,
    };
    let mse = |b| Arc::new(MseCodec::new(d, KVH, b, 3, s).expect("mse"));
    let rvq = |b| Arc::new(RvqCodec::new(d, KVH, b, 3, s).expect("rvq"));
    let group = |b| Arc::new(GroupCodec::new(d, b, 64.min(d)).expect("group"));
    let qjl = |m| Arc::new(QjlKeyCodec::new(d, KVH, m, 1, 3, s).expect("qjl"));
    let prod = |b| Arc::new(ProdKeyCodec::new(d, KVH, b, 3, s).expect("prod"));
    let (vk2, vv2) = vecinfer(d, 4, false, s);
    let (vk1, vv1) = vecinfer(d, 8, true, s);
    vec![
        c("turboquant-mse-2", mse(2), mse(2)),
        c("turboquant-mse-4", mse(4), mse(4)),
        c("turboquant-rvq-4", rvq(4), rvq(4)),
        c("turboquant-rvq-6", rvq(6), rvq(6)),
        c("turboquant-prod-3", prod(3), mse(3)),
        c("turboquant-prod-4", prod(4), mse(4)),
        c("qjl-3", qjl(3 * d - d / 8 * 3), group(2)),
        c("qjl-4", qjl(4 * d + 8), group(4)),
        c("vecinfer-2 (shared books)", vk2, vv2),
        c("vecinfer-1 (per-position books)", vk1, vv1),
    ]
}

fn normalized(rows: &[f32], d: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut out, mut lse) = (Vec::new(), Vec::new());
    for r in rows.chunks_exact(d + 2) {
        assert!(r.iter().all(|x| !x.is_nan()), "NaN in a partial row");
        let (m, l) = (r[d], r[d + 1]);
        if l > 0.0 {
            out.extend(r[..d].iter().map(|x| x / l));
            lse.push(m + l.ln());
        } else {
            out.extend(std::iter::repeat_n(0.0, d));
            lse.push(f32::NEG_INFINITY);
        }
    }
    (out, lse)
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn lse_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x == y {
                0.0
            } else {
                f64::from((x - y).abs())
            }
        })
        .fold(0.0, f64::max)
}

fn decode(n: usize, d: usize) -> AttendParams {
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

type Row = (String, f64, f64, f64);

/// The bound of VecInfer's fused attention from 512 positions on, where it scores keys from a
/// 16-bit table (`kvq_attend_vq_lut`; 6.3e-5 at most on the emulator's shapes at the usual
/// softmax scale, 7.1e-4 at softmax scale 4).
const TABLE_BOUND: f64 = 1e-3;

fn report(title: &str, rows: &[Row], bound: impl Fn(&str) -> f64) {
    eprintln!("\n{title}");
    eprintln!(
        "{:<48} {:>11} {:>11} {:>9}",
        "kernel / shape", "rel L2", "|dlse|", "ms"
    );
    for (name, e, l, ms) in rows {
        eprintln!("{name:<48} {e:>11.3e} {l:>11.3e} {ms:>9.2}");
    }
    let bad: Vec<_> = rows
        .iter()
        .filter(|(name, e, l, _)| !(*e < bound(name) && *l < 1e-2))
        .collect();
    assert!(bad.is_empty(), "over the bound: {bad:?}");
}

/// The fused attention and combine on codes the CPU wrote: decode over 1, 300 and 5000 rows,
/// GQA 1 and 4, head dim 64, 128 and 256, and a 5-row prefill.
#[test]
fn attend_matches_the_cpu_op() {
    let dev = metal();
    let mut rows = Vec::new();
    for d in [64, 128, 256] {
        for c in cases(d) {
            for (group, n, t) in [(1, 1, 1), (4, 300, 1), (4, 5000, 1), (1, 300, 5)] {
                let nh = KVH * group;
                let k = host(gauss(KVH * n * d, seed()), &[KVH, n, d]);
                let v = host(gauss(KVH * n * d, seed()), &[KVH, n, d]);
                let q = host(gauss(nh * t * d, seed()), &[nh, t, d]);
                let p = decode(n + 1 - t, d);
                let kc = encode_keys(&c.keys, &k).expect("encode");
                let vc = encode_values(&c.values, &v).expect("encode");
                let cpu = compressed_attend(&c.keys, &c.values, p, &q, &kc, &vc).expect("cpu");
                let up = |x: &Tensor| x.to_device(&dev).expect("upload");
                let (qg, kg, vg) = (up(&q), up(&kc), up(&vc));
                let _ = compressed_attend(&c.keys, &c.values, p, &qg, &kg, &vg).expect("warm");
                let start = Instant::now();
                let gpu = compressed_attend(&c.keys, &c.values, p, &qg, &kg, &vg).expect("metal");
                let got = flat(&gpu);
                let ms = start.elapsed().as_secs_f64() * 1e3;
                let (oc, lc) = normalized(&flat(&cpu), d);
                let (og, lg) = normalized(&got, d);
                rows.push((
                    format!("{} d{d} g{group} n{n} t{t}", c.name),
                    rel_l2(&og, &oc),
                    lse_diff(&lg, &lc),
                    ms,
                ));
            }
        }
    }
    report(
        "fused attention (kvq_attend_* + kvq_combine) vs the CPU op",
        &rows,
        // VecInfer over 5000 rows takes the table kernel.
        |name| match name.starts_with("vecinfer") && name.contains(" n5000 ") {
            true => TABLE_BOUND,
            false => 1e-4,
        },
    );
}

/// Encode on the GPU: the attention over GPU-written codes against CPU-written codes (the
/// GPU's rounding may pick the other side of a threshold for a few coordinates).
#[test]
fn encode_matches_the_cpu_codec() {
    let dev = metal();
    let mut rows = Vec::new();
    for d in [64, 128, 256] {
        for c in cases(d) {
            let (n, nh) = (2000, 2 * KVH);
            let k = host(gauss(KVH * n * d, seed()), &[KVH, n, d]);
            let v = host(gauss(KVH * n * d, seed()), &[KVH, n, d]);
            let q = host(gauss(nh * d, seed()), &[nh, 1, d]);
            let p = decode(n, d);
            let (kc, vc) = (
                encode_keys(&c.keys, &k).expect("encode"),
                encode_values(&c.values, &v).expect("encode"),
            );
            let cpu = compressed_attend(&c.keys, &c.values, p, &q, &kc, &vc).expect("cpu");
            let up = |x: &Tensor| x.to_device(&dev).expect("upload");
            let start = Instant::now();
            let kg = encode_keys(&c.keys, &up(&k)).expect("metal encode");
            let vg = encode_values(&c.values, &up(&v)).expect("metal encode");
            let (kh, vh) = (
                kg.to_device(&Device::Cpu).expect("read back"),
                vg.to_device(&Device::Cpu).expect("read back"),
            );
            let ms = start.elapsed().as_secs_f64() * 1e3;
            let gpu = compressed_attend(&c.keys, &c.values, p, &q, &kh, &vh).expect("cpu");
            let (oc, lc) = normalized(&flat(&cpu), d);
            let (og, lg) = normalized(&flat(&gpu), d);
            rows.push((
                format!("{} d{d} n{n}", c.name),
                rel_l2(&og, &oc),
                lse_diff(&lg, &lc),
                ms,
            ));
        }
    }
    report(
        "encode (kvq_encode_*) vs the CPU codec, through attention",
        &rows,
        |_| 2e-2,
    );
}

/// The nearest-centroid search: never a farther centroid than the CPU's.
#[test]
fn nearest_matches_the_cpu_search() {
    let dev = metal();
    for sub in [4, 8] {
        let n = 1 << 16;
        let x = host(gauss(n * sub, seed()), &[n, sub]);
        let c = host(gauss(256 * sub, seed()), &[256, sub]);
        let cpu = kvq_kernels::nearest_centroid(&x, &c)
            .and_then(|t| t.to_vec1::<u32>())
            .expect("cpu");
        let up = |t: &Tensor| t.to_device(&dev).expect("upload");
        let gpu = kvq_kernels::nearest_centroid(&up(&x), &up(&c))
            .and_then(|t| t.to_device(&Device::Cpu))
            .and_then(|t| t.to_vec1::<u32>())
            .expect("metal");
        let (xs, cs) = (flat(&x), flat(&c));
        let dist = |i: usize, k: u32| -> f64 {
            (0..sub)
                .map(|j| f64::from(xs[i * sub + j] - cs[k as usize * sub + j]).powi(2))
                .sum()
        };
        let worse = (0..n)
            .filter(|&i| gpu[i] >= 256 || dist(i, gpu[i]) > dist(i, cpu[i]) * (1.0 + 1e-5) + 1e-9)
            .count();
        let same = (0..n).filter(|&i| gpu[i] == cpu[i]).count();
        eprintln!("kvq_nearest s{sub}: {same}/{n} same index, {worse} farther");
        assert_eq!(worse, 0, "sub {sub}");
    }
}

/// Every builtin method (that needs no calibration: not VecInfer) as a whole cache, fp16
/// (candle's Metal SDPA on decode) among them: a 700-token prompt in chunks, then 8 decode
/// steps, the same rows on the CPU and on Metal.
#[test]
fn every_method_as_a_cache() {
    let dev = metal();
    let reg = CacheRegistry::builtin();
    let g = CacheGeometry {
        n_heads: 8,
        n_kv_heads: KVH,
        head_dim: 128,
        sliding_window: None,
        max_tokens: 4096,
    };
    let mut rows = Vec::new();
    for name in reg.names() {
        let spec = CacheSpec {
            method: Some(name.clone()),
            bits: None,
        };
        let factory = match reg.resolve(&spec) {
            Ok(r) => r.factory,
            Err(CacheError::Calibration(_)) => continue,
            Err(e) => panic!("{name}: {e}"),
        };
        let (mut cpu, mut gpu) = (
            factory.create(0, &g).expect("cache"),
            factory.create(0, &g).expect("cache"),
        );
        let mut worst = 0f64;
        let start = Instant::now();
        for t in [300, 400, 1, 1, 1, 1, 1, 1, 1, 1] {
            let k = host(gauss(KVH * t * 128, seed()), &[KVH, t, 128]);
            let v = host(gauss(KVH * t * 128, seed()), &[KVH, t, 128]);
            let q = host(gauss(8 * t * 128, seed()), &[8, t, 128]);
            cpu.append(&k, &v).expect("cpu append");
            let up = |x: &Tensor| x.to_device(&dev).expect("upload");
            gpu.append(&up(&k), &up(&v)).expect("metal append");
            let oc = cpu.attend(&q, 0.088).expect("cpu attend");
            let og = gpu.attend(&up(&q), 0.088).expect("metal attend");
            worst = worst.max(rel_l2(&flat(&og), &flat(&oc)));
        }
        let ms = start.elapsed().as_secs_f64() * 1e3;
        rows.push((name, worst, 0.0, ms));
    }
    report(
        "every method as a cache (prompt 700 + 8 decode steps), worst step",
        &rows,
        |_| 5e-2,
    );
}
