//! Model hashes, file names and the source's refusal of other methods. Calibrating the real
//! model (first use, concurrent waiters, reload from disk) is tested in tests/tests/vecinfer.rs.

use super::*;

fn scratch(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("kvq-cal-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

#[test]
fn a_file_hashes_to_its_sha256() {
    let dir = scratch("file");
    let f = dir.join("m.gguf");
    // Longer than one read buffer, so the streaming is exercised.
    let data: Vec<u8> = (0..(3 << 20) + 17).map(|i| (i % 251) as u8).collect();
    std::fs::write(&f, &data).unwrap();
    assert_eq!(model_hash(&f).unwrap(), sha256_hex(&data));
    assert_eq!(
        sha256_hex(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_directory_hashes_its_safetensors_files() {
    let dir = scratch("dir");
    std::fs::write(dir.join("config.json"), "{}").unwrap();
    assert!(model_hash(&dir).is_err(), "no weights, no identity");
    std::fs::write(dir.join("b.safetensors"), "two").unwrap();
    std::fs::write(dir.join("a.safetensors"), "one").unwrap();
    let h1 = model_hash(&dir).unwrap();
    std::fs::write(dir.join("config.json"), "{\"x\": 1}").unwrap();
    assert_eq!(model_hash(&dir).unwrap(), h1, "only the weights count");
    std::fs::write(dir.join("b.safetensors"), "TWO").unwrap();
    assert_ne!(model_hash(&dir).unwrap(), h1);
    assert!(model_hash(&dir.join("missing")).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn file_names_carry_non_default_seeds() {
    assert_eq!(file_stem(DEFAULT_SEED), "vecinfer");
    assert_eq!(file_stem(7), "vecinfer-seed7");
    let d = calibration_dir(Path::new("/c"), "abc");
    assert_eq!(d, Path::new("/c/calibration/abc"));
}

#[test]
fn the_shipped_text_is_public_domain_and_not_macbeth() {
    assert!(
        SHIPPED_TEXT
            .lines()
            .next()
            .unwrap()
            .contains("Public domain")
    );
    assert!((30_000..=40_000).contains(&SHIPPED_TEXT.len()));
    assert!(!SHIPPED_TEXT.to_ascii_lowercase().contains("macbeth"));
    assert!(!SHIPPED_TEXT.to_ascii_lowercase().contains("gutenberg"));
}

#[test]
fn only_vecinfer_is_calibrated() {
    let src = ModelCalibration::new(Path::new("/nonexistent/model.gguf"));
    let err = src.calibration("qjl", &toml::Table::new()).err().unwrap();
    assert!(err.to_string().contains("qjl"), "{err}");
    // A missing model is an error, not a panic.
    let err = src.calibration(METHOD, &toml::Table::new()).err().unwrap();
    assert!(err.to_string().contains("not found"), "{err}");
}
