//! The process's resident memory from /proc/self/status (Linux only; elsewhere `None`):
//! VmRSS (resident now) and VmHWM (the peak resident set since the process started); and the
//! memory in use on the GPU the model runs on.

use candle_core::Device;

/// Resident set size now, bytes.
pub(super) fn rss_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|kb| kb * 1024)
}

/// Peak resident set size of this process so far, bytes.
pub(super) fn peak_rss_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|kb| kb * 1024)
}

fn status_kib(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_kib(&status, key)
}

/// The value of `key` (e.g. `VmHWM:`) in a /proc status text, in kB as the kernel writes it.
pub(super) fn parse_kib(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Memory in use on `dev` now: on CUDA the card's total less its free memory (every context on
/// the card counted: weights, caches, workspace); on Metal what the device has allocated; `None`
/// on the CPU or where the driver does not answer.
pub(super) fn device_used_bytes(dev: &Device) -> Option<u64> {
    match dev {
        #[cfg(feature = "cuda")]
        Device::Cuda(c) => {
            let (free, total) = c.cuda_stream().context().mem_get_info().ok()?;
            Some(total.saturating_sub(free) as u64)
        }
        #[cfg(feature = "metal")]
        Device::Metal(m) => Some(m.metal_device().current_allocated_size() as u64),
        _ => None,
    }
}

/// Bytes as MiB.
pub(super) fn mib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}
