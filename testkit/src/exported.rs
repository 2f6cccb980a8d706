//! A plugin crate's own exported manifest (`__verl_plugin_manifest()` from `export_plugin!`),
//! checked in its unit tests without building the library: what it registers, and a device
//! detection made through the stable interface exactly as the host makes it.

use verl_plugin_api::{Detection, PluginManifest, wire};

use crate::FakeRoot;

/// Asserts `manifest` registers exactly one component, the device `name` at `priority`, and
/// returns that device's detection of `root`, called through the stable ABI (records encoded and
/// decoded as the host does).
pub fn detect_exported_device(
    manifest: PluginManifest,
    name: &str,
    priority: i32,
    root: &FakeRoot,
) -> Detection {
    let info = manifest.info().expect("the manifest reads back");
    let registered: Vec<(&str, i32)> = info
        .components
        .iter()
        .map(|c| (c.name.as_str(), c.priority))
        .collect();
    assert_eq!(
        registered,
        [(name, priority)],
        "components of plugin `{}`",
        info.name
    );
    let device = manifest
        .factory
        .create_device(name.into())
        .into_result()
        .expect("the device is created");
    let probe = wire::encode(&root.probe());
    let detected = device
        .detect(probe.as_rstr())
        .into_result()
        .expect("detection succeeds");
    wire::decode("detection", &detected).expect("the detection reads back")
}
