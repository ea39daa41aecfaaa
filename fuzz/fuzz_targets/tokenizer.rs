//! Fuzz target: SmolLM2's tokenizer (rebuilt from the GGUF as kvq serves it) on arbitrary
//! bytes: encoding their lossy UTF-8 text, decoding them read as token ids (in range and not),
//! and the streaming decoder over those ids. Errors are fine; panics and hangs are not, every id
//! the encoder gives must be in the vocabulary, and text round-trips when the vocabulary has a
//! token for each of its bytes (SmolLM2's lacks a few control and non-UTF-8 bytes, which the
//! byte-level BPE drops).
#![no_main]

use kvq_fuzz::tokenizer;
use kvq_models::tokenizer::IncrementalDecoder;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

/// Which bytes have a token of their own.
fn representable() -> &'static [bool; 256] {
    static BYTES: OnceLock<[bool; 256]> = OnceLock::new();
    BYTES.get_or_init(|| {
        let tok = tokenizer();
        let mut has = [false; 256];
        for id in 0..u32::try_from(tok.vocab_size()).expect("vocab fits u32") {
            if let [b] = tok.token_bytes(id)[..]
                && !tok.is_special(id)
            {
                has[usize::from(b)] = true;
            }
        }
        has
    })
}

fuzz_target!(|data: &[u8]| {
    kvq_fuzz::contain_third_party_panics();
    let tok = tokenizer();
    let vocab = u32::try_from(tok.vocab_size()).expect("vocab fits u32");
    let text = String::from_utf8_lossy(data);
    for special in [false, true] {
        if let Ok(ids) = tok.encode(&text, special) {
            assert!(
                ids.iter().all(|&id| id < vocab),
                "an id past the vocabulary"
            );
            // Text without special-token spellings (`<|im_start|>`, `<filename>`, ...) and made
            // of bytes the vocabulary has round-trips.
            let all_bytes = text.bytes().all(|b| representable()[usize::from(b)]);
            if !special
                && all_bytes
                && !text.contains('<')
                && let Ok(back) = tok.decode(&ids, false)
            {
                assert_eq!(back, text, "round trip");
            }
        }
    }
    // The bytes as little-endian u16 ids: mostly in range, some past it.
    let ids: Vec<u32> = data
        .chunks(2)
        .map(|c| u32::from(c[0]) | (u32::from(*c.get(1).unwrap_or(&0)) << 8))
        .collect();
    for skip in [false, true] {
        let _ = tok.decode(&ids, skip);
        let mut stream = IncrementalDecoder::new(tok.clone(), skip);
        for &id in &ids {
            let _ = stream.push(id);
        }
        let _ = stream.flush();
    }
    for &id in ids.iter().take(64) {
        let _ = tok.id_to_token(id);
        let _ = tok.token_bytes(id);
        let _ = tok.is_special(id);
    }
});
