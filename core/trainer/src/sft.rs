//! Supervised fine-tuning (`verl-core sft`, and the quickstart's warm-up) through the actor
//! engine: the data's reference answers as responses, trained with the engine's own update.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::json;
use verl_plugin_api::{Metric, keys};
use verl_plugin_host::{EngineHandle, Registry};

pub use verl_config::SftConfig;

use crate::batch;
use crate::placement::Placement;
use crate::trainer::{TrainError, apply_policy, plugin_init};
use verl_algo::masked_mean;
use verl_config::{Config, EngineRole, Slot};
use verl_data::{ChatTemplate, DataLoader, PromptProcessor, Sample, expand_home};

/// The reference response to train on: verl's `extra_info.answer` when present (GSM8K-style
/// datasets carry the worked answer there), else `#### <ground_truth>`.
fn reference_answer(sample: &Sample) -> String {
    sample
        .extra_info
        .get("answer")
        .and_then(|a| a.as_str())
        .map(str::to_owned)
        .unwrap_or_else(|| format!("#### {}", sample.reward_model.ground_truth))
}

/// Supervised fine-tuning through the actor engine's `update_actor`: with `old_log_probs` equal
/// to the current log-probs and every advantage 1, the PPO loss's gradient is the NLL's.
/// Returns the output directory.
pub fn run_sft(
    config: &Config,
    sft: &SftConfig,
    registry: &Registry,
    placement: &Placement,
) -> Result<PathBuf, TrainError> {
    let base = expand_home(
        sft.base_model
            .as_deref()
            .unwrap_or(&config.actor_rollout_ref.model.path),
    );
    let output = expand_home(
        sft.output_dir
            .as_deref()
            .unwrap_or(&format!("{}/sft", config.trainer.default_local_dir)),
    );
    if sft.batch_size == 0 {
        return Err(TrainError::Invalid(
            "sft.batch_size must be at least 1".to_owned(),
        ));
    }
    if !(sft.lr.is_finite() && sft.lr >= 0.0) {
        return Err(TrainError::Invalid(format!(
            "sft.lr must be a finite number ≥ 0, got {}",
            sft.lr
        )));
    }
    crate::limits::check_sft(config, &base).map_err(|e| TrainError::Invalid(e.to_string()))?;
    let examples = sft_examples(config, sft, &base)?;
    let mut engine = sft_engine(config, sft, &base, registry, placement)?;
    let plugin = |context: &str| {
        let context = context.to_owned();
        move |error| TrainError::Plugin { context, error }
    };
    let mut loader = DataLoader::new(
        examples.len(),
        sft.batch_size,
        true,
        config.trainer.seed,
        true,
    );
    let started = Instant::now();
    eprintln!(
        "sft: {} steps of {} examples from {}",
        sft.steps,
        sft.batch_size,
        base.display()
    );
    for step in 1..=sft.steps {
        let indices = loop {
            if let Some(b) = loader.next_batch() {
                break b;
            }
        };
        let (nll, metrics) = sft_step(&mut engine, &examples, &indices, step)?;
        apply_policy(config.trainer.nan_policy, step, "actor", &metrics).map_err(|what| {
            TrainError::NonFinite {
                step,
                what,
                kept: format!("{} is not written", output.display()),
            }
        })?;
        if step == 1 || step % 25 == 0 || step == sft.steps {
            let grad = metrics
                .iter()
                .find(|m| m.key == "actor/grad_norm")
                .map_or(f64::NAN, |m| m.value);
            eprintln!(
                "sft step {step}/{}: nll {nll:.4}, grad_norm {grad:.3}, {:.1} s",
                sft.steps,
                started.elapsed().as_secs_f64()
            );
        }
    }
    std::fs::create_dir_all(&output).map_err(|error| TrainError::Io {
        path: output.clone(),
        error,
    })?;
    engine
        .export_hf(&output.to_string_lossy())
        .map_err(plugin(&format!("exporting {}", output.display())))?;
    eprintln!("sft: model written to {}", output.display());
    Ok(output)
}

/// A supervised example: the prompt's tokens and the reference answer's, EOS-terminated.
type Example = (Vec<u32>, Vec<u32>);

/// The training split as examples, checked to fill a batch.
fn sft_examples(config: &Config, sft: &SftConfig, base: &Path) -> Result<Vec<Example>, TrainError> {
    let tokenizer_json = base.join("tokenizer.json");
    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_json)
        .map_err(|e| TrainError::Invalid(format!("{}: {e}", tokenizer_json.display())))?;
    let eos = ["</s>", "<|endoftext|>", "<|im_end|>", "<eos>"]
        .iter()
        .find_map(|t| tokenizer.token_to_id(t));
    let data = &config.data;
    let mut processor = PromptProcessor::new(
        ChatTemplate::from_model_dir(base)?,
        &tokenizer_json,
        data.max_prompt_length,
        true,
        data.truncation,
    )?;
    processor.template_kwargs = config
        .chat_template_kwargs()
        .map_err(|e| TrainError::Invalid(e.to_string()))?;
    let examples: Vec<Example> = processor
        .prepare(verl_data::load_samples(
            &data.train_files,
            &data.prompt_key,
        )?)?
        .into_iter()
        .map(|(sample, prompt)| {
            let mut answer = tokenizer
                .encode(reference_answer(&sample), false)
                .map_err(|e| TrainError::Invalid(format!("tokenizing an answer: {e}")))?
                .get_ids()
                .to_vec();
            answer.truncate(data.max_response_length.saturating_sub(1).max(1));
            answer.extend(eos);
            Ok((prompt.ids, answer))
        })
        .collect::<Result<_, TrainError>>()?;
    if examples.len() < sft.batch_size {
        return Err(TrainError::Invalid(format!(
            "sft.batch_size={} but the training set has {} examples",
            sft.batch_size,
            examples.len()
        )));
    }

    Ok(examples)
}

/// The actor engine for supervised updates: the base model, one mini-batch per step, no KL or
/// entropy term, no warm-up or weight decay.
fn sft_engine(
    config: &Config,
    sft: &SftConfig,
    base: &Path,
    registry: &Registry,
    placement: &Placement,
) -> Result<EngineHandle, TrainError> {
    let mut section = config.engine_json(EngineRole::Actor);
    section["model"]["path"] = json!(base);
    section["model"]["random_init"] = json!(sft.random_init);
    section["ppo_mini_batch_size"] = json!(sft.batch_size);
    section["ppo_micro_batch_size_per_gpu"] = json!(sft.batch_size);
    section["ppo_epochs"] = json!(1);
    section["entropy_coeff"] = json!(0.0);
    section["use_kl_loss"] = json!(false);
    section["loss_agg_mode"] = json!("token-mean");
    // Supervised updates have no teacher outputs: the distillation loss is for the RL steps.
    if let Some(section) = section.as_object_mut() {
        section.remove("distillation_loss");
    }
    // Supervised data has no recorded routing: the model routes with its own router.
    section["router_replay"]["mode"] = json!("disabled");
    section["optim"]["lr"] = json!(sft.lr);
    section["optim"]["lr_warmup_steps"] = json!(0);
    section["optim"]["weight_decay"] = json!(0.0);
    section["optim"]["total_training_steps"] = json!(sft.steps);
    let name = config.engine_strategy(EngineRole::Actor);
    let component = registry
        .resolve_engine(name, &placement.run().device_type)
        .map_err(|source| TrainError::Engine {
            key: config.strategy_key(EngineRole::Actor),
            source,
        })?;
    let mut engine = component.create_engine()?;
    let run_dir = expand_home(&config.trainer.default_local_dir);
    let run = placement.for_run(
        &config.trainer.project_name,
        &config.trainer.experiment_name,
        &run_dir.to_string_lossy(),
    );
    engine
        .init(&plugin_init(
            config,
            Slot::Engine(EngineRole::Actor),
            &component,
            section,
            &run,
        ))
        .map_err(|error| TrainError::Plugin {
            context: format!("initialising the sft engine `{name}`"),
            error,
        })?;

    Ok(engine)
}

/// One supervised update on the examples at `indices`: the NLL before it, and its metrics.
fn sft_step(
    engine: &mut EngineHandle,
    examples: &[Example],
    indices: &[usize],
    step: u64,
) -> Result<(f64, Vec<Metric>), TrainError> {
    let plugin = |context: &str| {
        let context = context.to_owned();
        move |error| TrainError::Plugin { context, error }
    };
    let prompts: Vec<Vec<u32>> = indices.iter().map(|&i| examples[i].0.clone()).collect();
    let answers: Vec<Vec<u32>> = indices.iter().map(|&i| examples[i].1.clone()).collect();
    let mut input = batch::build(&prompts, &answers, 0).map_err(plugin("building an sft batch"))?;
    input.meta_json = json!({ "temperature": 1.0, "global_steps": step })
        .to_string()
        .into();
    let out = engine
        .compute_log_prob(&input)
        .map_err(plugin("sft log-probs"))?;
    let log_probs = out
        .require(keys::LOG_PROBS)
        .map_err(plugin("sft log-probs"))?
        .clone();
    let mask_tensor = input
        .require(keys::RESPONSE_MASK)
        .map_err(plugin("sft batch"))?
        .clone();
    let mask = batch::matrix(keys::RESPONSE_MASK, &mask_tensor).map_err(plugin("sft batch"))?;
    let nll = -masked_mean(
        &batch::matrix(keys::LOG_PROBS, &log_probs).map_err(plugin("sft log-probs"))?,
        &mask,
    )?;
    input.insert(keys::OLD_LOG_PROBS, log_probs);
    input.insert(keys::ADVANTAGES, mask_tensor);
    let metrics = engine.update_actor(&input).map_err(plugin("sft update"))?;
    Ok((nll, metrics))
}
