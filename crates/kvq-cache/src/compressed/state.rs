//! A compressed cache's saved state (`KvCache::save_state`), the same from a host and from a
//! device cache, so either restores into either (conventions in `crate::state`):
//! - `method`, `geom`, `len`, `roll` (flag: code rows that left a sliding window are dropped);
//! - the code rows (`codes.rs`): `codes.k`, `codes.v` (`[kv heads, len - first, code bytes]`
//!   u8, with `.from` = `first` and `.cap`; absent in a layer that dropped its codes) and the
//!   codecs' probes `codes.k_probe`, `codes.v_probe` (the codecs come from the factory);
//! - the fp16 rows (`exact_rows.rs`): `exact.window`, `exact.sinks`, `exact.rewind`,
//!   `exact.first`, `exact.recent_k`/`_v`, `exact.sink_k`/`_v`;
//! - the key center (`center.rs`): `center.kind`, `center.share`, `center.q_sq`,
//!   `center.q_rows`, and once fixed `center.mu`, `center.spread`, `center.exact`.
//!
//! Restoring on a non-CPU device, or into a tensor-path cache, puts the fp16 rows in device
//! buffers (the key center's `mu` too); on the CPU, on the host. The codes go to the device
//! restored on. Every part is read and checked, then they are checked together (what the next
//! query reads must be held), and only then does the cache change.

use super::CompressedCache;
use crate::Result;
use crate::state::{StateReader, max_cap, put_geometry, put_method, put_usize, state_err};
use crate::traits::CacheState;
use candle_core::Device;

impl CompressedCache {
    /// See `KvCache::save_state` and the module docs.
    pub(super) fn save(&self) -> Result<CacheState> {
        let mut s = CacheState::new();
        put_method(&mut s, &self.method)?;
        put_geometry(&mut s, &self.geom)?;
        put_usize(&mut s, "len", self.len)?;
        put_usize(&mut s, "roll", usize::from(self.roll))?;
        self.codes.save(&mut s, self.len)?;
        self.exact.save(&mut s, self.len)?;
        self.center.save(&mut s)?;
        Ok(s)
    }

    /// See `KvCache::restore_state` and the module docs.
    pub(super) fn restore(&mut self, state: &CacheState, device: &Device) -> Result<()> {
        if self.len != 0 {
            return Err(state_err(format!(
                "restoring into a cache that holds {} positions",
                self.len
            )));
        }
        let g = self.geom;
        let mut r = StateReader::new(state);
        r.expect_method(&self.method)?;
        r.expect_geometry(&g)?;
        let len = r.bounded("len", g.max_tokens)?;
        let roll = r.flag("roll")?;
        let limit = max_cap(g.max_tokens);
        let on_device = !device.is_cpu() || self.exact.on_device();
        let exact = self
            .exact
            .restore(&mut r, (len, limit), device, on_device)?;
        let codes = self.codes.restore(&mut r, (len, limit), device)?;
        let center = self.center.restore(&mut r, device, on_device)?;
        r.finish()?;
        let out = Self {
            geom: g,
            method: self.method.clone(),
            codes,
            exact,
            center,
            len,
            roll,
        };
        out.check_restored()?;
        *self = out;
        Ok(())
    }

    /// The parts of a restored cache agree: while the key center needs every fp16 row they
    /// are all held, and a query at position `len` (the next one) finds its fp16 rows and
    /// codes.
    fn check_restored(&self) -> Result<()> {
        if self.center.holds_rows() && self.exact.first() > 0 {
            return Err(state_err(format!(
                "tensor exact.first: {}, but the key center still needs every fp16 row",
                self.exact.first()
            )));
        }
        self.exact
            .check_truncate(self.len)
            .map_err(|e| state_err(format!("tensor exact.first: {e}")))?;
        let (_, c0, c1) = self.params(0, 1.0).ranges(self.len);
        if c1 > c0 && (self.codes.views(self.len)?.is_none() || c0 < self.codes.first()) {
            return Err(state_err(format!(
                "tensor codes.k: a query at position {} reads codes from {c0}, held from {}",
                self.len,
                self.codes.first()
            )));
        }
        Ok(())
    }
}
