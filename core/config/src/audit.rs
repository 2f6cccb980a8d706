//! Nothing accepted is ignored: every key the config accepts is either acted on or reported.
//! [`RULES`] classifies every key of the schema — acted on (read by verl-core or handed to the
//! component that reads it), unsupported (it would change what is trained or how, and nothing
//! here does that yet: an error when set), or without effect (infrastructure: a warning when set).
//! "Set" means a value other than the built-in default. `trainer.strict_config=false` turns the
//! errors into warnings.
//!
//! Components add to this through their capabilities ([`ConfigKeys`]): the keys of their section
//! they act on (a vLLM rollout's `gpu_memory_utilization`), and the keys of their own plugin
//! section (an engine's `fsdp_config`) that they accept without honouring, which core cannot know.

use std::fmt;

use serde_json::Value;
use verl_plugin_api::{ConfigKeys, KeyNote};

use super::{Config, EngineRole};

/// What verl-core does with a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Treatment {
    /// Read by verl-core, or handed to the component that reads it.
    Acted,
    /// The contents belong to a plugin, which checks them and declares what it ignores.
    Plugin,
    /// Would change what is trained or how, and nothing here does it yet: an error when set.
    /// The text says what would provide it.
    Unsupported(&'static str),
    /// Changes nothing here: a warning when set. The text says why.
    NoEffect(&'static str),
    /// `trainer.nnodes` × `trainer.n_gpus_per_node` must equal the world size.
    WorldSize,
}

/// The treatment of a key, or of every key below a section not listed on its own.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub key: &'static str,
    pub treatment: Treatment,
    /// Values other than the default that are fine as well (acted on as the default is).
    pub also_fine: &'static [&'static str],
}

const fn acted(key: &'static str) -> Rule {
    rule(key, Treatment::Acted)
}
const fn plugin(key: &'static str) -> Rule {
    rule(key, Treatment::Plugin)
}
const fn unsupported(key: &'static str, why: &'static str) -> Rule {
    rule(key, Treatment::Unsupported(why))
}
const fn no_effect(key: &'static str, why: &'static str) -> Rule {
    rule(key, Treatment::NoEffect(why))
}
const fn rule(key: &'static str, treatment: Treatment) -> Rule {
    Rule {
        key,
        treatment,
        also_fine: &[],
    }
}

const PARALLEL: &str = "every rank holds the whole model (data parallel over the job's ranks); model and sequence parallelism are not implemented";
const OFFLOAD: &str =
    "CPU offloading is not implemented: parameters, gradients and activations stay on the device";
const LORA: &str = "LoRA adapters are not implemented: every parameter is trained";
const NO_PYTHON: &str = "no Python code runs here: models load from config.json and safetensors";
const KERNELS: &str =
    "the engine has one implementation of each op; verl's kernel options change speed, not results";
const INFERENCE_SERVER: &str = "inference-server tuning: the `native` rollout generates in process (a rollout plugin that acts on it declares so)";
const MODEL_CONFIG: &str =
    "overrides of the model's config.json are not applied; edit config.json instead";
const SHM: &str = "files are read directly; there is no shared-memory copy";
const SEED_FROM_RUN: &str = "mini-batch shuffling is seeded from trainer.seed";
const FILLED_IN: &str = "filled in from the run's total steps, as verl does";
const NO_REWARD_MODEL: &str =
    "only rule-based rewards by data_source are built in (reward_model.enable)";
const NO_RAY: &str =
    "there is no Ray or worker group: the trainer and its components run in this process";
const ROUTING_FILES: &str =
    "declared by verl, read by none of its workers: the routing travels in the batch";
const NO_PROFILER: &str = "profilers are not wired; the timing_s/* metrics time each stage";

/// Every key of the schema, by path; a section's rule covers the keys below it that have none.
pub const RULES: &[Rule] = &[
    // data
    acted("data.tokenizer"),
    no_effect("data.use_shm", SHM),
    acted("data.train_files"),
    acted("data.val_files"),
    acted("data.train_max_samples"),
    acted("data.val_max_samples"),
    acted("data.prompt_key"),
    unsupported(
        "data.reward_fn_key",
        "rewards are chosen by the `data_source` column; another column needs a reward manager that reads it",
    ),
    acted("data.max_prompt_length"),
    acted("data.max_response_length"),
    acted("data.train_batch_size"),
    acted("data.gen_batch_size"),
    acted("data.val_batch_size"),
    no_effect(
        "data.return_raw_chat",
        "prompts are rendered with the chat template and tokenized here; no raw chat is passed on",
    ),
    no_effect(
        "data.return_full_prompt",
        "the rendered prompt is not carried in the batch",
    ),
    acted("data.shuffle"),
    acted("data.seed"),
    no_effect(
        "data.dataloader_num_workers",
        "the data is loaded once, in this process",
    ),
    no_effect(
        "data.validation_shuffle",
        "validation always covers the whole set; its order changes no metric",
    ),
    acted("data.filter_overlong_prompts"),
    no_effect(
        "data.filter_overlong_prompts_workers",
        "prompts are filtered in this process",
    ),
    acted("data.truncation"),
    no_effect("data.trust_remote_code", NO_PYTHON),
    acted("data.apply_chat_template_kwargs"),
    // actor_rollout_ref
    Rule {
        also_fine: &["true"],
        ..unsupported(
            "actor_rollout_ref.hybrid_engine",
            "only the hybrid engine (actor and rollout share the process) exists, as in verl",
        )
    },
    acted("actor_rollout_ref.nccl_timeout"),
    acted("actor_rollout_ref.model.path"),
    acted("actor_rollout_ref.model.tokenizer_path"),
    acted("actor_rollout_ref.model.custom_chat_template"),
    no_effect("actor_rollout_ref.model.external_lib", NO_PYTHON),
    unsupported("actor_rollout_ref.model.override_config", MODEL_CONFIG),
    acted("actor_rollout_ref.model.enable_gradient_checkpointing"),
    unsupported("actor_rollout_ref.model.enable_activation_offload", OFFLOAD),
    acted("actor_rollout_ref.model.use_remove_padding"),
    no_effect("actor_rollout_ref.model.use_shm", SHM),
    no_effect("actor_rollout_ref.model.trust_remote_code", NO_PYTHON),
    unsupported("actor_rollout_ref.model.lora_rank", LORA),
    no_effect(
        "actor_rollout_ref.model.lora_alpha",
        "only used with lora_rank > 0",
    ),
    no_effect("actor_rollout_ref.model.use_liger", KERNELS),
    no_effect("actor_rollout_ref.model.use_fused_kernels", KERNELS),
    acted("actor_rollout_ref.model.random_init"),
    acted("actor_rollout_ref.model.dtype"),
    // actor
    acted("actor_rollout_ref.actor.strategy"),
    acted("actor_rollout_ref.actor.ppo_mini_batch_size"),
    acted("actor_rollout_ref.actor.ppo_micro_batch_size"),
    acted("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    acted("actor_rollout_ref.actor.use_dynamic_bsz"),
    acted("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    acted("actor_rollout_ref.actor.clip_ratio"),
    acted("actor_rollout_ref.actor.clip_ratio_low"),
    acted("actor_rollout_ref.actor.clip_ratio_high"),
    acted("actor_rollout_ref.actor.clip_ratio_c"),
    acted("actor_rollout_ref.actor.policy_loss.loss_mode"),
    acted("actor_rollout_ref.actor.policy_loss.clip_cov_ratio"),
    acted("actor_rollout_ref.actor.policy_loss.clip_cov_lb"),
    acted("actor_rollout_ref.actor.policy_loss.clip_cov_ub"),
    acted("actor_rollout_ref.actor.policy_loss.kl_cov_ratio"),
    acted("actor_rollout_ref.actor.policy_loss.ppo_kl_coef"),
    acted("actor_rollout_ref.actor.policy_loss.dro_beta"),
    acted("actor_rollout_ref.actor.tau_pos"),
    acted("actor_rollout_ref.actor.tau_neg"),
    acted("actor_rollout_ref.actor.loss_agg_mode"),
    acted("actor_rollout_ref.actor.entropy_coeff"),
    acted("actor_rollout_ref.actor.calculate_sum_pi_squared"),
    no_effect(
        "actor_rollout_ref.actor.sum_pi_squared_checkpointing",
        "Σπ² is computed only in the log-prob pass, without gradients: there is no backward to recompute it in",
    ),
    acted("actor_rollout_ref.actor.use_kl_loss"),
    acted("actor_rollout_ref.actor.kl_loss_coef"),
    acted("actor_rollout_ref.actor.kl_loss_type"),
    acted("actor_rollout_ref.actor.ppo_epochs"),
    acted("actor_rollout_ref.actor.shuffle"),
    no_effect("actor_rollout_ref.actor.data_loader_seed", SEED_FROM_RUN),
    acted("actor_rollout_ref.actor.grad_clip"),
    unsupported(
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        PARALLEL,
    ),
    no_effect("actor_rollout_ref.actor.use_torch_compile", KERNELS),
    no_effect("actor_rollout_ref.actor.profiler", NO_PROFILER),
    unsupported(
        "actor_rollout_ref.actor.optim.optimizer",
        "the engines train with AdamW",
    ),
    acted("actor_rollout_ref.actor.optim"),
    no_effect(
        "actor_rollout_ref.actor.optim.total_training_steps",
        FILLED_IN,
    ),
    unsupported(
        "actor_rollout_ref.actor.router_replay.mode",
        "router replay needs an engine that replays each token's experts and declares so (the `fsdp` engine does; `megatron` has no mixture-of-experts layers)",
    ),
    no_effect(
        "actor_rollout_ref.actor.router_replay.record_file",
        ROUTING_FILES,
    ),
    no_effect(
        "actor_rollout_ref.actor.router_replay.replay_file",
        ROUTING_FILES,
    ),
    Rule {
        also_fine: &["false"],
        ..no_effect(
            "actor_rollout_ref.actor.use_prefix_grouper",
            "only an engine that shares prompts in its packed passes acts on it and declares so (`fsdp` does; `megatron` packs every sequence whole); it changes speed, not results",
        )
    },
    // ref
    acted("actor_rollout_ref.ref.strategy"),
    acted("actor_rollout_ref.ref.log_prob_micro_batch_size"),
    acted("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
    acted("actor_rollout_ref.ref.log_prob_use_dynamic_bsz"),
    acted("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
    unsupported(
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
        PARALLEL,
    ),
    no_effect("actor_rollout_ref.ref.profiler", NO_PROFILER),
    unsupported(
        "actor_rollout_ref.ref.router_replay",
        "the reference policy routes with its own router; verl replays routing in the actor only",
    ),
    // rollout
    acted("actor_rollout_ref.rollout.name"),
    Rule {
        also_fine: &["sync"],
        ..no_effect(
            "actor_rollout_ref.rollout.mode",
            "the trainer calls the rollout directly, one batch at a time",
        )
    },
    acted("actor_rollout_ref.rollout.temperature"),
    acted("actor_rollout_ref.rollout.top_k"),
    acted("actor_rollout_ref.rollout.top_p"),
    acted("actor_rollout_ref.rollout.do_sample"),
    acted("actor_rollout_ref.rollout.n"),
    no_effect(
        "actor_rollout_ref.rollout.prompt_length",
        "prompts are bounded by data.max_prompt_length",
    ),
    acted("actor_rollout_ref.rollout.response_length"),
    no_effect(
        "actor_rollout_ref.rollout.dtype",
        "the `native` rollout computes in actor_rollout_ref.model.dtype (a rollout plugin that acts on it declares so)",
    ),
    no_effect(
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        INFERENCE_SERVER,
    ),
    acted("actor_rollout_ref.rollout.ignore_eos"),
    no_effect("actor_rollout_ref.rollout.enforce_eager", INFERENCE_SERVER),
    // Acted on with a rollout that can sleep; the trainer says so at start for one that cannot.
    acted("actor_rollout_ref.rollout.free_cache_engine"),
    no_effect(
        "actor_rollout_ref.rollout.enable_sleep_mode",
        "the `native` rollout has no server memory to free (a rollout plugin that acts on it declares so)",
    ),
    unsupported(
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        PARALLEL,
    ),
    unsupported("actor_rollout_ref.rollout.data_parallel_size", PARALLEL),
    unsupported(
        "actor_rollout_ref.rollout.pipeline_model_parallel_size",
        PARALLEL,
    ),
    no_effect(
        "actor_rollout_ref.rollout.max_num_batched_tokens",
        INFERENCE_SERVER,
    ),
    no_effect("actor_rollout_ref.rollout.max_model_len", INFERENCE_SERVER),
    no_effect("actor_rollout_ref.rollout.max_num_seqs", INFERENCE_SERVER),
    no_effect(
        "actor_rollout_ref.rollout.enable_chunked_prefill",
        INFERENCE_SERVER,
    ),
    no_effect(
        "actor_rollout_ref.rollout.enable_prefix_caching",
        INFERENCE_SERVER,
    ),
    no_effect("actor_rollout_ref.rollout.load_format", INFERENCE_SERVER),
    acted("actor_rollout_ref.rollout.log_prob_micro_batch_size"),
    acted("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
    acted("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"),
    acted("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
    no_effect(
        "actor_rollout_ref.rollout.disable_log_stats",
        INFERENCE_SERVER,
    ),
    acted("actor_rollout_ref.rollout.calculate_log_probs"),
    no_effect(
        "actor_rollout_ref.rollout.skip_tokenizer_init",
        INFERENCE_SERVER,
    ),
    unsupported(
        "actor_rollout_ref.rollout.enable_rollout_routing_replay",
        "the rollout must return each token's experts and declare so (the `native` rollout does; the `vllm` and `sglang` adapters do not)",
    ),
    plugin("actor_rollout_ref.rollout.engine_kwargs"),
    acted("actor_rollout_ref.rollout.val_kwargs"),
    acted("actor_rollout_ref.rollout.checkpoint_engine.backend"),
    no_effect(
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
        "weights are handed over whole, by reference or in one file per sync",
    ),
    plugin("actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs"),
    // critic
    acted("critic.enable"),
    acted("critic.strategy"),
    acted("critic.optim"),
    unsupported("critic.optim.optimizer", "the engines train with AdamW"),
    no_effect("critic.optim.total_training_steps", FILLED_IN),
    no_effect(
        "critic.model",
        "the critic's engine reads model.path, model.random_init, model.dtype, model.enable_gradient_checkpointing and model.use_remove_padding; its engine section is critic.<section> (e.g. critic.fsdp_config)",
    ),
    acted("critic.model.path"),
    acted("critic.model.random_init"),
    acted("critic.model.dtype"),
    acted("critic.model.enable_gradient_checkpointing"),
    acted("critic.model.use_remove_padding"),
    unsupported("critic.model.override_config", MODEL_CONFIG),
    unsupported("critic.model.enable_activation_offload", OFFLOAD),
    unsupported("critic.model.lora_rank", LORA),
    unsupported("critic.model.fsdp_config.param_offload", OFFLOAD),
    unsupported("critic.model.fsdp_config.optimizer_offload", OFFLOAD),
    acted("critic.ppo_mini_batch_size"),
    acted("critic.ppo_micro_batch_size"),
    acted("critic.ppo_micro_batch_size_per_gpu"),
    acted("critic.forward_micro_batch_size"),
    acted("critic.forward_micro_batch_size_per_gpu"),
    acted("critic.use_dynamic_bsz"),
    acted("critic.ppo_max_token_len_per_gpu"),
    acted("critic.forward_max_token_len_per_gpu"),
    acted("critic.ppo_epochs"),
    acted("critic.shuffle"),
    no_effect("critic.data_loader_seed", SEED_FROM_RUN),
    acted("critic.cliprange_value"),
    acted("critic.loss_agg_mode"),
    acted("critic.grad_clip"),
    unsupported("critic.ulysses_sequence_parallel_size", PARALLEL),
    no_effect("critic.profiler", NO_PROFILER),
    // reward
    unsupported("reward_model.enable", NO_REWARD_MODEL),
    no_effect("reward_model", "only used with reward_model.enable"),
    acted("reward_model.reward_manager"),
    acted("reward_model.overlong_buffer"),
    acted("reward_model.sandbox_fusion"),
    no_effect(
        "reward_model.launch_reward_fn_async",
        "rule rewards are computed in line, in milliseconds",
    ),
    acted("custom_reward_function.path"),
    acted("custom_reward_function.name"),
    acted("custom_reward_function.reward_kwargs"),
    // algorithm
    acted("algorithm.gamma"),
    acted("algorithm.lam"),
    acted("algorithm.adv_estimator"),
    acted("algorithm.norm_adv_by_std_in_grpo"),
    acted("algorithm.use_kl_in_reward"),
    acted("algorithm.kl_penalty"),
    acted("algorithm.kl_ctrl"),
    acted("algorithm.gdpo_reward_keys"),
    acted("algorithm.gdpo_reward_weights"),
    acted("algorithm.filter_groups.enable"),
    acted("algorithm.filter_groups.max_num_gen_batches"),
    acted("algorithm.filter_groups.metric"),
    acted("algorithm.rollout_correction.rollout_is"),
    acted("algorithm.rollout_correction.rollout_is_threshold"),
    acted("algorithm.rollout_correction.rollout_is_batch_normalize"),
    acted("algorithm.rollout_correction.rollout_rs"),
    acted("algorithm.rollout_correction.rollout_rs_threshold"),
    acted("algorithm.rollout_correction.bypass_mode"),
    unsupported(
        "algorithm.rollout_correction.loss_type",
        "bypass mode trains with the PPO-clip loss (ppo_clip); its REINFORCE loss is not implemented in the engines",
    ),
    // trainer
    acted("trainer.balance_batch"),
    acted("trainer.total_epochs"),
    acted("trainer.total_training_steps"),
    acted("trainer.project_name"),
    acted("trainer.experiment_name"),
    acted("trainer.logger"),
    acted("trainer.log_val_generations"),
    acted("trainer.rollout_data_dir"),
    no_effect(
        "trainer.validation_data_dir",
        "validation generations are not dumped to files; log_val_generations shows validation samples",
    ),
    rule("trainer.nnodes", Treatment::WorldSize),
    rule("trainer.n_gpus_per_node", Treatment::WorldSize),
    acted("trainer.save_freq"),
    acted("trainer.resume_mode"),
    acted("trainer.resume_from_path"),
    acted("trainer.val_before_train"),
    acted("trainer.val_only"),
    acted("trainer.test_freq"),
    acted("trainer.critic_warmup"),
    no_effect(
        "trainer.default_hdfs_dir",
        "checkpoints stay in trainer.default_local_dir; nothing is copied to HDFS",
    ),
    no_effect(
        "trainer.del_local_ckpt_after_load",
        "local checkpoints are kept (trainer.max_actor_ckpt_to_keep bounds them)",
    ),
    acted("trainer.default_local_dir"),
    acted("trainer.max_actor_ckpt_to_keep"),
    no_effect(
        "trainer.max_critic_ckpt_to_keep",
        "a checkpoint holds actor and critic together; trainer.max_actor_ckpt_to_keep bounds both",
    ),
    acted("trainer.device"),
    acted("trainer.seed"),
    acted("trainer.deterministic"),
    acted("trainer.strict_config"),
    acted("trainer.nan_policy"),
    acted("trainer.device_peak_flops"),
    acted("trainer.training_mode"),
    no_effect("trainer.use_legacy_worker_impl", NO_RAY),
    // verl's fully-async recipe (read in trainer.training_mode=fully_async; see
    // trainer::fully_async for how each is acted on).
    acted("async_training.staleness_threshold"),
    acted("async_training.trigger_parameter_sync_step"),
    acted("async_training.require_batches"),
    acted("async_training.use_rollout_log_probs"),
    no_effect(
        "async_training.partial_rollout",
        "the rollouter finishes the batches due with the old weights before each weight sync, so no sample spans two weight versions and none is interrupted",
    ),
    unsupported(
        "async_training.compute_prox_log_prob",
        "old log-probs from the weights of the sync interval's first step need a saved copy of those weights, which the engines do not keep; use use_rollout_log_probs=true or false",
    ),
    no_effect(
        "async_training.use_trainer_do_validate",
        "validation runs on the one rollout of this process, after the weight sync of the step it follows",
    ),
    no_effect(
        "async_training.checkpoint_engine",
        "weights reach the rollout through actor_rollout_ref.rollout.checkpoint_engine.backend",
    ),
    // Ours: the jobs built on the trainer.
    acted("quickstart"),
    acted("sft"),
    // distillation (verl-project/verl 01dcf9f0's keys)
    acted("distillation.enabled"),
    no_effect(
        "distillation.num_workers",
        "one teacher engine scores in this process; there are no teacher replicas",
    ),
    no_effect(
        "distillation.teacher_model.enable_resource_pool",
        "the teacher engine runs beside the actor on this rank's device",
    ),
    no_effect(
        "distillation.teacher_model.n_gpus_per_node",
        "the teacher engine runs beside the actor on this rank's device",
    ),
    no_effect(
        "distillation.teacher_model.nnodes",
        "the teacher engine runs beside the actor on this rank's device",
    ),
    acted("distillation.teacher_model.model_path"),
    no_effect(
        "distillation.teacher_model.inference",
        "the teacher is an engine role scoring in process (with the reference's engine settings), not an inference server",
    ),
    acted("distillation.distillation_loss"),
    // verl's infrastructure sections.
    no_effect("ray_kwargs", NO_RAY),
    no_effect("global_profiler", NO_PROFILER),
];

/// `trainer.*` keys verl-core copies into every engine and rollout section under the same name: a
/// component that does not honour one declares it (in its `unsupported` or `no_effect` notes)
/// and the audit reports `trainer.<key>` naming the component's reason.
pub const RUN_WIDE: [&str; 1] = ["deterministic"];

/// The rule for `key`: its own, else the one of the nearest section above it.
pub fn rule_for(key: &str) -> Option<&'static Rule> {
    RULES
        .iter()
        .filter(|r| {
            key == r.key
                || key
                    .strip_prefix(r.key)
                    .is_some_and(|rest| rest.starts_with('.'))
        })
        .max_by_key(|r| r.key.len())
}

/// What the audit needs besides the config: the world size and what the run's components
/// declare about their sections.
#[derive(Debug, Clone)]
pub struct AuditContext {
    /// Ranks in this run (WORLD_SIZE; 1 without a launcher), which `trainer.nnodes ×
    /// trainer.n_gpus_per_node` must equal; `None` for a command that takes its ranks from the
    /// launcher alone (`score`).
    pub world_size: Option<u32>,
    /// Each component the run uses: its verl section (`actor_rollout_ref.actor`,
    /// `actor_rollout_ref.rollout`, …) and what it declares about the keys there.
    pub components: Vec<(String, ConfigKeys)>,
    pub scope: AuditScope,
}

impl Default for AuditContext {
    /// One process, no component declarations, a training command.
    fn default() -> Self {
        Self {
            world_size: Some(1),
            components: Vec::new(),
            scope: AuditScope::Training,
        }
    }
}

/// What of the config the audited command reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuditScope {
    /// `run`, `sft`, `bench`: every rule applies.
    Training,
    /// A one-off command (`score`, `generate`) that reads only `reads` (keys and the sections
    /// under them); every other key it is given is reported as without effect there, and
    /// `replaced` keys with their own reason (e.g. the model path a flag gives).
    Command {
        name: &'static str,
        reads: Vec<String>,
        /// What `reads` are, in words, for the message.
        reads_what: &'static str,
        replaced: Vec<(String, String)>,
    },
}

impl AuditScope {
    /// Why `key`, set, does nothing for this command; `None` where the rules decide.
    fn unread(&self, key: &str) -> Option<String> {
        let Self::Command {
            name,
            reads,
            reads_what,
            replaced,
        } = self
        else {
            return None;
        };
        if let Some((_, why)) = replaced.iter().find(|(k, _)| k == key) {
            return Some(why.clone());
        }
        let read = reads
            .iter()
            .any(|r| key == r || key.starts_with(&format!("{r}.")));
        (!read).then(|| format!("`verl-core {name}` reads only {reads_what}"))
    }
}

/// Error (the run stops) or warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Warning => "warning",
        }
    }
}

/// A key that is set but not acted on.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Finding {
    pub key: String,
    pub value: Value,
    pub origin: String,
    pub severity: Severity,
    /// Whether the key is unsupported (else it has no effect).
    pub unsupported: bool,
    pub why: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            key, value, origin, ..
        } = self;
        write!(f, "config key `{key}`={value} (from {origin}) ")?;
        match (self.unsupported, self.severity) {
            (false, _) => write!(f, "has no effect: {}", self.why),
            (true, Severity::Error) => write!(
                f,
                "is not supported yet: {} (trainer.strict_config=false runs without it)",
                self.why
            ),
            (true, Severity::Warning) => write!(
                f,
                "is not supported yet and is ignored (trainer.strict_config=false): {}",
                self.why
            ),
        }
    }
}

/// Every set key of `config` that is not acted on, in key order.
pub fn audit(config: &Config, ctx: &AuditContext) -> Vec<Finding> {
    let tree = config.to_json();
    let defaults = Config::default().to_json();
    let strict = config.trainer.strict_config;
    let origin = |key: &str| config.origin(key).unwrap_or("built-in defaults").to_owned();
    let finding = |key: &str, value: &Value, unsupported: bool, why: String| Finding {
        key: key.to_owned(),
        value: value.clone(),
        origin: origin(key),
        severity: if unsupported && strict {
            Severity::Error
        } else {
            Severity::Warning
        },
        unsupported,
        why,
    };
    let acted_on_by_component = |key: &str| {
        ctx.components.iter().any(|(section, keys)| {
            keys.acts_on.iter().any(|k| {
                let declared = format!("{section}.{k}");
                key == declared || key.starts_with(&format!("{declared}."))
            })
        })
    };
    let unused_role = |key: &str| {
        let under = |section: &str| key.starts_with(&format!("{section}."));
        if under("critic") && !config.critic_enabled() {
            Some("no critic is trained in this run (critic.enable, algorithm.adv_estimator)")
        } else if under("actor_rollout_ref.ref") && !config.ref_enabled() {
            Some(
                "no reference policy is used in this run (actor.use_kl_loss, algorithm.use_kl_in_reward)",
            )
        } else {
            None
        }
    };

    let batching = unused_batching_keys(config);

    let mut findings = Vec::new();
    for_each_leaf(&tree, &mut Vec::new(), &mut |path, value| {
        let key = path.join(".");
        let default = path
            .iter()
            .try_fold(&defaults, |v, k| v.get(k))
            .unwrap_or(&Value::Null);
        // A key without a rule is in a plugin section (`actor_rollout_ref.actor.fsdp_config`,
        // `trainer.wandb`): its component reports it (declared notes, below) when it is used.
        let rule = rule_for(&key);
        let is_set = value != default
            && !rule.is_some_and(|rule| {
                rule.also_fine
                    .iter()
                    .any(|fine| value.as_str().map_or(value.to_string(), str::to_owned) == *fine)
            });
        if !is_set {
            return;
        }
        if let Some(why) = ctx.scope.unread(&key) {
            // Values derived at load (e.g. the checkpoint directory from the experiment name)
            // differ from the defaults too; only what the user gave is reported.
            let given = (1..=path.len()).any(|n| config.origin(&path[..n].join(".")).is_some());
            if given {
                findings.push(finding(&key, value, false, why));
            }
            return;
        }
        if ctx.scope == AuditScope::Training
            && let Some(why) = unused_role(&key)
        {
            findings.push(finding(&key, value, false, why.to_owned()));
            return;
        }
        if key.starts_with("async_training.")
            && config.trainer.training_mode != super::TrainingMode::FullyAsync
        {
            findings.push(finding(
                &key,
                value,
                false,
                "read only with trainer.training_mode=fully_async".to_owned(),
            ));
            return;
        }
        if let Some((_, why)) = batching.iter().find(|(k, _)| *k == key.as_str()) {
            findings.push(finding(&key, value, false, why.clone()));
            return;
        }
        let Some(rule) = rule else { return };
        match rule.treatment {
            Treatment::Acted | Treatment::Plugin | Treatment::WorldSize => {}
            _ if acted_on_by_component(&key) => {}
            Treatment::Unsupported(why) => {
                findings.push(finding(&key, value, true, why.to_owned()))
            }
            Treatment::NoEffect(why) => findings.push(finding(&key, value, false, why.to_owned())),
        }
    });
    let (nnodes, per_node) = (config.trainer.nnodes, config.trainer.n_gpus_per_node);
    if let Some(world_size) = ctx.world_size
        && nnodes * per_node != world_size as usize
    {
        // Name the key that was set (n_gpus_per_node when both or neither were).
        let key = if config.origin("trainer.nnodes").is_some()
            && config.origin("trainer.n_gpus_per_node").is_none()
        {
            "trainer.nnodes"
        } else {
            "trainer.n_gpus_per_node"
        };
        let value = config.get(key).unwrap_or(Value::Null);
        findings.push(finding(
            key,
            &value,
            true,
            format!(
                "trainer.nnodes × trainer.n_gpus_per_node = {nnodes} × {per_node} must equal the world size, {} \
                 (WORLD_SIZE, 1 without a launcher); {PARALLEL}",
                world_size
            ),
        ));
    }

    for (section, keys) in &ctx.components {
        for (notes, unsupported) in [(&keys.unsupported, true), (&keys.no_effect, false)] {
            for KeyNote {
                key, default, why, ..
            } in notes
            {
                // A run-wide key copied into every section is the trainer's.
                let section = if RUN_WIDE.contains(&key.as_str()) {
                    "trainer"
                } else {
                    section.as_str()
                };
                let Some(value) = config.get(&format!("{section}.{key}")) else {
                    continue;
                };
                let mut path = vec![section.to_owned(), key.clone()];
                for_each_change(&value, default, &mut path, &mut |key, value| {
                    // A key the command does not read was reported as such above.
                    if ctx.scope.unread(key).is_none() {
                        findings.push(finding(key, value, unsupported, why.clone()));
                    }
                });
            }
        }
    }
    findings.sort_by(|a, b| a.key.cmp(&b.key));
    findings
}

/// The micro-batch keys no pass of the run reads, each with why: verl batches a pass either by
/// rows (`*micro_batch_size*`) or, with `use_dynamic_bsz`, by a token budget
/// (`*max_token_len_per_gpu`), never both. A forward pass by rows without its own size falls
/// back to the PPO micro-batch size (`Config::engine_json`).
fn unused_batching_keys(config: &Config) -> Vec<(&'static str, String)> {
    const ACTOR_ROWS: [&str; 2] = [
        "actor_rollout_ref.actor.ppo_micro_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    ];
    const CRITIC_ROWS: [&str; 2] = [
        "critic.ppo_micro_batch_size",
        "critic.ppo_micro_batch_size_per_gpu",
    ];
    // Per pass: its role, which of `token_budgets` it is (0 forward, 1 update), the switch, the
    // row keys it reads when not batching by tokens, and its own budget key.
    let passes: [(EngineRole, usize, &str, Vec<&'static str>, &'static str); 5] = [
        (
            EngineRole::Actor,
            1,
            "actor_rollout_ref.actor.use_dynamic_bsz",
            ACTOR_ROWS.to_vec(),
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        ),
        (
            EngineRole::Actor,
            0,
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
            [
                "actor_rollout_ref.rollout.log_prob_micro_batch_size",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
            ]
            .into_iter()
            .chain(ACTOR_ROWS)
            .collect(),
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        ),
        (
            EngineRole::Ref,
            0,
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
            [
                "actor_rollout_ref.ref.log_prob_micro_batch_size",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
            ]
            .into_iter()
            .chain(ACTOR_ROWS)
            .collect(),
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        ),
        (
            EngineRole::Critic,
            1,
            "critic.use_dynamic_bsz",
            CRITIC_ROWS.to_vec(),
            "critic.ppo_max_token_len_per_gpu",
        ),
        (
            EngineRole::Critic,
            0,
            "critic.use_dynamic_bsz",
            [
                "critic.forward_micro_batch_size",
                "critic.forward_micro_batch_size_per_gpu",
            ]
            .into_iter()
            .chain(CRITIC_ROWS)
            .collect(),
            "critic.forward_max_token_len_per_gpu",
        ),
    ];
    let used = |role| match role {
        EngineRole::Actor => true,
        EngineRole::Ref => config.ref_enabled(),
        EngineRole::Critic => config.critic_enabled(),
        EngineRole::Teacher => config.teacher_enabled(),
    };
    let (mut rows_read, mut budgets_read) = (Vec::new(), Vec::new());
    for (role, pass, _, rows, _) in passes.iter().filter(|p| used(p.0)) {
        match config.token_budgets(*role)[*pass] {
            Some((key, _)) => budgets_read.push(key),
            None => rows_read.extend(rows.iter().copied()),
        }
    }
    let mut unused = Vec::new();
    for (_, _, switch, rows, budget) in passes.iter().filter(|p| used(p.0)) {
        if !budgets_read.contains(budget) {
            unused.push((
                *budget,
                format!("a token budget only applies with {switch}=true"),
            ));
        }
        for key in rows.iter().filter(|k| !rows_read.contains(k)) {
            unused.push((
                *key,
                format!("{switch} is true: micro-batches are cut by a token budget"),
            ));
        }
    }
    unused
}

/// Calls `f` with each key (dotted, `path` and below) where `value` differs from `default`:
/// mappings are compared key by key, so setting part of a section to its defaults is no change.
fn for_each_change(
    value: &Value,
    default: &Value,
    path: &mut Vec<String>,
    f: &mut impl FnMut(&str, &Value),
) {
    match (value, default) {
        (Value::Object(map), Value::Object(_) | Value::Null) => {
            for (k, v) in map {
                path.push(k.clone());
                for_each_change(v, default.get(k).unwrap_or(&Value::Null), path, f);
                path.pop();
            }
        }
        _ if value != default => f(&path.join("."), value),
        _ => {}
    }
}

/// Calls `f` with every leaf of `tree` (a value that is not a non-empty mapping) and its path.
pub(super) fn for_each_leaf(
    tree: &Value,
    path: &mut Vec<String>,
    f: &mut impl FnMut(&[String], &Value),
) {
    match tree {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                path.push(k.clone());
                for_each_leaf(v, path, f);
                path.pop();
            }
        }
        leaf => f(path, leaf),
    }
}

/// What `score` reads of the config: the reference engine's settings (its section, and the
/// actor's keys verl's reference config interpolates: strategy, compile, dynamic batch, Ulysses
/// and the megatron grid), the model section and the device; the model is `--model`'s.
pub fn score_scope() -> AuditScope {
    let actor = |key: &str| format!("actor_rollout_ref.actor.{key}");
    let mut reads: Vec<String> = [
        "actor_rollout_ref.ref",
        "actor_rollout_ref.model",
        "actor_rollout_ref.nccl_timeout",
        "trainer.device",
        "trainer.deterministic",
    ]
    .map(String::from)
    .to_vec();
    reads.extend(
        [
            "strategy",
            "use_torch_compile",
            "use_dynamic_bsz",
            "ppo_max_token_len_per_gpu",
            "ulysses_sequence_parallel_size",
        ]
        .map(actor),
    );
    reads.extend(super::REF_INHERITS_MEGATRON.map(|key| actor(&format!("megatron.{key}"))));
    AuditScope::Command {
        name: "score",
        reads,
        reads_what: "the reference engine's settings (actor_rollout_ref.ref, and the actor's strategy, \
                     use_torch_compile, use_dynamic_bsz, ppo_max_token_len_per_gpu, \
                     ulysses_sequence_parallel_size and megatron grid, which the reference inherits), \
                     actor_rollout_ref.model, trainer.device and trainer.deterministic",
        replaced: vec![(
            "actor_rollout_ref.model.path".into(),
            "`verl-core score` scores the model --model gives".into(),
        )],
    }
}

/// What `generate` reads of the config: the rollout section (its server and engine settings; the
/// sampling is the flags') and the device; the model is `--model`'s, the seed `--seed`'s.
pub fn generate_scope() -> AuditScope {
    let mut replaced: Vec<(String, String)> = vec![
        (
            "actor_rollout_ref.model.path".into(),
            "`verl-core generate` runs the model --model gives".into(),
        ),
        (
            "trainer.seed".into(),
            "`verl-core generate` is seeded by --seed".into(),
        ),
    ];
    replaced.extend(
        ["n", "temperature", "top_p", "top_k", "do_sample"].map(|key| {
            (
                format!("actor_rollout_ref.rollout.{key}"),
                "`verl-core generate` samples as its flags say (--n, --temperature, --top-p, \
                 --top-k, --greedy)"
                    .to_owned(),
            )
        }),
    );
    AuditScope::Command {
        name: "generate",
        reads: vec![
            "actor_rollout_ref.rollout".into(),
            "trainer.device".into(),
            "trainer.deterministic".into(),
        ],
        reads_what: "actor_rollout_ref.rollout (its sampling keys aside), trainer.device and \
                     trainer.deterministic",
        replaced,
    }
}
