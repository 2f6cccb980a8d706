//! The device (platform) interface: what hardware is there, and how to talk to it.

use std::path::PathBuf;

use abi_stable::StableAbi;
use abi_stable::std_types::{RString, RVec};

use crate::PluginError;

#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct EnvVar {
    pub key: RString,
    pub value: RString,
}

impl EnvVar {
    pub fn new(key: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            key: RString::from(key.into()),
            value: RString::from(value.into()),
        }
    }
}

/// Everything a detection may look at: a filesystem root and an environment, both handed in by the
/// host. Detection code never reads `/` or `std::env` itself, so tests and containers can point it at
/// a fake tree (`VERL_PROBE_ROOT`) and a fake environment.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct ProbeContext {
    pub root: RString,
    pub env: RVec<EnvVar>,
}

impl ProbeContext {
    pub fn new<K: Into<String>, V: Into<String>>(
        root: impl Into<String>,
        env: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        Self {
            root: RString::from(root.into()),
            env: env.into_iter().map(|(k, v)| EnvVar::new(k, v)).collect(),
        }
    }

    /// The variable's value; an empty value counts as set.
    pub fn var(&self, key: &str) -> Option<&str> {
        self.env
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.value.as_str())
    }

    /// `absolute` ("/dev/kfd") re-rooted under the probe root.
    pub fn path(&self, absolute: &str) -> PathBuf {
        PathBuf::from(self.root.as_str()).join(absolute.trim_start_matches('/'))
    }

    pub fn exists(&self, absolute: &str) -> bool {
        self.path(absolute).exists()
    }

    /// File contents with surrounding whitespace trimmed; `None` when unreadable.
    pub fn read_trimmed(&self, absolute: &str) -> Option<String> {
        std::fs::read_to_string(self.path(absolute))
            .ok()
            .map(|s| s.trim().to_owned())
    }

    /// Sorted entry names of a directory; empty when it is missing or unreadable.
    pub fn list_dir(&self, absolute: &str) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.path(absolute))
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort_by_key(|a| natural_key(a));
        names
    }
}

/// Orders `davinci2` before `davinci10`.
fn natural_key(name: &str) -> (String, u64) {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (stem, number) = name.split_at(name.len() - digits);
    (stem.to_owned(), number.parse().unwrap_or(0))
}

/// Static facts about a device family.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Platform name users select with `VERL_PLATFORM` / `trainer.device` (e.g. "rocm").
    pub name: RString,
    /// Hardware vendor ("amd", "nvidia", "huawei", …).
    pub vendor: RString,
    /// The torch device type the platform computes on ("cuda" for ROCm too, "npu", "cpu", "xpu").
    pub device_type: RString,
    /// Collective communication backend ("nccl", "hccl", "gloo", …).
    pub comm_backend: RString,
    /// Variables that restrict the visible devices, most specific first.
    pub visible_devices_env: RVec<RString>,
}

/// Result of probing for a device family.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq, Default)]
pub struct Detection {
    pub available: bool,
    /// Devices usable by this process, after the visible-devices filter.
    pub count: u32,
    /// Why it is (un)available, for humans: "2 GPU nodes in /sys/class/kfd/…".
    pub reason: RString,
    /// Product names of the visible devices, when the probe can tell.
    pub device_names: RVec<RString>,
    /// Variables the host should set before compute starts (e.g. HIP_VISIBLE_DEVICES translated for
    /// CUDA-compatible libraries).
    pub env_updates: RVec<EnvVar>,
}

impl Detection {
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self {
            reason: RString::from(reason.into()),
            ..Self::default()
        }
    }

    pub fn available(count: u32, reason: impl Into<String>) -> Self {
        Self {
            available: count > 0,
            count,
            reason: RString::from(reason.into()),
            ..Self::default()
        }
    }
}

/// A device family, as a plugin author implements it.
pub trait Device: Send + Sync + 'static {
    fn info(&self) -> DeviceInfo;
    /// Probes through `probe` only. An `Err` is a configuration error the user must fix (e.g. two
    /// conflicting visible-devices variables); absence of hardware is `Ok(Detection::unavailable(..))`.
    fn detect(&self, probe: &ProbeContext) -> Result<Detection, PluginError>;
}

/// Which of `physical` devices a visible-devices value leaves, with CUDA's rules: comma-separated
/// indices, an empty value hides everything, the list ends at the first entry that is not a valid
/// index (out of range, negative, garbage), repeats are ignored. UUID entries (`GPU-…`, `MIG-…`)
/// cannot be mapped without the driver and are kept in order as the next unused index.
pub fn visible_devices(physical: u32, value: Option<&str>) -> Vec<u32> {
    let Some(value) = value else {
        return (0..physical).collect();
    };
    let mut visible = Vec::new();
    for token in value.split(',').map(str::trim) {
        let index = if token.starts_with("GPU-") || token.starts_with("MIG-") {
            (0..physical).find(|i| !visible.contains(i))
        } else {
            token.parse::<u32>().ok().filter(|&i| i < physical)
        };
        match index {
            Some(i) if !visible.contains(&i) => visible.push(i),
            Some(_) => {}
            None => break,
        }
    }
    visible
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visible_devices_follow_cuda_rules() {
        assert_eq!(visible_devices(4, None), vec![0, 1, 2, 3]);
        assert_eq!(visible_devices(4, Some("")), Vec::<u32>::new());
        assert_eq!(visible_devices(4, Some("2,0")), vec![2, 0]);
        assert_eq!(visible_devices(4, Some("1, 1,3")), vec![1, 3]);
        assert_eq!(visible_devices(4, Some("0,7,1")), vec![0]);
        assert_eq!(visible_devices(4, Some("-1")), Vec::<u32>::new());
        assert_eq!(
            visible_devices(2, Some("GPU-abc,GPU-def,GPU-x")),
            vec![0, 1]
        );
        assert_eq!(visible_devices(0, Some("0")), Vec::<u32>::new());
    }

    #[test]
    fn probe_paths_are_rerooted_and_sorted_naturally() {
        let dir = std::env::temp_dir().join(format!("verl-probe-test-{}", std::process::id()));
        for n in ["davinci10", "davinci2", "davinci_manager"] {
            std::fs::create_dir_all(dir.join("dev")).unwrap();
            std::fs::write(dir.join("dev").join(n), " x\n").unwrap();
        }
        let probe = ProbeContext::new(dir.to_string_lossy(), [("A", "")]);
        assert_eq!(
            probe.list_dir("/dev"),
            vec!["davinci2", "davinci10", "davinci_manager"]
        );
        assert_eq!(probe.read_trimmed("/dev/davinci2").as_deref(), Some("x"));
        assert_eq!(probe.var("A"), Some(""));
        assert_eq!(probe.var("B"), None);
        assert!(!probe.exists("/dev/kfd"));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
