//! The out-of-tree vendor example, built by its own `cargo build` as a vendor would, loaded into
//! the released binary.

use verl_testkit::FakeRoot;

use crate::helpers::*;

#[test]
fn vendor_plugin_built_separately_loads_into_the_release_binary() {
    let manifest = workspace_root().join("examples/vendor-plugin/Cargo.toml");
    let target = target_dir().join("vendor-plugin");
    let status = cargo()
        .args(["build", "--release", "--quiet", "--manifest-path"])
        .arg(&manifest)
        .env("CARGO_TARGET_DIR", &target)
        .status()
        .unwrap();
    assert!(status.success(), "building the vendor example");
    let lib = target.join("release").join(dylib_name("verl_plugin_xpu"));
    let dir = plugin_dir(&[("libverl_plugin_xpu.so", &lib)]);
    let dir_arg = dir.path().to_str().unwrap();

    let out = verl_core(
        &[
            "plugins",
            "check",
            "--json",
            dir.path().join("libverl_plugin_xpu.so").to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let check = stdout_json(&out);
    let entry = plugin_entry(&check, "libverl_plugin_xpu.so");
    assert_eq!(entry["components"][0]["kind"], "device");
    assert_eq!(entry["components"][0]["name"], "xpu");

    // It passes the device conformance suite.
    let out = verl_core(
        &[
            "plugins",
            "certify",
            dir.path().join("libverl_plugin_xpu.so").to_str().unwrap(),
        ],
        &[],
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    assert!(
        table.contains("certified: 5 passed, 0 failed, 0 skipped"),
        "{table}"
    );

    let root = FakeRoot::new()
        .cpus("0-3", "GenuineIntel", "Intel(R) Xeon(R) Platinum 8480+")
        .intel_gpus(2, true);
    let root_path = root.path().to_str().unwrap();
    let out = verl_core(
        &["platform", "--json", "--plugin-dir", dir_arg],
        &[("VERL_PROBE_ROOT", root_path)],
    );
    let platform = stdout_json(&out);
    assert!(out.status.success(), "{platform:#}");
    assert_eq!(platform["selected"], "xpu", "{platform:#}");
    assert_eq!(
        device(&platform, "xpu")["count"],
        2,
        "only the discrete GPUs count: {platform:#}"
    );

    let out = verl_core(
        &["platform", "--json", "--plugin-dir", dir_arg],
        &[("VERL_PROBE_ROOT", root_path), ("ZE_AFFINITY_MASK", "1")],
    );
    assert_eq!(device(&stdout_json(&out), "xpu")["count"], 1);
}
