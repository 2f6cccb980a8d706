//! verl's actor / critic section (`actor_rollout_ref.actor`, `…ref`, `critic`) with verl's key
//! names and defaults, plus `role` and `model`, for every engine strategy. The host has checked
//! verl's keys, so keys not read here (a strategy's own section among them) are ignored; a wrong
//! type is reported by serde with the key's path, a wrong value by [`ActorConfig::validate`].

use serde::{Deserialize, Serialize};
use serde_json::Value;
use verl_plugin_api::{ComponentInit, ConfigKeys};

use verl_model::ModelSpec;

use crate::ActorError;
use crate::distill::{DistillLossConfig, DistillSettings};
use crate::losses::{ClipConfig, KlPenalty, LossAggMode, PolicyLossMode, PolicyLossOptions};
use crate::{AdamWConfig, LrDecay, LrSchedule};

/// What the engine trains (or only scores).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The policy: log-probs and PPO updates.
    Actor,
    /// A frozen policy: log-probs only.
    Ref,
    /// A value model: values and value-loss updates.
    Critic,
    /// A frozen distillation teacher: log-probs and top-k log-probs only.
    Teacher,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Actor => "actor",
            Self::Ref => "ref",
            Self::Critic => "critic",
            Self::Teacher => "teacher",
        }
    }

    /// Whether the role trains (has an optimizer).
    pub fn trains(self) -> bool {
        matches!(self, Self::Actor | Self::Critic)
    }

    /// Where the role's section sits in verl's config.
    pub fn section_path(self) -> &'static str {
        match self {
            Self::Actor => "actor_rollout_ref.actor",
            Self::Ref => "actor_rollout_ref.ref",
            Self::Critic => "critic",
            Self::Teacher => "distillation.teacher_model",
        }
    }

    /// The full key path of the engine's own section `name` (`fsdp_config`, `megatron`): as the
    /// host sent it, else under the role's place in verl's config.
    pub fn engine_section_path(self, init: &ComponentInit, name: &str) -> String {
        if init.section_path.is_empty() {
            format!("{}.{name}", self.section_path())
        } else {
            init.section_path.clone()
        }
    }
}

/// An engine section's keys as the host's audit sees them: `acted_on`, `unsupported` (an error
/// when set) and `no_effect` ones with their reasons, each under `section` with its default from
/// `defaults` (the section serialised with its defaults).
pub fn engine_section_keys(
    section: &str,
    defaults: &Value,
    acted_on: &[&str],
    unsupported: &[(&str, &str)],
    no_effect: &[(&str, &str)],
) -> ConfigKeys {
    let key = |name: &str| (format!("{section}.{name}"), defaults[name].clone());
    let keys = unsupported.iter().fold(
        ConfigKeys::default().acts_on(acted_on.iter().map(|name| key(name).0)),
        |keys, (name, why)| {
            let (path, default) = key(name);
            keys.unsupported(&path, default, why)
        },
    );
    no_effect.iter().fold(keys, |keys, (name, why)| {
        let (path, default) = key(name);
        keys.no_effect(&path, default, why)
    })
}

fn default_lr() -> f64 {
    1e-6
}
fn default_weight_decay() -> f64 {
    0.01
}
fn default_betas() -> (f64, f64) {
    (0.9, 0.999)
}
fn minus_one() -> i64 {
    -1
}
fn default_num_cycles() -> f64 {
    0.5
}
fn one() -> usize {
    1
}
fn default_mini_batch() -> usize {
    256
}
fn default_clip_ratio() -> f64 {
    0.2
}
fn default_clip_ratio_c() -> f64 {
    3.0
}
fn default_kl_loss_coef() -> f64 {
    0.001
}
fn default_kl_loss_type() -> String {
    "low_var_kl".into()
}
fn default_cliprange_value() -> f64 {
    0.5
}
fn default_max_token_len() -> usize {
    16384
}

/// verl's `optim` section. Keys verl may leave `null` are options.
#[derive(Debug, Clone, Deserialize)]
pub struct OptimConfig {
    #[serde(default = "default_lr")]
    pub lr: f64,
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f64,
    /// Max global gradient norm; `None` falls back to the section's `grad_clip` (older verl), then 1.0.
    pub clip_grad: Option<f64>,
    #[serde(default = "default_betas")]
    pub betas: (f64, f64),
    /// ≤ 0: derive from `lr_warmup_steps_ratio`.
    #[serde(default = "minus_one")]
    pub lr_warmup_steps: i64,
    #[serde(default)]
    pub lr_warmup_steps_ratio: f64,
    /// Filled in by the trainer; needed by the cosine schedule and the warm-up ratio.
    pub total_training_steps: Option<i64>,
    /// `constant` | `cosine`; `warmup_style` is its older spelling.
    pub lr_scheduler_type: Option<String>,
    pub warmup_style: Option<String>,
    pub min_lr_ratio: Option<f64>,
    #[serde(default = "default_num_cycles")]
    pub num_cycles: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("every optim key has a default")
    }
}

/// verl's `policy_loss` sub-section. Keys verl may leave `null` take its defaults.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct PolicyLossConfig {
    #[serde(default)]
    pub loss_mode: PolicyLossMode,
    pub clip_cov_ratio: Option<f64>,
    pub clip_cov_lb: Option<f64>,
    pub clip_cov_ub: Option<f64>,
    pub kl_cov_ratio: Option<f64>,
    pub ppo_kl_coef: Option<f64>,
    pub dro_beta: Option<f64>,
}

/// verl's `router_replay.mode` (`RouterReplayConfig`) for mixture-of-experts models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum RouterReplayMode {
    /// Every forward routes with its own router.
    #[default]
    #[serde(rename = "disabled")]
    Disabled,
    /// `compute_log_prob` records each token's experts (returned as `routed_experts`); the
    /// update's forwards replay them.
    R2,
    /// The rollout's experts (the batch's `routed_experts`) are replayed in `compute_log_prob`
    /// and in the update.
    R3,
}

/// verl's `router_replay` section. `record_file` / `replay_file` are declared by verl but read
/// by none of its workers (the routing travels in the batch); the host reports them.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct RouterReplayConfig {
    #[serde(default)]
    pub mode: RouterReplayMode,
}

/// The section, as every strategy reads it.
#[derive(Debug, Clone, Deserialize)]
pub struct ActorConfig {
    pub role: Role,
    pub model: ModelSpec,
    #[serde(default)]
    pub optim: OptimConfig,
    /// Older verl's place for the gradient-clipping norm.
    pub grad_clip: Option<f64>,
    /// Sequences per optimizer step (the trainer has already multiplied by `rollout.n`).
    #[serde(default = "default_mini_batch")]
    pub ppo_mini_batch_size: usize,
    /// Sequences per forward/backward (gradient accumulation); default the whole mini-batch.
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    /// Sequences per forward in `compute_log_prob` / `compute_values` (verl's ref/rollout and
    /// critic keys); default the PPO micro-batch size, then the whole batch.
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    pub forward_micro_batch_size_per_gpu: Option<usize>,
    /// verl's `use_dynamic_bsz`: micro-batches by a token budget instead of a row count — in
    /// updates (`ppo_max_token_len_per_gpu`) and in the critic's `compute_values`
    /// (`forward_max_token_len_per_gpu`).
    #[serde(default)]
    pub use_dynamic_bsz: bool,
    /// Real (unpadded) tokens per micro-batch and rank with `use_dynamic_bsz`.
    #[serde(default = "default_max_token_len")]
    pub ppo_max_token_len_per_gpu: usize,
    /// `compute_log_prob` by a token budget (verl's rollout and ref `log_prob_use_dynamic_bsz`);
    /// default `use_dynamic_bsz`, as verl's config interpolates it.
    pub log_prob_use_dynamic_bsz: Option<bool>,
    /// Its budget; default `ppo_max_token_len_per_gpu`.
    pub log_prob_max_token_len_per_gpu: Option<usize>,
    /// The critic's `compute_values` budget; default `ppo_max_token_len_per_gpu`.
    pub forward_max_token_len_per_gpu: Option<usize>,
    #[serde(default = "one")]
    pub ppo_epochs: usize,
    /// Shuffle the batch before splitting it into mini-batches, each epoch (seeded, checkpointed).
    #[serde(default)]
    pub shuffle: bool,
    #[serde(default = "default_clip_ratio")]
    pub clip_ratio: f64,
    pub clip_ratio_low: Option<f64>,
    pub clip_ratio_high: Option<f64>,
    #[serde(default = "default_clip_ratio_c")]
    pub clip_ratio_c: f64,
    #[serde(default)]
    pub loss_agg_mode: LossAggMode,
    /// Divisor of `seq-mean-token-sum-norm` (verl's); default the response length.
    pub loss_scale_factor: Option<f64>,
    #[serde(default)]
    pub entropy_coeff: f64,
    #[serde(default)]
    pub use_kl_loss: bool,
    #[serde(default = "default_kl_loss_coef")]
    pub kl_loss_coef: f64,
    #[serde(default = "default_kl_loss_type")]
    pub kl_loss_type: String,
    #[serde(default)]
    pub policy_loss: PolicyLossConfig,
    /// SAPO's gate temperatures.
    pub tau_pos: Option<f64>,
    pub tau_neg: Option<f64>,
    /// Critic: clip range of the value update around the old values.
    #[serde(default = "default_cliprange_value")]
    pub cliprange_value: f64,
    /// Actor: verl's `distillation.distillation_loss`, sent when `distillation.enabled`.
    pub distillation_loss: Option<DistillLossConfig>,
    #[serde(default)]
    pub router_replay: RouterReplayConfig,
    /// verl's `use_prefix_grouper`: packed passes compute each distinct prompt once (see
    /// [`PassLayout::Packed`]); `true` packs the passes even without `use_remove_padding`.
    /// None: on when packed.
    pub use_prefix_grouper: Option<bool>,
}

/// How an engine lays out a micro-batch's rows for its forward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassLayout {
    /// `[B, S]` rows, padding included.
    Padded,
    /// One stream of the rows' real tokens (verl's `use_remove_padding`); with `share_prompts`,
    /// each distinct prompt once, the rows repeating it attending its slots (verl's
    /// `use_prefix_grouper`, see [`verl_model::Packing::sharing_prompts`]).
    Packed { share_prompts: bool },
}

/// The validated, resolved settings an engine runs with.
#[derive(Debug, Clone)]
pub struct ActorSettings {
    pub role: Role,
    pub model: ModelSpec,
    pub layout: PassLayout,
    pub optimizer: AdamWConfig,
    pub clip_grad: f64,
    pub schedule: LrSchedule,
    pub mini_batch: usize,
    /// How an update's mini-batches are cut.
    pub micro_batch: MicroBatching,
    /// How `compute_log_prob` / `compute_values` cut their rows.
    pub forward_micro_batch: MicroBatching,
    pub epochs: usize,
    pub shuffle: bool,
    pub clip: ClipConfig,
    pub loss_agg_mode: LossAggMode,
    pub loss_scale_factor: Option<f64>,
    pub loss_mode: PolicyLossMode,
    pub loss_options: PolicyLossOptions,
    pub entropy_coeff: f64,
    /// `Some((coef, penalty))` when `use_kl_loss`.
    pub kl_loss: Option<(f64, KlPenalty)>,
    pub cliprange_value: f64,
    /// The distillation loss, when the actor distils a teacher.
    pub distillation: Option<DistillSettings>,
    /// Router replay of a mixture-of-experts policy (the actor only).
    pub router_replay: RouterReplayMode,
}

/// How rows are cut into micro-batches (forward passes, and gradient accumulation in updates).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MicroBatching {
    /// At most this many rows each, in order; all rows at once when `None`.
    Rows(Option<usize>),
    /// verl's `use_dynamic_bsz`: balanced micro-batches of about `max_token_len` real tokens each
    /// (per rank; a strategy may scale it, see `Strategy::token_budget_scale`), outputs restored
    /// to the input order. `key` names the setting in errors.
    Tokens {
        max_token_len: usize,
        key: &'static str,
    },
}

fn invalid(key: &str, reason: impl Into<String>) -> ActorError {
    ActorError::Config {
        key: key.to_owned(),
        reason: reason.into(),
    }
}

fn positive(key: &str, value: usize) -> Result<usize, ActorError> {
    if value == 0 {
        Err(invalid(key, "must be at least 1"))
    } else {
        Ok(value)
    }
}

fn non_negative(key: &str, value: f64) -> Result<f64, ActorError> {
    if value >= 0.0 && value.is_finite() {
        Ok(value)
    } else {
        Err(invalid(
            key,
            format!("must be a finite number ≥ 0, got {value}"),
        ))
    }
}

impl ActorConfig {
    /// Checks values serde cannot and resolves verl's fallbacks (clip_ratio_low/high default to
    /// clip_ratio, warm-up steps from the ratio, the schedule type from either spelling).
    pub fn validate(self) -> Result<ActorSettings, ActorError> {
        let o = &self.optim;
        non_negative("optim.lr", o.lr)?;
        non_negative("optim.weight_decay", o.weight_decay)?;
        for (key, beta) in [("optim.betas[0]", o.betas.0), ("optim.betas[1]", o.betas.1)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(invalid(key, format!("must lie in [0, 1), got {beta}")));
            }
        }
        let clip_grad = match (o.clip_grad, self.grad_clip) {
            (Some(c), _) => non_negative("optim.clip_grad", c)?,
            (None, Some(c)) => non_negative("grad_clip", c)?,
            (None, None) => 1.0,
        };
        let total_steps = o.total_training_steps.filter(|&t| t > 0).unwrap_or(0) as u64;
        if !(0.0..=1.0).contains(&o.lr_warmup_steps_ratio) {
            return Err(invalid(
                "optim.lr_warmup_steps_ratio",
                format!("must lie in [0, 1], got {}", o.lr_warmup_steps_ratio),
            ));
        }
        let warmup_steps = if o.lr_warmup_steps > 0 {
            o.lr_warmup_steps as u64
        } else {
            (o.lr_warmup_steps_ratio * total_steps as f64) as u64
        };
        let (key, style) = match (&o.lr_scheduler_type, &o.warmup_style) {
            (Some(s), _) => ("optim.lr_scheduler_type", s.as_str()),
            (None, Some(s)) => ("optim.warmup_style", s.as_str()),
            (None, None) => ("optim.lr_scheduler_type", "constant"),
        };
        let decay = match style {
            "constant" => LrDecay::Constant,
            "cosine" => {
                if total_steps == 0 {
                    return Err(invalid(
                        "optim.total_training_steps",
                        "the cosine schedule needs a positive total",
                    ));
                }
                let min_lr_ratio = o.min_lr_ratio.unwrap_or(0.0);
                if !(0.0..=1.0).contains(&min_lr_ratio) {
                    return Err(invalid(
                        "optim.min_lr_ratio",
                        format!("must lie in [0, 1], got {min_lr_ratio}"),
                    ));
                }
                LrDecay::Cosine {
                    min_lr_ratio,
                    num_cycles: non_negative("optim.num_cycles", o.num_cycles)?,
                }
            }
            other => {
                return Err(invalid(
                    key,
                    format!("unknown schedule {other:?} (constant, cosine)"),
                ));
            }
        };
        let mini_batch = positive("ppo_mini_batch_size", self.ppo_mini_batch_size)?;
        let micro_batch = self
            .ppo_micro_batch_size_per_gpu
            .map(|m| positive("ppo_micro_batch_size_per_gpu", m))
            .transpose()?;
        // Updates by a token budget do not read it (verl checks it only without one).
        if let Some(micro) = micro_batch
            && !self.use_dynamic_bsz
            && mini_batch % micro != 0
        {
            return Err(invalid(
                "ppo_micro_batch_size_per_gpu",
                format!("{micro} does not divide ppo_mini_batch_size {mini_batch}"),
            ));
        }
        let forward_rows = match (
            self.log_prob_micro_batch_size_per_gpu,
            self.forward_micro_batch_size_per_gpu,
        ) {
            (Some(m), _) => Some(positive("log_prob_micro_batch_size_per_gpu", m)?),
            (None, Some(m)) => Some(positive("forward_micro_batch_size_per_gpu", m)?),
            (None, None) => micro_batch,
        };
        // Budgets are checked where they are used (verl reads them only then).
        let tokens =
            |key: &'static str, max_token_len: usize| -> Result<MicroBatching, ActorError> {
                Ok(MicroBatching::Tokens {
                    max_token_len: positive(key, max_token_len)?,
                    key,
                })
            };
        let ppo_budget = || tokens("ppo_max_token_len_per_gpu", self.ppo_max_token_len_per_gpu);
        let update_batching = if self.use_dynamic_bsz {
            ppo_budget()?
        } else {
            MicroBatching::Rows(micro_batch)
        };
        // verl: the critic's forward follows its `use_dynamic_bsz`; log-probs follow the
        // rollout's (actor) or the ref's `log_prob_use_dynamic_bsz`.
        let (forward_dynamic, forward_budget) = match self.role {
            Role::Critic => (
                self.use_dynamic_bsz,
                self.forward_max_token_len_per_gpu
                    .map(|m| ("forward_max_token_len_per_gpu", m)),
            ),
            Role::Actor | Role::Ref | Role::Teacher => (
                self.log_prob_use_dynamic_bsz
                    .unwrap_or(self.use_dynamic_bsz),
                self.log_prob_max_token_len_per_gpu
                    .map(|m| ("log_prob_max_token_len_per_gpu", m)),
            ),
        };
        let forward_micro_batch = match (forward_dynamic, forward_budget) {
            (false, _) => MicroBatching::Rows(forward_rows),
            (true, Some((key, m))) => tokens(key, m)?,
            (true, None) => ppo_budget()?,
        };
        let clip = ClipConfig {
            clip_ratio_low: non_negative(
                "clip_ratio_low",
                self.clip_ratio_low.unwrap_or(self.clip_ratio),
            )?,
            clip_ratio_high: non_negative(
                "clip_ratio_high",
                self.clip_ratio_high.unwrap_or(self.clip_ratio),
            )?,
            clip_ratio_c: self.clip_ratio_c,
        };
        non_negative("clip_ratio", self.clip_ratio)?;
        if clip.clip_ratio_c <= 1.0 {
            return Err(invalid(
                "clip_ratio_c",
                format!(
                    "the dual-clip bound must be greater than 1, got {}",
                    clip.clip_ratio_c
                ),
            ));
        }
        let loss_options = self.loss_options()?;
        let kl_loss = if self.use_kl_loss {
            let penalty = self
                .kl_loss_type
                .parse::<KlPenalty>()
                .map_err(|e| invalid("kl_loss_type", e.to_string()))?;
            Some((non_negative("kl_loss_coef", self.kl_loss_coef)?, penalty))
        } else {
            None
        };
        let router_replay = self.router_replay.mode;
        if router_replay != RouterReplayMode::Disabled && self.role != Role::Actor {
            return Err(invalid(
                "router_replay.mode",
                format!(
                    "only the actor replays routing (verl's R2/R3); a `{}` engine routes with its own router",
                    self.role.as_str()
                ),
            ));
        }
        // verl's prefix grouper runs on padded rows only (it is skipped with
        // `use_remove_padding`); here prompts are shared within a packed stream, so asking for it
        // packs the passes whatever `use_remove_padding` says (the same results either way).
        let layout = match (self.model.use_remove_padding, self.use_prefix_grouper) {
            (false, None | Some(false)) => PassLayout::Padded,
            (true, Some(false)) => PassLayout::Packed {
                share_prompts: false,
            },
            (_, _) => PassLayout::Packed {
                share_prompts: true,
            },
        };
        Ok(ActorSettings {
            role: self.role,
            layout,
            router_replay,
            optimizer: AdamWConfig {
                betas: o.betas,
                weight_decay: o.weight_decay,
                ..AdamWConfig::default()
            },
            clip_grad,
            schedule: LrSchedule {
                base_lr: o.lr,
                warmup_steps,
                total_steps,
                decay,
            },
            mini_batch,
            micro_batch: update_batching,
            forward_micro_batch,
            epochs: positive("ppo_epochs", self.ppo_epochs)?,
            shuffle: self.shuffle,
            clip,
            loss_agg_mode: self.loss_agg_mode,
            loss_scale_factor: self
                .loss_scale_factor
                .map(|f| {
                    if f > 0.0 {
                        Ok(f)
                    } else {
                        Err(invalid(
                            "loss_scale_factor",
                            format!("must be positive, got {f}"),
                        ))
                    }
                })
                .transpose()?,
            loss_mode: self.policy_loss.loss_mode,
            loss_options,
            entropy_coeff: self.entropy_coeff,
            kl_loss,
            cliprange_value: non_negative("cliprange_value", self.cliprange_value)?,
            distillation: self
                .distillation_loss
                .as_ref()
                .map(|d| {
                    d.validate().map_err(|(key, reason)| {
                        invalid(&format!("distillation.distillation_loss.{key}"), reason)
                    })
                })
                .transpose()?,
            model: self.model,
        })
    }
}

impl ActorConfig {
    /// The policy-loss knobs, verl's defaults where unset; the ones the chosen loss reads must be
    /// positive (verl asserts so).
    fn loss_options(&self) -> Result<PolicyLossOptions, ActorError> {
        let d = PolicyLossOptions::default();
        let p = &self.policy_loss;
        let options = PolicyLossOptions {
            tau_pos: self.tau_pos.unwrap_or(d.tau_pos),
            tau_neg: self.tau_neg.unwrap_or(d.tau_neg),
            clip_cov_ratio: p.clip_cov_ratio.unwrap_or(d.clip_cov_ratio),
            clip_cov_lb: p.clip_cov_lb.unwrap_or(d.clip_cov_lb),
            clip_cov_ub: p.clip_cov_ub.unwrap_or(d.clip_cov_ub),
            kl_cov_ratio: p.kl_cov_ratio.unwrap_or(d.kl_cov_ratio),
            ppo_kl_coef: p.ppo_kl_coef.unwrap_or(d.ppo_kl_coef),
            dro_beta: p.dro_beta,
        };
        let must_be_positive = |key: &str, value: Option<f64>| match value {
            Some(v) if v > 0.0 && v.is_finite() => Ok(()),
            _ => Err(invalid(
                key,
                format!(
                    "must be set to a positive number for loss_mode `{}`, got {}",
                    p.loss_mode.as_str(),
                    value.map_or("nothing".to_owned(), |v| v.to_string())
                ),
            )),
        };
        match p.loss_mode {
            PolicyLossMode::Sapo => {
                must_be_positive("tau_pos", Some(options.tau_pos))?;
                must_be_positive("tau_neg", Some(options.tau_neg))?;
            }
            PolicyLossMode::ClipCov => {
                must_be_positive("policy_loss.clip_cov_ratio", Some(options.clip_cov_ratio))?
            }
            PolicyLossMode::KlCov => {
                must_be_positive("policy_loss.kl_cov_ratio", Some(options.kl_cov_ratio))?
            }
            PolicyLossMode::Dro => must_be_positive("policy_loss.dro_beta", options.dro_beta)?,
            _ => {}
        }
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(extra: &str) -> Result<ActorSettings, ActorError> {
        let text = format!(r#"{{"role":"actor","model":{{"path":"m"}}{extra}}}"#);
        serde_json::from_str::<ActorConfig>(&text)
            .unwrap()
            .validate()
    }

    #[test]
    fn verl_defaults_and_fallbacks() {
        let s = settings("").unwrap();
        assert_eq!(
            (s.schedule.base_lr, s.optimizer.weight_decay, s.clip_grad),
            (1e-6, 0.01, 1.0)
        );
        assert_eq!(
            (s.mini_batch, s.micro_batch, s.forward_micro_batch, s.epochs),
            (256, MicroBatching::Rows(None), MicroBatching::Rows(None), 1)
        );
        assert_eq!(
            (
                s.clip.clip_ratio_low,
                s.clip.clip_ratio_high,
                s.clip.clip_ratio_c
            ),
            (0.2, 0.2, 3.0)
        );
        assert_eq!(
            (s.loss_agg_mode, s.loss_mode, s.kl_loss),
            (LossAggMode::TokenMean, PolicyLossMode::Vanilla, None)
        );
        let s = settings(
            r#","clip_ratio":0.1,"clip_ratio_high":0.28,"grad_clip":0.5,"use_kl_loss":true,
               "optim":{"lr_warmup_steps_ratio":0.1,"total_training_steps":50,"warmup_style":"cosine","min_lr_ratio":null}"#,
        )
        .unwrap();
        assert_eq!(
            (s.clip.clip_ratio_low, s.clip.clip_ratio_high, s.clip_grad),
            (0.1, 0.28, 0.5)
        );
        assert_eq!((s.schedule.warmup_steps, s.schedule.total_steps), (5, 50));
        assert_eq!(
            s.schedule.decay,
            LrDecay::Cosine {
                min_lr_ratio: 0.0,
                num_cycles: 0.5
            }
        );
        assert_eq!(s.kl_loss.unwrap().0, 0.001);
        let s = settings(
            r#","tau_pos":2,"policy_loss":{"loss_mode":"dro","dro_beta":0.5,"clip_cov_lb":null}"#,
        )
        .unwrap();
        assert_eq!(s.loss_mode, PolicyLossMode::Dro);
        assert_eq!(
            s.loss_options,
            PolicyLossOptions {
                tau_pos: 2.0,
                dro_beta: Some(0.5),
                ..PolicyLossOptions::default()
            }
        );
    }

    #[test]
    fn pass_layout_follows_padding_and_the_prefix_grouper() {
        let layout = |padding: bool, grouper: &str| {
            let text = format!(
                r#"{{"role":"actor","model":{{"path":"m","use_remove_padding":{padding}}},"use_prefix_grouper":{grouper}}}"#
            );
            serde_json::from_str::<ActorConfig>(&text)
                .unwrap()
                .validate()
                .unwrap()
                .layout
        };
        let packed = |share_prompts| PassLayout::Packed { share_prompts };
        assert_eq!(layout(false, "null"), PassLayout::Padded);
        assert_eq!(layout(false, "false"), PassLayout::Padded);
        // verl's prefix grouper is for padded rows; here it shares prompts in a packed stream.
        assert_eq!(layout(false, "true"), packed(true));
        assert_eq!(layout(true, "null"), packed(true));
        assert_eq!(layout(true, "false"), packed(false));
        assert_eq!(layout(true, "true"), packed(true));
    }

    #[test]
    fn token_budgets_follow_verl_defaults() {
        let tokens = |max_token_len, key| MicroBatching::Tokens { max_token_len, key };
        let s = settings(r#","use_dynamic_bsz":true,"ppo_micro_batch_size_per_gpu":3"#).unwrap();
        // The log-prob switch and budget default to the update's, as verl interpolates them.
        assert_eq!(s.micro_batch, tokens(16384, "ppo_max_token_len_per_gpu"));
        assert_eq!(s.forward_micro_batch, s.micro_batch);
        let s = settings(
            r#","use_dynamic_bsz":true,"ppo_max_token_len_per_gpu":64,"log_prob_max_token_len_per_gpu":96"#,
        )
        .unwrap();
        assert_eq!(s.micro_batch, tokens(64, "ppo_max_token_len_per_gpu"));
        assert_eq!(
            s.forward_micro_batch,
            tokens(96, "log_prob_max_token_len_per_gpu")
        );
        // Each switch on its own.
        let s = settings(
            r#","use_dynamic_bsz":true,"log_prob_use_dynamic_bsz":false,"log_prob_micro_batch_size_per_gpu":3"#,
        )
        .unwrap();
        assert_eq!(s.forward_micro_batch, MicroBatching::Rows(Some(3)));
        let s = settings(r#","log_prob_use_dynamic_bsz":true,"ppo_micro_batch_size_per_gpu":2"#)
            .unwrap();
        assert_eq!(s.micro_batch, MicroBatching::Rows(Some(2)));
        assert_eq!(
            s.forward_micro_batch,
            tokens(16384, "ppo_max_token_len_per_gpu")
        );
        // The critic's forward budget is its own key; its log-prob keys do not apply.
        let critic = |extra: &str| {
            serde_json::from_str::<ActorConfig>(&format!(
                r#"{{"role":"critic","model":{{"path":"m"}},"use_dynamic_bsz":true{extra}}}"#
            ))
            .unwrap()
            .validate()
            .unwrap()
        };
        assert_eq!(
            critic(r#","forward_max_token_len_per_gpu":128,"log_prob_use_dynamic_bsz":false"#)
                .forward_micro_batch,
            tokens(128, "forward_max_token_len_per_gpu")
        );
        assert_eq!(
            critic(r#","ppo_max_token_len_per_gpu":32"#).forward_micro_batch,
            tokens(32, "ppo_max_token_len_per_gpu")
        );
    }

    #[test]
    fn invalid_values_name_the_key() {
        for (extra, key) in [
            (
                r#","optim":{"lr_scheduler_type":"linear"}"#,
                "optim.lr_scheduler_type",
            ),
            (
                r#","optim":{"lr_scheduler_type":"cosine"}"#,
                "optim.total_training_steps",
            ),
            (
                r#","ppo_mini_batch_size":8,"ppo_micro_batch_size_per_gpu":3"#,
                "ppo_micro_batch_size_per_gpu",
            ),
            (r#","use_kl_loss":true,"kl_loss_type":"k9""#, "kl_loss_type"),
            (r#","clip_ratio_c":0.5"#, "clip_ratio_c"),
            (
                r#","policy_loss":{"loss_mode":"dro"}"#,
                "policy_loss.dro_beta",
            ),
            (
                r#","policy_loss":{"loss_mode":"kl_cov","kl_cov_ratio":0}"#,
                "policy_loss.kl_cov_ratio",
            ),
            (
                r#","tau_neg":-1,"policy_loss":{"loss_mode":"sapo"}"#,
                "tau_neg",
            ),
            (r#","ppo_epochs":0"#, "ppo_epochs"),
            (
                r#","use_dynamic_bsz":true,"ppo_max_token_len_per_gpu":0"#,
                "ppo_max_token_len_per_gpu",
            ),
            (
                r#","log_prob_use_dynamic_bsz":true,"log_prob_max_token_len_per_gpu":0"#,
                "log_prob_max_token_len_per_gpu",
            ),
        ] {
            let err = settings(extra).unwrap_err().to_string();
            assert!(err.contains(&format!("`{key}`")), "{extra}: {err}");
        }
    }
}
