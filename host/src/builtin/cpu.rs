//! The `cpu` device: always available, the platform of last resort. Computes with libtorch's CPU
//! kernels and communicates with gloo.

use std::io::Read;

use verl_plugin_api::{Detection, Device, DeviceInfo, PluginError, ProbeContext};

/// How much of /proc/cpuinfo to read: the first processor's entry carries `vendor_id` and
/// `model name`, and the whole file is ~1 KiB per CPU (hundreds of KiB on big hosts).
const CPUINFO_PREFIX: u64 = 8 * 1024;

#[derive(Debug, Clone, Copy, Default)]
pub struct CpuDevice;

impl Device for CpuDevice {
    fn info(&self) -> DeviceInfo {
        // `info` has no probe, so the CPU's real vendor (from /proc/cpuinfo) is reported by
        // `detect`, in the reason and the device name.
        DeviceInfo::new("cpu", "cpu", "cpu", "gloo")
    }

    fn detect(&self, probe: &ProbeContext) -> Result<Detection, PluginError> {
        let online = probe.read_trimmed("/sys/devices/system/cpu/online");
        let (count, source) = match online.as_deref().and_then(count_cpu_list) {
            Some(n) => (n, "online in /sys/devices/system/cpu/online"),
            // Containers without /sys still have at least the CPU this code runs on.
            None => (1, "assumed (/sys/devices/system/cpu/online unreadable)"),
        };
        let info = cpuinfo_prefix(probe)
            .map(|text| CpuIdentity::parse(&text))
            .unwrap_or_default();
        let vendor = info.vendor.as_deref().unwrap_or("unknown vendor");
        let mut detection =
            Detection::available(count, format!("{count} CPU(s) {source}; {vendor}"));
        detection.device_names = vec![info.model.unwrap_or_else(|| "CPU".to_owned())];
        Ok(detection)
    }
}

/// Number of CPUs in a kernel CPU list ("0-15", "0-3,8-11", "0"); `None` if it does not parse.
fn count_cpu_list(list: &str) -> Option<u32> {
    let mut total = 0u32;
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (first, last) = part.split_once('-').unwrap_or((part, part));
        let (first, last): (u32, u32) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
        total = total.checked_add(last.checked_sub(first)? + 1)?;
    }
    (total > 0).then_some(total)
}

fn cpuinfo_prefix(probe: &ProbeContext) -> Option<String> {
    let file = std::fs::File::open(probe.path("/proc/cpuinfo")).ok()?;
    let mut bytes = Vec::new();
    file.take(CPUINFO_PREFIX).read_to_end(&mut bytes).ok()?;
    // A read cut mid-character is fine: only whole lines at the start are used.
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

#[derive(Debug, Default, PartialEq, Eq)]
struct CpuIdentity {
    vendor: Option<String>,
    model: Option<String>,
}

impl CpuIdentity {
    /// x86 has `vendor_id` and `model name`; arm64 has neither, only `CPU implementer`, which is
    /// reported as such rather than guessed into a vendor name.
    fn parse(cpuinfo: &str) -> Self {
        let field = |key: &str| {
            cpuinfo.lines().find_map(|line| {
                let (k, v) = line.split_once(':')?;
                (k.trim() == key && !v.trim().is_empty()).then(|| v.trim().to_owned())
            })
        };
        let vendor = field("vendor_id")
            .or_else(|| field("CPU implementer").map(|id| format!("CPU implementer {id}")));
        Self {
            vendor,
            model: field("model name"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe_with(files: &[(&str, &str)]) -> (tempfile::TempDir, ProbeContext) {
        let dir = tempfile::tempdir().unwrap();
        for (path, contents) in files {
            let full = dir.path().join(path.trim_start_matches('/'));
            std::fs::create_dir_all(full.parent().unwrap()).unwrap();
            std::fs::write(full, contents).unwrap();
        }
        let probe = ProbeContext::new(dir.path().to_string_lossy(), Vec::<(String, String)>::new());
        (dir, probe)
    }

    #[test]
    fn counts_online_cpus_and_reads_the_vendor() {
        let cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n\nprocessor\t: 1\n";
        let (_dir, probe) = probe_with(&[
            ("/sys/devices/system/cpu/online", "0-15\n"),
            ("/proc/cpuinfo", cpuinfo),
        ]);
        let d = CpuDevice.detect(&probe).unwrap();
        assert!(d.available);
        assert_eq!(d.count, 16);
        assert!(d.reason.contains("AuthenticAMD"), "{}", d.reason);
        assert_eq!(
            d.device_names.as_slice(),
            ["AMD EPYC 9654 96-Core Processor"]
        );
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("0-15"), Some(16));
        assert_eq!(count_cpu_list("0-3,8-11"), Some(8));
        assert_eq!(count_cpu_list("0,2,4-5\n"), Some(4));
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list("zero"), None);
        assert_eq!(count_cpu_list(""), None);
    }

    #[test]
    fn falls_back_to_one_cpu_without_sys() {
        let (_dir, probe) = probe_with(&[]);
        let d = CpuDevice.detect(&probe).unwrap();
        assert!(d.available && d.count == 1, "{d:?}");
        assert!(
            d.reason.contains("assumed") && d.reason.contains("unknown vendor"),
            "{}",
            d.reason
        );
        assert_eq!(d.device_names.as_slice(), ["CPU"]);

        let (_dir, probe) = probe_with(&[("/sys/devices/system/cpu/online", "garbage")]);
        assert_eq!(CpuDevice.detect(&probe).unwrap().count, 1);
    }

    #[test]
    fn arm_cpuinfo_has_no_vendor_id() {
        let cpuinfo =
            "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n";
        let (_dir, probe) = probe_with(&[
            ("/sys/devices/system/cpu/online", "0-63"),
            ("/proc/cpuinfo", cpuinfo),
        ]);
        let d = CpuDevice.detect(&probe).unwrap();
        assert_eq!(d.count, 64);
        assert!(d.reason.contains("CPU implementer 0x41"), "{}", d.reason);
    }

    #[test]
    fn reads_only_the_start_of_a_huge_cpuinfo() {
        let mut cpuinfo =
            String::from("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon\n\n");
        cpuinfo.push_str(&"processor\t: n\nvendor_id\t: Other\nflags\t: x\n\n".repeat(50_000));
        let (_dir, probe) = probe_with(&[("/proc/cpuinfo", &cpuinfo)]);
        let text = cpuinfo_prefix(&probe).unwrap();
        assert_eq!(text.len() as u64, CPUINFO_PREFIX);
        assert_eq!(
            CpuIdentity::parse(&text).vendor.as_deref(),
            Some("GenuineIntel")
        );
    }

    #[test]
    fn info_is_gloo_with_no_visible_devices_variable() {
        let info = CpuDevice.info();
        assert_eq!(
            (
                info.name.as_str(),
                info.device_type.as_str(),
                info.comm_backend.as_str()
            ),
            ("cpu", "cpu", "gloo")
        );
        assert!(info.visible_devices_env.is_empty());
    }
}
