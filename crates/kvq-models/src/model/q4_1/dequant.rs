//! Q4_1 weights read back from the repacked tiles as f32: the whole matrix for the prompt
//! GEMM and single rows for an embedding lookup, so a Q4_1 layer is held once (as tiles) and
//! never also as the ggml blocks it was loaded from.
//!
//! Every value is `q as f32 * d + m` with `d` and `m` widened from f16, the expression (and so
//! the bits) of candle's `BlockQ4_1::to_float`: the prompt path computes exactly what it did
//! when it dequantized candle's `QTensor`.

use super::{LANES, Q41Weight, QK, Tile};
use crate::{ModelError, Result};
use candle_core::{Device, Tensor};
use half::f16;

/// Lane `r`'s 32 weights of `tile` (one block of one row): the block's 16 bytes gathered first,
/// then both nibble halves converted in straight loops the compiler vectorizes.
fn dequantize_lane(tile: &Tile, r: usize) -> [f32; QK] {
    let d = f16::from_bits(tile.d[r]).to_f32();
    let m = f16::from_bits(tile.m[r]).to_f32();
    let mut bytes = [0u8; QK / 2];
    for (p, qs) in tile.qs.iter().enumerate() {
        bytes[4 * p..4 * p + 4].copy_from_slice(&qs[4 * r..4 * r + 4]);
    }
    let mut out = [0f32; QK];
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((l, h), &byte) in lo.iter_mut().zip(hi.iter_mut()).zip(&bytes) {
        *l = (byte & 0x0F) as f32 * d + m;
        *h = (byte >> 4) as f32 * d + m;
    }
    out
}

impl Q41Weight {
    /// Output rows (the matrix is `[rows, cols]`).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `row` as f32, appended to `out`.
    fn dequantize_row(&self, row: usize, out: &mut Vec<f32>) {
        let nb = self.cols / QK;
        let (g, r) = (row / LANES, row % LANES);
        for tile in &self.tiles[g * nb..(g + 1) * nb] {
            out.extend_from_slice(&dequantize_lane(tile, r));
        }
    }

    /// The whole weight as f32 `[rows, cols]`, bit for bit what candle's `QTensor::dequantize`
    /// gives for the blocks it was repacked from. Written once, never zeroed first (a prompt
    /// chunk dequantizes every layer's weights: the zeroing was 4% of a 128-token prompt).
    pub fn dequantize_vec(&self) -> Vec<f32> {
        let mut w = Vec::with_capacity(self.rows * self.cols);
        for row in 0..self.rows {
            self.dequantize_row(row, &mut w);
        }
        w
    }

    /// [`Self::dequantize_vec`] as a tensor on `device`.
    pub fn dequantize(&self, device: &Device) -> Result<Tensor> {
        Ok(Tensor::from_vec(
            self.dequantize_vec(),
            (self.rows, self.cols),
            device,
        )?)
    }

    /// Rows `ids` as f32 `[ids.len(), cols]`: the weight used as an embedding table.
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        let ids = ids.flatten_all()?.to_vec1::<u32>()?;
        let mut out = Vec::with_capacity(ids.len() * self.cols);
        for &id in &ids {
            let id = id as usize;
            if id >= self.rows {
                return Err(ModelError::Invalid(format!(
                    "token id {id} is out of range for an embedding of {} rows",
                    self.rows
                )));
            }
            self.dequantize_row(id, &mut out);
        }
        Ok(Tensor::from_vec(out, (ids.len(), self.cols), &Device::Cpu)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};

    fn quantized(rows: usize, cols: usize, seed: u32) -> QTensor {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32)
            .map(|v| 2.0 * v - 1.0)
            .collect();
        let w = Tensor::from_vec(w, (rows, cols), &Device::Cpu).expect("tensor");
        QTensor::quantize(&w, GgmlDType::Q4_1).expect("quantize")
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("values")
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// The tiles give back candle's dequantized weight bit for bit, including a row count that
    /// is not a multiple of the tile's 8 lanes.
    #[test]
    fn dequantize_matches_candle() {
        for (rows, cols) in [(576, 576), (13, 64), (1, 32), (1536, 96)] {
            let q = quantized(rows, cols, rows as u32);
            let w = Q41Weight::from_qtensor(&q).expect("repack").expect("Q4_1");
            let want = q.dequantize(&Device::Cpu).expect("candle");
            assert_eq!(
                bits(&w.dequantize(&Device::Cpu).expect("ours")),
                bits(&want)
            );
        }
    }

    #[test]
    fn embedding_rows_match_candle_and_reject_out_of_range() {
        let (rows, cols) = (21, 64);
        let q = quantized(rows, cols, 5);
        let w = Q41Weight::from_qtensor(&q).expect("repack").expect("Q4_1");
        let ids = Tensor::new(&[20u32, 0, 7, 7, 8], &Device::Cpu).expect("ids");
        let want = q.embedding(&ids).expect("candle");
        assert_eq!(bits(&w.embedding(&ids).expect("ours")), bits(&want));
        let bad = Tensor::new(&[3u32, 21], &Device::Cpu).expect("ids");
        assert!(w.embedding(&bad).is_err());
    }
}
