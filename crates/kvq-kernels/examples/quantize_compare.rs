//! Times one nearest-centroid formulation at Falcon3-like geometry (head_dim 256, 256
//! centroids, sub_dim 4 and 8, 4096 tokens x 8 kv heads by default). Peak memory is measured from
//! outside, one formulation per process:
//!
//! ```text
//! /usr/bin/time -v target/release/examples/quantize_compare fused
//! /usr/bin/time -v target/release/examples/quantize_compare materializing --chunk 65536
//! ```
//!
//! Flags: `--tokens N` (4096), `--heads N` (8), `--head-dim N` (256), `--sub 4|8` (both),
//! `--reps N` (3), `--chunk N` (materializing only: sub-vectors per call, 0 = all at once, as
//! the seed's unchunked path; default 65536).

use candle_core::{Device, Tensor};
use kvq_kernels::{nearest_centroid, nearest_centroid_reference};
use std::time::Instant;

struct Args {
    fused: bool,
    tokens: usize,
    heads: usize,
    head_dim: usize,
    subs: Vec<usize>,
    reps: usize,
    chunk: usize,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let fused = match it.next().as_deref() {
        Some("fused") => true,
        Some("materializing") => false,
        other => return Err(format!("first argument fused|materializing, got {other:?}")),
    };
    let mut a = Args {
        fused,
        tokens: 4096,
        heads: 8,
        head_dim: 256,
        subs: vec![4, 8],
        reps: 3,
        chunk: 65536,
    };
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let n: usize = value
            .parse()
            .map_err(|_| format!("{flag}: not a number: {value}"))?;
        match flag.as_str() {
            "--tokens" => a.tokens = n,
            "--heads" => a.heads = n,
            "--head-dim" => a.head_dim = n,
            "--sub" => a.subs = vec![n],
            "--reps" => a.reps = n.max(1),
            "--chunk" => a.chunk = n,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

/// Deterministic values in [-1, 1).
fn uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn run(a: &Args, sub: usize) -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let n = a.tokens * a.heads * (a.head_dim / sub);
    let x = Tensor::from_vec(uniform(n * sub, 1), (n, sub), &dev)?;
    let cb = Tensor::from_vec(uniform(256 * sub, 2), (256, sub), &dev)?;
    let once = || -> candle_core::Result<Tensor> {
        if a.fused {
            return nearest_centroid(&x, &cb);
        }
        let chunk = if a.chunk == 0 { n } else { a.chunk };
        let parts = (0..n)
            .step_by(chunk)
            .map(|s| nearest_centroid_reference(&x.narrow(0, s, chunk.min(n - s))?, &cb))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Tensor::cat(&parts, 0)
    };
    let mut best = f64::INFINITY;
    let mut checksum = 0u64;
    for _ in 0..a.reps {
        let t = Instant::now();
        let idx = once()?;
        best = best.min(t.elapsed().as_secs_f64());
        checksum = idx.to_vec1::<u32>()?.iter().map(|&i| i as u64).sum();
    }
    let name = if a.fused {
        "fused".to_string()
    } else {
        format!(
            "materializing (chunk {})",
            if a.chunk == 0 { n } else { a.chunk }
        )
    };
    println!(
        "{name}: head_dim {} sub {sub} centroids 256, N = {} tokens x {} heads x {} = {n} \
         sub-vectors: {:.1} ms per call (best of {}), {:.1} M sub-vectors/s, checksum {checksum}",
        a.head_dim,
        a.tokens,
        a.heads,
        a.head_dim / sub,
        best * 1e3,
        a.reps,
        n as f64 / best / 1e6
    );
    Ok(())
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    for &sub in &a.subs {
        if let Err(e) = run(&a, sub) {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
