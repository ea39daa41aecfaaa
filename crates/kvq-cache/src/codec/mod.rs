//! Building blocks the compressed methods share: the randomized Hadamard rotation, data-free
//! Lloyd-Max scalar codebooks, k-means, seeded random matrices and the one random stream (bit
//! packing is a kernel: `kvq_kernels::bitpack`).

pub mod hadamard;
pub mod kmeans;
pub mod lloyd_max;
pub mod rng;
pub mod sketch;
