//! `verl-core generate`: completions from a model directory through a rollout plugin.

use std::process::ExitCode;
use std::time::Duration;

use verl_plugin_api::{ComponentKind, SamplingParams};

use crate::args::{GenerateArgs, PluginArgs};
use crate::common::{load_config, load_registry, print_json, training_placement};
use crate::{config_audit, inference};

pub fn run(
    plugins: &PluginArgs,
    timeout: Duration,
    args: GenerateArgs,
) -> anyhow::Result<ExitCode> {
    let registry = load_registry(plugins)?;
    let mut config = load_config(&args.config, false, &registry)?;
    // The config as given is audited (a trainer.seed in it is reported: --seed seeds the
    // request and the run).
    let given = config.clone();
    config.trainer.seed = args.seed;
    let placement = training_placement(&config, &registry, timeout)?;
    placement.require_single_rank("generation")?;
    let context = config_audit::command_context(
        &registry,
        &placement.run().device_type,
        verl_config::generate_scope(),
        &[(
            "actor_rollout_ref.rollout",
            ComponentKind::ROLLOUT,
            args.rollout
                .as_deref()
                .unwrap_or(&config.actor_rollout_ref.rollout.name),
        )],
    );
    config_audit::check(&given, &context)?;
    let tokenizer = if args.prompts.is_empty() && !args.json {
        None
    } else {
        inference::load_tokenizer(&args.model).ok()
    };
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    for text in &args.prompts {
        let tokenizer = tokenizer.as_ref().ok_or_else(|| {
            anyhow::anyhow!("--prompt needs {}/tokenizer.json", args.model.display())
        })?;
        prompts.push(inference::encode(tokenizer, text)?);
    }
    prompts.extend(args.prompt_ids.iter().map(|ids| ids.0.clone()));
    anyhow::ensure!(
        !prompts.is_empty(),
        "give at least one --prompt or --prompt-ids"
    );
    let mut sampling = SamplingParams::default();
    sampling.n = args.n;
    sampling.greedy = args.temperature.is_none() || args.greedy;
    sampling.temperature = args.temperature.unwrap_or(1.0);
    sampling.top_p = args.top_p.unwrap_or(1.0);
    sampling.top_k = args.top_k.unwrap_or(-1);
    sampling.max_new_tokens = args.max_new_tokens;
    sampling.seed = Some(args.seed);
    let rollout = args
        .rollout
        .as_deref()
        .unwrap_or(&config.actor_rollout_ref.rollout.name);
    let results = inference::generate(
        &inference::GenerateSpec {
            registry: &registry,
            config: &config,
            rollout,
            model: &args.model,
            placement: &placement,
        },
        prompts,
        sampling,
        tokenizer.as_ref(),
    )?;
    if args.json {
        print_json(&serde_json::json!({ "results": results }))?;
    } else {
        for r in &results {
            println!(
                "[{}] ({}) {}",
                r.prompt_index,
                r.finish_reason,
                r.text
                    .clone()
                    .unwrap_or_else(|| format!("{:?}", r.response_ids))
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
