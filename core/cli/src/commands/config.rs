//! `verl-core config show | check`.

use std::process::ExitCode;
use std::time::Duration;

use crate::args::{ConfigCommand, PluginArgs, RunArgs};
use crate::common::{load_config, load_registry, placement, print_json};
use verl_trainer::trainer;

use crate::config_audit;

pub fn run(
    plugins: &PluginArgs,
    timeout: Duration,
    command: ConfigCommand,
) -> anyhow::Result<ExitCode> {
    match command {
        ConfigCommand::Show { run, json } => show(plugins, &run, json),
        ConfigCommand::Check { run, json } => check(plugins, timeout, &run, json),
    }
}

fn show(plugins: &PluginArgs, run: &RunArgs, json: bool) -> anyhow::Result<ExitCode> {
    let config = load_config(run, true, &load_registry(plugins)?)?;
    if json {
        print_json(&config.to_json())?;
    } else {
        print!("{}", config.to_yaml());
    }
    Ok(ExitCode::SUCCESS)
}

fn check(
    plugins: &PluginArgs,
    timeout: Duration,
    run: &RunArgs,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let registry = load_registry(plugins)?;
    let config = load_config(run, true, &registry)?;
    // The world size as `run` would see it; the device `trainer.device` names need not be
    // on this machine to check a config.
    let placement = placement(&registry, timeout, config.trainer.seed)?;
    let context = config_audit::context(
        &config,
        &registry,
        &placement.run().device_type,
        Some(placement.run().world_size),
    );
    let findings = verl_config::audit(&config, &context);
    // A value `run` would refuse (a batch size, a schedule, a split over the ranks).
    let invalid = trainer::check_values(&config, placement.run().world_size)
        .err()
        .map(|e| e.to_string());
    let errors = findings
        .iter()
        .filter(|f| f.severity == verl_config::Severity::Error)
        .count()
        + usize::from(invalid.is_some());
    if json {
        print_json(&serde_json::json!({
            "findings": findings,
            "invalid": invalid,
            "errors": errors,
            "warnings": findings.len() + usize::from(invalid.is_some()) - errors,
        }))?;
    } else if findings.is_empty() && invalid.is_none() {
        println!("every key set is acted on");
    } else {
        for finding in &findings {
            println!("{}: {finding}", finding.severity.as_str());
        }
        if let Some(message) = &invalid {
            println!("error: {message}");
        }
    }
    Ok(if errors == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
