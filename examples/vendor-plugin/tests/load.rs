//! The built plugin file loaded into the real host, as `verl-core` loads it: what it registers, its
//! detection through the ABI, and the host's platform selection with it among the built-ins.

use verl_plugin_api::ComponentKind;
use verl_plugin_xpu::{AFFINITY_ENV, NAME, PRIORITY};
use verl_testkit::{FakeRoot, PluginHarness, built_plugin};

fn plugin() -> PluginHarness {
    PluginHarness::load(built_plugin("verl_plugin_xpu")).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn registers_one_device() {
    let plugin = plugin();
    assert_eq!(plugin.record().name, "xpu");
    assert_eq!(plugin.record().version, env!("CARGO_PKG_VERSION"));
    assert_eq!(plugin.components().len(), 1);
    plugin.assert_registers(ComponentKind::DEVICE, NAME, PRIORITY);
    let info = plugin.info(NAME).unwrap();
    assert_eq!((info.vendor.as_str(), info.comm_backend.as_str()), ("intel", "ccl"));
}

#[test]
fn detects_through_the_abi() {
    let plugin = plugin();
    let root = FakeRoot::new().intel_gpus(2, true).env(AFFINITY_ENV, "2");
    let detection = plugin.detect(NAME, &root.probe()).unwrap();
    assert_eq!(detection.count, 1);
    assert_eq!(detection.device_names.len(), 1);
}

#[test]
fn selected_over_cpu_when_a_discrete_gpu_is_there() {
    let plugin = plugin();
    let selection = plugin.select_platform(&FakeRoot::new().cpus("0-7", "GenuineIntel", "Xeon").intel_gpus(2, false));
    let xpu = selection.assert_selected(NAME);
    assert_eq!((xpu.count, xpu.device_type.as_str()), (2, "xpu"));
}

#[test]
fn cpu_fallback_on_an_integrated_only_laptop() {
    let selection = plugin().select_platform(&FakeRoot::new().cpus("0-15", "GenuineIntel", "Core Ultra 7").intel_gpus(0, true));
    selection.assert_selected("cpu");
    assert!(!selection.device(NAME).available);
}

#[test]
fn in_tree_accelerators_outrank_it() {
    let selection = plugin().select_platform(&FakeRoot::new().intel_gpus(1, false).nvidia_gpus(2, "NVIDIA H100 80GB HBM3"));
    selection.assert_selected("cuda");
    assert!(selection.device(NAME).available, "xpu is still detected, just not chosen");
}

#[test]
fn verl_platform_override_is_case_insensitive() {
    let root = FakeRoot::new().intel_gpus(1, false).nvidia_gpus(1, "NVIDIA L4");
    plugin().select_platform(&root.env("VERL_PLATFORM", "XPU")).assert_selected(NAME);

    let unknown = plugin().select_platform(&FakeRoot::new().env("VERL_PLATFORM", "tpu"));
    let message = unknown.error().to_string();
    assert!(message.contains("tpu") && message.contains("xpu") && message.contains("cpu"), "{message}");
}

/// The conformance suite `verl-core plugins certify` runs, from the vendor's own tests: the device
/// is faked as an Intel machine (its declared vendor), so every check runs and passes.
#[test]
fn certifies() {
    use verl_testkit::conformance::{Options, Outcome, certify_file};
    let report = certify_file(&built_plugin("verl_plugin_xpu"), None, &Options::default())
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        report.checks.iter().all(|c| c.outcome == Outcome::Pass),
        "{}",
        report.table()
    );
    assert_eq!(report.checks.len(), 5);
}
