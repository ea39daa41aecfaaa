//! The method registry: maps the names a request may use (`x-kv-cache-method`, `kv_cache.method`)
//! to cache factories, and validates the requested bits.

use crate::params::MethodParams;
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
    /// Names the configuration exactly (method or preset, bits, whether the request set the
    /// bits): caches built under equal keys are interchangeable, so a held prefix is reused only
    /// under its own key.
    pub key: String,
}

impl std::fmt::Debug for ResolvedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResolvedCache")
            .field("name", &self.name)
            .field("bits", &self.bits)
            .finish()
    }
}

/// What a method's builder receives.
pub struct BuildArgs<'a> {
    /// Bits the request asked for (`x-kv-cache-bits`): they override everything a preset sets.
    pub request_bits: Option<u8>,
    /// The preset's `bits`, if a preset was named and sets them.
    pub preset_bits: Option<u8>,
    /// Method parameters from a preset's `[params]` table (empty for a bare method name).
    pub params: &'a toml::Table,
    /// Where data-dependent methods get their calibration, if the server has one.
    pub calibration: Option<&'a Arc<dyn CalibrationSource>>,
}

impl<'a> BuildArgs<'a> {
    /// The bits to build with: the request's, else the preset's; `None` means the method's
    /// default.
    pub fn bits(&self) -> Option<u8> {
        self.request_bits.or(self.preset_bits)
    }

    /// The bits of one part: the request's bits, else the preset's explicit part (`key_bits`,
    /// `value_bits`), else [`Self::bits`], else `default`.
    pub fn part_bits(&self, explicit: Option<u32>, default: u32) -> u32 {
        match (self.request_bits, explicit) {
            (Some(b), _) => u32::from(b),
            (None, Some(b)) => b,
            (None, None) => self.preset_bits.map_or(default, u32::from),
        }
    }

    /// What a preset's check builds from: its own bits and params, no request, no calibration.
    pub fn check_only(params: &'a toml::Table, preset_bits: Option<u8>) -> Self {
        Self {
            request_bits: None,
            preset_bits,
            params,
            calibration: None,
        }
    }

    /// The preset's `[params]`, parsed strictly as `method`'s typed parameters.
    pub fn typed<M: MethodParams>(&self, method: &str) -> Result<M> {
        crate::params::parse(method, self.params)
    }
}

/// A method the registry can build: its name, the bits it accepts and its builder.
pub struct MethodEntry {
    pub name: &'static str,
    pub bits: Vec<u8>,
    pub default_bits: u8,
    pub build: fn(&BuildArgs<'_>) -> Result<Arc<dyn CacheFactory>>,
    /// Checks a preset's `[params]` and `bits` when it is loaded, without building (no
    /// calibration is needed): typed and strict, so a misspelt key fails at startup.
    pub check: fn(&toml::Table, Option<u8>) -> Result<()>,
}

/// Gives data-dependent methods (VecInfer) the calibration of the loaded model. Returns the
/// method's own calibration type behind `Any`, built or loaded on first use.
pub trait CalibrationSource: Send + Sync {
    fn calibration(
        &self,
        method: &str,
        params: &toml::Table,
    ) -> Result<Arc<dyn std::any::Any + Send + Sync>>;
}

struct Entry {
    base: &'static str,
    bits: Vec<u8>,
    default_bits: u8,
    /// A preset's own bits, passed to the builder when the request gives none.
    preset_bits: Option<u8>,
    params: toml::Table,
    build: fn(&BuildArgs<'_>) -> Result<Arc<dyn CacheFactory>>,
    check: fn(&toml::Table, Option<u8>) -> Result<()>,
}

/// Every method the server can build, by name.
pub struct CacheRegistry {
    entries: BTreeMap<String, Entry>,
    default: String,
    calibration: Option<Arc<dyn CalibrationSource>>,
}

impl Default for CacheRegistry {
    fn default() -> Self {
        Self::builtin()
    }
}

/// A preset file: `configs/cache/<name>.toml`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PresetFile {
    method: String,
    bits: Option<u8>,
    #[serde(default)]
    params: toml::Table,
}

impl CacheRegistry {
    /// The methods built into kvq (see `methods::all`), no presets.
    pub fn builtin() -> Self {
        let mut r = Self {
            entries: BTreeMap::new(),
            default: "fp16".to_string(),
            calibration: None,
        };
        for m in crate::methods::all() {
            r.add(m);
        }
        r
    }

    /// Adds (or replaces) a method.
    pub fn add(&mut self, m: MethodEntry) {
        self.entries.insert(
            m.name.to_string(),
            Entry {
                base: m.name,
                bits: m.bits,
                default_bits: m.default_bits,
                preset_bits: None,
                params: toml::Table::new(),
                build: m.build,
                check: m.check,
            },
        );
    }

    /// Adds a preset named `name` over an existing method, with its own default bits and params,
    /// checked by the method (typed, strict: errors name the file and the parameter).
    pub fn add_preset(&mut self, name: &str, text: &str, path: &str) -> Result<()> {
        let preset_err = |message: String| CacheError::Preset {
            path: path.to_string(),
            message,
        };
        let file: PresetFile = toml::from_str(text).map_err(|e| preset_err(e.to_string()))?;
        let base = self
            .entries
            .get(&file.method.to_ascii_lowercase())
            .ok_or_else(|| {
                preset_err(format!(
                    "unknown method '{}'; valid methods: {}",
                    file.method,
                    self.names().join(", ")
                ))
            })?;
        if let Some(b) = file.bits.filter(|b| !base.bits.contains(b)) {
            return Err(preset_err(format!(
                "method '{}' does not take {b} bits",
                file.method
            )));
        }
        (base.check)(&file.params, file.bits).map_err(|e| match e {
            CacheError::Preset { message, .. } => preset_err(message),
            other => preset_err(other.to_string()),
        })?;
        let entry = Entry {
            base: base.base,
            bits: base.bits.clone(),
            default_bits: file.bits.unwrap_or(base.default_bits),
            preset_bits: file.bits,
            params: file.params,
            build: base.build,
            check: base.check,
        };
        self.entries.insert(name.to_ascii_lowercase(), entry);
        Ok(())
    }

    /// Loads every `*.toml` preset of `dir` (file stem = preset name), sorted by name.
    pub fn load_presets(&mut self, dir: &std::path::Path) -> Result<Vec<String>> {
        let err = |e: std::io::Error| CacheError::Preset {
            path: dir.display().to_string(),
            message: e.to_string(),
        };
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(err)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        files.sort();
        let mut names = Vec::new();
        for path in files {
            let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            let text = std::fs::read_to_string(&path).map_err(err)?;
            self.add_preset(stem, &text, &path.display().to_string())?;
            names.push(stem.to_string());
        }
        Ok(names)
    }

    /// Gives data-dependent methods their calibration.
    pub fn set_calibration(&mut self, source: Arc<dyn CalibrationSource>) {
        self.calibration = Some(source);
    }

    /// The base method a name (method or preset) builds.
    pub fn base_method(&self, name: &str) -> Option<&'static str> {
        self.entries.get(&name.to_ascii_lowercase()).map(|e| e.base)
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
        // Request bits override everything; otherwise a preset's explicit per-part bits
        // (`key_bits`, `value_bits`) win over its `bits` (see `BuildArgs::part_bits`).
        let args = BuildArgs {
            request_bits: spec.bits,
            preset_bits: entry.preset_bits,
            params: &entry.params,
            calibration: self.calibration.as_ref(),
        };
        Ok(ResolvedCache {
            factory: (entry.build)(&args)?,
            key: format!(
                "{name}/{bits}/{}/{:016x}",
                spec.bits.is_some(),
                params_fingerprint(entry.base, entry.preset_bits, &entry.params)
            ),
            name,
            bits,
        })
    }
}

/// FNV-1a over a preset's method, bits and parameters (as TOML text, keys in order): a prefix
/// saved under one preset file is never restored after the file changed.
fn params_fingerprint(base: &str, preset_bits: Option<u8>, params: &toml::Table) -> u64 {
    let text = format!(
        "{base};{preset_bits:?};{}",
        toml::to_string(params).unwrap_or_default()
    );
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
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
    fn a_preset_with_a_misspelt_or_bad_parameter_does_not_load() {
        let load = |text: &str| {
            let mut r = CacheRegistry::builtin();
            r.add_preset("p", text, "configs/cache/p.toml")
                .map(|_| r.names())
                .map_err(|e| e.to_string())
        };
        let ok = "method = \"turboquant-mse\"\nbits = 4\n[params]\nwindow = 32\n";
        assert!(load(ok).is_ok_and(|n| n.contains(&"p".to_string())));
        for (text, needles) in [
            (
                "method = \"turboquant-mse\"\n[params]\nwindw = 32\n",
                &["configs/cache/p.toml", "'windw'", "window, sinks"][..],
            ),
            (
                "method = \"qjl\"\n[params]\nwindow = \"64\"\n",
                &["configs/cache/p.toml", "parameter 'window' of qjl"],
            ),
            (
                "method = \"vecinfer\"\n[params]\nsub_dim = 5\n",
                &["configs/cache/p.toml", "sub_dim", "4 or 8"],
            ),
            (
                "method = \"vecinfer\"\n[params]\ncenter_keys = false\n",
                &["'center_keys' is not a parameter of vecinfer"],
            ),
            (
                "method = \"fp16\"\n[params]\nwindow = 8\n",
                &["'window' is not a parameter of fp16", "none"],
            ),
            (
                "method = \"turboquant-rvq\"\n[params]\nkey_bits = 3\n",
                &["configs/cache/p.toml", "bits"],
            ),
        ] {
            let err = load(text).expect_err(text);
            for n in needles {
                assert!(err.contains(n), "{text}: {err} lacks {n}");
            }
        }
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
        // Every registered method is listed, sorted (the list grows as methods are added).
        let names = r.names();
        assert!(names.iter().any(|n| n == "fp16") && names.windows(2).all(|w| w[0] < w[1]));
        assert!(matches!(&err, CacheError::UnknownMethod { valid, .. } if valid == &names));
        assert!(
            err.to_string()
                .contains(&format!("valid methods: {}", names.join(", ")))
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

    #[test]
    fn preset_part_bits_win_over_its_bits_and_request_bits_win_over_both() {
        use crate::traits::CacheGeometry;
        use candle_core::{Device, Tensor};
        let mut r = CacheRegistry::builtin();
        let text = "method = \"turboquant-mse\"\nbits = 3\n[params]\nkey_bits = 4\nvalue_bits = 2\nwindow = 1\n";
        r.add_preset("mixed", text, "mixed.toml").unwrap();
        let g = CacheGeometry {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 64,
            sliding_window: None,
            max_tokens: 1024,
        };
        let split = |bits: Option<u8>| {
            let spec = CacheSpec {
                method: Some("mixed".into()),
                bits,
            };
            let mut c = r.resolve(&spec).unwrap().factory.create(0, &g).unwrap();
            let x = Tensor::ones((1, 256, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
            c.append(&x, &x).unwrap();
            c.resident_split()
        };
        let (k, v) = split(None);
        assert!(
            k > v,
            "4-bit keys ({k} B) hold more than 2-bit values ({v} B)"
        );
        let (k, v) = split(Some(3));
        assert_eq!(k, v, "request bits set both");
    }
}
