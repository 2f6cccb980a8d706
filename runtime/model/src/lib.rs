//! Running a model on libtorch (tch), as the engine and rollout plugins share it (core never links
//! it): decoder-only transformers of the Llama/Qwen2 family (and their mixture-of-experts
//! variants) read from Hugging Face model directories, KV-cache generation, per-token log-probs
//! and entropy, export back to a model directory, and the plugin ABI's tensors and lent weights
//! ([`interop`]). Training them verl's way is `verl-actor`'s.

mod config;
mod error;
mod generate;
pub mod interop;
mod kernels;
mod logprobs;
mod memory;
mod model;
mod rng;
mod spec;
#[cfg(feature = "testing")]
pub mod testing;
mod tokenizer;
mod weights;

pub use config::{Architecture, GenerationConfig, ModelConfig, MoeConfig, RopeScaling};
pub use error::{ModelError, Result, read_json, write_json};
pub use generate::{Completion, FinishReason, SamplingParams};
pub use logprobs::{
    DistillScores, FusedScores, ResponseScores, ScoreOutputs, TopkLogProbs, entropy_from_logits,
    fused_scores, log_probs_from_logits, sum_pi_squared_from_logits, topk_log_probs,
};
pub use model::{
    BlockContext, CausalLM, Head, LoadBalance, ModelOptions, NOT_SHARING_PROMPTS, Packing,
    RouterOutput, TensorParallel, load_balancing_loss,
};
pub use rng::Rng;
pub use spec::{Dtype, ModelSpec, parse_device};
pub use tokenizer::Tokenizer;
pub use weights::{INDEX_FILE, SINGLE_FILE, assign, read_safetensors, write_safetensors};
