//! # verl-plugin-rocm
//!
//! Device plugin for AMD GPUs under ROCm. ROCm builds of PyTorch expose AMD GPUs as `cuda` devices
//! and RCCL behind the `nccl` backend name, so the platform computes on device type "cuda".
//!
//! Detection reads the KFD topology the amdgpu kernel driver publishes — no ROCm user-space tools:
//! `/dev/kfd` must exist (the compute interface; containers need `--device /dev/kfd`), and every
//! `/sys/class/kfd/kfd/topology/nodes/N/properties` with `simd_count > 0` and `vendor_id 4098`
//! (0x1002) is a GPU; CPU nodes report `simd_count 0`. The HIP runtime numbers GPUs in node order,
//! so the k-th GPU node is HIP device k before any visible-devices filter.

use std::collections::HashMap;

use verl_plugin_api::{
    Detection, Device, DeviceInfo, EnvVar, PluginBuilder, PluginError, ProbeContext,
    visible_devices,
};

pub const NAME: &str = "rocm";
/// Below CUDA (100): a machine with both vendors' drivers defaults to NVIDIA, as in verl.
pub const PRIORITY: i32 = 90;

const TOPOLOGY_NODES: &str = "/sys/class/kfd/kfd/topology/nodes";
const AMD_VENDOR_ID: u64 = 0x1002;
const ROCR: &str = "ROCR_VISIBLE_DEVICES";
const HIP: &str = "HIP_VISIBLE_DEVICES";
const CUDA: &str = "CUDA_VISIBLE_DEVICES";

verl_plugin_api::export_plugin!(
    PluginBuilder::new(
        "rocm",
        env!("CARGO_PKG_VERSION"),
        "AMD GPUs through ROCm (HIP as CUDA, RCCL as nccl)"
    )
    .device(
        NAME,
        PRIORITY,
        "AMD Instinct / Radeon GPUs found in the KFD topology",
        || RocmDevice
    )
);

#[derive(Debug, Clone, Copy, Default)]
pub struct RocmDevice;

/// One GPU node of the KFD topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuNode {
    /// The node's directory name under the topology (not necessarily contiguous with others).
    pub node: String,
    /// What to call the GPU: ASIC name and/or gfx target, else the PCI device id.
    pub display_name: String,
}

impl Device for RocmDevice {
    fn info(&self) -> DeviceInfo {
        DeviceInfo::new(NAME, "amd", "cuda", "nccl").visible_devices_env([HIP, ROCR, CUDA])
    }

    fn detect(&self, probe: &ProbeContext) -> Result<Detection, PluginError> {
        // Configuration errors first: they are the user's to fix whether or not GPUs are present.
        let filters = VisibleFilters::from_probe(probe)?;
        let gpus = gpu_nodes(probe);
        if gpus.is_empty() {
            let reason = if probe.exists(TOPOLOGY_NODES) {
                format!(
                    "no AMD GPU node in {TOPOLOGY_NODES} (only CPU nodes, or properties unreadable)"
                )
            } else {
                format!("no KFD topology at {TOPOLOGY_NODES} (amdgpu driver not loaded)")
            };
            return Ok(Detection::unavailable(reason));
        }
        if !probe.exists("/dev/kfd") {
            return Ok(Detection::unavailable(format!(
                "{} AMD GPU node(s) in the KFD topology but /dev/kfd is missing (in a container, pass --device /dev/kfd)",
                gpus.len()
            )));
        }

        let physical = gpus.len() as u32;
        let visible = filters.apply(physical);
        let mut detection = Detection::available(
            visible.len() as u32,
            filters.describe(physical, visible.len()),
        );
        detection.device_names = visible
            .iter()
            .map(|&i| gpus[i as usize].display_name.as_str().into())
            .collect();
        if let Some(hip) = &filters.hip {
            // CUDA-compatible libraries (and code written for CUDA) read CUDA_VISIBLE_DEVICES only.
            detection.env_updates.push(EnvVar::new(CUDA, hip.as_str()));
        }
        Ok(detection)
    }
}

/// The visible-devices variables that apply, after checking verl's rules.
#[derive(Debug, Default)]
struct VisibleFilters {
    rocr: Option<String>,
    hip: Option<String>,
    cuda: Option<String>,
}

impl VisibleFilters {
    fn from_probe(probe: &ProbeContext) -> Result<Self, PluginError> {
        let get = |key: &str| probe.var(key).map(str::to_owned);
        let filters = Self {
            rocr: get(ROCR),
            hip: get(HIP),
            cuda: get(CUDA),
        };
        // ROCR filters first and HIP/CUDA then index into what is left; verl refuses ROCR with
        // CUDA rather than guess which numbering the user meant. A CUDA value equal to HIP's is
        // HIP's alias — what this plugin's own translation sets — so re-detecting in a process
        // that applied `env_updates` gives the same answer instead of an error.
        if filters.rocr.is_some() && filters.cuda.is_some() && filters.hip.is_none() {
            return Err(PluginError::invalid_config(format!(
                "both {ROCR} ({}) and {CUDA} ({}) are set: they number GPUs differently (ROCR filters first, CUDA indexes what is left); unset one of them",
                filters.rocr.as_deref().unwrap_or_default(),
                filters.cuda.as_deref().unwrap_or_default()
            )));
        }
        if let (Some(hip), Some(cuda)) = (&filters.hip, &filters.cuda)
            && hip != cuda
        {
            return Err(PluginError::invalid_config(format!(
                "{HIP} ({hip}) and {CUDA} ({cuda}) disagree; set only {HIP}, or both to the same value"
            )));
        }
        Ok(filters)
    }

    /// Physical GPU indices left visible, in HIP order.
    fn apply(&self, physical: u32) -> Vec<u32> {
        let after_rocr = visible_devices(physical, self.rocr.as_deref());
        let hip_or_cuda = self.hip.as_deref().or(self.cuda.as_deref());
        visible_devices(after_rocr.len() as u32, hip_or_cuda)
            .into_iter()
            .map(|i| after_rocr[i as usize])
            .collect()
    }

    fn describe(&self, physical: u32, visible: usize) -> String {
        let mut reason = format!("{physical} AMD GPU node(s) in the KFD topology");
        let applied: Vec<String> = [(ROCR, &self.rocr), (HIP, &self.hip), (CUDA, &self.cuda)]
            .into_iter()
            .filter_map(|(key, value)| value.as_ref().map(|v| format!("{key}={v}")))
            .collect();
        if !applied.is_empty() {
            reason.push_str(&format!(", {visible} visible with {}", applied.join(" ")));
        }
        reason
    }
}

/// The GPU nodes of the KFD topology in HIP order. Nodes whose properties cannot be read are
/// skipped: a device cgroup denies reading the properties of GPUs the container may not use.
pub fn gpu_nodes(probe: &ProbeContext) -> Vec<GpuNode> {
    let mut nodes: Vec<(u64, String)> = probe
        .list_dir(TOPOLOGY_NODES)
        .into_iter()
        .filter_map(|name| Some((name.parse::<u64>().ok()?, name)))
        .collect();
    // list_dir sorts naturally already; sort by number anyway so the order never depends on it.
    nodes.sort();
    nodes
        .into_iter()
        .filter_map(|(_, node)| {
            let dir = format!("{TOPOLOGY_NODES}/{node}");
            let text = probe.read_trimmed(&format!("{dir}/properties"))?;
            let props = parse_properties(&text);
            let is_amd_gpu = props.get("simd_count").is_some_and(|&n| n > 0)
                && props.get("vendor_id") == Some(&AMD_VENDOR_ID);
            is_amd_gpu.then(|| GpuNode {
                display_name: display_name(probe.read_trimmed(&format!("{dir}/name")), &props),
                node,
            })
        })
        .collect()
}

/// `key value` lines → map; lines that do not parse as an unsigned number are ignored.
fn parse_properties(text: &str) -> HashMap<&str, u64> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            Some((parts.next()?, parts.next()?.parse().ok()?))
        })
        .collect()
}

/// "gfx942" from gfx_target_version 90402 (major*10000 + minor*100 + stepping; minor and stepping
/// print in hex, so 90010 is gfx90a). `None` for 0, which CPU nodes and very old kernels report.
pub fn gfx_target(version: u64) -> Option<String> {
    (version > 0).then(|| {
        format!(
            "gfx{}{:x}{:x}",
            version / 10000,
            (version / 100) % 100,
            version % 100
        )
    })
}

/// The node's `name` file holds the ASIC name ("aldebaran"), or "ip discovery" on ASICs the
/// kernel enumerates by IP discovery (MI300 and newer), which names nothing — then the gfx target
/// is the most specific honest name.
fn display_name(name_file: Option<String>, props: &HashMap<&str, u64>) -> String {
    let asic = name_file.filter(|n| !n.is_empty() && n != "ip discovery");
    let gfx = props.get("gfx_target_version").and_then(|&v| gfx_target(v));
    match (asic, gfx) {
        (Some(asic), Some(gfx)) => format!("AMD {asic} ({gfx})"),
        (Some(asic), None) => format!("AMD {asic}"),
        (None, Some(gfx)) => format!("AMD GPU {gfx}"),
        (None, None) => format!(
            "AMD GPU [1002:{:04x}]",
            props.get("device_id").copied().unwrap_or_default()
        ),
    }
}

#[cfg(test)]
mod tests {
    use verl_plugin_api::ErrorKind;
    use verl_testkit::{FakeEnv, FakeRoot, KfdGpu};

    use super::*;

    fn detect(probe: &ProbeContext) -> Detection {
        RocmDevice.detect(probe).expect("detection succeeds")
    }

    fn names(d: &Detection) -> Vec<&str> {
        d.device_names.iter().map(|n| n.as_str()).collect()
    }

    #[test]
    fn info_is_cuda_compatible_amd() {
        let info = RocmDevice.info();
        assert_eq!((info.name.as_str(), info.vendor.as_str()), ("rocm", "amd"));
        assert_eq!(
            (info.device_type.as_str(), info.comm_backend.as_str()),
            ("cuda", "nccl")
        );
        let vars: Vec<&str> = info
            .visible_devices_env
            .iter()
            .map(|v| v.as_str())
            .collect();
        assert_eq!(vars, [HIP, ROCR, CUDA]);
    }

    #[test]
    fn counts_gpu_nodes_and_skips_cpu_nodes() {
        for n in [1, 2, 8] {
            let d = detect(&FakeRoot::new().rocm_gpus(n).probe());
            assert!(d.available, "{d:?}");
            assert_eq!(d.count, n);
            assert_eq!(d.device_names.len(), n as usize);
            assert!(
                names(&d).iter().all(|&name| name == "AMD GPU gfx942"),
                "{d:?}"
            );
            assert!(
                d.reason.contains(&format!("{n} AMD GPU node(s)")),
                "{}",
                d.reason
            );
            assert!(d.env_updates.is_empty());
        }
    }

    #[test]
    fn non_contiguous_nodes_and_several_cpu_sockets() {
        // Two CPU sockets (nodes 0 and 1), GPUs on nodes 2, 3 and 10 (numbering need not be dense),
        // node 11 another vendor's accelerator in the topology, node 12 a non-number entry.
        let root = FakeRoot::new()
            .file("/dev/kfd", "")
            .kfd_cpu_node(0)
            .kfd_cpu_node(1)
            .kfd_gpu_node(10, &KfdGpu::mi250x())
            .kfd_gpu_node(2, &KfdGpu::mi300x())
            .kfd_gpu_node(
                3,
                &KfdGpu {
                    name: None,
                    ..KfdGpu::mi250x()
                },
            )
            .kfd_gpu_node(
                11,
                &KfdGpu {
                    vendor_id: 0x10de,
                    ..KfdGpu::mi300x()
                },
            )
            .dir("/sys/class/kfd/kfd/topology/nodes/README");
        let d = detect(&root.probe());
        assert_eq!(d.count, 3);
        // Numeric node order is HIP order: 2, 3, 10.
        assert_eq!(
            names(&d),
            ["AMD GPU gfx942", "AMD GPU gfx90a", "AMD aldebaran (gfx90a)"]
        );

        let nodes: Vec<String> = gpu_nodes(&root.probe())
            .into_iter()
            .map(|n| n.node)
            .collect();
        assert_eq!(nodes, ["2", "3", "10"]);
    }

    #[test]
    fn names_fall_back_to_pci_id_and_unreadable_nodes_are_skipped() {
        let root = FakeRoot::new()
            .file("/dev/kfd", "")
            .kfd_gpu_node(
                1,
                &KfdGpu {
                    name: Some(String::new()),
                    gfx_target_version: 0,
                    ..KfdGpu::mi300x()
                },
            )
            // A node without a properties file (e.g. hidden by the device cgroup) is not counted.
            .dir("/sys/class/kfd/kfd/topology/nodes/2");
        let d = detect(&root.probe());
        assert_eq!((d.count, names(&d)), (1, vec!["AMD GPU [1002:74a1]"]));
    }

    #[test]
    fn visible_devices_filters() {
        let root = FakeRoot::new()
            .file("/dev/kfd", "")
            .kfd_cpu_node(0)
            .kfd_gpu_node(1, &KfdGpu::mi250x())
            .kfd_gpu_node(2, &KfdGpu::mi300x())
            .kfd_gpu_node(
                5,
                &KfdGpu {
                    name: Some("navi31".into()),
                    gfx_target_version: 110000,
                    ..KfdGpu::mi300x()
                },
            )
            .kfd_gpu_node(6, &KfdGpu::mi300x());
        let case = |env: FakeEnv| detect(&root.probe_with(&env));

        let d = case(FakeEnv::new().set(HIP, "2,0"));
        assert_eq!(
            names(&d),
            ["AMD navi31 (gfx1100)", "AMD aldebaran (gfx90a)"]
        );
        assert!(
            d.reason.contains("2 visible with HIP_VISIBLE_DEVICES=2,0"),
            "{}",
            d.reason
        );

        assert_eq!(case(FakeEnv::new().set(CUDA, "3")).count, 1);
        assert_eq!(
            case(FakeEnv::new().set(CUDA, "1,9,2")).count,
            1,
            "a list ends at its first invalid entry"
        );

        // ROCR first, then HIP relative to what ROCR left: ROCR 3,1 → physical [3, 1]; HIP 1 → physical 1.
        let d = case(FakeEnv::new().set(ROCR, "3,1").set(HIP, "1"));
        assert_eq!(names(&d), ["AMD GPU gfx942"]);
        let d = case(FakeEnv::new().set(ROCR, "2"));
        assert_eq!(names(&d), ["AMD navi31 (gfx1100)"]);

        let hidden = case(FakeEnv::new().set(HIP, ""));
        assert!(
            !hidden.available && hidden.count == 0,
            "an empty list hides every GPU: {hidden:?}"
        );
        assert!(hidden.reason.contains("0 visible"), "{}", hidden.reason);
    }

    #[test]
    fn hip_is_translated_for_cuda_libraries() {
        let root = FakeRoot::new().rocm_gpus(4);
        let d = detect(&root.probe_with(&FakeEnv::new().set(HIP, "1,3")));
        assert_eq!(d.count, 2);
        assert_eq!(d.env_updates.as_slice(), [EnvVar::new(CUDA, "1,3")]);
        // Same value in both is consistent, and then nothing new needs setting but the echo is harmless.
        let same = detect(&root.probe_with(&FakeEnv::new().set(HIP, "0").set(CUDA, "0")));
        assert_eq!(same.count, 1);
        // Without HIP_VISIBLE_DEVICES nothing is translated.
        assert!(
            detect(&root.probe_with(&FakeEnv::new().set(CUDA, "0")))
                .env_updates
                .is_empty()
        );
    }

    #[test]
    fn conflicting_variables_are_configuration_errors() {
        let root = FakeRoot::new().rocm_gpus(2);
        let err = RocmDevice
            .detect(&root.probe_with(&FakeEnv::new().set(ROCR, "0").set(CUDA, "1")))
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::INVALID_CONFIG);
        assert!(
            err.message().contains(ROCR) && err.message().contains(CUDA),
            "{err}"
        );

        let err = RocmDevice
            .detect(&root.probe_with(&FakeEnv::new().set(HIP, "0").set(CUDA, "1")))
            .unwrap_err();
        assert!(err.message().contains("disagree"), "{err}");

        // ROCR with HIP composes; applying the HIP→CUDA translation must not turn that into a conflict.
        let env = FakeEnv::new().set(ROCR, "1,0").set(HIP, "1");
        let first = detect(&root.probe_with(&env));
        let mut applied = env.clone();
        for update in first.env_updates.iter() {
            applied = applied.set(update.key.as_str(), update.value.as_str());
        }
        let again = detect(&root.probe_with(&applied));
        assert_eq!(
            (first.count, &first.device_names),
            (again.count, &again.device_names)
        );

        // A configuration error is reported even on a machine without AMD GPUs: the environment is wrong.
        let err = RocmDevice
            .detect(&FakeRoot::new().env(ROCR, "0").env(CUDA, "0").probe())
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::INVALID_CONFIG);
    }

    #[test]
    fn no_hardware_and_partial_setups() {
        let empty = detect(&FakeRoot::new().probe());
        assert!(!empty.available && empty.count == 0);
        assert!(
            empty.reason.contains("amdgpu driver not loaded"),
            "{}",
            empty.reason
        );

        let cpu_only = detect(
            &FakeRoot::new()
                .file("/dev/kfd", "")
                .kfd_cpu_node(0)
                .kfd_cpu_node(1)
                .probe(),
        );
        assert!(!cpu_only.available);
        assert!(
            cpu_only.reason.contains("no AMD GPU node"),
            "{}",
            cpu_only.reason
        );

        let no_kfd = detect(&FakeRoot::new().rocm_gpus(2).remove("/dev/kfd").probe());
        assert!(!no_kfd.available && no_kfd.count == 0);
        assert!(
            no_kfd.reason.contains("/dev/kfd is missing"),
            "{}",
            no_kfd.reason
        );
    }

    #[test]
    fn gfx_targets() {
        assert_eq!(gfx_target(90402).as_deref(), Some("gfx942"));
        assert_eq!(gfx_target(90010).as_deref(), Some("gfx90a"));
        assert_eq!(gfx_target(110000).as_deref(), Some("gfx1100"));
        assert_eq!(gfx_target(100300).as_deref(), Some("gfx1030"));
        assert_eq!(gfx_target(0), None);
    }

    #[test]
    fn exported_manifest_registers_the_device() {
        let manifest = __verl_plugin_manifest().into_result().expect("manifest");
        let root = FakeRoot::new().rocm_gpus(3);
        let detection = verl_testkit::detect_exported_device(manifest, NAME, PRIORITY, &root);
        assert_eq!(detection.count, 3);
    }
}
