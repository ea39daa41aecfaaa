//! Converts a Llama GGUF into a Hugging Face directory (config.json, f32 safetensors with q/k
//! rows un-permuted back to rotate-half order, tokenizer.json, tokenizer_config.json), so the
//! safetensors loading path is tested on real weights.

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use kvq_models::Tokenizer;
use kvq_models::model::ModelConfig;
use kvq_models::model::arch::llama::hf_name;
use std::collections::HashMap;
use std::path::Path;

/// Undoes llama.cpp's q/k permutation: GGUF rows of each head are interleaved pairs
/// (`[half, 2]`), Hugging Face's are two halves (`[2, half]`).
fn unpermute(w: &Tensor, n_heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let half = rows / n_heads / 2;
    w.reshape((n_heads, half, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

/// Writes the HF directory for `gguf` into `dir`.
pub fn export(gguf: &Path, dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let mut file = std::fs::File::open(gguf)?;
    let content = gguf_file::Content::read(&mut file)?;
    let cfg = ModelConfig::from_gguf(&content)?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let q = content.tensor(&mut file, name, &dev)?;
        let mut t = q.dequantize(&dev)?;
        if name.ends_with("attn_q.weight") {
            t = unpermute(&t, cfg.n_heads)?;
        } else if name.ends_with("attn_k.weight") {
            t = unpermute(&t, cfg.n_kv_heads)?;
        }
        let hf = hf_name(name).ok_or_else(|| format!("no HF name for {name}"))?;
        tensors.insert(hf, t);
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    let tied = !content.tensor_infos.contains_key("output.weight");
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.context_length,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    let tok = Tokenizer::from_gguf(&content)?;
    let template = content
        .metadata
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
        .cloned();
    tok.save_hf_files(dir, template.as_deref())?;
    Ok(())
}
