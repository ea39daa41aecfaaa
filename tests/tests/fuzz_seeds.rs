//! The fuzz targets' committed model-file seeds load as models and are exactly what
//! `kvq_tests::fuzz_seeds` writes from the fetched SmolLM2 GGUF (`KVQ_WRITE_FUZZ_SEEDS=1`
//! rewrites them in the repository instead).

use kvq_tests::fuzz_seeds::{check_model_seeds, write_model_seeds};
use kvq_tests::{default_gguf, workspace_root};

#[test]
fn committed_seeds_load_and_are_reproducible() {
    let fuzz = workspace_root().join("fuzz");
    let (seeds, fixtures) = (fuzz.join("seeds/model_file"), fuzz.join("fixtures/tiny-hf"));
    if std::env::var_os("KVQ_WRITE_FUZZ_SEEDS").is_some() {
        write_model_seeds(&default_gguf(), &seeds, &fixtures);
    }
    check_model_seeds(&seeds, &fixtures);

    let tmp = std::env::temp_dir().join(format!("kvq-fuzz-seeds-{}", std::process::id()));
    let (new_seeds, new_fixtures) = (tmp.join("seeds"), tmp.join("fixtures"));
    write_model_seeds(&default_gguf(), &new_seeds, &new_fixtures);
    for (committed, fresh) in [(&seeds, &new_seeds), (&fixtures, &new_fixtures)] {
        for entry in std::fs::read_dir(fresh).expect("fresh seeds") {
            let entry = entry.expect("entry");
            let name = entry.file_name();
            let old = std::fs::read(committed.join(&name))
                .unwrap_or_else(|e| panic!("{}: {e}", committed.join(&name).display()));
            let new = std::fs::read(entry.path()).expect("fresh seed");
            assert!(
                old == new,
                "{} differs from what the generator writes; rerun with KVQ_WRITE_FUZZ_SEEDS=1",
                committed.join(&name).display()
            );
        }
    }
    std::fs::remove_dir_all(&tmp).expect("clean up");
}

#[test]
fn fuzz_findings_stay_fixed() {
    // model_file findings: a GGUF tensor with a zero dimension (candle read it through a
    // dangling, misaligned pointer: a debug-assertion abort, undefined behaviour without them)
    // and one whose dimensions multiply past usize (candle multiplied unchecked).
    for (seed, want) in [
        ("regress-empty-tensor", "has no elements"),
        ("regress-overflowing-shape", "than memory can address"),
    ] {
        let bytes =
            std::fs::read(workspace_root().join("fuzz/seeds/model_file").join(seed)).expect("seed");
        assert_eq!(bytes[0] % 2, 0, "{seed}: selector 0 is a GGUF file");
        let path = std::env::temp_dir().join(format!("kvq-{seed}-{}.gguf", std::process::id()));
        std::fs::write(&path, &bytes[1..]).expect("write");
        let err = kvq_models::load(&path, &mut |_, _| {})
            .err()
            .unwrap_or_else(|| panic!("{seed}: refused"))
            .to_string();
        std::fs::remove_file(&path).expect("clean up");
        assert!(err.contains(want), "{seed}: {err}");
        assert!(err.contains(&path.display().to_string()), "{seed}: {err}");
    }
}
