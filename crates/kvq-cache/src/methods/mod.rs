//! The cache methods, one folder each. Adding a method means adding a folder here and registering its factory in `registry.rs`.

pub mod dense;
pub mod turboquant_mse;
