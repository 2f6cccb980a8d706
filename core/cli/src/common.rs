//! What the commands share: the plugin registry, the config with its plugins' sections, this
//! process's placement on the selected platform, the audit of a training command, JSON output.

use std::time::Duration;

use anyhow::Context as _;
use verl_config::{Config, ConfigSource, FileFormat, PluginSections, SectionKind};
use verl_plugin_api::ComponentKind;
use verl_plugin_host::{
    DeviceReport, PlatformReport, PluginSearch, Registry, detect_platform, process_probe,
};
use verl_trainer::placement::{self, EnvUpdates, Placement};

use crate::args::{PluginArgs, RunArgs};
use crate::{config_audit, quickstart};

/// `--plugin-allowlist`, read.
pub fn allow_list(args: &PluginArgs) -> anyhow::Result<Option<verl_plugin_host::vet::AllowList>> {
    Ok(args
        .plugin_allowlist
        .as_deref()
        .map(verl_plugin_host::vet::AllowList::from_file)
        .transpose()?)
}

pub fn load_registry(args: &PluginArgs) -> anyhow::Result<Registry> {
    let search = PluginSearch::standard(&args.plugin_dirs, args.plugin_allowlist.as_deref())?;
    let mut registry = Registry::with_builtins();
    registry.load_all(&search);
    Ok(registry)
}

/// The config sections the registry's plugins declare (`config_section` of each loaded component).
pub fn plugin_sections(registry: &Registry) -> PluginSections {
    let mut sections = PluginSections::new();
    let declared = registry
        .plugins()
        .iter()
        .filter(|p| p.status.is_ok())
        .flat_map(|p| &p.components);
    for component in declared {
        let Some(section) = &component.config_section else {
            continue;
        };
        let kind = match component.kind {
            ComponentKind::ENGINE => SectionKind::Engine,
            ComponentKind::ROLLOUT => SectionKind::Rollout,
            ComponentKind::CHECKPOINT => SectionKind::Checkpoint,
            ComponentKind::TRACKER => SectionKind::Tracker,
            _ => continue,
        };
        sections.declare(kind, section.clone());
    }
    sections
}

/// The config from `--config` (or, for `run`, the embedded quickstart), VERL_* variables and
/// overrides, with the sections of `registry`'s plugins.
pub fn load_config(
    args: &RunArgs,
    embedded_default: bool,
    registry: &Registry,
) -> anyhow::Result<Config> {
    let sections = plugin_sections(registry);
    let source = match (&args.config, embedded_default) {
        (Some(path), _) => Some(ConfigSource::File(path)),
        (None, true) => Some(ConfigSource::Text {
            text: quickstart::QUICKSTART_YAML,
            format: FileFormat::Yaml,
            name: "the embedded examples/quickstart.yaml",
        }),
        (None, false) => None,
    };
    Ok(Config::from_process_source(
        source,
        &args.overrides,
        &sections,
    )?)
}

/// This process's placement for training: `trainer.device=auto` follows platform selection,
/// anything else names a platform (or a torch device type) explicitly. The platform's
/// environment updates are applied before any component exists.
pub fn training_placement(
    config: &Config,
    registry: &Registry,
    timeout: Duration,
) -> anyhow::Result<Placement> {
    let wanted = config.trainer.device.trim().to_ascii_lowercase();
    if wanted.is_empty() || wanted == "auto" {
        return placement(registry, timeout, config.trainer.seed);
    }
    let (report, _) = detect_platform(registry, &process_probe(), timeout);
    let device = report
        .devices
        .iter()
        .find(|d| d.name == wanted || d.device_type == wanted)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "trainer.device={wanted} names no platform; known: {}",
                report
                    .devices
                    .iter()
                    .map(|d| d.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
    anyhow::ensure!(
        device.available,
        "trainer.device={wanted}: {} is not available: {}",
        device.name,
        device.reason
    );
    apply_env_updates(&report, device)?;
    Ok(Placement::on_platform(device, config.trainer.seed)?)
}

/// A training command's ranks against `trainer.nnodes × trainer.n_gpus_per_node`: every rank
/// stops here, before anything is written.
pub fn check_training_ranks(placement: &Placement, config: &Config) -> anyhow::Result<()> {
    Ok(placement.check_world_size(config.trainer.nnodes, config.trainer.n_gpus_per_node)?)
}

/// This process on the selected platform; a selection error stops the command.
pub fn placement(registry: &Registry, timeout: Duration, seed: u64) -> anyhow::Result<Placement> {
    let (report, selection) = detect_platform(registry, &process_probe(), timeout);
    selection.context("selecting the device platform (see `verl-core platform`)")?;
    let device = report
        .selected_device()
        .expect("a selected platform has a report");
    apply_env_updates(&report, device)?;
    Ok(Placement::on_platform(device, seed)?)
}

/// The config audit of a training command, sized by its ranks, on its device type.
pub fn audit_training(
    config: &Config,
    registry: &Registry,
    placement: &Placement,
) -> anyhow::Result<()> {
    let run = placement.run();
    let context = config_audit::context(config, registry, &run.device_type, Some(run.world_size));
    config_audit::check(config, &context)?;
    Ok(())
}

pub fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Applies the selected platform's environment updates before any component exists: set here,
/// or, while a detection that did not finish may still read the environment, by restarting this
/// process with them (exec keeps its pid, arguments and open files; only returns on failure).
fn apply_env_updates(report: &PlatformReport, device: &DeviceReport) -> anyhow::Result<()> {
    match placement::env_updates(report, device, |key| std::env::var(key).ok()) {
        EnvUpdates::Unchanged => Ok(()),
        EnvUpdates::Set(updates) => {
            for (key, value) in updates {
                tracing::info!("platform `{}` sets {key}={value}", device.name);
                // SAFETY: no other thread of this process runs yet: every detection that
                // reported was joined, none is left (`EnvUpdates::Set`), and no component exists.
                unsafe { std::env::set_var(key, value) };
            }
            Ok(())
        }
        EnvUpdates::Restart(updates) => {
            use std::os::unix::process::CommandExt as _;
            tracing::info!(
                "platform `{}` sets {}; restarting with them, since the detection of {} did not finish",
                device.name,
                updates
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                report.unfinished.join(", ")
            );
            let exe = std::env::current_exe().context("locating the verl-core binary")?;
            let error = std::process::Command::new(exe)
                .args(std::env::args_os().skip(1))
                .envs(updates)
                .exec();
            Err(anyhow::Error::new(error).context(format!(
                "restarting with platform `{}`'s environment",
                device.name
            )))
        }
    }
}
