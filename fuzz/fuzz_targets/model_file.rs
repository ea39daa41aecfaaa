//! Fuzz target: model-file loading as `kvq serve --model` does it. The first byte picks the
//! file that gets the rest: even, a GGUF file; 1, 3 or 5 (mod 6), the `model.safetensors`,
//! `config.json` or `tokenizer.json` of a Hugging Face directory whose other files are the tiny
//! fixtures (fuzz/fixtures/tiny-hf). Truncated, bit-flipped, wrong-magic and huge-count headers
//! must give an error naming the path, never a panic, a hang or a giant allocation (libFuzzer's
//! -malloc_limit_mb catches those).
#![no_main]

use kvq_fuzz::{repo_root, scratch_dir};
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

const HF_FILES: [&str; 4] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
];

/// The directory with the fixtures in place; one file is overwritten per input.
fn hf_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| scratch_dir().join("hf"))
}

fn reset_hf_dir() {
    let dir = hf_dir();
    std::fs::create_dir_all(dir).expect("hf dir");
    let fixtures = repo_root().join("fuzz/fixtures/tiny-hf");
    for name in &HF_FILES[..3] {
        std::fs::copy(fixtures.join(name), dir.join(name)).expect("fixture");
    }
}

fuzz_target!(|data: &[u8]| {
    kvq_fuzz::contain_third_party_panics();
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    let path = if selector % 2 == 0 {
        let p = scratch_dir().join("model.gguf");
        std::fs::write(&p, bytes).expect("write");
        p
    } else {
        reset_hf_dir();
        let target = match selector % 6 {
            1 => "model.safetensors",
            3 => "config.json",
            _ => "tokenizer.json",
        };
        if target != "model.safetensors" {
            // The weights must be readable for the other files' errors to be reached.
            let seed = repo_root().join("fuzz/seeds/model_file/safetensors-tiny-llama");
            let weights = std::fs::read(seed).expect("the safetensors seed");
            std::fs::write(hf_dir().join("model.safetensors"), &weights[1..]).expect("write");
        }
        std::fs::write(hf_dir().join(target), bytes).expect("write");
        hf_dir().clone()
    };
    if let Err(e) = kvq_models::load(&path, &mut |_, _| {}) {
        let msg = e.to_string();
        assert!(
            msg.contains(&path.display().to_string()),
            "the error does not name {}: {msg}",
            path.display()
        );
    }
});
