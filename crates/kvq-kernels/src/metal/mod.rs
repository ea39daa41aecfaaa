//! The Metal backend's plain-Rust parts, compiled on every platform: the dispatch geometry of
//! each kernel in `kernels/metal/` ([`dispatch`]) and the parameter structs the kernels read
//! ([`params`]), so the CPU emulator (crates/kvq-metal-emu) runs exactly the dispatch and the
//! bytes a Mac's `metal_fwd` will.

pub mod dispatch;
pub mod params;
