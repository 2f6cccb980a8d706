//! Components built into verl-core, registered through `inventory` next to the host's built-in
//! devices: the `console` and `file` trackers, the `naive` and `disk` weight-sync engines and the
//! `rule` reward.

mod console;
mod file_logger;
pub(crate) mod weight_sync;

use verl_plugin_api::PluginBuilder;
use verl_plugin_host::BuiltinPlugin;

pub use console::ConsoleTracker;
pub use file_logger::{FILE_LOGGER_PATH_ENV, FileTracker};
pub use weight_sync::{DiskWeightSync, NaiveWeightSync};

fn builtin_components() -> PluginBuilder {
    PluginBuilder::new(
        "verl-core-trainer",
        env!("CARGO_PKG_VERSION"),
        "trackers, weight sync and rule rewards built into verl-core",
    )
    .tracker(
        "console",
        0,
        "compact metric table per step and a progress bar on stderr",
        ConsoleTracker::default,
    )
    .tracker(
        "file",
        0,
        "JSONL, one {\"step\", \"data\"} object per step (verl's file logger)",
        FileTracker::default,
    )
    .checkpoint(
        "naive",
        0,
        "hands weights over in memory (trainer and rollout in one process)",
        NaiveWeightSync::default,
    )
    .checkpoint(
        "disk",
        0,
        "hands the rollout a directory of safetensors files",
        DiskWeightSync::default,
    )
    .config_section("disk")
    .reward(
        verl_rewards::RULE_REWARD,
        0,
        "verl's rule rewards by data_source (default_compute_score)",
        verl_rewards::RuleReward::default,
    )
}

inventory::submit! { BuiltinPlugin(builtin_components) }
