//! `KVQ_FAST_TRACE=FILE`: where the time of a version-6 attention launch goes. For two launches
//! of each kernel, grid and length (the 6th and the 26th, after warm-up), every block's thread 0
//! records the global timer and its multiprocessor's clock at up to 15 phase marks
//! (fast_frame.cuh `fast_mark`: start, chunk loop start and end, slot written, the last block's
//! merge done, finer marks between); the launcher waits for the launch, copies the marks back
//! and appends one JSON line per launch to FILE (scripts/gpu/fast_trace.py summarizes them). Off,
//! nothing is allocated and the kernels skip the marks on a null pointer.

use super::{address, drv};
use candle_core::Result;
use candle_core::cuda_backend::CudaDevice;
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use std::collections::HashMap;
use std::io::Write;
use std::sync::{Mutex, OnceLock};

/// u64 slots per block (fast_frame.cuh `fast_mark`).
const SLOTS: usize = 32;

fn target() -> Option<&'static str> {
    static PATH: OnceLock<Option<String>> = OnceLock::new();
    PATH.get_or_init(|| {
        std::env::var("KVQ_FAST_TRACE")
            .ok()
            .filter(|p| !p.is_empty())
    })
    .as_deref()
}

/// A traced launch: the marks' buffer and what the line names.
pub(super) struct Trace {
    buf: CudaSlice<u64>,
    key: String,
}

impl Trace {
    /// The buffer's address for `FastArgs::trace`.
    pub fn addr(&self, dev: &CudaDevice) -> u64 {
        address(&self.buf, &dev.cuda_stream(), 0)
    }
}

/// A zeroed buffer when this launch of `name` over `grid` and `rows` code rows is one to trace,
/// else None.
pub(super) fn start(
    dev: &CudaDevice,
    name: &str,
    grid: (u32, u32, u32),
    rows: usize,
) -> Result<Option<Trace>> {
    if target().is_none() {
        return Ok(None);
    }
    static SEEN: OnceLock<Mutex<HashMap<String, usize>>> = OnceLock::new();
    let key = format!("{name} {} {} {} {rows}", grid.0, grid.1, grid.2);
    let n = {
        let mut seen = SEEN
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let c = seen.entry(key.clone()).or_insert(0);
        *c += 1;
        *c - 1
    };
    if n != 5 && n != 25 {
        return Ok(None);
    }
    let blocks = grid.0 as usize * grid.1 as usize * grid.2 as usize;
    let buf = dev.alloc_zeros::<u64>(blocks * SLOTS)?;
    Ok(Some(Trace { buf, key }))
}

/// Waits for the launch and appends its marks to the trace file.
pub(super) fn finish(dev: &CudaDevice, t: Trace) -> Result<()> {
    let Some(path) = target() else {
        return Ok(());
    };
    let stream = dev.cuda_stream();
    let marks = drv(stream.clone_dtoh(&t.buf), "trace copy")?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(candle_core::Error::wrap)?;
    let list: Vec<String> = marks.iter().map(u64::to_string).collect();
    writeln!(
        f,
        "{{\"launch\":\"{}\",\"slots\":{SLOTS},\"marks\":[{}]}}",
        t.key,
        list.join(",")
    )
    .map_err(candle_core::Error::wrap)
}
