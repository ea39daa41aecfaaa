//! Building blocks the compressed methods share: the randomized Hadamard rotation, data-free
//! Lloyd-Max scalar codebooks, k-means, seeded random matrices, the one random stream, and the
//! frame and factory of the TurboQuant methods (`turboquant`). Bit packing is a kernel:
//! `kvq_kernels::bitpack`.

pub mod hadamard;
pub mod kmeans;
pub mod lloyd_max;
pub mod rng;
pub mod sketch;
pub mod turboquant;
