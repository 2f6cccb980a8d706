//! The engine, rollout, checkpoint (weight sync) and tracker interfaces, as plugin authors implement
//! them, and the records they exchange. Every method has a default that reports "unsupported", so a
//! component implements what its role needs (a critic engine has no `compute_log_prob`).
//!
//! Records are `#[non_exhaustive]`: build them from `Default` (or their constructors) and set
//! fields, so a field added in a later 2.x release breaks neither the ABI nor a plugin's source.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::capabilities::{
    CheckpointCapabilities, EngineCapabilities, RolloutCapabilities, TrackerCapabilities,
};
use crate::{Batch, Metric, PluginError, TensorRef, WeightSource, WeightSourceKind};

/// Where and as what a component runs, including the rendezvous facts a multi-rank backend needs
/// (torchrun's convention: rank, world size, local rank, master address and port).
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(default)]
pub struct RunContext {
    pub project: String,
    pub experiment: String,
    /// Directory for the run's local outputs (logs, tracker files, weight handover files).
    pub run_dir: String,
    /// Torch device string, e.g. "cpu", "cuda:0", "npu:1".
    pub device: String,
    /// The selected platform's torch device type ("cpu", "cuda", "npu", …).
    pub device_type: String,
    /// Index of this rank's device among the visible ones; `None` on CPU.
    pub device_index: Option<u32>,
    pub rank: u32,
    pub world_size: u32,
    pub local_rank: u32,
    pub local_world_size: u32,
    /// Rendezvous store (c10d TCPStore) address and port; empty / 0 for a single process.
    pub master_addr: String,
    pub master_port: u16,
    /// Collective backend the selected platform reports ("gloo", "nccl", "hccl", …).
    pub comm_backend: String,
    pub seed: u64,
}

impl Default for RunContext {
    /// One process on the CPU.
    fn default() -> Self {
        Self {
            project: String::new(),
            experiment: String::new(),
            run_dir: String::new(),
            device: "cpu".into(),
            device_type: "cpu".into(),
            device_index: None,
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: String::new(),
            master_port: 0,
            comm_backend: "gloo".into(),
            seed: 0,
        }
    }
}

/// What a component is initialised with: its config section and the run context.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(default)]
pub struct ComponentInit {
    /// The component's config (verl's section for its role, with the plugin-owned sub-section).
    pub config: serde_json::Value,
    /// Dotted path of the plugin-owned section within the run config (e.g.
    /// `actor_rollout_ref.actor.fsdp_config`), for error messages; empty when there is none.
    pub section_path: String,
    /// Where each key of the plugin-owned section came from (full dotted path → "config file
    /// x.yaml", "command-line override `…`", …).
    pub config_origins: BTreeMap<String, String>,
    pub run: RunContext,
    /// Trackers only (they are initialised after the checkpoint is restored): the step the run
    /// resumes after, `None` for a run that starts from scratch. Records a tracker keeps for later
    /// steps were left by an interrupted attempt and are about to be trained again, so a tracker
    /// drops them where its backend allows; the trainer then logs again, from the checkpoint,
    /// the steps since the previous checkpoint, and a tracker that already holds one of them
    /// drops that call. The outcome: every step recorded exactly once.
    pub resume_step: Option<u64>,
}

impl ComponentInit {
    pub fn new(config: serde_json::Value, run: RunContext) -> Self {
        Self {
            config,
            run,
            ..Self::default()
        }
    }

    /// [`ComponentInit::config_origins`] as the JSON [`crate::config::parse_section`] takes.
    pub fn origins_json(&self) -> String {
        serde_json::to_string(&self.config_origins).expect("string maps serialise")
    }

    /// The whole config as the plugin-owned section, parsed strictly (unknown keys rejected with
    /// path, origin and the nearest valid key); `default_path` names it when the host sent no path.
    pub fn section<T: DeserializeOwned + Serialize>(
        &self,
        default_path: &str,
    ) -> Result<T, PluginError> {
        let path = if self.section_path.is_empty() {
            default_path
        } else {
            &self.section_path
        };
        crate::config::parse_section(path, &self.config.to_string(), &self.origins_json())
    }

    /// Deserialises the config, naming the component and the key path in the error. Unknown keys
    /// are ignored here: the host has validated verl's own keys.
    pub fn config<T: DeserializeOwned>(&self, component: &str) -> Result<T, PluginError> {
        let value = if self.config.is_null() {
            serde_json::Value::Object(Default::default())
        } else {
            self.config.clone()
        };
        serde_path_to_error::deserialize(value).map_err(|e| {
            PluginError::invalid_config(format!(
                "config of `{component}`: key `{}`: {}",
                e.path(),
                e.inner()
            ))
        })
    }
}

/// A training backend (verl's `BaseEngine`): holds a model and its optimizer.
pub trait Engine: Send + 'static {
    /// What this engine can do; shown by `plugins list` and checked by the trainer before step 1.
    fn capabilities() -> EngineCapabilities
    where
        Self: Sized,
    {
        EngineCapabilities::default()
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError>;
    /// Per-token log-probs (and entropy) of `responses` given `input_ids`/`attention_mask`, no grad.
    fn compute_log_prob(&mut self, _batch: &Batch) -> Result<Batch, PluginError> {
        Err(PluginError::unsupported("compute_log_prob"))
    }
    /// Per-token values from a value head, no grad.
    fn compute_values(&mut self, _batch: &Batch) -> Result<Batch, PluginError> {
        Err(PluginError::unsupported("compute_values"))
    }
    /// PPO-style policy update over mini/micro-batches; returns verl's `actor/*` metrics.
    fn update_actor(&mut self, _batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        Err(PluginError::unsupported("update_actor"))
    }
    /// Value-function update; returns verl's `critic/*` metrics.
    fn update_critic(&mut self, _batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        Err(PluginError::unsupported("update_critic"))
    }
    /// Saves the full training state (weights, optimizer, scheduler, RNG) under `dir`.
    fn save_checkpoint(&mut self, _dir: &str, _global_step: u64) -> Result<(), PluginError> {
        Err(PluginError::unsupported("save_checkpoint"))
    }
    /// Restores what `save_checkpoint` wrote; returns its global step.
    fn load_checkpoint(&mut self, _dir: &str) -> Result<u64, PluginError> {
        Err(PluginError::unsupported("load_checkpoint"))
    }
    /// The weights for a rollout, as views into the engine's own memory (no copy where the
    /// parameters are contiguous host memory). The views stay valid until the next call on the
    /// engine, which the borrow of `self` enforces.
    fn weights(&mut self) -> Result<Vec<TensorRef<'_>>, PluginError> {
        Err(PluginError::unsupported("weights"))
    }
    /// Writes a Hugging Face model directory.
    fn export_hf(&mut self, _dir: &str) -> Result<(), PluginError> {
        Err(PluginError::unsupported("export_hf"))
    }
    /// Every rank's `bytes`, in rank order, over the engine's process group (since 2.1.0; declare
    /// `EngineCapabilities::object_exchange`). Every rank calls it at the same point of the run
    /// (a collective); on one rank it returns `[bytes]`. For metadata (scores, metrics, agreement
    /// on a checkpoint), not bulk tensors. A lost peer is an error naming its rank.
    fn all_gather_object(&mut self, _bytes: &[u8]) -> Result<Vec<Vec<u8>>, PluginError> {
        Err(PluginError::unsupported("all_gather_object"))
    }
}

/// Sampling parameters, with vLLM's meaning (`top_k = -1` disables top-k).
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(default)]
pub struct SamplingParams {
    pub n: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub max_new_tokens: u32,
    pub greedy: bool,
    pub stop_token_ids: Vec<u32>,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            max_new_tokens: 512,
            greedy: false,
            stop_token_ids: Vec::new(),
            seed: None,
        }
    }
}

#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(default)]
pub struct GenerateRequest {
    /// Prompt token ids, unpadded, one list per prompt.
    pub prompts: Vec<Vec<u32>>,
    pub sampling: SamplingParams,
    /// One seed per prompt (since 2.1.0; empty: `sampling.seed` seeds the request): prompt `i`'s
    /// `n` samples depend on `seeds[i]` only, not on the other prompts of the request, so a batch
    /// sharded over data-parallel ranks samples what one rank would. A rollout that honours them
    /// declares `RolloutCapabilities::prompt_seeds`.
    pub seeds: Vec<u64>,
}

impl GenerateRequest {
    pub fn new(prompts: Vec<Vec<u32>>, sampling: SamplingParams) -> Self {
        Self {
            prompts,
            sampling,
            seeds: Vec::new(),
        }
    }

    /// With a seed per prompt (see [`GenerateRequest::seeds`]).
    pub fn with_seeds(mut self, seeds: Vec<u64>) -> Self {
        self.seeds = seeds;
        self
    }
}

/// Why generation of one completion ended. A reason added by a newer peer reads as `Other`.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An EOS or stop token was produced.
    #[default]
    Stop,
    /// `max_new_tokens` was reached.
    Length,
    Abort,
    #[serde(other)]
    Other,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Other => "other",
        }
    }
}

#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(default)]
pub struct Completion {
    /// Index into `GenerateRequest::prompts`; `n` completions share it.
    pub prompt_index: u32,
    pub response_ids: Vec<u32>,
    /// Log-prob of each sampled token under the sampling distribution.
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
    /// The experts a mixture-of-experts model routed each token through (since 2.4.0; verl's
    /// `routed_experts`, for rollout router replay), when the rollout records them
    /// (`RolloutCapabilities::routed_experts` and the run asks for it); `None` otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<RoutedExperts>,
}

/// Each token's experts, for every sparse layer: `[tokens][layers][top_k]` flattened, `tokens`
/// being every token the model was fed — the prompt and the response but its last token
/// (`prompt + response − 1`), as vLLM's `routed_experts` and verl's agent loop lay them out.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[serde(default)]
pub struct RoutedExperts {
    /// The model's sparse (mixture-of-experts) layers.
    pub layers: u32,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: u32,
    pub experts: Vec<u32>,
}

impl RoutedExperts {
    pub fn new(layers: u32, top_k: u32, experts: Vec<u32>) -> Self {
        Self {
            layers,
            top_k,
            experts,
        }
    }

    /// The tokens recorded, or why `experts` does not split into `[tokens][layers][top_k]`.
    pub fn tokens(&self) -> Result<usize, String> {
        let per_token = self.layers as usize * self.top_k as usize;
        if per_token == 0 || !self.experts.len().is_multiple_of(per_token) {
            return Err(format!(
                "{} expert ids do not split into tokens of {} layers × top-{}",
                self.experts.len(),
                self.layers,
                self.top_k
            ));
        }
        Ok(self.experts.len() / per_token)
    }
}

impl Completion {
    pub fn new(
        prompt_index: u32,
        response_ids: Vec<u32>,
        logprobs: Vec<f32>,
        finish_reason: FinishReason,
    ) -> Self {
        Self {
            prompt_index,
            response_ids,
            logprobs,
            finish_reason,
            routed_experts: None,
        }
    }

    /// With the experts each token was routed through (since 2.4.0).
    pub fn with_routed_experts(mut self, routed: RoutedExperts) -> Self {
        self.routed_experts = Some(routed);
        self
    }
}

#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(default)]
pub struct GenerateOutput {
    pub completions: Vec<Completion>,
    /// The version (trainer `global_steps`) of the weights that produced the output, when known.
    pub weight_version: Option<u64>,
}

impl GenerateOutput {
    pub fn new(completions: Vec<Completion>, weight_version: Option<u64>) -> Self {
        Self {
            completions,
            weight_version,
        }
    }
}

/// A generator (verl's `BaseRollout`): in-process or an adapter to an inference server.
pub trait Rollout: Send + 'static {
    /// What this rollout can do; shown by `plugins list` and checked by the trainer before step 1.
    fn capabilities() -> RolloutCapabilities
    where
        Self: Sized,
    {
        RolloutCapabilities::default()
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError>;
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError>;
    /// Takes new weights from `source`: borrowed tensors to copy, a directory to read, or a
    /// collective to join, as the capabilities declare.
    fn update_weights(&mut self, _source: &WeightSource<'_>) -> Result<(), PluginError> {
        Err(PluginError::unsupported("update_weights"))
    }
    /// Frees memory between generation phases (vLLM sleep level semantics).
    fn sleep(&mut self, _level: u32) -> Result<(), PluginError> {
        Err(PluginError::unsupported("sleep"))
    }
    fn wake_up(&mut self) -> Result<(), PluginError> {
        Err(PluginError::unsupported("wake_up"))
    }
}

/// What a weight sync hands the rollout: the tensors it was given (memory), a directory it wrote
/// (file), or a collective the rollout joins. The host turns it into the rollout's
/// [`WeightSource`].
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(default)]
pub struct Handover {
    pub kind: WeightSourceKind,
    /// For [`WeightSourceKind::File`]: a directory of safetensors files.
    pub path: String,
    /// Anything else the rollout needs (a collective's group name and address, …).
    pub meta: serde_json::Value,
}

impl Handover {
    /// Hand the sender's tensors over as they are.
    pub fn memory() -> Self {
        Self::default()
    }

    pub fn file(path: impl Into<String>) -> Self {
        Self {
            kind: WeightSourceKind::File,
            path: path.into(),
            meta: serde_json::Value::Null,
        }
    }

    pub fn collective(meta: serde_json::Value) -> Self {
        Self {
            kind: WeightSourceKind::Collective,
            path: String::new(),
            meta,
        }
    }
}

/// Moves weights from the trainer to the rollout (verl's `CheckpointEngine`): in memory, through
/// files, or over a collective.
pub trait CheckpointEngine: Send + 'static {
    fn capabilities() -> CheckpointCapabilities
    where
        Self: Sized,
    {
        CheckpointCapabilities::default()
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError>;
    /// Publishes `weights` (always borrowed host memory) and says where the rollout finds them.
    fn send_weights(&mut self, weights: &WeightSource<'_>) -> Result<Handover, PluginError>;
    /// Called once the rollout has taken the weights: releases buffers, files.
    fn finalize(&mut self) -> Result<(), PluginError> {
        Ok(())
    }
}

/// A table of strings (validation samples: prompt, response, score).
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(default)]
pub struct Table {
    pub name: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(name: impl Into<String>, columns: Vec<String>, rows: Vec<Vec<String>>) -> Self {
        Self {
            name: name.into(),
            columns,
            rows,
        }
    }
}

/// A metrics sink (verl's `Tracking` backends).
pub trait Tracker: Send + 'static {
    fn capabilities() -> TrackerCapabilities
    where
        Self: Sized,
    {
        TrackerCapabilities::default()
    }
    /// `init.config` is the whole resolved run config (for params/hyper-parameters) merged with
    /// the tracker's own settings under the key of its name.
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError>;
    fn log(&mut self, step: u64, metrics: &[Metric]) -> Result<(), PluginError>;
    fn log_table(&mut self, _step: u64, _table: &Table) -> Result<(), PluginError> {
        Err(PluginError::unsupported("log_table"))
    }
    /// Flushes everything; `exit_code` 0 marks the run successful.
    fn finish(&mut self, exit_code: i32) -> Result<(), PluginError>;
}
