//! verl's `distillation` section (on-policy distillation; verl-project/verl 01dcf9f0's
//! `DistillationConfig`, which verl b178a3c does not have): a teacher model scores the student's
//! samples and the actor's loss pulls the student towards it. The loss keys are handed to the
//! actor engine as they are (it validates them, naming `distillation.distillation_loss.<key>`);
//! the teacher is an engine role (`EngineRole::Teacher`), not an inference server.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// `distillation.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DistillationConfig {
    pub enabled: bool,
    /// verl's teacher replicas (Ray workers); one in-process engine here.
    pub num_workers: usize,
    pub teacher_model: TeacherModelConfig,
    pub distillation_loss: DistillationLossConfig,
}

impl Default for DistillationConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            num_workers: 8,
            teacher_model: TeacherModelConfig::default(),
            distillation_loss: DistillationLossConfig::default(),
        }
    }
}

/// `distillation.teacher_model.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TeacherModelConfig {
    pub enable_resource_pool: bool,
    pub n_gpus_per_node: usize,
    pub nnodes: usize,
    /// A Hugging Face model directory with the student's tokenizer.
    pub model_path: Option<String>,
    /// verl's teacher inference server settings (a rollout section).
    pub inference: Value,
}

impl Default for TeacherModelConfig {
    fn default() -> Self {
        Self {
            enable_resource_pool: false,
            n_gpus_per_node: 0,
            nnodes: 0,
            model_path: None,
            inference: json!({}),
        }
    }
}

/// `distillation.distillation_loss.*`, verl's keys and defaults (`tail_mass_eps`'s default is
/// ours).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DistillationLossConfig {
    pub loss_mode: String,
    pub topk: Option<i64>,
    pub use_task_rewards: bool,
    pub distillation_loss_coef: f64,
    pub loss_max_clamp: Option<f64>,
    pub log_prob_min_clamp: Option<f64>,
    pub use_policy_gradient: bool,
    pub policy_loss_mode: String,
    pub clip_ratio: f64,
    pub clip_ratio_low: Option<f64>,
    pub clip_ratio_high: Option<f64>,
    pub tail_mass_eps: f64,
}

impl Default for DistillationLossConfig {
    fn default() -> Self {
        Self {
            loss_mode: "k3".into(),
            topk: Some(128),
            use_task_rewards: true,
            distillation_loss_coef: 1.0,
            loss_max_clamp: Some(10.0),
            log_prob_min_clamp: Some(-10.0),
            use_policy_gradient: true,
            policy_loss_mode: "vanilla".into(),
            clip_ratio: 0.2,
            clip_ratio_low: None,
            clip_ratio_high: None,
            tail_mass_eps: 1e-6,
        }
    }
}

/// The top-k loss modes (the others are single-sample estimators of the sampled token).
const TOPK_MODES: [&str; 4] = [
    "forward_kl_topk",
    "forward_kl_topk_tail",
    "reverse_kl_topk",
    "reverse_kl_topk_tail",
];

impl DistillationConfig {
    /// The teacher's `k` when the loss takes top-k log-probs; `None` for an estimator mode.
    pub fn topk(&self) -> Option<i64> {
        let loss = &self.distillation_loss;
        TOPK_MODES
            .contains(&loss.loss_mode.as_str())
            .then_some(loss.topk)
            .flatten()
    }
}
