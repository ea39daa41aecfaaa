//! Bit packing of b-bit codes (1 to 8 bits) into bytes, least significant bits first, so a row
//! of `n` codes takes exactly `ceil(n * b / 8)` bytes: the layout every packed code row of the
//! caches uses, and the one the CPU and CUDA kernels unpack.

/// Bytes needed for `n` codes of `bits` bits.
pub const fn packed_len(n: usize, bits: u32) -> usize {
    (n * bits as usize).div_ceil(8)
}

/// Packs `codes` (each below `2^bits`) into `out` (`packed_len(codes.len(), bits)` bytes).
///
/// # Panics
/// When `bits` is not in 1..=8 or `out` is too short; both are programming errors, never
/// request-dependent.
pub fn pack(codes: &[u8], bits: u32, out: &mut [u8]) {
    assert!((1..=8).contains(&bits), "bits must be in 1..=8");
    let len = packed_len(codes.len(), bits);
    assert!(out.len() >= len, "output too short");
    let mask = (1u64 << bits) - 1;
    // Eight codes fill exactly `bits` bytes.
    for (group, bytes) in codes.chunks(8).zip(out[..len].chunks_mut(bits as usize)) {
        let mut v = 0u64;
        for (k, &c) in group.iter().enumerate() {
            v |= (u64::from(c) & mask) << (k as u32 * bits);
        }
        bytes.copy_from_slice(&v.to_le_bytes()[..bytes.len()]);
    }
}

/// Unpacks `out.len()` codes of `bits` bits from `packed`.
///
/// # Panics
/// When `bits` is not in 1..=8 or `packed` is too short (programming errors).
pub fn unpack(packed: &[u8], bits: u32, out: &mut [u8]) {
    assert!((1..=8).contains(&bits), "bits must be in 1..=8");
    assert!(
        packed.len() >= packed_len(out.len(), bits),
        "packed row too short"
    );
    let mask = (1u64 << bits) - 1;
    for (group, bytes) in out.chunks_mut(8).zip(packed.chunks(bits as usize)) {
        let v = bytes
            .iter()
            .enumerate()
            .fold(0u64, |v, (i, &b)| v | u64::from(b) << (8 * i));
        for (k, o) in group.iter_mut().enumerate() {
            *o = ((v >> (k as u32 * bits)) & mask) as u8;
        }
    }
}

/// The code at index `i` of a packed row.
#[inline]
pub fn get(packed: &[u8], bits: u32, i: usize) -> u8 {
    let bit = i * bits as usize;
    let (byte, shift) = (bit / 8, bit % 8);
    let lo = packed[byte] as u16;
    let hi = if shift + bits as usize > 8 {
        packed[byte + 1] as u16
    } else {
        0
    };
    (((lo | (hi << 8)) >> shift) & ((1u16 << bits) - 1)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(bits in 1u32..=8, raw in proptest::collection::vec(any::<u8>(), 0..300)) {
            let codes: Vec<u8> = raw.iter().map(|c| c & (((1u16 << bits) - 1) as u8)).collect();
            let mut packed = vec![0u8; packed_len(codes.len(), bits)];
            pack(&codes, bits, &mut packed);
            let mut back = vec![0u8; codes.len()];
            unpack(&packed, bits, &mut back);
            prop_assert_eq!(&back, &codes);
            for (i, &c) in codes.iter().enumerate() {
                prop_assert_eq!(get(&packed, bits, i), c);
            }
        }
    }

    #[test]
    fn sizes_are_exact() {
        assert_eq!(packed_len(64, 3), 24);
        assert_eq!(packed_len(64, 1), 8);
        assert_eq!(packed_len(5, 3), 2);
    }
}
