//! Rotary position tables, with the per-frequency scaling of Llama 3.1+ (`rope_scaling` of
//! `rope_type: "llama3"` in config.json, or the `rope_freqs.weight` factors llama.cpp's converter
//! writes into a GGUF) and linear position interpolation.

use super::config::ModelConfig;
use crate::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

/// The rotary frequencies of one base: `1 / (theta^(2i/d) * factor_i)` for the `d/2` pairs,
/// `factor_i` being the config's `rope_freq_factors` (1 without scaling).
pub fn inv_freqs(cfg: &ModelConfig, theta: f32) -> Vec<f32> {
    let d = cfg.head_dim;
    (0..d / 2)
        .map(|i| {
            let f = cfg
                .rope_freq_factors
                .as_ref()
                .and_then(|v| v.get(i).copied())
                .unwrap_or(1.0);
            1.0 / (theta.powf(2.0 * i as f32 / d as f32) * f)
        })
        .collect()
}

/// cos and sin of every position's angles, `[context, head_dim / 2]` each.
pub fn rope_tables(cfg: &ModelConfig, theta: f32, device: &Device) -> Result<(Tensor, Tensor)> {
    let inv = inv_freqs(cfg, theta);
    let half = inv.len();
    let inv = Tensor::from_vec(inv, (1, half), device)?;
    let t = Tensor::arange(0u32, cfg.context_length as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((cfg.context_length, 1))?;
    let freqs = t.broadcast_mul(&inv)?;
    Ok((freqs.cos()?.contiguous()?, freqs.sin()?.contiguous()?))
}

fn num(obj: &serde_json::Map<String, Value>, key: &str) -> Result<f32> {
    obj.get(key)
        .and_then(Value::as_f64)
        .map(|x| x as f32)
        .filter(|x| x.is_finite() && *x > 0.0)
        .ok_or_else(|| {
            ModelError::Invalid(format!(
                "config.json: rope_scaling.{key} must be a positive number"
            ))
        })
}

/// The divisors of each rotary frequency that config.json's `rope_scaling` asks for, or None when
/// it asks for none. `llama3` (Llama 3.1/3.2/3.3) leaves the high frequencies, divides the low ones
/// by `factor` and blends in between, as Hugging Face's `_compute_llama3_parameters` does;
/// `linear` divides all by `factor`. Other kinds (dynamic NTK, YaRN, LongRoPE) are not applied:
/// a warning says so and the plain frequencies are used.
pub fn hf_freq_factors(
    scaling: Option<&Value>,
    head_dim: usize,
    theta: f32,
) -> Result<Option<Vec<f32>>> {
    let obj = match scaling {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(obj)) => obj,
        Some(_) => {
            return Err(ModelError::Invalid(
                "config.json: rope_scaling must be an object or null".into(),
            ));
        }
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let half = head_dim / 2;
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(vec![num(obj, "factor")?; half])),
        "llama3" => {
            let factor = num(obj, "factor")?;
            let low = num(obj, "low_freq_factor")?;
            let high = num(obj, "high_freq_factor")?;
            let old_ctx = num(obj, "original_max_position_embeddings")?;
            if high <= low {
                return Err(ModelError::Invalid(
                    "config.json: rope_scaling.high_freq_factor must exceed low_freq_factor".into(),
                ));
            }
            let (low_wavelen, high_wavelen) = (old_ctx / low, old_ctx / high);
            let factors = (0..half)
                .map(|i| {
                    let inv = 1.0 / theta.powf(2.0 * i as f32 / head_dim as f32);
                    let wavelen = 2.0 * std::f32::consts::PI / inv;
                    if wavelen < high_wavelen {
                        1.0
                    } else if wavelen > low_wavelen {
                        factor
                    } else {
                        let smooth = (old_ctx / wavelen - low) / (high - low);
                        1.0 / ((1.0 - smooth) / factor + smooth)
                    }
                })
                .collect();
            Ok(Some(factors))
        }
        other => {
            tracing::warn!(
                "config.json has rope_scaling of type '{other}', which kvq does not apply: \
                 contexts past the original training length drift from the reference"
            );
            Ok(None)
        }
    }
}

/// Checks the `rope_freqs.weight` factors of a GGUF: one positive finite divisor per pair.
pub fn check_gguf_factors(factors: Vec<f32>, head_dim: usize) -> Result<Vec<f32>> {
    if factors.len() != head_dim / 2 {
        return Err(ModelError::Invalid(format!(
            "rope_freqs.weight has {} values; the model's head_dim {head_dim} needs {}",
            factors.len(),
            head_dim / 2
        )));
    }
    if factors.iter().any(|f| !f.is_finite() || *f <= 0.0) {
        return Err(ModelError::Invalid(
            "rope_freqs.weight holds a factor that is not a positive number".into(),
        ));
    }
    Ok(factors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn llama31() -> Value {
        json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    }

    /// Llama 3.1 8B's scaling (theta 500000, head_dim 128): short wavelengths (< 2048 positions)
    /// keep their frequency, long ones (> 8192) are divided by 8, the band between blends
    /// monotonically; the numbers are Hugging Face's formula worked by hand for one pair.
    #[test]
    fn llama3_factors_follow_the_wavelength_bands() {
        let f = hf_freq_factors(Some(&llama31()), 128, 500_000.0)
            .unwrap()
            .unwrap();
        assert_eq!(f.len(), 64);
        let wavelen = |i: usize| 2.0 * std::f32::consts::PI * 500_000f32.powf(i as f32 / 64.0);
        for (i, &x) in f.iter().enumerate() {
            match wavelen(i) {
                w if w < 2048.0 => assert_eq!(x, 1.0, "pair {i}"),
                w if w > 8192.0 => assert_eq!(x, 8.0, "pair {i}"),
                _ => assert!(x > 1.0 && x < 8.0, "pair {i}: {x}"),
            }
        }
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "{f:?}");
        // Pair 30: wavelength 2*pi*500000^(30/64) = 2948.30; smooth = (8192/2948.30 - 1)/3
        // = 0.59285; factor = 1/((1 - 0.59285)/8 + 0.59285) = 1.55341.
        assert!((wavelen(30) - 2948.30).abs() < 0.5, "{}", wavelen(30));
        assert!((f[30] - 1.55341).abs() < 1e-3, "{}", f[30]);
    }

    #[test]
    fn other_kinds_and_bad_values() {
        assert_eq!(hf_freq_factors(None, 64, 1e4).unwrap(), None);
        assert_eq!(hf_freq_factors(Some(&Value::Null), 64, 1e4).unwrap(), None);
        let linear = json!({"type": "linear", "factor": 2.0});
        assert_eq!(
            hf_freq_factors(Some(&linear), 8, 1e4).unwrap(),
            Some(vec![2.0; 4])
        );
        let yarn = json!({"rope_type": "yarn", "factor": 4.0});
        assert_eq!(hf_freq_factors(Some(&yarn), 8, 1e4).unwrap(), None);
        let mut bad = llama31();
        bad["factor"] = json!(-1);
        assert!(hf_freq_factors(Some(&bad), 8, 1e4).is_err());
        assert!(hf_freq_factors(Some(&json!("llama3")), 8, 1e4).is_err());
        assert!(check_gguf_factors(vec![1.0; 3], 8).is_err());
        assert!(check_gguf_factors(vec![1.0, 0.0, 1.0, 1.0], 8).is_err());
        assert_eq!(check_gguf_factors(vec![1.0; 4], 8).unwrap(), vec![1.0; 4]);
    }

    /// The tables divide each pair's angle by its factor.
    #[test]
    fn factors_divide_the_angles() {
        let cfg = |factors: Option<Vec<f32>>| ModelConfig {
            architecture: "llama".into(),
            hidden_size: 8,
            intermediate_size: 8,
            n_layers: 1,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 8,
            vocab_size: 4,
            context_length: 16,
            rope_theta: 10_000.0,
            norm_eps: 1e-5,
            rope_interleaved: false,
            sliding_window: None,
            parallel_residual: false,
            activation: "silu".into(),
            global_every: None,
            rope_theta_local: None,
            embed_scale: None,
            rope_freq_factors: factors,
        };
        let plain = inv_freqs(&cfg(None), 10_000.0);
        let scaled = inv_freqs(&cfg(Some(vec![1.0, 2.0, 4.0, 8.0])), 10_000.0);
        for i in 0..4 {
            let want = plain[i] / [1.0, 2.0, 4.0, 8.0][i];
            assert!((scaled[i] - want).abs() <= want * 1e-6, "pair {i}");
        }
        let (cos, _) =
            rope_tables(&cfg(Some(vec![1.0, 2.0, 4.0, 8.0])), 10_000.0, &Device::Cpu).unwrap();
        let row: Vec<f32> = cos.get(5).unwrap().to_vec1().unwrap();
        assert!((row[3] - (5.0 * scaled[3]).cos()).abs() < 1e-6);
    }
}
