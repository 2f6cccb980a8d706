//! `verl-core generate` and `verl-core score`: one-off generation and scoring through the same
//! rollout and engine plugins training uses, for checking parity with other implementations.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};
use verl_plugin_api::{ComponentKind, GenerateRequest, SamplingParams, keys};
use verl_plugin_host::Registry;

use crate::batch;
use crate::limits::ContextWindow;
use crate::placement::Placement;

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

/// Generates with the rollout component `rollout` loaded from `model`. The longest prompt and
/// `--max-new-tokens` must fit the model's context; the rollout checks the rest of the request's
/// size (`--n` included) against the memory available.
pub fn generate(
    registry: &Registry,
    rollout: &str,
    model: &Path,
    prompts: Vec<Vec<u32>>,
    sampling: SamplingParams,
    placement: &Placement,
    tokenizer: Option<&tokenizers::Tokenizer>,
) -> anyhow::Result<Vec<GeneratedText>> {
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
    let mut generator = registry
        .resolve(ComponentKind::ROLLOUT, rollout)?
        .create_rollout()?;
    let config = serde_json::json!({ "model": { "path": model } });
    generator
        .init(&placement.init(config))
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

/// Per-token log-probs of each response under `model`, computed by the engine component `engine`.
pub fn score(
    registry: &Registry,
    engine: &str,
    model: &Path,
    prompts: &[Vec<u32>],
    responses: &[Vec<u32>],
    placement: &Placement,
) -> anyhow::Result<Vec<ScoredResponse>> {
    let mut scorer = registry
        .resolve(ComponentKind::ENGINE, engine)?
        .create_engine()?;
    let config = serde_json::json!({ "role": "ref", "model": { "path": model } });
    scorer
        .init(&placement.init(config))
        .with_context(|| format!("initialising engine `{engine}`"))?;
    let mut input = batch::build(prompts, responses, 0)?;
    input.meta_json = serde_json::json!({ "temperature": 1.0, "calculate_entropy": false })
        .to_string()
        .into();
    let output = scorer
        .compute_log_prob(&input)
        .with_context(|| format!("engine `{engine}`"))?;
    let lengths: Vec<usize> = responses.iter().map(Vec::len).collect();
    Ok(batch::response_values(&output, keys::LOG_PROBS, &lengths)?
        .into_iter()
        .map(|logprobs| ScoredResponse { logprobs })
        .collect())
}
