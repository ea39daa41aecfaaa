//! Saved cache states ([`crate::KvCache::save_state`]): scalars and rows written as named host
//! tensors, and a [`StateReader`] that reads them back with every name, dtype, shape and count
//! checked, so that a state from a corrupted or foreign file is a [`CacheError::State`], never
//! a panic.
//!
//! Conventions every cache's state follows (a cache's own names are plain; `LayerCaches` adds
//! the `layer.<i>.` prefix):
//! - a count or position is an `i64` tensor of shape `[1]` (never negative); a flag is one that
//!   is 0 or 1, a choice among `n` states one in `0..n`; floats are `f32` or `f64` `[1]`;
//! - `method`: the method name as `u8` bytes (`[n]`);
//! - `geom`: `i64 [4]` = n_heads, n_kv_heads, head_dim, sliding window (-1: none);
//! - rows ([`put_rows`]): `<p>.from` (the position of row 0), `<p>.cap` (positions the buffer
//!   they were saved from had room for; 0: none was allocated) and, when both it and the row
//!   count are nonzero, `<p>` `[heads, n, width]`, the rows of positions `from..from + n`.

use crate::rowbuf::GROW_TOKENS;
use crate::traits::{CacheGeometry, CacheState};
use crate::{CacheError, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashSet;

/// Longest `method` name a state may carry.
const MAX_METHOD_BYTES: usize = 256;

/// A [`CacheError::State`] with `msg`.
pub fn state_err(msg: impl Into<String>) -> CacheError {
    CacheError::State(msg.into())
}

/// The most positions a saved buffer of a cache that holds at most `max_tokens` may have room
/// for (host rows grow by doubling, device rows by steps with a step of slack).
pub fn max_cap(max_tokens: usize) -> usize {
    2 * max_tokens + 4 * GROW_TOKENS
}

/// Writes the count `v` as `name` (`i64 [1]`).
pub fn put_usize(state: &mut CacheState, name: &str, v: usize) -> Result<()> {
    let v = i64::try_from(v).map_err(|_| state_err(format!("{name}: {v} does not fit an i64")))?;
    state.insert(name.into(), Tensor::new(&[v], &Device::Cpu)?);
    Ok(())
}

/// Writes `v` as `name` (`f32 [1]`).
pub fn put_f32(state: &mut CacheState, name: &str, v: f32) -> Result<()> {
    state.insert(name.into(), Tensor::new(&[v], &Device::Cpu)?);
    Ok(())
}

/// Writes `v` as `name` (`f64 [1]`, its bits kept).
pub fn put_f64(state: &mut CacheState, name: &str, v: f64) -> Result<()> {
    state.insert(name.into(), Tensor::new(&[v], &Device::Cpu)?);
    Ok(())
}

/// Writes the method name `method` (`u8 [n]`).
pub fn put_method(state: &mut CacheState, method: &str) -> Result<()> {
    let bytes = method.as_bytes().to_vec();
    let n = bytes.len();
    state.insert("method".into(), Tensor::from_vec(bytes, n, &Device::Cpu)?);
    Ok(())
}

/// Writes the geometry `g` as `geom` (see the module docs).
pub fn put_geometry(state: &mut CacheState, g: &CacheGeometry) -> Result<()> {
    let window = match g.sliding_window {
        Some(w) => i64::try_from(w).map_err(|_| state_err("sliding window too large"))?,
        None => -1,
    };
    let dims = [g.n_heads, g.n_kv_heads, g.head_dim].map(|x| x as i64);
    let v = vec![dims[0], dims[1], dims[2], window];
    state.insert("geom".into(), Tensor::from_vec(v, 4, &Device::Cpu)?);
    Ok(())
}

/// Writes rows as `p` (see the module docs): `rows` (`[heads, n, width]`, any device; copied
/// to the host, so the state never shares a live buffer) hold positions `from..from + n` of a
/// buffer with room for `cap` positions (0: no buffer, and no rows).
pub fn put_rows(
    state: &mut CacheState,
    p: &str,
    rows: Option<Tensor>,
    from: usize,
    cap: usize,
) -> Result<()> {
    put_usize(state, &format!("{p}.from"), from)?;
    put_usize(state, &format!("{p}.cap"), cap)?;
    if let Some(rows) = rows.filter(|r| cap > 0 && r.dim(1).is_ok_and(|n| n > 0)) {
        // `force_contiguous` always copies (a contiguous view would share the buffer).
        let host = rows.force_contiguous()?.to_device(&Device::Cpu)?;
        state.insert(p.into(), host);
    }
    Ok(())
}

/// Rows read back by [`StateReader::rows`].
pub struct SavedRows<'a> {
    /// `[heads, n, width]`, the rows of positions `from..from + n`; None when `n` or `cap` is 0.
    pub rows: Option<&'a Tensor>,
    /// The position of row 0.
    pub from: usize,
    /// Positions the saved buffer had room for (0: it had none), at least `n`.
    pub cap: usize,
    /// Rows held: `end - from` (0 when `from >= end`).
    pub n: usize,
}

/// Reads a [`CacheState`] with checks; remembers which tensors it took, so that
/// [`StateReader::finish`] can refuse any it did not (a state of something else).
pub struct StateReader<'a> {
    state: &'a CacheState,
    taken: HashSet<String>,
}

impl<'a> StateReader<'a> {
    /// A reader of `state`.
    pub fn new(state: &'a CacheState) -> Self {
        Self {
            state,
            taken: HashSet::new(),
        }
    }

    /// Whether `state` has a tensor `name`.
    pub fn has(&self, name: &str) -> bool {
        self.state.contains_key(name)
    }

    /// The tensor `name`, which must have `dtype` and `dims`.
    pub fn tensor(&mut self, name: &str, dtype: DType, dims: &[usize]) -> Result<&'a Tensor> {
        let t = self
            .state
            .get(name)
            .ok_or_else(|| state_err(format!("tensor {name}: missing")))?;
        self.taken.insert(name.to_string());
        if t.dtype() != dtype || t.dims() != dims {
            return Err(state_err(format!(
                "tensor {name}: expected {dtype:?} {dims:?}, got {:?} {:?}",
                t.dtype(),
                t.dims()
            )));
        }
        Ok(t)
    }

    /// The one value of the `[1]` tensor `name` of type `T`.
    fn scalar<T: candle_core::WithDType>(&mut self, name: &str) -> Result<T> {
        let v = self.tensor(name, T::DTYPE, &[1])?.to_vec1::<T>()?;
        v.first()
            .copied()
            .ok_or_else(|| state_err(format!("tensor {name}: empty")))
    }

    /// The count `name` (`i64 [1]`, not negative).
    pub fn usize(&mut self, name: &str) -> Result<usize> {
        let v = self.scalar::<i64>(name)?;
        usize::try_from(v)
            .map_err(|_| state_err(format!("tensor {name}: expected a count, got {v}")))
    }

    /// The count `name`, which must be at most `max`.
    pub fn bounded(&mut self, name: &str, max: usize) -> Result<usize> {
        let v = self.usize(name)?;
        if v > max {
            return Err(state_err(format!(
                "tensor {name}: expected at most {max}, got {v}"
            )));
        }
        Ok(v)
    }

    /// The count `name`, which must be `want`.
    pub fn expect_usize(&mut self, name: &str, want: usize) -> Result<()> {
        let v = self.usize(name)?;
        if v != want {
            return Err(state_err(format!(
                "tensor {name}: expected {want} (this cache's), got {v}"
            )));
        }
        Ok(())
    }

    /// The flag `name` (0 or 1).
    pub fn flag(&mut self, name: &str) -> Result<bool> {
        Ok(self.choice(name, 2)? == 1)
    }

    /// The choice `name`, one of `0..n`.
    pub fn choice(&mut self, name: &str, n: usize) -> Result<usize> {
        let v = self.scalar::<i64>(name)?;
        match usize::try_from(v) {
            Ok(c) if c < n => Ok(c),
            _ => Err(state_err(format!(
                "tensor {name}: expected one of 0..{n}, got {v}"
            ))),
        }
    }

    /// The `f32 [1]` tensor `name`.
    pub fn f32(&mut self, name: &str) -> Result<f32> {
        self.scalar::<f32>(name)
    }

    /// The `f64 [1]` tensor `name`.
    pub fn f64(&mut self, name: &str) -> Result<f64> {
        self.scalar::<f64>(name)
    }

    /// Checks that the state is of method `method`.
    pub fn expect_method(&mut self, method: &str) -> Result<()> {
        let t = self
            .state
            .get("method")
            .ok_or_else(|| state_err("tensor method: missing"))?;
        let n = t.dims1().unwrap_or(usize::MAX);
        if t.dtype() != DType::U8 || n > MAX_METHOD_BYTES {
            return Err(state_err(format!(
                "tensor method: expected U8 [n <= {MAX_METHOD_BYTES}], got {:?} {:?}",
                t.dtype(),
                t.dims()
            )));
        }
        self.taken.insert("method".into());
        let name = String::from_utf8_lossy(&t.to_vec1::<u8>()?).into_owned();
        if name != method {
            return Err(state_err(format!(
                "a state of method '{name}' cannot be restored into a {method} cache"
            )));
        }
        Ok(())
    }

    /// Checks that the state was saved at geometry `g` (its query heads, kv heads, head
    /// dimension and sliding window; its length is checked against `g.max_tokens` by the
    /// caller).
    pub fn expect_geometry(&mut self, g: &CacheGeometry) -> Result<()> {
        let got = self.tensor("geom", DType::I64, &[4])?.to_vec1::<i64>()?;
        let window = g.sliding_window.map_or(-1, |w| w as i64);
        let want = [
            g.n_heads as i64,
            g.n_kv_heads as i64,
            g.head_dim as i64,
            window,
        ];
        if got != want {
            return Err(state_err(format!(
                "tensor geom: this cache's geometry is {want:?} (heads, kv heads, head dim, \
                 sliding window), the state's {got:?}"
            )));
        }
        Ok(())
    }

    /// The rows `p` (see [`put_rows`]) of positions up to `end`, `[heads, n, width]` of
    /// `dtype`: `from` and `cap` at most `limit`, `cap` at least `n = end - from`. With
    /// `required`, rows that `n` says are held must be there (a buffer was allocated); without,
    /// a state may say none was (`cap` 0).
    pub fn rows(
        &mut self,
        p: &str,
        (heads, width, dtype): (usize, usize, DType),
        end: usize,
        limit: usize,
        required: bool,
    ) -> Result<SavedRows<'a>> {
        let from = self.bounded(&format!("{p}.from"), limit)?;
        let cap = self.bounded(&format!("{p}.cap"), limit)?;
        let n = end.saturating_sub(from);
        if cap == 0 {
            if self.has(p) {
                return Err(state_err(format!(
                    "tensor {p}: present, but {p}.cap says no buffer was saved"
                )));
            }
            if required && n > 0 {
                return Err(state_err(format!(
                    "tensor {p}.cap: 0, but positions {from}..{end} are held"
                )));
            }
            return Ok(SavedRows {
                rows: None,
                from,
                cap,
                n: 0,
            });
        }
        if cap < n {
            return Err(state_err(format!(
                "tensor {p}.cap: {cap} positions, fewer than the {n} rows held"
            )));
        }
        let rows = match n {
            0 if self.has(p) => {
                return Err(state_err(format!(
                    "tensor {p}: present, but no row is held"
                )));
            }
            0 => None,
            _ => Some(self.tensor(p, dtype, &[heads, n, width])?),
        };
        Ok(SavedRows { rows, from, cap, n })
    }

    /// Checks that every tensor of the state was taken.
    pub fn finish(self) -> Result<()> {
        let mut extra: Vec<&String> = self
            .state
            .keys()
            .filter(|k| !self.taken.contains(*k))
            .collect();
        extra.sort();
        match extra.first() {
            Some(name) => Err(state_err(format!(
                "tensor {name}: not part of this cache's state ({} unknown)",
                extra.len()
            ))),
            None => Ok(()),
        }
    }
}
