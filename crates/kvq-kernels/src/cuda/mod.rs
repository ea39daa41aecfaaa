//! The CUDA backend of the ops: the PTX of `kernels/cuda` embedded by build.rs, loaded once per
//! device, the `#[repr(C)]` mirrors of the kernels' parameter structs, the device copies of the
//! codecs' specs, and the launchers the ops' `cuda_fwd` call ([`attend`], [`encode`]).

pub mod attend;
pub mod encode;
pub mod fast;
pub mod ops;
mod params;
pub mod step;
mod trace;

use candle_core::cuda_backend::cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, sys,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice};
use candle_core::{DType, Layout, Result, bail};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub use params::*;

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

pub use crate::fast_geometry::MAX_SMEM;

/// Maps a CUDA driver error into candle's error, naming what failed.
pub(crate) fn drv<T>(r: std::result::Result<T, impl std::fmt::Debug>, what: &str) -> Result<T> {
    r.map_err(|e| candle_core::Error::Msg(format!("cuda: {what}: {e:?}")))
}

type ModuleKey = (usize, &'static str);
type FunctionKey = (usize, &'static str, String);

/// The function `name` of embedded module `module` on `dev`'s context, allowed `smem` bytes of
/// dynamic shared memory: modules loaded (PTX compiled by the driver) once per context,
/// functions and their shared-memory limit looked up once.
pub(crate) fn function_smem(
    dev: &CudaDevice,
    module: &'static str,
    name: &str,
    smem: usize,
) -> Result<CudaFunction> {
    static MODULES: OnceLock<Mutex<HashMap<ModuleKey, Arc<CudaModule>>>> = OnceLock::new();
    static FUNCS: OnceLock<Mutex<HashMap<FunctionKey, (CudaFunction, usize)>>> = OnceLock::new();
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let id = Arc::as_ptr(ctx) as usize;
    let mut funcs = FUNCS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let key = (id, module, name.to_string());
    if let Some((f, limit)) = funcs.get_mut(&key) {
        if *limit < smem {
            drv(set_smem(f, smem), name)?;
            *limit = smem;
        }
        return Ok(f.clone());
    }
    let m = {
        let mut map = MODULES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match map.get(&(id, module)) {
            Some(m) => m.clone(),
            None => {
                let Some((_, src)) = ptx::MODULES.iter().find(|(n, _)| *n == module) else {
                    bail!("cuda: no embedded kernel module {module}")
                };
                // Kernel work on a GPU machine without Rust: `KVQ_CUDA_PTX_DIR` holds PTX
                // compiled there from kernels/cuda (`<family>_<file>.ptx`, as
                // `scripts/build-cuda ptx` names them), loaded instead of the embedded text.
                let text = match std::env::var_os("KVQ_CUDA_PTX_DIR") {
                    Some(dir) => {
                        let path = std::path::Path::new(&dir).join(format!("{module}.ptx"));
                        match std::fs::read_to_string(&path) {
                            Ok(t) => t,
                            Err(_) => (*src).to_string(),
                        }
                    }
                    None => (*src).to_string(),
                };
                let m = drv(ctx.load_module(text.into()), module)?;
                map.insert((id, module), m.clone());
                m
            }
        }
    };
    let f = drv(m.load_function(name), name)?;
    if smem > 48 * 1024 {
        drv(set_smem(&f, smem), name)?;
    }
    funcs.insert(key, (f.clone(), smem.max(48 * 1024)));
    Ok(f)
}

fn set_smem(
    f: &CudaFunction,
    smem: usize,
) -> std::result::Result<(), candle_core::cuda_backend::cudarc::driver::DriverError> {
    f.set_attribute(
        sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
}

/// [`function_smem`] for kernels with only static shared memory.
pub(crate) fn function(dev: &CudaDevice, module: &'static str, name: &str) -> Result<CudaFunction> {
    function_smem(dev, module, name, 0)
}

/// Number of multiprocessors of `dev` (132 on an H200 if the query fails).
pub(crate) fn sm_count(ctx: &Arc<CudaContext>) -> usize {
    ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_or(132, |n| n.max(1) as usize)
}

/// Raw device address of `s`'s element `offset` (bytes per element `size`). The returned
/// address stays valid while the storage lives; callers keep the storage borrowed across the
/// launch.
pub(crate) fn address<T>(s: &CudaSlice<T>, stream: &CudaStream, offset: usize) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p + (offset * std::mem::size_of::<T>()) as u64
}

/// The device address of a storage's first element under `layout` and its dtype.
pub(crate) fn storage_address(s: &CudaStorage, layout: &Layout) -> Result<(u64, DType)> {
    let stream = s.device.cuda_stream();
    let off = layout.start_offset();
    Ok(match &s.slice {
        CudaStorageSlice::U8(x) => (address(x, &stream, off), DType::U8),
        CudaStorageSlice::F32(x) => (address(x, &stream, off), DType::F32),
        CudaStorageSlice::F16(x) => (address(x, &stream, off), DType::F16),
        CudaStorageSlice::U32(x) => (address(x, &stream, off), DType::U32),
        _ => bail!("cuda: unsupported storage dtype"),
    })
}

/// A device id to key the codecs' device copies by.
pub(crate) fn device_key(dev: &CudaDevice) -> String {
    format!("cuda:{:?}", dev.id())
}

/// Uploads `v` to `dev` (an empty `v` as one default element: a zero-length allocation has no
/// address to pass).
pub(crate) fn upload<T>(dev: &CudaDevice, v: &[T]) -> Result<CudaSlice<T>>
where
    T: candle_core::cuda_backend::cudarc::driver::DeviceRepr + Default + Copy + 'static,
{
    if v.is_empty() {
        return dev.clone_htod(&[T::default()][..]);
    }
    dev.clone_htod(v)
}

/// Checks the last launch's error on `stream` (launch errors come back from the launch itself;
/// this catches asynchronous faults when `KVQ_CUDA_SYNC` is set, as the parity tests do).
pub(crate) fn check_launch(stream: &CudaStream, what: &str) -> Result<()> {
    static SYNC: OnceLock<bool> = OnceLock::new();
    if *SYNC.get_or_init(|| std::env::var_os("KVQ_CUDA_SYNC").is_some()) {
        drv(stream.synchronize(), what)?;
    }
    Ok(())
}

/// With `KVQ_CUDA_POISON=<byte>` set (the parity tests set it), fills a fresh output with that
/// byte before a kernel writes it, so an element a kernel leaves unwritten shows (0xff: NaN).
pub(crate) fn poison<T>(s: &CudaSlice<T>, stream: &CudaStream) -> Result<()> {
    let byte = std::env::var("KVQ_CUDA_POISON")
        .ok()
        .and_then(|v| u8::from_str_radix(v.trim_start_matches("0x"), 16).ok());
    if let Some(b) = byte {
        let addr = address(s, stream, 0);
        // SAFETY: `addr` is the start of `s`, `s.num_bytes()` long, alive for the call.
        let r = unsafe {
            candle_core::cuda_backend::cudarc::driver::result::memset_d8_async(
                addr,
                b,
                s.num_bytes(),
                stream.cu_stream(),
            )
        };
        drv(r, "poison")?;
    }
    Ok(())
}

/// Keeps the GPU busy for about `cycles` clock cycles on `dev`'s stream (benchmarks queue their
/// timed launches behind it, so host enqueue time stays out of the GPU timings).
pub fn spin(dev: &CudaDevice, cycles: i64) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    let f = function(dev, "common_combine", "kvq_spin")?;
    let stream = dev.cuda_stream();
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(&cycles);
    // SAFETY: one by-value integer argument.
    drv(unsafe { b.launch(cfg) }, "kvq_spin").map(|_| ())
}
