//! The fast CPU paths of the TurboQuant codebook kernels: AVX-512 F/BW/VBMI (x86-64, detected at
//! run time) and the portable Rust fallback, both checked against the plain references in the
//! parent module.

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512;
pub(super) mod portable;
