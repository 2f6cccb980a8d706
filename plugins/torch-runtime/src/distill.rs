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
//! token and the k teacher tokens are gathered in one gather ([`fused_scores`]): the policy loss
//! and the distillation loss share it, where computing them separately holds two `[N, V]`
//! log-softmax tensors for the backward pass.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};
use crate::logprobs::{ResponseScores, ScoreOutputs};
use crate::losses::{ClipConfig, KlPenalty};
use crate::model::{BlockContext, CausalLM, Layout};

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

/// The teacher's `k` most likely tokens at each position: ids `[.., k]` int64 and their
/// log-probs `[.., k]` fp32, most likely first.
#[derive(Debug)]
pub struct TopkLogProbs {
    pub ids: Tensor,
    pub log_probs: Tensor,
}

/// The top-`k` log-probs of `softmax(logits)` (`logits [.., V]`): top-k of the logits minus their
/// log-normaliser (log-softmax is monotone), so no `[.., V]` log-softmax is built.
pub fn topk_log_probs(logits: &Tensor, k: i64) -> Result<TopkLogProbs> {
    let vocab = logits.size().last().copied().unwrap_or(0);
    if k < 1 || k > vocab {
        return Err(ModelError::invalid_input(
            "topk",
            format!("must lie in [1, {vocab}] (the vocabulary), got {k}"),
        ));
    }
    let logits = logits.to_kind(Kind::Float);
    let (values, ids) = logits.topk(k, -1, true, true);
    Ok(TopkLogProbs {
        log_probs: values - logits.logsumexp(-1, true),
        ids,
    })
}

/// The student's scores from one log-softmax: log-probs of `labels [..]`, of `ids [.., k]`, and
/// the entropy and Σπ² when asked, all fp32 and differentiable.
#[derive(Debug)]
pub struct FusedScores {
    pub log_probs: Tensor,
    pub topk_log_probs: Tensor,
    pub entropy: Option<Tensor>,
    pub sum_pi_squared: Option<Tensor>,
}

/// One `log_softmax(logits [.., V])`, one gather of the `1 + k` columns (`labels [..]`, then
/// `ids [.., k]`), and from the same log-softmax the entropy `−Σ exp(ls)·ls` and Σπ² `Σ exp(2·ls)`
/// when asked.
pub fn fused_scores(
    logits: &Tensor,
    labels: &Tensor,
    ids: &Tensor,
    outputs: ScoreOutputs,
) -> FusedScores {
    let log_softmax = logits.log_softmax(-1, Kind::Float);
    let columns = Tensor::cat(&[labels.unsqueeze(-1), ids.shallow_clone()], -1);
    let gathered = log_softmax.gather(-1, &columns, false);
    let k = ids.size().last().copied().unwrap_or(0);
    FusedScores {
        log_probs: gathered.narrow(-1, 0, 1).squeeze_dim(-1),
        topk_log_probs: gathered.narrow(-1, 1, k),
        entropy: outputs
            .entropy
            .then(|| -(log_softmax.exp() * &log_softmax).sum_dim_intlist(-1, false, Kind::Float)),
        sum_pi_squared: outputs.sum_pi_squared.then(|| {
            (&log_softmax * 2.0)
                .exp()
                .sum_dim_intlist(-1, false, Kind::Float)
        }),
    }
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

/// Response scores with the student's log-probs of the teacher's top-k tokens, `[B, R, k]`
/// (zero on padding).
#[derive(Debug)]
pub struct DistillScores {
    pub scores: ResponseScores,
    pub topk_log_probs: Tensor,
}

impl CausalLM {
    /// The teacher's top-`k` log-probs at each response position of a block context's batch
    /// (padded or packed), at `temperature`: `[B, R, k]`, ids 0 and log-probs 0 on padding.
    pub fn response_topk_in(
        &self,
        hidden: &Tensor,
        context: &BlockContext,
        response_len: i64,
        temperature: f64,
        k: i64,
    ) -> Result<TopkLogProbs> {
        let (predictors, place) = self.response_predictors(hidden, context, response_len)?;
        let top = topk_log_probs(&self.tempered_logits(&predictors, temperature)?, k)?;
        let mask = place.mask().unsqueeze(-1);
        Ok(TopkLogProbs {
            ids: place.spread(&top.ids) * mask.to_kind(Kind::Int64),
            log_probs: place.spread(&top.log_probs) * mask,
        })
    }

    /// [`CausalLM::response_scores_in`] plus the log-probs of `ids` (`[B, R, k]`, the teacher's
    /// top-k tokens), all from one log-softmax ([`fused_scores`]).
    pub fn response_distill_scores_in(
        &self,
        hidden: &Tensor,
        context: &BlockContext,
        response_len: i64,
        temperature: f64,
        outputs: ScoreOutputs,
        ids: &Tensor,
    ) -> Result<DistillScores> {
        let (predictors, place) = self.response_predictors(hidden, context, response_len)?;
        let size = ids.size();
        let rows = context.batch_ids.size()[0];
        if size.len() != 3 || size[0] != rows || size[1] != response_len {
            return Err(ModelError::invalid_input(
                "teacher_ids",
                format!("must be [{rows}, {response_len}, k], got {size:?}"),
            ));
        }
        let labels = place.gather(&context.batch_ids.narrow(
            1,
            context.batch_ids.size()[1] - response_len,
            response_len,
        ));
        let ids = place.gather(&ids.to_device(self.device()));
        let logits = self.tempered_logits(&predictors, temperature)?;
        let fused = fused_scores(&logits, &labels, &ids, outputs);
        let mask = place.mask();
        let masked = |t: Tensor| place.spread(&t) * &mask;
        Ok(DistillScores {
            topk_log_probs: place.spread(&fused.topk_log_probs) * mask.unsqueeze(-1),
            scores: ResponseScores {
                log_probs: masked(fused.log_probs),
                entropy: fused.entropy.map(masked),
                sum_pi_squared: fused.sum_pi_squared.map(masked),
            },
        })
    }

    /// `logits / temperature`, fp32. Dividing by 1 is exact: skipped, saving a pass (and its
    /// backward) over the largest activation.
    pub(crate) fn tempered_logits(&self, hidden: &Tensor, temperature: f64) -> Result<Tensor> {
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(ModelError::invalid_input(
                "temperature",
                format!("must be positive, got {temperature}"),
            ));
        }
        let logits = self.logits(hidden)?;
        Ok(if temperature == 1.0 {
            logits
        } else {
            logits / temperature
        })
    }

    /// The hidden states of the response tokens' predictors and where their outputs go.
    fn response_predictors<'a>(
        &self,
        hidden: &Tensor,
        context: &'a BlockContext,
        response_len: i64,
    ) -> Result<(Tensor, Placement<'a>)> {
        let predictors = crate::logprobs::predictors_in(hidden, context, response_len)?;
        let place = match &context.layout {
            Layout::Padded(mask) => {
                let seq = mask.size()[1];
                Placement::Padded(
                    mask.to_device(self.device())
                        .narrow(1, seq - response_len, response_len)
                        .to_kind(Kind::Float),
                )
            }
            Layout::Packed(packing) => Placement::Packed(packing),
        };
        Ok((predictors, place))
    }
}

/// Where per-predictor outputs belong in the `[B, R, ..]` response layout.
enum Placement<'a> {
    /// Predictors are already `[B, R]`; the response mask.
    Padded(Tensor),
    /// Predictors are the packing's `[n]` scored tokens.
    Packed(&'a crate::model::Packing),
}

impl Placement<'_> {
    /// Per-predictor values `[.., ..]` in the `[B, R, ..]` layout (zero where nothing is scored).
    fn spread(&self, values: &Tensor) -> Tensor {
        match self {
            Self::Padded(_) => values.shallow_clone(),
            Self::Packed(packing) => packing.unpack_response(values),
        }
    }

    /// A `[B, R, ..]` tensor in the predictors' layout.
    fn gather(&self, values: &Tensor) -> Tensor {
        match self {
            Self::Padded(_) => values.shallow_clone(),
            Self::Packed(packing) => {
                let size = values.size();
                let mut flat = vec![size[0] * size[1]];
                flat.extend_from_slice(&size[2..]);
                values
                    .to_device(packing.targets().device())
                    .reshape(flat.as_slice())
                    .index_select(0, packing.targets())
            }
        }
    }

    /// 1 where a response token is scored, `[B, R]` fp32.
    fn mask(&self) -> Tensor {
        match self {
            Self::Padded(mask) => mask.shallow_clone(),
            Self::Packed(packing) => {
                let n = packing.targets().size()[0];
                packing.unpack_response(&Tensor::ones(
                    [n],
                    (Kind::Float, packing.targets().device()),
                ))
            }
        }
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

    #[test]
    fn teacher_top_k_are_the_largest_log_probs() {
        let logits = Tensor::from_slice(&[0.0f32, 2.0, 1.0, -1.0]).view([1, 4]);
        let top = topk_log_probs(&logits, 2).unwrap();
        assert_eq!(Vec::<i64>::try_from(top.ids.view([-1])).unwrap(), [1, 2]);
        let full = logits.log_softmax(-1, Kind::Float);
        let expect = full.index_select(1, &Tensor::from_slice(&[1i64, 2]));
        assert!(bool::try_from((top.log_probs - expect).abs().max().lt(1e-6)).unwrap());
        assert!(topk_log_probs(&logits, 5).is_err());
    }
}
