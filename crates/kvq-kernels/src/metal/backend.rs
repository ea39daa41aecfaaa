//! The Metal runtime of the ops (the `metal` feature, Apple only): every `.metal` file of
//! `kernels/metal` embedded with `include_str!` and compiled once per device at first use
//! (`new_library_with_source`, IEEE math, MSL 3.2 where the OS has it), pipelines built once
//! per device and kernel and cached, the
//! codecs' parameter arrays uploaded once per device, and one function that encodes a dispatch
//! from a [`Dispatch`] (always `dispatch_thread_groups`: the geometry is in threadgroups).

use super::dispatch::Dispatch;
use crate::KernelData;
use crate::spec::{KeySpec, ScalarSpec, ValueSpec, VqSpec};
use candle_core::{MetalDevice, Result, bail};
use candle_metal_kernels::metal::{Buffer, ComputeCommandEncoder, ComputePipeline, Library};
use objc2::rc::Retained;
use objc2_metal::{MTLCompileOptions, MTLLanguageVersion, MTLSize};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// The kernel sources, one library each, by the name the dispatches use. Most are one file; a
/// file that builds on another's helpers (`attend_codes`, `scalar_encode_row`, `fwht_row`) is
/// compiled after it in one library, as the emulator (crates/kvq-metal-emu/cpp/kernels.cpp)
/// includes them. The attention libraries start with common/combine.metal: its `merge_if_last`
/// ends their kernels.
pub const SOURCES: [(&str, &str); 9] = [
    (
        "common/bitpack",
        include_str!("../../../../kernels/metal/common/bitpack.metal"),
    ),
    (
        "common/combine",
        include_str!("../../../../kernels/metal/common/combine.metal"),
    ),
    (
        "turboquant_mse/encode",
        include_str!("../../../../kernels/metal/turboquant_mse/encode.metal"),
    ),
    (
        "turboquant_mse/attend",
        concat!(
            include_str!("../../../../kernels/metal/common/combine.metal"),
            include_str!("../../../../kernels/metal/turboquant_mse/attend.metal"),
        ),
    ),
    (
        "turboquant_prod/encode",
        concat!(
            include_str!("../../../../kernels/metal/turboquant_mse/encode.metal"),
            include_str!("../../../../kernels/metal/turboquant_prod/encode.metal"),
        ),
    ),
    (
        "turboquant_prod/attend",
        concat!(
            include_str!("../../../../kernels/metal/common/combine.metal"),
            include_str!("../../../../kernels/metal/turboquant_mse/attend.metal"),
            include_str!("../../../../kernels/metal/turboquant_prod/attend.metal"),
        ),
    ),
    (
        "qjl/encode",
        include_str!("../../../../kernels/metal/qjl/encode.metal"),
    ),
    (
        "qjl/attend",
        concat!(
            include_str!("../../../../kernels/metal/common/combine.metal"),
            include_str!("../../../../kernels/metal/qjl/attend.metal"),
        ),
    ),
    (
        // kvq_attend_vq and kvq_attend_vq_lut.
        "vecinfer/attend",
        concat!(
            include_str!("../../../../kernels/metal/common/combine.metal"),
            include_str!("../../../../kernels/metal/turboquant_mse/attend.metal"),
            include_str!("../../../../kernels/metal/vecinfer/attend.metal"),
        ),
    ),
];

/// The `vecinfer/encode` library (`kvq_nearest`, and `kvq_encode_vq` on
/// turboquant_mse/encode.metal's `fwht_row`), apart from [`SOURCES`]: the nearest-centroid op
/// uses it on its own.
pub const NEAREST_SOURCE: (&str, &str) = (
    "vecinfer/encode",
    concat!(
        include_str!("../../../../kernels/metal/turboquant_mse/encode.metal"),
        include_str!("../../../../kernels/metal/vecinfer/encode.metal"),
    ),
);

fn err(what: &str, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("metal: {what}: {e}"))
}

type Key = (candle_core::metal_backend::DeviceId, &'static str);

/// Compile options of every kvq library: IEEE float semantics (Metal's default is fast math,
/// which may assume away the infinities the attention compares with: an empty split's max, the
/// softmax's first tile) and, when given, the language version.
fn options(version: Option<MTLLanguageVersion>) -> Retained<MTLCompileOptions> {
    let o = MTLCompileOptions::new();
    #[allow(deprecated)] // mathMode is macOS 15+; this setter works on every version
    o.setFastMathEnabled(false);
    if let Some(v) = version {
        o.setLanguageVersion(v);
    }
    o
}

/// A compiled library and whether it was compiled as MSL 3.2 (`merge_if_last` present).
type Compiled = (Arc<Library>, bool);

/// The library of source file `file` on `dev`, compiled once per device: as MSL 3.2 where the
/// OS takes it, else at the OS's default version (the split merge then compiles to nothing).
fn library(dev: &MetalDevice, file: &'static str) -> Result<Compiled> {
    static LIBRARIES: OnceLock<Mutex<HashMap<Key, Compiled>>> = OnceLock::new();
    let mut libs = LIBRARIES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(l) = libs.get(&(dev.id(), file)) {
        return Ok(l.clone());
    }
    let Some((_, src)) = SOURCES
        .iter()
        .chain(std::iter::once(&NEAREST_SOURCE))
        .find(|(f, _)| *f == file)
    else {
        bail!("metal: no kernel source {file}")
    };
    let md = dev.metal_device();
    let (v32, default) = (options(Some(MTLLanguageVersion::Version3_2)), options(None));
    let compiled = match md.new_library_with_source(src, Some(&*v32)) {
        Ok(lib) => (Arc::new(lib), true),
        Err(_) => {
            let lib = md
                .new_library_with_source(src, Some(&*default))
                .map_err(|e| err(file, e))?;
            (Arc::new(lib), false)
        }
    };
    libs.insert((dev.id(), file), compiled.clone());
    Ok(compiled)
}

/// Whether the attention kernels of library `file` on `dev` merge their splits themselves (MSL
/// 3.2: one dispatch a decode step); `KVQ_METAL_MERGE=0` turns it off (two dispatches, as
/// without 3.2), for comparing the two on a Mac.
pub fn merges(dev: &MetalDevice, file: &'static str) -> Result<bool> {
    if std::env::var("KVQ_METAL_MERGE").is_ok_and(|v| v == "0") {
        return Ok(false);
    }
    Ok(library(dev, file)?.1)
}

/// The pipeline of kernel `name` from source file `file` on `dev`: the file compiled once per
/// device, the pipeline built once per device and kernel.
pub fn pipeline(
    dev: &MetalDevice,
    file: &'static str,
    name: &'static str,
) -> Result<Arc<ComputePipeline>> {
    static PIPELINES: OnceLock<Mutex<HashMap<Key, Arc<ComputePipeline>>>> = OnceLock::new();
    let id = dev.id();
    let mut pipes = PIPELINES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(p) = pipes.get(&(id, name)) {
        return Ok(p.clone());
    }
    let (lib, _) = library(dev, file)?;
    let f = lib.get_function(name, None).map_err(|e| err(name, e))?;
    let p = dev
        .metal_device()
        .new_compute_pipeline_state_with_function(&f)
        .map_err(|e| err(name, e))?;
    let p = Arc::new(p);
    pipes.insert((id, name), p.clone());
    Ok(p)
}

/// The key of `dev` in a codec's [`crate::spec::DeviceCache`].
pub fn device_key(dev: &MetalDevice) -> String {
    format!("metal:{:?}", dev.id())
}

/// One argument of a dispatch, bound at its position in the list.
pub enum Arg<'a> {
    /// A buffer the kernel reads, at a byte offset.
    In(&'a Buffer, usize),
    /// A buffer the kernel writes, at a byte offset.
    Out(&'a Buffer, usize),
    /// A `constant` parameter struct's bytes (`set_bytes`).
    Bytes(Vec<u8>),
}

/// Encodes `name` over `d` with `args` bound to buffer indices 0.. in order, on the device's
/// current command buffer (candle commits it). `d` is in threadgroups: it feeds
/// `dispatch_thread_groups` (`dispatchThreadgroups:threadsPerThreadgroup:`).
pub fn encode(
    dev: &MetalDevice,
    file: &'static str,
    name: &'static str,
    d: Dispatch,
    args: &[Arg<'_>],
) -> Result<()> {
    if d.threadgroups.contains(&0) {
        return Ok(());
    }
    let p = pipeline(dev, file, name)?;
    let threads = d.threads.iter().map(|&x| x as usize).product::<usize>();
    if threads > p.max_total_threads_per_threadgroup() {
        bail!(
            "metal: {name} runs at most {} threads per threadgroup, the dispatch asks {threads}",
            p.max_total_threads_per_threadgroup()
        )
    }
    let guard = dev.command_encoder()?;
    let enc: &ComputeCommandEncoder = guard.as_ref();
    enc.set_label(name);
    enc.set_compute_pipeline_state(&p);
    for (i, a) in args.iter().enumerate() {
        match a {
            Arg::In(b, off) => enc.set_input_buffer(i, Some(b), *off),
            Arg::Out(b, off) => enc.set_output_buffer(i, Some(b), *off),
            Arg::Bytes(v) if v.is_empty() => bail!("metal: {name}: empty parameter struct"),
            Arg::Bytes(v) => enc.set_bytes_directly(i, v.len(), v.as_ptr() as *const c_void),
        }
    }
    let size = |v: [u32; 3]| MTLSize {
        width: v[0] as usize,
        height: v[1] as usize,
        depth: v[2] as usize,
    };
    enc.dispatch_thread_groups(size(d.threadgroups), size(d.threads));
    Ok(())
}

/// A new buffer of `bytes` bytes (not zeroed: the kernels write every byte of their outputs).
pub fn output(dev: &MetalDevice, bytes: usize, label: &str) -> Result<Arc<Buffer>> {
    dev.new_buffer_builder()
        .with_size(bytes.max(4))
        .with_label(label)
        .build()
}

fn upload<T>(dev: &MetalDevice, data: &[T]) -> Result<Arc<Buffer>> {
    if data.is_empty() {
        bail!("metal: an empty codec array")
    }
    dev.new_buffer_with_data(data)
}

/// A [`ScalarSpec`]'s arrays on a device.
pub struct ScalarBufs {
    pub levels: Arc<Buffer>,
    pub thresholds: Arc<Buffer>,
    pub code_of: Arc<Buffer>,
    pub signs: Arc<Buffer>,
}

impl ScalarBufs {
    fn new(dev: &MetalDevice, s: &ScalarSpec) -> Result<Self> {
        Ok(Self {
            levels: upload(dev, &s.levels)?,
            thresholds: upload(dev, &s.thresholds)?,
            code_of: upload(dev, &s.code_of)?,
            signs: upload(dev, &s.signs)?,
        })
    }
}

/// A [`VqSpec`]'s arrays on a device.
pub struct VqBufs {
    pub books: Arc<Buffer>,
    pub signs: Arc<Buffer>,
    /// Keys: the smoothing factors `[heads][d]`; values have none.
    pub lambda: Option<Arc<Buffer>>,
    /// Keys: each codebook's largest centroid norm (`params::vq_book_norms`), the scale of
    /// `kvq_attend_vq_lut`'s table; values have none.
    pub norms: Option<Arc<Buffer>>,
}

impl VqBufs {
    fn new(dev: &MetalDevice, s: &VqSpec) -> Result<Self> {
        Ok(Self {
            books: upload(dev, &s.books)?,
            signs: upload(dev, &s.signs)?,
            lambda: match s.lambda.is_empty() {
                true => None,
                false => Some(upload(dev, &s.lambda)?),
            },
            norms: match s.lambda.is_empty() {
                true => None,
                false => Some(upload(dev, &super::params::vq_book_norms(s))?),
            },
        })
    }
}

/// A key codec's device arrays, by its spec.
pub enum KeyBufs {
    Scalar(ScalarBufs),
    /// TurboQuant-Prod: the scalar stage's arrays and the residual sketch's matrices.
    ScalarSketch(ScalarBufs, Arc<Buffer>),
    /// QJL: the sketch matrices.
    Sketch(Arc<Buffer>),
    ProductVq(VqBufs),
}

/// A value codec's device arrays, by its spec.
pub enum ValueBufs {
    Scalar(ScalarBufs),
    /// Group values need no arrays.
    Group,
    ProductVq(VqBufs),
}

/// The device arrays of a key codec on `dev`, uploaded the first time.
pub fn key_bufs(dev: &MetalDevice, data: &KernelData<KeySpec>) -> Result<Arc<KeyBufs>> {
    data.device.get_or_try_insert(&device_key(dev), || {
        Ok(match &data.spec {
            KeySpec::Scalar(s) => KeyBufs::Scalar(ScalarBufs::new(dev, s)?),
            KeySpec::ScalarSketch { scalar, sketch } => KeyBufs::ScalarSketch(
                ScalarBufs::new(dev, scalar)?,
                upload(dev, &sketch.matrices)?,
            ),
            KeySpec::Sketch { sketch, .. } => KeyBufs::Sketch(upload(dev, &sketch.matrices)?),
            KeySpec::ProductVq(v) => KeyBufs::ProductVq(VqBufs::new(dev, v)?),
        })
    })
}

/// The device arrays of a value codec on `dev`, uploaded the first time.
pub fn value_bufs(dev: &MetalDevice, data: &KernelData<ValueSpec>) -> Result<Arc<ValueBufs>> {
    data.device.get_or_try_insert(&device_key(dev), || {
        Ok(match &data.spec {
            ValueSpec::Scalar(s) => ValueBufs::Scalar(ScalarBufs::new(dev, s)?),
            ValueSpec::Group { .. } => ValueBufs::Group,
            ValueSpec::ProductVq(v) => ValueBufs::ProductVq(VqBufs::new(dev, v)?),
        })
    })
}
