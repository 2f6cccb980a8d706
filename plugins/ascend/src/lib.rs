//! # verl-plugin-ascend
//!
//! Device plugin for Huawei Ascend NPUs. Torch sees them as device type "npu" (through torch_npu)
//! and they communicate with HCCL.
//!
//! Detection needs no Ascend tools (`npu-smi`): the kernel driver creates one `/dev/davinciN`
//! character device per NPU plus the control devices `/dev/davinci_manager`, `/dev/devmm_svm` and
//! `/dev/hisi_hdc`; the user-space driver (libascend_hal and friends) is installed at
//! `/usr/local/Ascend/driver`, with its version in `version.info`. Containers must be given the
//! davinci devices, the control devices and a mount of the driver directory, so each missing piece
//! is named in the reason.
//!
//! verl-core computes through libtorch; on Ascend that needs torch_npu's libraries, which this
//! build does not link. Detection therefore reports the hardware honestly and says so.

use verl_plugin_api::{
    Detection, Device, DeviceInfo, PluginBuilder, PluginError, ProbeContext, visible_devices,
};

pub const NAME: &str = "ascend";
/// Below CUDA (100) and ROCm (90), above CPU (0).
pub const PRIORITY: i32 = 80;

const VISIBLE: &str = "ASCEND_RT_VISIBLE_DEVICES";
const DRIVER_DIR: &str = "/usr/local/Ascend/driver";
const MANAGER: &str = "/dev/davinci_manager";
/// Set by CANN's `set_env.sh`; where the toolkit torch_npu builds against lives.
const TOOLKIT_ENV: [&str; 2] = ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"];

verl_plugin_api::export_plugin!(
    PluginBuilder::new(
        "ascend",
        env!("CARGO_PKG_VERSION"),
        "Huawei Ascend NPUs (npu device type, HCCL)"
    )
    .device(
        NAME,
        PRIORITY,
        "Ascend NPUs found as /dev/davinciN with the driver at /usr/local/Ascend/driver",
        || AscendDevice
    )
);

#[derive(Debug, Clone, Copy, Default)]
pub struct AscendDevice;

impl Device for AscendDevice {
    fn info(&self) -> DeviceInfo {
        DeviceInfo::new(NAME, "huawei", "npu", "hccl").visible_devices_env([VISIBLE])
    }

    fn detect(&self, probe: &ProbeContext) -> Result<Detection, PluginError> {
        let npus = davinci_devices(probe);
        if npus.is_empty() {
            return Ok(Detection::unavailable(
                "no /dev/davinciN device (no Ascend NPU, or the driver is not loaded)",
            ));
        }
        let listed = npus
            .iter()
            .map(|n| format!("davinci{n}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut missing = Vec::new();
        if !probe.exists(MANAGER) {
            missing.push(format!(
                "{MANAGER} is missing (in a container, pass it with --device)"
            ));
        }
        let driver = DriverInfo::read(probe);
        if driver.is_none() {
            missing.push(format!(
                "no driver at {DRIVER_DIR} (install it, or mount it into the container)"
            ));
        }
        if !missing.is_empty() {
            return Ok(Detection::unavailable(format!(
                "{} NPU device(s) ({listed}) but {}",
                npus.len(),
                missing.join("; ")
            )));
        }
        let driver = driver.unwrap_or_default();

        // The runtime numbers the NPUs a process can see 0..n in device order, so the variable's
        // indices refer to positions in `npus`, not to the N of /dev/davinciN.
        let filter = probe.var(VISIBLE);
        let visible = visible_devices(npus.len() as u32, filter);
        let mut reason = format!(
            "{} NPU device(s) ({listed}), driver {}",
            npus.len(),
            driver.version
        );
        if let Some(value) = filter {
            reason.push_str(&format!(
                ", {} visible with {VISIBLE}={value}",
                visible.len()
            ));
        }
        reason.push_str(&match toolkit(probe) {
            Some(path) => format!("; CANN toolkit at {path}"),
            None => "; no CANN toolkit found (source set_env.sh)".to_owned(),
        });
        reason.push_str("; computing on NPUs needs torch_npu's libraries, which this verl-core build does not link");

        let mut detection = Detection::available(visible.len() as u32, reason);
        detection.device_names = visible
            .iter()
            .map(|&i| {
                format!(
                    "{} (/dev/davinci{})",
                    driver.chip.as_deref().unwrap_or("Ascend NPU"),
                    npus[i as usize]
                )
            })
            .collect();
        Ok(detection)
    }
}

/// The N of every `/dev/davinciN`, ascending; `davinci_manager` and other non-numbered entries
/// are control devices, not NPUs.
pub fn davinci_devices(probe: &ProbeContext) -> Vec<u32> {
    let mut ids: Vec<u32> = probe
        .list_dir("/dev")
        .iter()
        .filter_map(|name| name.strip_prefix("davinci"))
        .filter(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .filter_map(|digits| digits.parse().ok())
        .collect();
    ids.sort_unstable();
    ids
}

/// What the installed driver says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DriverInfo {
    /// `Version=` (else `package_version=`) of version.info, or "of unknown version".
    pub version: String,
    /// The chip name, only when version.info carries one (`chip_name=`/`soc_version=`); the
    /// driver's version.info usually does not, and without npu-smi nothing else names it.
    pub chip: Option<String>,
}

impl DriverInfo {
    /// `None` when the driver directory is absent.
    pub fn read(probe: &ProbeContext) -> Option<Self> {
        if !probe.exists(DRIVER_DIR) {
            return None;
        }
        let text = probe
            .read_trimmed(&format!("{DRIVER_DIR}/version.info"))
            .unwrap_or_default();
        let field = |keys: &[&str]| {
            keys.iter().find_map(|key| {
                text.lines().find_map(|line| {
                    let (k, v) = line.split_once('=')?;
                    (k.trim().eq_ignore_ascii_case(key) && !v.trim().is_empty())
                        .then(|| v.trim().to_owned())
                })
            })
        };
        let version = field(&["Version", "package_version"])
            .unwrap_or_else(|| "of unknown version".to_owned());
        Some(Self {
            version,
            chip: field(&["chip_name", "soc_version"]),
        })
    }
}

/// Where the CANN toolkit is: the variable `set_env.sh` exports, else the default install path.
fn toolkit(probe: &ProbeContext) -> Option<String> {
    TOOLKIT_ENV
        .iter()
        .filter_map(|key| probe.var(key))
        .find(|path| !path.is_empty())
        .map(str::to_owned)
        .or_else(|| {
            probe
                .exists("/usr/local/Ascend/ascend-toolkit")
                .then(|| "/usr/local/Ascend/ascend-toolkit".to_owned())
        })
}

#[cfg(test)]
mod tests {
    use verl_testkit::{FakeEnv, FakeRoot};

    use super::*;

    fn detect(probe: &ProbeContext) -> Detection {
        AscendDevice
            .detect(probe)
            .expect("detection never fails on configuration")
    }

    fn names(d: &Detection) -> Vec<&str> {
        d.device_names.iter().map(|n| n.as_str()).collect()
    }

    #[test]
    fn info_is_npu_with_hccl() {
        let info = AscendDevice.info();
        assert_eq!(
            (info.name.as_str(), info.vendor.as_str()),
            ("ascend", "huawei")
        );
        assert_eq!(
            (info.device_type.as_str(), info.comm_backend.as_str()),
            ("npu", "hccl")
        );
        assert_eq!(info.visible_devices_env.as_slice(), [VISIBLE]);
    }

    #[test]
    fn counts_davinci_devices_and_says_compute_needs_torch_npu() {
        for n in [1, 8, 16] {
            let d = detect(&FakeRoot::new().ascend_npus(n).probe());
            assert!(d.available && d.count == n, "{d:?}");
            assert_eq!(d.device_names.len(), n as usize);
            assert!(d.reason.contains("driver 24.1.rc3"), "{}", d.reason);
            assert!(d.reason.contains("torch_npu"), "{}", d.reason);
            assert!(d.reason.contains("no CANN toolkit"), "{}", d.reason);
        }
    }

    #[test]
    fn control_devices_are_not_npus_and_numbering_may_have_gaps() {
        // A container given davinci3 and davinci5 only (plus look-alike names that are not NPUs).
        let root = FakeRoot::new()
            .ascend_npus(0)
            .file("/dev/davinci5", "")
            .file("/dev/davinci3", "")
            .file("/dev/davinci", "")
            .file("/dev/davinci1x", "")
            .dir("/usr/local/Ascend/ascend-toolkit");
        assert_eq!(davinci_devices(&root.probe()), [3, 5]);
        let d = detect(&root.probe());
        assert_eq!(
            names(&d),
            ["Ascend NPU (/dev/davinci3)", "Ascend NPU (/dev/davinci5)"]
        );
        assert!(d.reason.contains("(davinci3, davinci5)"), "{}", d.reason);
        assert!(
            d.reason
                .contains("CANN toolkit at /usr/local/Ascend/ascend-toolkit"),
            "{}",
            d.reason
        );

        // ASCEND_RT_VISIBLE_DEVICES indexes the visible devices in order: 1 is davinci5.
        let d = detect(&root.probe_with(&FakeEnv::new().set(VISIBLE, "1")));
        assert_eq!(names(&d), ["Ascend NPU (/dev/davinci5)"]);
    }

    #[test]
    fn visible_devices_filter() {
        let root = FakeRoot::new().ascend_npus(8);
        let case = |value: &str| detect(&root.probe_with(&FakeEnv::new().set(VISIBLE, value)));
        let d = case("6,7");
        assert_eq!(d.count, 2);
        assert_eq!(
            names(&d),
            ["Ascend NPU (/dev/davinci6)", "Ascend NPU (/dev/davinci7)"]
        );
        assert!(
            d.reason
                .contains("2 visible with ASCEND_RT_VISIBLE_DEVICES=6,7"),
            "{}",
            d.reason
        );
        assert_eq!(case("0,8").count, 1, "out-of-range entries end the list");
        let none = case("");
        assert!(!none.available && none.count == 0);
    }

    #[test]
    fn missing_pieces_are_named() {
        let no_manager = detect(&FakeRoot::new().ascend_npus(2).remove(MANAGER).probe());
        assert!(!no_manager.available && no_manager.count == 0);
        assert!(
            no_manager
                .reason
                .contains("/dev/davinci_manager is missing"),
            "{}",
            no_manager.reason
        );

        let no_driver = detect(&FakeRoot::new().ascend_npus(2).remove(DRIVER_DIR).probe());
        assert!(!no_driver.available);
        assert!(
            no_driver
                .reason
                .contains("no driver at /usr/local/Ascend/driver"),
            "{}",
            no_driver.reason
        );

        let neither = detect(
            &FakeRoot::new()
                .ascend_npus(1)
                .remove(DRIVER_DIR)
                .remove(MANAGER)
                .probe(),
        );
        assert!(
            neither.reason.contains("davinci_manager") && neither.reason.contains("no driver"),
            "{}",
            neither.reason
        );

        let nothing = detect(&FakeRoot::new().probe());
        assert!(
            !nothing.available && nothing.reason.contains("no /dev/davinciN"),
            "{}",
            nothing.reason
        );
        // The driver alone (a host prepared for NPUs that are not there) is not a device.
        let driver_only = detect(&FakeRoot::new().ascend_npus(0).probe());
        assert!(!driver_only.available);
    }

    #[test]
    fn driver_version_info_variants() {
        let read = |contents: Option<&str>| {
            let mut root = FakeRoot::new().dir(DRIVER_DIR);
            if let Some(text) = contents {
                root = root.file("/usr/local/Ascend/driver/version.info", text);
            }
            DriverInfo::read(&root.probe()).expect("driver dir exists")
        };
        assert_eq!(read(None).version, "of unknown version");
        assert_eq!(read(Some("package_version=23.0.3\n")).version, "23.0.3");
        let named = read(Some("Version=25.0.rc1\nchip_name=910B3\n"));
        assert_eq!(
            (named.version.as_str(), named.chip.as_deref()),
            ("25.0.rc1", Some("910B3"))
        );
        assert_eq!(DriverInfo::read(&FakeRoot::new().probe()), None);

        let root = FakeRoot::new().ascend_npus(1).file(
            "/usr/local/Ascend/driver/version.info",
            "Version=25.0.rc1\nchip_name=910B3\n",
        );
        assert_eq!(names(&detect(&root.probe())), ["910B3 (/dev/davinci0)"]);
        let toolkit = detect(
            &root.probe_with(&FakeEnv::new().set("ASCEND_TOOLKIT_HOME", "/opt/cann/latest")),
        );
        assert!(
            toolkit.reason.contains("CANN toolkit at /opt/cann/latest"),
            "{}",
            toolkit.reason
        );
    }

    #[test]
    fn exported_manifest_registers_the_device() {
        let manifest = __verl_plugin_manifest().into_result().expect("manifest");
        let root = FakeRoot::new().ascend_npus(2);
        let detection = verl_testkit::detect_exported_device(manifest, NAME, PRIORITY, &root);
        assert_eq!(detection.count, 2);
    }
}
