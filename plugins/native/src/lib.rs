//! # verl-plugin-native
//!
//! The `native` rollout component: in-process generation with verl-model's batched KV-cache
//! decoder, the default when no inference server is configured. Prompts of different lengths are
//! left-padded into one batch and prefilled once; `n` samples per prompt share the prefill.
//!
//! Config (`ComponentInit::config_json`): verl's `actor_rollout_ref.rollout` section plus
//! `"model": {"path", "random_init", "dtype"}`. Sampling settings come with each request
//! ([`verl_plugin_api::SamplingParams`]); of the section itself only
//! `ignore_eos` and `deterministic` (`trainer.deterministic`: batch-invariant kernels, greedy
//! tokens and log-probs bit-identical in any batch and equal to the fsdp engine's) are read (the trainer folds `temperature`, `top_p`, `top_k`, `n` into the request;
//! the model's dtype is `model.dtype`, not the section's vLLM-oriented `dtype`).
//!
//! EOS ids come from the model's `generation_config.json` (else `config.json`); `stop_token_ids`
//! add to them. A request without a seed draws one from the run seed, so a run is reproducible
//! while successive calls differ; a request with a seed per prompt (`GenerateRequest::seeds`)
//! samples each prompt from its own seed, independently of the rest of the batch. New weights come by reference: borrowed tensors (copied once,
//! straight into the parameters) or a safetensors directory. There is no `sleep` / `wake_up`: the
//! KV cache only lives during a `generate` call, so between calls there is nothing to free but the
//! weights, which the next `generate` needs anyway.

use serde::Deserialize;
use std::path::Path;

use verl_model::{CausalLM, Head, ModelError, ModelSpec, Rng, parse_device};
use verl_plugin_api::{
    Completion, ComponentInit, ConfigKeys, FinishReason, GenerateOutput, GenerateRequest,
    PluginBuilder, PluginError, Rollout, RolloutCapabilities, RoutedExperts, SamplingParams,
    WeightSource, WeightSourceKind,
};

/// The keys of the rollout section this component acts on.
#[derive(Debug, Deserialize)]
struct RolloutConfig {
    model: ModelSpec,
    /// Keep generating past EOS (only `stop_token_ids` and the length limit end a sequence).
    #[serde(default)]
    ignore_eos: bool,
    /// `trainer.deterministic`, which verl-core copies into the section: batch-invariant
    /// kernels (see `CausalLM::set_batch_invariant`).
    #[serde(default)]
    deterministic: bool,
    /// verl's rollout router replay (R3): return each token's experts with the completions.
    #[serde(default)]
    enable_rollout_routing_replay: bool,
}

#[derive(Debug, thiserror::Error)]
enum RolloutError {
    #[error("the rollout is not initialised: call `init` first")]
    NotInitialised,
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Plugin(#[from] PluginError),
}

impl From<RolloutError> for PluginError {
    fn from(e: RolloutError) -> Self {
        match e {
            RolloutError::Model(e) => e.into(),
            RolloutError::Plugin(e) => e,
            RolloutError::NotInitialised => PluginError::other(e.to_string()),
        }
    }
}

struct Generator {
    model: CausalLM,
    eos_token_ids: Vec<i64>,
    ignore_eos: bool,
    /// `[sparse layers, top_k]` of a mixture-of-experts model whose routing is returned
    /// (`enable_rollout_routing_replay`).
    routing: Option<(u32, u32)>,
    /// Seeds for requests that bring none.
    seeds: Rng,
    weight_version: Option<u64>,
}

impl Generator {
    fn new(init: &ComponentInit) -> Result<Self, RolloutError> {
        let config: RolloutConfig = init.config("native")?;
        let device = parse_device(&init.run.device)?;
        let mut model = config.model.load(device, Head::Lm, init.run.seed)?;
        model.set_trainable(false);
        model.set_batch_invariant(config.deterministic);
        let eos_token_ids = config
            .model
            .generation_config(model.config())?
            .eos_token_ids;
        let routing = if config.enable_rollout_routing_replay {
            let Some(moe) = &model.config().moe else {
                return Err(PluginError::invalid_config(
                    "actor_rollout_ref.rollout.enable_rollout_routing_replay=true: the model has no mixture-of-experts layers whose routing could be replayed",
                )
                .into());
            };
            // Layer and expert counts come from config.json, far below u32::MAX.
            Some((model.sparse_layers() as u32, moe.num_experts_per_tok as u32))
        } else {
            None
        };
        Ok(Self {
            model,
            eos_token_ids,
            ignore_eos: config.ignore_eos,
            routing,
            seeds: Rng::stream(init.run.seed, 2),
            weight_version: None,
        })
    }

    fn sampling(&mut self, p: &SamplingParams, prompt_seeds: &[u64]) -> verl_model::SamplingParams {
        verl_model::SamplingParams {
            n: p.n as usize,
            max_new_tokens: p.max_new_tokens as usize,
            // verl-model's greedy decoding is temperature 0.
            temperature: if p.greedy {
                0.0
            } else {
                f64::from(p.temperature)
            },
            top_p: f64::from(p.top_p),
            top_k: i64::from(p.top_k),
            stop_token_ids: p.stop_token_ids.iter().map(|&id| i64::from(id)).collect(),
            ignore_eos: self.ignore_eos,
            seed: p.seed.unwrap_or_else(|| self.seeds.next_u64()),
            prompt_seeds: prompt_seeds.to_vec(),
        }
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, RolloutError> {
        let prompts: Vec<Vec<i64>> = request
            .prompts
            .iter()
            .map(|p| p.iter().map(|&id| i64::from(id)).collect())
            .collect();
        let params = self.sampling(&request.sampling, &request.seeds);
        let completions = self
            .model
            .generate(&prompts, &params, &self.eos_token_ids)?;
        let completions = completions
            .into_iter()
            .map(|c| {
                let completion = Completion::new(
                    c.prompt_index as u32,
                    // Ids come from the vocabulary, so they are non-negative and fit.
                    c.response_ids.iter().map(|&id| id as u32).collect(),
                    c.logprobs,
                    match c.finish_reason {
                        verl_model::FinishReason::Stop => FinishReason::Stop,
                        verl_model::FinishReason::Length => FinishReason::Length,
                    },
                );
                match self.routing {
                    // Expert ids lie in [0, num_experts).
                    Some((layers, top_k)) => completion.with_routed_experts(RoutedExperts::new(
                        layers,
                        top_k,
                        c.routed_experts.iter().map(|&e| e as u32).collect(),
                    )),
                    None => completion,
                }
            })
            .collect();
        Ok(GenerateOutput::new(completions, self.weight_version))
    }

    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), RolloutError> {
        let handover = source.handover()?;
        match handover.kind {
            WeightSourceKind::Memory => {
                self.model.load_views(&source.tensors)?;
            }
            WeightSourceKind::File => self.model.load_weights_dir(Path::new(&handover.path))?,
            other => {
                return Err(PluginError::unsupported(&format!(
                    "update_weights from a {} source",
                    other.as_str()
                ))
                .into());
            }
        }
        self.weight_version = Some(source.version);
        Ok(())
    }
}

/// The `native` rollout as the ABI sees it: a generator once `init` has run.
#[derive(Default)]
pub struct NativeRollout {
    generator: Option<Generator>,
}

impl NativeRollout {
    fn generator(&mut self) -> Result<&mut Generator, RolloutError> {
        self.generator.as_mut().ok_or(RolloutError::NotInitialised)
    }
}

impl Rollout for NativeRollout {
    fn capabilities() -> RolloutCapabilities {
        RolloutCapabilities::default()
            .weight_sources([WeightSourceKind::Memory, WeightSourceKind::File])
            .logprobs(true)
            .prompt_seeds(true)
            .routed_experts(true)
            .config_keys(ConfigKeys::default().acts_on(["enable_rollout_routing_replay"]))
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        self.generator = Some(Generator::new(init)?);
        Ok(())
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        Ok(self.generator()?.generate(request)?)
    }
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        Ok(self.generator()?.update_weights(source)?)
    }
}

verl_plugin_api::export_plugin!(
    PluginBuilder::new(
        "native",
        env!("CARGO_PKG_VERSION"),
        "in-process libtorch generation"
    )
    .rollout(
        "native",
        100,
        "batched KV-cache generation in the trainer's process (verl-model)",
        NativeRollout::default
    )
);
