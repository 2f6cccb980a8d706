//! On-policy distillation: the teacher's top-k log-probs of each response position, and the
//! student's KL to them over the teacher's top-k tokens.
//!
//! Losses follow verl's `verl/trainer/distillation` (verl-project/verl 01dcf9f0): `forward_kl_topk`
//! is `Σ_{i∈top-k} p_i (log p_i − log q_i)` over the teacher's top-k tokens, with both log-probs
//! clamped below at `log_prob_min_clamp` and not renormalised (so the sum can dip below zero; it is
//! clamped at 0 as verl does); `forward_kl_topk_tail` adds one bucket for every other token,
//! `p_tail (log p_tail − log q_tail)` (a true KL of the coarse-grained distributions). verl has no
//! top-k reverse KL (its reverse modes are single-sample estimators); ours are `reverse_kl_topk`,
//! `Σ q̃_i (log q̃_i − log p̃_i)` with both renormalised over the top-k (unnormalised, the sum is
//! smallest at `q = p/e`), and `reverse_kl_topk_tail`, the tail-bucket sum with `p` and `q`
//! swapped.
//!
//! The student's log-probs come from ONE log-softmax over the vocabulary, from which the sampled
//! token and the k teacher tokens are gathered in one gather ([`verl_model::fused_scores`]): the
//! policy loss and the distillation loss share it, where computing them separately holds two
//! `[N, V]` log-softmax tensors for the backward pass.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::losses::{ClipConfig, KlPenalty};

/// verl's batch key of the teacher's top-k token ids, `[B, R, k]` int64.
pub const TEACHER_IDS: &str = "teacher_ids";
/// verl's batch key of the teacher's log-probs: `[B, R, k]` fp32 of the top-k tokens (top-k
/// modes), or `[B, R]` of the sampled tokens (estimator modes).
pub const TEACHER_LOGPROBS: &str = "teacher_logprobs";

/// verl's `distillation.distillation_loss.loss_mode` values that take top-k log-probs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DistillLossMode {
    #[default]
    ForwardKlTopk,
    ForwardKlTopkTail,
    ReverseKlTopk,
    ReverseKlTopkTail,
}

/// verl's `distillation.distillation_loss` section, which the trainer hands the actor (under
/// `distillation_loss`) when `distillation.enabled`. Defaults are verl's (`tail_mass_eps`: ours;
/// verl's default is not in its dataclass).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DistillLossConfig {
    /// A top-k mode ([`DistillLossMode`]) or a single-sample estimator of the sampled token's
    /// reverse KL (`kl`/`k1`, `abs`, `mse`/`k2`, `low_var_kl`/`k3`).
    pub loss_mode: String,
    pub topk: Option<i64>,
    pub use_task_rewards: bool,
    pub distillation_loss_coef: f64,
    pub loss_max_clamp: Option<f64>,
    pub log_prob_min_clamp: Option<f64>,
    pub use_policy_gradient: bool,
    pub policy_loss_mode: String,
    pub clip_ratio: f64,
    /// Default `clip_ratio` (verl's vanilla policy loss falls back to it).
    pub clip_ratio_low: Option<f64>,
    pub clip_ratio_high: Option<f64>,
    pub tail_mass_eps: f64,
}

impl Default for DistillLossConfig {
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

/// What the student is trained against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DistillObjective {
    /// KL over the teacher's top-`k` tokens.
    Topk { k: i64, kl: TopkKlConfig },
    /// A single-sample estimator on the sampled token (verl's `kl_penalty`).
    Estimator(KlPenalty),
}

/// The validated [`DistillLossConfig`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DistillSettings {
    pub objective: DistillObjective,
    pub use_task_rewards: bool,
    pub coef: f64,
    pub loss_max_clamp: Option<f64>,
    /// `Some(clip)`: the negated per-token loss is a PPO advantage (verl's
    /// `use_policy_gradient`); `None`: the loss is backpropagated directly.
    pub policy_gradient: Option<ClipConfig>,
}

impl DistillLossConfig {
    /// Checks the section as verl's `DistillationLossConfig.__post_init__` does; errors name the
    /// key under `distillation.distillation_loss`.
    pub fn validate(&self) -> std::result::Result<DistillSettings, (String, String)> {
        let bad = |key: &str, reason: String| Err((key.to_owned(), reason));
        let objective = match serde_json::from_value::<DistillLossMode>(serde_json::json!(
            self.loss_mode
        )) {
            Ok(loss_mode) => {
                let Some(k) = self.topk.filter(|&k| k >= 1) else {
                    return bad(
                        "topk",
                        format!(
                            "must be a positive number for loss_mode `{}`, got {:?}",
                            self.loss_mode, self.topk
                        ),
                    );
                };
                DistillObjective::Topk {
                    k,
                    kl: TopkKlConfig {
                        loss_mode,
                        log_prob_min_clamp: self.log_prob_min_clamp,
                        tail_mass_eps: self.tail_mass_eps,
                    },
                }
            }
            Err(_) => match self.loss_mode.parse::<KlPenalty>() {
                Ok(penalty) if !self.loss_mode.ends_with('+') => {
                    DistillObjective::Estimator(penalty)
                }
                _ => {
                    return bad(
                        "loss_mode",
                        format!(
                            "unknown loss_mode `{}` (forward_kl_topk, forward_kl_topk_tail, reverse_kl_topk, \
                             reverse_kl_topk_tail, kl, k1, abs, mse, k2, low_var_kl, k3)",
                            self.loss_mode
                        ),
                    );
                }
            },
        };
        if !self.use_policy_gradient && matches!(self.loss_mode.as_str(), "k1" | "kl") {
            // verl: k1's gradient with respect to the student does not depend on the teacher.
            return bad("loss_mode", "k1 cannot be backpropagated directly (its gradient ignores the teacher): set use_policy_gradient=true".into());
        }
        if self.policy_loss_mode != "vanilla" {
            return bad(
                "policy_loss_mode",
                format!(
                    "only `vanilla` is supported (as verl), got `{}`",
                    self.policy_loss_mode
                ),
            );
        }
        if !(self.tail_mass_eps > 0.0 && self.tail_mass_eps < 1.0) {
            return bad(
                "tail_mass_eps",
                format!("must lie in (0, 1), got {}", self.tail_mass_eps),
            );
        }
        if !(self.distillation_loss_coef.is_finite() && self.distillation_loss_coef >= 0.0) {
            return bad(
                "distillation_loss_coef",
                format!(
                    "must be a finite number ≥ 0, got {}",
                    self.distillation_loss_coef
                ),
            );
        }
        if let Some(c) = self.loss_max_clamp.filter(|c| c.is_nan() || *c <= 0.0) {
            return bad("loss_max_clamp", format!("must be positive, got {c}"));
        }
        Ok(DistillSettings {
            objective,
            use_task_rewards: self.use_task_rewards,
            coef: self.distillation_loss_coef,
            loss_max_clamp: self.loss_max_clamp,
            policy_gradient: self.use_policy_gradient.then_some(ClipConfig {
                clip_ratio_low: self.clip_ratio_low.unwrap_or(self.clip_ratio),
                clip_ratio_high: self.clip_ratio_high.unwrap_or(self.clip_ratio),
                ..ClipConfig::default()
            }),
        })
    }
}

/// The per-token loss's settings (verl's `DistillationLossConfig` minus the aggregation keys).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TopkKlConfig {
    pub loss_mode: DistillLossMode,
    /// Log-probs below this are raised to it before the KL (`None`: no clamp).
    pub log_prob_min_clamp: Option<f64>,
    /// Floor of the tail mass inside a logarithm (tail modes).
    pub tail_mass_eps: f64,
}

/// The per-token top-k KL and the top-k masses `Σ exp(lp)` of student and teacher (before any
/// clamp), each `[..]`.
#[derive(Debug)]
pub struct TopkKl {
    pub loss: Tensor,
    pub student_mass: Tensor,
    pub teacher_mass: Tensor,
}

/// verl's top-k KL of `student [.., k]` to `teacher [.., k]` log-probs of the same tokens.
pub fn topk_kl(student: &Tensor, teacher: &Tensor, config: &TopkKlConfig) -> TopkKl {
    let student_mass = student.exp().sum_dim_intlist(-1, false, Kind::Float);
    let teacher_mass = teacher.exp().sum_dim_intlist(-1, false, Kind::Float);
    let (student, teacher) = match config.log_prob_min_clamp {
        Some(min) => (student.clamp_min(min), teacher.clamp_min(min)),
        None => (student.shallow_clone(), teacher.shallow_clone()),
    };
    // KL(a‖b) over the top-k support: Σ a (log a − log b).
    let kl = |log_a: &Tensor, log_b: &Tensor| {
        (log_a.exp() * (log_a - log_b)).sum_dim_intlist(-1, false, Kind::Float)
    };
    // verl's tail bucket: the tail in the logarithm of the divisor is floored at `eps` (→ 0 would
    // make the loss infinite); the weighting tail goes to 0 by continuity (x log x).
    let tail = |mass_a: &Tensor, mass_b: &Tensor| {
        let tail_a = (-mass_a + 1.0).clamp(0.0, 1.0);
        let tail_b = (-mass_b + 1.0).clamp(config.tail_mass_eps, 1.0);
        let tail_a_log = tail_a.clamp_min(f64::from(f32::MIN_POSITIVE));
        &tail_a * (tail_a_log.log() - tail_b.log())
    };
    let loss = match config.loss_mode {
        // The unnormalised top-k sum can fall below zero; verl clamps it.
        DistillLossMode::ForwardKlTopk => kl(&teacher, &student).clamp_min(0.0),
        DistillLossMode::ForwardKlTopkTail => {
            kl(&teacher, &student) + tail(&teacher_mass, &student_mass)
        }
        // Unnormalised, Σ q log(q/p) is smallest at q = p/e, not at q = p: both sides are
        // renormalised over the top-k (the KL of the distributions conditioned on the top-k).
        DistillLossMode::ReverseKlTopk => {
            let renormalised = |lp: &Tensor| lp - lp.logsumexp(-1, true);
            kl(&renormalised(&student), &renormalised(&teacher))
        }
        DistillLossMode::ReverseKlTopkTail => {
            kl(&student, &teacher) + tail(&student_mass, &teacher_mass)
        }
    };
    TopkKl {
        loss,
        student_mass,
        teacher_mass,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(loss_mode: DistillLossMode) -> TopkKlConfig {
        TopkKlConfig {
            loss_mode,
            log_prob_min_clamp: None,
            tail_mass_eps: 1e-6,
        }
    }

    /// With k = V the top-k KL is the full KL: hand values for two 3-token distributions.
    #[test]
    fn full_support_top_k_is_the_kl() {
        let p = [0.5f64, 0.3, 0.2];
        let q = [0.2f64, 0.2, 0.6];
        let lp = Tensor::from_slice(&p.map(f64::ln)).to_kind(Kind::Float);
        let lq = Tensor::from_slice(&q.map(f64::ln)).to_kind(Kind::Float);
        let kl = |a: &[f64; 3], b: &[f64; 3]| {
            a.iter().zip(b).map(|(x, y)| x * (x / y).ln()).sum::<f64>()
        };
        let forward = topk_kl(&lq, &lp, &config(DistillLossMode::ForwardKlTopk));
        assert!((forward.loss.double_value(&[]) - kl(&p, &q)).abs() < 1e-6);
        let reverse = topk_kl(&lq, &lp, &config(DistillLossMode::ReverseKlTopk));
        assert!((reverse.loss.double_value(&[]) - kl(&q, &p)).abs() < 1e-6);
        // The tail is empty (mass 1): the tail modes add nothing.
        let tail = topk_kl(&lq, &lp, &config(DistillLossMode::ForwardKlTopkTail));
        assert!((tail.loss.double_value(&[]) - kl(&p, &q)).abs() < 1e-5);
    }

    /// The top-k of two of three tokens plus the tail bucket is the KL of the coarse-grained
    /// distributions {a, b, rest}.
    #[test]
    fn tail_bucket_is_the_coarse_grained_kl() {
        let p = [0.5f64, 0.3, 0.2];
        let q = [0.2f64, 0.2, 0.6];
        let two = |x: &[f64; 3]| Tensor::from_slice(&[x[0].ln(), x[1].ln()]).to_kind(Kind::Float);
        let kl = |a: &[f64; 3], b: &[f64; 3]| {
            a.iter().zip(b).map(|(x, y)| x * (x / y).ln()).sum::<f64>()
        };
        let forward = topk_kl(
            &two(&q),
            &two(&p),
            &config(DistillLossMode::ForwardKlTopkTail),
        );
        assert!((forward.loss.double_value(&[]) - kl(&p, &q)).abs() < 1e-5);
        let reverse = topk_kl(
            &two(&q),
            &two(&p),
            &config(DistillLossMode::ReverseKlTopkTail),
        );
        assert!((reverse.loss.double_value(&[]) - kl(&q, &p)).abs() < 1e-5);
        assert!((forward.teacher_mass.double_value(&[]) - 0.8).abs() < 1e-6);
        assert!((forward.student_mass.double_value(&[]) - 0.4).abs() < 1e-6);
    }
}
