//! `verl-core run` (RL training; without --config the embedded quickstart) and `verl-core sft`.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use verl_trainer::{sft, trainer};

use crate::args::{PluginArgs, RunArgs};
use crate::common::{
    allow_list, audit_training, check_training_ranks, load_config, load_registry,
    training_placement,
};
use crate::quickstart;

pub fn run(plugins: &PluginArgs, timeout: Duration, args: RunArgs) -> anyhow::Result<ExitCode> {
    let mut registry = load_registry(plugins)?;
    let config = load_config(&args, true, &registry)?;
    // A reward plugin named by custom_reward_function.path joins the registry.
    let allow_list = allow_list(plugins)?;
    verl_trainer::reward_select::load_library(&mut registry, &config, allow_list.as_ref())?;
    let placement = training_placement(&config, &registry, timeout)?;
    check_training_ranks(&placement, &config)?;
    audit_training(&config, &registry, &placement)?;
    trainer::check_values(&config, placement.run().world_size)?;
    quickstart::prepare(&config, &registry, &placement)?;
    trainer::install_interrupt_handler().context("installing the Ctrl-C handler")?;
    let summary = trainer::run(config, &registry, &placement)?;
    // Rank 0 owns the console.
    if placement.run().rank > 0 {
        return Ok(ExitCode::SUCCESS);
    }
    if let (Some(first), Some(last)) = (summary.validations.first(), summary.validations.last()) {
        for (key, value) in &last.1 {
            let before = first.1.get(key).copied().unwrap_or(f64::NAN);
            eprintln!(
                "{key}: {before:.3} (step {}) -> {value:.3} (step {})",
                first.0, last.0
            );
        }
    }
    if let Some(model) = summary.final_model {
        eprintln!("final model: {}", model.display());
    }
    Ok(ExitCode::SUCCESS)
}

pub fn sft(plugins: &PluginArgs, timeout: Duration, args: RunArgs) -> anyhow::Result<ExitCode> {
    let registry = load_registry(plugins)?;
    let config = load_config(&args, false, &registry)?;
    let placement = training_placement(&config, &registry, timeout)?;
    check_training_ranks(&placement, &config)?;
    placement.require_single_rank("supervised fine-tuning")?;
    audit_training(&config, &registry, &placement)?;
    sft::run_sft(&config, &config.sft, &registry, &placement)?;
    Ok(ExitCode::SUCCESS)
}
