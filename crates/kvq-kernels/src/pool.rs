//! Row-parallel loops on candle's own CPU thread pool (the barrier pool its quantized matmuls
//! use), not on a pool of our own: between matmuls candle's workers spin, so a second pool's
//! threads would compete with them for the cores. Measured on the 2-core CPU, decode at 2048
//! tokens: QJL 3-bit ran at 38.1 tok/s on rayon's pool and 55.4 with candle's workers made to
//! park instead of spin (`CANDLE_BARRIER_POOL_SPIN_LIMIT=1000`); running the ops on candle's pool
//! gets that without slowing the matmuls (fp16 lost 7% with the shorter spin).

use std::panic::AssertUnwindSafe;
use std::sync::Mutex;

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
/// works, and that lock is not reentrant). The ops check their inputs at entry so that `f`
/// should never panic; if it does anyway, the panic is caught on the thread it happened on
/// (an unwinding pool thread would poison the lock for every later candle matmul) and returned
/// as this op's error, so only the request that ran the op fails.
pub fn for_each_row<T: Send>(
    out: &mut [T],
    width: usize,
    min_parallel: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) -> candle_core::Result<()> {
    if width == 0 {
        return Ok(());
    }
    let n = out.len() / width;
    let panicked: Mutex<Option<String>> = Mutex::new(None);
    let guarded = |run: &mut dyn FnMut()| {
        if let Err(p) = std::panic::catch_unwind(AssertUnwindSafe(run)) {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a kernel row panicked".into());
            if let Ok(mut g) = panicked.lock() {
                g.get_or_insert(msg);
            }
        }
    };
    if n < min_parallel {
        guarded(&mut || {
            for (i, row) in out.chunks_exact_mut(width).enumerate() {
                f(i, row);
            }
        });
    } else {
        let base = RowsPtr(out.as_mut_ptr());
        candle_core::utils::barrier_pool().execute_chunked(n, |range| {
            guarded(&mut || {
                for i in range.clone() {
                    // SAFETY: `execute_chunked` hands out disjoint ranges of `0..n` and returns
                    // only after all of them ran, so each row is written by one thread while
                    // `out` (of `n * width` elements) is borrowed here.
                    let row =
                        unsafe { std::slice::from_raw_parts_mut(base.get().add(i * width), width) };
                    f(i, row);
                }
            })
        });
    }
    match panicked.into_inner() {
        Ok(None) => Ok(()),
        Ok(Some(msg)) => Err(candle_core::Error::Msg(format!("kernel failed: {msg}"))),
        Err(_) => Err(candle_core::Error::Msg(
            "kernel failed: a row panicked".into(),
        )),
    }
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
            })
            .unwrap();
            assert!(out.iter().enumerate().all(|(k, &x)| x == k as u32 + 1));
        }
    }

    #[test]
    fn a_panicking_row_is_an_error_and_the_pool_goes_on() {
        for min in [1, usize::MAX] {
            let mut out = vec![0f32; 4096];
            let err = for_each_row(&mut out, 4, min, |i, _| {
                if i == 700 {
                    panic!("row {i} is bad");
                }
            })
            .unwrap_err();
            assert!(err.to_string().contains("row 700 is bad"), "{err}");
        }
        // Candle's pool still runs a matmul big enough to use it.
        let dev = candle_core::Device::Cpu;
        let a = candle_core::Tensor::ones((256, 256), candle_core::DType::F32, &dev).unwrap();
        let s: f32 = a
            .matmul(&a)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert_eq!(s, 256.0 * 256.0 * 256.0);
    }
}
