//! How much host memory a request may take: checked before a large allocation, so that an
//! oversized request is an error naming its size instead of a libtorch allocation failure (or
//! the kernel's OOM killer).

use std::path::Path;

use crate::error::{ModelError, Result};

/// Bytes this process can still allocate: `MemAvailable` of `/proc/meminfo`, lowered to what
/// the cgroup (v2) the process runs in has left. None where neither can be read.
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let machine = meminfo.as_deref().and_then(mem_available);
    [machine, cgroup_headroom(Path::new("/sys/fs/cgroup"))]
        .into_iter()
        .flatten()
        .min()
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// `memory.max - memory.current` of the cgroup whose files are in `dir`; None without a limit.
fn cgroup_headroom(dir: &Path) -> Option<u64> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let max: u64 = read("memory.max")?.trim().parse().ok()?;
    let current: u64 = read("memory.current")?.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// Fails with [`ModelError::OutOfMemory`] when `needed` bytes (for `what`) exceed what is
/// available; passes where that is unknown.
pub fn check(what: impl FnOnce() -> String, needed: u128) -> Result<()> {
    match available_bytes() {
        Some(available) if needed > u128::from(available) => Err(ModelError::OutOfMemory {
            what: what(),
            needed: gib(needed),
            available: gib(u128::from(available)),
        }),
        _ => Ok(()),
    }
}

/// `bytes` in GiB for messages.
pub fn gib(bytes: u128) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_cgroup_limits_are_read() {
        let meminfo =
            "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available(meminfo), Some(20_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 5 kB\n"), None);

        let dir = tempfile::tempdir().unwrap();
        assert_eq!(cgroup_headroom(dir.path()), None);
        std::fs::write(dir.path().join("memory.max"), "max\n").unwrap();
        std::fs::write(dir.path().join("memory.current"), "1000\n").unwrap();
        assert_eq!(cgroup_headroom(dir.path()), None, "no limit");
        std::fs::write(dir.path().join("memory.max"), "5000\n").unwrap();
        assert_eq!(cgroup_headroom(dir.path()), Some(4000));
        assert!(available_bytes().is_some_and(|b| b > 0), "this is Linux");
        assert_eq!(gib(3 << 30), "3.0 GiB");
    }
}
