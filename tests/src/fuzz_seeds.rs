//! The model-file seeds of the fuzz target `model_file` (fuzz/fuzz_targets/model_file.rs): a
//! tiny random Llama as GGUF (a 400-token slice of SmolLM2's vocabulary and merges, its chat
//! template, 1 layer of width 16) and the same as a Hugging Face directory (config.json,
//! tokenizer.json, model.safetensors). A seed's first byte picks the file the target feeds; the
//! directory's other files are the fixtures in fuzz/fixtures/tiny-hf. tests/tests/fuzz_seeds.rs
//! checks that the committed seeds load and are what this code writes
//! (`KVQ_WRITE_FUZZ_SEEDS=1` rewrites them).

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::collections::{HashMap, HashSet};
use std::path::Path;

const VOCAB: usize = 400;
const HIDDEN: usize = 16;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = HIDDEN / HEADS;
const FFN: usize = 32;

fn random(shape: &[usize], seed: &mut u64, scale: f32, offset: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            offset + scale * (((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5)
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).expect("tensor")
}

/// (GGUF name, Hugging Face name, shape, scale, offset) of every tensor.
fn tensors() -> Vec<(String, String, Vec<usize>, f32, f32)> {
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let mut t = vec![(
        "token_embd.weight".into(),
        "model.embed_tokens.weight".into(),
        vec![VOCAB, HIDDEN],
        0.5,
        0.0,
    )];
    for (g, h, shape, scale, offset) in [
        ("attn_norm", "input_layernorm", vec![HIDDEN], 0.1, 1.0),
        ("attn_q", "self_attn.q_proj", vec![q, HIDDEN], 0.3, 0.0),
        ("attn_k", "self_attn.k_proj", vec![kv, HIDDEN], 0.3, 0.0),
        ("attn_v", "self_attn.v_proj", vec![kv, HIDDEN], 0.3, 0.0),
        ("attn_output", "self_attn.o_proj", vec![HIDDEN, q], 0.3, 0.0),
        (
            "ffn_norm",
            "post_attention_layernorm",
            vec![HIDDEN],
            0.1,
            1.0,
        ),
        ("ffn_gate", "mlp.gate_proj", vec![FFN, HIDDEN], 0.3, 0.0),
        ("ffn_up", "mlp.up_proj", vec![FFN, HIDDEN], 0.3, 0.0),
        ("ffn_down", "mlp.down_proj", vec![HIDDEN, FFN], 0.3, 0.0),
    ] {
        t.push((
            format!("blk.0.{g}.weight"),
            format!("model.layers.0.{h}.weight"),
            shape,
            scale,
            offset,
        ));
    }
    t.push((
        "output_norm.weight".into(),
        "model.norm.weight".into(),
        vec![HIDDEN],
        0.1,
        1.0,
    ));
    t
}

fn strings(v: &Value) -> Vec<String> {
    match v {
        Value::Array(items) => items
            .iter()
            .filter_map(|i| i.to_string().ok().cloned())
            .collect(),
        _ => panic!("not an array"),
    }
}

fn with_selector(selector: u8, bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![selector];
    out.extend_from_slice(bytes);
    out
}

/// Writes the seeds into `seeds` and the directory's fixture files into `fixtures`, from the
/// SmolLM2 GGUF at `source`.
pub fn write_model_seeds(source: &Path, seeds: &Path, fixtures: &Path) {
    std::fs::create_dir_all(seeds).expect("seeds dir");
    std::fs::create_dir_all(fixtures).expect("fixtures dir");

    let mut file = std::fs::File::open(source).expect("the fetched SmolLM2 GGUF");
    let src = gguf_file::Content::read(&mut file).expect("read GGUF");
    let tokens: Vec<String> = strings(&src.metadata["tokenizer.ggml.tokens"])[..VOCAB].to_vec();
    let known: HashSet<&str> = tokens.iter().map(String::as_str).collect();
    let merges: Vec<Value> = strings(&src.metadata["tokenizer.ggml.merges"])
        .into_iter()
        .filter(|m| {
            let mut parts = m.splitn(2, ' ');
            let (a, b) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            known.contains(a) && known.contains(b) && known.contains(format!("{a}{b}").as_str())
        })
        .map(Value::String)
        .collect();
    let types = match &src.metadata["tokenizer.ggml.token_type"] {
        Value::Array(t) => t[..VOCAB].to_vec(),
        _ => panic!("token types"),
    };
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        (
            "general.name".into(),
            Value::String("tiny-fuzz-seed".into()),
        ),
        ("llama.block_count".into(), Value::U32(1)),
        ("llama.context_length".into(), Value::U32(256)),
        ("llama.embedding_length".into(), Value::U32(HIDDEN as u32)),
        ("llama.feed_forward_length".into(), Value::U32(FFN as u32)),
        (
            "llama.attention.head_count".into(),
            Value::U32(HEADS as u32),
        ),
        (
            "llama.attention.head_count_kv".into(),
            Value::U32(KV_HEADS as u32),
        ),
        ("llama.rope.freq_base".into(), Value::F32(10000.0)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-5),
        ),
        (
            "llama.rope.dimension_count".into(),
            Value::U32(HEAD_DIM as u32),
        ),
        ("llama.vocab_size".into(), Value::U32(VOCAB as u32)),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.iter().cloned().map(Value::String).collect()),
        ),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
    ];
    for key in [
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_space_prefix",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.chat_template",
    ] {
        meta.push((key.into(), src.metadata[key].clone()));
    }

    let mut seed = 7u64;
    let mut gguf_tensors = Vec::new();
    let mut hf_tensors = HashMap::new();
    for (gguf_name, hf_name, shape, scale, offset) in tensors() {
        let t = random(&shape, &mut seed, scale, offset);
        gguf_tensors.push((
            gguf_name,
            QTensor::quantize(&t, GgmlDType::F32).expect("f32"),
        ));
        hf_tensors.insert(hf_name, t);
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> =
        gguf_tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut gguf = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut gguf, &meta_refs, &tensor_refs).expect("write GGUF");
    let gguf = gguf.into_inner();
    std::fs::write(seeds.join("gguf-tiny-llama"), with_selector(0, &gguf)).expect("seed");

    // The same model as a Hugging Face directory.
    let content = gguf_file::Content::read(&mut std::io::Cursor::new(&gguf)).expect("reread");
    let tokenizer = kvq_models::Tokenizer::from_gguf(&content).expect("tiny tokenizer");
    tokenizer
        .save_hf_files(fixtures, tokenizer.chat_template())
        .expect("tokenizer files");
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": true,
    });
    std::fs::write(fixtures.join("config.json"), format!("{config:#}\n")).expect("config");
    let st = fixtures.join("model.safetensors");
    candle_core::safetensors::save(&hf_tensors, &st).expect("safetensors");
    let st_bytes = std::fs::read(&st).expect("read safetensors");
    std::fs::remove_file(&st).expect("the fixture keeps no weights");
    std::fs::write(
        seeds.join("safetensors-tiny-llama"),
        with_selector(1, &st_bytes),
    )
    .expect("seed");
    for (selector, name) in [(3u8, "config.json"), (5, "tokenizer.json")] {
        let bytes = std::fs::read(fixtures.join(name)).expect("fixture");
        std::fs::write(
            seeds.join(format!("hf-{name}")),
            with_selector(selector, &bytes),
        )
        .expect("seed");
    }
}

/// Loads the seeds as the target would without mutation: the GGUF, and the directory of the
/// fixtures with the seed's weights; panics unless both give a model.
pub fn check_model_seeds(seeds: &Path, fixtures: &Path) {
    let dir = std::env::temp_dir().join(format!("kvq-make-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let gguf = std::fs::read(seeds.join("gguf-tiny-llama")).expect("seed");
    std::fs::write(dir.join("tiny.gguf"), &gguf[1..]).expect("write");
    kvq_models::load(&dir.join("tiny.gguf"), &mut |_, _| {}).expect("the GGUF seed loads");
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).expect("hf");
    for entry in std::fs::read_dir(fixtures).expect("fixtures") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), hf.join(entry.file_name())).expect("copy");
    }
    let st = std::fs::read(seeds.join("safetensors-tiny-llama")).expect("seed");
    std::fs::write(hf.join("model.safetensors"), &st[1..]).expect("write");
    kvq_models::load(&hf, &mut |_, _| {}).expect("the safetensors seed loads");
    std::fs::remove_dir_all(&dir).expect("clean up");
}
