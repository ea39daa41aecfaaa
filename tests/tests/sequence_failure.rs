//! One sequence's failure stays its own: a sequence whose cache errors mid-generation gets a
//! typed cache error, while the sequences batched with it finish with exactly the tokens they
//! produce alone; and the model step reports per-sequence errors without failing the batch.

use candle_core::Tensor;
use kvq_cache::{
    CacheError, CacheFactory, CacheGeometry, CacheRegistry, CacheSpec, KvCache, ResolvedCache,
};
use kvq_engine::{
    Engine, EngineConfig, EngineError, GenerationEvent, GenerationRequest, SamplingParams,
};
use kvq_models::ModelError;
use kvq_models::model::SeqStep;
use std::sync::Arc;

/// A cache that behaves like the one it wraps until `fail_at` positions are stored, then errs
/// on every append (as a cache that ran out of room or met a corrupt buffer would).
struct Failing {
    inner: Box<dyn KvCache>,
    fail_at: usize,
}

impl KvCache for Failing {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> kvq_cache::Result<()> {
        if self.inner.len() + k.dim(1)? > self.fail_at {
            return Err(CacheError::Shape(format!(
                "injected failure past {} positions",
                self.fail_at
            )));
        }
        self.inner.append(k, v)
    }
    fn attend(&mut self, q: &Tensor, scale: f32) -> kvq_cache::Result<Tensor> {
        self.inner.attend(q, scale)
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn resident_bytes(&self) -> usize {
        self.inner.resident_bytes()
    }
    fn reserve_bytes(&self, tokens: usize, chunk: usize) -> usize {
        self.inner.reserve_bytes(tokens, chunk)
    }
    fn truncate(&mut self, n: usize) -> kvq_cache::Result<()> {
        self.inner.truncate(n)
    }
    fn method(&self) -> &str {
        self.inner.method()
    }
    fn fork(&self) -> kvq_cache::Result<Box<dyn KvCache>> {
        self.inner.fork()
    }
}

/// Builds `Failing` caches over `inner`; only layer `layer` fails (the others go on, so the
/// failure lands in the middle of a forward pass).
struct FailingFactory {
    inner: Arc<dyn CacheFactory>,
    layer: usize,
    fail_at: usize,
}

impl CacheFactory for FailingFactory {
    fn method(&self) -> &str {
        self.inner.method()
    }
    fn create(&self, layer: usize, geom: &CacheGeometry) -> kvq_cache::Result<Box<dyn KvCache>> {
        let inner = self.inner.create(layer, geom)?;
        Ok(if layer == self.layer {
            Box::new(Failing {
                inner,
                fail_at: self.fail_at,
            })
        } else {
            inner
        })
    }
}

fn resolved(reg: &CacheRegistry, name: &str) -> ResolvedCache {
    reg.resolve(&CacheSpec {
        method: Some(name.into()),
        bits: None,
    })
    .expect("method")
}

fn request(prompt: &[u32], cache: ResolvedCache) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        max_tokens: Some(12),
        sampling: SamplingParams::greedy(),
        stop: Vec::new(),
        stop_on_eos: false,
        constraint: None,
        logprobs: None,
        cache,
    }
}

/// Every event of one stream: the generated token ids, and the error if it ended in one.
async fn collect(mut rx: kvq_engine::GenerationStream) -> (Vec<u32>, Option<EngineError>, bool) {
    let mut tokens = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerationEvent::Delta { token, .. } => tokens.extend(token),
            GenerationEvent::Finished { .. } => return (tokens, None, true),
            GenerationEvent::Error(e) => return (tokens, Some(e), false),
        }
    }
    (tokens, None, false)
}

#[test]
fn a_failing_cache_fails_only_its_sequence() {
    let loaded = kvq_models::load(&kvq_tests::default_gguf(), &mut |_, _| {}).expect("model");
    let prompts: Vec<Vec<u32>> = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
        .iter()
        .map(|p| loaded.tokenizer.encode(p, true).expect("encode"))
        .collect();
    let n_layers = loaded.model.config().n_layers;
    let engine = Engine::start(loaded, EngineConfig::default());
    let reg = CacheRegistry::builtin();
    let methods = ["fp16", "turboquant-mse", "fp16"];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");

    // Each sequence alone.
    let solo: Vec<Vec<u32>> = prompts
        .iter()
        .zip(methods)
        .map(|(p, m)| {
            let rx = engine
                .submit(request(p, resolved(&reg, m)))
                .expect("submit");
            let (tokens, err, finished) = rt.block_on(collect(rx));
            assert!(finished && err.is_none(), "{m}: {err:?}");
            assert_eq!(tokens.len(), 12);
            tokens
        })
        .collect();

    // Together, the middle one's cache failing in a middle layer after 4 generated tokens.
    let mut failing = resolved(&reg, methods[1]);
    failing.factory = Arc::new(FailingFactory {
        inner: failing.factory,
        layer: n_layers / 2,
        fail_at: prompts[1].len() + 4,
    });
    let streams: Vec<_> = prompts
        .iter()
        .zip(methods)
        .enumerate()
        .map(|(i, (p, m))| {
            let cache = if i == 1 {
                ResolvedCache {
                    name: failing.name.clone(),
                    bits: failing.bits,
                    factory: failing.factory.clone(),
                    // Never interchangeable with a working cache of the same method.
                    key: format!("failing/{}", failing.key),
                }
            } else {
                resolved(&reg, m)
            };
            engine.submit(request(p, cache)).expect("submit")
        })
        .collect();
    let results =
        rt.block_on(async { futures::future::join_all(streams.into_iter().map(collect)).await });

    for (i, (tokens, err, finished)) in results.iter().enumerate() {
        if i == 1 {
            assert!(!finished);
            assert!(
                matches!(err, Some(EngineError::Cache(CacheError::Shape(m))) if m.contains("injected")),
                "{err:?}"
            );
            // The tokens it got before failing are the ones it gets alone.
            // One token from the prefill and four decode steps fit; the fifth append fails.
            assert_eq!(tokens[..], solo[1][..5]);
        } else {
            assert!(*finished && err.is_none(), "sequence {i}: {err:?}");
            assert_eq!(
                tokens, &solo[i],
                "sequence {i} changed by its failing batch-mate"
            );
        }
    }
    // The engine goes on: nothing is left running, and a new request runs normally.
    let rx = engine
        .submit(request(&prompts[0], resolved(&reg, "fp16")))
        .expect("submit");
    let (tokens, err, finished) = rt.block_on(collect(rx));
    assert!(finished && err.is_none(), "{err:?}");
    assert_eq!(tokens, solo[0]);
    let idle = (0..200).any(|_| {
        let st = engine.stats();
        std::thread::sleep(std::time::Duration::from_millis(10));
        (st.running, st.waiting) == (0, 0)
    });
    assert!(idle, "the engine still reports work: {:?}", engine.stats());
}

#[test]
fn forward_each_reports_per_sequence_errors() {
    let loaded = kvq_models::load(&kvq_tests::default_gguf(), &mut |_, _| {}).expect("model");
    let m = &loaded.model;
    let reg = CacheRegistry::builtin();
    let fp16 = resolved(&reg, "fp16").factory;
    let bad = FailingFactory {
        inner: fp16.clone(),
        layer: 1,
        fail_at: 0,
    };
    let prompt = loaded
        .tokenizer
        .encode("Hello there", true)
        .expect("encode");
    let to_vec = |t: &Tensor| {
        t.flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("logits")
    };

    let mut alone = m.new_caches(fp16.as_ref()).expect("caches");
    let want = m
        .forward(&mut [SeqStep {
            tokens: &prompt,
            cache: &mut alone,
            all_logits: false,
        }])
        .expect("forward");

    let (mut a, mut b, mut c) = (
        m.new_caches(&bad).expect("caches"),
        m.new_caches(fp16.as_ref()).expect("caches"),
        m.new_caches(fp16.as_ref()).expect("caches"),
    );
    let oov = [u32::MAX];
    let out = m
        .forward_each(&mut [
            SeqStep {
                tokens: &prompt,
                cache: &mut a,
                all_logits: false,
            },
            SeqStep {
                tokens: &prompt,
                cache: &mut b,
                all_logits: false,
            },
            SeqStep {
                tokens: &oov,
                cache: &mut c,
                all_logits: false,
            },
        ])
        .expect("the batch as a whole runs");
    assert!(matches!(&out[0], Err(ModelError::Cache(_))), "{:?}", out[0]);
    assert_eq!(to_vec(out[1].as_ref().expect("logits")), to_vec(&want[0]));
    assert!(
        matches!(&out[2], Err(ModelError::Invalid(m)) if m.contains("out of vocabulary")),
        "{:?}",
        out[2]
    );
    // The plain forward fails as a whole on the same batch.
    let mut d = m.new_caches(&bad).expect("caches");
    assert!(
        m.forward(&mut [SeqStep {
            tokens: &prompt,
            cache: &mut d,
            all_logits: false,
        }])
        .is_err()
    );
}
