//! kvq-metal-emu: runs kvq's Metal kernels on the CPU, so CI executes the very MSL text a Mac
//! compiles. build.rs compiles every `.metal` file of kernels/metal with the system C++
//! compiler through a `<metal_stdlib>` shim (kernels/metal/emu/include), plus copies with one
//! known mistake each (the negative controls). A dispatch runs each threadgroup's threads as
//! fibers (kernels/metal/emu/kvq_emu_runtime.cpp): barriers and simdgroup operations are
//! scheduling points, and the lane order is forward, reverse or random, so races and lane-order
//! assumptions change the answer. The geometry is the one `metal_fwd` uses:
//! [`kvq_kernels::metal::dispatch`], in threadgroups.
//!
//! Buffers are copied into allocations fenced by guard bytes, checked after the run: a kernel
//! that writes outside a buffer is an error, not silent corruption.

use kvq_kernels::metal::dispatch::Dispatch;
use std::ffi::{CString, c_char, c_void};

unsafe extern "C" {
    fn kvq_emu_run(
        name: *const c_char,
        groups: *const u32,
        threads: *const u32,
        order: u32,
        seed: u64,
        buffers: *const *mut c_void,
        n_buffers: usize,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
}

/// The order in which a threadgroup's runnable threads are resumed at each scheduling round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    Forward,
    Reverse,
    /// A fresh permutation every round, from this seed.
    Random(u64),
}

/// The schedules every kernel is run under.
pub const ORDERS: [Order; 3] = [Order::Forward, Order::Reverse, Order::Random(0x5eed)];

/// What can go wrong running an emulated kernel.
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    /// The emulator stopped the dispatch (a deadlock, a barrier not every thread reaches,
    /// diverged simdgroup operations).
    #[error("{kernel}: {message}")]
    Kernel { kernel: String, message: String },
    /// No such kernel, or another number of buffers than it takes.
    #[error("{0}")]
    Call(String),
    /// The kernel wrote bytes before or after one of its buffers.
    #[error("{kernel} wrote outside buffer {index}")]
    OutOfBounds { kernel: String, index: usize },
}

/// Guard bytes on each side of a buffer.
const GUARD: usize = 256;
const GUARD_BYTE: u8 = 0xa5;

/// One buffer in an 8-byte aligned allocation with guard bytes around it.
struct Fenced {
    words: Vec<u64>,
    len: usize,
}

impl Fenced {
    fn new(data: &[u8]) -> Self {
        let total = GUARD + data.len() + GUARD;
        let mut f = Self {
            words: vec![0; total.div_ceil(8)],
            len: data.len(),
        };
        let bytes = f.bytes_mut();
        bytes.fill(GUARD_BYTE);
        bytes[GUARD..GUARD + data.len()].copy_from_slice(data);
        f
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.words.len() * 8;
        // SAFETY: u64 storage viewed as bytes, in bounds, no other reference alive.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), n) }
    }

    fn intact(&mut self) -> bool {
        let len = self.len;
        let b = self.bytes_mut();
        b[..GUARD].iter().all(|&x| x == GUARD_BYTE)
            && b[GUARD + len..].iter().all(|&x| x == GUARD_BYTE)
    }
}

/// Runs `kernel` with `buffers` in its `[[buffer(n)]]` order (inputs and outputs alike; each is
/// copied back afterwards), dispatched as `dispatch` says, threads resumed in `order`.
pub fn run(
    kernel: &str,
    dispatch: Dispatch,
    order: Order,
    buffers: &mut [&mut [u8]],
) -> Result<(), EmuError> {
    let name = CString::new(kernel).map_err(|_| EmuError::Call(format!("bad name {kernel:?}")))?;
    let mut fenced: Vec<Fenced> = buffers.iter().map(|b| Fenced::new(b)).collect();
    let ptrs: Vec<*mut c_void> = fenced
        .iter_mut()
        .map(|f| f.bytes_mut()[GUARD..].as_mut_ptr().cast::<c_void>())
        .collect();
    let (code, seed) = match order {
        Order::Forward => (0, 0),
        Order::Reverse => (1, 0),
        Order::Random(s) => (2, s),
    };
    let mut err = vec![0u8; 1024];
    // SAFETY: every pointer is a live allocation of the length the kernel's parameters imply
    // (the caller's buffers, copied); the emulator returns before they are dropped.
    let rc = unsafe {
        kvq_emu_run(
            name.as_ptr(),
            dispatch.threadgroups.as_ptr(),
            dispatch.threads.as_ptr(),
            code,
            seed,
            ptrs.as_ptr(),
            ptrs.len(),
            err.as_mut_ptr().cast::<c_char>(),
            err.len(),
        )
    };
    let message = || {
        let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
        String::from_utf8_lossy(&err[..end]).into_owned()
    };
    match rc {
        0 => {}
        1 => {
            return Err(EmuError::Kernel {
                kernel: kernel.into(),
                message: message(),
            });
        }
        _ => return Err(EmuError::Call(message())),
    }
    for (index, (f, b)) in fenced.iter_mut().zip(buffers.iter_mut()).enumerate() {
        if !f.intact() {
            return Err(EmuError::OutOfBounds {
                kernel: kernel.into(),
                index,
            });
        }
        let len = f.len;
        b.copy_from_slice(&f.bytes_mut()[GUARD..GUARD + len]);
    }
    Ok(())
}

/// The dispatch a caller gets who passes `d`'s threadgroup count where total threads are meant
/// (MLX's `grid=`): the seed's bug, for the negative controls.
pub fn seed_grid(d: Dispatch) -> Dispatch {
    let per = d.threads[0].max(1);
    Dispatch {
        threadgroups: [d.threadgroups[0].div_ceil(per), 1, 1],
        threads: d.threads,
    }
}

/// Little-endian bytes of f32s (how a Metal buffer of floats holds them).
pub fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}
