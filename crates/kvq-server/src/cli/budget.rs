//! `--kv-budget`: how many bytes the KV caches of running sequences may reserve together, given
//! as bytes (`8GiB`, `512 MiB`, `2e9`), a share of the memory the caches live in (`60%`: of
//! available RAM for a CPU model, of free device memory for a GPU one, measured once the model
//! is loaded), or `none`.

#[cfg(any(target_os = "linux", feature = "cuda"))]
use anyhow::Context;
use candle_core::Device;

/// The default: a share of what is free once the weights are loaded, leaving room for
/// activations, the tokenizer and the rest of the machine.
pub const DEFAULT: KvBudget = KvBudget::Share(0.6);

/// A parsed `--kv-budget`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    /// Exactly this many bytes.
    Bytes(usize),
    /// This fraction (0 to 1] of the memory available where the caches live.
    Share(f64),
    /// No limit: admission counts sequences only.
    Unlimited,
}

impl std::str::FromStr for KvBudget {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let bad = || {
            format!(
                "'{s}' is not a KV budget: give bytes (8GiB, 512MiB, 2000000000), a share of \
                 available memory (60%), or none"
            )
        };
        if matches!(
            t.to_ascii_lowercase().as_str(),
            "none" | "unlimited" | "off"
        ) {
            return Ok(Self::Unlimited);
        }
        if let Some(p) = t.strip_suffix('%') {
            let p: f64 = p.trim().parse().map_err(|_| bad())?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(format!("--kv-budget {s}: a share must be in (0%, 100%]"));
            }
            return Ok(Self::Share(p / 100.0));
        }
        // The unit is a suffix (so `2e9` stays a number); longest spellings first.
        const UNITS: [(&str, f64); 13] = [
            ("tib", 1099511627776.0),
            ("gib", 1073741824.0),
            ("mib", 1048576.0),
            ("kib", 1024.0),
            ("tb", 1e12),
            ("gb", 1e9),
            ("mb", 1e6),
            ("kb", 1e3),
            ("t", 1e12),
            ("g", 1e9),
            ("m", 1e6),
            ("k", 1e3),
            ("b", 1.0),
        ];
        let lower = t.to_ascii_lowercase();
        let (num, scale) = UNITS
            .iter()
            .find_map(|(u, scale)| lower.strip_suffix(u).map(|n| (n.trim(), *scale)))
            .unwrap_or((lower.as_str(), 1.0));
        if num.is_empty() || num.ends_with(|c: char| c.is_ascii_alphabetic()) {
            return Err(bad());
        }
        let num: f64 = num.parse().map_err(|_| bad())?;
        let bytes = num * scale;
        if !(bytes.is_finite() && bytes >= 1.0 && bytes < usize::MAX as f64) {
            return Err(format!("--kv-budget {s}: must be at least 1 byte"));
        }
        Ok(Self::Bytes(bytes as usize))
    }
}

impl KvBudget {
    /// The budget in bytes for caches on `dev` (`None`: unlimited), and how it was arrived at.
    pub fn resolve(self, dev: &Device) -> anyhow::Result<(Option<usize>, String)> {
        Ok(match self {
            Self::Bytes(b) => (Some(b), "given".into()),
            Self::Unlimited => (None, "no limit".into()),
            Self::Share(share) => {
                let (free, what) = available(dev)?;
                let b = (free as f64 * share) as usize;
                (
                    Some(b),
                    format!(
                        "{:.0}% of {} {what}",
                        share * 100.0,
                        kvq_engine::error::human_bytes(free)
                    ),
                )
            }
        })
    }
}

/// Bytes free where caches on `dev` live, and what that memory is called.
fn available(dev: &Device) -> anyhow::Result<(usize, &'static str)> {
    match dev {
        Device::Cpu => Ok((available_ram()?, "available RAM")),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let (free, _) = dev
                .as_cuda_device()?
                .cuda_stream()
                .context()
                .mem_get_info()
                .context("could not read the GPU's free memory")?;
            Ok((free, "free GPU memory"))
        }
        // Unified memory: what Metal recommends this process keep resident, less what it holds.
        #[cfg(feature = "metal")]
        Device::Metal(m) => {
            let d = m.metal_device();
            let free = d
                .recommended_max_working_set_size()
                .saturating_sub(d.current_allocated_size());
            Ok((free, "Metal working set"))
        }
        _ => anyhow::bail!(
            "cannot measure this device's free memory: give --kv-budget in bytes (8GiB) or none"
        ),
    }
}

/// `MemAvailable` of /proc/meminfo: what can be allocated without swapping.
#[cfg(target_os = "linux")]
fn available_ram() -> anyhow::Result<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").context("could not read /proc/meminfo")?;
    parse_meminfo(&text).context("/proc/meminfo has no MemAvailable line")
}

#[cfg(not(target_os = "linux"))]
fn available_ram() -> anyhow::Result<usize> {
    anyhow::bail!(
        "cannot measure available RAM on this platform: give --kv-budget in bytes (8GiB) or none"
    )
}

/// The `MemAvailable:  N kB` line, in bytes.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn parse_meminfo(text: &str) -> Option<usize> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// A parsed `--prefix-cache`: `Some(bytes)`, or `None` for off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixCacheSize(pub Option<usize>);

impl std::str::FromStr for PrefixCacheSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        parse_prefix_cache(s).map(Self)
    }
}

/// A `--prefix-cache` value: `Some(bytes)`, or `None` for off (`off`, `none`, `0`).
pub fn parse_prefix_cache(s: &str) -> Result<Option<usize>, String> {
    let t = s.trim().to_ascii_lowercase();
    if matches!(t.as_str(), "off" | "none" | "0" | "no" | "false") {
        return Ok(None);
    }
    match t.parse::<KvBudget>() {
        Ok(KvBudget::Bytes(b)) => Ok(Some(b)),
        _ => Err(format!(
            "'{s}' is not a prefix cache size: give bytes (2GiB, 512MiB, 1000000000) or off"
        )),
    }
}

/// `--kv-store-max`'s default.
pub const DEFAULT_STORE_MAX: u64 = 10 << 30;

/// A parsed `--kv-store-max`: bytes, more than 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StoreSize(pub u64);

impl std::str::FromStr for StoreSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.parse::<KvBudget>() {
            Ok(KvBudget::Bytes(b)) if b > 0 => Ok(Self(b as u64)),
            _ => Err(format!(
                "'{s}' is not a KV store size: give bytes (20GiB, 512MiB, 1000000000)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_store_sizes() {
        assert_eq!("20GiB".parse::<StoreSize>(), Ok(StoreSize(20 << 30)));
        assert_eq!("1000".parse::<StoreSize>(), Ok(StoreSize(1000)));
        for bad in ["0", "50%", "none", "lots"] {
            assert!(bad.parse::<StoreSize>().is_err(), "{bad}");
        }
    }

    #[test]
    fn parses_prefix_cache_sizes() {
        assert_eq!(parse_prefix_cache("512MiB"), Ok(Some(512 << 20)));
        assert_eq!(parse_prefix_cache("off"), Ok(None));
        assert_eq!(parse_prefix_cache("0"), Ok(None));
        assert!(parse_prefix_cache("50%").is_err());
        assert!(parse_prefix_cache("lots").is_err());
    }

    #[test]
    fn parses_bytes_shares_and_none() {
        let p = |s: &str| s.parse::<KvBudget>();
        assert_eq!(p("8GiB"), Ok(KvBudget::Bytes(8 << 30)));
        assert_eq!(p(" 512 MiB "), Ok(KvBudget::Bytes(512 << 20)));
        assert_eq!(p("1.5GB"), Ok(KvBudget::Bytes(1_500_000_000)));
        assert_eq!(p("2e9"), Ok(KvBudget::Bytes(2_000_000_000)));
        assert_eq!(p("4096"), Ok(KvBudget::Bytes(4096)));
        assert_eq!(p("60%"), Ok(KvBudget::Share(0.6)));
        assert_eq!(p("none"), Ok(KvBudget::Unlimited));
        for bad in [
            "",
            "abc",
            "-1GiB",
            "0",
            "0%",
            "150%",
            "NaN",
            "inf",
            "3 parsecs",
            "1e400",
        ] {
            assert!(p(bad).is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn reads_mem_available() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_meminfo(text), Some(20_000_000 * 1024));
        assert_eq!(parse_meminfo("MemTotal: 5 kB\n"), None);
        #[cfg(target_os = "linux")]
        assert!(available_ram().is_ok_and(|b| b > 0));
    }

    #[test]
    fn a_share_of_the_cpu_memory_is_below_it() {
        #[cfg(target_os = "linux")]
        {
            let (b, how) = KvBudget::Share(0.5).resolve(&Device::Cpu).unwrap();
            assert!(
                b.is_some_and(|b| b > 0 && b < available_ram().unwrap()),
                "{how}"
            );
        }
        assert_eq!(KvBudget::Bytes(7).resolve(&Device::Cpu).unwrap().0, Some(7));
        assert_eq!(KvBudget::Unlimited.resolve(&Device::Cpu).unwrap().0, None);
    }
}
