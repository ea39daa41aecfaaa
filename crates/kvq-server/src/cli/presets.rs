//! Loading the cache presets (`configs/cache/*.toml`) into a registry, for every subcommand.

use anyhow::Context;
use kvq_cache::CacheRegistry;
use std::path::Path;

/// Where presets live when no directory is given.
pub const DEFAULT_DIR: &str = "configs/cache";

/// Loads the presets of `dir`; without one, of `configs/cache` when that exists (a missing default
/// directory is not an error, a missing explicit one is).
pub fn load(registry: &mut CacheRegistry, dir: Option<&Path>) -> anyhow::Result<()> {
    let dir = match dir {
        Some(d) => d,
        None if Path::new(DEFAULT_DIR).is_dir() => Path::new(DEFAULT_DIR),
        None => {
            tracing::info!("no {DEFAULT_DIR} directory here: no cache presets loaded");
            return Ok(());
        }
    };
    let names = registry
        .load_presets(dir)
        .with_context(|| format!("could not load the cache presets in {}", dir.display()))?;
    tracing::info!(dir = %dir.display(), presets = %names.join(", "), "cache presets");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq_cache::CacheSpec;

    fn shipped() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/cache")
    }

    #[test]
    fn shipped_presets_load_and_resolve() {
        let mut r = CacheRegistry::builtin();
        load(&mut r, Some(&shipped())).unwrap();
        for name in [
            "turboquant-mse-4bit",
            "turboquant-mse-3bit",
            "turboquant-prod-4bit",
            "turboquant-prod-3bit",
            "turboquant-rvq-4bit",
            "turboquant-rvq-2bit",
            "qjl-4bit",
            "qjl-3bit",
            "vecinfer-2bit",
            "vecinfer-1bit",
        ] {
            assert!(r.names().contains(&name.to_string()), "{name} missing");
            let base = r.base_method(name).unwrap();
            assert!(name.starts_with(base), "{name} builds {base}");
        }
        // A preset resolves to its own default bits; x-kv-cache-bits overrides them.
        let spec = |bits| CacheSpec {
            method: Some("turboquant-mse-3bit".into()),
            bits,
        };
        assert_eq!(r.resolve(&spec(None)).unwrap().bits, 3);
        assert_eq!(r.resolve(&spec(Some(2))).unwrap().bits, 2);
        assert!(r.resolve(&spec(Some(7))).is_err());
    }

    #[test]
    fn a_broken_preset_names_its_file() {
        let dir = std::env::temp_dir().join(format!("kvq-presets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("bad.toml"), "method = \"zip\"\n").unwrap();
        let mut r = CacheRegistry::builtin();
        let err = format!("{:#}", load(&mut r, Some(&dir)).unwrap_err());
        std::fs::remove_dir_all(&dir).ok();
        assert!(
            err.contains("bad.toml") && err.contains("unknown method 'zip'"),
            "{err}"
        );
        assert!(err.contains("fp16"), "lists valid methods: {err}");
    }

    #[test]
    fn a_missing_explicit_directory_is_an_error() {
        let mut r = CacheRegistry::builtin();
        assert!(load(&mut r, Some(Path::new("/nonexistent/kvq-presets"))).is_err());
    }
}
