//! Typed `[params]` of cache presets: one struct per method, the frame parameters every
//! compressed method shares flattened in, parsed strictly (an unknown key, a misspelling such as
//! `windw`, or a value of the wrong type is an error naming the key), so a preset that would
//! silently fall back to defaults never loads.

use crate::{CacheError, Result};
use serde::Deserialize;
use serde::de::DeserializeOwned;

/// A method's parameter struct: what [`parse`] fills, and the keys it accepts (for messages).
pub trait MethodParams: DeserializeOwned + Default {
    /// Every key the struct reads, in groups (the shared frame's, then the method's own), in
    /// the order a message lists them.
    const KEYS: &'static [&'static [&'static str]];

    /// [`Self::KEYS`], flat.
    fn keys() -> impl Iterator<Item = &'static str> {
        Self::KEYS.iter().flat_map(|g| g.iter().copied())
    }
}

/// The window every compressed cache keeps in fp16 and the seed of its random parts.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct WindowParams {
    /// Most recent tokens kept in fp16.
    pub window: Option<usize>,
    /// First tokens (attention sinks) kept in fp16.
    pub sinks: Option<usize>,
    /// Seed of the rotations, sketches and codebook initialisation.
    pub seed: Option<u64>,
}

/// The frame of the TurboQuant and QJL caches: the window plus key centering.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct FrameParams {
    #[serde(flatten)]
    pub window: WindowParams,
    /// Subtract a per-head key center before encoding.
    pub center_keys: Option<bool>,
    /// Least share (percent) of a head's key energy in its center for centering to be used.
    pub center_min_share: Option<u32>,
}

const WINDOW_KEYS: &[&str] = &["window", "sinks", "seed"];
const CENTER_KEYS: &[&str] = &["center_keys", "center_min_share"];

/// The fp16 and f32 caches take no parameters.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct NoParams {}

impl MethodParams for NoParams {
    const KEYS: &'static [&'static [&'static str]] = &[];
}

/// TurboQuant MSE, Prod and RVQ.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct TurboQuantParams {
    #[serde(flatten)]
    pub frame: FrameParams,
    /// Bits per key coordinate (the preset's `bits` otherwise).
    pub key_bits: Option<u32>,
    /// Bits per value coordinate (the preset's `bits` otherwise).
    pub value_bits: Option<u32>,
}

impl MethodParams for TurboQuantParams {
    const KEYS: &'static [&'static [&'static str]] =
        &[WINDOW_KEYS, CENTER_KEYS, &["key_bits", "value_bits"]];
}

/// QJL.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct QjlParams {
    #[serde(flatten)]
    pub frame: FrameParams,
    /// Sign-sketch rows per key.
    pub sketch_dim: Option<usize>,
    /// Bits per value element.
    pub value_bits: Option<u32>,
    /// Elements per value quantization group.
    pub group_size: Option<usize>,
    /// Outlier coordinates per key sketched apart.
    pub outliers: Option<usize>,
}

impl MethodParams for QjlParams {
    const KEYS: &'static [&'static [&'static str]] = &[
        WINDOW_KEYS,
        CENTER_KEYS,
        &["sketch_dim", "value_bits", "group_size", "outliers"],
    ];
}

/// VecInfer (no key centering: its keys are smoothed instead).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct VecInferParams {
    #[serde(flatten)]
    pub window: WindowParams,
    /// Dimensions per sub-vector (4 or 8).
    pub sub_dim: Option<usize>,
}

impl MethodParams for VecInferParams {
    const KEYS: &'static [&'static [&'static str]] = &[WINDOW_KEYS, &["sub_dim"]];
}

fn typed<M: MethodParams>(table: &toml::Table) -> std::result::Result<M, String> {
    toml::Value::Table(table.clone())
        .try_into::<M>()
        .map_err(|e| e.message().trim().to_string())
}

/// Parses `table` (a preset's `[params]`) as `method`'s parameters. Errors name the key: an
/// unknown one with the valid keys listed, a bad value with what was expected.
pub fn parse<M: MethodParams>(method: &str, table: &toml::Table) -> Result<M> {
    let err = |key: &str, message: String| CacheError::Preset {
        path: key.to_string(),
        message,
    };
    // Serde cannot deny unknown fields of a struct with flattened parts: the declared keys do.
    if let Some(key) = table.keys().find(|k| !M::keys().any(|v| v == k.as_str())) {
        let valid = match M::KEYS.is_empty() {
            true => "none".to_string(),
            false => M::keys().collect::<Vec<_>>().join(", "),
        };
        return Err(err(
            key,
            format!("'{key}' is not a parameter of {method}; valid parameters: {valid}"),
        ));
    }
    typed::<M>(table).map_err(|message| {
        // Nor do flattened parts say which key failed: the first key that fails alone does.
        let culprit = table.iter().find_map(|(key, value)| {
            let one = toml::Table::from_iter([(key.clone(), value.clone())]);
            typed::<M>(&one).err().map(|m| (key, m))
        });
        match culprit {
            Some((key, m)) => err(key, format!("parameter '{key}' of {method}: {m}")),
            None => err(method, format!("parameters of {method}: {message}")),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> toml::Table {
        toml::from_str(text).unwrap()
    }

    fn message<M: MethodParams + std::fmt::Debug>(text: &str) -> String {
        parse::<M>("m", &table(text)).unwrap_err().to_string()
    }

    #[test]
    fn every_declared_key_is_read_by_its_struct() {
        fn check<M: MethodParams + PartialEq + std::fmt::Debug>() {
            for key in M::keys() {
                let value = match key {
                    "center_keys" => toml::Value::Boolean(false),
                    _ => toml::Value::Integer(8),
                };
                let t = toml::Table::from_iter([(key.to_string(), value)]);
                let got = parse::<M>("m", &t);
                assert!(
                    got.as_ref().is_ok_and(|p| *p != M::default()),
                    "{key}: {got:?}"
                );
            }
        }
        fn all_at_once<M: MethodParams + std::fmt::Debug>() {
            let t = toml::Table::from_iter(M::keys().map(|k| {
                let v = match k {
                    "center_keys" => toml::Value::Boolean(true),
                    _ => toml::Value::Integer(4),
                };
                (k.to_string(), v)
            }));
            assert!(parse::<M>("m", &t).is_ok(), "{t}");
        }
        all_at_once::<TurboQuantParams>();
        all_at_once::<QjlParams>();
        all_at_once::<VecInferParams>();
        check::<NoParams>();
        check::<TurboQuantParams>();
        check::<QjlParams>();
        check::<VecInferParams>();
    }

    #[test]
    fn values_land_in_their_fields() {
        let p: TurboQuantParams = parse(
            "m",
            &table("window = 32\nsinks = 2\nseed = 9\ncenter_keys = false\nkey_bits = 3"),
        )
        .unwrap();
        assert_eq!(p.frame.window.window, Some(32));
        assert_eq!(p.frame.window.sinks, Some(2));
        assert_eq!(p.frame.window.seed, Some(9));
        assert_eq!(p.frame.center_keys, Some(false));
        assert_eq!(p.key_bits, Some(3));
        assert_eq!(p.value_bits, None);
        assert_eq!(
            parse::<QjlParams>("m", &table("")).unwrap(),
            QjlParams::default()
        );
    }

    #[test]
    fn an_unknown_key_is_named_with_the_valid_ones() {
        let m = message::<TurboQuantParams>("window = 32\nwindw = 32");
        assert!(m.contains("'windw' is not a parameter of m"), "{m}");
        assert!(m.contains("window, sinks, seed"), "{m}");
        // VecInfer has no key centering: the frame key of the others is unknown there.
        let m = message::<VecInferParams>("center_keys = true");
        assert!(m.contains("'center_keys'"), "{m}");
        let m = message::<NoParams>("window = 1");
        assert!(m.contains("valid parameters: none"), "{m}");
    }

    #[test]
    fn a_bad_value_names_its_parameter() {
        for (text, key) in [
            ("sinks = 4\nwindow = \"64\"", "window"),
            ("center_keys = 1", "center_keys"),
            ("sub_dim = -4", "sub_dim"),
            ("seed = 1.5", "seed"),
        ] {
            let m = match key {
                "sub_dim" => message::<VecInferParams>(text),
                _ => message::<TurboQuantParams>(text),
            };
            assert!(
                m.contains(&format!("parameter '{key}' of m")),
                "{text}: {m}"
            );
        }
    }
}
