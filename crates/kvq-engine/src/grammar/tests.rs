//! Grammar tests over SmolLM2's real vocabulary (skipped when the model file is absent): JSON is
//! followed token by token, what leaves the grammar is masked, random walks through the mask
//! always give JSON that validates, and an unsupported schema keyword is named.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;

fn smollm2() -> Option<Arc<Tokenizer>> {
    let dir = std::env::var_os("KVQ_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models")));
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let Ok(mut file) = std::fs::File::open(&path) else {
        eprintln!("skipping: {} not found", path.display());
        return None;
    };
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).expect("gguf");
    Some(Arc::new(Tokenizer::from_gguf(&content).expect("tokenizer")))
}

fn compiler() -> Option<(GrammarCompiler, Arc<Tokenizer>)> {
    let tok = smollm2()?;
    Some((GrammarCompiler::new(tok.clone()).expect("compiler"), tok))
}

/// Logits one longer than the vocabulary, as a padded output layer gives.
fn random_logits(rng: &mut StdRng, vocab: usize) -> Vec<f32> {
    (0..vocab + 1).map(|_| rng.random::<f32>()).collect()
}

fn masked_argmax(c: &mut Constraint, logits: &mut [f32]) -> u32 {
    c.mask(logits).expect("mask");
    crate::sampling::argmax(logits)
}

#[test]
fn json_is_followed_token_by_token_and_the_rest_is_masked() {
    let Some((compiler, tok)) = compiler() else {
        return;
    };
    let mut c = compiler.compile(&GrammarSpec::JsonObject).expect("compile");
    let mut rng = StdRng::seed_from_u64(1);
    let mut logits = random_logits(&mut rng, tok.vocab_size());
    c.mask(&mut logits).expect("mask");
    let first = |s: &str| tok.encode(s, false).expect("encode")[0] as usize;
    // An object must open: prose, an array, free whitespace and the end are all masked.
    for banned in ["Hello", "[", "\n", " {"] {
        assert_eq!(logits[first(banned)], f32::NEG_INFINITY, "{banned:?}");
    }
    for &eos in tok.eos_token_ids() {
        assert_eq!(logits[eos as usize], f32::NEG_INFINITY);
    }
    assert_eq!(
        logits[tok.vocab_size()],
        f32::NEG_INFINITY,
        "past the vocabulary"
    );
    assert!(logits[first("{")].is_finite());
    let text = r#"{"name": "Ada", "age": 36, "tags": ["x", true, null]}"#;
    let ids = tok.encode(text, false).expect("encode");
    let mut c = compiler.compile(&GrammarSpec::JsonObject).expect("compile");
    for (i, &id) in ids.iter().enumerate() {
        let mut logits = random_logits(&mut rng, tok.vocab_size());
        c.mask(&mut logits).expect("mask");
        assert!(logits[id as usize].is_finite(), "token {i} ({id}) masked");
        let followed = c.follow(id).expect("follow");
        let last = i + 1 == ids.len();
        assert_eq!(followed == Followed::Complete, last, "token {i}");
    }
    // Complete: only an end of sequence may follow.
    let mut logits = random_logits(&mut rng, tok.vocab_size());
    c.mask(&mut logits).expect("mask");
    let open: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    assert!(
        open.iter()
            .all(|&i| tok.eos_token_ids().contains(&(i as u32)))
    );
    assert!(!open.is_empty());
}

/// Random logits through the mask stand in for any model: every walk ends within bounds and
/// gives JSON that validates against the schema, keys and bounds included.
#[test]
fn random_walks_through_a_schema_always_validate() {
    let Some((compiler, tok)) = compiler() else {
        return;
    };
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "pet": {"enum": ["cat", "dog"]},
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "maxItems": 3
            }
        },
        "required": ["name", "age", "pet"],
        "additionalProperties": false
    });
    let base = compiler
        .compile(&GrammarSpec::JsonSchema(schema))
        .expect("compile");
    let eos = tok.eos_token_ids().to_vec();
    for seed in 0..20 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut c = base.clone();
        let mut ids = Vec::new();
        for _ in 0..400 {
            let mut logits = random_logits(&mut rng, tok.vocab_size());
            let id = masked_argmax(&mut c, &mut logits);
            if eos.contains(&id) {
                break;
            }
            ids.push(id);
            if c.follow(id).expect("follow") == Followed::Complete {
                break;
            }
        }
        let text = tok.decode(&ids, false).expect("decode");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        let obj = v.as_object().expect("object");
        assert!(
            obj.keys()
                .all(|k| ["name", "age", "pet", "scores"].contains(&k.as_str()))
        );
        assert!(
            obj["name"].as_str().expect("name").chars().count() <= 12,
            "{text}"
        );
        assert!(
            (0..=150).contains(&obj["age"].as_i64().expect("age")),
            "{text}"
        );
        assert!(
            ["cat", "dog"].contains(&obj["pet"].as_str().expect("pet")),
            "{text}"
        );
        if let Some(s) = obj.get("scores") {
            let s = s.as_array().expect("array");
            assert!(s.len() <= 3, "{text}");
            assert!(
                s.iter()
                    .all(|x| x.as_i64().is_some_and(|x| x.abs() <= 1000)),
                "{text}"
            );
        }
        // The clone started where the original stands: untouched.
        assert_eq!(base.cost().1, 0);
    }
}

#[test]
fn unsupported_and_malformed_schemas_are_named() {
    let Some((compiler, _)) = compiler() else {
        return;
    };
    let cases = [
        (json!({"type": "object", "if": {"type": "object"}}), "if"),
        (
            json!({"type": "object", "properties": {"a": {"type": "strin"}}}),
            "strin",
        ),
        (json!({"$ref": "#/$defs/missing"}), "missing"),
        (json!(true), "JSON object"),
        (json!([1]), "JSON object"),
    ];
    for (schema, named) in cases {
        let err = compiler
            .compile(&GrammarSpec::JsonSchema(schema.clone()))
            .expect_err(&schema.to_string());
        assert!(err.to_string().contains(named), "{schema}: {err}");
    }
}
