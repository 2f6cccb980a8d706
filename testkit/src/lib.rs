//! # verl-testkit
//!
//! Tests for verl-core plugins without the CLI, in the spirit of nushell's
//! `nu-plugin-test-support`: build a fake machine ([`FakeRoot`]: `/sys`, `/proc`, `/dev` files and
//! an environment), run a device's detection against it, and — with the `host` feature (on by
//! default) — load a built plugin file and assert what it registers and detects
//! ([`PluginHarness`]), or run the host's platform selection over fake roots ([`select_platform`]).
//!
//! ```no_run
//! // `no_run`: needs the xpu example's built library, which the example's own tests have.
//! use verl_testkit::{FakeRoot, PluginHarness, built_plugin};
//! use verl_plugin_api::ComponentKind;
//!
//! let plugin = PluginHarness::load(built_plugin("verl_plugin_xpu")).unwrap();
//! plugin.assert_registers(ComponentKind::DEVICE, "xpu", 70);
//! let root = FakeRoot::new().intel_gpus(2, false).env("ZE_AFFINITY_MASK", "1");
//! assert_eq!(plugin.detect("xpu", &root.probe()).unwrap().count, 1);
//! plugin.select_platform(&root).assert_selected("xpu");
//! ```

#[cfg(feature = "host")]
pub mod conformance;
mod exported;
mod fake;
#[cfg(feature = "host")]
mod harness;
mod rank_tests;

pub use exported::detect_exported_device;
pub use fake::{FakeEnv, FakeRoot, IntelGpu, KfdGpu};
#[cfg(feature = "host")]
pub use harness::{PluginHarness, Selection, built_plugin, registry_with, select_platform};
pub use rank_tests::{join_ranks, run_rank_tests};
/// The host crate the harness drives, for tests that need more of it.
#[cfg(feature = "host")]
pub use verl_plugin_host as host;
