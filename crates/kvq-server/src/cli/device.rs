//! `--device cpu|cuda[:N]|metal|auto`: where the model and its caches run. `auto` takes CUDA
//! device 0 when this binary was built with CUDA and a GPU answers, else the Metal device when
//! it was built with Metal and one answers, else the CPU; the log says which. A device this binary was not built for is an error naming the feature to build with.

use anyhow::Context;
use candle_core::Device;
use std::str::FromStr;

/// A `--device` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceArg {
    Cpu,
    Cuda(usize),
    Metal,
    #[default]
    Auto,
}

impl FromStr for DeviceArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim().to_ascii_lowercase();
        Ok(match s.as_str() {
            "cpu" => Self::Cpu,
            "cuda" | "gpu" => Self::Cuda(0),
            "metal" => Self::Metal,
            "auto" => Self::Auto,
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Self::Cuda(n),
                _ => {
                    return Err(format!(
                        "unknown device '{s}': expected cpu, cuda, cuda:N, metal or auto"
                    ));
                }
            },
        })
    }
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
            Self::Metal => f.write_str("metal"),
            Self::Auto => f.write_str("auto"),
        }
    }
}

impl DeviceArg {
    /// The candle device, logged.
    pub fn resolve(self) -> anyhow::Result<Device> {
        let dev = match self {
            Self::Cpu => Device::Cpu,
            Self::Cuda(n) => cuda(n)?,
            Self::Metal => metal()?,
            Self::Auto if cfg!(feature = "cuda") => cuda(0).unwrap_or_else(|e| {
                tracing::info!("no CUDA device ({e:#}); running on the CPU");
                Device::Cpu
            }),
            Self::Auto if cfg!(feature = "metal") => metal().unwrap_or_else(|e| {
                tracing::info!("no Metal device ({e:#}); running on the CPU");
                Device::Cpu
            }),
            Self::Auto => Device::Cpu,
        };
        tracing::info!(device = %describe(&dev), "device");
        Ok(dev)
    }
}

/// `cpu` or `cuda:N`, for logs and reports.
pub fn describe(dev: &Device) -> String {
    match dev.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Opens CUDA device `n`. Candle runs every op on one stream of its own, but creating that
/// stream puts cudarc in multi-stream mode, where every launch records and waits on events for
/// each buffer it touches: a few driver calls per argument, host time that a decode step of
/// many small launches is bound by. One stream needs none of them, so they are turned off
/// (`KVQ_CUDA_EVENT_TRACKING=1` keeps them, for comparison).
#[cfg(feature = "cuda")]
fn cuda(n: usize) -> anyhow::Result<Device> {
    let dev = Device::new_cuda(n).with_context(|| format!("could not open CUDA device {n}"))?;
    if std::env::var("KVQ_CUDA_EVENT_TRACKING").as_deref() != Ok("1") {
        // SAFETY: before the model or a cache allocates (buffers made from now on carry no
        // events), and kvq enqueues everything (its kernels, candle's, cuBLAS, copies) on
        // candle's one stream, so stream order alone orders every read after its write.
        unsafe { dev.as_cuda_device()?.disable_event_tracking() };
        tracing::debug!("CUDA event tracking off (one stream)");
    }
    Ok(dev)
}

#[cfg(not(feature = "cuda"))]
fn cuda(n: usize) -> anyhow::Result<Device> {
    Err(anyhow::anyhow!("no CUDA device {n}")).context(
        "this kvq was built without CUDA: build it with `scripts/build-cuda kvq` \
         (cargo feature cuda), or use --device cpu",
    )
}

/// Opens the system's default Metal device (the model and caches on it; the caches' kernels
/// are compiled from kernels/metal on first use).
#[cfg(feature = "metal")]
fn metal() -> anyhow::Result<Device> {
    Device::new_metal(0).context("could not open the Metal device")
}

#[cfg(not(feature = "metal"))]
fn metal() -> anyhow::Result<Device> {
    anyhow::bail!(
        "this kvq was built without Metal: build it on macOS with `cargo build --release \
         --features metal`, or use --device cpu"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_spelling_and_refuses_the_rest() {
        assert_eq!("cpu".parse(), Ok(DeviceArg::Cpu));
        assert_eq!("CUDA".parse(), Ok(DeviceArg::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceArg::Cuda(3)));
        assert_eq!("metal".parse(), Ok(DeviceArg::Metal));
        assert_eq!("auto".parse(), Ok(DeviceArg::Auto));
        for d in [
            DeviceArg::Cpu,
            DeviceArg::Cuda(2),
            DeviceArg::Metal,
            DeviceArg::Auto,
        ] {
            assert_eq!(d.to_string().parse(), Ok(d));
        }
        for bad in ["", "cuda:", "cuda:x", "tpu", "cuda:-1"] {
            assert!(bad.parse::<DeviceArg>().is_err(), "{bad}");
        }
    }

    #[test]
    fn auto_and_cpu_resolve_here_and_a_missing_backend_is_an_error() {
        assert!(DeviceArg::Cpu.resolve().expect("cpu").is_cpu());
        let auto = DeviceArg::Auto.resolve().expect("auto falls back");
        if !cfg!(feature = "cuda") {
            assert!(auto.is_cpu());
            let err = format!("{:#}", DeviceArg::Cuda(0).resolve().unwrap_err());
            assert!(err.contains("without CUDA"), "{err}");
        }
        if !cfg!(feature = "metal") {
            let err = format!("{:#}", DeviceArg::Metal.resolve().unwrap_err());
            assert!(err.contains("without Metal"), "{err}");
        }
    }
}
