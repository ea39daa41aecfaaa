//! The portable paths of the codebook kernels. For 1- to 4-bit indices and enough rows to pay
//! for a table, a row is cut into fields (bytes; pairs of indices for 3 bits): scores sum a
//! per-query table (`lut[j][field]` = the query's dot product with the levels field `j` of a
//! row encodes), value sums add each row's weight into a histogram of its fields and turn it
//! into values once. Other widths unpack each row and multiply-add. (The AVX-512 path's register gather beats the byte
//! table by about 5x, see benches/decode_attention.rs; these are for CPUs without it.)

use crate::bitpack;
use crate::turboquant::{Rows, Table};

/// Rows below this count take the unpack loop (building a table per field costs more).
const TABLE_ROWS: usize = 64;

/// Bits of the fields a row is cut into for the tables: whole bytes for 1-, 2- and 4-bit
/// indices, pairs of 3-bit indices (6 bits), none for other widths.
fn field_bits(bits: u32) -> Option<u32> {
    match bits {
        1 | 2 | 4 => Some(8),
        3 => Some(6),
        _ => None,
    }
}

/// The levels one field of `bits`-bit indices encodes, in order.
fn field_levels(table: &Table, field: usize, fbits: u32) -> impl Iterator<Item = f32> + '_ {
    let bits = table.bits();
    (0..fbits / bits).map(move |m| table.level((field >> (m * bits)) as u8))
}

/// Calls `f(j, field)` for the fields of a packed row, in order.
#[inline]
fn for_fields(packed: &[u8], fbits: u32, mut f: impl FnMut(usize, usize)) {
    if fbits == 8 {
        packed
            .iter()
            .enumerate()
            .for_each(|(j, &b)| f(j, usize::from(b)));
    } else {
        // Three bytes hold four 6-bit fields.
        for (g, c) in packed.chunks(3).enumerate() {
            let v = c
                .iter()
                .enumerate()
                .fold(0usize, |v, (i, &b)| v | usize::from(b) << (8 * i));
            for k in 0..4 {
                f(4 * g + k, (v >> (6 * k)) & 63);
            }
        }
    }
}

/// `lut[j * 2^F + field]` = sum over the indices of field `j` of `q[i] * level`, for 1- to
/// 4-bit indices (`F` = 8 bits, or 6 for 3-bit indices) and `d` a multiple of 8; `None`
/// otherwise.
pub fn byte_lut(q: &[f32], table: &Table, d: usize, lut: &mut Vec<f32>) -> Option<()> {
    let fbits = field_bits(table.bits()).filter(|_| d.is_multiple_of(8))?;
    let e = (fbits / table.bits()) as usize;
    lut.clear();
    for qs in q[..d].chunks_exact(e) {
        for field in 0..1usize << fbits {
            let levels = field_levels(table, field, fbits);
            lut.push(qs.iter().zip(levels).map(|(a, l)| a * l).sum());
        }
    }
    Some(())
}

/// Scores of rows through [`byte_lut`]'s table.
pub fn dot_rows_byte_lut(lut: &[f32], bits: u32, rows: Rows<'_>, out: &mut [f32]) {
    let Some(fbits) = field_bits(bits) else {
        return;
    };
    let size = 1usize << fbits;
    for (r, o) in out.iter_mut().enumerate() {
        let mut acc = [0f32; 4];
        for_fields(rows.row(r, bits), fbits, |j, v| {
            acc[j % 4] += lut[j * size + v]
        });
        *o = acc.iter().sum::<f32>() * rows.scale(r);
    }
}

pub(in crate::turboquant) fn dot_rows_portable(
    q: &[f32],
    table: &Table,
    rows: Rows<'_>,
    out: &mut [f32],
) {
    let (bits, d) = (table.bits(), rows.d);
    let mut lut = Vec::new();
    if out.len() >= TABLE_ROWS && byte_lut(q, table, d, &mut lut).is_some() {
        return dot_rows_byte_lut(&lut, bits, rows, out);
    }
    let mut idx = vec![0u8; d];
    for (r, o) in out.iter_mut().enumerate() {
        bitpack::unpack(rows.row(r, bits), bits, &mut idx);
        let mut acc = [0f32; 4];
        for (i, (&k, &qi)) in idx.iter().zip(q).enumerate() {
            acc[i % 4] += qi * table.level(k);
        }
        *o = acc.iter().sum::<f32>() * rows.scale(r);
    }
}

pub(in crate::turboquant) fn axpy_rows_portable(
    w: &[f32],
    table: &Table,
    rows: Rows<'_>,
    acc: &mut [f32],
) {
    let (bits, d) = (table.bits(), rows.d);
    if let Some(fbits) = field_bits(bits).filter(|_| w.len() >= TABLE_ROWS && d.is_multiple_of(8)) {
        // Each row's weight goes to the histogram of its fields, turned into values once.
        let (size, e) = (1usize << fbits, (fbits / bits) as usize);
        let mut hist = vec![0f32; d / e * size];
        for (r, &wr) in w.iter().enumerate() {
            let wr = wr * rows.scale(r);
            for_fields(rows.row(r, bits), fbits, |j, v| hist[j * size + v] += wr);
        }
        for (h, a) in hist.chunks_exact(size).zip(acc[..d].chunks_exact_mut(e)) {
            for (field, &weight) in h.iter().enumerate().filter(|(_, x)| **x != 0.0) {
                for (x, l) in a.iter_mut().zip(field_levels(table, field, fbits)) {
                    *x += weight * l;
                }
            }
        }
        return;
    }
    let mut idx = vec![0u8; d];
    for (r, &wr) in w.iter().enumerate() {
        bitpack::unpack(rows.row(r, bits), bits, &mut idx);
        let wr = wr * rows.scale(r);
        for (a, &k) in acc[..d].iter_mut().zip(&idx) {
            *a += wr * table.level(k);
        }
    }
}
