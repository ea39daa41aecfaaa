//! Falcon on small random checkpoints in the Hugging Face layout (no Falcon weights are reachable
//! here), in its three layer layouts: Falcon-7B (multi-query, attention and MLP in parallel on one
//! norm), the old multi-head sequential layout with biases, and the new decoder architecture of
//! 40B/180B (grouped kv heads, two norms). kvq's logits are checked against candle-transformers'
//! own Falcon loaded from the same files where it implements the layout (7B and the old one; for
//! the new decoder with one kv head, against the equivalent 7B checkpoint), and against a plain
//! reference forward written here from transformers' definition for grouped kv heads, which
//! candle does not implement. Then every cache method runs on Falcon.
//!
//! The checkpoints use `activation = "gelu_pytorch_tanh"` because candle's Falcon applies GELU's
//! tanh approximation; kvq reads the activation from the config (`gelu`, the default, is exact).

use candle_core::{D, DType, Device, IndexOp, Tensor};
use candle_transformers::models::falcon;
use kvq_cache::CacheRegistry;
use kvq_tests::checkpoints::{
    Init, every_method, factory, kvq_model, max_rel_diff, mean_rel_l2, run_method, step_logits,
    tokens,
};
use kvq_tests::scratch_dir;
use std::collections::HashMap;
use std::path::Path;

const VOCAB: usize = 96;
const HIDDEN: usize = 128;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const HD: usize = HIDDEN / HEADS;

/// One Falcon layout.
#[derive(Clone, Copy)]
struct Layout {
    multi_query: bool,
    parallel: bool,
    new_decoder: bool,
    kv_heads: usize,
    bias: bool,
}

const FALCON_7B: Layout = Layout {
    multi_query: true,
    parallel: true,
    new_decoder: false,
    kv_heads: 1,
    bias: false,
};

/// The new decoder architecture (40B/180B) with two kv head groups.
const NEW_DECODER: Layout = Layout {
    multi_query: false,
    parallel: true,
    new_decoder: true,
    kv_heads: 2,
    bias: false,
};

fn config(l: Layout) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["FalconForCausalLM"],
        "model_type": "falcon",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_kv_heads": l.kv_heads,
        "multi_query": l.multi_query,
        "parallel_attn": l.parallel,
        "new_decoder_architecture": l.new_decoder,
        "bias": l.bias,
        "alibi": false,
        "layer_norm_epsilon": 1e-5,
        "activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 2048,
        "tie_word_embeddings": false,
    })
}

/// Writes a random Falcon checkpoint of layout `l` into `dir`. The new decoder's `ln_attn` and
/// `ln_mlp` both get the tensors `input_layernorm` would have had.
fn write(dir: &Path, l: Layout) {
    let mut w = Init::new(9);
    w.put(
        "transformer.word_embeddings.weight",
        &[VOCAB, HIDDEN],
        1.0,
        0.0,
    );
    let qkv_rows = (HEADS + 2 * l.kv_heads) * HD;
    for i in 0..LAYERS {
        let p = |n: &str| format!("transformer.h.{i}.{n}");
        w.put(p("input_layernorm.weight"), &[HIDDEN], 0.1, 1.0);
        w.put(p("input_layernorm.bias"), &[HIDDEN], 0.1, 0.0);
        if !l.parallel && !l.new_decoder {
            w.put(p("post_attention_layernorm.weight"), &[HIDDEN], 0.1, 1.0);
            w.put(p("post_attention_layernorm.bias"), &[HIDDEN], 0.1, 0.0);
        }
        w.put(
            p("self_attention.query_key_value.weight"),
            &[qkv_rows, HIDDEN],
            0.1,
            0.0,
        );
        w.put(
            p("self_attention.dense.weight"),
            &[HIDDEN, HIDDEN],
            0.08,
            0.0,
        );
        w.put(
            p("mlp.dense_h_to_4h.weight"),
            &[4 * HIDDEN, HIDDEN],
            0.08,
            0.0,
        );
        w.put(
            p("mlp.dense_4h_to_h.weight"),
            &[HIDDEN, 4 * HIDDEN],
            0.05,
            0.0,
        );
        if l.bias {
            w.put(
                p("self_attention.query_key_value.bias"),
                &[qkv_rows],
                0.1,
                0.0,
            );
            w.put(p("self_attention.dense.bias"), &[HIDDEN], 0.1, 0.0);
            w.put(p("mlp.dense_h_to_4h.bias"), &[4 * HIDDEN], 0.1, 0.0);
            w.put(p("mlp.dense_4h_to_h.bias"), &[HIDDEN], 0.1, 0.0);
        }
        if l.new_decoder {
            for part in ["weight", "bias"] {
                let t = w.tensors[&p(&format!("input_layernorm.{part}"))].clone();
                w.tensors.insert(p(&format!("ln_attn.{part}")), t.clone());
                w.tensors.insert(p(&format!("ln_mlp.{part}")), t);
                w.tensors.remove(&p(&format!("input_layernorm.{part}")));
            }
        }
    }
    w.put("transformer.ln_f.weight", &[HIDDEN], 0.1, 1.0);
    w.put("transformer.ln_f.bias", &[HIDDEN], 0.1, 0.0);
    w.put("lm_head.weight", &[VOCAB, HIDDEN], 0.2, 0.0);
    w.save(dir, &config(l));
}

/// candle-transformers' Falcon from `dir` (7B or the old multi-head layout).
fn oracle(dir: &Path, l: Layout) -> falcon::Falcon {
    let cfg = falcon::Config {
        vocab_size: VOCAB,
        hidden_size: HIDDEN,
        num_hidden_layers: LAYERS,
        num_attention_heads: HEADS,
        layer_norm_epsilon: 1e-5,
        initializer_range: 0.02,
        use_cache: false,
        bos_token_id: 0,
        eos_token_id: 0,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        // candle defaults the kv heads of the multi-head layout to 1; name them.
        n_head_kv: (!l.multi_query).then_some(HEADS),
        alibi: false,
        new_decoder_architecture: false,
        multi_query: l.multi_query,
        parallel_attn: l.parallel,
        bias: l.bias,
    };
    let tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).expect("load");
    let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    falcon::Falcon::load(vb, cfg).expect("oracle model")
}

/// kvq's logits (f32 cache; a 9-token chunk, then single tokens) against `want(end)`, the logits
/// of the last of the first `end` tokens, after every 5th step.
fn check(dir: &Path, n: usize, mut want: impl FnMut(&[u32]) -> Tensor) {
    let model = kvq_model(dir);
    assert_eq!(model.config().architecture, "falcon");
    let ids = tokens(n, VOCAB);
    let f = factory(&CacheRegistry::builtin(), "f32");
    let mut caches = model.new_caches(f.as_ref()).expect("caches");
    let ours = step_logits(&model, &mut caches, &ids, &[9]);
    let ends: Vec<usize> = std::iter::once(9).chain(10..=n).collect();
    for (got, &end) in ours
        .iter()
        .zip(&ends)
        .filter(|(_, e)| **e % 5 == 4 || **e == n)
    {
        let d = max_rel_diff(got, &want(&ids[..end]));
        assert!(d < 1e-4, "after {end} tokens, relative difference {d}");
    }
}

fn candle_logits(o: &mut falcon::Falcon, ids: &[u32]) -> Tensor {
    o.clear_kv_cache();
    let input = Tensor::new(ids, &Device::Cpu)
        .and_then(|t| t.unsqueeze(0))
        .expect("input");
    o.forward(&input)
        .and_then(|x| x.i(0))
        .expect("oracle forward")
}

#[test]
fn falcon_7b_layout_matches_candle_transformers() {
    let dir = scratch_dir("arch-falcon-7b");
    write(&dir, FALCON_7B);
    let mut o = oracle(&dir, FALCON_7B);
    check(&dir, 30, |ids| candle_logits(&mut o, ids));
}

#[test]
fn old_multi_head_sequential_layout_with_biases_matches_candle_transformers() {
    let l = Layout {
        multi_query: false,
        parallel: false,
        new_decoder: false,
        kv_heads: HEADS,
        bias: true,
    };
    let dir = scratch_dir("arch-falcon-rw");
    write(&dir, l);
    let mut o = oracle(&dir, l);
    check(&dir, 30, |ids| candle_logits(&mut o, ids));
}

/// The new decoder with one kv group and both norms equal is Falcon-7B: kvq on the new-decoder
/// files against candle on the 7B files with the same tensors.
#[test]
fn new_decoder_with_one_kv_head_matches_candle_on_the_7b_equivalent() {
    let seven = scratch_dir("arch-falcon-7b-twin");
    write(&seven, FALCON_7B);
    let new = scratch_dir("arch-falcon-new-1kv");
    write(
        &new,
        Layout {
            new_decoder: true,
            ..FALCON_7B
        },
    );
    let mut o = oracle(&seven, FALCON_7B);
    check(&new, 30, |ids| candle_logits(&mut o, ids));
}

/// transformers' Falcon forward, written out plainly for the last position (no cache).
fn reference_logits(t: &HashMap<String, Tensor>, l: Layout, ids: &[u32]) -> Tensor {
    let get = |n: &str| t[n].clone();
    let ln = |x: &Tensor, p: &str| {
        candle_nn::ops::layer_norm(
            x,
            &get(&format!("{p}.weight")),
            &get(&format!("{p}.bias")),
            1e-5,
        )
        .expect("layer norm")
    };
    let lin = |x: &Tensor, p: &str| x.matmul(&get(&format!("{p}.weight")).t()?);
    let n = ids.len();
    let dev = Device::Cpu;
    let mut x = get("transformer.word_embeddings.weight")
        .index_select(&Tensor::new(ids, &dev).expect("ids"), 0)
        .expect("embed");
    // Rotary tables (rotate-half layout), theta 10000.
    let inv: Vec<f32> = (0..HD / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / HD as f32))
        .collect();
    let freqs = Tensor::arange(0u32, n as u32, &dev)
        .and_then(|p| {
            p.to_dtype(DType::F32)?
                .reshape((n, 1))?
                .broadcast_mul(&Tensor::new(inv.as_slice(), &dev)?.reshape((1, HD / 2))?)
        })
        .expect("freqs");
    let cos =
        Tensor::cat(&[&freqs.cos().expect("cos"), &freqs.cos().expect("cos")], 1).expect("cos");
    let sin =
        Tensor::cat(&[&freqs.sin().expect("sin"), &freqs.sin().expect("sin")], 1).expect("sin");
    let rope = |x: &Tensor| -> Tensor {
        // x: [heads, n, hd]
        let x1 = x.narrow(D::Minus1, 0, HD / 2).expect("x1");
        let x2 = x.narrow(D::Minus1, HD / 2, HD / 2).expect("x2");
        let rot = Tensor::cat(&[&x2.neg().expect("neg"), &x1], D::Minus1).expect("rot");
        (x.broadcast_mul(&cos).expect("c") + rot.broadcast_mul(&sin).expect("s")).expect("rope")
    };
    let per = HEADS / l.kv_heads;
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..n).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (n, n), &dev).expect("mask");
    for i in 0..LAYERS {
        let p = |s: &str| format!("transformer.h.{i}.{s}");
        let ha = ln(&x, &p("ln_attn"));
        let hm = ln(&x, &p("ln_mlp"));
        let qkv = lin(&ha, &p("self_attention.query_key_value"))
            .and_then(|y| y.reshape((n, l.kv_heads, per + 2, HD)))
            .expect("qkv");
        let mut heads = Vec::new();
        for h in 0..HEADS {
            let (g, j) = (h / per, h % per);
            let q = rope(&qkv.i((.., g, j)).expect("q").unsqueeze(0).expect("q"));
            let k = rope(&qkv.i((.., g, per)).expect("k").unsqueeze(0).expect("k"));
            let v = qkv.i((.., g, per + 1)).expect("v");
            let s = (q
                .squeeze(0)
                .expect("q")
                .matmul(&k.squeeze(0).expect("k").t().expect("t"))
                .expect("s")
                / (HD as f64).sqrt())
            .expect("scale");
            let pr =
                candle_nn::ops::softmax_last_dim(&(s + &mask).expect("mask")).expect("softmax");
            heads.push(pr.matmul(&v).expect("pv"));
        }
        let attn = Tensor::cat(&heads, 1).expect("heads");
        let a = lin(&attn, &p("self_attention.dense")).expect("dense");
        let m = lin(&hm, &p("mlp.dense_h_to_4h"))
            .and_then(|u| u.gelu())
            .and_then(|u| lin(&u, &p("mlp.dense_4h_to_h")))
            .expect("mlp");
        x = ((x + a).expect("res") + m).expect("res");
    }
    let x = ln(&x.i(n - 1..n).expect("last"), "transformer.ln_f");
    lin(&x, "lm_head").and_then(|y| y.i(0)).expect("logits")
}

#[test]
fn new_decoder_with_grouped_kv_heads_matches_the_reference_forward() {
    let l = NEW_DECODER;
    let dir = scratch_dir("arch-falcon-new-2kv");
    write(&dir, l);
    let model = kvq_model(&dir);
    assert_eq!(model.config().n_kv_heads, 2);
    let tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).expect("load");
    check(&dir, 30, |ids| reference_logits(&tensors, l, ids));
}

#[test]
fn every_cache_method_runs_falcon() {
    let l = NEW_DECODER;
    let dir = scratch_dir("arch-falcon-methods");
    write(&dir, l);
    let model = kvq_model(&dir);
    let (registry, names) = every_method(&model, 16);
    let ids = tokens(400, VOCAB);
    let exact = run_method(&model, &registry, "fp16", &ids, 64);
    for method in &names {
        let run = run_method(&model, &registry, method, &ids, 64);
        let rel = mean_rel_l2(&run, &exact);
        eprintln!("{method}: logits {rel:.5} from fp16's (relative L2, mean over steps)");
        assert!(rel < 0.5, "{method}: {rel} from fp16");
    }
}
