//! `verl-core generate` and `verl-core score`: one-off generation and scoring through the same
//! rollout and engine plugins training uses, for checking parity with other implementations.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};
use serde_json::json;
use verl_plugin_api::{ComponentKind, GenerateRequest, SamplingParams, keys};
use verl_plugin_host::Registry;

use verl_config::{Config, EngineRole, Slot};
use verl_trainer::batch;
use verl_trainer::limits::ContextWindow;
use verl_trainer::placement::Placement;
use verl_trainer::trainer::plugin_init;

#[derive(Debug, Serialize)]
pub struct GeneratedText {
    pub prompt_index: u32,
    pub response_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish_reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

pub fn load_tokenizer(model: &Path) -> anyhow::Result<tokenizers::Tokenizer> {
    let path = model.join("tokenizer.json");
    tokenizers::Tokenizer::from_file(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

pub fn encode(tokenizer: &tokenizers::Tokenizer, text: &str) -> anyhow::Result<Vec<u32>> {
    Ok(tokenizer
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("tokenizing {text:?}: {e}"))?
        .get_ids()
        .to_vec())
}

/// What `verl-core generate` generates with: the rollout component `rollout`, loaded from `model`
/// and configured with the keys of `actor_rollout_ref.rollout` the config sets (a file, variable
/// or override; the section's defaults size and type a training run's server, not this command's).
pub struct GenerateSpec<'a> {
    pub registry: &'a Registry,
    pub config: &'a Config,
    pub rollout: &'a str,
    pub model: &'a Path,
    pub placement: &'a Placement,
}

/// Generates with `spec`'s rollout. The longest prompt and `--max-new-tokens` must fit the
/// model's context; the rollout checks the rest of the request's size (`--n` included) against
/// the memory available.
pub fn generate(
    spec: &GenerateSpec<'_>,
    prompts: Vec<Vec<u32>>,
    sampling: SamplingParams,
    tokenizer: Option<&tokenizers::Tokenizer>,
) -> anyhow::Result<Vec<GeneratedText>> {
    let (rollout, model) = (spec.rollout, spec.model);
    if let Some(window) = ContextWindow::of_model(model) {
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        window.check(
            format!(
                "the longest prompt ({longest} tokens) + --max-new-tokens={}",
                sampling.max_new_tokens
            ),
            longest as u128 + u128::from(sampling.max_new_tokens),
        )?;
    }
    let component = spec.registry.resolve(ComponentKind::ROLLOUT, rollout)?;
    let mut generator = component.create_rollout()?;
    let mut section = json!({
        "model": { "path": model },
        "deterministic": spec.config.trainer.deterministic,
    });
    if let serde_json::Value::Object(all) = spec.config.rollout_json() {
        for (key, value) in all {
            if key != "model"
                && spec
                    .config
                    .sets(&format!("actor_rollout_ref.rollout.{key}"))
            {
                section[key.as_str()] = value;
            }
        }
    }
    generator
        .init(&plugin_init(
            spec.config,
            Slot::Rollout,
            &component,
            section,
            spec.placement.run(),
        ))
        .with_context(|| format!("initialising rollout `{rollout}`"))?;
    let request = GenerateRequest::new(prompts, sampling);
    let output = generator
        .generate(&request)
        .with_context(|| format!("rollout `{rollout}`"))?;
    output
        .completions
        .into_iter()
        .map(|c| {
            let ids = c.response_ids;
            let text = match tokenizer {
                Some(t) => Some(
                    t.decode(&ids, true)
                        .map_err(|e| anyhow::anyhow!("decoding: {e}"))?,
                ),
                None => None,
            };
            Ok(GeneratedText {
                prompt_index: c.prompt_index,
                response_ids: ids,
                logprobs: c.logprobs,
                finish_reason: c.finish_reason.as_str(),
                text,
            })
        })
        .collect()
}

#[derive(Debug, Deserialize)]
struct ScoreLine {
    prompt_ids: Vec<u32>,
    response_ids: Vec<u32>,
}

#[derive(Debug, Serialize)]
pub struct ScoredResponse {
    pub logprobs: Vec<f32>,
}

/// The token ids of `verl-core score`'s input: `(prompts, responses)`, one of each per line.
pub type ScoreInput = (Vec<Vec<u32>>, Vec<Vec<u32>>);

/// Reads `{"prompt_ids": […], "response_ids": […]}` lines, each of which must fit the context of
/// `model`; errors name the file and line.
pub fn read_score_input(path: &PathBuf, model: &Path) -> anyhow::Result<ScoreInput> {
    let window = ContextWindow::of_model(model);
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let (mut prompts, mut responses) = (Vec::new(), Vec::new());
    for (number, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("{}:{}", path.display(), number + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed: ScoreLine = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}", path.display(), number + 1))?;
        if parsed.prompt_ids.is_empty() {
            bail!("{}:{}: prompt_ids is empty", path.display(), number + 1);
        }
        if let Some(window) = &window {
            let (prompt, response) = (parsed.prompt_ids.len(), parsed.response_ids.len());
            window
                .check(
                    format!("{prompt} prompt_ids + {response} response_ids"),
                    (prompt + response) as u128,
                )
                .with_context(|| format!("{}:{}", path.display(), number + 1))?;
        }
        prompts.push(parsed.prompt_ids);
        responses.push(parsed.response_ids);
    }
    if prompts.is_empty() {
        bail!("{}: no input lines", path.display());
    }
    Ok((prompts, responses))
}

/// What `verl-core score` computes with: the verl config (overrides included) whose reference
/// role's section (`actor_rollout_ref.actor` overlaid with `…ref`, as the trainer's reference
/// policy) configures the engine, `engine` instead of that role's strategy when given, and the
/// model directory.
pub struct ScoreSpec<'a> {
    pub registry: &'a Registry,
    pub config: &'a Config,
    pub engine: Option<&'a str>,
    pub model: &'a Path,
    pub placement: &'a Placement,
}

/// Per-token log-probs of each response under the model, by the engine the strategy resolves to
/// on this platform. With several ranks (`verl-core launch`), each rank scores its contiguous
/// part of the lines as the trainer hands an engine its rows (the input padded with copies of the
/// last line to a multiple of the world size, so every rank runs the same number of
/// collectives); the parts are gathered over the engine's process group and every rank returns
/// all the lines' results.
pub fn score(
    spec: &ScoreSpec<'_>,
    prompts: &[Vec<u32>],
    responses: &[Vec<u32>],
) -> anyhow::Result<Vec<ScoredResponse>> {
    let (config, run) = (spec.config, spec.placement.run());
    let role = EngineRole::Ref;
    let (strategy, key) = match spec.engine {
        Some(engine) => (engine, "--engine"),
        None => (config.engine_strategy(role), config.strategy_key(role)),
    };
    let component = spec
        .registry
        .resolve_engine(strategy, &run.device_type)
        .with_context(|| format!("{key}={strategy}"))?;
    let engine = &component.name;
    let mut section = config.engine_json(role);
    section["strategy"] = json!(strategy);
    section["model"]["path"] = json!(spec.model);
    section["nccl_timeout"] = json!(config.actor_rollout_ref.nccl_timeout);
    let mut scorer = component.create_engine()?;
    scorer
        .init(&plugin_init(
            config,
            Slot::Engine(role),
            &component,
            section,
            run,
        ))
        .with_context(|| format!("initialising engine `{engine}`"))?;

    let world = run.world_size.max(1) as usize;
    let lines = prompts.len();
    let padded = lines.div_ceil(world) * world;
    let pad = |rows: &[Vec<u32>]| -> Vec<Vec<u32>> {
        let mut rows = rows.to_vec();
        rows.resize(padded, rows.last().cloned().unwrap_or_default());
        rows
    };
    let (prompts, responses) = (pad(prompts), pad(responses));
    let per_rank = padded / world;
    let mine = run.rank as usize * per_rank..(run.rank as usize + 1) * per_rank;
    // Every rank's rows from one batch, so their widths agree (a model-parallel group gathers them).
    let mut input = batch::slice_rows(&batch::build(&prompts, &responses, 0)?, mine.clone())?;
    input.meta_json = serde_json::json!({ "temperature": 1.0, "calculate_entropy": false })
        .to_string()
        .into();
    let output = scorer
        .compute_log_prob(&input)
        .with_context(|| format!("engine `{engine}`"))?;
    let lengths: Vec<usize> = responses[mine].iter().map(Vec::len).collect();
    let part = batch::response_values(&output, keys::LOG_PROBS, &lengths)?;
    let all = if world == 1 {
        part
    } else {
        // f32 bit patterns: exact across ranks.
        let bits: Vec<Vec<u32>> = part
            .iter()
            .map(|row| row.iter().map(|v| v.to_bits()).collect())
            .collect();
        let gathered = scorer
            .all_gather_object(&serde_json::to_vec(&bits)?)
            .with_context(|| format!("gathering the ranks' log-probs through engine `{engine}`"))?;
        let mut all = Vec::with_capacity(padded);
        for (rank, bytes) in gathered.iter().enumerate() {
            let rows: Vec<Vec<u32>> = serde_json::from_slice(bytes)
                .with_context(|| format!("rank {rank}'s log-probs"))?;
            all.extend(
                rows.into_iter()
                    .map(|row| row.into_iter().map(f32::from_bits).collect::<Vec<f32>>()),
            );
        }
        all
    };
    Ok(all
        .into_iter()
        .take(lines)
        .map(|logprobs| ScoredResponse { logprobs })
        .collect())
}
