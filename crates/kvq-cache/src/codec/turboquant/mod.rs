//! What the three TurboQuant methods (MSE, Prod, RVQ; `crate::methods::turboquant_*`) share and
//! no one of them owns: the rotated scalar-codebook frame of a layer's codes (`rotated`: seeded
//! randomized Hadamard rotations, fp16 norm, packed b-bit indices, scored and summed through
//! `kvq_kernels::turboquant`) and the factory and registry entry built from bits per coordinate
//! (`factory`).

pub mod factory;
pub(crate) mod rotated;

pub use factory::{BitsFactory, BitsMethod, invalid_bits};
pub(crate) use rotated::Rotated;
