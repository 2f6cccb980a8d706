//! `verl-core score`: per-token log-probs of given responses, computed by an engine plugin.

use std::process::ExitCode;
use std::time::Duration;

use verl_config::EngineRole;
use verl_plugin_api::ComponentKind;

use crate::args::{PluginArgs, ScoreArgs};
use crate::common::{load_config, load_registry, print_json, training_placement};
use crate::{config_audit, inference};

pub fn run(plugins: &PluginArgs, timeout: Duration, args: ScoreArgs) -> anyhow::Result<ExitCode> {
    let registry = load_registry(plugins)?;
    let config = load_config(&args.config, false, &registry)?;
    let placement = training_placement(&config, &registry, timeout)?;
    let engine = args
        .engine
        .as_deref()
        .unwrap_or(config.engine_strategy(EngineRole::Ref));
    let context = config_audit::command_context(
        &registry,
        &placement.run().device_type,
        verl_config::score_scope(),
        // The reference engine reads the actor's section under its own (engine_json).
        &[
            ("actor_rollout_ref.actor", ComponentKind::ENGINE, engine),
            ("actor_rollout_ref.ref", ComponentKind::ENGINE, engine),
        ],
    );
    config_audit::check(&config, &context)?;
    let (prompts, responses) = inference::read_score_input(&args.input, &args.model)?;
    let spec = inference::ScoreSpec {
        registry: &registry,
        config: &config,
        engine: args.engine.as_deref(),
        model: &args.model,
        placement: &placement,
    };
    let results = inference::score(&spec, &prompts, &responses)?;
    // Every rank holds every result; rank 0 owns the console.
    if placement.run().rank > 0 {
        return Ok(ExitCode::SUCCESS);
    }
    if args.json {
        print_json(&serde_json::json!({ "results": results }))?;
    } else {
        for (i, r) in results.iter().enumerate() {
            println!(
                "[{i}] sum {:.6}  {:?}",
                r.logprobs.iter().map(|&x| f64::from(x)).sum::<f64>(),
                r.logprobs
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
