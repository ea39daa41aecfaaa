//! What the fuzz targets share: the real SmolLM2 tokenizer and chat template (from the fetched
//! GGUF, read once per process), the cache registry with the shipped presets, a scratch folder
//! per process, and the checks every target makes of an error (a 4xx with OpenAI's shape).

use candle_core::quantized::gguf_file;
use kvq_models::{ChatTemplate, Tokenizer};
use kvq_server::ApiError;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// The repository root (the fuzz crate lives in `fuzz/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from(".."), Path::to_path_buf)
}

/// The GGUF whose tokenizer and template the targets use: `KVQ_FUZZ_MODEL`, else the one
/// `scripts/fetch-models smollm2` puts in `models/`.
pub fn model_path() -> PathBuf {
    std::env::var_os("KVQ_FUZZ_MODEL").map_or_else(
        || repo_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        PathBuf::from,
    )
}

struct Real {
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
}

fn real() -> &'static Real {
    static REAL: OnceLock<Real> = OnceLock::new();
    REAL.get_or_init(|| {
        let path = model_path();
        let mut file = std::fs::File::open(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run scripts/fetch-models smollm2 or set KVQ_FUZZ_MODEL)",
                path.display()
            )
        });
        let content = gguf_file::Content::read(&mut file).expect("the fetched GGUF reads");
        let tokenizer = Tokenizer::from_gguf(&content).expect("the fetched GGUF's tokenizer");
        let template = ChatTemplate::for_tokenizer(&tokenizer).expect("SmolLM2's template");
        Real {
            tokenizer: Arc::new(tokenizer),
            template,
        }
    })
}

/// SmolLM2's tokenizer.
pub fn tokenizer() -> &'static Arc<Tokenizer> {
    &real().tokenizer
}

/// SmolLM2's chat template.
pub fn template() -> &'static ChatTemplate {
    &real().template
}

/// The grammar compiler for SmolLM2's vocabulary (what a server builds on its first structured
/// request).
pub fn grammar() -> &'static kvq_engine::GrammarCompiler {
    static COMPILER: OnceLock<kvq_engine::GrammarCompiler> = OnceLock::new();
    COMPILER.get_or_init(|| {
        kvq_engine::GrammarCompiler::new(Arc::clone(tokenizer()))
            .expect("SmolLM2's vocabulary carries a grammar")
    })
}

/// The built-in methods plus the presets shipped in `configs/cache`.
pub fn registry() -> &'static kvq_cache::CacheRegistry {
    static REGISTRY: OnceLock<kvq_cache::CacheRegistry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut r = kvq_cache::CacheRegistry::builtin();
        r.load_presets(&repo_root().join("configs/cache"))
            .expect("the shipped presets load");
        r
    })
}

/// A folder of this process's own for files a target writes.
pub fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kvq-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    })
}

/// What every rejected input must get: a client error (4xx, or 503 for a method the server
/// cannot build) with a non-empty message, serializable as OpenAI's error object.
pub fn check_error(e: &ApiError) {
    let status = e.status().as_u16();
    assert!(
        (400..500).contains(&status) || status == 503,
        "status {status} for {e:?}"
    );
    let body = serde_json::to_value(e.body()).expect("the error body serializes");
    let err = &body["error"];
    for key in ["message", "type", "param", "code"] {
        assert!(err.get(key).is_some(), "error lacks {key}: {body}");
    }
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
}

/// libfuzzer-sys aborts on every panic, even one that is caught. kvq contains the panics of the
/// third-party crates that parse untrusted input (`kvq_models::contain`), so for those alone
/// this hook only prints: an uncontained one still unwinds to libFuzzer's harness, which aborts
/// and records the input. Call at the start of every target.
pub fn contain_third_party_panics() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let abort_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let third_party = info.location().is_some_and(|l| {
                let f = l.file();
                f.contains("/minijinja-") || f.contains("/tokenizers-")
            });
            if third_party {
                eprintln!("contained third-party panic: {info}");
            } else {
                abort_hook(info);
            }
        }));
    });
}
