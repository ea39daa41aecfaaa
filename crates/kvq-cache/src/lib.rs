//! kvq-cache: the `KvCache` trait every attention layer talks to, the cache methods and the registry that maps method names to factories.
//!
//! Invariant: a model hands a cache its new keys (after RoPE) and values, then asks the cache for the
//! attention output of its queries. The cache owns attention, so a compressed method can score keys
//! without ever materializing them in fp16.

pub mod attention;
pub mod codec;
pub mod compressed;
pub mod error;
pub mod methods;
pub mod params;
pub mod registry;
pub mod rowbuf;
pub mod state;
mod tiles;
pub mod traits;

#[cfg(test)]
mod rolling_tests;

#[cfg(test)]
mod centering_tests;

#[cfg(test)]
mod tensor_path_tests;

#[cfg(test)]
mod fork_tests;

#[cfg(test)]
mod state_tests;

#[cfg(test)]
mod state_error_tests;

#[cfg(test)]
pub(crate) mod testkit;

pub use error::CacheError;
pub use registry::{CacheRegistry, CacheSpec, ResolvedCache};
pub use tiles::TILE_POSITIONS;
pub use traits::{CacheFactory, CacheGeometry, CacheState, KvCache, LayerCaches};

pub type Result<T> = std::result::Result<T, CacheError>;
