//! Unit tests of `kvq eval`: the perplexity math on synthetic logits (chunks, BOS, the scored
//! half, KL divergence), method parsing and rows, and, on the real default model, that feeding
//! a chunk in pieces gives the logits of one-token-at-a-time generation.

use super::ppl::*;
use super::*;
use kvq_cache::methods::turboquant_mse::TurboQuantMseFactory;
use std::sync::OnceLock;

#[test]
fn chunks_are_cut_whole_and_get_bos_only_when_asked() {
    let tokens: Vec<u32> = (10..30).collect(); // 20 tokens
    let c = make_chunks(&tokens, 6, None, None).unwrap();
    assert_eq!(c.len(), 3, "20 / 6 whole chunks, the tail dropped");
    assert_eq!(c[0], [10, 11, 12, 13, 14, 15]);
    assert_eq!(c[2], [22, 23, 24, 25, 26, 27]);
    let b = make_chunks(&tokens, 6, None, Some(1)).unwrap();
    assert_eq!(
        b[0],
        [1, 11, 12, 13, 14, 15],
        "BOS replaces the first token"
    );
    assert_eq!(b[1], [1, 17, 18, 19, 20, 21]);
    assert_eq!(make_chunks(&tokens, 6, Some(2), None).unwrap().len(), 2);
    assert_eq!(make_chunks(&tokens, 6, Some(9), None).unwrap().len(), 3);
    // Like llama.cpp, at least two contexts' worth of tokens.
    assert!(make_chunks(&tokens, 11, None, None).is_err());
    assert!(make_chunks(&tokens, 10, None, None).is_ok());
    assert!(make_chunks(&tokens, 6, Some(0), None).is_err());
}

#[test]
fn the_second_half_is_scored() {
    assert_eq!(scored_range(512), 256..511);
    assert_eq!(scored_range(8), 4..7);
    assert_eq!(scored_range(7), 3..6);
    assert_eq!(split_pieces(1100, 512), [512, 512, 76]);
    assert_eq!(split_pieces(512, 512), [512]);
    assert_eq!(split_pieces(64, 7), [7, 7, 7, 7, 7, 7, 7, 7, 7, 1]);
}

#[test]
fn log_softmax_and_argmax() {
    let mut row = vec![1.0f32, 3.0, 2.0, 3.0];
    let top = log_softmax_in_place(&mut row);
    assert_eq!(top, 1, "the first of tied maxima");
    let z = 1f64.exp() + 2.0 * 3f64.exp() + 2f64.exp();
    for (got, x) in row.iter().zip([1.0f64, 3.0, 2.0, 3.0]) {
        assert!((f64::from(*got) - (x - z.ln())).abs() < 1e-6);
    }
    // Large logits do not overflow.
    let mut big = vec![1000.0f32, 1000.0];
    log_softmax_in_place(&mut big);
    assert!((big[0] + std::f32::consts::LN_2).abs() < 1e-6);
}

/// A chunk of 8 tokens over a vocabulary of 4, and logits rows for positions 4, 5, 6 where the
/// next token (1, 2, 3: never the first index, the top of a flat row) gets logit `hit` and every
/// other token 0.
fn synthetic(hit: f32) -> (Vec<u32>, Vec<f32>) {
    let chunk = vec![3, 0, 1, 2, 3, 1, 2, 3];
    let mut rows = vec![0.0f32; 3 * 4];
    for (r, j) in scored_range(8).enumerate() {
        rows[r * 4 + chunk[j + 1] as usize] = hit;
    }
    (chunk, rows)
}

#[test]
fn nll_counts_the_scored_positions_only() {
    // Uniform logits: every scored token has probability 1/4, PPL is exactly 4.
    let (chunk, _) = synthetic(0.0);
    let mut acc = Acc::default();
    score_chunk(&chunk, 4, vec![0.0; 12], None, &mut acc).unwrap();
    assert_eq!(
        acc.count, 3,
        "ctx 8 scores positions 4, 5, 6 (tokens 5, 6, 7)"
    );
    assert!((acc.ppl() - 4.0).abs() < 1e-5);
    assert_eq!(acc.ppl_err(), None, "no spread, no error");
    // The target at logit 2: p = e^2 / (e^2 + 3).
    let (chunk, rows) = synthetic(2.0);
    let mut acc = Acc::default();
    score_chunk(&chunk, 4, rows, None, &mut acc).unwrap();
    let nll = -(2f64.exp() / (2f64.exp() + 3.0)).ln();
    assert!((acc.nll - 3.0 * nll).abs() < 1e-5);
    assert!((acc.ppl() - nll.exp()).abs() < 1e-5);
    // Rows for the wrong number of positions are refused (the first half is never scored).
    assert!(score_chunk(&chunk, 4, vec![0.0; 8 * 4], None, &mut Acc::default()).is_err());
    // Tokens in the first half do not matter; token 7 (the last) does.
    let (mut other, rows) = synthetic(2.0);
    other[..5].copy_from_slice(&[0, 0, 0, 0, 0]);
    let mut acc2 = Acc::default();
    score_chunk(&other, 4, rows.clone(), None, &mut acc2).unwrap();
    assert!((acc2.nll - 3.0 * nll).abs() < 1e-5);
    other[7] = (other[7] + 1) % 4;
    let mut acc3 = Acc::default();
    score_chunk(&other, 4, rows, None, &mut acc3).unwrap();
    assert!(acc3.nll > acc2.nll + 1.0);
}

#[test]
fn ppl_error_is_llama_cpp_s() {
    let mut acc = Acc::default();
    for v in [1.0, 2.0, 4.0] {
        acc.nll += v;
        acc.nll2 += v * v;
        acc.count += 1;
    }
    // llama.cpp: nll2/n - (nll/n)^2, sqrt(./(n-1)), times PPL.
    let mean = 7.0 / 3.0;
    let var = 21.0 / 3.0 - mean * mean;
    let want = (var / 2.0f64).sqrt() * mean.exp();
    assert!((acc.ppl_err().unwrap() - want).abs() < 1e-9);
}

#[test]
fn kl_divergence_and_same_top_against_a_baseline() {
    let (chunk, rows) = synthetic(2.0);
    let mut base_acc = Acc::default();
    let base = score_chunk(&chunk, 4, rows.clone(), None, &mut base_acc).unwrap();
    assert_eq!(base_acc.compared, 0);
    // The same logits: KL 0, same top everywhere.
    let mut same = Acc::default();
    score_chunk(&chunk, 4, rows, Some(&base), &mut same).unwrap();
    assert!(same.mean_kld().unwrap().abs() < 1e-9);
    assert_eq!(same.same_top_pct(), Some(100.0));
    // Uniform logits: KL(p || uniform) = sum p log p + log 4; the top token differs.
    let mut flat = Acc::default();
    score_chunk(&chunk, 4, vec![0.0; 12], Some(&base), &mut flat).unwrap();
    let p = 2f64.exp() / (2f64.exp() + 3.0);
    let q = 1.0 / (2f64.exp() + 3.0);
    let want = p * p.ln() + 3.0 * q * q.ln() + 4f64.ln();
    assert!((flat.mean_kld().unwrap() - want).abs() < 1e-5);
    assert_eq!(flat.same_top_pct(), Some(0.0));
    assert!((kl_divergence(&base[..4], &base[..4])).abs() < 1e-12);
}

#[test]
fn methods_parse_with_bits_and_fp16_first() {
    let reg = CacheRegistry::builtin();
    let list = |s: &str| s.split(',').map(String::from).collect::<Vec<_>>();
    let m = parse_methods(
        &list("turboquant-mse@3,fp16,turboquant-mse@2,turboquant-mse"),
        &reg,
    )
    .unwrap();
    let labels: Vec<&str> = m.iter().map(|m| m.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "fp16",
            "turboquant-mse@3",
            "turboquant-mse@2",
            "turboquant-mse"
        ]
    );
    assert_eq!((m[1].cache.bits, m[3].cache.bits), (3, 4));
    // fp16 listed again (as itself or with its only bits) is the baseline, evaluated once.
    assert_eq!(parse_methods(&list("fp16@16"), &reg).unwrap().len(), 1);
    assert_eq!(
        parse_methods(&list("TurboQuant-MSE@4"), &reg).unwrap()[1].label,
        "turboquant-mse@4"
    );
    assert!(parse_methods(&list("turboquant-mse@5"), &reg).is_err());
    assert!(parse_methods(&list("turboquant-mse@x"), &reg).is_err());
    assert!(parse_methods(&list("nope"), &reg).is_err());
}

#[test]
fn rows_count_bits_per_element_and_delta() {
    let result = |nll: f64, bytes: usize| MethodResult {
        acc: Acc {
            nll,
            nll2: nll * nll,
            count: 1,
            ..Acc::default()
        },
        secs: 1.0,
        key_bytes: bytes,
        value_bytes: bytes,
    };
    // ctx 4, 1 layer, 2 kv heads, head_dim 8: 64 key elements; fp16 holds 128 key bytes.
    let results = [result(2.0, 128), result(2.1, 32)];
    let labels = ["fp16".to_string(), "x@2".to_string()];
    let rows = make_rows(&labels, &results, 4, 64);
    assert_eq!(rows[0].delta_pct, 0.0);
    assert_eq!((rows[0].key_bits, rows[0].value_bits), (16.0, 16.0));
    assert_eq!(rows[0].kv_bytes_per_token, 64.0);
    assert_eq!(rows[1].key_bits, 4.0);
    assert!((rows[1].delta_pct - (0.1f64.exp() - 1.0) * 100.0).abs() < 1e-9);
    let json = serde_json::to_value(&rows).unwrap();
    let keys: Vec<&str> = json[0]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    // The row's fields in their declared order (serde_json keeps insertion order).
    let want = vec![
        "method",
        "key_bits",
        "value_bits",
        "ppl",
        "delta_pct",
        "kv_bytes_per_token",
    ];
    assert_eq!(keys, want);
    let table = render_table(&rows, &results);
    assert!(table.contains("baseline") && table.contains("+10.52%"));
}

/// The real default model, loaded once per test binary.
fn model() -> &'static kvq_models::LoadedModel {
    static M: OnceLock<kvq_models::LoadedModel> = OnceLock::new();
    M.get_or_init(|| kvq_models::load(&model_path(), &mut |_, _| {}).expect("model loads"))
}

/// The default model's GGUF (`$KVQ_MODELS_DIR` or `<workspace>/models`), which must exist.
fn model_path() -> PathBuf {
    let dir = std::env::var_os("KVQ_MODELS_DIR").map_or_else(
        || PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models")),
        PathBuf::from,
    );
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models first",
        path.display()
    );
    path
}

const TEXT: &str = "It was the best of times, it was the worst of times, it was the age of \
    wisdom, it was the age of foolishness, it was the epoch of belief, it was the epoch of \
    incredulity, it was the season of Light, it was the season of Darkness, it was the spring \
    of hope, it was the winter of despair.";

/// Largest absolute difference of two equally long slices.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The batched path is generation: 64 tokens fed in pieces give, at every position, the
/// logits of feeding them one at a time, for a compressed cache whose fp16 window (8) is much
/// shorter than the pieces (a batched query that saw its whole piece in fp16 would differ).
///
/// The pieces stay below the model's dequantized-GEMM threshold (32 rows), so the dense layers
/// run the same Q8_1 kernel as one-token steps and only the cache could make a difference (it
/// makes none: the logits are bit-identical). A piece of 32+ rows takes the f32 GEMM, whose
/// rounding differs from the Q8_1 kernel's; 3-bit codes then flip on some coordinates and the
/// logits drift by up to ~1 (also with f32 weights, where only the GEMM's summation order
/// differs), which is kernel noise, not a cache that sees more than generation would.
#[test]
fn pieces_give_the_logits_of_one_token_at_a_time() {
    let loaded = model();
    let m = &loaded.model;
    let tokens = loaded.tokenizer.encode(TEXT, true).unwrap();
    assert!(tokens.len() >= 64, "{} tokens", tokens.len());
    let tokens = &tokens[..64];
    let factory = TurboQuantMseFactory {
        window: 8,
        ..TurboQuantMseFactory::new(3)
    };
    let run = |pieces: &[usize]| {
        let mut caches = m.new_caches(&factory).unwrap();
        let out = feed(m, &mut caches, tokens, pieces, 0..64).unwrap();
        assert_eq!(caches.len(), 64);
        out
    };
    let vocab = m.config().vocab_size;
    let single = run(&[1; 64]);
    assert_eq!(single.len(), 64 * vocab);
    let pieces = [7, 25, 31, 1];
    assert!(
        pieces
            .iter()
            .all(|&p| p < kvq_models::model::DEQUANT_MIN_ROWS)
    );
    let batched = run(&pieces);
    let d = max_diff(&single, &batched);
    assert!(
        d < 1e-3,
        "{pieces:?}: max |logit diff| vs one at a time {d}"
    );
    // Only the wanted rows come back, from the pieces that hold them.
    let mut caches = m.new_caches(&factory).unwrap();
    let part = feed(m, &mut caches, tokens, &pieces, 20..40).unwrap();
    assert_eq!(part, batched[20 * vocab..40 * vocab]);
}
