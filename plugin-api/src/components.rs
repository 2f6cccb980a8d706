//! The engine, rollout, checkpoint (weight sync) and tracker interfaces, as plugin authors implement
//! them. Every method has a default that reports "unsupported", so a component implements what its
//! role needs (a critic engine has no `compute_log_prob`).

use abi_stable::StableAbi;
use abi_stable::std_types::{ROption, RString, RVec};

use crate::{Batch, Metric, NamedTensor, PluginError, WeightBundle};

/// Where and as what a component runs. Rank and world size are here from the start so multi-rank
/// backends fit without an ABI change; `process_group` is an opaque handle owned by the host
/// (0 = single process).
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq, Default)]
pub struct RunContext {
    pub project: RString,
    pub experiment: RString,
    /// Directory for the run's local outputs (logs, tracker files).
    pub run_dir: RString,
    /// Torch device string, e.g. "cpu", "cuda:0".
    pub device: RString,
    pub rank: u32,
    pub world_size: u32,
    pub local_rank: u32,
    pub seed: u64,
    pub process_group: usize,
}

/// What a component is initialised with: its own config section as JSON (each plugin deserialises it
/// with serde) and the run context.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq, Default)]
pub struct ComponentInit {
    pub config_json: RString,
    pub run: RunContext,
}

impl ComponentInit {
    /// Deserialises the config section, naming the component in the error.
    pub fn config<T: serde::de::DeserializeOwned>(
        &self,
        component: &str,
    ) -> Result<T, PluginError> {
        let text = if self.config_json.is_empty() {
            "{}"
        } else {
            self.config_json.as_str()
        };
        serde_json::from_str(text)
            .map_err(|e| PluginError::invalid_config(format!("config of `{component}`: {e}")))
    }
}

/// A training backend (verl's `BaseEngine`): holds a model and its optimizer.
pub trait Engine: Send + 'static {
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
    /// Weights as named tensors, for weight sync to a rollout.
    fn export_weights(&mut self) -> Result<Vec<NamedTensor>, PluginError> {
        Err(PluginError::unsupported("export_weights"))
    }
    /// Writes a Hugging Face model directory.
    fn export_hf(&mut self, _dir: &str) -> Result<(), PluginError> {
        Err(PluginError::unsupported("export_hf"))
    }
}

/// Sampling parameters, with vLLM's meaning (`top_k = -1` disables top-k).
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub n: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub max_new_tokens: u32,
    pub greedy: bool,
    pub stop_token_ids: RVec<u32>,
    pub seed: ROption<u64>,
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
            stop_token_ids: RVec::new(),
            seed: ROption::RNone,
        }
    }
}

#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// Prompt token ids, unpadded, one list per prompt.
    pub prompts: RVec<RVec<u32>>,
    pub sampling: SamplingParams,
}

/// Why generation of one completion ended.
#[repr(transparent)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FinishReason(pub u8);

impl FinishReason {
    /// An EOS or stop token was produced.
    pub const STOP: Self = Self(0);
    /// `max_new_tokens` was reached.
    pub const LENGTH: Self = Self(1);
    pub const ABORT: Self = Self(2);

    pub fn as_str(self) -> &'static str {
        match self {
            Self::STOP => "stop",
            Self::LENGTH => "length",
            _ => "abort",
        }
    }
}

#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct Completion {
    /// Index into `GenerateRequest::prompts`; `n` completions share it.
    pub prompt_index: u32,
    pub response_ids: RVec<u32>,
    /// Log-prob of each sampled token under the sampling distribution.
    pub logprobs: RVec<f32>,
    pub finish_reason: FinishReason,
}

#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Default)]
pub struct GenerateOutput {
    pub completions: RVec<Completion>,
    /// The `global_steps` of the weights that produced the output, when known.
    pub weight_version: ROption<u64>,
}

/// A generator (verl's `BaseRollout`): in-process or an adapter to an inference server.
pub trait Rollout: Send + 'static {
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError>;
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError>;
    fn update_weights(&mut self, _weights: &WeightBundle) -> Result<(), PluginError> {
        Err(PluginError::unsupported("update_weights"))
    }
    /// Frees memory between generation phases (vLLM sleep level semantics).
    fn sleep(&mut self, _level: u32) -> Result<(), PluginError> {
        Ok(())
    }
    fn wake_up(&mut self) -> Result<(), PluginError> {
        Ok(())
    }
}

/// Moves weights from the trainer to the rollout (verl's `CheckpointEngine`): in memory, through
/// files, or over a collective.
pub trait CheckpointEngine: Send + 'static {
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError>;
    fn send_weights(&mut self, weights: &WeightBundle) -> Result<(), PluginError>;
    fn receive_weights(&mut self) -> Result<WeightBundle, PluginError>;
    /// Releases whatever a round of sending/receiving held (buffers, files).
    fn finalize(&mut self) -> Result<(), PluginError> {
        Ok(())
    }
}

/// A table of strings (validation samples: prompt, response, score).
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Default)]
pub struct Table {
    pub name: RString,
    pub columns: RVec<RString>,
    pub rows: RVec<RVec<RString>>,
}

/// A metrics sink (verl's `Tracking` backends).
pub trait Tracker: Send + 'static {
    /// `init.config_json` is the whole resolved run config (for params/hyper-parameters) merged with
    /// the tracker's own settings under the key of its name.
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError>;
    fn log(&mut self, step: u64, metrics: &[Metric]) -> Result<(), PluginError>;
    fn log_table(&mut self, _step: u64, _table: &Table) -> Result<(), PluginError> {
        Err(PluginError::unsupported("log_table"))
    }
    /// Flushes everything; `exit_code` 0 marks the run successful.
    fn finish(&mut self, exit_code: i32) -> Result<(), PluginError>;
}
