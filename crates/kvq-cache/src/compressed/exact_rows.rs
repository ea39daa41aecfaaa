//! The fp16 rows of a compressed cache: the recent window's keys and values and the sinks'
//! (the first `sinks` positions), on the host for a CPU cache or in device buffers on a GPU,
//! with the policy that drops the window rows no future query can need.
//!
//! Invariant: for a cache holding `len` positions, the recent rows hold positions
//! `[first, len)` and the sink rows `[0, min(len, sinks))`, keys and values alike. `first`
//! starts at 0 and only grows, in [`ExactRows::trim`], which the cache calls only once the key
//! center no longer needs every row (`KeyCenter::holds_rows`, `center.rs`): until then the
//! recent rows hold every key so far. A query at position `pos` reads the rows of
//! `(pos - window, pos]` and of the sinks, so `first <= len + 1 - window` keeps every future
//! query's rows. A device buffer may also hold stale rows past `len` after a truncation: they
//! are overwritten by the next append and never read.

use crate::rowbuf::{GROW_TOKENS, RowBuf};
use crate::state::{StateReader, put_rows, put_usize, state_err};
use crate::traits::CacheState;
use crate::{CacheError, Result};
use candle_core::{DType, Device, Tensor};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// fp16 rows of one kind (keys or values) for a contiguous range of positions, per head: on
/// the host for a CPU cache (its merge reads them row by row), in a device buffer on a GPU (the
/// kernels read them there).
#[derive(Default)]
pub(super) struct Fp16Rows {
    /// `[head][pos - first][d]`, one Vec per head (CPU).
    rows: Vec<Vec<f16>>,
    /// The first position held (any before it are gone).
    first: usize,
    /// `[heads, capacity, d]` f16 on the device, when the cache lives there.
    dev: Option<RowBuf>,
}

impl Fp16Rows {
    fn new(heads: usize) -> Self {
        Self {
            rows: vec![Vec::new(); heads],
            first: 0,
            dev: None,
        }
    }

    /// The rows of head `h` at positions `from..to` (held, on the host), as f32 into `out`
    /// (`(to - from) * d` long), converted in one pass.
    pub(super) fn rows_f32(&self, h: usize, (from, to): (usize, usize), d: usize, out: &mut [f32]) {
        let (a, b) = ((from - self.first) * d, (to - self.first) * d);
        self.rows[h][a..b].convert_to_f32_slice(out);
    }

    /// The device rows of positions `from..to` (`[heads, to - from, d]` f16), as a view; None
    /// on the host or before the first write.
    pub(super) fn dev_range(&self, from: usize, to: usize) -> Result<Option<Tensor>> {
        Ok(match &self.dev {
            Some(buf) => buf.range(from, to)?,
            None => None,
        })
    }

    fn fork(&self) -> Result<Self> {
        Ok(Self {
            rows: self.rows.clone(),
            first: self.first,
            dev: self.dev.as_ref().map(RowBuf::fork).transpose()?,
        })
    }

    fn bytes(&self) -> usize {
        match &self.dev {
            Some(d) => d.bytes(),
            None => self.rows.iter().map(|r| r.capacity() * 2).sum(),
        }
    }

    /// Writes the rows of positions `first..end` (`[heads, n, d]` f16) as `p`
    /// (`crate::state::put_rows`): a device buffer's rows from its own first row (at most
    /// `first`) and its capacity, or the host rows and their capacity in positions.
    fn save(
        &self,
        state: &mut CacheState,
        p: &str,
        (heads, d): (usize, usize),
        end: usize,
    ) -> Result<()> {
        if let Some(buf) = &self.dev {
            return buf.save(state, p, end);
        }
        let n = end.saturating_sub(self.first);
        let mut data = Vec::with_capacity(heads * n * d);
        for r in &self.rows {
            let held = r.get(..n * d).ok_or_else(|| {
                state_err(format!(
                    "{p}: {} rows held, {n} expected",
                    r.len() / d.max(1)
                ))
            })?;
            data.extend_from_slice(held);
        }
        let cap = self
            .rows
            .iter()
            .map(|r| r.capacity() / d.max(1))
            .max()
            .unwrap_or(0);
        let rows = Tensor::from_vec(data, (heads, n, d), &Device::Cpu)?;
        put_rows(state, p, Some(rows), self.first, cap)
    }

    /// Rows like these (empty) ones holding the rows `p` of positions `first..end` that
    /// [`Self::save`] wrote (from a host or a device cache), where these live: in a device
    /// buffer on `dev` when they have one, else on the host; `limit` bounds the saved
    /// capacity. The saved rows must start at or before `first`.
    fn restore(
        &self,
        reader: &mut StateReader<'_>,
        p: &str,
        (heads, d): (usize, usize),
        (first, end, limit): (usize, usize, usize),
        dev: &Device,
    ) -> Result<Self> {
        let check = |from: usize| match from <= first {
            true => Ok(()),
            false => Err(state_err(format!(
                "tensor {p}.from: {from}, after the first position held, {first}"
            ))),
        };
        if let Some(empty) = &self.dev {
            let buf = empty.restore(reader, p, (end, limit, true), dev)?;
            check(buf.first)?;
            return Ok(Self {
                rows: vec![Vec::new(); heads],
                first,
                dev: Some(buf),
            });
        }
        let saved = reader.rows(p, (heads, d, DType::F16), end, limit, true)?;
        check(saved.from)?;
        let skip = (first - saved.from).min(saved.n);
        let keep = saved.n - skip;
        let data = match saved.rows {
            Some(t) => t.flatten_all()?.to_vec1::<f16>()?,
            None => Vec::new(),
        };
        let rows = (0..heads)
            .map(|h| {
                let mut r = Vec::with_capacity(saved.cap.max(keep) * d);
                let at = (h * saved.n + skip) * d;
                r.extend_from_slice(&data[at..at + keep * d]);
                r
            })
            .collect();
        Ok(Self {
            rows,
            first,
            dev: None,
        })
    }
}

/// The fp16 window and sink rows of one layer (see the module docs for what they hold).
pub(super) struct ExactRows {
    recent_k: Fp16Rows,
    recent_v: Fp16Rows,
    sink_k: Fp16Rows,
    sink_v: Fp16Rows,
    /// Recent positions a query reads from fp16 (at least 1).
    window: usize,
    /// First positions every query reads from fp16.
    sinks: usize,
    /// kv heads and head dimension.
    heads: usize,
    d: usize,
    /// Recent rows kept beyond what the window needs, so a truncation that far back still
    /// finds its rows (`KvCache::allow_rewind`).
    rewind: usize,
}

impl ExactRows {
    /// No rows yet, on the host, for `heads` kv heads of dimension `d`.
    pub(super) fn new(heads: usize, d: usize, window: usize, sinks: usize) -> Self {
        Self {
            recent_k: Fp16Rows::new(heads),
            recent_v: Fp16Rows::new(heads),
            sink_k: Fp16Rows::new(heads),
            sink_v: Fp16Rows::new(heads),
            window: window.max(1),
            sinks,
            heads,
            d,
            rewind: 0,
        }
    }

    /// Keeps `tokens` more recent rows than the window needs from the next trim on.
    pub(super) fn set_rewind(&mut self, tokens: usize) {
        self.rewind = tokens;
    }

    /// Recent rows kept beyond the window's.
    pub(super) fn rewind(&self) -> usize {
        self.rewind
    }

    /// Recent positions a query reads from fp16.
    pub(super) fn window(&self) -> usize {
        self.window
    }

    /// First positions every query reads from fp16.
    pub(super) fn sinks(&self) -> usize {
        self.sinks
    }

    /// The first position the recent rows hold.
    pub(super) fn first(&self) -> usize {
        self.recent_k.first
    }

    /// Whether the rows live in device buffers.
    pub(super) fn on_device(&self) -> bool {
        self.recent_k.dev.is_some()
    }

    /// The key rows: (sinks, recent).
    pub(super) fn keys(&self) -> (&Fp16Rows, &Fp16Rows) {
        (&self.sink_k, &self.recent_k)
    }

    /// The value rows: (sinks, recent).
    pub(super) fn values(&self) -> (&Fp16Rows, &Fp16Rows) {
        (&self.sink_v, &self.recent_v)
    }

    /// Moves these (empty) rows to device buffers: a cache lives where its first keys came
    /// from.
    pub(super) fn use_device(&mut self) {
        let (h, d) = (self.heads, self.d);
        // The window's buffer grows (and is compacted) a window's length at a time.
        let recent = (self.window + 1).next_power_of_two().clamp(16, GROW_TOKENS);
        let sinks = self.sinks.max(1);
        for (rows, step) in [
            (&mut self.recent_k, recent),
            (&mut self.recent_v, recent),
            (&mut self.sink_k, sinks),
            (&mut self.sink_v, sinks),
        ] {
            *rows = Fp16Rows {
                dev: Some(RowBuf::new(h, d, DType::F16, step)),
                ..Fp16Rows::new(h)
            };
        }
    }

    /// Appends the host rows of keys `kd` and values `vd` (`[kv heads][t][d]` f32) at
    /// positions `len..len + t`, the first `sinks` also as sinks.
    pub(super) fn push_host(&mut self, kd: &[f32], vd: &[f32], len: usize, t: usize) {
        let d = self.d;
        for h in 0..self.heads {
            for i in 0..t {
                let pos = len + i;
                let (kr, vr) = (
                    &kd[(h * t + i) * d..(h * t + i + 1) * d],
                    &vd[(h * t + i) * d..(h * t + i + 1) * d],
                );
                let push = |rows: &mut Fp16Rows, x: &[f32]| {
                    rows.rows[h].extend(x.iter().map(|&f| f16::from_f32(f)))
                };
                if pos < self.sinks {
                    push(&mut self.sink_k, kr);
                    push(&mut self.sink_v, vr);
                }
                push(&mut self.recent_k, kr);
                push(&mut self.recent_v, vr);
            }
        }
    }

    /// Appends the device rows of keys `k` and values `v` (`[kv heads, t, d]` f32 on the
    /// device) at positions `len..`, the first `sinks` also as sinks.
    pub(super) fn push_device(&mut self, k: &Tensor, v: &Tensor, len: usize) -> Result<()> {
        let t = k.dim(1)?;
        let (k16, v16) = (k.to_dtype(DType::F16)?, v.to_dtype(DType::F16)?);
        let keep = self.recent_k.first;
        for (rows, x) in [(&mut self.recent_k, &k16), (&mut self.recent_v, &v16)] {
            if let Some(buf) = &mut rows.dev {
                buf.write(x, len, keep)?;
            }
        }
        let ns = self.sinks.min(len + t).saturating_sub(len);
        if ns > 0 {
            for (rows, x) in [(&mut self.sink_k, &k16), (&mut self.sink_v, &v16)] {
                if let Some(buf) = &mut rows.dev {
                    buf.write(&x.narrow(1, 0, ns)?, len, 0)?;
                }
            }
        }
        Ok(())
    }

    /// [`Self::push_device`] on CUDA once past the sinks: one launch stores the keys and values
    /// as f16 into the window rows in place.
    #[cfg(feature = "cuda")]
    pub(super) fn push_cuda(&mut self, k: &Tensor, v: &Tensor, len: usize) -> Result<()> {
        let t = k.dim(1)?;
        let keep = self.recent_k.first;
        let (Some(bk), Some(bv), true) = (
            &mut self.recent_k.dev,
            &mut self.recent_v.dev,
            len >= self.sinks,
        ) else {
            return self.push_device(k, v, len);
        };
        let (kb, kr) = bk.reserve(len, t, keep, k.device())?;
        let (vb, vr) = bv.reserve(len, t, keep, v.device())?;
        if kr != vr {
            // The two buffers always move together; should they not, write each on its own.
            kb.slice_set(&k.to_dtype(DType::F16)?, 1, kr)?;
            vb.slice_set(&v.to_dtype(DType::F16)?, 1, vr)?;
            return Ok(());
        }
        Ok(kvq_kernels::cuda::step::store_rows_f16(k, v, &kb, &vb, kr)?)
    }

    /// Every key so far, positions `0..len` (`[kv head][len][d]` f32), for fixing the key
    /// center: all are held then (`first` is 0 while it is pending). A device cache reads them
    /// back, once.
    pub(super) fn keys_from_start(&self, len: usize) -> Result<Vec<f32>> {
        if let Some(buf) = &self.recent_k.dev
            && let Some(rows) = buf.view(len)?
        {
            return Ok(rows.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        let n = len * self.d;
        let mut out = vec![0f32; self.heads * n];
        for (h, rows) in self.recent_k.rows.iter().enumerate() {
            rows[..n].convert_to_f32_slice(&mut out[h * n..(h + 1) * n]);
        }
        Ok(out)
    }

    /// Drops the window rows no future query can need once the cache holds `len` positions:
    /// all but the last `window - 1` (a later query sits at `len` or past it), plus the
    /// `rewind` rows a truncation may still need. The caller skips this while every row must
    /// stay (`KeyCenter::holds_rows`).
    pub(super) fn trim(&mut self, len: usize) -> Result<()> {
        let d = self.d;
        let keep_from = len.saturating_sub(self.window - 1 + self.rewind);
        if keep_from <= self.recent_k.first {
            return Ok(());
        }
        let room = self.window + 1 + self.rewind;
        if self.recent_k.dev.is_some() {
            let keep = room;
            for rows in [&mut self.recent_k, &mut self.recent_v] {
                rows.first = keep_from;
                if let Some(buf) = &mut rows.dev {
                    buf.shrink(len, keep_from, keep)?;
                }
            }
            return Ok(());
        }
        let drop = (keep_from - self.recent_k.first) * d;
        for rows in [&mut self.recent_k, &mut self.recent_v] {
            for r in rows.rows.iter_mut() {
                r.drain(..drop.min(r.len()));
                // After a long prompt chunk, give the memory back: keep room for the window.
                if r.capacity() > room * d * 5 / 4 {
                    r.shrink_to(room * d);
                }
            }
            rows.first = keep_from;
        }
        Ok(())
    }

    /// Whether a truncation to `n` positions keeps the rows a query at position `n` reads
    /// (those from `n + 1 - window` on, or the sinks).
    pub(super) fn check_truncate(&self, n: usize) -> Result<()> {
        let needed = (n + 1).saturating_sub(self.window).max(self.sinks);
        if self.recent_k.first > needed {
            return Err(CacheError::Shape(format!(
                "cannot truncate to {n}: the fp16 rows from position {needed} are gone"
            )));
        }
        Ok(())
    }

    /// Forgets the rows of positions `n..` (host rows; device rows past `n` are overwritten by
    /// later appends).
    pub(super) fn truncate(&mut self, n: usize) {
        let d = self.d;
        for h in 0..self.heads {
            for rows in [&mut self.recent_k, &mut self.recent_v] {
                let keep = n.saturating_sub(rows.first) * d;
                rows.rows[h].truncate(keep);
            }
            for rows in [&mut self.sink_k, &mut self.sink_v] {
                rows.rows[h].truncate(n.min(self.sinks) * d);
            }
        }
    }

    /// An upper bound on the bytes of keys and values together after an attend, while at most
    /// `recent` window positions and `min(tokens, sinks)` sinks are held then. Host rows are
    /// Vecs grown by doubling, and [`Self::trim`] shrinks a window Vec past 5/4 of the window,
    /// so each stays under twice the rows it holds; device window rows are a rolling
    /// [`RowBuf`] that `shrink` compacts once it is over twice the window's size.
    pub(super) fn max_bytes(&self, tokens: usize, recent: usize) -> usize {
        let sinks = tokens.min(self.sinks);
        let one = |rows: &Fp16Rows, held: usize, rolling: bool| match &rows.dev {
            Some(buf) if rolling => 2 * buf.max_bytes(held, true),
            Some(buf) => buf.max_bytes(held, false),
            None => self.heads * 2 * held * self.d * 2,
        };
        one(&self.recent_k, recent, true)
            + one(&self.recent_v, recent, true)
            + one(&self.sink_k, sinks, false)
            + one(&self.sink_v, sinks, false)
    }

    /// Bytes held: (keys, values).
    pub(super) fn bytes(&self) -> (usize, usize) {
        (
            self.recent_k.bytes() + self.sink_k.bytes(),
            self.recent_v.bytes() + self.sink_v.bytes(),
        )
    }

    /// An independent copy (device buffers copied on their device).
    pub(super) fn fork(&self) -> Result<Self> {
        Ok(Self {
            recent_k: self.recent_k.fork()?,
            recent_v: self.recent_v.fork()?,
            sink_k: self.sink_k.fork()?,
            sink_v: self.sink_v.fork()?,
            ..*self
        })
    }

    /// Writes `exact.window`, `exact.sinks`, `exact.rewind`, `exact.first` (the first recent
    /// position held) and the rows, of a cache holding `len` positions: `exact.recent_k`,
    /// `exact.recent_v` (positions `[first, len)`, or from a device buffer's first row) and
    /// `exact.sink_k`, `exact.sink_v` (`[0, min(len, sinks))`), each `[heads, n, d]` f16.
    pub(super) fn save(&self, state: &mut CacheState, len: usize) -> Result<()> {
        put_usize(state, "exact.window", self.window)?;
        put_usize(state, "exact.sinks", self.sinks)?;
        put_usize(state, "exact.rewind", self.rewind)?;
        put_usize(state, "exact.first", self.first())?;
        let hd = (self.heads, self.d);
        self.recent_k.save(state, "exact.recent_k", hd, len)?;
        self.recent_v.save(state, "exact.recent_v", hd, len)?;
        let ns = len.min(self.sinks);
        self.sink_k.save(state, "exact.sink_k", hd, ns)?;
        self.sink_v.save(state, "exact.sink_v", hd, ns)
    }

    /// Rows like these (fresh) ones holding what [`Self::save`] wrote for a cache of `len`
    /// positions: in device buffers on `dev` when `on_device` (or these are), else on the host;
    /// `limit` bounds the saved capacities and the rewind. The window and sinks must be this
    /// cache's, and the first recent position at most `len`.
    pub(super) fn restore(
        &self,
        reader: &mut StateReader<'_>,
        (len, limit): (usize, usize),
        dev: &Device,
        on_device: bool,
    ) -> Result<Self> {
        reader.expect_usize("exact.window", self.window)?;
        reader.expect_usize("exact.sinks", self.sinks)?;
        let rewind = reader.bounded("exact.rewind", limit)?;
        let first = reader.bounded("exact.first", len)?;
        let mut out = Self::new(self.heads, self.d, self.window, self.sinks);
        if on_device || self.on_device() {
            out.use_device();
        }
        out.rewind = rewind;
        let hd = (self.heads, self.d);
        let recent = (first, len, limit);
        out.recent_k = out
            .recent_k
            .restore(reader, "exact.recent_k", hd, recent, dev)?;
        out.recent_v = out
            .recent_v
            .restore(reader, "exact.recent_v", hd, recent, dev)?;
        let sinks = (0, len.min(self.sinks), limit);
        out.sink_k = out.sink_k.restore(reader, "exact.sink_k", hd, sinks, dev)?;
        out.sink_v = out.sink_v.restore(reader, "exact.sink_v", hd, sinks, dev)?;
        Ok(out)
    }
}
