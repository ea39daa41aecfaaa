//! The emulated encode kernels of TurboQuant-Prod keys (kernels/metal/turboquant_prod/
//! encode.metal), QJL's group values (`kvq_encode_group`, kernels/metal/qjl/encode.metal) and
//! VecInfer keys and values (`kvq_encode_vq`, kernels/metal/vecinfer/encode.metal) against the
//! CPU codecs on random rows, head dims 64, 128 and 256, one and five rows per head, under every
//! lane order, outputs poisoned; and their negative controls (build.rs): the shared rotation's
//! mistakes (the seed's XOR butterfly, a removed butterfly barrier) through the Prod and
//! VecInfer kernels, a residual sign packed from the wrong lane, and the barriers these kernels
//! add (before the residual's projections, before packing group codes, before reading rotated
//! sub-vectors).

mod common;

use common::{KVH, vq_books, vq_lambda};
use kvq_cache::codec::rng::SplitMix;
use kvq_cache::compressed::{KeyCodec, ValueCodec};
use kvq_cache::methods::qjl::GroupCodec;
use kvq_cache::methods::turboquant_mse::MseCodec;
use kvq_cache::methods::turboquant_prod::ProdKeyCodec;
use kvq_cache::methods::vecinfer::codec::{ValueAccum, VqKeyCodec, VqValueCodec};
use kvq_kernels::metal::dispatch;
use kvq_kernels::metal::params::{
    self, AsBytes, GroupEncodeParams, ProdEncodeParams, VqEncodeParams,
};
use kvq_kernels::spec::{KeySpec, ValueSpec, VqSpec};
use kvq_metal_emu::{ORDERS, Order, f32_bytes, run};

const POISON: u8 = 0xee;

fn f16_bits(c: &[u8]) -> i32 {
    i32::from(u16::from_le_bytes([c[0], c[1]]))
}

fn sq_err(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum()
}

/// TurboQuant-Prod keys at `bits` (the MSE stage's codec rebuilt beside it, as the Prod codec
/// makes it, to decode the stage alone).
struct Prod {
    codec: ProdKeyCodec,
    stage: MseCodec,
    bits: u32,
}

fn prod(d: usize, bits: u32) -> Prod {
    Prod {
        codec: ProdKeyCodec::new(d, KVH, bits, 3, 11).expect("prod"),
        stage: MseCodec::new(d, KVH, bits - 1, 3, 11).expect("stage"),
        bits,
    }
}

/// Encodes `t` random rows per head with `kernel` and compares with the CPU codec: the stage's
/// norms within one f16 step and its reconstruction error within 1% of the CPU's; where a row's
/// stage is the CPU's byte for byte, the residual norm within two f16 steps; at most 0.5% of the
/// residual's sign bits different (projections within rounding of zero, or a stage index on the
/// other side of a threshold); the decoded keys within 2% relative L2 of the CPU's.
fn check_prod(kernel: &str, c: &Prod, t: usize, order: Order, seed: u64) -> Result<(), String> {
    let d = c.codec.head_dim();
    let (rows, cb) = (KVH * t, c.codec.code_bytes());
    let Some(KeySpec::ScalarSketch { scalar, sketch }) = c.codec.kernel_data().map(|k| &k.spec)
    else {
        return Err("not a Prod spec".into());
    };
    let mb = scalar.code_bytes(d);
    let x = SplitMix::new(seed).gauss_vec(rows * d);
    let mut want = vec![0u8; rows * cb];
    for (i, o) in want.chunks_exact_mut(cb).enumerate() {
        c.codec.encode(i / t, &x[i * d..(i + 1) * d], o);
    }
    let p = ProdEncodeParams {
        rows: rows as u32,
        t: t as u32,
        d: d as u32,
        bits: scalar.bits,
        cb: cb as u32,
        sigma: scalar.sigma,
        m: sketch.m as u32,
    };
    let mut got = vec![POISON; rows * cb];
    run(
        kernel,
        dispatch::encode_prod(rows, d),
        order,
        &mut [
            &mut f32_bytes(&x),
            &mut f32_bytes(&scalar.signs),
            &mut f32_bytes(&scalar.thresholds),
            &mut scalar.code_of.clone(),
            &mut f32_bytes(&scalar.levels),
            &mut f32_bytes(&sketch.matrices),
            &mut got,
            &mut p.as_bytes(),
        ],
    )
    .map_err(|e| e.to_string())?;
    let (mut flips, mut stage_g, mut stage_w, mut num, mut den) = (0u32, 0f64, 0f64, 0f64, 0f64);
    let (mut a, mut b) = (vec![0f32; d], vec![0f32; d]);
    for (i, (g, w)) in got.chunks_exact(cb).zip(want.chunks_exact(cb)).enumerate() {
        let (h, row) = (i / t, &x[i * d..(i + 1) * d]);
        if (f16_bits(g) - f16_bits(w)).abs() > 1 {
            return Err(format!(
                "row {i}: stage norm bits {:#x} against {:#x}",
                f16_bits(g),
                f16_bits(w)
            ));
        }
        if g[..mb] == w[..mb] && (f16_bits(&g[mb..]) - f16_bits(&w[mb..])).abs() > 2 {
            return Err(format!(
                "row {i}: residual norm bits {:#x} against {:#x}",
                f16_bits(&g[mb..]),
                f16_bits(&w[mb..])
            ));
        }
        KeyCodec::decode(&c.stage, h, &g[..mb], &mut a);
        KeyCodec::decode(&c.stage, h, &w[..mb], &mut b);
        stage_g += sq_err(&a, row);
        stage_w += sq_err(&b, row);
        flips += g[mb + 2..]
            .iter()
            .zip(&w[mb + 2..])
            .map(|(a, b)| (a ^ b).count_ones())
            .sum::<u32>();
        c.codec.decode(h, g, &mut a);
        c.codec.decode(h, w, &mut b);
        num += sq_err(&a, &b);
        den += b.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>();
    }
    if !(stage_g.is_finite() && (stage_g - stage_w).abs() <= 0.01 * stage_w) {
        return Err(format!(
            "stage reconstruction error {stage_g:.4e} against the CPU codec's {stage_w:.4e}"
        ));
    }
    let bits = (rows * sketch.m) as f64;
    if f64::from(flips) > 0.005 * bits {
        return Err(format!("{flips} of {bits} residual sign bits differ"));
    }
    let rel = (num / den.max(1e-30)).sqrt();
    if rel.is_nan() || rel > 0.02 {
        return Err(format!("decoded keys differ by {rel:.3e} relative L2"));
    }
    Ok(())
}

#[test]
fn prod_key_encode_equals_the_cpu_codec() {
    let mut seed = 800;
    for d in [64, 128, 256] {
        for bits in [2, 3, 4] {
            let c = prod(d, bits);
            for t in [1, 5] {
                for order in ORDERS {
                    seed += 1;
                    check_prod("kvq_encode_prod", &c, t, order, seed)
                        .unwrap_or_else(|e| panic!("prod-{} d {d} t {t} {order:?}: {e}", c.bits));
                }
            }
        }
    }
}

/// A negative control made in a copy of the Prod encode: fails under every lane order at head
/// dims 64 and 256.
fn assert_prod_caught(kernel: &str) {
    for d in [64, 256] {
        let c = prod(d, 3);
        for order in ORDERS {
            assert!(
                check_prod(kernel, &c, 5, order, 7).is_err(),
                "{kernel} d {d} {order:?} passed the parity check"
            );
        }
    }
}

#[test]
fn prod_encode_mistakes_are_caught() {
    assert_prod_caught("xor_butterfly/kvq_encode_prod");
    assert_prod_caught("no_barrier/kvq_encode_prod");
    assert_prod_caught("prod_wrong_shuffle_lane/kvq_encode_prod");
    assert_prod_caught("prod_no_residual_barrier/kvq_encode_prod");
}

/// Encodes `t` random rows per head of `codec` with `kernel`: every row's squared error (its
/// codes decoded by the CPU codec) at most 2% over the CPU's own codes' (the fit may pick
/// another trimmed range of nearly equal error, where the CPU sums its errors in another
/// order), and at least 90% of the rows the CPU's byte for byte.
fn check_group(
    kernel: &str,
    codec: &GroupCodec,
    t: usize,
    order: Order,
    seed: u64,
) -> Result<(), String> {
    let d = codec.head_dim();
    let (rows, cb) = (KVH * t, codec.code_bytes());
    let Some(ValueSpec::Group { bits, group }) = codec.kernel_data().map(|v| &v.spec) else {
        return Err("not a group spec".into());
    };
    let x = SplitMix::new(seed).gauss_vec(rows * d);
    let mut want = vec![0u8; rows * cb];
    for (i, o) in want.chunks_exact_mut(cb).enumerate() {
        codec.encode(i / t, &x[i * d..(i + 1) * d], o);
    }
    let p = GroupEncodeParams {
        rows: rows as u32,
        d: d as u32,
        bits: *bits,
        group: *group as u32,
        cb: cb as u32,
    };
    let mut got = vec![POISON; rows * cb];
    run(
        kernel,
        dispatch::encode_group(rows, d),
        order,
        &mut [&mut f32_bytes(&x), &mut got, &mut p.as_bytes()],
    )
    .map_err(|e| e.to_string())?;
    let (mut same, mut a, mut b) = (0usize, vec![0f32; d], vec![0f32; d]);
    for (i, (g, w)) in got.chunks_exact(cb).zip(want.chunks_exact(cb)).enumerate() {
        let row = &x[i * d..(i + 1) * d];
        codec.decode(0, g, &mut a);
        codec.decode(0, w, &mut b);
        let (eg, ew) = (sq_err(&a, row), sq_err(&b, row));
        if eg.is_nan() || eg > 1.02 * ew + 1e-9 {
            return Err(format!(
                "row {i}: squared error {eg:.4e} against the CPU's {ew:.4e}"
            ));
        }
        same += usize::from(g == w);
    }
    if same * 10 < rows * 9 {
        return Err(format!("{same} of {rows} rows are the CPU's"));
    }
    Ok(())
}

/// QJL's value shapes: 2 bits in groups of 64 (the trimmed-range search) and of 4 (the
/// narrowest whole byte), 4 bits in groups of 32, 8 bits in groups of 32.
fn group_codecs(d: usize) -> Vec<GroupCodec> {
    [(2, 64), (2, 4), (4, 32), (8, 32)]
        .into_iter()
        .map(|(bits, group)| GroupCodec::new(d, bits, group).expect("group codec"))
        .collect()
}

#[test]
fn group_value_encode_equals_the_cpu_codec() {
    let mut seed = 900;
    for d in [64, 128, 256] {
        for c in group_codecs(d) {
            for t in [1, 5] {
                for order in ORDERS {
                    seed += 1;
                    check_group("kvq_encode_group", &c, t, order, seed)
                        .unwrap_or_else(|e| panic!("d {d} {c:?} t {t} {order:?}: {e}"));
                }
            }
        }
    }
}

/// The lane orders under which `check` fails. A removed barrier whose readers read what threads
/// of higher index write is exposed by the orders that resume the reader first (forward, and
/// the random one here), not by the reverse order, which happens to write before it reads; the
/// suite runs every kernel under all three orders, so one failing order catches it.
fn caught_by(check: impl Fn(Order) -> Result<(), String>) -> Vec<Order> {
    ORDERS.into_iter().filter(|&o| check(o).is_err()).collect()
}

fn forward_and_random(caught: &[Order]) -> bool {
    caught.contains(&Order::Forward) && caught.iter().any(|o| matches!(o, Order::Random(_)))
}

#[test]
fn group_encode_without_its_pack_barrier_is_caught() {
    for d in [64, 256] {
        let c = GroupCodec::new(d, 2, 64).expect("group codec");
        let caught = caught_by(|o| check_group("group_no_barrier/kvq_encode_group", &c, 5, o, 3));
        assert!(
            forward_and_random(&caught),
            "d {d}: caught under {caught:?}"
        );
    }
}

/// A VecInfer key or value codec and its spec.
enum Vq {
    Keys(VqKeyCodec),
    Values(VqValueCodec),
}

impl Vq {
    fn spec(&self) -> Option<&VqSpec> {
        match self {
            Vq::Keys(c) => match c.kernel_data().map(|k| &k.spec) {
                Some(KeySpec::ProductVq(s)) => Some(s),
                _ => None,
            },
            Vq::Values(c) => match c.kernel_data().map(|v| &v.spec) {
                Some(ValueSpec::ProductVq(s)) => Some(s),
                _ => None,
            },
        }
    }

    fn encode(&self, head: usize, x: &[f32], out: &mut [u8]) {
        match self {
            Vq::Keys(c) => KeyCodec::encode(c, head, x, out),
            Vq::Values(c) => ValueCodec::encode(c, head, x, out),
        }
    }

    fn transform(&self, head: usize, x: &[f32], out: &mut [f32]) {
        match self {
            Vq::Keys(c) => c.transform(head, x, out),
            Vq::Values(c) => c.transform(head, x, out),
        }
    }
}

fn vq_codecs(d: usize) -> Vec<(String, Vq)> {
    let lambda = vq_lambda(d, 21);
    let key = |sub, per| {
        Vq::Keys(
            VqKeyCodec::new(d, sub, 3, 11, &lambda, &vq_books(d, sub, per, 22)).expect("vq keys"),
        )
    };
    let value = |sub, per| {
        let books = vq_books(d, sub, per, 23);
        Vq::Values(
            VqValueCodec::new(d, sub, 3, 11, KVH, &books, ValueAccum::Gather).expect("vq values"),
        )
    };
    vec![
        ("keys s4 shared".into(), key(4, false)),
        ("keys s8 per position".into(), key(8, true)),
        ("values s4 per position".into(), value(4, true)),
        ("values s8 shared".into(), value(8, false)),
    ]
}

/// Encodes `t` random rows per head with `kernel`: every sub-vector's centroid as near to the
/// CPU's transformed row (`k / lambda` or `v`, rotated) as the CPU's pick (ties and rounding may
/// pick another index), and at least 99% the CPU's.
fn check_vq(
    kernel: &str,
    c: &Vq,
    d: usize,
    t: usize,
    order: Order,
    seed: u64,
) -> Result<(), String> {
    let Some(s) = c.spec() else {
        return Err("not a VecInfer spec".into());
    };
    let Some(books) = params::vq_books(s, d) else {
        return Err("a codebook layout the kernel does not take".into());
    };
    let (rows, cb, sub) = (KVH * t, d / s.sub, s.sub);
    let x = SplitMix::new(seed).gauss_vec(rows * d);
    let mut want = vec![0u8; rows * cb];
    for (i, o) in want.chunks_exact_mut(cb).enumerate() {
        c.encode(i / t, &x[i * d..(i + 1) * d], o);
    }
    let smooth = !s.lambda.is_empty();
    let p = VqEncodeParams {
        rows: rows as u32,
        t: t as u32,
        d: d as u32,
        sub: sub as u32,
        books,
        smooth: u32::from(smooth),
    };
    let mut got = vec![POISON; rows * cb];
    let lambda = if smooth { &s.lambda } else { &s.signs };
    run(
        kernel,
        dispatch::encode_vq(rows, d),
        order,
        &mut [
            &mut f32_bytes(&x),
            &mut f32_bytes(&s.signs),
            &mut f32_bytes(lambda),
            &mut f32_bytes(&s.books),
            &mut got,
            &mut p.as_bytes(),
        ],
    )
    .map_err(|e| e.to_string())?;
    let mut u = vec![0f32; d];
    let mut same = 0usize;
    for i in 0..rows {
        c.transform(i / t, &x[i * d..(i + 1) * d], &mut u);
        for sp in 0..cb {
            let book = if books == 1 { 0 } else { sp };
            let dist = |idx: u8| -> f64 {
                let at = (book * 256 + usize::from(idx)) * sub;
                sq_err(&u[sp * sub..(sp + 1) * sub], &s.books[at..at + sub])
            };
            let (g, w) = (got[i * cb + sp], want[i * cb + sp]);
            if dist(g) > dist(w) * (1.0 + 1e-4) + 1e-9 {
                return Err(format!(
                    "row {i} sub-vector {sp}: centroid {g} at {:.4e}, the CPU's {w} at {:.4e}",
                    dist(g),
                    dist(w)
                ));
            }
            same += usize::from(g == w);
        }
    }
    if same * 100 < rows * cb * 99 {
        return Err(format!("{same} of {} indices are the CPU's", rows * cb));
    }
    Ok(())
}

#[test]
fn vq_encode_equals_the_cpu_codec() {
    let mut seed = 1000;
    for d in [64, 128, 256] {
        for (name, c) in vq_codecs(d) {
            for t in [1, 5] {
                for order in ORDERS {
                    seed += 1;
                    check_vq("kvq_encode_vq", &c, d, t, order, seed)
                        .unwrap_or_else(|e| panic!("{name} d {d} t {t} {order:?}: {e}"));
                }
            }
        }
    }
}

#[test]
fn vq_encode_mistakes_are_caught() {
    for d in [64, 256] {
        for (name, c) in vq_codecs(d) {
            for kernel in ["xor_butterfly/kvq_encode_vq", "no_barrier/kvq_encode_vq"] {
                for order in ORDERS {
                    assert!(
                        check_vq(kernel, &c, d, 5, order, 5).is_err(),
                        "{kernel} {name} d {d} {order:?} passed the parity check"
                    );
                }
            }
            let caught = caught_by(|o| check_vq("vq_no_barrier/kvq_encode_vq", &c, d, 5, o, 5));
            assert!(
                forward_and_random(&caught),
                "vq_no_barrier {name} d {d}: caught under {caught:?}"
            );
        }
    }
}
