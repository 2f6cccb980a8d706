//! Loading a built plugin into the real host and asserting what it registers and detects, and
//! running the host's platform selection over fake roots — what `verl-core plugins check` and
//! `verl-core platform` do, without the CLI.

use std::path::{Path, PathBuf};

use verl_plugin_api::{ComponentKind, Detection, DeviceInfo, PluginError, ProbeContext};
use verl_plugin_host::{
    Component, DEFAULT_DETECT_TIMEOUT, DeviceHandle, DeviceReport, LoadError, PlatformError,
    PlatformReport, PluginRecord, Registry, detect_platform,
};

use crate::FakeRoot;

/// The library cargo built for the crate `lib_name` (its name with underscores, e.g.
/// `"verl_plugin_xpu"`) in the profile of the running test binary: integration tests of a
/// `cdylib` crate run after cargo has built the library itself, into the directory above `deps/`.
pub fn built_plugin(lib_name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("path of the running test binary");
    let file = format!(
        "{}{lib_name}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let candidates: Vec<PathBuf> = exe
        .ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join(&file))
        .collect();
    candidates.iter().find(|p| p.is_file()).cloned().unwrap_or_else(|| {
        panic!(
            "no built plugin `{file}` next to {} (looked at {candidates:?}); is `{lib_name}` a cdylib of this package?",
            exe.display()
        )
    })
}

/// A plugin library loaded into a host registry next to the host's built-in devices, as the CLI
/// would load it (same pre-dlopen checks, same ABI checks).
///
/// ```no_run
/// # use verl_plugin_api::ComponentKind;
/// # use verl_testkit::{FakeRoot, PluginHarness, built_plugin};
/// let plugin = PluginHarness::load(built_plugin("verl_plugin_xpu")).unwrap();
/// plugin.assert_registers(ComponentKind::DEVICE, "xpu", 70);
/// let detection = plugin.detect("xpu", &FakeRoot::new().intel_gpus(2, false).probe()).unwrap();
/// assert_eq!(detection.count, 2);
/// plugin.select_platform(&FakeRoot::new().intel_gpus(1, false)).assert_selected("xpu");
/// ```
pub struct PluginHarness {
    registry: Registry,
    record: usize,
}

impl std::fmt::Debug for PluginHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginHarness")
            .field("plugin", self.record())
            .finish()
    }
}

impl PluginHarness {
    /// Vets and loads `path` into a registry that already holds the built-in `cpu` and `cuda`.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        Self::load_into(Registry::with_builtins(), path.as_ref())
    }

    /// Loads `path` alone, without the built-in devices.
    pub fn load_alone(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        Self::load_into(Registry::default(), path.as_ref())
    }

    fn load_into(mut registry: Registry, path: &Path) -> Result<Self, LoadError> {
        registry.load_file(path, None).status.clone()?;
        let record = registry.plugins().len() - 1;
        Ok(Self { registry, record })
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The plugin's record: name, version, description, components.
    pub fn record(&self) -> &PluginRecord {
        &self.registry.plugins()[self.record]
    }

    pub fn components(&self) -> &[Component] {
        &self.record().components
    }

    /// The plugin's component of `kind` called `name`; panics listing what it does register.
    pub fn component(&self, kind: ComponentKind, name: &str) -> &Component {
        self.components()
            .iter()
            .find(|c| c.kind == kind && c.name == name)
            .unwrap_or_else(|| {
                let have: Vec<String> = self
                    .components()
                    .iter()
                    .map(|c| format!("{} `{}`", c.kind, c.name))
                    .collect();
                panic!(
                    "plugin `{}` registers no {kind} `{name}`; it registers: {}",
                    self.record().name,
                    have.join(", ")
                )
            })
    }

    /// Asserts the plugin registers `kind` `name` with `priority`.
    pub fn assert_registers(&self, kind: ComponentKind, name: &str, priority: i32) -> &Self {
        let component = self.component(kind, name);
        assert_eq!(
            component.priority,
            priority,
            "priority of {kind} `{name}` in plugin `{}`",
            self.record().name
        );
        self
    }

    /// A fresh instance of the plugin's device `name`, through the ABI.
    pub fn device(&self, name: &str) -> DeviceHandle {
        self.component(ComponentKind::DEVICE, name)
            .create_device()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn info(&self, name: &str) -> Result<DeviceInfo, PluginError> {
        self.device(name).info()
    }

    /// Runs the device's detection through the ABI (panics inside the plugin come back as errors).
    pub fn detect(&self, name: &str, probe: &ProbeContext) -> Result<Detection, PluginError> {
        self.device(name).detect(probe)
    }

    /// The host's platform selection over every device in this registry (built-ins included)
    /// with `root` and its environment as the machine.
    pub fn select_platform(&self, root: &FakeRoot) -> Selection {
        select_platform(&self.registry, &root.probe())
    }
}

/// The outcome of platform selection: the report the CLI prints and the chosen platform (or why
/// none could be chosen).
#[derive(Debug)]
pub struct Selection {
    pub report: PlatformReport,
    pub result: Result<String, PlatformError>,
}

/// Runs the host's platform selection over `registry` with `probe`, with the host's default
/// detection time limit.
pub fn select_platform(registry: &Registry, probe: &ProbeContext) -> Selection {
    let (report, result) = detect_platform(registry, probe, DEFAULT_DETECT_TIMEOUT);
    Selection { report, result }
}

/// A registry of the host's built-in devices plus the libraries at `plugins` (each must load).
pub fn registry_with(plugins: &[&Path]) -> Registry {
    let mut registry = Registry::with_builtins();
    for path in plugins {
        if let Err(e) = &registry.load_file(path, None).status {
            panic!("{e}");
        }
    }
    registry
}

impl Selection {
    pub fn selected(&self) -> Option<&str> {
        self.result.as_deref().ok()
    }

    /// Asserts `name` was selected; on failure shows every candidate's detection.
    pub fn assert_selected(&self, name: &str) -> &DeviceReport {
        assert_eq!(
            self.selected(),
            Some(name),
            "selection: {:?}\n{}",
            self.result,
            self.table()
        );
        self.device(name)
    }

    /// The selection error; panics if a platform was selected.
    pub fn error(&self) -> &PlatformError {
        match &self.result {
            Err(e) => e,
            Ok(name) => panic!(
                "expected selection to fail, but `{name}` was selected\n{}",
                self.table()
            ),
        }
    }

    /// The report of device `name`; panics if no such device was probed.
    pub fn device(&self, name: &str) -> &DeviceReport {
        self.report
            .devices
            .iter()
            .find(|d| d.name == name)
            .unwrap_or_else(|| panic!("no device `{name}` in\n{}", self.table()))
    }

    /// One line per candidate, for assertion messages.
    pub fn table(&self) -> String {
        self.report
            .devices
            .iter()
            .map(|d| {
                format!(
                    "  {:<8} prio {:>4}  available={:<5} count={}  {}",
                    d.name, d.priority, d.available, d.count, d.reason
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn file_with(bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.path().join(format!(
            "{}bogus{}",
            std::env::consts::DLL_PREFIX,
            std::env::consts::DLL_SUFFIX
        ));
        std::fs::write(&path, bytes).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        (dir, path)
    }

    #[test]
    fn a_file_that_is_no_plugin_is_rejected_with_its_path() {
        let (_dir, path) = file_with(b"\x7fELF but not really");
        let err = PluginHarness::load(&path).unwrap_err();
        assert_eq!(err.path(), path);
        assert!(matches!(err, LoadError::Open { .. }), "{err}");
    }

    #[test]
    fn a_writable_file_is_refused_before_loading() {
        let (_dir, path) = file_with(b"x");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(matches!(
            PluginHarness::load_alone(&path).unwrap_err(),
            LoadError::Writable { .. }
        ));
    }

    #[test]
    fn selection_over_the_builtins_alone() {
        let registry = registry_with(&[]);
        let cpu = FakeRoot::new().cpus("0-3", "GenuineIntel", "Xeon");
        let selection = select_platform(&registry, &cpu.probe());
        assert_eq!(selection.assert_selected("cpu").count, 4);

        let gpus = FakeRoot::new()
            .nvidia_gpus(2, "NVIDIA H100 80GB HBM3")
            .env("CUDA_VISIBLE_DEVICES", "1");
        let cuda = select_platform(&registry, &gpus.probe());
        assert_eq!(
            cuda.assert_selected("cuda").device_names,
            ["NVIDIA H100 80GB HBM3"]
        );
        assert!(cuda.table().contains("cpu"), "{}", cuda.table());

        let unknown = select_platform(
            &registry,
            &FakeRoot::new().env("VERL_PLATFORM", "Nope").probe(),
        );
        assert!(
            unknown.error().to_string().contains("cpu, cuda"),
            "{}",
            unknown.error()
        );
        assert_eq!(unknown.selected(), None);
    }
}
