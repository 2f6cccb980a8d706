//! Platform registration through the released binary and the bundled plugins, on fake machines:
//! what a CI suite asserting "this platform registers correctly" runs.

use std::process::Output;

use serde_json::Value;
use verl_testkit::{FakeRoot, KfdGpu};

use crate::helpers::*;

/// `verl-core platform --json` with the bundled plugins on `root`, its fake environment only.
fn platform(root: &FakeRoot) -> (Output, Value) {
    let dir = bundled_plugins(&["verl_plugin_rocm", "verl_plugin_ascend"]);
    let out = verl_core_on(
        root,
        &[
            "platform",
            "--json",
            "--plugin-dir",
            dir.path().to_str().unwrap(),
        ],
        &[],
    );
    let json = stdout_json(&out);
    (out, json)
}

fn machine() -> FakeRoot {
    FakeRoot::new().cpus("0-7", "AuthenticAMD", "AMD EPYC 9654 96-Core Processor")
}

fn assert_selected(root: &FakeRoot, name: &str, count: u64) -> Value {
    let (out, json) = platform(root);
    assert!(
        out.status.success(),
        "{json:#}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(json["selected"], name, "{json:#}");
    assert_eq!(device(&json, name)["count"], count, "{json:#}");
    json
}

fn assert_selection_error(root: &FakeRoot, needles: &[&str]) -> Value {
    let (out, json) = platform(root);
    assert!(!out.status.success(), "selection should fail: {json:#}");
    assert!(json["selected"].is_null());
    let error = json["error"].as_str().unwrap();
    for needle in needles {
        assert!(error.contains(needle), "`{needle}` missing from: {error}");
    }
    json
}

#[test]
fn cpu_is_the_fallback_on_a_machine_without_accelerators() {
    let json = assert_selected(&machine(), "cpu", 8);
    for name in ["cuda", "rocm", "ascend"] {
        let d = device(&json, name);
        assert_eq!(d["available"], false);
        assert!(!d["reason"].as_str().unwrap().is_empty());
    }
    assert_eq!(
        device(&json, "cpu")["reason"]
            .as_str()
            .map(|r| r.contains("8")),
        Some(true)
    );
}

#[test]
fn rocm_counts_gpu_nodes_not_cpu_nodes() {
    let json = assert_selected(&machine().rocm_gpus(4), "rocm", 4);
    let rocm = device(&json, "rocm");
    assert_eq!(rocm["vendor"], "amd");
    assert_eq!(rocm["comm_backend"], "nccl");
    assert_eq!(rocm["device_type"], "cuda");
    // Non-contiguous node numbering with an extra CPU node in the middle.
    let root = machine()
        .rocm_gpus(0)
        .kfd_gpu_node(2, &KfdGpu::mi250x())
        .kfd_cpu_node(3)
        .kfd_gpu_node(7, &KfdGpu::mi300x());
    assert_selected(&root, "rocm", 2);
}

#[test]
fn rocm_visible_device_filters() {
    assert_selected(
        &machine().rocm_gpus(4).env("ROCR_VISIBLE_DEVICES", "0,2"),
        "rocm",
        2,
    );
    let json = assert_selected(
        &machine().rocm_gpus(4).env("HIP_VISIBLE_DEVICES", "3"),
        "rocm",
        1,
    );
    let updates = device(&json, "rocm")["env_updates"].to_string();
    assert!(
        updates.contains("CUDA_VISIBLE_DEVICES") && updates.contains('3'),
        "HIP is translated for CUDA libraries: {updates}"
    );
    // Everything hidden: not available, so the CPU takes over.
    assert_selected(
        &machine().rocm_gpus(2).env("HIP_VISIBLE_DEVICES", ""),
        "cpu",
        8,
    );
}

#[test]
fn rocr_and_cuda_visible_devices_together_are_an_error() {
    let root = machine()
        .rocm_gpus(2)
        .env("ROCR_VISIBLE_DEVICES", "0")
        .env("CUDA_VISIBLE_DEVICES", "1");
    assert_selection_error(
        &root,
        &["rocm", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"],
    );
}

#[test]
fn ascend_counts_davinci_devices_and_filters() {
    let json = assert_selected(&machine().ascend_npus(8), "ascend", 8);
    let ascend = device(&json, "ascend");
    assert_eq!(
        (ascend["vendor"].as_str(), ascend["comm_backend"].as_str()),
        (Some("huawei"), Some("hccl"))
    );
    assert_selected(
        &machine()
            .ascend_npus(8)
            .env("ASCEND_RT_VISIBLE_DEVICES", "1,3,5"),
        "ascend",
        3,
    );
    // Control devices alone are no NPU.
    assert_selected(&machine().ascend_npus(0), "cpu", 8);
}

#[test]
fn nvidia_from_driver_proc_entries_and_filters() {
    let json = assert_selected(
        &machine().nvidia_gpus(2, "NVIDIA H100 80GB HBM3"),
        "cuda",
        2,
    );
    assert!(
        device(&json, "cuda")["device_names"]
            .to_string()
            .contains("H100"),
        "{json:#}"
    );
    assert_selected(
        &machine()
            .nvidia_gpus(4, "NVIDIA A100")
            .env("CUDA_VISIBLE_DEVICES", "1,2"),
        "cuda",
        2,
    );
    assert_selected(
        &machine()
            .nvidia_gpus(2, "NVIDIA A100")
            .env("CUDA_VISIBLE_DEVICES", ""),
        "cpu",
        8,
    );
}

#[test]
fn the_highest_priority_available_platform_wins() {
    let everything = || {
        machine()
            .nvidia_gpus(2, "NVIDIA H100")
            .rocm_gpus(4)
            .ascend_npus(8)
    };
    assert_selected(&everything(), "cuda", 2);
    assert_selected(&machine().rocm_gpus(4).ascend_npus(8), "rocm", 4);
    assert_selected(
        &everything()
            .env("CUDA_VISIBLE_DEVICES", "")
            .env("HIP_VISIBLE_DEVICES", ""),
        "ascend",
        8,
    );
}

#[test]
fn verl_platform_overrides_case_insensitively() {
    let everything = || {
        machine()
            .nvidia_gpus(2, "NVIDIA H100")
            .rocm_gpus(4)
            .ascend_npus(8)
    };
    assert_selected(&everything().env("VERL_PLATFORM", "AsCeNd"), "ascend", 8);
    assert_selected(&everything().env("VERL_PLATFORM", "CPU"), "cpu", 8);
    // Another platform's configuration error does not matter when one is chosen explicitly.
    let conflicting = everything()
        .env("ROCR_VISIBLE_DEVICES", "0")
        .env("CUDA_VISIBLE_DEVICES", "0");
    assert_selected(&conflicting.env("VERL_PLATFORM", "ascend"), "ascend", 8);
}

#[test]
fn verl_platform_errors_name_the_valid_choices() {
    assert_selection_error(
        &machine().env("VERL_PLATFORM", "tpu"),
        &["VERL_PLATFORM=tpu", "ascend", "cpu", "cuda", "rocm"],
    );
    assert_selection_error(
        &machine().env("VERL_PLATFORM", "rocm"),
        &["rocm", "not available", "KFD"],
    );
}

/// The selected platform's `env_updates` are applied before any component initialises: on a fake
/// ROCm machine with HIP_VISIBLE_DEVICES, `verl-core generate` sets CUDA_VISIBLE_DEVICES (what
/// CUDA-compatible libraries read) first, then places the rollout on the platform's device.
#[test]
fn platform_env_updates_are_applied_before_components_start() {
    let root = machine().rocm_gpus(4).env("HIP_VISIBLE_DEVICES", "1,3");
    let dir = bundled_plugins(&["verl_plugin_rocm", "verl_plugin_native"]);
    let model = workspace_root().join("runtime/model/fixtures/tiny-llama");
    let out = verl_core_on(
        &root,
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
            "--plugin-dir",
            dir.path().to_str().unwrap(),
        ],
        &[("RUST_LOG", "info")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let applied = stderr
        .find("platform `rocm` sets CUDA_VISIBLE_DEVICES=1,3")
        .unwrap_or_else(|| panic!("{stderr}"));
    // This machine has no GPU: the rollout, placed on cuda:0, fails after the update was applied.
    assert!(!out.status.success(), "{stderr}");
    let failed = stderr
        .find("initialising rollout `native`")
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(applied < failed, "{stderr}");
}
