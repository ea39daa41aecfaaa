//! The cache methods, one folder each. Adding a method means adding a folder here (with an
//! `entry()` describing its name, bits and builder) and listing it in `all`.

pub mod dense;
pub mod qjl;
pub mod turboquant_mse;
pub mod turboquant_prod;
pub mod turboquant_rvq;
pub mod vecinfer;

use crate::registry::MethodEntry;

/// Every built-in method, in the order `kvq` lists them.
pub fn all() -> Vec<MethodEntry> {
    vec![
        dense::fp16_entry(),
        dense::f32_entry(),
        turboquant_mse::entry(),
        qjl::entry(),
        turboquant_prod::entry(),
        turboquant_rvq::entry(),
        vecinfer::entry(),
    ]
}
