//! Building blocks the compressed methods share: bit packing, the randomized Hadamard rotation,
//! data-free Lloyd-Max scalar codebooks and seeded random matrices.

pub mod bitpack;
pub mod hadamard;
pub mod kmeans;
pub mod lloyd_max;
pub mod sketch;
