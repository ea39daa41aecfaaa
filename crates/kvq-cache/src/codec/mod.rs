//! Building blocks the compressed methods share: bit packing, the randomized Hadamard rotation,
//! data-free Lloyd-Max scalar codebooks, seeded random matrices and the one random stream.

pub mod bitpack;
pub mod hadamard;
pub mod kmeans;
pub mod lloyd_max;
pub mod rng;
pub mod sketch;
