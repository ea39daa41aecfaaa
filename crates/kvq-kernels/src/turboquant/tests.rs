//! The kernel paths against their references: every index width, head dim and path, rows with
//! a stride and an offset (as the codes sit in the cache). The threshold count is tested against
//! the Lloyd-Max codebook's search where the codebooks live (kvq-cache, TurboQuant-MSE's tests).

use super::*;
use proptest::prelude::*;

/// splitmix64 seeded by `seed`: the stream of `kvq_cache::codec::rng::SplitMix::next_u64`
/// (kvq-kernels cannot depend on kvq-cache), so these tests draw the data they always drew.
fn stream(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed;
    move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn floats(n: usize, seed: u64) -> Vec<f32> {
    let mut next = stream(seed);
    (0..n)
        .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
        .collect()
}

/// `n` rows of `stride` bytes, random packed indices after a 2-byte prefix.
fn random_rows(n: usize, d: usize, bits: u32, stride: usize, seed: u64) -> Vec<u8> {
    let mut next = stream(seed);
    let mut data = vec![0u8; n * stride];
    let mut idx = vec![0u8; d];
    for row in data.chunks_exact_mut(stride) {
        row[..2].copy_from_slice(&[(next() & 255) as u8, 0x3c]);
        idx.iter_mut()
            .for_each(|i| *i = (next() % (1 << bits)) as u8);
        bitpack::pack(&idx, bits, &mut row[2..]);
        for b in row[2 + bitpack::packed_len(d, bits)..].iter_mut() {
            *b = (next() & 255) as u8;
        }
    }
    data
}

fn table(bits: u32) -> Table {
    let levels: Vec<f32> = floats(1 << bits, u64::from(bits) * 7);
    Table::new(&levels)
}

fn check_paths(
    bits: u32,
    d: usize,
    n: usize,
    extra: usize,
    seed: u64,
) -> std::result::Result<(), String> {
    let stride = 2 + bitpack::packed_len(d, bits) + extra;
    let data = random_rows(n, d, bits, stride, seed);
    let scale_at = seed.is_multiple_of(2).then_some(0);
    let rows = Rows {
        data: &data,
        stride,
        offset: 2,
        d,
        scale_at,
    };
    let t = table(bits);
    let q = floats(d, seed + 1);
    let w = floats(n, seed + 2);
    // Row scales are fp16 numbers in [1, 2) (high byte 0x3c).
    let scale: f32 = 2.0 * (q.iter().map(|x| x.abs()).sum::<f32>() + 1.0);
    let mut want = vec![0f32; n];
    dot_rows_reference(&q, &t, rows, &mut want);
    let mut want_acc = floats(d, seed + 3);
    let start = want_acc.clone();
    axpy_rows_reference(&w, &t, rows, &mut want_acc);
    for isa in Isa::available() {
        let mut got = vec![0f32; n];
        dot_rows_with(isa, &q, &t, rows, &mut got);
        for (r, (a, b)) in got.iter().zip(&want).enumerate() {
            if (a - b).abs() > 1e-5 * scale {
                return Err(format!("{isa:?} bits {bits} d {d} row {r}: {a} vs {b}"));
            }
        }
        let mut acc = start.clone();
        axpy_rows_with(isa, &w, &t, rows, &mut acc);
        let wscale: f32 = 2.0 * (w.iter().map(|x| x.abs()).sum::<f32>() + 1.0);
        for (i, (a, b)) in acc.iter().zip(&want_acc).enumerate() {
            if (a - b).abs() > 1e-5 * wscale {
                return Err(format!("{isa:?} bits {bits} d {d} acc {i}: {a} vs {b}"));
            }
        }
    }
    Ok(())
}

#[test]
fn every_path_matches_the_reference() {
    for bits in 1..=MAX_BITS {
        for d in [16, 32, 64, 128, 256] {
            for extra in [0, 3, 16] {
                for seed in [0, 1] {
                    let seed = u64::from(bits) * 1000 + d as u64 + seed;
                    check_paths(bits, d, 37, extra, seed).unwrap();
                    // Enough rows for the portable byte tables.
                    check_paths(bits, d, 100, extra, seed).unwrap();
                }
            }
        }
    }
}

#[test]
fn no_rows_and_one_row() {
    for bits in 1..=MAX_BITS {
        check_paths(bits, 64, 0, 0, 5).unwrap();
        check_paths(bits, 64, 1, 0, 6).unwrap();
    }
}

#[test]
fn avx512_is_used_when_the_cpu_has_it() {
    // Not an assertion about the machine: reports which path the other tests covered.
    eprintln!("kernel paths tested: {:?}", Isa::available());
}

#[test]
fn byte_lut_matches_the_reference() {
    let (d, n) = (64, 21);
    let stride = 2 + bitpack::packed_len(d, 4);
    let data = random_rows(n, d, 4, stride, 9);
    let rows = Rows {
        data: &data,
        stride,
        offset: 2,
        d,
        scale_at: Some(0),
    };
    let t = table(4);
    let q = floats(d, 10);
    let mut lut = Vec::new();
    byte_lut(&q, &t, d, &mut lut).unwrap();
    let (mut got, mut want) = (vec![0f32; n], vec![0f32; n]);
    dot_rows_byte_lut(&lut, 4, rows, &mut got);
    dot_rows_reference(&q, &t, rows, &mut want);
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
}

proptest! {
    #[test]
    fn random_shapes_match(bits in 1u32..=MAX_BITS, d_log in 4u32..=8, n in 0usize..90, extra in 0usize..9, seed in any::<u64>()) {
        let r = check_paths(bits, 1 << d_log, n, extra, seed);
        prop_assert!(r.is_ok(), "{:?}", r);
    }
}
