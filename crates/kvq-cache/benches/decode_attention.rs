//! Decode attention at 8192 cached tokens (d = 64, 3 kv heads, 9 query heads, one query row:
//! append the new token, attend), fp16 against every compressed method (VecInfer with random
//! codebooks of a real calibration's shape), all through the public `KvCache` API in one run so
//! their ratio is measured under the same machine load; then the codebook kernels alone (scores
//! and value sums over 8192 code rows) on each path, the byte lookup table the register gather
//! replaced, and the fast encode against its reference.
//! `cargo bench -p kvq-cache --bench decode_attention`.

use candle_core::{Device, Tensor};
use criterion::{Criterion, black_box, criterion_group, criterion_main};
use kvq_cache::compressed::KeyCodec;
use kvq_cache::methods::turboquant_mse::MseCodec;
use kvq_cache::methods::vecinfer::calibration::{FixedCalibration, VecInferCalibration};
use kvq_cache::{CacheGeometry, CacheRegistry, CacheSpec, KvCache};
use kvq_kernels::turboquant::{self, Isa, Rows, Table};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKENS: usize = 8192;
const D: usize = 64;
const KV_HEADS: usize = 3;
const HEADS: usize = 9;
/// Decode steps between rebuilds of the cache.
const REFILL: usize = 64;

fn floats(n: usize, seed: u64) -> Vec<f32> {
    let mut r = kvq_cache::codec::rng::SplitMix::new(seed);
    (0..n)
        .map(|_| (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0)
        .collect()
}

/// The registry, with random VecInfer codebooks (timing only: a real calibration has the same
/// shapes and costs).
fn registry() -> CacheRegistry {
    let mut r = CacheRegistry::builtin();
    let cal = VecInferCalibration::random(1, KV_HEADS, D, 3);
    r.set_calibration(Arc::new(FixedCalibration(Arc::new(cal))));
    r
}

/// A cache of `method` (with `bits`) holding TOKENS positions.
fn filled(method: &str, bits: Option<u8>) -> Box<dyn KvCache> {
    let spec = CacheSpec {
        method: Some(method.into()),
        bits,
    };
    let factory = registry()
        .resolve(&spec)
        .expect("method in the registry")
        .factory;
    let geom = CacheGeometry {
        n_heads: HEADS,
        n_kv_heads: KV_HEADS,
        head_dim: D,
        sliding_window: None,
        max_tokens: TOKENS + REFILL + 1,
    };
    let mut cache = factory.create(0, &geom).expect("cache");
    let chunk = 512;
    let dev = Device::Cpu;
    for c in 0..TOKENS / chunk {
        let k = Tensor::from_vec(
            floats(KV_HEADS * chunk * D, 2 * c as u64),
            (KV_HEADS, chunk, D),
            &dev,
        );
        let v = Tensor::from_vec(
            floats(KV_HEADS * chunk * D, 2 * c as u64 + 1),
            (KV_HEADS, chunk, D),
            &dev,
        );
        cache
            .append(&k.expect("k"), &v.expect("v"))
            .expect("append");
    }
    cache
}

fn decode_attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_attention_8192");
    g.sample_size(30).measurement_time(Duration::from_secs(4));
    let q = Tensor::from_vec(floats(HEADS * D, 99), (HEADS, 1, D), &Device::Cpu).expect("q");
    let mut cases: Vec<(String, &str, Option<u8>)> = vec![("fp16".into(), "fp16", None)];
    for (method, bits) in [
        ("turboquant-mse", &[2u8, 3, 4][..]),
        ("turboquant-rvq", &[2, 4, 6]),
        ("turboquant-prod", &[3, 4]),
        ("qjl", &[3, 4]),
        ("vecinfer", &[1, 2]),
    ] {
        for &b in bits {
            cases.push((format!("{method}-{b}bit"), method, Some(b)));
        }
    }
    let dev = Device::Cpu;
    let k1 = Tensor::from_vec(floats(KV_HEADS * D, 5), (KV_HEADS, 1, D), &dev).expect("k");
    let v1 = Tensor::from_vec(floats(KV_HEADS * D, 6), (KV_HEADS, 1, D), &dev).expect("v");
    for (name, method, bits) in cases {
        let mut cache = filled(method, bits);
        eprintln!("{name}: resident {} bytes", cache.resident_bytes());
        // One decode step: append the new token, attend. The cache is rebuilt (untimed) every
        // REFILL steps, so the context stays within TOKENS..TOKENS + REFILL.
        g.bench_function(&name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if cache.len() >= TOKENS + REFILL {
                        cache = filled(method, bits);
                    }
                    let t = Instant::now();
                    cache.append(&k1, &v1).expect("append");
                    black_box(cache.attend(&q, 0.125).expect("attend"));
                    total += t.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

fn kernels(c: &mut Criterion) {
    let mut g = c.benchmark_group("kernels_8192_rows");
    g.sample_size(30).measurement_time(Duration::from_secs(2));
    let q = floats(D, 7);
    let w = floats(TOKENS, 8);
    for bits in [2u32, 3, 4] {
        let stride = 2 + (D * bits as usize).div_ceil(8);
        let data: Vec<u8> = floats(TOKENS * stride, u64::from(bits))
            .iter()
            .map(|x| (x.to_bits() >> 7) as u8)
            .collect();
        let rows = Rows {
            data: &data,
            stride,
            offset: 2,
            d: D,
            scale_at: Some(0),
        };
        let table = Table::new(&floats(1 << bits, 3));
        let mut out = vec![0f32; TOKENS];
        for isa in Isa::available() {
            g.bench_function(format!("scores_{bits}bit_{isa:?}"), |b| {
                b.iter(|| turboquant::dot_rows_with(isa, &q, &table, rows, black_box(&mut out)))
            });
            let mut acc = vec![0f32; D];
            g.bench_function(format!("values_{bits}bit_{isa:?}"), |b| {
                b.iter(|| turboquant::axpy_rows_with(isa, &w, &table, rows, black_box(&mut acc)))
            });
        }
        if bits == 4 {
            let mut lut = Vec::new();
            g.bench_function("scores_4bit_byte_lut_incl_build", |b| {
                b.iter(|| {
                    turboquant::byte_lut(&q, &table, D, &mut lut).expect("4 bits");
                    turboquant::dot_rows_byte_lut(&lut, 4, rows, black_box(&mut out))
                })
            });
        }
    }
    g.finish();
}

fn encode(c: &mut Criterion) {
    let mut g = c.benchmark_group("encode_1024_rows");
    g.sample_size(20).measurement_time(Duration::from_secs(2));
    let rows = 1024;
    let x = floats(rows * D, 11);
    for bits in [2u32, 4] {
        let codec = MseCodec::new(D, 1, bits, 0, 1).expect("codec");
        let cb = KeyCodec::code_bytes(&codec);
        let mut out = vec![0u8; rows * cb];
        g.bench_function(format!("mse_{bits}bit_fast"), |b| {
            b.iter(|| {
                for (xr, o) in x.chunks_exact(D).zip(out.chunks_exact_mut(cb)) {
                    KeyCodec::encode(&codec, 0, xr, o);
                }
            })
        });
        g.bench_function(format!("mse_{bits}bit_reference"), |b| {
            b.iter(|| {
                for (xr, o) in x.chunks_exact(D).zip(out.chunks_exact_mut(cb)) {
                    codec.encode_reference(0, xr, o);
                }
            })
        });
        // Scores of the 1024 codes one call per code (how a stage built on MSE may use it)
        // against one call for all of them.
        let mut state = vec![0f32; codec.state_len()];
        codec.prepare(0, &floats(D, 12), &mut state);
        let mut s = vec![0f32; rows];
        g.bench_function(format!("mse_{bits}bit_score_one_per_code"), |b| {
            b.iter(|| {
                for (o, code) in s.iter_mut().zip(out.chunks_exact(cb)) {
                    *o = codec.score_one(&state, code);
                }
            })
        });
        g.bench_function(format!("mse_{bits}bit_score_rows"), |b| {
            b.iter(|| codec.score_rows(&state, &out, cb, black_box(&mut s)))
        });
    }
    g.finish();
}

criterion_group!(benches, decode_attention, kernels, encode);
criterion_main!(benches);
