//! A growable `[heads, capacity, width]` tensor of per-position rows on the cache's device: the
//! compressed caches' code rows, and on a GPU the fp16 rows of the dense caches and of the
//! compressed caches' window and sinks. Rows are written in place (`slice_set`), never
//! concatenated per token; under a sliding window the rows no query can reach are dropped when
//! the buffer is next reallocated, so it stops growing at the window.

use crate::Result;
use crate::state::{StateReader, put_rows};
use crate::traits::CacheState;
use candle_core::{DType, Device, Tensor};

/// Positions by which code rows grow (so `resident_bytes` stays close to the promised size).
pub const GROW_TOKENS: usize = 256;

/// See the module docs. Row `i` holds position `first + i`.
pub struct RowBuf {
    buf: Option<Tensor>,
    cap: usize,
    /// Elements per row.
    width: usize,
    heads: usize,
    dtype: DType,
    /// Positions by which the capacity grows.
    step: usize,
    /// Position of row 0.
    pub first: usize,
}

impl RowBuf {
    /// Rows of `width` bytes (codes), grown by [`GROW_TOKENS`].
    pub fn codes(heads: usize, width: usize) -> Self {
        Self::new(heads, width, DType::U8, GROW_TOKENS)
    }

    /// Rows of `width` elements of `dtype`, grown `step` positions at a time (a reallocation
    /// copies the live rows once per `step` appended positions: 1/step of what attending reads).
    pub fn new(heads: usize, width: usize, dtype: DType, step: usize) -> Self {
        Self {
            buf: None,
            cap: 0,
            width,
            heads,
            dtype,
            step: step.max(1),
            first: 0,
        }
    }

    /// Writes `rows` (`[heads, t, width]`, this buffer's dtype) for positions `len..len + t`;
    /// positions before `keep_from` may be dropped (they are when the buffer has to grow).
    pub fn write(&mut self, rows: &Tensor, len: usize, keep_from: usize) -> Result<()> {
        let (buf, row) = self.reserve(len, rows.dim(1)?, keep_from, rows.device())?;
        buf.slice_set(&rows.contiguous()?, 1, row)?;
        Ok(())
    }

    /// Makes room for `t` rows at positions `len..len + t` (as [`Self::write`] does) and returns
    /// the buffer and the row where position `len` goes, for a kernel that writes them in place.
    pub fn reserve(
        &mut self,
        len: usize,
        t: usize,
        keep_from: usize,
        dev: &Device,
    ) -> Result<(Tensor, usize)> {
        if self.buf.is_none() || len < self.first || len - self.first + t > self.cap {
            let first = keep_from.max(self.first.min(len)).min(len);
            let live = len - first;
            // A rolling buffer keeps a step of slack so it is reallocated once per step.
            let slack = if first > 0 { self.step } else { 0 };
            let cap = (live + t).div_ceil(self.step) * self.step + slack;
            self.realloc(first, live, cap, dev)?;
        }
        match &self.buf {
            Some(buf) => Ok((buf.clone(), len - self.first)),
            None => Err(crate::CacheError::Shape("row buffer not allocated".into())),
        }
    }

    /// Moves the live rows `first..first + live` into a fresh buffer of `cap` rows.
    fn realloc(
        &mut self,
        first: usize,
        live: usize,
        cap: usize,
        dev: &candle_core::Device,
    ) -> Result<()> {
        let fresh = Tensor::zeros((self.heads, cap, self.width), self.dtype, dev)?;
        if let (Some(old), true) = (&self.buf, live > 0) {
            let rows = old.narrow(1, first - self.first, live)?.contiguous()?;
            fresh.slice_set(&rows, 1, 0)?;
        }
        self.buf = Some(fresh);
        self.cap = cap;
        self.first = first;
        Ok(())
    }

    /// Gives memory back when at most `keep` of the `len - keep_from` live rows are needed
    /// from now on and the buffer is over twice that: after a long prompt chunk, the window.
    pub fn shrink(&mut self, len: usize, keep_from: usize, keep: usize) -> Result<()> {
        let first = keep_from.clamp(self.first, len.max(self.first));
        let cap = (keep + 1).div_ceil(self.step) * self.step + self.step;
        if self.cap > 2 * cap
            && len - first <= keep
            && let Some(dev) = self.buf.as_ref().map(|b| b.device().clone())
        {
            self.realloc(first, len - first, cap, &dev)?;
        }
        Ok(())
    }

    /// The rows of positions `first..len`, as a view.
    pub fn view(&self, len: usize) -> Result<Option<Tensor>> {
        Ok(match &self.buf {
            Some(b) => Some(b.narrow(1, 0, len.saturating_sub(self.first))?),
            None => None,
        })
    }

    /// The rows of positions `from..to` (all held), as a view.
    pub fn range(&self, from: usize, to: usize) -> Result<Option<Tensor>> {
        Ok(match &self.buf {
            Some(b) if from >= self.first && to >= from => {
                Some(b.narrow(1, from - self.first, to - from)?)
            }
            _ => None,
        })
    }

    /// An independent copy (the buffer copied on its device).
    pub fn fork(&self) -> Result<Self> {
        Ok(Self {
            buf: self.buf.as_ref().map(|b| b.copy()).transpose()?,
            ..*self
        })
    }

    /// The rows' element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// An upper bound on [`Self::bytes`] while at most `held` positions are live at once
    /// (the rows kept plus those being written): every allocation rounds `held` up to a step,
    /// and a buffer that drops old rows (`rolling`) adds one step of slack.
    pub fn max_bytes(&self, held: usize, rolling: bool) -> usize {
        let cap = held.div_ceil(self.step) * self.step + if rolling { self.step } else { 0 };
        self.heads * cap * self.width * self.dtype.size_in_bytes()
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        self.heads * self.cap * self.width * self.dtype.size_in_bytes()
    }

    /// Writes the rows of positions `first..end` (`end` at most the positions written), the
    /// capacity and `first` into `state` as `p` (`crate::state::put_rows`).
    pub fn save(&self, state: &mut CacheState, p: &str, end: usize) -> Result<()> {
        put_rows(state, p, self.view(end)?, self.first, self.cap)
    }

    /// A buffer like this (empty) one holding the rows `p` of positions up to `end` that
    /// [`Self::save`] wrote, on `dev`, with the saved capacity (`limit` bounds it and `first`;
    /// `required`: see [`StateReader::rows`]). A fresh buffer: the state's tensors are copied.
    pub fn restore(
        &self,
        reader: &mut StateReader<'_>,
        p: &str,
        (end, limit, required): (usize, usize, bool),
        dev: &Device,
    ) -> Result<Self> {
        let shape = (self.heads, self.width, self.dtype);
        let saved = reader.rows(p, shape, end, limit, required)?;
        let buf = match saved.cap {
            0 => None,
            cap => {
                let fresh = Tensor::zeros((self.heads, cap, self.width), self.dtype, dev)?;
                if let Some(rows) = saved.rows {
                    fresh.slice_set(&rows.to_device(dev)?.contiguous()?, 1, 0)?;
                }
                Some(fresh)
            }
        };
        Ok(Self {
            buf,
            cap: saved.cap,
            first: saved.from,
            ..*self
        })
    }
}
