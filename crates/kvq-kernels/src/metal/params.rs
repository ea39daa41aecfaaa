//! The parameter structs the Metal kernels read from their `constant` buffer, laid out as the
//! MSL structs of the same name (`#[repr(C)]`, 4-byte fields: the same layout in MSL and in the
//! emulator's C++). `as_bytes` is what `set_bytes` (or the emulator) is given.

/// kernels/metal/common/bitpack.metal `PackParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackParams {
    pub n: u32,
    pub bits: u32,
}

/// kernels/metal/turboquant_mse/encode.metal `ScalarEncodeParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalarEncodeParams {
    pub rows: u32,
    pub t: u32,
    pub d: u32,
    pub bits: u32,
    pub cb: u32,
    pub sigma: f32,
}

/// kernels/metal/qjl/encode.metal `QjlKeyEncodeParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QjlKeyEncodeParams {
    pub rows: u32,
    pub t: u32,
    pub d: u32,
    pub m: u32,
    pub outliers: u32,
    pub cb: u32,
}

/// kernels/metal/vecinfer/encode.metal `NearestParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NearestParams {
    pub n: u32,
    pub centroids: u32,
    pub sub: u32,
}

/// The bytes of a parameter struct (plain 4-byte fields, no padding).
pub trait AsBytes: Copy {
    fn as_bytes(&self) -> Vec<u8>;
}

macro_rules! as_bytes {
    ($t:ty, $($f:ident),+) => {
        impl AsBytes for $t {
            fn as_bytes(&self) -> Vec<u8> {
                let mut v = Vec::with_capacity(std::mem::size_of::<$t>());
                $(v.extend_from_slice(&self.$f.to_le_bytes());)+
                debug_assert_eq!(v.len(), std::mem::size_of::<$t>());
                v
            }
        }
    };
}

as_bytes!(PackParams, n, bits);
as_bytes!(ScalarEncodeParams, rows, t, d, bits, cb, sigma);
as_bytes!(QjlKeyEncodeParams, rows, t, d, m, outliers, cb);
as_bytes!(NearestParams, n, centroids, sub);
