//! Fake probe roots and environments: a directory tree that looks like the parts of `/sys`, `/proc`
//! and `/dev` a device plugin reads, plus the environment it sees, handed to detection as a
//! [`ProbeContext`].

use std::fmt;
use std::path::{Component, Path, PathBuf};

use tempfile::TempDir;
use verl_plugin_api::ProbeContext;

/// The environment a detection sees. Nothing is inherited from the test process: a variable is set
/// only if the test sets it, so results never depend on the machine running the tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeEnv {
    vars: Vec<(String, String)>,
}

impl FakeEnv {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` (replacing an earlier value). An empty value counts as set, as in a real
    /// environment (`CUDA_VISIBLE_DEVICES=` hides every GPU).
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        let key = key.into();
        self.vars.retain(|(k, _)| *k != key);
        self.vars.push((key, value.into()));
        self
    }

    pub fn unset(mut self, key: &str) -> Self {
        self.vars.retain(|(k, _)| k != key);
        self
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.vars
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn vars(&self) -> &[(String, String)] {
        &self.vars
    }

    /// A probe context on `root` with these variables.
    pub fn probe(&self, root: impl AsRef<Path>) -> ProbeContext {
        ProbeContext::new(root.as_ref().to_string_lossy(), self.vars.iter().cloned())
    }
}

/// One GPU node of the AMD KFD topology (`/sys/class/kfd/kfd/topology/nodes/N`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KfdGpu {
    /// Contents of the node's `name` file; `None` leaves the file out. Kernels write the ASIC name
    /// there ("aldebaran"), or "ip discovery" for ASICs enumerated by IP discovery (MI300 and newer).
    pub name: Option<String>,
    /// `gfx_target_version` property: major*10000 + minor*100 + stepping (90402 = gfx942).
    pub gfx_target_version: u32,
    pub vendor_id: u32,
    pub device_id: u32,
    pub simd_count: u32,
}

impl KfdGpu {
    /// An Instinct MI300X as the kernel reports it (304 CUs x 4 SIMDs).
    pub fn mi300x() -> Self {
        Self {
            name: Some("ip discovery".into()),
            gfx_target_version: 90402,
            vendor_id: 0x1002,
            device_id: 0x74a1,
            simd_count: 1216,
        }
    }

    /// An Instinct MI250X GCD (kernels before IP discovery name it by ASIC).
    pub fn mi250x() -> Self {
        Self {
            name: Some("aldebaran".into()),
            gfx_target_version: 90010,
            vendor_id: 0x1002,
            device_id: 0x740c,
            simd_count: 440,
        }
    }
}

/// One Intel GPU under `/sys/class/drm/cardN`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntelGpu {
    /// PCI address; Intel integrated GPUs always sit at `0000:00:02.0`.
    pub pci_slot: String,
    pub device_id: u16,
    /// Bound kernel driver ("i915", "xe"); `None` = no driver bound (no `DRIVER=` in uevent).
    pub driver: Option<String>,
    /// Whether the DRM device has a render node (`device/drm/renderD*`).
    pub render_node: bool,
}

impl IntelGpu {
    /// The integrated Arc GPU of a Core Ultra (Meteor Lake) laptop.
    pub fn integrated() -> Self {
        Self {
            pci_slot: "0000:00:02.0".into(),
            device_id: 0x7d55,
            driver: Some("i915".into()),
            render_node: true,
        }
    }

    /// A discrete Data Center GPU Max 1100 on `bus`, driven by `xe`.
    pub fn discrete(bus: u8) -> Self {
        Self {
            pci_slot: format!("0000:{bus:02x}:00.0"),
            device_id: 0x0bda,
            driver: Some("xe".into()),
            render_node: true,
        }
    }
}

/// A temporary directory laid out like a machine's `/sys`, `/proc` and `/dev`, plus a [`FakeEnv`].
/// Paths are written as absolute paths of the machine being faked (`"/dev/kfd"`) and land under
/// the temporary root. The directory is removed on drop.
///
/// ```
/// use verl_testkit::FakeRoot;
/// let root = FakeRoot::new().rocm_gpus(2).env("HIP_VISIBLE_DEVICES", "1");
/// let probe = root.probe();
/// assert!(probe.exists("/dev/kfd"));
/// assert_eq!(probe.var("HIP_VISIBLE_DEVICES"), Some("1"));
/// ```
pub struct FakeRoot {
    dir: TempDir,
    env: FakeEnv,
}

impl fmt::Debug for FakeRoot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeRoot")
            .field("path", &self.dir.path())
            .field("env", &self.env)
            .finish()
    }
}

impl Default for FakeRoot {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeRoot {
    /// An empty root: a machine with no accelerators, no `/proc` and no `/sys`.
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("verl-fake-root-")
            .tempdir()
            .expect("create a temporary directory");
        Self {
            dir,
            env: FakeEnv::new(),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Where `absolute` of the faked machine lives on disk. Panics on `..`, so a fixture can never
    /// write outside its root.
    pub fn host_path(&self, absolute: &str) -> PathBuf {
        let relative = Path::new(absolute.trim_start_matches('/'));
        assert!(
            relative
                .components()
                .all(|c| matches!(c, Component::Normal(_))),
            "fake root paths must be plain absolute paths, got `{absolute}`"
        );
        self.dir.path().join(relative)
    }

    /// Writes a file, creating its parent directories.
    pub fn file(self, absolute: &str, contents: impl AsRef<[u8]>) -> Self {
        let path = self.host_path(absolute);
        std::fs::create_dir_all(path.parent().expect("a file path has a parent"))
            .expect("create parent directories");
        std::fs::write(&path, contents).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        self
    }

    /// Creates a directory (and its parents).
    pub fn dir(self, absolute: &str) -> Self {
        let path = self.host_path(absolute);
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        self
    }

    /// Removes a file or directory a layout created, to fake a machine that lacks it.
    pub fn remove(self, absolute: &str) -> Self {
        let path = self.host_path(absolute);
        let result = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        result.unwrap_or_else(|e| panic!("remove {}: {e}", path.display()));
        self
    }

    /// Sets a variable of the environment [`probe`](Self::probe) hands to detection.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env = self.env.set(key, value);
        self
    }

    /// Replaces the whole environment.
    pub fn with_env(mut self, env: FakeEnv) -> Self {
        self.env = env;
        self
    }

    pub fn fake_env(&self) -> &FakeEnv {
        &self.env
    }

    /// The probe context detection receives: this root and this root's environment.
    pub fn probe(&self) -> ProbeContext {
        self.env.probe(self.path())
    }

    /// The same root seen with another environment (one layout, many visible-devices cases).
    pub fn probe_with(&self, env: &FakeEnv) -> ProbeContext {
        env.probe(self.path())
    }

    // ----- ready-made layouts -----

    /// `/sys/devices/system/cpu/online` (kernel range syntax, e.g. "0-15" or "0-3,8-11") and a
    /// `/proc/cpuinfo` with one processor entry per online CPU.
    pub fn cpus(self, online: &str, vendor_id: &str, model_name: &str) -> Self {
        let mut cpuinfo = String::new();
        for cpu in expand_ranges(online) {
            cpuinfo.push_str(&format!(
                "processor\t: {cpu}\nvendor_id\t: {vendor_id}\ncpu family\t: 25\nmodel name\t: {model_name}\nflags\t\t: fpu sse2 avx2\n\n"
            ));
        }
        self.file("/sys/devices/system/cpu/online", format!("{online}\n"))
            .file("/proc/cpuinfo", cpuinfo)
    }

    /// `n` NVIDIA GPUs as the proprietary/open kernel driver shows them: one
    /// `/proc/driver/nvidia/gpus/<pci address>/information` per GPU, `/dev/nvidiaN` and
    /// `/dev/nvidiactl`.
    pub fn nvidia_gpus(mut self, n: u32, model: &str) -> Self {
        self = self
            .file(
                "/proc/driver/nvidia/version",
                "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05\n",
            )
            .file("/dev/nvidiactl", "");
        for i in 0..n {
            let bus = format!("0000:{:02x}:00.0", 0x18 + 0x10 * i);
            let info = format!(
                "Model: \t\t {model}\nIRQ:   \t\t {irq}\nGPU UUID: \t GPU-{i:08x}-1111-2222-3333-444455556666\nVideo BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t {bus}\nDevice Minor: \t {i}\nGPU Firmware: \t 580.95.05\nGPU Excluded:\t No\n",
                irq = 200 + i
            );
            self = self
                .file(&format!("/proc/driver/nvidia/gpus/{bus}/information"), info)
                .file(&format!("/dev/nvidia{i}"), "");
        }
        self
    }

    /// A KFD CPU node (`simd_count 0`, `gpu_id 0`) at `/sys/class/kfd/kfd/topology/nodes/<node>`.
    pub fn kfd_cpu_node(self, node: u32) -> Self {
        let dir = format!("/sys/class/kfd/kfd/topology/nodes/{node}");
        let properties = "cpu_cores_count 64\nsimd_count 0\nmem_banks_count 1\ncaches_count 0\nio_links_count 4\n\
            cpu_core_id_base 0\nsimd_id_base 0\nmax_waves_per_simd 0\nlds_size_in_kb 0\ngds_size_in_kb 0\n\
            wave_front_size 0\narray_count 0\ngfx_target_version 0\nvendor_id 0\ndevice_id 0\nlocation_id 0\n\
            domain 0\ndrm_render_minor 0\nmax_engine_clk_ccompute 3700\n";
        self.file(&format!("{dir}/gpu_id"), "0\n")
            .file(&format!("{dir}/name"), "\n")
            .file(&format!("{dir}/properties"), properties)
    }

    /// A KFD GPU node at `/sys/class/kfd/kfd/topology/nodes/<node>`, with its render node.
    pub fn kfd_gpu_node(mut self, node: u32, gpu: &KfdGpu) -> Self {
        let dir = format!("/sys/class/kfd/kfd/topology/nodes/{node}");
        let render_minor = 128 + node;
        let properties = format!(
            "cpu_cores_count 0\nsimd_count {simd}\nmem_banks_count 1\ncaches_count 200\nio_links_count 1\n\
             cpu_core_id_base 0\nsimd_id_base 2147487744\nmax_waves_per_simd 8\nlds_size_in_kb 64\ngds_size_in_kb 0\n\
             num_gws 64\nwave_front_size 64\narray_count 32\nsimd_arrays_per_engine 1\ncu_per_simd_array 10\n\
             simd_per_cu 4\nmax_slots_scratch_cu 32\ngfx_target_version {gfx}\nvendor_id {vendor}\ndevice_id {device}\n\
             location_id {location}\ndomain 0\ndrm_render_minor {render_minor}\nhive_id 0\nnum_sdma_engines 2\n\
             num_sdma_xgmi_engines 6\nnum_sdma_queues_per_engine 8\nnum_cp_queues 32\nmax_engine_clk_fcompute 2100\n\
             local_mem_size 0\nfw_version 177\ncapability 746586752\nmax_engine_clk_ccompute 3700\n",
            simd = gpu.simd_count,
            gfx = gpu.gfx_target_version,
            vendor = gpu.vendor_id,
            device = gpu.device_id,
            location = 256 * (node + 1),
        );
        self = self
            .file(&format!("{dir}/gpu_id"), format!("{}\n", 40000 + node))
            .file(&format!("{dir}/properties"), properties)
            .file(&format!("/dev/dri/renderD{render_minor}"), "");
        if let Some(name) = &gpu.name {
            self = self.file(&format!("{dir}/name"), format!("{name}\n"));
        }
        self
    }

    /// `/dev/kfd` plus a KFD topology of one CPU node (node 0) and `n` MI300X GPU nodes (1..=n),
    /// as on a single-socket ROCm server.
    pub fn rocm_gpus(mut self, n: u32) -> Self {
        self = self
            .file("/dev/kfd", "")
            .file("/sys/class/kfd/kfd/topology/generation_id", "1\n")
            .file(
                "/sys/class/kfd/kfd/topology/system_properties",
                "platform_oem 0\nplatform_id 0\nplatform_rev 0\n",
            )
            .kfd_cpu_node(0);
        for node in 1..=n {
            self = self.kfd_gpu_node(node, &KfdGpu::mi300x());
        }
        self
    }

    /// `n` Ascend NPUs: `/dev/davinci0..n-1` with the driver's control devices
    /// (`davinci_manager`, `devmm_svm`, `hisi_hdc`) and the driver at `/usr/local/Ascend/driver`.
    pub fn ascend_npus(mut self, n: u32) -> Self {
        self = self
            .file("/dev/davinci_manager", "")
            .file("/dev/devmm_svm", "")
            .file("/dev/hisi_hdc", "")
            .file(
                "/usr/local/Ascend/driver/version.info",
                "Version=24.1.rc3\nascendhal_version=7.35.23\naicpu_version=1.0\ntdt_version=1.0\nlog_version=1.0\n\
                 prof_version=2.0\ndvppkernels_version=1.1\ntsfw_version=1.0\nInnerversion=V100R001C19SPC003B220\n\
                 compatible_version=[V100R001C15],[V100R001C17],[V100R001C18],[V100R001C19]\n\
                 compatible_version_fw=[7.0.0,7.5.99]\npackage_version=24.1.rc3\n",
            )
            .dir("/usr/local/Ascend/driver/lib64/driver");
        for i in 0..n {
            self = self.file(&format!("/dev/davinci{i}"), "");
        }
        self
    }

    /// One Intel GPU at `/sys/class/drm/card<card>` (PCI `vendor`, `device`, `uevent`, the render
    /// node) plus a display connector entry (`card<card>-DP-1`) that detection must skip.
    pub fn intel_gpu(mut self, card: u32, gpu: &IntelGpu) -> Self {
        let dir = format!("/sys/class/drm/card{card}");
        let mut uevent = String::new();
        if let Some(driver) = &gpu.driver {
            uevent.push_str(&format!("DRIVER={driver}\n"));
        }
        uevent.push_str(&format!(
            "PCI_CLASS=30000\nPCI_ID=8086:{id:04X}\nPCI_SUBSYS_ID=8086:1020\nPCI_SLOT_NAME={slot}\nMODALIAS=pci:v00008086d0000{id:04X}sv00008086sd00001020bc03sc00i00\n",
            id = gpu.device_id,
            slot = gpu.pci_slot
        ));
        self = self
            .file(&format!("{dir}/device/vendor"), "0x8086\n")
            .file(
                &format!("{dir}/device/device"),
                format!("0x{:04x}\n", gpu.device_id),
            )
            .file(&format!("{dir}/device/uevent"), uevent)
            .file(&format!("{dir}/dev"), format!("226:{card}\n"))
            .dir(&format!("/sys/class/drm/card{card}-DP-1"));
        if gpu.render_node {
            let minor = 128 + card;
            self = self
                .dir(&format!("{dir}/device/drm/renderD{minor}"))
                .dir(&format!("/sys/class/drm/renderD{minor}"));
        }
        self
    }

    /// `discrete` Intel data-center GPUs (cards 1..) and, if `integrated`, the integrated GPU as
    /// card 0 — the layout of the out-of-tree example plugin's family.
    pub fn intel_gpus(mut self, discrete: u32, integrated: bool) -> Self {
        if integrated {
            self = self.intel_gpu(0, &IntelGpu::integrated());
        }
        for k in 0..discrete {
            self = self.intel_gpu(k + 1, &IntelGpu::discrete(0x29 + 0x10 * k as u8));
        }
        self
    }
}

/// "0-3,8,10-11" → [0, 1, 2, 3, 8, 10, 11]; malformed parts are skipped.
fn expand_ranges(list: &str) -> Vec<u32> {
    list.trim()
        .split(',')
        .filter_map(|part| {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            Some(a.trim().parse::<u32>().ok()?..=b.trim().parse::<u32>().ok()?)
        })
        .flatten()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_land_under_the_root_and_env_is_not_inherited() {
        let root = FakeRoot::new()
            .file("/a/b/c.txt", " hello \n")
            .dir("/empty")
            .env("X", "1");
        let probe = root.probe();
        assert_eq!(probe.read_trimmed("/a/b/c.txt").as_deref(), Some("hello"));
        assert!(probe.exists("/empty"));
        assert_eq!(probe.var("X"), Some("1"));
        assert_eq!(
            probe.var("PATH"),
            None,
            "the test process's environment must not leak in"
        );
        let other = root.probe_with(&FakeEnv::new().set("Y", "").set("Y", "2").unset("X"));
        assert_eq!((other.var("X"), other.var("Y")), (None, Some("2")));
    }

    #[test]
    #[should_panic(expected = "plain absolute paths")]
    fn parent_components_are_refused() {
        let _ = FakeRoot::new().file("/dev/../../escape", "");
    }

    #[test]
    fn layouts_remove_and_drop() {
        let root = FakeRoot::new()
            .rocm_gpus(2)
            .ascend_npus(1)
            .remove("/dev/davinci_manager");
        let probe = root.probe();
        assert_eq!(
            probe.list_dir("/sys/class/kfd/kfd/topology/nodes"),
            vec!["0", "1", "2"]
        );
        assert!(probe.exists("/dev/davinci0") && !probe.exists("/dev/davinci_manager"));
        let path = root.path().to_owned();
        drop(root);
        assert!(!path.exists());
    }

    #[test]
    fn ranges_expand() {
        assert_eq!(expand_ranges("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(expand_ranges("0"), vec![0]);
        assert_eq!(expand_ranges("x,2"), vec![2]);
    }
}
