//! The plugin's detection on fake machines, called directly (the rlib) — fast, no loading.

use verl_plugin_api::{Detection, Device, ErrorKind, ProbeContext};
use verl_plugin_xpu::{ALLOW_INTEGRATED_ENV, AFFINITY_ENV, XpuDevice, intel_cards};
use verl_testkit::{FakeEnv, FakeRoot, IntelGpu};

fn detect(probe: &ProbeContext) -> Detection {
    XpuDevice.detect(probe).expect("detection succeeds")
}

fn names(d: &Detection) -> Vec<&str> {
    d.device_names.iter().map(|n| n.as_str()).collect()
}

#[test]
fn info_names_the_xpu_stack() {
    let info = XpuDevice.info();
    assert_eq!((info.name.as_str(), info.vendor.as_str()), ("xpu", "intel"));
    assert_eq!((info.device_type.as_str(), info.comm_backend.as_str()), ("xpu", "ccl"));
    assert_eq!(info.visible_devices_env.as_slice(), [AFFINITY_ENV]);
}

#[test]
fn discrete_gpus_are_counted() {
    for n in [1, 2, 8] {
        let d = detect(&FakeRoot::new().intel_gpus(n, false).probe());
        assert!(d.available && d.count == n, "{d:?}");
        assert!(names(&d).iter().all(|name| name.starts_with("Intel GPU [8086:0bda] (discrete, 0000:")), "{d:?}");
        assert!(d.reason.contains(&format!("{n} discrete, 0 integrated")), "{}", d.reason);
    }
}

#[test]
fn affinity_mask_filters_in_pci_order() {
    let root = FakeRoot::new().intel_gpus(4, false);
    let case = |mask: &str| detect(&root.probe_with(&FakeEnv::new().set(AFFINITY_ENV, mask)));

    let d = case("3,1");
    assert_eq!(d.count, 2);
    assert_eq!(names(&d), ["Intel GPU [8086:0bda] (discrete, 0000:59:00.0)", "Intel GPU [8086:0bda] (discrete, 0000:39:00.0)"]);
    assert!(d.reason.contains("ZE_AFFINITY_MASK=3,1"), "{}", d.reason);
    assert_eq!(case("0.0,0.1,2.1").count, 2, "tiles of one device count that device once");
    assert_eq!(case("7").count, 0, "a mask naming no device leaves none");
    assert!(!case("7").available);
    assert_eq!(case("").count, 4, "an empty mask is no mask, as for Level Zero");
}

#[test]
fn integrated_only_is_reported_but_not_counted_unless_allowed() {
    let root = FakeRoot::new().intel_gpus(0, true);
    let d = detect(&root.probe());
    assert!(!d.available && d.count == 0, "{d:?}");
    assert!(d.reason.contains("0 discrete, 1 integrated"), "{}", d.reason);
    assert!(d.reason.contains(ALLOW_INTEGRATED_ENV), "{}", d.reason);

    let allowed = detect(&root.probe_with(&FakeEnv::new().set(ALLOW_INTEGRATED_ENV, "1")));
    assert_eq!(allowed.count, 1);
    assert_eq!(names(&allowed), ["Intel GPU [8086:7d55] (integrated, 0000:00:02.0)"]);

    let err = XpuDevice.detect(&root.probe_with(&FakeEnv::new().set(ALLOW_INTEGRATED_ENV, "yes"))).unwrap_err();
    assert_eq!(err.kind, ErrorKind::INVALID_CONFIG);
}

#[test]
fn mixed_machine_indexes_integrated_first() {
    // The integrated GPU (00:02.0) is device 0 for the runtime; discrete cards follow.
    let root = FakeRoot::new().intel_gpus(2, true);
    let d = detect(&root.probe());
    assert_eq!(d.count, 2);
    assert!(d.reason.contains("3 Intel GPU(s)") && d.reason.contains("1 integrated GPU(s) not counted"), "{}", d.reason);

    let d = detect(&root.probe_with(&FakeEnv::new().set(AFFINITY_ENV, "0")));
    assert_eq!(d.count, 0, "the mask selects only the integrated GPU");
    let d = detect(&root.probe_with(&FakeEnv::new().set(AFFINITY_ENV, "0,2").set(ALLOW_INTEGRATED_ENV, "1")));
    assert_eq!(names(&d), ["Intel GPU [8086:7d55] (integrated, 0000:00:02.0)", "Intel GPU [8086:0bda] (discrete, 0000:39:00.0)"]);
}

#[test]
fn cards_that_cannot_compute_are_named() {
    let root = FakeRoot::new()
        .intel_gpu(0, &IntelGpu { driver: Some("vfio-pci".into()), ..IntelGpu::discrete(0x3b) })
        .intel_gpu(1, &IntelGpu { driver: None, ..IntelGpu::discrete(0x4b) })
        .intel_gpu(2, &IntelGpu { render_node: false, ..IntelGpu::discrete(0x5b) })
        .intel_gpu(3, &IntelGpu { driver: Some("i915".into()), ..IntelGpu::discrete(0x9a) });
    let d = detect(&root.probe());
    assert_eq!(d.count, 1);
    for why in ["card0: driver vfio-pci", "card1: no kernel driver bound", "card2: no render node"] {
        assert!(d.reason.contains(why), "missing `{why}` in {}", d.reason);
    }
}

#[test]
fn other_vendors_and_connectors_are_ignored() {
    let root = FakeRoot::new()
        .intel_gpus(1, false)
        // An AMD card and an NVIDIA card next to the Intel one; connector entries look like cards.
        .file("/sys/class/drm/card7/device/vendor", "0x1002\n")
        .file("/sys/class/drm/card8/device/vendor", "0x10de\n")
        .dir("/sys/class/drm/card1-HDMI-A-1")
        .file("/sys/class/drm/version", "drm 1.1.0 20060810\n");
    let cards = intel_cards(&root.probe());
    assert_eq!(cards.len(), 1);
    assert_eq!(cards[0].card, "card1");
    assert_eq!(detect(&root.probe()).count, 1);
}

#[test]
fn no_intel_gpu() {
    let d = detect(&FakeRoot::new().probe());
    assert!(!d.available && d.count == 0);
    assert!(d.reason.contains("no Intel GPU"), "{}", d.reason);
    let nvidia_only = detect(&FakeRoot::new().nvidia_gpus(2, "NVIDIA H100").probe());
    assert!(!nvidia_only.available);
}
