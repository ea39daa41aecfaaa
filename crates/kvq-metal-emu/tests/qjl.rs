//! The emulated QJL key encode (kernels/metal/qjl/encode.metal) against the CPU codec under
//! every lane order, and its negative control: a sign packed from the wrong lane is caught.

use kvq_cache::codec::rng::SplitMix;
use kvq_cache::compressed::KeyCodec;
use kvq_cache::methods::qjl::QjlKeyCodec;
use kvq_kernels::metal::dispatch::{self, Dispatch};
use kvq_kernels::metal::params::{AsBytes, QjlKeyEncodeParams};
use kvq_kernels::spec::KeySpec;
use kvq_metal_emu::{ORDERS, Order, f32_bytes, run, seed_grid};

const POISON: u8 = 0xee;

/// Encodes `t` random rows per head (2 heads) with `kernel` and compares with the CPU codec:
/// norms within one f16 step, the same outliers (as a set: the CPU's order among them is
/// unspecified), at most 0.1% of the sign bits different (projections within rounding of zero)
/// and the decoded keys within 1% relative L2.
fn check(
    kernel: &str,
    codec: &QjlKeyCodec,
    t: usize,
    d_of: &dyn Fn(usize, usize) -> Dispatch,
    order: Order,
    seed: u64,
) -> Result<(), String> {
    let (heads, d) = (2, codec.head_dim());
    let rows = heads * t;
    let cb = codec.code_bytes();
    let Some(KeySpec::Sketch { sketch, outliers }) = codec.kernel_data().map(|k| &k.spec) else {
        return Err("not a sketch spec".into());
    };
    let (m, outliers) = (sketch.m, *outliers);
    // Heavy-tailed channels, so the outliers matter.
    let mut x = SplitMix::new(seed).gauss_vec(rows * d);
    for (i, v) in x.iter_mut().enumerate() {
        if i % 17 == 3 {
            *v *= 8.0;
        }
    }
    let mut want = vec![0u8; rows * cb];
    for (i, o) in want.chunks_exact_mut(cb).enumerate() {
        codec.encode(i / t, &x[i * d..(i + 1) * d], o);
    }
    let p = QjlKeyEncodeParams {
        rows: rows as u32,
        t: t as u32,
        d: d as u32,
        m: m as u32,
        outliers: outliers as u32,
        cb: cb as u32,
    };
    let mut got = vec![POISON; rows * cb];
    let (mut xb, mut mats, mut pb) = (f32_bytes(&x), f32_bytes(&sketch.matrices), p.as_bytes());
    run(
        kernel,
        d_of(rows, d),
        order,
        &mut [&mut xb, &mut mats, &mut got, &mut pb],
    )
    .map_err(|e| e.to_string())?;
    let (mut flips, mut num, mut den) = (0u32, 0f64, 0f64);
    let at = 2 + m / 8;
    for (i, (g, w)) in got.chunks_exact(cb).zip(want.chunks_exact(cb)).enumerate() {
        let f16_bits = |c: &[u8]| i32::from(u16::from_le_bytes([c[0], c[1]]));
        if (f16_bits(g) - f16_bits(w)).abs() > 1 {
            return Err(format!(
                "row {i}: norm bits {:#x} against {:#x}",
                f16_bits(g),
                f16_bits(w)
            ));
        }
        let pairs = |c: &[u8]| {
            let mut v: Vec<(u8, u16)> = (0..outliers)
                .map(|k| {
                    let o = at + outliers + 2 * k;
                    (c[at + k], u16::from_le_bytes([c[o], c[o + 1]]))
                })
                .collect();
            v.sort_unstable();
            v
        };
        if pairs(g) != pairs(w) {
            return Err(format!(
                "row {i}: outliers {:?} against {:?}",
                pairs(g),
                pairs(w)
            ));
        }
        flips += g[2..at]
            .iter()
            .zip(&w[2..at])
            .map(|(a, b)| (a ^ b).count_ones())
            .sum::<u32>();
        let (mut rg, mut rw) = (vec![0f32; d], vec![0f32; d]);
        codec.decode(i / t, g, &mut rg);
        codec.decode(i / t, w, &mut rw);
        num += rg
            .iter()
            .zip(&rw)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>();
        den += rw.iter().map(|b| f64::from(*b).powi(2)).sum::<f64>();
    }
    let bits = (rows * m) as f64;
    if f64::from(flips) > 0.001 * bits {
        return Err(format!("{flips} of {bits} sign bits differ"));
    }
    let rel = (num / den.max(1e-30)).sqrt();
    if rel > 0.01 {
        return Err(format!("decoded keys differ by {rel:.3e} relative L2"));
    }
    Ok(())
}

fn codecs(d: usize) -> Vec<QjlKeyCodec> {
    // The presets' shapes: ~3 bits without outliers, ~4 bits with 4 of them.
    vec![
        QjlKeyCodec::new(d, 2, 3 * d - d / 8 * 3, 0, 3, 5).expect("qjl"),
        QjlKeyCodec::new(d, 2, 4 * d + 8, 4, 3, 5).expect("qjl"),
    ]
}

#[test]
fn qjl_key_encode_equals_the_cpu_codec() {
    let mut seed = 300;
    for d in [64, 128, 256] {
        for c in codecs(d) {
            for t in [1, 6] {
                for order in ORDERS {
                    seed += 1;
                    check(
                        "kvq_encode_qjl_keys",
                        &c,
                        t,
                        &dispatch::encode_qjl_keys,
                        order,
                        seed,
                    )
                    .unwrap_or_else(|e| panic!("m {} d {d} t {t} {order:?}: {e}", c.sketch_dim()));
                }
            }
        }
    }
}

#[test]
fn a_sign_from_the_wrong_lane_is_caught() {
    for d in [64, 256] {
        for c in codecs(d) {
            for order in ORDERS {
                let r = check(
                    "wrong_shuffle_lane/kvq_encode_qjl_keys",
                    &c,
                    6,
                    &dispatch::encode_qjl_keys,
                    order,
                    9,
                );
                assert!(r.is_err(), "d {d} {order:?} passed the parity check");
            }
        }
    }
}

#[test]
fn qjl_key_encode_with_the_seeds_grid_is_caught() {
    let c = &codecs(128)[1];
    let wrong = |rows, d| seed_grid(dispatch::encode_qjl_keys(rows, d));
    assert!(check("kvq_encode_qjl_keys", c, 6, &wrong, Order::Forward, 9).is_err());
}
