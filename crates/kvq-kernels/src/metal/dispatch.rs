//! One function per Metal kernel decides its dispatch. Every function here returns a
//! [`Dispatch`] in threadgroups: it feeds `dispatchThreadgroups` (candle's
//! `ComputeCommandEncoder::dispatch_thread_groups(threadgroups, threads_per_threadgroup)`), never
//! `dispatchThreads`, whose grid counts threads (MLX's `grid=`: the seed's "grid = total
//! threads" bug was a threadgroup count passed where threads were meant).

/// Threadgroups of threads, for `dispatchThreadgroups`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dispatch {
    /// Threadgroups in the grid (x, y, z).
    pub threadgroups: [u32; 3],
    /// Threads per threadgroup (x, y, z); their product is at most 1024.
    pub threads: [u32; 3],
}

impl Dispatch {
    /// `groups` threadgroups of `threads` threads along x.
    pub fn linear(groups: usize, threads: usize) -> Self {
        Self {
            threadgroups: [to_u32(groups), 1, 1],
            threads: [to_u32(threads), 1, 1],
        }
    }

    /// Threads in the whole grid.
    pub fn total_threads(&self) -> u64 {
        let n = |v: [u32; 3]| v.iter().map(|&x| u64::from(x)).product::<u64>();
        n(self.threadgroups) * n(self.threads)
    }
}

fn to_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Threads per threadgroup of the one-thread-per-item kernels.
pub const LINEAR_THREADS: usize = 256;

/// `kvq_pack_bits` / `kvq_unpack_bits` (kernels/metal/common/bitpack.metal): one thread per group
/// of 8 of the `n` codes, in threadgroups of [`LINEAR_THREADS`].
pub fn pack_bits(n: usize) -> Dispatch {
    let threads = n.div_ceil(8);
    let per = threads.clamp(1, LINEAR_THREADS);
    Dispatch::linear(threads.div_ceil(per).max(1), per)
}

/// `kvq_encode_scalar` (kernels/metal/turboquant_mse/encode.metal): one threadgroup of `d`
/// threads per code row (`d` in 64, 128, 256).
pub fn encode_scalar(rows: usize, d: usize) -> Dispatch {
    Dispatch::linear(rows, d)
}

/// `kvq_encode_qjl_keys` (kernels/metal/qjl/encode.metal): one threadgroup of `d` threads per
/// code row.
pub fn encode_qjl_keys(rows: usize, d: usize) -> Dispatch {
    Dispatch::linear(rows, d)
}

/// `kvq_nearest` (kernels/metal/vecinfer/encode.metal): one thread per sub-vector of the `n`,
/// in threadgroups of [`LINEAR_THREADS`] (each copies the codebook once).
pub fn nearest(n: usize) -> Dispatch {
    let per = n.clamp(1, LINEAR_THREADS);
    Dispatch::linear(n.div_ceil(per).max(1), per)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_gets_a_thread() {
        for n in [1, 7, 8, 9, 2047, 2048, 2049, 100_000] {
            let g = pack_bits(n);
            assert!(g.total_threads() >= n.div_ceil(8) as u64, "{n}");
            assert!(g.total_threads() < n.div_ceil(8) as u64 + LINEAR_THREADS as u64);
        }
        let e = encode_scalar(33, 128);
        assert_eq!((e.threadgroups, e.threads), ([33, 1, 1], [128, 1, 1]));
    }
}
