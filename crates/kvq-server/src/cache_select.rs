//! Choosing a request's KV cache method: the `x-kv-cache-method` / `x-kv-cache-bits` headers,
//! else the body's `kv_cache`, resolved through the `CacheRegistry`.

use crate::error::ApiError;
use axum::http::HeaderMap;
use kvq_cache::{CacheRegistry, CacheSpec, ResolvedCache};

/// Request (and response) header naming the cache method.
pub const HEADER_METHOD: &str = "x-kv-cache-method";
/// Request header with the bits per element.
pub const HEADER_BITS: &str = "x-kv-cache-bits";
/// Where the method came from when it came from the body.
pub const BODY_METHOD_PARAM: &str = "kv_cache.method";

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Result<Option<&'a str>, ApiError> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim()).filter(|s| !s.is_empty()))
            .map_err(|_| {
                ApiError::invalid(name, format!("The '{name}' header must be ASCII text."))
            }),
    }
}

/// Where a request's cache choice came from: the parameter to blame for a bad method, and the
/// one to blame for bits the method does not take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheSource {
    pub method: &'static str,
    pub bits: &'static str,
}

/// Where the body's bits are given.
pub const BODY_BITS_PARAM: &str = "kv_cache.bits";

/// The cache the request asks for, and the parameters to blame if it is invalid.
///
/// A method header wins over the body entirely; without one, the body's `kv_cache` is used and
/// an `x-kv-cache-bits` header still overrides its bits.
pub fn cache_spec(
    headers: &HeaderMap,
    body: Option<&CacheSpec>,
) -> Result<(CacheSpec, CacheSource), ApiError> {
    let method = header_str(headers, HEADER_METHOD)?;
    let bits = match header_str(headers, HEADER_BITS)? {
        None => None,
        Some(b) => Some(b.parse::<u8>().map_err(|_| {
            ApiError::invalid(
                HEADER_BITS,
                format!("The '{HEADER_BITS}' header must be an integer from 0 to 255; got '{b}'."),
            )
        })?),
    };
    let from_headers = CacheSource {
        method: HEADER_METHOD,
        bits: HEADER_BITS,
    };
    if let Some(method) = method {
        let spec = CacheSpec {
            method: Some(method.to_string()),
            bits,
        };
        return Ok((spec, from_headers));
    }
    match body {
        Some(spec) if spec.method.is_some() || spec.bits.is_some() => Ok((
            CacheSpec {
                method: spec.method.clone(),
                bits: bits.or(spec.bits),
            },
            CacheSource {
                method: match spec.method {
                    Some(_) => BODY_METHOD_PARAM,
                    None => HEADER_METHOD,
                },
                bits: match bits {
                    Some(_) => HEADER_BITS,
                    None => BODY_BITS_PARAM,
                },
            },
        )),
        _ => Ok((CacheSpec { method: None, bits }, from_headers)),
    }
}

/// Resolves the request's cache choice; unknown methods and invalid bits are 400s that list the
/// valid choices, naming the header or body field that was wrong.
pub fn resolve_cache(
    registry: &CacheRegistry,
    headers: &HeaderMap,
    body: Option<&CacheSpec>,
) -> Result<ResolvedCache, ApiError> {
    let (spec, source) = cache_spec(headers, body)?;
    registry.resolve(&spec).map_err(|e| {
        let param = match e {
            kvq_cache::CacheError::InvalidBits { .. } => source.bits,
            _ => source.method,
        };
        ApiError::from_cache(e, param)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn header_wins_over_body() {
        let body = CacheSpec {
            method: Some("qjl".into()),
            bits: Some(3),
        };
        let (spec, source) = cache_spec(&headers(&[(HEADER_METHOD, "fp16")]), Some(&body)).unwrap();
        assert_eq!(spec.method.as_deref(), Some("fp16"));
        assert_eq!(spec.bits, None);
        assert_eq!(source.method, HEADER_METHOD);
    }

    #[test]
    fn body_used_without_header() {
        let body = CacheSpec {
            method: Some("fp16".into()),
            bits: Some(16),
        };
        let (spec, source) = cache_spec(&HeaderMap::new(), Some(&body)).unwrap();
        assert_eq!(spec, body);
        assert_eq!(source.method, BODY_METHOD_PARAM);
        assert_eq!(source.bits, BODY_BITS_PARAM);
    }

    /// Bits a method does not take blame the field that gave the bits, not the method's.
    #[test]
    fn invalid_bits_name_where_the_bits_came_from() {
        let reg = CacheRegistry::builtin();
        let body = CacheSpec {
            method: Some("turboquant-mse".into()),
            bits: Some(7),
        };
        let err = resolve_cache(&reg, &HeaderMap::new(), Some(&body)).unwrap_err();
        assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(err.param(), Some(BODY_BITS_PARAM));
        let err = resolve_cache(&reg, &headers(&[(HEADER_BITS, "7")]), Some(&body)).unwrap_err();
        assert_eq!(err.param(), Some(HEADER_BITS));
        let h = headers(&[(HEADER_METHOD, "turboquant-mse"), (HEADER_BITS, "7")]);
        assert_eq!(
            resolve_cache(&reg, &h, None).unwrap_err().param(),
            Some(HEADER_BITS)
        );
        // A bad method with good bits still names the method.
        let body = CacheSpec {
            method: Some("zip".into()),
            bits: Some(4),
        };
        let err = resolve_cache(&reg, &HeaderMap::new(), Some(&body)).unwrap_err();
        assert_eq!(err.param(), Some(BODY_METHOD_PARAM));
    }

    #[test]
    fn bad_bits_header_is_400() {
        let err = cache_spec(&headers(&[(HEADER_BITS, "three")]), None).unwrap_err();
        assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(err.param(), Some(HEADER_BITS));
    }

    #[test]
    fn unknown_method_lists_valid() {
        let reg = CacheRegistry::builtin();
        let err = resolve_cache(&reg, &headers(&[(HEADER_METHOD, "zip")]), None).unwrap_err();
        assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(err.param(), Some(HEADER_METHOD));
        assert!(err.to_string().contains("fp16"));
        let body = CacheSpec {
            method: Some("zip".into()),
            bits: None,
        };
        let err = resolve_cache(&reg, &HeaderMap::new(), Some(&body)).unwrap_err();
        assert_eq!(err.param(), Some(BODY_METHOD_PARAM));
    }

    #[test]
    fn default_resolves() {
        let reg = CacheRegistry::builtin();
        let c = resolve_cache(&reg, &HeaderMap::new(), None).unwrap();
        assert_eq!(c.name, reg.default_method());
    }
}
