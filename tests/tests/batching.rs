//! Continuous batching must not change results: a sequence's logits are the same, bit for bit,
//! whether it runs alone or batched with others (short and long prompt chunks, decode steps,
//! different cache methods in one batch).

use kvq_cache::{CacheRegistry, CacheSpec};
use kvq_models::model::SeqStep;

fn logits(m: &kvq_models::model::Model, steps: &mut [SeqStep<'_>]) -> Vec<Vec<f32>> {
    m.forward(steps)
        .expect("forward")
        .into_iter()
        .map(|t| {
            t.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("logits")
        })
        .collect()
}

#[test]
fn batched_logits_equal_solo_logits() {
    let loaded = kvq_models::load(&kvq_tests::default_gguf(), &mut |_, _| {}).expect("model");
    let reg = CacheRegistry::builtin();
    let factory = |name: &str| {
        reg.resolve(&CacheSpec {
            method: Some(name.into()),
            bits: None,
        })
        .expect("method")
        .factory
    };
    let (fp16, tq) = (factory("fp16"), factory("turboquant-mse"));
    let m = &loaded.model;
    let short = loaded
        .tokenizer
        .encode("Once upon a time there was", true)
        .expect("encode");
    let long: Vec<u32> = (0..40).map(|i| 100 + i * 7).collect();

    let mut a = m.new_caches(fp16.as_ref()).expect("caches");
    let mut b = m.new_caches(tq.as_ref()).expect("caches");
    let solo_a = logits(
        m,
        &mut [SeqStep {
            tokens: &short,
            cache: &mut a,
            all_logits: false,
        }],
    );
    let solo_b = logits(
        m,
        &mut [SeqStep {
            tokens: &long,
            cache: &mut b,
            all_logits: false,
        }],
    );
    let next_a = logits(
        m,
        &mut [SeqStep {
            tokens: &[42],
            cache: &mut a,
            all_logits: false,
        }],
    );

    let mut a2 = m.new_caches(fp16.as_ref()).expect("caches");
    let mut b2 = m.new_caches(tq.as_ref()).expect("caches");
    // Short chunk first in the batch, long chunk second: rows get reordered inside.
    let both = logits(
        m,
        &mut [
            SeqStep {
                tokens: &short,
                cache: &mut a2,
                all_logits: false,
            },
            SeqStep {
                tokens: &long,
                cache: &mut b2,
                all_logits: false,
            },
        ],
    );
    assert_eq!(both[0], solo_a[0], "short prompt batched with a long one");
    assert_eq!(both[1], solo_b[0], "long prompt batched with a short one");
    // A decode step batched with a new sequence's long prompt.
    let mut c = m.new_caches(fp16.as_ref()).expect("caches");
    let mixed = logits(
        m,
        &mut [
            SeqStep {
                tokens: &[42],
                cache: &mut a2,
                all_logits: false,
            },
            SeqStep {
                tokens: &long,
                cache: &mut c,
                all_logits: false,
            },
        ],
    );
    assert_eq!(
        mixed[0], next_a[0],
        "decode step batched with a prompt chunk"
    );
}
