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
//! code only ever calls the op functions, so a `cuda_fwd` or `metal_fwd` can be added to the ops
//! (dispatching on [`KeyCodec::kernel`] / [`ValueCodec::kernel`]) without touching the caches.

mod attend;
mod codec;
#[cfg(feature = "cuda")]
pub mod cuda;
mod encode;
mod math;
mod nearest;
mod pool;
pub mod spec;
mod storage;

pub use attend::{AttendParams, Partial, attend_reference, compressed_attend, merge_partial};
pub use codec::{KernelData, KernelKind, KeyCodec, ValueCodec};
pub use encode::{encode_keys, encode_reference, encode_values};
pub use nearest::{NearestCodebook, nearest_centroid, nearest_centroid_reference};
