//! `verl-core bench plugins | components`, and the hidden start-up probe `bench plugins` times.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;

use crate::args::{BenchCommand, PluginArgs};
use crate::bench;
use crate::common::{load_registry, placement};
use crate::quickstart::TinyModel;

pub fn run(
    plugins: &PluginArgs,
    timeout: Duration,
    command: BenchCommand,
) -> anyhow::Result<ExitCode> {
    match command {
        BenchCommand::Plugins { runs } => {
            let exe = std::env::current_exe().context("locating the verl-core binary")?;
            print!("{}", bench::plugins(&exe, &plugins.plugin_dirs, runs)?);
            Ok(ExitCode::SUCCESS)
        }
        BenchCommand::Components {
            model,
            engine,
            rollout,
            hidden_size,
            layers,
            runs,
        } => {
            // Head size 64, else 32: the sizes every bundled rollout serves (vLLM's CPU
            // attention refuses 16).
            anyhow::ensure!(
                hidden_size >= 32 && hidden_size % 32 == 0,
                "--hidden-size {hidden_size}: give a multiple of 32 (head size 32 or 64, which \
                 vLLM's CPU attention takes)"
            );
            let heads = hidden_size / if hidden_size % 64 == 0 { 64 } else { 32 };
            let registry = load_registry(plugins)?;
            let placement = placement(&registry, timeout, 0)?;
            let tiny = TinyModel {
                hidden_size,
                intermediate_size: hidden_size * 4,
                num_hidden_layers: layers,
                num_attention_heads: heads,
                num_key_value_heads: heads,
                ..TinyModel::default()
            };
            let bench = bench::ComponentBench {
                registry: &registry,
                placement: &placement,
                engine: &engine,
                rollout: &rollout,
                model: model.as_deref(),
                tiny,
                runs: runs.max(1),
            };
            print!("{}", bench::components(&bench)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

pub fn startup_probe(plugins: &PluginArgs, timeout: Duration) -> anyhow::Result<ExitCode> {
    let elapsed = bench::startup_once(&plugins.plugin_dirs, timeout)?;
    println!("{}", elapsed.as_nanos());
    Ok(ExitCode::SUCCESS)
}
