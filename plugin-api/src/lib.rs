//! # verl-plugin-api
//!
//! The stable ABI between verl-core and its plugins, and the only crate a plugin author depends on.
//! A plugin is a `cdylib` that implements one or more of the component traits ([`Device`],
//! [`Engine`], [`Rollout`], [`CheckpointEngine`], [`Tracker`], [`Reward`]) in plain Rust and exports them with
//! one [`export_plugin!`] call:
//!
//! ```
//! use verl_plugin_api::{Detection, Device, DeviceInfo, PluginError, ProbeContext};
//!
//! struct XpuDevice;
//!
//! impl Device for XpuDevice {
//!     fn info(&self) -> DeviceInfo {
//!         DeviceInfo::new("xpu", "intel", "xpu", "ccl").visible_devices_env(["ZE_AFFINITY_MASK"])
//!     }
//!     fn detect(&self, probe: &ProbeContext) -> Result<Detection, PluginError> {
//!         let cards = probe.list_dir("/sys/class/drm").into_iter().filter(|n| n.starts_with("card")).count();
//!         Ok(Detection::available(cards as u32, format!("{cards} DRM cards")))
//!     }
//! }
//!
//! verl_plugin_api::export_plugin!(
//!     verl_plugin_api::PluginBuilder::new("xpu", env!("CARGO_PKG_VERSION"), "Intel GPUs")
//!         .device("xpu", 70, "Intel Data Center / Arc GPUs", || XpuDevice)
//! );
//! # fn main() {
//! #     let manifest = __verl_plugin_manifest().unwrap();
//! #     assert_eq!(manifest.info().unwrap().components[0].name, "xpu");
//! # }
//! ```
//!
//! The host checks the library with abi_stable before running any of its code (header, layout of
//! every type reachable from the root module) and checks this crate's semver: a plugin built against
//! an older minor loads, a newer minor or another major is rejected. Every call into a plugin is
//! wrapped so a panic becomes a [`PluginError`] of kind [`ErrorKind::PANIC`] instead of unwinding
//! across the boundary.
//!
//! ## How the contract grows
//! - Vtables and the root module are abi_stable prefix types: methods and fields are appended.
//! - Records (run context, sampling parameters, requests, completions, device facts,
//!   capabilities, the manifest) cross as JSON ([`wire`]) and are `#[serde(default)]` and
//!   `#[non_exhaustive]`: a newer peer's extra fields are ignored, an older peer's missing fields
//!   take their defaults, and adding a field is neither an ABI nor a source break.
//! - Bulk containers ([`Tensor`], [`TensorRef`], [`Batch`], [`WeightSource`], [`Metric`]) are
//!   fixed binary layouts that grow by keys: a batch gains named tensors and `meta_json` keys, a
//!   weight source gains [`Handover`] fields.
//!
//! Each component declares its capabilities ([`EngineCapabilities`], [`RolloutCapabilities`],
//! …) with an associated function of its trait; the host shows them and checks a run's config
//! against them before the first step.

mod abi;
mod capabilities;
mod components;
pub mod config;
mod device;
mod error;
pub mod keys;
mod reward;
mod tensor;
pub mod wire;

pub use abi::{
    __root_module, CheckpointBox, ComponentKind, ComponentMeta, DeviceBox, EngineBox, FactoryBox,
    PluginBuilder, PluginInfo, PluginManifest, PluginModule, PluginModule_Ref, RewardBox,
    RolloutBox, StableCheckpoint, StableDevice, StableEngine, StableFactory, StableReward,
    StableRollout, StableTracker, TrackerBox,
};
pub use capabilities::{
    CheckpointCapabilities, ConfigKeys, EngineCapabilities, KeyNote, RolloutCapabilities,
    TrackerCapabilities, WeightSourceKind,
};
pub use components::{
    CheckpointEngine, Completion, ComponentInit, Engine, FinishReason, GenerateOutput,
    GenerateRequest, Handover, Rollout, RoutedExperts, RunContext, SamplingParams, Table, Tracker,
};
pub use device::{Detection, Device, DeviceInfo, EnvVar, ProbeContext, visible_devices};
pub use error::{ErrorKind, PluginError, guard};
pub use reward::{
    Reward, RewardCapabilities, RewardItem, RewardOutput, RewardRequest, RewardScore,
};
pub use tensor::{Batch, DType, Element, Metric, NamedTensor, Tensor, TensorRef, WeightSource};

/// Re-exported so plugin crates need no direct dependency on abi_stable.
pub use abi_stable;

/// The ABI version this crate defines (its package version).
pub const ABI_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The name under which abi_stable looks up a library's root module; [`export_plugin!`] exports a
/// static under it. Kept as a literal because `export_name` takes no constant (checked by a test).
#[doc(hidden)]
#[macro_export]
macro_rules! __root_module_symbol {
    () => {
        "_1as_0lib_1header_0root_bmodule_bloader"
    };
}

/// Whether a plugin built against ABI `plugin` may be loaded by a host on ABI `host`: same major,
/// and the plugin's minor not newer than the host's (an older plugin lacks only appended fields).
/// The error names both versions.
pub fn check_abi_compatible(host: &str, plugin: &str) -> Result<(), String> {
    let parse = |v: &str| -> Option<(u64, u64)> {
        let mut parts = v.trim().splitn(3, '.');
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        parts
            .next()?
            .split(['-', '+'])
            .next()?
            .parse::<u64>()
            .ok()?;
        Some((major, minor))
    };
    let ((hmaj, hmin), (pmaj, pmin)) = match (parse(host), parse(plugin)) {
        (Some(h), Some(p)) => (h, p),
        _ => {
            return Err(format!(
                "unreadable plugin API version `{plugin}` (core has {host})"
            ));
        }
    };
    if pmaj != hmaj {
        Err(format!(
            "built against plugin API {plugin}, but this core has {host}: major versions differ; rebuild the plugin against verl-plugin-api {hmaj}.x"
        ))
    } else if pmin > hmin {
        Err(format!(
            "built against plugin API {plugin}, newer than this core's {host}: upgrade verl-core or rebuild the plugin against verl-plugin-api {host}"
        ))
    } else {
        Ok(())
    }
}

/// Exports a plugin's root module. Takes an expression of type [`PluginBuilder`]; call it once, at
/// the crate root of a `cdylib`.
#[macro_export]
macro_rules! export_plugin {
    ($builder:expr) => {
        #[doc(hidden)]
        pub extern "C" fn __verl_plugin_manifest()
        -> $crate::abi_stable::std_types::RResult<$crate::PluginManifest, $crate::PluginError> {
            $crate::guard("plugin registration", || {
                let builder: $crate::PluginBuilder = $builder;
                Ok(builder.into_manifest())
            })
        }

        #[doc(hidden)]
        pub fn __verl_plugin_root_module() -> $crate::PluginModule_Ref {
            $crate::__root_module(__verl_plugin_manifest)
        }

        // What abi_stable's `#[export_root_module]` expands to, written with `$crate` paths so plugin
        // crates need not depend on abi_stable themselves.
        #[doc(hidden)]
        #[unsafe(export_name = $crate::__root_module_symbol!())]
        pub static __VERL_PLUGIN_LIB_HEADER: $crate::abi_stable::library::LibHeader = {
            extern "C" fn erased_root_module() -> $crate::abi_stable::library::RootModuleResult {
                $crate::abi_stable::library::__call_root_module_loader(__verl_plugin_root_module)
            }
            // SAFETY: `erased_root_module` returns the root module of type `PluginModule_Ref`, the
            // type named here, exactly as abi_stable's own attribute macro sets it up.
            unsafe {
                $crate::abi_stable::library::LibHeader::from_constructor::<$crate::PluginModule_Ref>(
                    erased_root_module,
                    $crate::abi_stable::library::CheckTypeLayout::Yes,
                )
            }
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_module_symbol_matches_abi_stable() {
        assert_eq!(
            __root_module_symbol!(),
            abi_stable::library::ROOT_MODULE_LOADER_NAME
        );
    }

    #[test]
    fn abi_compatibility_rules() {
        assert!(check_abi_compatible("1.3.0", "1.3.0").is_ok());
        assert!(check_abi_compatible("1.3.0", "1.1.7").is_ok());
        assert!(check_abi_compatible("1.3.0", "1.3.9").is_ok());
        let newer = check_abi_compatible("1.3.0", "1.4.0").unwrap_err();
        assert!(
            newer.contains("1.4.0") && newer.contains("1.3.0"),
            "{newer}"
        );
        let major = check_abi_compatible("1.3.0", "2.0.0").unwrap_err();
        assert!(
            major.contains("major") && major.contains("2.0.0") && major.contains("1.3.0"),
            "{major}"
        );
        assert!(check_abi_compatible("1.0.0", "x.y").is_err());
    }

    #[test]
    fn panics_become_errors() {
        let r = guard("detect", || -> Result<(), PluginError> {
            panic!("boom {}", 7)
        });
        let e = r.into_result().unwrap_err();
        assert_eq!(e.kind, ErrorKind::PANIC);
        assert_eq!(e.message(), "panicked in detect: boom 7");
    }

    /// A guarded panic prints nothing (checked in a child process, whose stderr is the hook's
    /// output) and its reason keeps its first line only.
    #[test]
    fn guarded_panics_are_silent_and_one_line() {
        const CHILD: &str = "VERL_PLUGIN_API_PANIC_CHILD";
        if std::env::var_os(CHILD).is_some() {
            let e = guard("generate", || -> Result<(), PluginError> {
                panic!("Torch(\"out of memory\\nframe #0: c10::Error\")\nException raised from")
            })
            .into_result()
            .unwrap_err();
            println!("message=[{}]", e.message());
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "tests::guarded_panics_are_silent_and_one_line",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{stdout}{stderr}");
        assert!(
            stdout.contains("message=[panicked in generate: Torch(\"out of memory]"),
            "{stdout}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }

    #[test]
    fn builder_creates_guarded_components() {
        struct Boom;
        impl Device for Boom {
            fn info(&self) -> DeviceInfo {
                panic!("no info")
            }
            fn detect(&self, _: &ProbeContext) -> Result<Detection, PluginError> {
                Ok(Detection::available(3, "three"))
            }
        }
        let manifest = PluginBuilder::new("p", "0.1.0", "test")
            .device("boom", 5, "d", || Boom)
            .into_manifest();
        let info = manifest.info().unwrap();
        assert_eq!(info.components.len(), 1);
        assert_eq!(info.components[0].kind, ComponentKind::DEVICE);
        let dev = manifest.factory.create_device("boom".into()).unwrap();
        let probe = wire::encode(&ProbeContext::new("/", Vec::<(String, String)>::new()));
        let detection: Detection =
            wire::decode("detection", &dev.detect(probe.as_rstr()).unwrap()).unwrap();
        assert_eq!(detection.count, 3);
        assert_eq!(dev.info().unwrap_err().kind, ErrorKind::PANIC);
        let Err(missing) = manifest.factory.create_engine("boom".into()).into_result() else {
            panic!("no engine expected")
        };
        assert!(
            missing.message().contains("no engine component `boom`"),
            "{missing}"
        );
    }
}
