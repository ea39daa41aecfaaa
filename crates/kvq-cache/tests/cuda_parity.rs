//! Parity of every CUDA kernel with its CPU definition, on fresh random inputs of several shapes
//! (head_dim 64 / 128 / 256; 1, 7, 4096 and 32768 positions; GQA groups 1, 3, 4, 7 and 8): the
//! fused attention against the CPU op on the same codes (relative L2 of the normalized output
//! and the log-sum-exp), encode by the reconstruction error of its codes against the CPU
//! encoder's, the nearest-centroid search by the distance of the centroid it picks. Outputs are
//! poisoned (`KVQ_CUDA_POISON`: NaN for f32) and every launch is synchronized and checked
//! (`KVQ_CUDA_SYNC`). Needs the `cuda` feature and a GPU; `scripts/gpu-suite` runs it and the
//! sanitizer passes (`small_` tests) on the GPU machine.
#![cfg(feature = "cuda")]

mod cuda_parity_support;

use cuda_parity_support::*;

use candle_core::{DType, Device, Tensor};
use kvq_kernels::cuda::ops::{decode_attend, dense_decode_attend};
use kvq_kernels::{
    AttendParams, Partial, compressed_attend, encode_keys, encode_values, merge_partial,
};

/// A CPU decoder of one code row: (kv head, code, output).
type Decode<'a> = &'a dyn Fn(usize, &[u8], &mut [f32]);

fn cuda() -> Device {
    // SAFETY: the variables are set before any CUDA work, and read once by the launchers.
    unsafe {
        std::env::set_var("KVQ_CUDA_POISON", "ff");
        std::env::set_var("KVQ_CUDA_SYNC", "1");
    }
    Device::new_cuda(0).expect("a CUDA device")
}

/// One attention parity check: codes of `n` random keys and values encoded on the CPU, queries
/// for `t` rows, the CUDA op against the CPU op. Returns (relative L2, max relative lse diff).
fn attend_check(
    c: &Case,
    d: usize,
    group: usize,
    n: usize,
    t: usize,
    p: AttendParams,
) -> (f64, f64) {
    let dev = cuda();
    let nh = KVH * group;
    let k = host(&gauss(KVH * n * d, seed()), &[KVH, n, d]);
    let v = host(&gauss(KVH * n * d, seed()), &[KVH, n, d]);
    let q = host(&gauss(nh * t * d, seed()), &[nh, t, d]);
    let kc = encode_keys(&c.keys, &k).unwrap();
    let vc = encode_values(&c.values, &v).unwrap();
    let cpu = compressed_attend(&c.keys, &c.values, p, &q, &kc, &vc).unwrap();
    let (qg, kg, vg) = (
        q.to_device(&dev).unwrap(),
        kc.to_device(&dev).unwrap(),
        vc.to_device(&dev).unwrap(),
    );
    let gpu = compressed_attend(&c.keys, &c.values, p, &qg, &kg, &vg).unwrap();
    assert_eq!(gpu.dims(), cpu.dims());
    let flat = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (oc, lc) = normalized(&flat(&cpu), d);
    let (og, lg) = normalized(&flat(&gpu.to_device(&Device::Cpu).unwrap()), d);
    // The log-sum-exp's error relative to its size (at least 1): the GPU scores from f16
    // operands (VecInfer's codebooks, the levels' tables), whose rounding moves a logit in
    // proportion to it; one position of vecinfer-2 at d 64 gave 1.1e-3 absolute in one run.
    let lse = lc
        .iter()
        .zip(&lg)
        .map(|(a, b)| {
            if a == b {
                0.0
            } else {
                ((a - b).abs() / a.abs().max(1.0)) as f64
            }
        })
        .fold(0.0, f64::max);
    (rel_l2(&og, &oc), lse)
}

/// Every method, every head dim and group, decode (t = 1) at 1, 7, 4096 and 32768 positions
/// (32768 on one group per head dim) and a 7-row prefill.
#[test]
fn attend_matches_the_cpu_op() {
    let shapes: &[(usize, usize, &[usize])] = &[
        (64, 1, &[1, 7, 4096, 32768]),
        (64, 3, &[7, 4096]),
        (128, 4, &[1, 7, 4096, 32768]),
        (128, 1, &[4096]),
        (128, 3, &[4096]),
        (256, 3, &[1, 7, 4096, 32768]),
        (256, 4, &[4096]),
        // Groups past 4: blocks of 7 and 8 heads (QJL's s8 scores take two tiles of 4 heads).
        (64, 7, &[4096]),
        (128, 8, &[7, 4096]),
    ];
    let mut rows = Vec::new();
    for &(d, group, ns) in shapes {
        for c in cases(d) {
            for &n in ns {
                let (e, l) = attend_check(&c, d, group, n, 1, decode_params(n, d));
                rows.push((format!("{} d{d} g{group} n{n}", c.name), e, l));
            }
            // Prefill: 7 query rows, each over its own causal range.
            let mut p = decode_params(4096, d);
            p.first_pos = 4096 - 6;
            let (e, l) = attend_check(&c, d, group, 4096, 7, p);
            rows.push((format!("{} d{d} g{group} prefill t7", c.name), e, l));
        }
    }
    report(&rows, 1e-3);
}

/// Sinks, a sliding window over rolled codes (`code_first > 0`), the fp16 window and queries
/// before the center is fixed (every key read from fp16: an empty compressed range).
#[test]
fn attend_ranges_match_the_cpu_op() {
    let mut rows = Vec::new();
    for d in [64, 128] {
        for c in cases(d) {
            let pos = 5000;
            let p = AttendParams {
                scale: 0.125,
                first_pos: pos,
                window: 64,
                sinks: 4,
                sliding_window: Some(2048),
                code_first: pos + 1 - 2048,
                exact_before: 16,
            };
            let (e, l) = attend_check(&c, d, 3, 2048, 1, p);
            rows.push((format!("{} d{d} rolled sliding", c.name), e, l));
            let p = AttendParams {
                exact_before: usize::MAX,
                ..decode_params(100, d)
            };
            let (e, l) = attend_check(&c, d, 3, 100, 2, p);
            rows.push((format!("{} d{d} exact (empty)", c.name), e, l));
        }
    }
    report(&rows, 1e-3);
}

/// The batched entry point with exact fp16 rows merged in (the decode path of a cache: codes,
/// then sinks and window), against the CPU op merged with the same rows on the host.
#[test]
fn attend_merges_exact_rows() {
    let dev = cuda();
    let mut rows = Vec::new();
    for (d, group, n, nx) in [(128, 4, 4096, 68), (64, 3, 1000, 24), (256, 3, 2048, 64)] {
        let c = &cases(d)[2];
        let nh = KVH * group;
        let p = decode_params(n, d);
        let k = host(&gauss(KVH * n * d, seed()), &[KVH, n, d]);
        let v = host(&gauss(KVH * n * d, seed()), &[KVH, n, d]);
        let q = gauss(nh * d, seed());
        let xk: Vec<f32> = gauss(KVH * nx * d, seed());
        let xv: Vec<f32> = gauss(KVH * nx * d, seed());
        let kc = encode_keys(&c.keys, &k).unwrap();
        let vc = encode_values(&c.values, &v).unwrap();
        let part =
            compressed_attend(&c.keys, &c.values, p, &host(&q, &[nh, 1, d]), &kc, &vc).unwrap();
        let part = part.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let r16 = |x: f32| half::f16::from_f32(x).to_f32();
        let mut want = vec![0f32; nh * d];
        for h in 0..nh {
            let kh = h / group;
            let qr = &q[h * d..(h + 1) * d];
            let scores: Vec<f32> = (0..nx)
                .map(|j| {
                    let kr = &xk[(kh * nx + j) * d..(kh * nx + j + 1) * d];
                    qr.iter().zip(kr).map(|(a, b)| a * r16(*b)).sum::<f32>() * p.scale
                })
                .collect();
            let value = |j: usize, buf: &mut [f32]| {
                for (o, x) in buf
                    .iter_mut()
                    .zip(&xv[(kh * nx + j) * d..(kh * nx + j + 1) * d])
                {
                    *o = r16(*x);
                }
            };
            let pr = Partial::from_row(&part[h * (d + 2)..(h + 1) * (d + 2)]);
            merge_partial(pr, &scores, value, &mut want[h * d..(h + 1) * d]);
        }
        let to = |x: &[f32], dims: &[usize], dt: DType| {
            host(x, dims).to_dtype(dt).unwrap().to_device(&dev).unwrap()
        };
        let got = decode_attend(
            &*c.keys,
            &*c.values,
            p,
            &to(&q, &[1, nh, 1, d], DType::F32),
            &kc.unsqueeze(0).unwrap().to_device(&dev).unwrap(),
            &vc.unsqueeze(0).unwrap().to_device(&dev).unwrap(),
            Some((
                &to(&xk, &[1, KVH, nx, d], DType::F16),
                &to(&xv, &[1, KVH, nx, d], DType::F16),
            )),
            true,
        )
        .unwrap();
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let got: Vec<f32> = got
            .chunks_exact(d + 2)
            .flat_map(|r| r[..d].to_vec())
            .collect();
        rows.push((
            format!("mse-4 + {nx} fp16 rows d{d} g{group} n{n}"),
            rel_l2(&got, &want),
            0.0,
        ));
    }
    report(&rows, 1e-3);
}

/// The fp16 cache's fused decode attention against exact f64 attention on the same fp16 rows,
/// batch 1 and 3.
#[test]
fn dense_attend_matches_exact_attention() {
    let dev = cuda();
    let mut rows = Vec::new();
    for (d, group, n, b) in [
        (64, 3, 7, 1),
        (128, 4, 4096, 3),
        (128, 4, 32768, 1),
        (256, 3, 4096, 1),
        (128, 1, 1, 2),
    ] {
        let nh = KVH * group;
        let r16 = |v: Vec<f32>| -> Vec<f32> {
            v.iter().map(|x| half::f16::from_f32(*x).to_f32()).collect()
        };
        let k = r16(gauss(b * KVH * n * d, seed()));
        let v = r16(gauss(b * KVH * n * d, seed()));
        let q = gauss(b * nh * d, seed());
        let p = decode_params(n, d);
        let to16 = |x: &[f32]| {
            host(x, &[b, KVH, n, d])
                .to_dtype(DType::F16)
                .unwrap()
                .to_device(&dev)
                .unwrap()
        };
        let got = dense_decode_attend(
            p,
            &host(&q, &[b, nh, 1, d]).to_device(&dev).unwrap(),
            &to16(&k),
            &to16(&v),
            true,
        )
        .unwrap();
        let got: Vec<f32> = got
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .chunks_exact(d + 2)
            .flat_map(|r| r[..d].to_vec())
            .collect();
        let mut want = vec![0f32; b * nh * d];
        for bi in 0..b {
            for h in 0..nh {
                let kh = h / group;
                let qr = &q[(bi * nh + h) * d..(bi * nh + h + 1) * d];
                let base = (bi * KVH + kh) * n;
                let s: Vec<f64> = (0..n)
                    .map(|j| {
                        qr.iter()
                            .zip(&k[(base + j) * d..(base + j + 1) * d])
                            .map(|(a, b)| (*a as f64) * (*b as f64))
                            .sum::<f64>()
                            * p.scale as f64
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let tot: f64 = w.iter().sum();
                for c in 0..d {
                    let o: f64 = (0..n).map(|j| w[j] * v[(base + j) * d + c] as f64).sum();
                    want[(bi * nh + h) * d + c] = (o / tot) as f32;
                }
            }
        }
        rows.push((
            format!("fp16 d{d} g{group} n{n} b{b}"),
            rel_l2(&got, &want),
            0.0,
        ));
    }
    report(&rows, 1e-3);
}

/// Reconstruction error (CPU decode of the codes) of the CUDA encoder's codes within 1% of the
/// CPU encoder's, for keys and values of every method; two runs under different poison bytes
/// give the same bytes (every byte written).
#[test]
fn encode_matches_the_cpu_codec() {
    let dev = cuda();
    let mut table = Vec::new();
    for d in [64, 128, 256] {
        for c in cases(d) {
            let rows = 2048;
            let x = host(&gauss(KVH * rows * d, seed()), &[KVH, rows, d]);
            let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let mse = |codes: &Tensor, cb: usize, dec: Decode<'_>| {
                let bytes = codes.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                let mut out = vec![0f32; d];
                let (mut num, mut den) = (0f64, 0f64);
                for (i, row) in bytes.chunks_exact(cb).enumerate() {
                    dec(i / rows, row, &mut out);
                    for (a, b) in out.iter().zip(&xs[i * d..(i + 1) * d]) {
                        num += ((a - b) as f64).powi(2);
                        den += (*b as f64).powi(2);
                    }
                }
                num / den
            };
            let xg = x.to_device(&dev).unwrap();
            for kind in ["keys", "values"] {
                let run = |poison: &str| {
                    // SAFETY: set between launches on this thread; read once per launch.
                    unsafe { std::env::set_var("KVQ_CUDA_POISON", poison) };
                    let t = match kind {
                        "keys" => encode_keys(&c.keys, &xg).unwrap(),
                        _ => encode_values(&c.values, &xg).unwrap(),
                    };
                    t.to_device(&Device::Cpu).unwrap()
                };
                let (g1, g2) = (run("00"), run("ff"));
                // SAFETY: as above.
                unsafe { std::env::set_var("KVQ_CUDA_POISON", "ff") };
                let same = g1.flatten_all().unwrap().to_vec1::<u8>().unwrap()
                    == g2.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                assert!(
                    same,
                    "{} {kind} d{d}: bytes depend on the poison (unwritten)",
                    c.name
                );
                let (cpu, cb, e_gpu, e_cpu) = match kind {
                    "keys" => {
                        let cpu = encode_keys(&c.keys, &x).unwrap();
                        let cb = c.keys.code_bytes();
                        let dec = |h: usize, r: &[u8], o: &mut [f32]| c.keys.decode(h, r, o);
                        (cpu.clone(), cb, mse(&g1, cb, &dec), mse(&cpu, cb, &dec))
                    }
                    _ => {
                        let cpu = encode_values(&c.values, &x).unwrap();
                        let cb = c.values.code_bytes();
                        let dec = |h: usize, r: &[u8], o: &mut [f32]| c.values.decode(h, r, o);
                        (cpu.clone(), cb, mse(&g1, cb, &dec), mse(&cpu, cb, &dec))
                    }
                };
                let a = g1.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                let b = cpu.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                if c.name.starts_with("turboquant-mse-4") && kind == "keys" {
                    // Where the codes differ: per byte position of a row, how many rows differ.
                    let mut diff = vec![0usize; cb];
                    for (x, y) in a.chunks_exact(cb).zip(b.chunks_exact(cb)) {
                        for (i, (p, q)) in x.iter().zip(y).enumerate() {
                            diff[i] += usize::from(p != q);
                        }
                    }
                    eprintln!("{} d{d}: rows differing per byte position {diff:?}", c.name);
                    eprintln!("first row gpu {:?}\nfirst row cpu {:?}", &a[..cb], &b[..cb]);
                }
                let rows_same = a
                    .chunks_exact(cb)
                    .zip(b.chunks_exact(cb))
                    .filter(|(x, y)| x == y)
                    .count();
                table.push((
                    format!("{} {kind} d{d}", c.name),
                    e_gpu,
                    e_cpu,
                    rows_same as f64 / (KVH * rows) as f64,
                ));
            }
        }
    }
    eprintln!(
        "{:<36} {:>12} {:>12} {:>10}",
        "encoder", "err cuda", "err cpu", "rows same"
    );
    for (n, g, c, s) in &table {
        eprintln!("{n:<36} {g:>12.4e} {c:>12.4e} {s:>10.4}");
    }
    let bad: Vec<_> = table
        .iter()
        .filter(|(_, g, c, _)| (g - c).abs() > 0.01 * c || g.is_nan())
        .collect();
    assert!(
        bad.is_empty(),
        "reconstruction error off by more than 1%: {bad:?}"
    );
}

/// The fused nearest-centroid search picks a centroid as near as the CPU's (its distance within
/// 1e-5 relative) for every sub-vector, at sub_dim 4 and 8.
#[test]
fn nearest_matches_the_cpu_search() {
    let dev = cuda();
    for sub in [4, 8] {
        let n = 1 << 16;
        let x = host(&gauss(n * sub, seed()), &[n, sub]);
        let c = host(&gauss(256 * sub, seed()), &[256, sub]);
        let cpu = kvq_kernels::nearest_centroid(&x, &c)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap();
        let gpu =
            kvq_kernels::nearest_centroid(&x.to_device(&dev).unwrap(), &c.to_device(&dev).unwrap())
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap()
                .to_vec1::<u32>()
                .unwrap();
        let (xs, cs) = (
            x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            c.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        let dist = |i: usize, k: u32| -> f64 {
            (0..sub)
                .map(|j| ((xs[i * sub + j] - cs[k as usize * sub + j]) as f64).powi(2))
                .sum()
        };
        let worse = (0..n)
            .filter(|&i| gpu[i] >= 256 || dist(i, gpu[i]) > dist(i, cpu[i]) * (1.0 + 1e-5) + 1e-9)
            .count();
        let same = (0..n).filter(|&i| gpu[i] == cpu[i]).count();
        eprintln!("nearest s{sub}: {same}/{n} same index, {worse} farther");
        assert_eq!(worse, 0, "sub {sub}");
    }
}

/// A small shape of every kernel, for compute-sanitizer (memcheck, racecheck) on the GPU
/// machine: `cuda_parity small_`.
#[test]
fn small_every_kernel() {
    let mut rows = Vec::new();
    for c in cases(64) {
        for group in [3, 8] {
            let (e, l) = attend_check(&c, 64, group, 300, 1, decode_params(300, 64));
            rows.push((format!("{} small g{group}", c.name), e, l));
        }
        let x = host(&gauss(KVH * 5 * 64, seed()), &[KVH, 5, 64])
            .to_device(&cuda())
            .unwrap();
        encode_keys(&c.keys, &x).unwrap();
        encode_values(&c.values, &x).unwrap();
    }
    report(&rows, 1e-3);
}
