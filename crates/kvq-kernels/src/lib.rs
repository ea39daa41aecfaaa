//! kvq-kernels: the hot paths of the compressed caches as candle custom ops.
//!
//! A method describes its codes through two traits, [`KeyCodec`] (encode a key, prepare a query,
//! score a run of key codes) and [`ValueCodec`] (encode a value, accumulate probability-weighted
//! values from codes). The ops are generic over them:
//! - [`encode_keys`] / [`encode_values`]: `[heads, t, d]` f32 to `[heads, t, code_bytes]` u8;
//! - [`compressed_attend`]: fused score + softmax + value accumulation over the compressed
//!   positions of every query row, returning a partial softmax state that the cache merges with
//!   its fp16 rows (sinks and recent window) through [`merge_partial`].
//!
//! Each op has a plain `*_reference` function that is the definition of correct, and the cache
//! code only ever calls the op functions. With the `cuda` feature the ops also have a `cuda_fwd`
//! (module `cuda`), which runs a codec from its [`spec`] (`kernel_data()`) without the caches knowing;
//! with the `metal` feature a `metal_fwd` (module `metal`: the kernels of `kernels/metal`, which
//! the CPU emulator crates/kvq-metal-emu also runs).
//!
//! Beside the ops, the kernels the codecs call row by row: [`bitpack`] (the packed b-bit layout
//! of every code row) and [`turboquant`] (the CPU loops of the rotated scalar codebooks: scores
//! and value sums over packed rows, AVX-512 or portable, and the fast encode's threshold count).

mod attend;
pub mod bitpack;
mod codec;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dense_scores;
mod encode;
pub mod fast_geometry;
mod math;
pub mod metal;
mod nearest;
mod pool;
pub mod spec;
mod storage;
pub mod turboquant;

pub use attend::{AttendParams, Partial, attend_reference, compressed_attend, merge_partial};
pub use codec::{KernelData, KernelKind, KeyCodec, ValueCodec};
pub use dense_scores::{KeyColumns, ScoreRows, add_scores_f16};
pub use encode::{encode_keys, encode_reference, encode_values};
pub use math::exp_sub_sum;
pub use nearest::{NearestCodebook, nearest_centroid, nearest_centroid_reference};
pub use pool::for_each_row;
