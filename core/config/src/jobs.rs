//! The sections of the jobs built on the trainer: `quickstart.*` (what `verl-core run`'s embedded
//! default makes before training) and `sft.*` (supervised fine-tuning, `verl-core sft`). Their
//! types live here, with the rest of the schema, so that the config depends on nothing above it
//! (the jobs that read these sections depend on the config, not the other way round).

use serde::{Deserialize, Serialize};

use verl_data::synthetic::AdditionTask;

/// A tiny decoder for the synthetic task (character vocabulary): Llama, or with `num_experts`
/// a Qwen3-MoE whose every layer is a mixture of experts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TinyModel {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Experts per layer; 0: a dense Llama.
    pub num_experts: usize,
    /// Experts each token is routed to (with `num_experts`).
    pub num_experts_per_tok: usize,
}

impl Default for TinyModel {
    fn default() -> Self {
        Self {
            hidden_size: 64,
            intermediate_size: 256,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            num_experts: 0,
            num_experts_per_tok: 2,
        }
    }
}

/// `quickstart.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuickstartConfig {
    /// Make the synthetic data, the tiny model and its warm-up when they are missing.
    pub enable: bool,
    /// The only directory the quickstart writes into: data and model paths inside it are made
    /// when missing; paths elsewhere must exist and are used as given.
    pub dir: String,
    pub task: AdditionTask,
    pub model: TinyModel,
}

impl Default for QuickstartConfig {
    fn default() -> Self {
        Self {
            enable: false,
            dir: "checkpoints/verl-core-quickstart".into(),
            task: AdditionTask::default(),
            model: TinyModel::default(),
        }
    }
}

/// `sft.*`: supervised fine-tuning on the data's reference answers (`extra_info.answer`, else
/// `#### <ground_truth>`), through the actor engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftConfig {
    pub steps: u64,
    pub batch_size: usize,
    pub lr: f64,
    /// Model to start from; default `actor_rollout_ref.model.path`.
    pub base_model: Option<String>,
    /// Start from random weights (the base model's config.json) instead of its safetensors.
    pub random_init: bool,
    /// Where the Hugging Face directory is written.
    pub output_dir: Option<String>,
}

impl Default for SftConfig {
    fn default() -> Self {
        Self {
            steps: 100,
            batch_size: 64,
            lr: 1e-4,
            base_model: None,
            random_init: false,
            output_dir: None,
        }
    }
}
