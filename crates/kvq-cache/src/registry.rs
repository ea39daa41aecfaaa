//! The method registry: maps the names a request may use (`x-kv-cache-method`, `kv_cache.method`)
//! to cache factories, and validates the requested bits.

use crate::methods::dense::DenseFactory;
use crate::methods::turboquant_mse::TurboQuantMseFactory;
use crate::traits::CacheFactory;
use crate::{CacheError, Result};
use std::collections::BTreeMap;
use std::sync::Arc;

/// What a request asked for.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
pub struct CacheSpec {
    /// Method or preset name; `None` means the server's default.
    pub method: Option<String>,
    /// Bits per element, where the method allows a choice.
    pub bits: Option<u8>,
}

/// A validated choice: the name to report and the factory that builds its caches.
#[derive(Clone)]
pub struct ResolvedCache {
    /// The resolved name, echoed to the client (e.g. `fp16`).
    pub name: String,
    /// Bits per element the method was built with.
    pub bits: u8,
    /// Builds the per-layer caches.
    pub factory: Arc<dyn CacheFactory>,
}

impl std::fmt::Debug for ResolvedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResolvedCache")
            .field("name", &self.name)
            .field("bits", &self.bits)
            .finish()
    }
}

type Builder = Box<dyn Fn(u8) -> Result<Arc<dyn CacheFactory>> + Send + Sync>;

struct Entry {
    bits: Vec<u8>,
    default_bits: u8,
    build: Builder,
}

/// Every method the server can build, by name.
pub struct CacheRegistry {
    entries: BTreeMap<String, Entry>,
    default: String,
}

impl Default for CacheRegistry {
    fn default() -> Self {
        Self::builtin()
    }
}

impl CacheRegistry {
    /// The methods built into kvq.
    pub fn builtin() -> Self {
        let mut r = Self {
            entries: BTreeMap::new(),
            default: "fp16".to_string(),
        };
        r.register("fp16", vec![16], 16, |_| {
            Ok(Arc::new(DenseFactory::<half::f16>::new()))
        });
        r.register("f32", vec![32], 32, |_| {
            Ok(Arc::new(DenseFactory::<f32>::new()))
        });
        r.register("turboquant-mse", vec![2, 3, 4], 4, |b| {
            Ok(Arc::new(TurboQuantMseFactory::new(u32::from(b))))
        });
        r
    }

    /// Adds (or replaces) a method.
    pub fn register(
        &mut self,
        name: &str,
        bits: Vec<u8>,
        default_bits: u8,
        build: impl Fn(u8) -> Result<Arc<dyn CacheFactory>> + Send + Sync + 'static,
    ) {
        self.entries.insert(
            name.to_string(),
            Entry {
                bits,
                default_bits,
                build: Box::new(build),
            },
        );
    }

    /// The valid names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }

    /// The method used when a request names none.
    pub fn default_method(&self) -> &str {
        &self.default
    }

    /// Makes `name` the method used when a request names none.
    pub fn set_default(&mut self, name: &str) -> Result<()> {
        let name = name.trim().to_ascii_lowercase();
        if !self.entries.contains_key(&name) {
            return Err(CacheError::UnknownMethod {
                name,
                valid: self.names(),
            });
        }
        self.default = name;
        Ok(())
    }

    /// Validates a request's choice and returns the factory to build its caches with.
    pub fn resolve(&self, spec: &CacheSpec) -> Result<ResolvedCache> {
        let name = spec
            .method
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .unwrap_or(&self.default)
            .to_ascii_lowercase();
        let entry = self
            .entries
            .get(&name)
            .ok_or_else(|| CacheError::UnknownMethod {
                name: name.clone(),
                valid: self.names(),
            })?;
        let bits = spec.bits.unwrap_or(entry.default_bits);
        if !entry.bits.contains(&bits) {
            return Err(CacheError::InvalidBits {
                method: name,
                bits,
                valid: entry.bits.clone(),
            });
        }
        Ok(ResolvedCache {
            factory: (entry.build)(bits)?,
            name,
            bits,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_fp16() {
        let r = CacheRegistry::builtin();
        let c = r.resolve(&CacheSpec::default()).unwrap();
        assert_eq!(c.name, "fp16");
        assert_eq!(c.factory.method(), "fp16");
    }

    #[test]
    fn names_are_case_insensitive() {
        let r = CacheRegistry::builtin();
        let spec = CacheSpec {
            method: Some(" FP16 ".into()),
            bits: None,
        };
        assert_eq!(r.resolve(&spec).unwrap().name, "fp16");
    }

    #[test]
    fn unknown_method_lists_valid_names() {
        let r = CacheRegistry::builtin();
        let spec = CacheSpec {
            method: Some("zip".into()),
            bits: None,
        };
        let err = r.resolve(&spec).unwrap_err();
        assert!(
            matches!(&err, CacheError::UnknownMethod { valid, .. } if valid == &["f32", "fp16", "turboquant-mse"])
        );
        assert!(
            err.to_string()
                .contains("valid methods: f32, fp16, turboquant-mse")
        );
    }

    #[test]
    fn default_can_change_to_a_known_method_only() {
        let mut r = CacheRegistry::builtin();
        r.set_default("F32").unwrap();
        assert_eq!(r.resolve(&CacheSpec::default()).unwrap().name, "f32");
        assert!(r.set_default("nope").is_err());
        assert_eq!(r.default_method(), "f32");
    }

    #[test]
    fn invalid_bits_rejected() {
        let r = CacheRegistry::builtin();
        let spec = CacheSpec {
            method: Some("fp16".into()),
            bits: Some(3),
        };
        assert!(matches!(
            r.resolve(&spec),
            Err(CacheError::InvalidBits { bits: 3, .. })
        ));
    }
}
