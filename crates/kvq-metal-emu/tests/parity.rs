//! Every emulated Metal kernel against its CPU definition, under every lane order, on fresh
//! random inputs of several shapes, outputs poisoned; and the negative controls: the seed's
//! mistakes, each made in a copy of a kernel (build.rs) or in its dispatch, must be caught.

use kvq_cache::codec::rng::SplitMix;
use kvq_cache::compressed::{KeyCodec, ValueCodec};
use kvq_cache::methods::turboquant_mse::MseCodec;
use kvq_cache::methods::turboquant_rvq::RvqCodec;
use kvq_kernels::bitpack;
use kvq_kernels::metal::dispatch::{self, Dispatch};
use kvq_kernels::metal::params::{AsBytes, PackParams, ScalarEncodeParams};
use kvq_kernels::spec::KeySpec;
use kvq_metal_emu::{ORDERS, Order, f32_bytes, run, seed_grid};

const POISON: u8 = 0xee;

fn random_codes(n: usize, bits: u32, seed: u64) -> Vec<u8> {
    let mut r = SplitMix::new(seed);
    (0..n)
        .map(|_| (r.next_u64() & ((1u64 << bits) - 1)) as u8)
        .collect()
}

/// Packs `codes` on the emulator with dispatch `d`.
fn emu_pack(codes: &[u8], bits: u32, d: Dispatch, order: Order) -> Vec<u8> {
    let mut out = vec![POISON; bitpack::packed_len(codes.len(), bits)];
    let mut input = codes.to_vec();
    let mut p = PackParams {
        n: codes.len() as u32,
        bits,
    }
    .as_bytes();
    run(
        "kvq_pack_bits",
        d,
        order,
        &mut [&mut input, &mut out, &mut p],
    )
    .expect("pack");
    out
}

fn emu_unpack(packed: &[u8], n: usize, bits: u32, d: Dispatch, order: Order) -> Vec<u8> {
    let mut out = vec![POISON; n];
    let mut input = packed.to_vec();
    let mut p = PackParams { n: n as u32, bits }.as_bytes();
    run(
        "kvq_unpack_bits",
        d,
        order,
        &mut [&mut input, &mut out, &mut p],
    )
    .expect("unpack");
    out
}

#[test]
fn bit_pack_and_unpack_equal_the_cpu() {
    let mut seed = 1;
    for bits in 1..=8 {
        for n in [1, 7, 8, 9, 100, 2049, 4100] {
            seed += 1;
            let codes = random_codes(n, bits, seed);
            let mut want = vec![0u8; bitpack::packed_len(n, bits)];
            bitpack::pack(&codes, bits, &mut want);
            for order in ORDERS {
                let got = emu_pack(&codes, bits, dispatch::pack_bits(n), order);
                assert_eq!(got, want, "pack bits {bits} n {n} {order:?}");
                let back = emu_unpack(&want, n, bits, dispatch::pack_bits(n), order);
                assert_eq!(back, codes, "unpack bits {bits} n {n} {order:?}");
            }
        }
    }
}

#[test]
fn bit_pack_with_the_seeds_grid_is_caught() {
    // 4100 codes: 513 threads in 3 threadgroups of 256; the seed's grid runs 1 group.
    let (n, bits) = (4100, 3);
    let codes = random_codes(n, bits, 99);
    let mut want = vec![0u8; bitpack::packed_len(n, bits)];
    bitpack::pack(&codes, bits, &mut want);
    let wrong = seed_grid(dispatch::pack_bits(n));
    assert!(wrong.total_threads() < dispatch::pack_bits(n).total_threads());
    let got = emu_pack(&codes, bits, wrong, Order::Forward);
    assert_ne!(got, want, "the seed's grid must leave bytes unwritten");
    assert!(got.contains(&POISON));
}

/// A scalar codec (MSE, or RVQ's combined codebook) and its kernel parameters.
struct Scalar {
    name: String,
    codec: Box<dyn ValueCodec>,
    spec: kvq_kernels::spec::ScalarSpec,
}

fn scalar_codecs(d: usize, heads: usize) -> Vec<Scalar> {
    let mut v = Vec::new();
    let spec_of = |k: &dyn KeyCodec| match k.kernel_data().map(|k| &k.spec) {
        Some(KeySpec::Scalar(s)) => s.clone(),
        other => panic!("not a scalar spec: {other:?}"),
    };
    for bits in [1, 2, 3, 4] {
        let c = MseCodec::new(d, heads, bits, 3, 11).expect("mse");
        let spec = spec_of(&c);
        v.push(Scalar {
            name: format!("mse-{bits}"),
            codec: Box::new(c),
            spec,
        });
    }
    for bits in [2, 4] {
        let c = RvqCodec::new(d, heads, bits, 3, 11).expect("rvq");
        let spec = spec_of(&c);
        v.push(Scalar {
            name: format!("rvq-{bits}"),
            codec: Box::new(c),
            spec,
        });
    }
    v
}

/// Mean squared reconstruction error of code rows (decoded by the CPU codec) against `x`.
fn recon_mse(c: &dyn ValueCodec, codes: &[u8], x: &[f32], t: usize, d: usize) -> f64 {
    let cb = c.code_bytes();
    let mut total = 0f64;
    for (i, code) in codes.chunks_exact(cb).enumerate() {
        let mut acc = vec![0f32; c.acc_len()];
        c.accumulate(i / t, &[1.0], code, &mut acc);
        let mut rec = vec![0f32; d];
        c.finish(i / t, &acc, &mut rec);
        total += x[i * d..(i + 1) * d]
            .iter()
            .zip(&rec)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>();
    }
    total / x.len() as f64
}

/// Encodes `rows` random rows (`t` per head) with `kernel` and compares with the CPU codec:
/// every byte written, each norm within one f16 step, the reconstruction error within 1%.
fn encode_check(
    kernel: &str,
    s: &Scalar,
    d: usize,
    t: usize,
    d_of: &dyn Fn(usize, usize) -> Dispatch,
    order: Order,
    seed: u64,
) -> Result<(), String> {
    let heads = 2;
    let rows = heads * t;
    let cb = s.codec.code_bytes();
    let x = SplitMix::new(seed).gauss_vec(rows * d);
    let mut want = vec![0u8; rows * cb];
    for (i, o) in want.chunks_exact_mut(cb).enumerate() {
        s.codec.encode(i / t, &x[i * d..(i + 1) * d], o);
    }
    let p = ScalarEncodeParams {
        rows: rows as u32,
        t: t as u32,
        d: d as u32,
        bits: s.spec.bits,
        cb: cb as u32,
        sigma: s.spec.sigma,
    };
    let mut got = vec![POISON; rows * cb];
    let (mut xb, mut signs, mut th, mut code_of, mut pb) = (
        f32_bytes(&x),
        f32_bytes(&s.spec.signs),
        f32_bytes(&s.spec.thresholds),
        s.spec.code_of.clone(),
        p.as_bytes(),
    );
    run(
        kernel,
        d_of(rows, d),
        order,
        &mut [
            &mut xb,
            &mut signs,
            &mut th,
            &mut code_of,
            &mut got,
            &mut pb,
        ],
    )
    .map_err(|e| e.to_string())?;
    for (i, (g, w)) in got.chunks_exact(cb).zip(want.chunks_exact(cb)).enumerate() {
        let norm = |c: &[u8]| half::f16::from_le_bytes([c[0], c[1]]);
        let (ng, nw) = (norm(g), norm(w));
        if (ng.to_bits() as i32 - nw.to_bits() as i32).abs() > 1 {
            return Err(format!("row {i}: norm {ng} against {nw}"));
        }
    }
    let (eg, ew) = (
        recon_mse(s.codec.as_ref(), &got, &x, t, d),
        recon_mse(s.codec.as_ref(), &want, &x, t, d),
    );
    if !(eg.is_finite() && (eg - ew).abs() <= 0.01 * ew) {
        return Err(format!(
            "reconstruction error {eg:.4e} against the CPU codec's {ew:.4e}"
        ));
    }
    Ok(())
}

#[test]
fn scalar_encode_equals_the_cpu_codec() {
    let mut seed = 100;
    for d in [64, 128, 256] {
        for s in scalar_codecs(d, 2) {
            for t in [1, 5] {
                for order in ORDERS {
                    seed += 1;
                    encode_check(
                        "kvq_encode_scalar",
                        &s,
                        d,
                        t,
                        &dispatch::encode_scalar,
                        order,
                        seed,
                    )
                    .unwrap_or_else(|e| panic!("{} d {d} t {t} {order:?}: {e}", s.name));
                }
            }
        }
    }
}

/// A negative control must fail the check under every lane order.
fn assert_caught(kernel: &str, d_of: &dyn Fn(usize, usize) -> Dispatch) {
    for d in [64, 256] {
        let s = &scalar_codecs(d, 2)[3];
        for order in ORDERS {
            let r = encode_check(kernel, s, d, 5, d_of, order, 7);
            assert!(
                r.is_err(),
                "{kernel} d {d} {order:?} passed the parity check"
            );
        }
    }
}

#[test]
fn the_seeds_xor_butterfly_is_caught() {
    assert_caught("xor_butterfly/kvq_encode_scalar", &dispatch::encode_scalar);
}

#[test]
fn a_removed_barrier_is_caught() {
    assert_caught("no_barrier/kvq_encode_scalar", &dispatch::encode_scalar);
}

#[test]
fn scalar_encode_with_the_seeds_grid_is_caught() {
    assert_caught("kvq_encode_scalar", &|rows, d| {
        seed_grid(dispatch::encode_scalar(rows, d))
    });
}

/// The emulated nearest-centroid search picks a centroid as near as the CPU's (ties may pick
/// another index) for every sub-vector, at sub_dim 4 and 8 and 16 to 256 centroids.
#[test]
fn nearest_centroid_equals_the_cpu_search() {
    use kvq_kernels::NearestCodebook;
    use kvq_kernels::metal::params::NearestParams;
    let mut seed = 500;
    for sub in [4, 8] {
        for (centroids, n) in [(16, 1), (256, 300), (256, 1000), (100, 257)] {
            seed += 1;
            let book = SplitMix::new(seed).gauss_vec(centroids * sub);
            let x = SplitMix::new(seed + 1000).gauss_vec(n * sub);
            let search = NearestCodebook::new(&book, sub).expect("codebook");
            let dist = |i: usize, c: usize| -> f32 {
                (0..sub)
                    .map(|k| (x[i * sub + k] - book[c * sub + k]).powi(2))
                    .sum()
            };
            for order in ORDERS {
                let mut out = vec![POISON; n * 4];
                let (mut xb, mut bb) = (f32_bytes(&x), f32_bytes(&book));
                let mut p = NearestParams {
                    n: n as u32,
                    centroids: centroids as u32,
                    sub: sub as u32,
                }
                .as_bytes();
                run(
                    "kvq_nearest",
                    dispatch::nearest(n),
                    order,
                    &mut [&mut xb, &mut bb, &mut out, &mut p],
                )
                .expect("nearest");
                for (i, got) in out.chunks_exact(4).enumerate() {
                    let got = u32::from_le_bytes([got[0], got[1], got[2], got[3]]) as usize;
                    assert!(
                        got < centroids,
                        "sub {sub} n {n} {order:?}: row {i} index {got}"
                    );
                    let (want, wd) = search.nearest(&x[i * sub..(i + 1) * sub]);
                    let gd = dist(i, got);
                    assert!(
                        (gd - wd).abs() <= 1e-5 * wd.max(1e-6),
                        "sub {sub} n {n} {order:?}: row {i} picks {got} at {gd}, the CPU {want} at {wd}"
                    );
                }
            }
        }
    }
}
