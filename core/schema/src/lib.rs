//! verl's config sections as typed structs: key names and defaults as verl's `ppo_trainer.yaml`
//! has them, for the keys verl-core reads or that verl's own example scripts set. Additions of
//! ours are marked. The root document, its layering and its audit are `verl-config`'s.

mod distill;

use std::collections::BTreeMap;

use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Value, json};

use verl_algo::{
    AdvEstimator, AdvantageParams, AlgoError, IsLevel, KlController, KlCtrlType, KlPenalty,
    RolloutCorrection,
};

pub use distill::{DistillationConfig, DistillationLossConfig, TeacherModelConfig};

/// verl accepts a single string where a list is expected (`trainer.logger=console`,
/// `data.train_files=a.parquet`).
fn one_or_many<'de, D: Deserializer<'de>>(de: D) -> Result<Vec<String>, D::Error> {
    struct OneOrMany;
    impl<'de> Visitor<'de> for OneOrMany {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a string or a list of strings")
        }
        fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Self::Value, E> {
            Ok(vec![s.to_owned()])
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut items = Vec::new();
            while let Some(item) = seq.next_element()? {
                items.push(item);
            }
            Ok(items)
        }
    }
    de.deserialize_any(OneOrMany)
}

fn empty_object() -> Value {
    json!({})
}

/// Plugin-owned sections in a verl section: the plugin sections a caller declares (verl-config's
/// `PluginSections`) that the config sets, by name, unchecked here (their plugin checks them).
/// Flattened, so every struct holding one takes unknown keys from serde: verl-config's schema walk
/// is what rejects them, before deserialisation.
pub type Sections = BTreeMap<String, Value>;

/// `data.truncation`: what to do with a prompt longer than `max_prompt_length`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Truncation {
    Error,
    /// Keep the last tokens.
    Left,
    /// Keep the first tokens.
    Right,
    /// Keep the first and last halves.
    Middle,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    pub tokenizer: Option<String>,
    pub use_shm: bool,
    #[serde(deserialize_with = "one_or_many")]
    pub train_files: Vec<String>,
    #[serde(deserialize_with = "one_or_many")]
    pub val_files: Vec<String>,
    /// −1: all rows.
    pub train_max_samples: i64,
    pub val_max_samples: i64,
    pub prompt_key: String,
    /// The column the reward is dispatched on.
    pub reward_fn_key: String,
    pub max_prompt_length: usize,
    pub max_response_length: usize,
    /// Prompts per step (each sampled `rollout.n` times).
    pub train_batch_size: usize,
    /// Prompts per generation round (DAPO); None: `train_batch_size`. Without
    /// `algorithm.filter_groups` a step trains on the whole round, as verl's trainer does.
    pub gen_batch_size: Option<usize>,
    /// None: the whole validation set at once.
    pub val_batch_size: Option<usize>,
    pub return_raw_chat: bool,
    pub return_full_prompt: bool,
    pub shuffle: bool,
    /// Shuffle seed; None: `trainer.seed`.
    pub seed: Option<u64>,
    pub dataloader_num_workers: usize,
    pub validation_shuffle: bool,
    pub filter_overlong_prompts: bool,
    pub filter_overlong_prompts_workers: usize,
    pub truncation: Truncation,
    pub trust_remote_code: bool,
    pub apply_chat_template_kwargs: Value,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            tokenizer: None,
            use_shm: false,
            train_files: vec!["~/data/rlhf/gsm8k/train.parquet".into()],
            val_files: vec!["~/data/rlhf/gsm8k/test.parquet".into()],
            train_max_samples: -1,
            val_max_samples: -1,
            prompt_key: "prompt".into(),
            reward_fn_key: "data_source".into(),
            max_prompt_length: 512,
            max_response_length: 512,
            train_batch_size: 1024,
            gen_batch_size: None,
            val_batch_size: None,
            return_raw_chat: true,
            return_full_prompt: false,
            shuffle: true,
            seed: None,
            dataloader_num_workers: 8,
            validation_shuffle: false,
            filter_overlong_prompts: false,
            filter_overlong_prompts_workers: 1,
            truncation: Truncation::Error,
            trust_remote_code: false,
            apply_chat_template_kwargs: empty_object(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorRolloutRefConfig {
    pub hybrid_engine: bool,
    /// Seconds verl's collectives wait.
    pub nccl_timeout: u64,
    pub model: ModelConfig,
    pub actor: ActorConfig,
    #[serde(rename = "ref")]
    pub reference: RefConfig,
    pub rollout: RolloutConfig,
}

impl Default for ActorRolloutRefConfig {
    fn default() -> Self {
        Self {
            hybrid_engine: true,
            nccl_timeout: 600,
            model: ModelConfig::default(),
            actor: ActorConfig::default(),
            reference: RefConfig::default(),
            rollout: RolloutConfig::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// A Hugging Face model directory.
    pub path: String,
    pub tokenizer_path: Option<String>,
    /// Jinja source overriding the tokenizer's chat template.
    pub custom_chat_template: Option<String>,
    pub external_lib: Option<String>,
    pub override_config: Value,
    pub enable_gradient_checkpointing: bool,
    pub enable_activation_offload: bool,
    pub use_remove_padding: bool,
    pub use_shm: bool,
    pub trust_remote_code: bool,
    pub lora_rank: usize,
    pub lora_alpha: usize,
    pub use_liger: bool,
    pub use_fused_kernels: bool,
    /// Ours: build the weights from `config.json` and the seed instead of reading them.
    pub random_init: bool,
    /// Ours: parameter dtype of the engine (`float32` | `bfloat16`).
    pub dtype: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: "~/models/deepseek-llm-7b-chat".into(),
            tokenizer_path: None,
            custom_chat_template: None,
            external_lib: None,
            override_config: empty_object(),
            enable_gradient_checkpointing: true,
            enable_activation_offload: false,
            // verl's default. The results are the padded ones either way (README, *Packed
            // batches*), and packed is the faster pass.
            use_remove_padding: true,
            use_shm: false,
            trust_remote_code: false,
            lora_rank: 0,
            lora_alpha: 16,
            use_liger: false,
            use_fused_kernels: false,
            random_init: false,
            dtype: "float32".into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    pub optimizer: String,
    pub lr: f64,
    pub lr_warmup_steps_ratio: f64,
    /// −1: filled in by the trainer.
    pub total_training_steps: i64,
    pub weight_decay: f64,
    /// −1: derived from `lr_warmup_steps_ratio`.
    pub lr_warmup_steps: i64,
    pub betas: [f64; 2],
    pub clip_grad: f64,
    pub min_lr_ratio: f64,
    pub num_cycles: f64,
    /// `constant` | `cosine`.
    pub lr_scheduler_type: String,
    /// Older spelling of `lr_scheduler_type`.
    pub warmup_style: Option<String>,
}

impl OptimConfig {
    fn with_lr(lr: f64) -> Self {
        Self {
            optimizer: "AdamW".into(),
            lr,
            lr_warmup_steps_ratio: 0.0,
            total_training_steps: -1,
            weight_decay: 0.01,
            lr_warmup_steps: -1,
            betas: [0.9, 0.999],
            clip_grad: 1.0,
            min_lr_ratio: 0.0,
            num_cycles: 0.5,
            lr_scheduler_type: "constant".into(),
            warmup_style: None,
        }
    }
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self::with_lr(1e-6)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyLossConfig {
    /// `vanilla` | `gspo` | `dppo_tv` | … (the engine validates).
    pub loss_mode: String,
    /// Clip-Cov: share of tokens whose gradient is removed, and the covariance window.
    pub clip_cov_ratio: f64,
    pub clip_cov_lb: f64,
    pub clip_cov_ub: f64,
    /// KL-Cov: share of tokens penalised, and the penalty's coefficient.
    pub kl_cov_ratio: f64,
    pub ppo_kl_coef: f64,
    /// DRO's β (required with `dro`).
    pub dro_beta: Option<f64>,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        Self {
            loss_mode: "vanilla".into(),
            clip_cov_ratio: 0.0002,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 0.0002,
            ppo_kl_coef: 0.1,
            dro_beta: None,
        }
    }
}

/// verl's `router_replay.mode` (`RouterReplayConfig`) for mixture-of-experts policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum RouterReplayMode {
    #[default]
    #[serde(rename = "disabled")]
    Disabled,
    /// The old-log-prob forward records each token's experts; the update replays them.
    R2,
    /// The rollout records each token's experts (`rollout.enable_rollout_routing_replay`); the
    /// old-log-prob forward and the update replay them.
    R3,
}

/// verl's `router_replay` section of the actor and the reference.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterReplayConfig {
    pub mode: RouterReplayMode,
    /// Declared by verl, read by none of its workers.
    pub record_file: Option<String>,
    pub replay_file: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ActorConfig {
    /// The engine plugin (`fsdp`, `megatron`, …).
    pub strategy: String,
    /// Prompts per optimizer step (the engine gets it × `rollout.n`).
    pub ppo_mini_batch_size: usize,
    pub ppo_micro_batch_size: Option<usize>,
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    pub use_dynamic_bsz: bool,
    pub ppo_max_token_len_per_gpu: usize,
    pub clip_ratio: f64,
    /// None: `clip_ratio`.
    pub clip_ratio_low: Option<f64>,
    pub clip_ratio_high: Option<f64>,
    pub clip_ratio_c: f64,
    pub policy_loss: PolicyLossConfig,
    /// SAPO's gate temperatures for positive and other advantages.
    pub tau_pos: f64,
    pub tau_neg: f64,
    /// `token-mean` | `token-sum` | `seq-mean-token-sum` | `seq-mean-token-mean` |
    /// `seq-mean-token-sum-norm`.
    pub loss_agg_mode: String,
    pub entropy_coeff: f64,
    /// The log-prob pass also returns Σπ² per token (the optimal token baselines need it; it
    /// also gives the `variance_proxy/*` metrics).
    pub calculate_sum_pi_squared: bool,
    /// verl recomputes Σπ² in the backward to save memory; no effect here.
    pub sum_pi_squared_checkpointing: bool,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f64,
    pub kl_loss_type: String,
    pub ppo_epochs: usize,
    pub shuffle: bool,
    pub data_loader_seed: u64,
    /// Older place of `optim.clip_grad`.
    pub grad_clip: Option<f64>,
    pub ulysses_sequence_parallel_size: usize,
    pub use_torch_compile: bool,
    pub optim: OptimConfig,
    pub profiler: Value,
    pub router_replay: RouterReplayConfig,
    /// verl's prefix grouper: each distinct prompt of a packed micro-batch is computed once and
    /// its `rollout.n` samples attend it (the same results, less compute). None: on wherever the
    /// engine packs (`model.use_remove_padding`); verl's default is off, because its
    /// implementation patches padded attention and excludes packing.
    pub use_prefix_grouper: Option<bool>,
    /// The engine's section (`fsdp_config`, `megatron`, …).
    #[serde(flatten)]
    pub sections: Sections,
}

impl Default for ActorConfig {
    fn default() -> Self {
        Self {
            strategy: "fsdp".into(),
            ppo_mini_batch_size: 256,
            ppo_micro_batch_size: None,
            ppo_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            ppo_max_token_len_per_gpu: 16384,
            clip_ratio: 0.2,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_c: 3.0,
            policy_loss: PolicyLossConfig::default(),
            tau_pos: 1.0,
            tau_neg: 1.05,
            loss_agg_mode: "token-mean".into(),
            entropy_coeff: 0.0,
            calculate_sum_pi_squared: false,
            sum_pi_squared_checkpointing: false,
            use_kl_loss: false,
            kl_loss_coef: 0.001,
            kl_loss_type: "low_var_kl".into(),
            ppo_epochs: 1,
            shuffle: false,
            data_loader_seed: 42,
            grad_clip: None,
            ulysses_sequence_parallel_size: 1,
            use_torch_compile: true,
            optim: OptimConfig::default(),
            profiler: empty_object(),
            router_replay: RouterReplayConfig::default(),
            use_prefix_grouper: None,
            sections: Sections::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RefConfig {
    /// None: the actor's strategy.
    pub strategy: Option<String>,
    pub log_prob_micro_batch_size: Option<usize>,
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    /// None: `actor.use_dynamic_bsz` (verl's interpolation).
    pub log_prob_use_dynamic_bsz: Option<bool>,
    /// None: `actor.ppo_max_token_len_per_gpu` (verl's interpolation).
    pub log_prob_max_token_len_per_gpu: Option<usize>,
    pub ulysses_sequence_parallel_size: usize,
    pub profiler: Value,
    pub router_replay: RouterReplayConfig,
    /// The engine's section, not inherited from the actor's (verl's ref has its own).
    #[serde(flatten)]
    pub sections: Sections,
}

impl Default for RefConfig {
    fn default() -> Self {
        Self {
            strategy: None,
            log_prob_micro_batch_size: None,
            log_prob_micro_batch_size_per_gpu: None,
            log_prob_use_dynamic_bsz: None,
            log_prob_max_token_len_per_gpu: None,
            ulysses_sequence_parallel_size: 1,
            profiler: empty_object(),
            router_replay: RouterReplayConfig::default(),
            sections: Sections::new(),
        }
    }
}

/// `actor_rollout_ref.rollout.val_kwargs`: sampling for validation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ValKwargs {
    pub top_k: i64,
    pub top_p: f64,
    pub temperature: f64,
    pub n: usize,
    pub do_sample: bool,
}

impl Default for ValKwargs {
    fn default() -> Self {
        Self {
            top_k: -1,
            top_p: 1.0,
            temperature: 0.0,
            n: 1,
            do_sample: false,
        }
    }
}

/// `actor_rollout_ref.rollout.checkpoint_engine`: how weights reach the rollout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointEngineConfig {
    /// The checkpoint component (`naive` in-process, `disk` safetensors, …).
    pub backend: String,
    pub update_weights_bucket_megabytes: usize,
    /// Backend sections by backend name (verl passes the selected backend's entry).
    pub engine_kwargs: Value,
}

impl Default for CheckpointEngineConfig {
    fn default() -> Self {
        Self {
            backend: "naive".into(),
            update_weights_bucket_megabytes: 2048,
            engine_kwargs: empty_object(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutConfig {
    /// The rollout plugin (`native`, `vllm`, `sglang`). verl has no default; ours is `native`.
    pub name: String,
    pub mode: String,
    pub temperature: f64,
    pub top_k: i64,
    pub top_p: f64,
    pub do_sample: bool,
    /// Responses per prompt.
    pub n: usize,
    /// None: `data.max_prompt_length` / `data.max_response_length`.
    pub prompt_length: Option<usize>,
    pub response_length: Option<usize>,
    pub dtype: String,
    pub gpu_memory_utilization: f64,
    pub ignore_eos: bool,
    pub enforce_eager: bool,
    pub free_cache_engine: bool,
    /// A GPU inference server started able to free its memory (vLLM's `--enable-sleep-mode`).
    pub enable_sleep_mode: bool,
    /// verl's default is 2; ours is 1 (one device is the common case here).
    pub tensor_model_parallel_size: usize,
    pub data_parallel_size: usize,
    pub pipeline_model_parallel_size: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: Option<usize>,
    pub max_num_seqs: usize,
    pub enable_chunked_prefill: bool,
    pub enable_prefix_caching: bool,
    pub load_format: String,
    pub log_prob_micro_batch_size: Option<usize>,
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    /// None: `actor.use_dynamic_bsz` (verl's interpolation).
    pub log_prob_use_dynamic_bsz: Option<bool>,
    /// None: `actor.ppo_max_token_len_per_gpu` (verl's interpolation).
    pub log_prob_max_token_len_per_gpu: Option<usize>,
    pub disable_log_stats: bool,
    pub calculate_log_probs: bool,
    pub skip_tokenizer_init: bool,
    /// Return each token's experts with the completions (verl's rollout router replay, R3).
    pub enable_rollout_routing_replay: bool,
    /// Rollout sections by engine name; verl's default names its two engines, ours none.
    pub engine_kwargs: Value,
    pub val_kwargs: ValKwargs,
    pub checkpoint_engine: CheckpointEngineConfig,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            name: "native".into(),
            mode: "async".into(),
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
            do_sample: true,
            n: 1,
            prompt_length: None,
            response_length: None,
            dtype: "bfloat16".into(),
            gpu_memory_utilization: 0.5,
            ignore_eos: false,
            enforce_eager: false,
            free_cache_engine: true,
            enable_sleep_mode: true,
            tensor_model_parallel_size: 1,
            data_parallel_size: 1,
            pipeline_model_parallel_size: 1,
            max_num_batched_tokens: 8192,
            max_model_len: None,
            max_num_seqs: 256,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            load_format: "dummy".into(),
            log_prob_micro_batch_size: None,
            log_prob_micro_batch_size_per_gpu: None,
            log_prob_use_dynamic_bsz: None,
            log_prob_max_token_len_per_gpu: None,
            disable_log_stats: true,
            calculate_log_probs: false,
            skip_tokenizer_init: true,
            enable_rollout_routing_replay: false,
            engine_kwargs: empty_object(),
            val_kwargs: ValKwargs::default(),
            checkpoint_engine: CheckpointEngineConfig::default(),
        }
    }
}

/// `critic`. Keys verl interpolates from the actor are options here, resolved by
/// verl-config's `Config::engine_json`. `critic.model` is free-form: `path`
/// (None: the actor's model), `random_init`, `dtype`, `enable_gradient_checkpointing`, and verl's
/// pass-through keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CriticConfig {
    /// None: enabled exactly when the advantage estimator needs a critic (GAE).
    pub enable: Option<bool>,
    pub strategy: String,
    pub optim: OptimConfig,
    pub model: Value,
    pub ppo_mini_batch_size: Option<usize>,
    pub ppo_micro_batch_size: Option<usize>,
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    pub forward_micro_batch_size: Option<usize>,
    pub forward_micro_batch_size_per_gpu: Option<usize>,
    /// None: `actor_rollout_ref.actor.use_dynamic_bsz` (verl's interpolation).
    pub use_dynamic_bsz: Option<bool>,
    pub ppo_max_token_len_per_gpu: usize,
    /// None: `ppo_max_token_len_per_gpu` (verl's interpolation).
    pub forward_max_token_len_per_gpu: Option<usize>,
    pub ppo_epochs: Option<usize>,
    pub shuffle: bool,
    pub data_loader_seed: u64,
    pub cliprange_value: f64,
    pub loss_agg_mode: Option<String>,
    pub grad_clip: Option<f64>,
    pub ulysses_sequence_parallel_size: usize,
    pub profiler: Value,
    /// The engine's section.
    #[serde(flatten)]
    pub sections: Sections,
}

impl Default for CriticConfig {
    fn default() -> Self {
        Self {
            enable: None,
            strategy: "fsdp".into(),
            optim: OptimConfig::with_lr(1e-5),
            model: json!({"path": null, "enable_gradient_checkpointing": true, "use_remove_padding": false, "fsdp_config": {}}),
            ppo_mini_batch_size: None,
            ppo_micro_batch_size: None,
            ppo_micro_batch_size_per_gpu: None,
            forward_micro_batch_size: None,
            forward_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: None,
            ppo_max_token_len_per_gpu: 32768,
            forward_max_token_len_per_gpu: None,
            ppo_epochs: None,
            shuffle: false,
            data_loader_seed: 42,
            cliprange_value: 0.5,
            loss_agg_mode: None,
            grad_clip: None,
            ulysses_sequence_parallel_size: 1,
            profiler: empty_object(),
            sections: Sections::new(),
        }
    }
}

/// `reward_model`: the reward manager and DAPO's overlong buffer; a model-based reward is not
/// built in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardModelConfig {
    pub enable: bool,
    pub strategy: String,
    pub model: Value,
    pub micro_batch_size: Option<usize>,
    pub micro_batch_size_per_gpu: Option<usize>,
    pub max_length: Option<usize>,
    /// `naive` | `dapo`.
    pub reward_manager: String,
    pub launch_reward_fn_async: bool,
    pub overlong_buffer: OverlongBufferConfig,
    pub sandbox_fusion: SandboxFusionConfig,
}

/// The SandboxFusion server that runs the code of the code data sources (`codecontests`,
/// `apps`, `codeforces`, `taco`) for the rule reward (`reward_model.sandbox_fusion`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxFusionConfig {
    /// Its `/run_code` endpoint, e.g. `http://127.0.0.1:8080/run_code`.
    pub url: Option<String>,
    /// Requests in flight at once.
    pub max_concurrent: usize,
    /// Each run's memory limit; -1: none.
    pub memory_limit_mb: i64,
}

impl Default for SandboxFusionConfig {
    fn default() -> Self {
        Self {
            url: None,
            max_concurrent: 64,
            memory_limit_mb: 1024,
        }
    }
}

/// DAPO's overlong reward shaping (`reward_model.overlong_buffer`, read by the `dapo` manager).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OverlongBufferConfig {
    pub enable: bool,
    /// Tokens before `data.max_response_length` where the penalty grows from 0.
    pub len: usize,
    /// The penalty at `data.max_response_length`.
    pub penalty_factor: f64,
    /// Record `overlong_reward` and `overlong` in the reward's extra information.
    pub log: bool,
}

impl Default for RewardModelConfig {
    fn default() -> Self {
        Self {
            enable: false,
            strategy: "fsdp".into(),
            model: empty_object(),
            micro_batch_size: None,
            micro_batch_size_per_gpu: None,
            max_length: None,
            reward_manager: "naive".into(),
            launch_reward_fn_async: false,
            overlong_buffer: OverlongBufferConfig::default(),
            sandbox_fusion: SandboxFusionConfig::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CustomRewardFunctionConfig {
    /// A reward plugin library, or the URL of a reward server (`http` plugin); None: the
    /// built-in rule rewards.
    pub path: Option<String>,
    /// The reward component (or, through a server, the function) to use.
    pub name: String,
    /// Handed to the reward component (verl: keyword arguments of the function).
    pub reward_kwargs: Value,
}

impl Default for CustomRewardFunctionConfig {
    fn default() -> Self {
        Self {
            path: None,
            name: "compute_score".into(),
            reward_kwargs: empty_object(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlCtrlConfig {
    #[serde(rename = "type")]
    pub kind: KlCtrlType,
    pub kl_coef: f64,
    pub horizon: u64,
    pub target_kl: f64,
}

impl Default for KlCtrlConfig {
    fn default() -> Self {
        Self {
            kind: KlCtrlType::Fixed,
            kl_coef: 0.001,
            horizon: 10000,
            target_kl: 0.1,
        }
    }
}

impl KlCtrlConfig {
    /// The controller of `algorithm.use_kl_in_reward`.
    pub fn controller(&self) -> Result<KlController, AlgoError> {
        KlController::new(self.kind, self.kl_coef, self.target_kl, self.horizon)
    }
}

/// `algorithm.rollout_correction` (verl's `RolloutCorrectionConfig`): importance weights and
/// rejection sampling between the rollout's and the trainer's log-probs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutCorrectionConfig {
    /// `token` | `sequence`; None: no IS weights.
    pub rollout_is: Option<IsLevel>,
    /// Upper truncation of the IS weights; None also disables them, as in verl.
    pub rollout_is_threshold: Option<f64>,
    /// Comma-separated rejection criteria (`token_k1`, `seq_mean_k3`, …); None: no rejection.
    pub rollout_rs: Option<String>,
    /// One threshold, or one per criterion (a number or a comma-separated string).
    pub rollout_rs_threshold: Option<RsThreshold>,
    /// Old log-probs are the rollout's (no recomputation by the actor).
    pub bypass_mode: bool,
    /// Bypass mode's loss: `ppo_clip` | `reinforce`.
    pub loss_type: String,
    pub rollout_is_batch_normalize: bool,
}

impl Default for RolloutCorrectionConfig {
    fn default() -> Self {
        Self {
            rollout_is: None,
            rollout_is_threshold: Some(2.0),
            rollout_rs: None,
            rollout_rs_threshold: None,
            bypass_mode: false,
            loss_type: "ppo_clip".into(),
            rollout_is_batch_normalize: false,
        }
    }
}

/// `rollout_rs_threshold`: verl takes a number or a string.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RsThreshold {
    Number(f64),
    Text(String),
}

impl RolloutCorrectionConfig {
    /// The checked settings; errors name the key.
    pub fn settings(&self) -> Result<RolloutCorrection, AlgoError> {
        let threshold = self.rollout_rs_threshold.as_ref().map(|t| match t {
            RsThreshold::Number(n) => n.to_string(),
            RsThreshold::Text(s) => s.clone(),
        });
        // verl computes IS weights only with both the level and a threshold.
        let (level, is_threshold) = match (self.rollout_is, self.rollout_is_threshold) {
            (Some(level), Some(t)) => (Some(level), t),
            _ => (None, 2.0),
        };
        RolloutCorrection::new(
            level,
            is_threshold,
            self.rollout_is_batch_normalize,
            self.rollout_rs.as_deref(),
            threshold.as_deref(),
        )
    }
}

/// DAPO dynamic sampling.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterGroupsConfig {
    pub enable: bool,
    /// `acc` | `score` | `seq_reward` | `seq_final_reward`; None: `acc`.
    pub metric: Option<String>,
    /// ≤ 0: unbounded.
    pub max_num_gen_batches: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlgorithmConfig {
    pub gamma: f64,
    pub lam: f64,
    pub adv_estimator: AdvEstimator,
    pub norm_adv_by_std_in_grpo: bool,
    pub use_kl_in_reward: bool,
    pub kl_penalty: KlPenalty,
    pub kl_ctrl: KlCtrlConfig,
    pub filter_groups: FilterGroupsConfig,
    /// GDPO's reward components and their weights (keys of a reward's result dict).
    pub gdpo_reward_keys: Option<Vec<String>>,
    pub gdpo_reward_weights: Option<Vec<f64>>,
    pub rollout_correction: RolloutCorrectionConfig,
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            lam: 1.0,
            adv_estimator: AdvEstimator::Gae,
            norm_adv_by_std_in_grpo: true,
            use_kl_in_reward: false,
            kl_penalty: KlPenalty::Kl,
            kl_ctrl: KlCtrlConfig::default(),
            filter_groups: FilterGroupsConfig::default(),
            gdpo_reward_keys: None,
            gdpo_reward_weights: None,
            rollout_correction: RolloutCorrectionConfig::default(),
        }
    }
}

impl AlgorithmConfig {
    /// The estimator's parameters (GRPO's ε is verl's fixed 1e-6).
    pub fn advantage_params(&self) -> AdvantageParams {
        AdvantageParams {
            gamma: self.gamma as f32,
            lam: self.lam as f32,
            norm_adv_by_std_in_grpo: self.norm_adv_by_std_in_grpo,
            ..AdvantageParams::default()
        }
    }
}

/// `trainer.resume_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    /// Resume from the latest complete checkpoint in `default_local_dir`, if any.
    Auto,
    /// Start fresh.
    Disable,
    /// Resume from `resume_from_path`.
    ResumePath,
}

/// `trainer.training_mode` (ours).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainingMode {
    /// Generate, then train on what was generated (verl's `main_ppo`).
    #[default]
    Sync,
    /// Step k+1's batch is generated while step k trains, one weight version behind (verl's
    /// `one_step_off_policy`).
    OneStepOff,
    /// A rollouter thread generates ahead of the trainer, bounded by `async_training`'s staleness
    /// threshold; weights are published every `trigger_parameter_sync_step` steps (verl's
    /// `fully_async_policy`).
    FullyAsync,
}

impl TrainingMode {
    /// The name as configured.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sync => "sync",
            Self::OneStepOff => "one_step_off",
            Self::FullyAsync => "fully_async",
        }
    }
}

/// verl's `async_training` section (`fully_async_ppo_trainer.yaml`, with its defaults), read in
/// `trainer.training_mode=fully_async`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AsyncTrainingConfig {
    /// How far generation may run ahead: per published weight version the rollouter generates at
    /// most `required_samples × (staleness_threshold + 1) × trigger_parameter_sync_step` prompts.
    pub staleness_threshold: f64,
    /// Trainer steps between two weight publications to the rollouter.
    pub trigger_parameter_sync_step: u64,
    /// A step trains on `actor.ppo_mini_batch_size × require_batches` prompts.
    pub require_batches: u64,
    /// Interrupt in-flight generations at a weight sync and finish them with the new weights.
    pub partial_rollout: bool,
    /// The rollout's log-probs are the old policy's (no recomputation by the actor).
    pub use_rollout_log_probs: bool,
    /// Old log-probs from the weights of the interval's first step (verl's proximal policy).
    pub compute_prox_log_prob: bool,
    pub use_trainer_do_validate: bool,
    pub checkpoint_engine: AsyncCheckpointEngineConfig,
}

impl Default for AsyncTrainingConfig {
    fn default() -> Self {
        Self {
            staleness_threshold: 0.1,
            trigger_parameter_sync_step: 4,
            require_batches: 1,
            partial_rollout: true,
            use_rollout_log_probs: true,
            compute_prox_log_prob: false,
            use_trainer_do_validate: false,
            checkpoint_engine: AsyncCheckpointEngineConfig::default(),
        }
    }
}

/// `async_training.checkpoint_engine`: verl's device-buffered broadcast of the weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AsyncCheckpointEngineConfig {
    pub enable: bool,
    #[serde(rename = "device_buffer_size_M")]
    pub device_buffer_size_m: u64,
    pub overlap_broadcast_and_consume: bool,
}

impl Default for AsyncCheckpointEngineConfig {
    fn default() -> Self {
        Self {
            enable: true,
            device_buffer_size_m: 4096,
            overlap_broadcast_and_consume: false,
        }
    }
}

/// `trainer.nan_policy` (ours): what a step whose loss, gradient norm or weights are not finite does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NanPolicy {
    /// Stop with an error naming the step and the metric; nothing of the step is saved or
    /// exported, the last checkpoint stays the latest.
    #[default]
    Error,
    /// Skip the step's update (the engine does not apply it), warn, count it in
    /// `training/skipped_steps` and go on.
    Skip,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainerConfig {
    pub balance_batch: bool,
    pub total_epochs: u64,
    /// None: `total_epochs` × batches per epoch.
    pub total_training_steps: Option<u64>,
    pub project_name: String,
    pub experiment_name: String,
    /// Tracker plugins by name.
    #[serde(deserialize_with = "one_or_many")]
    pub logger: Vec<String>,
    pub log_val_generations: usize,
    pub rollout_data_dir: Option<String>,
    pub validation_data_dir: Option<String>,
    pub nnodes: usize,
    /// verl's default is 8; ours is 1.
    pub n_gpus_per_node: usize,
    /// −1: never.
    pub save_freq: i64,
    pub resume_mode: ResumeMode,
    pub resume_from_path: Option<String>,
    pub val_before_train: bool,
    pub val_only: bool,
    /// −1: never.
    pub test_freq: i64,
    pub critic_warmup: u64,
    pub default_hdfs_dir: Option<String>,
    pub del_local_ckpt_after_load: bool,
    /// verl's default, with `${…}` interpolation.
    pub default_local_dir: String,
    pub max_actor_ckpt_to_keep: Option<usize>,
    pub max_critic_ckpt_to_keep: Option<usize>,
    /// `auto` (ours; verl: `cuda`) picks the platform by device detection.
    pub device: String,
    /// Ours: the run's seed (model init, sampling, shuffling when `data.seed` is unset).
    pub seed: u64,
    /// Ours: bit-identical resumed runs (deterministic kernels, no thread-count dependence).
    pub deterministic: bool,
    pub nan_policy: NanPolicy,
    /// Ours: how generation and training interleave (verl picks this by entry point: its
    /// `one_step_off_policy` and `fully_async_policy` recipes).
    pub training_mode: TrainingMode,
    /// Ours: a key that is set but not supported (it would change what is trained) stops the
    /// run; false turns those errors into warnings.
    pub strict_config: bool,
    /// verl's choice of worker implementation; there are no verl workers here.
    pub use_legacy_worker_impl: String,
    /// Ours: the device's peak FLOP/s for the `perf/mfu/*` metrics; None: verl's per-device table
    /// (`verl/utils/flops_counter.py`: CPU 448e9, H100/H200 989e12, A100 312e12, …; an unknown
    /// device gives MFU 0).
    pub device_peak_flops: Option<f64>,
    /// Logger sections (see verl-config's `Config::sections`).
    #[serde(flatten)]
    pub sections: Sections,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            balance_batch: true,
            total_epochs: 30,
            total_training_steps: None,
            project_name: "verl_examples".into(),
            experiment_name: "gsm8k".into(),
            logger: vec!["console".into()],
            log_val_generations: 0,
            rollout_data_dir: None,
            validation_data_dir: None,
            nnodes: 1,
            n_gpus_per_node: 1,
            save_freq: -1,
            resume_mode: ResumeMode::Auto,
            resume_from_path: None,
            val_before_train: true,
            val_only: false,
            test_freq: -1,
            critic_warmup: 0,
            default_hdfs_dir: None,
            del_local_ckpt_after_load: false,
            default_local_dir: "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
                .into(),
            max_actor_ckpt_to_keep: None,
            max_critic_ckpt_to_keep: None,
            device: "auto".into(),
            seed: 42,
            deterministic: false,
            nan_policy: NanPolicy::Error,
            training_mode: TrainingMode::Sync,
            strict_config: true,
            use_legacy_worker_impl: "auto".into(),
            device_peak_flops: None,
            sections: Sections::new(),
        }
    }
}
