//! The device (platform) interface: what hardware is there, and how to talk to it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::PluginError;

#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[serde(default)]
pub struct EnvVar {
    pub key: String,
    pub value: String,
}

impl EnvVar {
    pub fn new(key: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            value: value.into(),
        }
    }
}

/// Everything a detection may look at: a filesystem root and an environment, both handed in by the
/// host. Detection code never reads `/` or `std::env` itself, so tests and containers can point it at
/// a fake tree (`VERL_PROBE_ROOT`) and a fake environment.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[serde(default)]
pub struct ProbeContext {
    pub root: String,
    pub env: Vec<EnvVar>,
}

impl ProbeContext {
    pub fn new<K: Into<String>, V: Into<String>>(
        root: impl Into<String>,
        env: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        Self {
            root: root.into(),
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
        PathBuf::from(&self.root).join(absolute.trim_start_matches('/'))
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
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[serde(default)]
pub struct DeviceInfo {
    /// Platform name users select with `VERL_PLATFORM` / `trainer.device` (e.g. "rocm").
    pub name: String,
    /// Hardware vendor ("amd", "nvidia", "huawei", …).
    pub vendor: String,
    /// The torch device type the platform computes on ("cuda" for ROCm too, "npu", "cpu", "xpu").
    pub device_type: String,
    /// Collective communication backend ("nccl", "hccl", "gloo", …).
    pub comm_backend: String,
    /// Variables that restrict the visible devices, most specific first.
    pub visible_devices_env: Vec<String>,
}

impl DeviceInfo {
    pub fn new(
        name: impl Into<String>,
        vendor: impl Into<String>,
        device_type: impl Into<String>,
        comm_backend: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            vendor: vendor.into(),
            device_type: device_type.into(),
            comm_backend: comm_backend.into(),
            visible_devices_env: Vec::new(),
        }
    }

    pub fn visible_devices_env<S: Into<String>>(
        mut self,
        vars: impl IntoIterator<Item = S>,
    ) -> Self {
        self.visible_devices_env = vars.into_iter().map(Into::into).collect();
        self
    }
}

/// Result of probing for a device family.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[serde(default)]
pub struct Detection {
    pub available: bool,
    /// Devices usable by this process, after the visible-devices filter.
    pub count: u32,
    /// Why it is (un)available, for humans: "2 GPU nodes in /sys/class/kfd/…".
    pub reason: String,
    /// Product names of the visible devices, when the probe can tell.
    pub device_names: Vec<String>,
    /// Variables the host sets before any component initialises (e.g. HIP_VISIBLE_DEVICES
    /// translated for CUDA-compatible libraries).
    pub env_updates: Vec<EnvVar>,
}

impl Detection {
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            ..Self::default()
        }
    }

    pub fn available(count: u32, reason: impl Into<String>) -> Self {
        Self {
            available: count > 0,
            count,
            reason: reason.into(),
            ..Self::default()
        }
    }

    pub fn device_names<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        self.device_names = names.into_iter().map(Into::into).collect();
        self
    }

    pub fn env_update(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env_updates.push(EnvVar::new(key, value));
        self
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
