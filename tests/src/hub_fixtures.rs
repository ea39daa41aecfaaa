//! Repositories for the fake Hub, made from what the tests have without the internet: the real
//! SmolLM2 GGUF (whole, and split in two parts as llama.cpp's gguf-split writes them) and a tiny
//! random Llama checkpoint in sharded safetensors (an index and two shards) with SmolLM2's
//! tokenizer and chat template.

use crate::checkpoints::Init;
use crate::fake_hub::{HubFile, HubRepo};
use candle_core::DType;
use candle_core::quantized::gguf_file::{self, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Writes `src` as two GGUF parts `{prefix}-00001-of-00002.gguf` and `-00002-of-00002.gguf`
/// into `dir`: the first with all metadata and half the tensors, the second with the rest, both
/// with llama.cpp's `split.no`, `split.count` and `split.tensors.count`.
pub fn split_gguf(src: &Path, dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut file = std::fs::File::open(src).expect("open gguf");
    let content = gguf_file::Content::read(&mut file).expect("read gguf");
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort_by_key(|n| content.tensor_infos[*n].offset);
    let tensors: Vec<(&str, candle_core::quantized::QTensor)> = names
        .iter()
        .map(|n| {
            let t = content
                .tensor(&mut file, n, &candle_core::Device::Cpu)
                .expect("tensor");
            (n.as_str(), t)
        })
        .collect();
    let half = tensors.len() / 2;
    let total = Value::I32(tensors.len() as i32);
    let count = Value::U16(2);
    let mut paths = Vec::new();
    for (no, part) in [&tensors[..half], &tensors[half..]].into_iter().enumerate() {
        let split_no = Value::U16(no as u16);
        let mut meta: Vec<(&str, &Value)> = vec![
            ("split.no", &split_no),
            ("split.count", &count),
            ("split.tensors.count", &total),
        ];
        if no == 0 {
            // The writer aligns to 32 bytes; any other alignment the source names would lie.
            meta.extend(
                content
                    .metadata
                    .iter()
                    .filter(|(k, _)| k.as_str() != "general.alignment")
                    .map(|(k, v)| (k.as_str(), v)),
            );
        }
        let refs: Vec<(&str, &candle_core::quantized::QTensor)> =
            part.iter().map(|(n, t)| (*n, t)).collect();
        let path = dir.join(format!("{prefix}-{:05}-of-00002.gguf", no + 1));
        let mut out = std::fs::File::create(&path).expect("create part");
        gguf_file::write(&mut out, &meta, &refs).expect("write part");
        paths.push(path);
    }
    paths
}

/// The tiny checkpoint's geometry (SmolLM2's vocabulary, so its tokenizer fits).
pub const TINY_VOCAB: usize = 49152;
const HIDDEN: usize = 32;
const HEAD_DIM: usize = 8;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const FFN: usize = 64;
const LAYERS: usize = 2;

/// Writes a random Llama checkpoint into `dir`: config.json, SmolLM2's tokenizer.json and
/// tokenizer_config.json (from `gguf`), and f16 weights in two shards named by
/// `model.safetensors.index.json`.
pub fn tiny_checkpoint(dir: &Path, gguf: &Path) {
    let mut file = std::fs::File::open(gguf).expect("open gguf");
    let content = gguf_file::Content::read(&mut file).expect("read gguf");
    kvq_models::Tokenizer::from_gguf(&content)
        .expect("tokenizer")
        .save_hf_files(dir, None)
        .expect("tokenizer files");
    let mut w = Init::new(11);
    w.put("model.embed_tokens.weight", &[TINY_VOCAB, HIDDEN], 0.5, 0.0);
    for l in 0..LAYERS {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
        w.put(p("self_attn.q_proj.weight"), &[q, HIDDEN], 0.2, 0.0);
        w.put(p("self_attn.k_proj.weight"), &[kv, HIDDEN], 0.2, 0.0);
        w.put(p("self_attn.v_proj.weight"), &[kv, HIDDEN], 0.2, 0.0);
        w.put(p("self_attn.o_proj.weight"), &[HIDDEN, q], 0.2, 0.0);
        w.put(p("mlp.gate_proj.weight"), &[FFN, HIDDEN], 0.2, 0.0);
        w.put(p("mlp.up_proj.weight"), &[FFN, HIDDEN], 0.2, 0.0);
        w.put(p("mlp.down_proj.weight"), &[HIDDEN, FFN], 0.2, 0.0);
        w.put(p("input_layernorm.weight"), &[HIDDEN], 0.1, 1.0);
        w.put(p("post_attention_layernorm.weight"), &[HIDDEN], 0.1, 1.0);
    }
    w.put("model.norm.weight", &[HIDDEN], 0.1, 1.0);
    // The embedding alone in the first shard, everything else in the second.
    let mut shards: [HashMap<String, candle_core::Tensor>; 2] = Default::default();
    for (name, t) in &w.tensors {
        let t = t.to_dtype(DType::F16).expect("f16");
        shards[usize::from(name != "model.embed_tokens.weight")].insert(name.clone(), t);
    }
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let name = format!("model-{:05}-of-00002.safetensors", i + 1);
        candle_core::safetensors::save(shard, dir.join(&name)).expect("save shard");
        let mut names: Vec<&String> = shard.keys().collect();
        names.sort();
        for tensor in names {
            weight_map.insert(tensor.clone(), name.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": TINY_VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": true,
        "torch_dtype": "float16",
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
}

/// A fixture repository of every file in `dir` (top level), at `commit`; `*.safetensors` and
/// `*.gguf` are LFS files, as on the Hub.
pub fn repo_of_dir(id: &str, commit: &str, dir: &Path, token: Option<&str>) -> HubRepo {
    let mut files: Vec<HubFile> = std::fs::read_dir(dir)
        .expect("read fixture dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .map(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            let name = name.unwrap_or_default();
            HubFile {
                lfs: name.ends_with(".safetensors") || name.ends_with(".gguf"),
                data: std::fs::read(&p).expect("read fixture").into(),
                path: name,
            }
        })
        .collect();
    files.sort_by(|a, b| a.path.cmp(&b.path));
    HubRepo {
        id: id.into(),
        commit: commit.into(),
        files,
        token: token.map(String::from),
    }
}
