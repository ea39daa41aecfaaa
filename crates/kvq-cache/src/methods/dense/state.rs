//! A dense cache's saved state (`KvCache::save_state`), the same from host blocks and from
//! device rows, so either restores into either (conventions in `crate::state`):
//! - `method` (`fp16` or `f32`), `geom`, `len`, `roll` (flag: rows that left a sliding window
//!   are released);
//! - `k`, `v`: the rows of the positions held, `[kv heads, len - first, head_dim]` of the
//!   cache's dtype, with `k.from`/`v.from` = `first` (the first position held: 0, or under a
//!   rolling sliding window the start of the first block or device row kept) and
//!   `k.cap`/`v.cap` (device rows: the buffer's capacity; host: the positions its blocks
//!   hold);
//! - `spare`: flag, a host cache's recycled block (restored as a zero block: its slots are
//!   never read before they are written).
//!
//! Restoring on a non-CPU device, or into a tensor-path cache, fills device rows of the saved
//! capacity; on the CPU, host blocks. Either way the cache then answers as the saved one.

use super::{BLOCK_TOKENS, Block, DenseCache, Element, device::DeviceRows};
use crate::Result;
use crate::attention::window_start;
use crate::state::{
    StateReader, max_cap, put_geometry, put_method, put_rows, put_usize, state_err,
};
use crate::traits::CacheState;
use candle_core::{Device, Tensor};

impl<E: Element> DenseCache<E> {
    /// See `KvCache::save_state` and the module docs.
    pub(super) fn save(&self) -> Result<CacheState> {
        let mut s = CacheState::new();
        put_method(&mut s, E::METHOD)?;
        put_geometry(&mut s, &self.geom)?;
        put_usize(&mut s, "len", self.len)?;
        put_usize(&mut s, "roll", usize::from(self.roll))?;
        match &self.dev {
            Some(dev) => {
                dev.save(&mut s, self.len)?;
                put_usize(&mut s, "spare", 0)?;
            }
            None => {
                let (k, v, first) = self.host_rows()?;
                let cap = self.blocks.iter().flatten().count() * BLOCK_TOKENS;
                put_rows(&mut s, "k", Some(k), first, cap)?;
                put_rows(&mut s, "v", Some(v), first, cap)?;
                put_usize(&mut s, "spare", usize::from(self.spare.is_some()))?;
            }
        }
        Ok(s)
    }

    /// The host rows of the positions held, `first..len` (keys and values as
    /// `[kv heads, n, d]` host tensors), and `first`.
    fn host_rows(&self) -> Result<(Tensor, Tensor, usize)> {
        let (kvh, d, len) = (self.geom.n_kv_heads, self.geom.head_dim, self.len);
        let first = match self.blocks.iter().position(Option::is_some) {
            Some(b) => (b * BLOCK_TOKENS).max(self.host_first).min(len),
            None => len,
        };
        let n = len - first;
        let (mut kd, mut vd) = (vec![E::ZERO; kvh * n * d], vec![E::ZERO; kvh * n * d]);
        for i in 0..n {
            let pos = first + i;
            let (b, slot) = (pos / BLOCK_TOKENS, pos % BLOCK_TOKENS);
            let block = self
                .blocks
                .get(b)
                .and_then(Option::as_ref)
                .ok_or_else(|| state_err(format!("position {pos} is held by no block")))?;
            for h in 0..kvh {
                let dst = (h * n + i) * d;
                let src = (h * BLOCK_TOKENS + slot) * d;
                vd[dst..dst + d].copy_from_slice(&block.v[src..src + d]);
                let kcol = h * d * BLOCK_TOKENS + slot;
                for (dd, x) in kd[dst..dst + d].iter_mut().enumerate() {
                    *x = block.k[kcol + dd * BLOCK_TOKENS];
                }
            }
        }
        Ok((
            E::host_tensor(kd, (kvh, n, d))?,
            E::host_tensor(vd, (kvh, n, d))?,
            first,
        ))
    }

    /// See `KvCache::restore_state` and the module docs. Everything is read and checked
    /// before this cache changes.
    pub(super) fn restore(&mut self, state: &CacheState, device: &Device) -> Result<()> {
        if self.len != 0 {
            return Err(state_err(format!(
                "restoring into a cache that holds {} positions",
                self.len
            )));
        }
        let g = self.geom;
        let (kvh, d) = (g.n_kv_heads, g.head_dim);
        let mut r = StateReader::new(state);
        r.expect_method(E::METHOD)?;
        r.expect_geometry(&g)?;
        let len = r.bounded("len", g.max_tokens)?;
        let roll = r.flag("roll")?;
        let spare = r.flag("spare")?;
        let limit = max_cap(g.max_tokens);
        let mut out = Self {
            geom: g,
            blocks: Vec::new(),
            spare: None,
            len,
            roll,
            dev: None,
            host_first: 0,
        };
        let first = if !device.is_cpu() || self.dev.is_some() {
            let dev = DeviceRows::restore::<E>(&g, &mut r, (len, limit), device)?;
            let first = dev.first();
            out.dev = Some(dev);
            first
        } else {
            let shape = (kvh, d, E::DTYPE);
            let k = r.rows("k", shape, len, limit, true)?;
            let v = r.rows("v", shape, len, limit, true)?;
            if k.from != v.from || k.from > len {
                return Err(state_err(format!(
                    "tensors k.from and v.from: {} and {}, of {len} positions",
                    k.from, v.from
                )));
            }
            let read = |t: Option<&Tensor>| -> Result<Vec<E>> {
                Ok(match t {
                    Some(t) => E::read(t)?,
                    None => Vec::new(),
                })
            };
            let (kd, vd) = (read(k.rows)?, read(v.rows)?);
            let first = k.from;
            out.blocks = vec![None; first / BLOCK_TOKENS];
            out.len = first;
            out.write_host(&kd, &vd, k.n);
            out.len = len;
            out.blocks.resize_with(len.div_ceil(BLOCK_TOKENS), || None);
            out.host_first = first;
            if spare {
                let elems = out.block_elems();
                out.spare = Some(Block {
                    k: vec![E::ZERO; elems],
                    v: vec![E::ZERO; elems],
                });
            }
            first
        };
        // The next query (at `len`) reads from its window's start: those rows must be here.
        let needed = window_start(len, g.sliding_window);
        if first > needed {
            return Err(state_err(format!(
                "tensor k.from: {first}, but a query at position {len} reads from {needed}"
            )));
        }
        r.finish()?;
        *self = out;
        Ok(())
    }
}
