//! Contains panics of the third-party code that reads untrusted input (minijinja rendering a
//! model's chat template, tokenizers parsing a tokenizer.json): a panic there becomes an error of
//! the caller's choosing instead of unwinding through a request handler. Known cases, found by
//! the fuzz targets in fuzz/: minijinja 2.24 indexes out of bounds on a negative-step slice of an
//! empty string (`''[::-1]`), tokenizers 0.23 unwraps a decoder that fails to parse.

use std::panic::{AssertUnwindSafe, catch_unwind};

/// Runs `f`; a panic inside it is `Err(message)`.
pub fn contained<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_errors() {
        assert_eq!(contained(|| 3), Ok(3));
        let err = contained(|| -> u8 { panic!("boom {}", 1) }).unwrap_err();
        assert_eq!(err, "boom 1");
    }
}
