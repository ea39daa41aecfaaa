//! GPU benchmark of the fused decode attention (one query token per sequence) for fp16 and every
//! preset, at Llama-3-8B (32 q / 8 kv heads, d 128) and Falcon3-7B (12 / 4, d 256) shapes, 4k to
//! 128k positions, batch 1 and 8, and of the fused nearest-centroid search at the seed's shapes.
//! Bytes are counted before timing: a preset's kernel must read its compressed rows
//! (`positions - window - sinks` code rows of keys and values) plus its fp16 sinks and window.
//! Timing: CUDA events around batches of launches queued behind a spin kernel (the GPU runs them
//! back to back, host enqueue time excluded), inputs rotated over enough sets to exceed the L2,
//! median over batches. With `--torch FILE` (scripts/gpu/torch_baselines.py's JSON from the same
//! machine and call) each row gets torch's flash / cuDNN times. Writes `--out DIR`/
//! gpu-attention.json and gpu-encode.json and prints tables.
//!
//! `cargo bench -p kvq-cache --features cuda --bench gpu_attention -- --out DIR [--torch F]
//! [--quick]`; scripts/gpu-suite runs it on the GPU machine.

use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::{DType, Device, Tensor};
use kvq_cache::compressed::CodecFactory;
use kvq_cache::compressed::{KeyCodec, ValueCodec};
use kvq_cache::methods::qjl::{GroupCodec, QjlFactory, QjlKeyCodec};
use kvq_cache::methods::turboquant_mse::MseCodec;
use kvq_cache::methods::turboquant_prod::ProdKeyCodec;
use kvq_cache::methods::turboquant_rvq::RvqCodec;
use kvq_cache::methods::vecinfer::codec::{ValueAccum, VqKeyCodec, VqValueCodec};
use kvq_kernels::cuda::ops::{decode_attend, dense_decode_attend};
use kvq_kernels::{AttendParams, encode_keys, encode_values};
use serde_json::{Value, json};
use std::sync::Arc;

type R<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Shape {
    name: &'static str,
    nh: usize,
    kvh: usize,
    d: usize,
}

const SHAPES: [Shape; 2] = [
    Shape {
        name: "llama3-8b",
        nh: 32,
        kvh: 8,
        d: 128,
    },
    Shape {
        name: "falcon3-7b",
        nh: 12,
        kvh: 4,
        d: 256,
    },
];

/// A preset as configs/cache/<name>.toml sets it up: codecs, fp16 window and sinks.
struct Preset {
    name: &'static str,
    keys: Arc<dyn KeyCodec>,
    values: Arc<dyn ValueCodec>,
    window: usize,
    sinks: usize,
}

fn presets(kvh: usize, d: usize) -> R<Vec<Preset>> {
    let s = 0x7451;
    let mse = |b| -> R<MseCodec> { Ok(MseCodec::new(d, kvh, b, 0, s)?) };
    let rvq = |b| -> R<RvqCodec> { Ok(RvqCodec::new(d, kvh, b, 0, s)?) };
    let g = |n: usize, seed: u64| kvq_cache::codec::rng::SplitMix::new(seed).gauss_vec(n);
    let lambda: Vec<f32> = g(kvh * d, 3).iter().map(|x| 0.5 + x.abs()).collect();
    let vq = |sub: usize| -> R<(VqKeyCodec, VqValueCodec)> {
        let n = d / sub * 256 * sub;
        Ok((
            VqKeyCodec::new(d, sub, 0, s, &lambda, &g(n, 5))?,
            VqValueCodec::new(d, sub, 0, s, kvh, &g(n, 6), ValueAccum::Auto(64))?,
        ))
    };
    let p = |name, k: Arc<dyn KeyCodec>, v: Arc<dyn ValueCodec>, window| Preset {
        name,
        keys: k,
        values: v,
        window,
        sinks: 4,
    };
    let (vk2, vv2) = vq(4)?;
    let (vk1, vv1) = vq(8)?;
    // QJL as its factory builds it for the preset's bits (sketch size, outliers, 2-bit values).
    let qjl = |bits| -> R<(QjlKeyCodec, GroupCodec)> {
        let geom = kvq_cache::CacheGeometry {
            n_heads: kvh,
            n_kv_heads: kvh,
            head_dim: d,
            sliding_window: None,
            max_tokens: 1 << 20,
        };
        Ok(CodecFactory::codecs(&QjlFactory::new(bits), 0, &geom)?)
    };
    let (qk4, qv4) = qjl(4)?;
    let (qk3, qv3) = qjl(3)?;
    Ok(vec![
        p(
            "turboquant-mse-4bit",
            Arc::new(mse(4)?),
            Arc::new(mse(4)?),
            64,
        ),
        p(
            "turboquant-mse-3bit",
            Arc::new(mse(3)?),
            Arc::new(mse(3)?),
            64,
        ),
        p(
            "turboquant-rvq-4bit",
            Arc::new(rvq(4)?),
            Arc::new(rvq(4)?),
            24,
        ),
        p(
            "turboquant-rvq-2bit",
            Arc::new(rvq(2)?),
            Arc::new(rvq(2)?),
            64,
        ),
        p(
            "turboquant-prod-4bit",
            Arc::new(ProdKeyCodec::new(d, kvh, 4, 0, s)?),
            Arc::new(mse(3)?),
            64,
        ),
        p(
            "turboquant-prod-3bit",
            Arc::new(ProdKeyCodec::new(d, kvh, 3, 0, s)?),
            Arc::new(mse(3)?),
            64,
        ),
        p("qjl-4bit", Arc::new(qk4), Arc::new(qv4), 48),
        p("qjl-3bit", Arc::new(qk3), Arc::new(qv3), 64),
        p("vecinfer-2bit", Arc::new(vk2), Arc::new(vv2), 64),
        p("vecinfer-1bit", Arc::new(vk1), Arc::new(vv1), 64),
    ])
}

/// Median microseconds per call of `f`, timed in batches of `per` launches behind a spin.
fn time_us(dev: &Device, per: usize, batches: usize, mut f: impl FnMut(usize) -> R<()>) -> R<f64> {
    let Device::Cuda(cd) = dev else {
        return Err("not a CUDA device".into());
    };
    let stream = cd.cuda_stream();
    let ctx = stream.context().clone();
    for i in 0..3 {
        f(i)?;
    }
    stream.synchronize()?;
    let mut samples = Vec::new();
    let mut i = 0;
    for _ in 0..batches {
        let (e0, e1) = (
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        );
        // ~1 ms at ~2 GHz: longer than enqueueing a batch.
        kvq_kernels::cuda::spin(cd, 2_000_000)?;
        e0.record(&stream)?;
        for _ in 0..per {
            f(i)?;
            i += 1;
        }
        e1.record(&stream)?;
        let ms = e0.elapsed_ms(&e1)? as f64;
        samples.push(ms * 1e3 / per as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

/// How many independent input sets of `bytes` each rotate past a 60 MB L2.
fn sets_for(bytes: usize) -> usize {
    (512usize << 20).div_ceil(bytes.max(1)).clamp(2, 48)
}

fn randn(dev: &Device, dims: &[usize]) -> R<Tensor> {
    Ok(Tensor::randn(0f32, 1f32, dims, dev)?)
}

struct Torch {
    rows: Vec<Value>,
    encode: Vec<Value>,
}

impl Torch {
    fn find(&self, shape: &str, batch: usize, positions: usize, key: &str) -> Value {
        self.rows
            .iter()
            .find(|r| r["shape"] == shape && r["batch"] == batch && r["positions"] == positions)
            .map_or(Value::Null, |r| r[key].clone())
    }
}

fn main() -> R<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let quick = args.iter().any(|a| a == "--quick");
    // `--only SHAPE:BATCH:POSITIONS:METHOD[,...]` (any part may be `*`, or end in `*` to match
    // a prefix): the configurations matching one of the patterns (one, for a profiler).
    let only = arg("--only");
    let wanted = |shape: &str, b: usize, n: usize, method: &str| {
        only.as_deref().is_none_or(|o| {
            o.split(',').any(|pat| {
                let f: Vec<&str> = pat.split(':').collect();
                // `*` matches anything, `prefix*` what starts with prefix.
                let ok = |i: usize, v: &str| {
                    f.get(i).is_none_or(|x| match x.strip_suffix('*') {
                        Some(pre) => v.starts_with(pre),
                        None => *x == v,
                    })
                };
                ok(0, shape) && ok(1, &b.to_string()) && ok(2, &n.to_string()) && ok(3, method)
            })
        })
    };
    let out = std::path::PathBuf::from(arg("--out").unwrap_or_else(|| "gpu-results".into()));
    std::fs::create_dir_all(&out)?;
    let torch = match arg("--torch") {
        Some(f) => {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(f)?)?;
            Torch {
                rows: v["attention"].as_array().cloned().unwrap_or_default(),
                encode: v["encode"].as_array().cloned().unwrap_or_default(),
            }
        }
        None => Torch {
            rows: vec![],
            encode: vec![],
        },
    };
    let dev = Device::new_cuda(0)?;
    let positions: &[usize] = if quick {
        &[4096, 32768]
    } else {
        &[4096, 16384, 32768, 131072]
    };
    let batches: &[usize] = if quick { &[1] } else { &[1, 8] };
    let mut rows = Vec::new();
    println!(
        "{:<11} {:>2} {:>7} {:<21} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7}",
        "shape", "B", "pos", "method", "us", "flash", "cudnn", "x best", "GB/s", "MiB"
    );
    for sh in &SHAPES {
        let presets = presets(sh.kvh, sh.d)?;
        for &b in batches {
            for &n in positions {
                let scale = 1.0 / (sh.d as f32).sqrt();
                let flash = torch.find(sh.name, b, n, "torch_flash_us");
                let cudnn = torch.find(sh.name, b, n, "torch_cudnn_us");
                let best = [flash.as_f64(), cudnn.as_f64()]
                    .into_iter()
                    .flatten()
                    .fold(f64::INFINITY, f64::min);
                let mut emit = |method: &str, us: f64, bytes: usize| {
                    let gbps = bytes as f64 / us / 1e3;
                    println!(
                        "{:<11} {:>2} {:>7} {:<21} {:>9.1} {:>9} {:>9} {:>8} {:>8.0} {:>7.1}",
                        sh.name,
                        b,
                        n,
                        method,
                        us,
                        flash.as_f64().map_or("-".into(), |x| format!("{x:.1}")),
                        cudnn.as_f64().map_or("-".into(), |x| format!("{x:.1}")),
                        if best.is_finite() {
                            format!("{:.2}", best / us)
                        } else {
                            "-".into()
                        },
                        gbps,
                        bytes as f64 / (1 << 20) as f64
                    );
                    rows.push(json!({
                        "shape": sh.name, "batch": b, "positions": n, "method": method,
                        "q_heads": sh.nh, "kv_heads": sh.kvh, "head_dim": sh.d,
                        "us": us, "torch_flash_us": flash, "torch_cudnn_us": cudnn,
                        "kv_bytes": bytes, "gbps": gbps,
                        "speedup_vs_best_torch": if best.is_finite() { json!(best / us) } else { Value::Null },
                    }));
                };
                // fp16: the whole context in fp16 rows.
                if wanted(sh.name, b, n, "fp16") {
                    let fp16_bytes = b * sh.kvh * n * sh.d * 4;
                    let sets = sets_for(fp16_bytes);
                    let inputs: Vec<(Tensor, Tensor, Tensor)> = (0..sets)
                        .map(|_| -> R<_> {
                            Ok((
                                randn(&dev, &[b, sh.nh, 1, sh.d])?,
                                randn(&dev, &[b, sh.kvh, n, sh.d])?.to_dtype(DType::F16)?,
                                randn(&dev, &[b, sh.kvh, n, sh.d])?.to_dtype(DType::F16)?,
                            ))
                        })
                        .collect::<R<_>>()?;
                    let p = AttendParams {
                        scale,
                        first_pos: n,
                        window: 1,
                        sinks: 0,
                        sliding_window: None,
                        code_first: 0,
                        exact_before: 0,
                    };
                    let us = time_us(&dev, 20, if quick { 5 } else { 15 }, |i| {
                        let (q, k, v) = &inputs[i % sets];
                        dense_decode_attend(p, q, k, v, true)?;
                        Ok(())
                    })?;
                    emit("fp16", us, fp16_bytes);
                    drop(inputs);
                }
                for pr in presets.iter().filter(|p| wanted(sh.name, b, n, p.name)) {
                    let exact = pr.window + pr.sinks;
                    let nc = n - exact;
                    let (kcb, vcb) = (pr.keys.code_bytes(), pr.values.code_bytes());
                    let bytes = b * sh.kvh * (nc * (kcb + vcb) + exact * sh.d * 4);
                    let sets = sets_for(bytes);
                    let mut inputs = Vec::new();
                    for _ in 0..sets {
                        let mut ks = Vec::new();
                        let mut vs = Vec::new();
                        for _ in 0..b {
                            ks.push(encode_keys(&pr.keys, &randn(&dev, &[sh.kvh, nc, sh.d])?)?);
                            vs.push(encode_values(
                                &pr.values,
                                &randn(&dev, &[sh.kvh, nc, sh.d])?,
                            )?);
                        }
                        inputs.push((
                            randn(&dev, &[b, sh.nh, 1, sh.d])?,
                            Tensor::stack(&ks, 0)?,
                            Tensor::stack(&vs, 0)?,
                            randn(&dev, &[b, sh.kvh, exact, sh.d])?.to_dtype(DType::F16)?,
                            randn(&dev, &[b, sh.kvh, exact, sh.d])?.to_dtype(DType::F16)?,
                        ));
                    }
                    // Codes hold positions sinks..n - window; the query at n - 1.
                    let p = AttendParams {
                        scale,
                        first_pos: n - 1,
                        window: pr.window,
                        sinks: pr.sinks,
                        sliding_window: None,
                        code_first: pr.sinks,
                        exact_before: 0,
                    };
                    let us = time_us(&dev, 20, if quick { 5 } else { 15 }, |i| {
                        let (q, kc, vc, xk, xv) = &inputs[i % sets];
                        decode_attend(&*pr.keys, &*pr.values, p, q, kc, vc, Some((xk, xv)), true)?;
                        Ok(())
                    })?;
                    emit(pr.name, us, bytes);
                }
            }
        }
    }
    std::fs::write(
        out.join("gpu-attention.json"),
        serde_json::to_string_pretty(&rows)?,
    )?;
    if only.is_some() {
        return Ok(());
    }

    // Nearest centroid at the seed's shapes: N = 2^20 sub-vectors, 256 centroids.
    let mut enc = Vec::new();
    println!(
        "\n{:<24} {:>8} {:>10} {:>14} {:>14} {:>10}",
        "encode", "sub", "us", "torch mat. us", "torch mm us", "MiB held"
    );
    for sub in [4usize, 8] {
        let n = 1usize << 20;
        let x = randn(&dev, &[n, sub])?;
        let c = randn(&dev, &[256, sub])?;
        let us = time_us(&dev, 10, 10, |_| {
            kvq_kernels::nearest_centroid(&x, &c)?;
            Ok(())
        })?;
        let t = |variant: &str| {
            torch
                .encode
                .iter()
                .find(|r| r["variant"] == variant && r["sub_dim"] == sub)
                .map_or(Value::Null, |r| r["us"].clone())
        };
        // What the op holds: its input, the codebook and the u32 indices (O(N)).
        let held = n * sub * 4 + 256 * sub * 4 + n * 4;
        println!(
            "{:<24} {:>8} {:>10.1} {:>14} {:>14} {:>10.1}",
            "nearest_centroid",
            sub,
            us,
            t("materializing"),
            t("matmul"),
            held as f64 / (1 << 20) as f64
        );
        enc.push(json!({"kernel": "nearest_centroid", "n": n, "centroids": 256, "sub_dim": sub, "us": us,
            "bytes_held": held, "torch_materializing_us": t("materializing"), "torch_matmul_us": t("matmul")}));
    }
    // Encode of one prefill chunk (4096 tokens x kv heads) per preset, Llama-3-8B shape.
    let sh = &SHAPES[0];
    for pr in presets(sh.kvh, sh.d)? {
        let x = randn(&dev, &[sh.kvh, 4096, sh.d])?;
        let kus = time_us(&dev, 10, 5, |_| {
            encode_keys(&pr.keys, &x)?;
            Ok(())
        })?;
        let vus = time_us(&dev, 10, 5, |_| {
            encode_values(&pr.values, &x)?;
            Ok(())
        })?;
        println!(
            "{:<24} {:>8} {:>10.1} {:>14.1} (keys / values, 8 x 4096 rows)",
            pr.name, "", kus, vus
        );
        enc.push(json!({"kernel": "encode", "method": pr.name, "rows": sh.kvh * 4096, "head_dim": sh.d, "keys_us": kus, "values_us": vus}));
    }
    std::fs::write(
        out.join("gpu-encode.json"),
        serde_json::to_string_pretty(&enc)?,
    )?;
    Ok(())
}
