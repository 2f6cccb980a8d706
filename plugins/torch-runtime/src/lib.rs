//! The libtorch (tch) runtime the engine and rollout plugins share (core never links it):
//! decoder-only transformers of the Llama/Qwen2 family read from Hugging Face model directories,
//! per-token log-probs and entropy, KV-cache generation, verl's PPO loss kernels, an AdamW optimiser
//! whose state saves and restores exactly, the ABI interop (tensors, lent weights), and [`actor`]:
//! verl's actor/critic semantics that every engine strategy runs on.

pub mod actor;
mod config;
pub mod distill;
mod error;
mod generate;
pub mod interop;
mod kernels;
mod logprobs;
pub mod losses;
mod memory;
mod model;
mod optim;
mod rng;
mod spec;
mod tokenizer;
mod weights;

pub use config::{Architecture, GenerationConfig, ModelConfig, MoeConfig, RopeScaling};
pub use error::{ModelError, Result};
pub use generate::{Completion, FinishReason, SamplingParams};
pub use logprobs::{
    DistillScores, FusedScores, ResponseScores, ScoreOutputs, TopkLogProbs, entropy_from_logits,
    fused_scores, log_probs_from_logits, sum_pi_squared_from_logits, topk_log_probs,
};
pub use model::{
    BlockContext, CausalLM, Head, LoadBalance, ModelOptions, NOT_SHARING_PROMPTS, Packing,
    RouterOutput, TensorParallel, load_balancing_loss,
};
pub use optim::{
    AdamW, AdamWConfig, LrDecay, LrSchedule, OPTIMIZER_FILE, TRAIN_STATE_FILE, TrainState,
    load_training_state, load_training_state_from, save_training_state,
};
pub use rng::Rng;
pub use spec::{Dtype, ModelSpec, parse_device};
pub use tokenizer::Tokenizer;
pub use weights::{INDEX_FILE, SINGLE_FILE, read_safetensors, write_safetensors};
