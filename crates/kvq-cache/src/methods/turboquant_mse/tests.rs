//! TurboQuant-MSE tests: distortion within the paper's bound, attention close to exact
//! attention, the window and sinks exact, chunked prefill equal to token-by-token decode, the
//! fast encode and scoring paths against their references, the fused op against
//! `attend_reference`, and resident bytes as promised.

use super::*;
use crate::testkit::{
    attention_error, gauss, geom, op_vs_reference, prefill_vs_steps, resident_ratio,
    unit_distortion,
};
use crate::traits::CacheFactory;
use std::sync::Arc;

#[test]
fn distortion_is_within_the_paper_bound() {
    // E||x - x_hat||^2 for unit x <= (sqrt(3) pi / 2) 4^-b.
    let d = 128;
    for bits in 1..=4u32 {
        let c = MseCodec::new(d, 1, bits, 0, 1).unwrap();
        let mse = unit_distortion(&c, d, 400);
        let bound = 3f64.sqrt() * std::f64::consts::PI / 2.0 * 4f64.powi(-(bits as i32));
        assert!(mse <= bound, "b={bits}: mse {mse} > bound {bound}");
        // And close to the Lloyd-Max optimum it is built from.
        let optimum = codebook(Dist::Gaussian, bits).mse;
        assert!(
            (mse - optimum).abs() < 0.25 * optimum,
            "b={bits}: mse {mse} vs {optimum}"
        );
    }
}

fn factory(bits: u32, window: usize, sinks: usize) -> TurboQuantMseFactory {
    TurboQuantMseFactory {
        window,
        sinks,
        ..TurboQuantMseFactory::new(bits)
    }
}

#[test]
fn attention_error_shrinks_with_bits() {
    let e2 = attention_error(&factory(2, 8, 0), 300, 1);
    let e3 = attention_error(&factory(3, 8, 0), 300, 1);
    let e4 = attention_error(&factory(4, 8, 0), 300, 1);
    assert!(e4 < e3 && e3 < e2, "{e2} {e3} {e4}");
    assert!(e4 < 0.15, "4-bit relative error {e4}");
}

#[test]
fn window_covering_everything_is_exact_up_to_f16() {
    assert!(attention_error(&factory(2, 1000, 0), 300, 1) < 2e-3);
    // All-sink: the first tokens are fp16 too.
    assert!(attention_error(&factory(2, 1, 400), 300, 1) < 2e-3);
}

#[test]
fn prefill_rows_see_what_generation_would() {
    let diff = prefill_vs_steps(&factory(3, 16, 2));
    assert!(diff < 1e-5, "{diff}");
}

#[test]
fn resident_bytes_match_the_packed_size() {
    for bits in [2u32, 3, 4] {
        // Per token and head: 2 bytes of norm + d * bits / 8, for keys and for values.
        let per = 2 + 64 * bits as usize / 8;
        let ratio = resident_ratio(&TurboQuantMseFactory::new(bits), per, per);
        assert!((0.95..=1.05).contains(&ratio), "{bits} bits: ratio {ratio}");
    }
}

/// Keys (and values) with a spread of norms, a zero row and a huge one.
fn awkward_rows(d: usize, n: usize) -> Vec<Vec<f32>> {
    let mut rows: Vec<Vec<f32>> = (0..n as u64)
        .map(|i| {
            let s = 10f32.powf((i % 7) as f32 - 3.0);
            gauss(d, 500 + i).iter().map(|x| x * s).collect()
        })
        .collect();
    rows.push(vec![0.0; d]);
    rows.push(vec![6.0e4; d]);
    rows
}

#[test]
fn threshold_count_is_the_codebook_search() {
    // The fast encode's threshold count (`kvq_kernels::turboquant::quantize_into`) against the
    // codebook's search: uniform draws in [-4, 4), the thresholds themselves, non-finite values
    // and signed zeros.
    for bits in 1..=turboquant::MAX_BITS {
        let book = codebook(Dist::Gaussian, bits);
        let mut r = crate::codec::rng::SplitMix::new(u64::from(bits));
        let mut y: Vec<f32> = (0..500)
            .map(|_| (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
            .collect();
        y.iter_mut().for_each(|v| *v *= 4.0);
        y.extend_from_slice(&book.thresholds);
        y.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0]);
        let mut idx = vec![0u8; y.len()];
        turboquant::quantize_into(&book.thresholds, &y, &mut idx);
        for (v, i) in y.iter().zip(&idx) {
            assert_eq!(*i, book.quantize(*v), "bits {bits}, y {v}");
        }
    }
}

#[test]
fn fast_encode_is_bit_exact() {
    for d in [64, 128] {
        for bits in 1..=4u32 {
            let c = MseCodec::new(d, 2, bits, 3, 9).unwrap();
            let cb = KeyCodec::code_bytes(&c);
            for (i, x) in awkward_rows(d, 40).iter().enumerate() {
                let (mut fast, mut slow) = (vec![0u8; cb], vec![0u8; cb]);
                KeyCodec::encode(&c, i % 2, x, &mut fast);
                c.encode_reference(i % 2, x, &mut slow);
                assert_eq!(fast, slow, "d {d} bits {bits} row {i}");
            }
        }
    }
}

#[test]
fn every_kernel_path_scores_and_sums_like_the_reference() {
    let (d, n) = (64, 70);
    for bits in 1..=4u32 {
        for isa in Isa::available() {
            let c = MseCodec::new(d, 1, bits, 0, 4).unwrap().with_isa(isa);
            let cb = KeyCodec::code_bytes(&c);
            let mut codes = vec![0u8; n * cb];
            for (i, code) in codes.chunks_exact_mut(cb).enumerate() {
                KeyCodec::encode(&c, 0, &gauss(d, 40 + i as u64), code);
            }
            let mut state = vec![0f32; c.state_len()];
            c.prepare(0, &gauss(d, 7), &mut state);
            let mut got = vec![0f32; n];
            c.scores(0, &state, &codes, &mut got);
            let qn: f32 = state.iter().map(|x| x * x).sum::<f32>().sqrt();
            for (r, (s, code)) in got.iter().zip(codes.chunks_exact(cb)).enumerate() {
                let want = c.score_one_reference(&state, code);
                let tol = 1e-5 * qn * Rotated::norm_of(code) * (d as f32).sqrt() * 3.0;
                assert!(
                    (s - want).abs() <= tol,
                    "{isa:?} {bits} row {r}: {s} vs {want}"
                );
                assert!((c.score_one(&state, code) - want).abs() <= tol);
            }
            // Value sums against decode-and-add.
            let probs: Vec<f32> = (0..n).map(|i| 1.0 / (1.0 + i as f32)).collect();
            let mut acc = vec![0f32; ValueCodec::acc_len(&c)];
            c.accumulate(0, &probs, &codes, &mut acc);
            let mut out = vec![0f32; d];
            c.finish(0, &acc, &mut out);
            let mut want = vec![0f32; d];
            let mut row = vec![0f32; d];
            for (p, code) in probs.iter().zip(codes.chunks_exact(cb)) {
                ValueCodec::decode(&c, 0, code, &mut row);
                want.iter_mut().zip(&row).for_each(|(w, x)| *w += p * x);
            }
            let mag = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-4 * mag, "{isa:?} {bits}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn score_rows_reads_the_first_stage_of_wider_rows() {
    let d = 64;
    let c = MseCodec::new(d, 1, 3, 0, 4).unwrap();
    let cb = KeyCodec::code_bytes(&c);
    let stride = cb + 11;
    let mut rows = vec![0xA5u8; 20 * stride];
    for (i, row) in rows.chunks_exact_mut(stride).enumerate() {
        KeyCodec::encode(&c, 0, &gauss(d, i as u64), &mut row[..cb]);
    }
    let mut state = vec![0f32; c.state_len()];
    c.prepare(0, &gauss(d, 99), &mut state);
    let mut got = vec![0f32; 20];
    c.score_rows(&state, &rows, stride, &mut got);
    for (g, row) in got.iter().zip(rows.chunks_exact(stride)) {
        assert!((g - c.score_one(&state, row)).abs() < 1e-5);
    }
}

#[test]
fn fused_op_matches_attend_reference() {
    for bits in [2u32, 3, 4] {
        let k = MseCodec::new(64, 2, bits, 1, 5).unwrap();
        let v = MseCodec::new(64, 2, bits, 1, 6).unwrap();
        let err = op_vs_reference(Arc::new(k), Arc::new(v));
        assert!(err < 1e-4, "bits {bits}: {err}");
    }
}

#[test]
fn bits_outside_the_kernels_are_an_error() {
    assert!(MseCodec::new(64, 1, 0, 0, 0).is_err());
    assert!(MseCodec::new(64, 1, 7, 0, 0).is_err());
    assert!(MseCodec::new(48, 1, 2, 0, 0).is_err());
}

#[test]
fn attending_twice_without_append_is_an_error_not_a_panic() {
    use candle_core::{Device, Tensor};
    let g = geom();
    let f = TurboQuantMseFactory {
        window: 4,
        ..TurboQuantMseFactory::new(3)
    };
    let mut cache = f.create(0, &g).unwrap();
    let dev = Device::Cpu;
    // Past the keys the center is fixed from (fp16 rows are all kept before).
    let t = crate::compressed::CENTER_ROWS + 16;
    let kv = Tensor::from_vec(gauss(2 * t * 64, 5), (2, t, 64), &dev).unwrap();
    cache.append(&kv, &kv).unwrap();
    let q = Tensor::from_vec(gauss(4 * t * 64, 6), (4, t, 64), &dev).unwrap();
    cache.attend(&q, 0.125).unwrap();
    assert!(cache.attend(&q, 0.125).is_err());
    // One more position, one query: fine again.
    let kv1 = Tensor::from_vec(gauss(2 * 64, 7), (2, 1, 64), &dev).unwrap();
    cache.append(&kv1, &kv1).unwrap();
    let q1 = Tensor::from_vec(gauss(4 * 64, 8), (4, 1, 64), &dev).unwrap();
    cache.attend(&q1, 0.125).unwrap();
}
