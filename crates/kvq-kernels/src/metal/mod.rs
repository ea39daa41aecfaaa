//! The Metal backend's plain-Rust parts, compiled on every platform: the dispatch geometry of
//! each kernel in `kernels/metal/` ([`dispatch`]) and the parameter structs the kernels read
//! ([`params`]), so the CPU emulator (crates/kvq-metal-emu) runs exactly the dispatch and the
//! bytes a Mac's `metal_fwd` will. With the `metal` feature, [`backend`] (library and pipeline
//! caches, dispatch encoding) and the ops' `metal_fwd` bodies.

#[cfg(feature = "metal")]
mod attend_ops;
#[cfg(feature = "metal")]
pub mod backend;
pub mod dispatch;
#[cfg(feature = "metal")]
mod encode_ops;
#[cfg(feature = "metal")]
pub(crate) mod ops;
pub mod params;
