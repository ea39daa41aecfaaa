//! Row-parallel loops on candle's own CPU thread pool (the barrier pool its quantized matmuls
//! use), not on a pool of our own: between matmuls candle's workers spin, so a second pool's
//! threads would compete with them for the cores. Measured on the 2-core CPU, decode at 2048
//! tokens: QJL 3-bit ran at 38.1 tok/s on rayon's pool and 55.4 with candle's workers made to
//! park instead of spin (`CANDLE_BARRIER_POOL_SPIN_LIMIT=1000`); running the ops on candle's pool
//! gets that without slowing the matmuls (fp16 lost 7% with the shorter spin).

/// A raw pointer the rows are written through; shared by the pool's threads.
struct RowsPtr<T>(*mut T);

impl<T> Clone for RowsPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for RowsPtr<T> {}

// SAFETY: `for_each_row` hands each row (a disjoint slice) to exactly one call, and the pointer
// is only dereferenced while `out` is mutably borrowed by `for_each_row`.
unsafe impl<T: Send> Send for RowsPtr<T> {}
// SAFETY: as above: threads never touch the same row.
unsafe impl<T: Send> Sync for RowsPtr<T> {}

impl<T> RowsPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

/// Calls `f(i, row_i)` for every `width`-long row of `out`: on the calling thread when there are
/// fewer than `min_parallel` rows, else spread over candle's barrier pool and the calling thread.
///
/// `f` must not run candle ops itself (the calling thread holds the pool's call lock while it
/// works, and that lock is not reentrant) and must not panic (a panic there poisons the lock for
/// every later candle matmul). The codecs' loops are plain slice arithmetic that check their
/// inputs instead of panicking.
pub(crate) fn for_each_row<T: Send>(
    out: &mut [T],
    width: usize,
    min_parallel: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if width == 0 {
        return;
    }
    let n = out.len() / width;
    if n < min_parallel {
        for (i, row) in out.chunks_exact_mut(width).enumerate() {
            f(i, row);
        }
        return;
    }
    let base = RowsPtr(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        for i in range {
            // SAFETY: `execute_chunked` hands out disjoint ranges of `0..n` and returns only
            // after all of them ran, so each row is written by one thread while `out` (of
            // `n * width` elements) is borrowed here.
            let row = unsafe { std::slice::from_raw_parts_mut(base.get().add(i * width), width) };
            f(i, row);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::for_each_row;

    #[test]
    fn every_row_once_in_and_out_of_the_pool() {
        for (n, min) in [(1000, 1), (1000, 5000), (3, 1), (0, 1)] {
            let mut out = vec![0u32; n * 3];
            for_each_row(&mut out, 3, min, |i, row| {
                for (j, x) in row.iter_mut().enumerate() {
                    *x += (i * 3 + j) as u32 + 1;
                }
            });
            assert!(out.iter().enumerate().all(|(k, &x)| x == k as u32 + 1));
        }
    }
}
