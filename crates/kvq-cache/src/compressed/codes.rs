//! The code rows of a compressed cache: a layer's key and value codecs and the packed per-head
//! codes they wrote, one row per position, as device (or host) tensors the kernels read.
//!
//! Invariant: for a cache holding `len` positions, the key and value code rows hold positions
//! `[first, len)` (rows past `len` after a truncation are stale, overwritten by the next
//! append). A key row codes the key minus the key center (zero while it is pending or off, see
//! `center.rs`); when the center is fixed every row so far is re-encoded around it, so the rows
//! a query reads were all made with one center. `first` grows only under a sliding window, as
//! rows no query can reach are dropped. An exact layer drops every row at its next append.

use crate::Result;
use crate::codec::rng::SplitMix;
use crate::rowbuf::RowBuf;
use crate::state::{StateReader, state_err};
use crate::traits::CacheState;
use candle_core::{DType, Device, Tensor};
use kvq_kernels::{
    AttendParams, KeyCodec, ValueCodec, compressed_attend, encode_keys, encode_values,
};
use std::sync::Arc;

/// The seed of the vector whose codes (`codes.k_probe`, `codes.v_probe`) tell a state's
/// codecs from another's.
const PROBE_SEED: u64 = 0x6b76_715f_7374_6174;

/// The codecs of one layer and their code rows (see the module docs).
pub(super) struct Codes {
    keys: Arc<dyn KeyCodec>,
    values: Arc<dyn ValueCodec>,
    key_codes: RowBuf,
    val_codes: RowBuf,
    /// kv heads.
    heads: usize,
}

impl Codes {
    /// No rows yet, for `heads` kv heads.
    pub(super) fn new(heads: usize, keys: Arc<dyn KeyCodec>, values: Arc<dyn ValueCodec>) -> Self {
        Self {
            key_codes: RowBuf::codes(heads, keys.code_bytes()),
            val_codes: RowBuf::codes(heads, values.code_bytes()),
            keys,
            values,
            heads,
        }
    }

    /// The key codec (the fused CUDA decode step calls it directly).
    #[cfg(feature = "cuda")]
    pub(super) fn keys(&self) -> &Arc<dyn KeyCodec> {
        &self.keys
    }

    /// The value codec.
    #[cfg(feature = "cuda")]
    pub(super) fn values(&self) -> &Arc<dyn ValueCodec> {
        &self.values
    }

    /// The first position the code rows hold.
    pub(super) fn first(&self) -> usize {
        self.key_codes.first
    }

    /// Encodes and writes the key rows `keys` (`[kv heads, n, d]` f32, centered) for positions
    /// `at..` and the value rows `values` (`[kv heads, t, d]` f32) for positions `len..`;
    /// positions before `keep_from` may be dropped.
    pub(super) fn write(
        &mut self,
        keys: &Tensor,
        at: usize,
        values: &Tensor,
        len: usize,
        keep_from: usize,
    ) -> Result<()> {
        self.key_codes
            .write(&encode_keys(&self.keys, keys)?, at, keep_from)?;
        self.val_codes
            .write(&encode_values(&self.values, values)?, len, keep_from)?;
        Ok(())
    }

    /// [`Self::write`] on CUDA for keys `k` and values `v` at positions `len..`: the encode
    /// kernels write straight into the code rows and center the keys by `mu` themselves (see
    /// `KeyCenter::device_encoding`).
    #[cfg(feature = "cuda")]
    pub(super) fn write_cuda(
        &mut self,
        k: &Tensor,
        mu: Option<&Tensor>,
        v: &Tensor,
        len: usize,
        keep_from: usize,
    ) -> Result<()> {
        use kvq_kernels::cuda::step::{Codec, encode_rows_into};
        let t = k.dim(1)?;
        let (kb, kr) = self.key_codes.reserve(len, t, keep_from, k.device())?;
        encode_rows_into(Codec::Keys(&*self.keys), k, mu, &kb, kr)?;
        let (vb, vr) = self.val_codes.reserve(len, t, keep_from, v.device())?;
        encode_rows_into(Codec::Values(&*self.values), v, None, &vb, vr)?;
        Ok(())
    }

    /// Drops every row: an exact layer reads every key from fp16, so codes would only take
    /// memory.
    pub(super) fn clear(&mut self) {
        self.key_codes = RowBuf::codes(self.heads, self.keys.code_bytes());
        self.val_codes = RowBuf::codes(self.heads, self.values.code_bytes());
    }

    /// The key and value code rows of positions `first..len`, as views; None before the first
    /// write.
    pub(super) fn views(&self, len: usize) -> Result<Option<(Tensor, Tensor)>> {
        Ok(
            match (self.key_codes.view(len)?, self.val_codes.view(len)?) {
                (Some(kc), Some(vc)) => Some((kc, vc)),
                _ => None,
            },
        )
    }

    /// The compressed op's partial states (`[heads, t, d + 2]`) of queries `q` over the code
    /// rows `kc`, `vc` (from [`Self::views`]), with parameters `p`.
    pub(super) fn attend(
        &self,
        p: AttendParams,
        q: &Tensor,
        (kc, vc): &(Tensor, Tensor),
    ) -> Result<Tensor> {
        Ok(compressed_attend(&self.keys, &self.values, p, q, kc, vc)?)
    }

    /// An upper bound on the bytes of both code buffers while at most `held` positions are
    /// live at once.
    pub(super) fn max_bytes(&self, held: usize, rolling: bool) -> usize {
        self.key_codes.max_bytes(held, rolling) + self.val_codes.max_bytes(held, rolling)
    }

    /// Bytes held: (keys, values).
    pub(super) fn bytes(&self) -> (usize, usize) {
        (self.key_codes.bytes(), self.val_codes.bytes())
    }

    /// An independent copy (the rows copied on their device; the codecs shared).
    pub(super) fn fork(&self) -> Result<Self> {
        Ok(Self {
            keys: self.keys.clone(),
            values: self.values.clone(),
            key_codes: self.key_codes.fork()?,
            val_codes: self.val_codes.fork()?,
            heads: self.heads,
        })
    }

    /// Each kv head's codes of one fixed vector by the key and the value codec (`[heads,
    /// code bytes]` u8): a state made with other codecs (another seed, calibration or bits)
    /// has other ones.
    fn probes(&self) -> Result<(Tensor, Tensor)> {
        let x = SplitMix::new(PROBE_SEED).gauss_vec(self.keys.head_dim());
        let y = SplitMix::new(PROBE_SEED + 1).gauss_vec(self.values.head_dim());
        let (kw, vw, h) = (self.keys.code_bytes(), self.values.code_bytes(), self.heads);
        let (mut kb, mut vb) = (vec![0u8; h * kw], vec![0u8; h * vw]);
        for (head, out) in kb.chunks_exact_mut(kw.max(1)).enumerate() {
            self.keys.encode(head, &x, out);
        }
        for (head, out) in vb.chunks_exact_mut(vw.max(1)).enumerate() {
            self.values.encode(head, &y, out);
        }
        let cpu = Device::Cpu;
        Ok((
            Tensor::from_vec(kb, (h, kw), &cpu)?,
            Tensor::from_vec(vb, (h, vw), &cpu)?,
        ))
    }

    /// Writes the code rows of positions `[first, len)` as `codes.k` and `codes.v`
    /// (`crate::state::put_rows`; none in a layer that dropped them) and the codecs' probes
    /// (`codes.k_probe`, `codes.v_probe`); the codecs themselves come from the factory.
    pub(super) fn save(&self, state: &mut CacheState, len: usize) -> Result<()> {
        self.key_codes.save(state, "codes.k", len)?;
        self.val_codes.save(state, "codes.v", len)?;
        let (kp, vp) = self.probes()?;
        state.insert("codes.k_probe".into(), kp);
        state.insert("codes.v_probe".into(), vp);
        Ok(())
    }

    /// These codecs with the code rows [`Self::save`] wrote for a cache of `len` positions, on
    /// `dev` (`limit` bounds the saved capacities and positions). The probes must be this
    /// codecs', and key and value rows must start at the same position.
    pub(super) fn restore(
        &self,
        reader: &mut StateReader<'_>,
        (len, limit): (usize, usize),
        dev: &Device,
    ) -> Result<Self> {
        let (kp, vp) = self.probes()?;
        for (name, want) in [("codes.k_probe", kp), ("codes.v_probe", vp)] {
            let got = reader.tensor(name, DType::U8, want.dims())?;
            if got.flatten_all()?.to_vec1::<u8>()? != want.flatten_all()?.to_vec1::<u8>()? {
                return Err(state_err(format!(
                    "tensor {name}: made by other codecs than this cache's (another seed, \
                     calibration or bits)"
                )));
            }
        }
        let empty = |width| RowBuf::codes(self.heads, width);
        let key_codes =
            empty(self.keys.code_bytes()).restore(reader, "codes.k", (len, limit, false), dev)?;
        let val_codes =
            empty(self.values.code_bytes()).restore(reader, "codes.v", (len, limit, false), dev)?;
        if key_codes.first != val_codes.first
            || (key_codes.bytes() == 0) != (val_codes.bytes() == 0)
        {
            return Err(state_err(format!(
                "tensors codes.k and codes.v: key rows from {} ({} bytes), value rows from {} \
                 ({} bytes)",
                key_codes.first,
                key_codes.bytes(),
                val_codes.first,
                val_codes.bytes()
            )));
        }
        Ok(Self {
            keys: self.keys.clone(),
            values: self.values.clone(),
            key_codes,
            val_codes,
            heads: self.heads,
        })
    }
}
