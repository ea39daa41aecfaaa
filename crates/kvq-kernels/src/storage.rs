//! Reading the CPU storage handed to a custom op: `[heads, rows, width]` views whose rows are
//! contiguous (the caches pass `narrow`ed views of their code buffers, so heads may be strided).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result, bail};

/// A `[heads, rows, width]` view over a flat slice: head `h` row `r` starts at
/// `offset + h * head_stride + r * width`.
pub struct Rows3<'a, T> {
    data: &'a [T],
    offset: usize,
    head_stride: usize,
    pub heads: usize,
    pub rows: usize,
    pub width: usize,
}

impl<'a, T> Rows3<'a, T> {
    /// Rows `from..to` of head `h`, as one contiguous slice.
    pub fn range(&self, h: usize, from: usize, to: usize) -> &'a [T] {
        let base = self.offset + h * self.head_stride;
        &self.data[base + from * self.width..base + to * self.width]
    }
}

fn view<'a, T>(data: &'a [T], layout: &Layout, what: &str) -> Result<Rows3<'a, T>> {
    let (dims, strides) = (layout.dims(), layout.stride());
    let &[heads, rows, width] = dims else {
        bail!("{what}: expected a rank-3 tensor, got {dims:?}")
    };
    if strides[2] != 1 || (rows > 1 && strides[1] != width) {
        bail!("{what}: rows must be contiguous (strides {strides:?})")
    }
    let offset = layout.start_offset();
    let head_stride = strides[0];
    if heads > 0 && offset + (heads - 1) * head_stride + rows * width > data.len() {
        bail!("{what}: view out of bounds")
    }
    Ok(Rows3 {
        data,
        offset,
        head_stride,
        heads,
        rows,
        width,
    })
}

/// An f32 `[heads, rows, width]` view.
pub fn f32_rows<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<Rows3<'a, f32>> {
    match s {
        CpuStorage::F32(d) => view(d, l, what),
        _ => bail!("{what}: expected f32, got {:?}", s.dtype()),
    }
}

/// A u8 `[heads, rows, width]` view.
pub fn u8_rows<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<Rows3<'a, u8>> {
    match s {
        CpuStorage::U8(d) => view(d, l, what),
        _ => bail!("{what}: expected u8, got {:?}", s.dtype()),
    }
}
