//! The `cuda` device: NVIDIA GPUs, detected from what the kernel driver publishes, without
//! nvidia-smi or libcuda: one `/proc/driver/nvidia/gpus/<pci address>/information` per GPU
//! (`Model:`, `GPU UUID:`, …), else the `/dev/nvidiaN` nodes with `/dev/nvidiactl`.

use verl_plugin_api::{Detection, Device, DeviceInfo, PluginError, ProbeContext, visible_devices};

const PROC_GPUS: &str = "/proc/driver/nvidia/gpus";
const VISIBLE: &str = "CUDA_VISIBLE_DEVICES";

#[derive(Debug, Clone, Copy, Default)]
pub struct CudaDevice;

/// A GPU as the driver's proc entry describes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct ProcGpu {
    model: Option<String>,
    uuid: Option<String>,
}

impl Device for CudaDevice {
    fn info(&self) -> DeviceInfo {
        DeviceInfo::new("cuda", "nvidia", "cuda", "nccl").visible_devices_env([VISIBLE])
    }

    fn detect(&self, probe: &ProbeContext) -> Result<Detection, PluginError> {
        let (gpus, source) = match proc_gpus(probe) {
            gpus if !gpus.is_empty() => (gpus, PROC_GPUS.to_owned()),
            _ => match dev_nodes(probe) {
                Ok(n) => (
                    vec![ProcGpu::default(); n],
                    "/dev/nvidia* device nodes".to_owned(),
                ),
                Err(reason) => return Ok(Detection::unavailable(reason)),
            },
        };
        let filter = probe.var(VISIBLE);
        let visible = visible_devices(
            gpus.len() as u32,
            filter.map(|v| uuids_to_indices(v, &gpus)).as_deref(),
        );
        let mut reason = format!("{} NVIDIA GPU(s) in {source}", gpus.len());
        if let Some(value) = filter {
            reason.push_str(&format!(
                ", {} visible with {VISIBLE}={value}",
                visible.len()
            ));
        }
        let mut detection = Detection::available(visible.len() as u32, reason);
        detection.device_names = visible
            .iter()
            .map(|&i| {
                gpus[i as usize]
                    .model
                    .clone()
                    .unwrap_or_else(|| "NVIDIA GPU".to_owned())
            })
            .collect();
        Ok(detection)
    }
}

/// GPUs listed by the driver, in PCI bus order. CUDA numbers devices fastest-first unless
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID`; on the usual machine of identical GPUs both orders agree, so
/// names are matched to CUDA indices in bus order. GPUs the driver excludes are not usable.
fn proc_gpus(probe: &ProbeContext) -> Vec<ProcGpu> {
    let mut buses = probe.list_dir(PROC_GPUS);
    buses.sort(); // fixed-width hex PCI addresses: string order is bus order
    buses
        .iter()
        .filter_map(|bus| {
            let text = probe
                .read_trimmed(&format!("{PROC_GPUS}/{bus}/information"))
                .unwrap_or_default();
            let field = |key: &str| {
                text.lines().find_map(|line| {
                    let (k, v) = line.split_once(':')?;
                    (k.trim() == key && !v.trim().is_empty()).then(|| v.trim().to_owned())
                })
            };
            let excluded = field("GPU Excluded").is_some_and(|v| v.eq_ignore_ascii_case("yes"));
            (!excluded).then(|| ProcGpu {
                model: field("Model"),
                uuid: field("GPU UUID"),
            })
        })
        .collect()
}

/// Number of `/dev/nvidiaN` nodes, provided `/dev/nvidiactl` is there too (without it no CUDA
/// context can be created); otherwise why not.
fn dev_nodes(probe: &ProbeContext) -> Result<usize, String> {
    let count = probe
        .list_dir("/dev")
        .iter()
        .filter_map(|name| name.strip_prefix("nvidia"))
        .filter(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .count();
    match (count, probe.exists("/dev/nvidiactl")) {
        (0, _) => Err(format!(
            "no NVIDIA GPU: {PROC_GPUS} is empty or missing and there is no /dev/nvidiaN"
        )),
        (n, false) => Err(format!(
            "{n} /dev/nvidiaN node(s) but no /dev/nvidiactl (in a container, run with the NVIDIA runtime)"
        )),
        (n, true) => Ok(n),
    }
}

/// Rewrites `GPU-<uuid>` entries (CUDA accepts any unique prefix) to indices when the driver
/// told us the UUIDs; other entries pass through for [`visible_devices`] to judge.
fn uuids_to_indices(value: &str, gpus: &[ProcGpu]) -> String {
    value
        .split(',')
        .map(|token| {
            let token = token.trim();
            if !token.starts_with("GPU-") {
                return token.to_owned();
            }
            let mut matches = gpus
                .iter()
                .enumerate()
                .filter(|(_, g)| g.uuid.as_deref().is_some_and(|u| u.starts_with(token)));
            match (matches.next(), matches.next()) {
                (Some((i, _)), None) => i.to_string(),
                // Unknown or ambiguous: an invalid entry, which ends the list as CUDA does.
                _ if gpus.iter().any(|g| g.uuid.is_some()) => "invalid".to_owned(),
                _ => token.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Root(tempfile::TempDir);

    impl Root {
        fn new() -> Self {
            Self(tempfile::tempdir().unwrap())
        }
        fn file(self, path: &str, contents: &str) -> Self {
            let full = self.0.path().join(path.trim_start_matches('/'));
            std::fs::create_dir_all(full.parent().unwrap()).unwrap();
            std::fs::write(full, contents).unwrap();
            self
        }
        /// A GPU on `bus` as the driver's proc entry shows it.
        fn gpu(self, bus: &str, model: &str, uuid: &str) -> Self {
            let info = format!(
                "Model: \t\t {model}\nIRQ:   \t\t 150\nGPU UUID: \t {uuid}\nVideo BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\nBus Location: \t {bus}\nDevice Minor: \t 0\nGPU Excluded:\t No\n"
            );
            self.file(&format!("{PROC_GPUS}/{bus}/information"), &info)
        }
        fn detect(&self, env: &[(&str, &str)]) -> Detection {
            let probe = ProbeContext::new(
                self.0.path().to_string_lossy(),
                env.iter().map(|&(k, v)| (k, v)),
            );
            CudaDevice.detect(&probe).unwrap()
        }
    }

    fn names(d: &Detection) -> Vec<&str> {
        d.device_names.iter().map(|n| n.as_str()).collect()
    }

    fn eight_mixed() -> Root {
        let mut root = Root::new().file("/dev/nvidiactl", "");
        // Created out of order and with gaps in the bus numbers, as on real boards.
        for (i, bus) in [
            "0000:db:00.0",
            "0000:18:00.0",
            "0000:2a:00.0",
            "0000:3a:00.0",
            "0000:5d:00.0",
            "0000:9a:00.0",
            "0000:ab:00.0",
            "0000:ba:00.0",
        ]
        .iter()
        .enumerate()
        {
            let model = if *bus == "0000:db:00.0" {
                "NVIDIA L4"
            } else {
                "NVIDIA H100 80GB HBM3"
            };
            root = root.gpu(
                bus,
                model,
                &format!("GPU-{i}aaaaaaa-0000-1111-2222-333344445555"),
            );
        }
        root
    }

    #[test]
    fn counts_proc_entries_with_model_names_in_bus_order() {
        let d = eight_mixed().detect(&[]);
        assert!(d.available && d.count == 8, "{d:?}");
        assert_eq!(names(&d)[7], "NVIDIA L4", "bus 0xdb sorts last");
        assert!(
            d.reason
                .contains("8 NVIDIA GPU(s) in /proc/driver/nvidia/gpus"),
            "{}",
            d.reason
        );
    }

    #[test]
    fn visible_devices_by_index_and_uuid() {
        let root = eight_mixed();
        let d = root.detect(&[(VISIBLE, "7,0")]);
        assert_eq!(names(&d), ["NVIDIA L4", "NVIDIA H100 80GB HBM3"]);
        assert!(
            d.reason.contains("2 visible with CUDA_VISIBLE_DEVICES=7,0"),
            "{}",
            d.reason
        );
        // UUID prefixes: GPU-0… is on bus 0xdb (index 7), GPU-1… on bus 0x18 (index 0).
        let d = root.detect(&[(VISIBLE, "GPU-0aaa,GPU-1aaaaaaa-0000")]);
        assert_eq!(names(&d), ["NVIDIA L4", "NVIDIA H100 80GB HBM3"]);
        assert_eq!(
            root.detect(&[(VISIBLE, "GPU-ffff,0")]).count,
            0,
            "an unknown UUID ends the list"
        );
        assert_eq!(
            root.detect(&[(VISIBLE, "GPU-")]).count,
            0,
            "an ambiguous prefix ends the list"
        );
        let hidden = root.detect(&[(VISIBLE, "")]);
        assert!(!hidden.available && hidden.count == 0);
        assert_eq!(root.detect(&[(VISIBLE, "-1")]).count, 0);
    }

    #[test]
    fn excluded_gpus_and_missing_fields() {
        let root = Root::new()
            .gpu("0000:01:00.0", "NVIDIA A100-SXM4-80GB", "GPU-a")
            .file(
                &format!("{PROC_GPUS}/0000:02:00.0/information"),
                "GPU Excluded:\t Yes\nModel: \t X\n",
            )
            .file(&format!("{PROC_GPUS}/0000:03:00.0/information"), "IRQ: 1\n");
        let d = root.detect(&[]);
        assert_eq!(names(&d), ["NVIDIA A100-SXM4-80GB", "NVIDIA GPU"]);
    }

    #[test]
    fn falls_back_to_device_nodes() {
        let root = Root::new()
            .file("/dev/nvidia0", "")
            .file("/dev/nvidia1", "")
            .file("/dev/nvidiactl", "")
            .file("/dev/nvidia-uvm", "")
            .file("/dev/nvidia-caps/x", "");
        let d = root.detect(&[]);
        assert_eq!(d.count, 2);
        assert_eq!(names(&d), ["NVIDIA GPU", "NVIDIA GPU"]);
        assert!(
            d.reason.contains("/dev/nvidia* device nodes"),
            "{}",
            d.reason
        );
        assert_eq!(root.detect(&[(VISIBLE, "1")]).count, 1);
        // UUIDs cannot be mapped without the driver's proc entries: plugin-api's rule applies.
        assert_eq!(root.detect(&[(VISIBLE, "GPU-x")]).count, 1);

        let no_ctl = Root::new().file("/dev/nvidia0", "").detect(&[]);
        assert!(
            !no_ctl.available && no_ctl.reason.contains("no /dev/nvidiactl"),
            "{}",
            no_ctl.reason
        );
    }

    #[test]
    fn no_hardware() {
        let d = Root::new()
            .file("/dev/nvidiactl", "")
            .file("/proc/driver/nvidia/version", "NVRM")
            .detect(&[]);
        assert!(!d.available && d.count == 0);
        assert!(d.reason.contains("no NVIDIA GPU"), "{}", d.reason);
    }

    #[test]
    fn info_is_nvidia_nccl() {
        let info = CudaDevice.info();
        assert_eq!(
            (
                info.vendor.as_str(),
                info.device_type.as_str(),
                info.comm_backend.as_str()
            ),
            ("nvidia", "cuda", "nccl")
        );
        assert_eq!(info.visible_devices_env.as_slice(), [VISIBLE]);
    }
}
