//! The built rocm plugin loaded into the real host: registration, detection through the ABI and
//! platform selection next to the built-in cpu and cuda devices.

use verl_plugin_api::ComponentKind;
use verl_plugin_rocm::{NAME, PRIORITY};
use verl_testkit::{FakeRoot, PluginHarness, built_plugin};

fn plugin() -> PluginHarness {
    PluginHarness::load(built_plugin("verl_plugin_rocm")).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn registers_the_rocm_device() {
    let plugin = plugin();
    assert_eq!(plugin.record().name, "rocm");
    plugin.assert_registers(ComponentKind::DEVICE, NAME, PRIORITY);
    let info = plugin.info(NAME).unwrap();
    assert_eq!(
        (
            info.vendor.as_str(),
            info.device_type.as_str(),
            info.comm_backend.as_str()
        ),
        ("amd", "cuda", "nccl")
    );
}

#[test]
fn selected_on_an_amd_machine_with_the_hip_translation() {
    let root = FakeRoot::new()
        .cpus("0-63", "AuthenticAMD", "AMD EPYC 9654")
        .rocm_gpus(8)
        .env("HIP_VISIBLE_DEVICES", "0,1");
    let selection = plugin().select_platform(&root);
    let rocm = selection.assert_selected(NAME);
    assert_eq!(rocm.count, 2);
    assert_eq!(
        rocm.env_updates,
        [("CUDA_VISIBLE_DEVICES".to_owned(), "0,1".to_owned())]
    );
}

#[test]
fn rocr_and_cuda_visible_devices_together_stop_selection() {
    let root = FakeRoot::new()
        .rocm_gpus(2)
        .env("ROCR_VISIBLE_DEVICES", "0")
        .env("CUDA_VISIBLE_DEVICES", "1");
    let selection = plugin().select_platform(&root);
    let message = selection.error().to_string();
    assert!(
        message.contains("ROCR_VISIBLE_DEVICES") && message.contains("CUDA_VISIBLE_DEVICES"),
        "{message}"
    );
}

#[test]
fn cuda_outranks_rocm_and_the_override_picks_either() {
    let root = FakeRoot::new()
        .rocm_gpus(2)
        .nvidia_gpus(2, "NVIDIA H100 80GB HBM3");
    plugin().select_platform(&root).assert_selected("cuda");
    plugin()
        .select_platform(&root.env("VERL_PLATFORM", "RoCm"))
        .assert_selected(NAME);
}

#[test]
fn cpu_fallback_when_every_gpu_is_hidden_or_absent() {
    plugin()
        .select_platform(&FakeRoot::new().rocm_gpus(2).env("HIP_VISIBLE_DEVICES", ""))
        .assert_selected("cpu");
    let selection = plugin().select_platform(&FakeRoot::new().file("/dev/kfd", "").kfd_cpu_node(0));
    selection.assert_selected("cpu");
    assert!(!selection.device(NAME).available);
}
