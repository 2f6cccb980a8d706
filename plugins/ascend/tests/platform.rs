//! The built ascend plugin loaded into the real host: registration, detection through the ABI and
//! platform selection next to the built-in cpu and cuda devices.

use verl_plugin_api::ComponentKind;
use verl_plugin_ascend::{NAME, PRIORITY};
use verl_testkit::{FakeRoot, PluginHarness, built_plugin};

fn plugin() -> PluginHarness {
    PluginHarness::load(built_plugin("verl_plugin_ascend")).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn registers_the_ascend_device() {
    let plugin = plugin();
    assert_eq!(plugin.record().name, "ascend");
    plugin.assert_registers(ComponentKind::DEVICE, NAME, PRIORITY);
    let info = plugin.info(NAME).unwrap();
    assert_eq!(
        (
            info.vendor.as_str(),
            info.device_type.as_str(),
            info.comm_backend.as_str()
        ),
        ("huawei", "npu", "hccl")
    );
}

#[test]
fn selected_on_an_ascend_machine() {
    let root = FakeRoot::new()
        .cpus("0-191", "HiSilicon", "Kunpeng-920")
        .ascend_npus(8)
        .env("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7");
    let selection = plugin().select_platform(&root);
    let npu = selection.assert_selected(NAME);
    assert_eq!(npu.count, 4);
    assert!(npu.reason.contains("torch_npu"), "{}", npu.reason);
}

#[test]
fn priority_against_the_builtins() {
    let both = FakeRoot::new().ascend_npus(2).nvidia_gpus(1, "NVIDIA L4");
    plugin().select_platform(&both).assert_selected("cuda");
    plugin()
        .select_platform(&both.env("VERL_PLATFORM", "ASCEND"))
        .assert_selected(NAME);
}

#[test]
fn incomplete_setups_fall_back_to_cpu_with_the_reason() {
    let selection = plugin().select_platform(
        &FakeRoot::new()
            .ascend_npus(2)
            .remove("/dev/davinci_manager"),
    );
    selection.assert_selected("cpu");
    assert!(
        selection.device(NAME).reason.contains("davinci_manager"),
        "{}",
        selection.table()
    );

    let forced = plugin().select_platform(&FakeRoot::new().env("VERL_PLATFORM", "ascend"));
    let message = forced.error().to_string();
    assert!(
        message.contains("ascend") && message.contains("not available"),
        "{message}"
    );
}
