//! The encode op's `metal_fwd` body: `[heads, t, d]` f32 rows to `[heads, t, code_bytes]` codes,
//! one threadgroup of `d` threads per row, by the codec's spec: `kvq_encode_scalar`
//! (TurboQuant-MSE and -RVQ, and TurboQuant's values), `kvq_encode_prod` (TurboQuant-Prod keys),
//! `kvq_encode_qjl_keys` and `kvq_encode_group` (QJL keys and values), `kvq_encode_vq`
//! (VecInfer keys and values).

use super::backend::{Arg, KeyBufs, ScalarBufs, ValueBufs, encode, key_bufs, output, value_bufs};
use super::dispatch;
use super::ops::offset;
use super::params::{
    AsBytes, GroupEncodeParams, ProdEncodeParams, QjlKeyEncodeParams, ScalarEncodeParams,
    VqEncodeParams, vq_books,
};
use crate::codec::{KeyCodec, ValueCodec};
use crate::spec::{KeySpec, ScalarSpec, ValueSpec, VqSpec};
use candle_core::backend::BackendStorage;
use candle_core::{DType, Layout, MetalDevice, MetalStorage, Result, Shape, bail};
use candle_metal_kernels::metal::Buffer;

fn too_many() -> candle_core::Error {
    candle_core::Error::Msg("metal: encode: too many rows".into())
}

fn u(v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| too_many())
}

/// One encode: the input rows, where the codes go, and their shape.
struct Rows<'a> {
    dev: &'a MetalDevice,
    x: Arg<'a>,
    out: &'a Buffer,
    rows: usize,
    t: usize,
    d: usize,
    cb: usize,
}

impl Rows<'_> {
    /// Fails unless the kernel's row width `kernel_cb` is the codec's.
    fn width(&self, kernel_cb: usize) -> Result<()> {
        if kernel_cb != self.cb {
            bail!(
                "metal: encode: the kernel writes rows of {kernel_cb} bytes, the codec's are {}",
                self.cb
            )
        }
        Ok(())
    }

    fn scalar(self, s: &ScalarSpec, b: &ScalarBufs) -> Result<()> {
        self.width(s.code_bytes(self.d))?;
        let p = ScalarEncodeParams {
            rows: u(self.rows)?,
            t: u(self.t)?,
            d: u(self.d)?,
            bits: s.bits,
            cb: u(self.cb)?,
            sigma: s.sigma,
        };
        encode(
            self.dev,
            "turboquant_mse/encode",
            "kvq_encode_scalar",
            dispatch::encode_scalar(self.rows, self.d),
            &[
                self.x,
                Arg::In(&b.signs, 0),
                Arg::In(&b.thresholds, 0),
                Arg::In(&b.code_of, 0),
                Arg::Out(self.out, 0),
                Arg::Bytes(p.as_bytes()),
            ],
        )
    }

    fn prod(self, s: &ScalarSpec, m: usize, b: &ScalarBufs, mats: &Buffer) -> Result<()> {
        self.width(s.code_bytes(self.d) + 2 + m / 8)?;
        let p = ProdEncodeParams {
            rows: u(self.rows)?,
            t: u(self.t)?,
            d: u(self.d)?,
            bits: s.bits,
            cb: u(self.cb)?,
            sigma: s.sigma,
            m: u(m)?,
        };
        encode(
            self.dev,
            "turboquant_prod/encode",
            "kvq_encode_prod",
            dispatch::encode_prod(self.rows, self.d),
            &[
                self.x,
                Arg::In(&b.signs, 0),
                Arg::In(&b.thresholds, 0),
                Arg::In(&b.code_of, 0),
                Arg::In(&b.levels, 0),
                Arg::In(mats, 0),
                Arg::Out(self.out, 0),
                Arg::Bytes(p.as_bytes()),
            ],
        )
    }

    fn qjl_keys(self, m: usize, outliers: usize, mats: &Buffer) -> Result<()> {
        self.width(2 + m / 8 + 3 * outliers)?;
        let p = QjlKeyEncodeParams {
            rows: u(self.rows)?,
            t: u(self.t)?,
            d: u(self.d)?,
            m: u(m)?,
            outliers: u(outliers)?,
            cb: u(self.cb)?,
        };
        encode(
            self.dev,
            "qjl/encode",
            "kvq_encode_qjl_keys",
            dispatch::encode_qjl_keys(self.rows, self.d),
            &[
                self.x,
                Arg::In(mats, 0),
                Arg::Out(self.out, 0),
                Arg::Bytes(p.as_bytes()),
            ],
        )
    }

    fn group(self, bits: u32, group: usize) -> Result<()> {
        self.width(4 * (self.d / group.max(1)) + self.d * bits as usize / 8)?;
        let p = GroupEncodeParams {
            rows: u(self.rows)?,
            d: u(self.d)?,
            bits,
            group: u(group)?,
            cb: u(self.cb)?,
        };
        encode(
            self.dev,
            "qjl/encode",
            "kvq_encode_group",
            dispatch::encode_group(self.rows, self.d),
            &[self.x, Arg::Out(self.out, 0), Arg::Bytes(p.as_bytes())],
        )
    }

    /// VecInfer rows; `lambda`: the keys' smoothing factors (values: none).
    fn vq(self, s: &VqSpec, books: &Buffer, signs: &Buffer, lambda: Option<&Buffer>) -> Result<()> {
        let Some(n_books) = vq_books(s, self.d) else {
            bail!("metal: encode: a VecInfer codebook layout the kernel does not read")
        };
        self.width(self.d / s.sub)?;
        let p = VqEncodeParams {
            rows: u(self.rows)?,
            t: u(self.t)?,
            d: u(self.d)?,
            sub: u(s.sub)?,
            books: n_books,
            smooth: u32::from(lambda.is_some()),
        };
        encode(
            self.dev,
            "vecinfer/encode",
            "kvq_encode_vq",
            dispatch::encode_vq(self.rows, self.d),
            &[
                self.x,
                Arg::In(signs, 0),
                // Values are not smoothed: the kernel never reads this binding then.
                Arg::In(lambda.unwrap_or(signs), 0),
                Arg::In(books, 0),
                Arg::Out(self.out, 0),
                Arg::Bytes(p.as_bytes()),
            ],
        )
    }
}

/// The encode op on Metal: `[heads, t, d]` f32 (contiguous) to `[heads, t, cb]` u8, for the
/// specs [`super::ops::encode_has_kernel`] accepts.
pub(crate) fn encode_fwd(
    keys: Option<&dyn KeyCodec>,
    values: Option<&dyn ValueCodec>,
    x: &MetalStorage,
    l: &Layout,
) -> Result<(MetalStorage, Shape)> {
    let dev = x.device().clone();
    let &[heads, t, d] = l.dims() else {
        bail!(
            "metal: encode input must be [heads, t, d], got {:?}",
            l.dims()
        )
    };
    if x.dtype() != DType::F32 {
        bail!("metal: encode takes f32 rows")
    }
    let xo = offset(x, l, "encode input")?;
    let rows = heads * t;
    let (cb, hd) = match (keys, values) {
        (Some(k), _) => (k.code_bytes(), k.head_dim()),
        (None, Some(v)) => (v.code_bytes(), v.head_dim()),
        (None, None) => bail!("encode: no codec"),
    };
    if hd != d {
        bail!("encode: rows of {d} values, codec expects {hd}")
    }
    let out = output(&dev, rows * cb, "kvq-encode")?;
    let r = Rows {
        dev: &dev,
        x: Arg::In(x.buffer(), xo),
        out: &out,
        rows,
        t,
        d,
        cb,
    };
    match (keys, values) {
        (Some(k), _) => {
            let Some(data) = k.kernel_data() else {
                bail!("metal: this key codec has no device kernel")
            };
            match (&data.spec, &*key_bufs(&dev, data)?) {
                (KeySpec::Scalar(s), KeyBufs::Scalar(b)) => r.scalar(s, b)?,
                (KeySpec::ScalarSketch { scalar, sketch }, KeyBufs::ScalarSketch(b, mats)) => {
                    r.prod(scalar, sketch.m, b, mats)?
                }
                (KeySpec::Sketch { sketch, outliers }, KeyBufs::Sketch(mats)) => {
                    r.qjl_keys(sketch.m, *outliers, mats)?
                }
                (KeySpec::ProductVq(s), KeyBufs::ProductVq(b)) => {
                    let Some(lambda) = &b.lambda else {
                        bail!("metal: encode: VecInfer keys without smoothing factors")
                    };
                    r.vq(s, &b.books, &b.signs, Some(lambda.as_ref()))?
                }
                _ => bail!("metal: no encode kernel for this key codec"),
            }
        }
        (None, Some(v)) => {
            let Some(data) = v.kernel_data() else {
                bail!("metal: this value codec has no device kernel")
            };
            match (&data.spec, &*value_bufs(&dev, data)?) {
                (ValueSpec::Scalar(s), ValueBufs::Scalar(b)) => r.scalar(s, b)?,
                (ValueSpec::Group { bits, group }, ValueBufs::Group) => r.group(*bits, *group)?,
                (ValueSpec::ProductVq(s), ValueBufs::ProductVq(b)) => {
                    r.vq(s, &b.books, &b.signs, None)?
                }
                _ => bail!("metal: no encode kernel for this value codec"),
            }
        }
        (None, None) => bail!("encode: no codec"),
    }
    Ok((
        MetalStorage::new(out, dev, rows * cb, DType::U8),
        Shape::from((heads, t, cb)),
    ))
}
