//! verl's loss kernels (`verl/trainer/ppo/core_algos.py`): loss aggregation, the vanilla PPO and
//! GSPO policy losses, KL penalties, the clipped value loss and the entropy loss. Inputs are
//! `[batch, response_len]` tensors with a response mask (1 = token, 0 = padding).

use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};
use crate::logprobs::entropy_from_logits;

/// `values * mask`, with values outside the mask ignored even if NaN (as verl's `masked_sum`).
fn weighted(values: &Tensor, mask: &Tensor) -> Tensor {
    let mask = mask.to_kind(Kind::Float);
    values.zeros_like().where_self(&mask.eq(0.0), values) * mask
}

/// Sum of `values` where `mask` is set.
pub fn masked_sum(values: &Tensor, mask: &Tensor) -> Tensor {
    weighted(values, mask).sum(Kind::Float)
}

/// Mean of `values` where `mask` is set (verl: `masked_sum / (mask.sum() + 1e-8)`).
pub fn masked_mean(values: &Tensor, mask: &Tensor) -> Tensor {
    masked_sum(values, mask) / (mask.to_kind(Kind::Float).sum(Kind::Float) + 1e-8)
}

fn scalar(t: &Tensor) -> f64 {
    t.double_value(&[])
}

/// How a `[batch, response_len]` loss matrix becomes a scalar (`loss_agg_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossAggMode {
    /// Mean over all response tokens of the batch.
    #[default]
    TokenMean,
    /// Sum over each sequence's tokens, mean over sequences.
    SeqMeanTokenSum,
    /// Mean over each sequence's tokens, mean over sequences.
    SeqMeanTokenMean,
    /// Sum over all tokens divided by a constant (default: the response length), as Dr. GRPO.
    SeqMeanTokenSumNorm,
}

impl LossAggMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TokenMean => "token-mean",
            Self::SeqMeanTokenSum => "seq-mean-token-sum",
            Self::SeqMeanTokenMean => "seq-mean-token-mean",
            Self::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
        }
    }
}

impl FromStr for LossAggMode {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        [
            Self::TokenMean,
            Self::SeqMeanTokenSum,
            Self::SeqMeanTokenMean,
            Self::SeqMeanTokenSumNorm,
        ]
        .into_iter()
        .find(|m| m.as_str() == s)
        .ok_or_else(|| ModelError::invalid_input("loss_agg_mode", format!("unknown mode {s:?}")))
    }
}

/// Normalisers for a micro-batch that is one part of a larger (data-parallel, accumulated) batch,
/// as verl's `global_batch_info`. The default normalises by the micro-batch itself.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AggScale {
    /// Data-parallel world size: gradients are averaged over ranks afterwards.
    pub dp_size: f64,
    /// Response tokens in the global batch (token-mean).
    pub batch_num_tokens: Option<f64>,
    /// Sequences in the global batch (seq-mean modes).
    pub global_batch_size: Option<f64>,
    /// Divisor of seq-mean-token-sum-norm; default the response length.
    pub loss_scale_factor: Option<f64>,
}

impl Default for AggScale {
    fn default() -> Self {
        Self {
            dp_size: 1.0,
            batch_num_tokens: None,
            global_batch_size: None,
            loss_scale_factor: None,
        }
    }
}

/// Aggregates a loss matrix as verl's `agg_loss`. One deliberate difference: a micro-batch with no
/// response token gives 0 instead of verl's NaN (0/0), which would poison the accumulated gradient.
pub fn agg_loss(
    loss_mat: &Tensor,
    loss_mask: &Tensor,
    mode: LossAggMode,
    scale: &AggScale,
) -> Tensor {
    let mask = loss_mask.to_kind(Kind::Float);
    let count = |local: Tensor, global: Option<f64>| match global {
        Some(n) => Tensor::from(n).to_device(local.device()),
        None => local.clamp_min(1.0),
    };
    let seq_sums = || weighted(loss_mat, &mask).sum_dim_intlist(-1, false, Kind::Float);
    let loss = match mode {
        LossAggMode::TokenMean => {
            masked_sum(loss_mat, &mask) / count(mask.sum(Kind::Float), scale.batch_num_tokens)
        }
        LossAggMode::SeqMeanTokenSum | LossAggMode::SeqMeanTokenMean => {
            let tokens = mask.sum_dim_intlist(-1, false, Kind::Float);
            let seq_losses = match mode {
                LossAggMode::SeqMeanTokenSum => seq_sums(),
                _ => seq_sums() / (&tokens + 1e-8),
            };
            // Fully masked sequences do not count.
            let seq_mask = tokens.gt(0.0).to_kind(Kind::Float);
            masked_sum(&seq_losses, &seq_mask)
                / count(seq_mask.sum(Kind::Float), scale.global_batch_size)
        }
        LossAggMode::SeqMeanTokenSumNorm => {
            let factor = scale
                .loss_scale_factor
                .unwrap_or(*loss_mask.size().last().unwrap_or(&1) as f64);
            seq_sums().sum(Kind::Float) / factor
        }
    };
    loss * scale.dp_size
}

/// PPO clip ranges. verl's defaults: `clip_ratio = 0.2` for both sides, `clip_ratio_c = 3`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ClipConfig {
    /// The ratio is clipped below at `1 - clip_ratio_low`.
    pub clip_ratio_low: f64,
    /// The ratio is clipped above at `1 + clip_ratio_high` (DAPO's clip-higher when larger).
    pub clip_ratio_high: f64,
    /// Dual-clip bound for negative advantages: the loss is at most `-A * clip_ratio_c`.
    pub clip_ratio_c: f64,
}

impl Default for ClipConfig {
    fn default() -> Self {
        Self {
            clip_ratio_low: 0.2,
            clip_ratio_high: 0.2,
            clip_ratio_c: 3.0,
        }
    }
}

/// A policy loss and verl's metrics for it (`actor/pg_clipfrac`, `actor/ppo_kl`,
/// `actor/pg_clipfrac_lower`).
#[derive(Debug)]
pub struct PolicyLoss {
    pub pg_loss: Tensor,
    pub pg_clipfrac: f64,
    pub ppo_kl: f64,
    pub pg_clipfrac_lower: f64,
}

/// verl's `policy_loss.loss_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyLossMode {
    #[default]
    Vanilla,
    Gspo,
}

impl FromStr for PolicyLossMode {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "vanilla" => Ok(Self::Vanilla),
            "gspo" => Ok(Self::Gspo),
            _ => Err(ModelError::invalid_input(
                "loss_mode",
                format!("unknown policy loss {s:?} (vanilla, gspo)"),
            )),
        }
    }
}

/// Inputs of a policy loss, each `[batch, response_len]`.
#[derive(Debug, Clone, Copy)]
pub struct PolicyBatch<'a> {
    pub old_log_prob: &'a Tensor,
    pub log_prob: &'a Tensor,
    pub advantages: &'a Tensor,
    pub response_mask: &'a Tensor,
}

/// Computes the policy loss of `mode`. GSPO always aggregates with seq-mean-token-mean, as verl.
pub fn policy_loss(
    mode: PolicyLossMode,
    batch: PolicyBatch<'_>,
    clip: &ClipConfig,
    agg: LossAggMode,
    scale: &AggScale,
) -> Result<PolicyLoss> {
    match mode {
        PolicyLossMode::Vanilla => policy_loss_vanilla(batch, clip, agg, scale),
        PolicyLossMode::Gspo => Ok(policy_loss_gspo(batch, clip, scale)),
    }
}

/// PPO's clipped surrogate with separate low/high clip ranges and dual clip for `A < 0`.
pub fn policy_loss_vanilla(
    batch: PolicyBatch<'_>,
    clip: &ClipConfig,
    agg: LossAggMode,
    scale: &AggScale,
) -> Result<PolicyLoss> {
    if clip.clip_ratio_c <= 1.0 {
        return Err(ModelError::invalid_input(
            "clip_ratio_c",
            format!(
                "the dual-clip bound must be greater than 1, got {}",
                clip.clip_ratio_c
            ),
        ));
    }
    let PolicyBatch {
        old_log_prob,
        log_prob,
        advantages,
        response_mask: mask,
    } = batch;
    // Clamped for stability, as verl.
    let negative_approx_kl = (log_prob - old_log_prob).clamp(-20.0, 20.0);
    let ratio = negative_approx_kl.exp();
    let ppo_kl = masked_mean(&negative_approx_kl.neg(), mask);

    let losses1 = -advantages * &ratio;
    let losses2 = -advantages * ratio.clamp(1.0 - clip.clip_ratio_low, 1.0 + clip.clip_ratio_high);
    let clipped = losses1.maximum(&losses2);
    let pg_clipfrac = masked_mean(&losses2.gt_tensor(&losses1).to_kind(Kind::Float), mask);

    let losses3 = -advantages * clip.clip_ratio_c;
    let dual_clipped = losses3.minimum(&clipped);
    let negative = advantages.lt(0.0);
    let pg_clipfrac_lower = masked_mean(
        &clipped
            .gt_tensor(&losses3)
            .logical_and(&negative)
            .to_kind(Kind::Float),
        mask,
    );

    let pg_losses = dual_clipped.where_self(&negative, &clipped);
    Ok(PolicyLoss {
        pg_loss: agg_loss(&pg_losses, mask, agg, scale),
        pg_clipfrac: scalar(&pg_clipfrac),
        ppo_kl: scalar(&ppo_kl),
        pg_clipfrac_lower: scalar(&pg_clipfrac_lower),
    })
}

/// GSPO: one importance ratio per sequence, `exp(mean_t log r_t)`, with each token's gradient
/// flowing through its own log-prob (`sg[s_i] · π/sg[π]`).
pub fn policy_loss_gspo(batch: PolicyBatch<'_>, clip: &ClipConfig, scale: &AggScale) -> PolicyLoss {
    let PolicyBatch {
        old_log_prob,
        log_prob,
        advantages,
        response_mask: mask,
    } = batch;
    let maskf = mask.to_kind(Kind::Float);
    let negative_approx_kl = log_prob - old_log_prob;
    let lengths = maskf.sum_dim_intlist(-1, false, Kind::Float).clamp_min(1.0);
    let seq_log_ratio =
        (&negative_approx_kl * &maskf).sum_dim_intlist(-1, false, Kind::Float) / lengths;
    let log_ratio =
        (log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp_max(10.0);
    let ratio = log_ratio.exp();

    let losses1 = -advantages * &ratio;
    let losses2 = -advantages * ratio.clamp(1.0 - clip.clip_ratio_low, 1.0 + clip.clip_ratio_high);
    let pg_losses = losses1.maximum(&losses2);
    PolicyLoss {
        pg_loss: agg_loss(&pg_losses, mask, LossAggMode::SeqMeanTokenMean, scale),
        pg_clipfrac: scalar(&masked_mean(
            &losses2.gt_tensor(&losses1).to_kind(Kind::Float),
            mask,
        )),
        ppo_kl: scalar(&masked_mean(&negative_approx_kl.neg(), mask)),
        pg_clipfrac_lower: 0.0,
    }
}

/// KL estimators between the policy and the reference, per token (Schulman, "Approximating KL
/// divergence", 2020).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KlEstimator {
    /// `kl`/`k1`: `logp − ref`.
    K1,
    /// `abs`: `|logp − ref|`.
    Abs,
    /// `mse`/`k2`: `½ (logp − ref)²`.
    K2,
    /// `low_var_kl`/`k3`: `e^(ref−logp) − (ref−logp) − 1`, clamped to ±10.
    K3,
}

/// A KL penalty as verl names it; a trailing `+` (e.g. `k3+`) keeps the estimator's value but takes
/// k2's gradient (straight-through), which is the unbiased KL gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KlPenalty {
    pub estimator: KlEstimator,
    pub straight_through: bool,
}

impl FromStr for KlPenalty {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        let (name, straight_through) = match s.strip_suffix('+') {
            Some(name) => (name, true),
            None => (s, false),
        };
        let estimator = match name {
            "kl" | "k1" => KlEstimator::K1,
            "abs" => KlEstimator::Abs,
            "mse" | "k2" if !straight_through => KlEstimator::K2,
            "low_var_kl" | "k3" => KlEstimator::K3,
            _ => {
                return Err(ModelError::invalid_input(
                    "kl_penalty",
                    format!(
                        "unknown KL penalty {s:?} (kl, k1, abs, mse, k2, low_var_kl, k3, or k1/abs/k3 with +)"
                    ),
                ));
            }
        };
        Ok(Self {
            estimator,
            straight_through,
        })
    }
}

/// Per-token KL penalty of `log_prob` against `ref_log_prob`.
pub fn kl_penalty(log_prob: &Tensor, ref_log_prob: &Tensor, penalty: KlPenalty) -> Tensor {
    let diff = log_prob - ref_log_prob;
    let value = match penalty.estimator {
        KlEstimator::K1 => diff.shallow_clone(),
        KlEstimator::Abs => diff.abs(),
        KlEstimator::K2 => diff.square() * 0.5,
        KlEstimator::K3 => {
            let kl = diff.neg().clamp(-20.0, 20.0);
            (kl.exp() - &kl - 1.0).clamp(-10.0, 10.0)
        }
    };
    if penalty.straight_through {
        let k2 = diff.square() * 0.5;
        &k2 - k2.detach() + value.detach()
    } else {
        value
    }
}

/// Clipped value loss and the fraction of tokens where clipping won (`critic/vf_clipfrac`):
/// `½ agg(max((v − R)², (clip(v, v_old ± c) − R)²))`.
pub fn value_loss(
    vpreds: &Tensor,
    returns: &Tensor,
    values: &Tensor,
    response_mask: &Tensor,
    cliprange_value: f64,
    agg: LossAggMode,
    scale: &AggScale,
) -> (Tensor, f64) {
    let clipped = vpreds
        .minimum(&(values + cliprange_value))
        .maximum(&(values - cliprange_value));
    let losses1 = (vpreds - returns).square();
    let losses2 = (clipped - returns).square();
    let loss = agg_loss(&losses1.maximum(&losses2), response_mask, agg, scale) * 0.5;
    let clipfrac = masked_mean(
        &losses2.gt_tensor(&losses1).to_kind(Kind::Float),
        response_mask,
    );
    (loss, scalar(&clipfrac))
}

/// Aggregated entropy of `logits [batch, response_len, vocab]` (the entropy bonus is
/// `-entropy_coeff` times this).
pub fn entropy_loss(
    logits: &Tensor,
    response_mask: &Tensor,
    agg: LossAggMode,
    scale: &AggScale,
) -> Tensor {
    agg_loss(&entropy_from_logits(logits), response_mask, agg, scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(rows: &[&[f64]]) -> Tensor {
        let flat: Vec<f32> = rows
            .iter()
            .flat_map(|r| r.iter().map(|&x| x as f32))
            .collect();
        Tensor::from_slice(&flat).view([rows.len() as i64, rows[0].len() as i64])
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-6, "{a} != {b}");
    }

    #[test]
    fn agg_loss_every_mode() {
        // Row 3 is fully masked (and holds NaN): it must not count anywhere.
        let loss = t(&[&[1., 2., 3.], &[4., 5., 6.], &[f64::NAN, 8., 9.]]);
        let mask = t(&[&[1., 1., 0.], &[1., 0., 0.], &[0., 0., 0.]]);
        let agg = |mode| scalar(&agg_loss(&loss, &mask, mode, &AggScale::default()));
        // token-mean: (1 + 2 + 4) / 3 tokens
        close(agg(LossAggMode::TokenMean), 7.0 / 3.0);
        // seq-mean-token-sum: sequence sums [3, 4], two non-empty sequences → 3.5
        close(agg(LossAggMode::SeqMeanTokenSum), 3.5);
        // seq-mean-token-mean: [3/2, 4/1] → (1.5 + 4) / 2
        close(agg(LossAggMode::SeqMeanTokenMean), 2.75);
        // seq-mean-token-sum-norm: (3 + 4) / response_len 3
        close(agg(LossAggMode::SeqMeanTokenSumNorm), 7.0 / 3.0);
        // Global normalisers replace the local counts; dp_size multiplies.
        let scale = AggScale {
            dp_size: 2.0,
            batch_num_tokens: Some(14.0),
            global_batch_size: Some(7.0),
            loss_scale_factor: Some(2.0),
        };
        close(
            scalar(&agg_loss(&loss, &mask, LossAggMode::TokenMean, &scale)),
            7.0 / 14.0 * 2.0,
        );
        close(
            scalar(&agg_loss(
                &loss,
                &mask,
                LossAggMode::SeqMeanTokenSum,
                &scale,
            )),
            7.0 / 7.0 * 2.0,
        );
        close(
            scalar(&agg_loss(
                &loss,
                &mask,
                LossAggMode::SeqMeanTokenSumNorm,
                &scale,
            )),
            7.0 / 2.0 * 2.0,
        );
        // No token at all: 0, not NaN.
        close(
            scalar(&agg_loss(
                &loss,
                &mask.zeros_like(),
                LossAggMode::TokenMean,
                &AggScale::default(),
            )),
            0.0,
        );
        assert_eq!(
            "seq-mean-token-sum-norm".parse::<LossAggMode>().unwrap(),
            LossAggMode::SeqMeanTokenSumNorm
        );
        assert!("token-sum".parse::<LossAggMode>().is_err());
    }

    #[test]
    fn vanilla_ppo_with_clip_higher_and_dual_clip() {
        // old log-prob 0, new log-prob ln r; clip 1 - 0.2 .. 1 + 0.28, dual clip c = 3.
        let ratios = [1.5, 0.5, 1.5, 0.5, 4.0, 10.0];
        let advantages = t(&[&[1., 1., -1., -1., -1., 5.]]);
        let log_prob = t(&[&ratios.map(f64::ln)]);
        let old = log_prob.zeros_like();
        let mask = t(&[&[1., 1., 1., 1., 1., 0.]]);
        let clip = ClipConfig {
            clip_ratio_low: 0.2,
            clip_ratio_high: 0.28,
            clip_ratio_c: 3.0,
        };
        let batch = PolicyBatch {
            old_log_prob: &old,
            log_prob: &log_prob,
            advantages: &advantages,
            response_mask: &mask,
        };
        let out = policy_loss_vanilla(batch, &clip, LossAggMode::TokenMean, &AggScale::default())
            .unwrap();
        // Per token, l1 = -A r, l2 = -A clip(r, 0.8, 1.28):
        //  A=+1 r=1.5: max(-1.5, -1.28) = -1.28 (clipped)
        //  A=+1 r=0.5: max(-0.5, -0.8)  = -0.5
        //  A=-1 r=1.5: max(1.5, 1.28)   = 1.5, below the dual bound 3
        //  A=-1 r=0.5: max(0.5, 0.8)    = 0.8 (clipped)
        //  A=-1 r=4:   max(4, 1.28)     = 4 → dual-clipped to 3
        //  the sixth token is masked out.
        close(scalar(&out.pg_loss), (-1.28 - 0.5 + 1.5 + 0.8 + 3.0) / 5.0);
        close(out.pg_clipfrac, 2.0 / 5.0);
        close(out.pg_clipfrac_lower, 1.0 / 5.0);
        // ppo_kl = mean(-ln r) = -(2 ln 1.5 + 2 ln 0.5 + ln 4) / 5 = -2 ln 1.5 / 5
        close(out.ppo_kl, -2.0 * 1.5f64.ln() / 5.0);
        let bad = ClipConfig {
            clip_ratio_c: 1.0,
            ..clip
        };
        assert!(
            policy_loss_vanilla(batch, &bad, LossAggMode::TokenMean, &AggScale::default()).is_err()
        );
    }

    #[test]
    fn gspo_uses_a_sequence_ratio() {
        // Sequence 1: log r = [ln 2, 0] → s = exp(ln 2 / 2) = √2 ≈ 1.414, A = +1: both tokens
        //   max(-√2, -1.28) = -1.28.
        // Sequence 2: log r = [ln 0.25, (padding)] → s = 0.25, A = -1: max(0.25, 0.8) = 0.8.
        // seq-mean-token-mean: (-1.28 + 0.8) / 2 = -0.24; every token clipped.
        let log_prob = t(&[&[2f64.ln(), 0.0], &[0.25f64.ln(), 7.0]]).set_requires_grad(true);
        let old = t(&[&[0., 0.], &[0., -3.]]);
        let advantages = t(&[&[1., 1.], &[-1., -1.]]);
        let mask = t(&[&[1., 1.], &[1., 0.]]);
        let batch = PolicyBatch {
            old_log_prob: &old,
            log_prob: &log_prob,
            advantages: &advantages,
            response_mask: &mask,
        };
        let clip = ClipConfig {
            clip_ratio_low: 0.2,
            clip_ratio_high: 0.28,
            clip_ratio_c: 3.0,
        };
        let out = policy_loss(
            PolicyLossMode::Gspo,
            batch,
            &clip,
            LossAggMode::TokenMean,
            &AggScale::default(),
        )
        .unwrap();
        close(scalar(&out.pg_loss), -0.24);
        close(out.pg_clipfrac, 1.0);
        // ppo_kl = -(ln 2 + 0 + ln 0.25) / 3 = ln 2 / 3
        close(out.ppo_kl, 2f64.ln() / 3.0);
        close(out.pg_clipfrac_lower, 0.0);
        // Every token is clipped, so no gradient reaches the log-probs.
        out.pg_loss.backward();
        close(scalar(&log_prob.grad().abs().sum(Kind::Float)), 0.0);
    }

    #[test]
    fn kl_estimators() {
        // logp = ln 0.5, ref = 0: Δ = logp − ref = −ln 2.
        let logp = Tensor::from_slice(&[0.5f32.ln(), -30.0]).set_requires_grad(true);
        let reference = Tensor::from_slice(&[0.0f32, 0.0]);
        let kl = |name: &str| kl_penalty(&logp, &reference, name.parse().unwrap());
        let ln2 = 2f64.ln();
        close(kl("kl").double_value(&[0]), -ln2);
        close(kl("abs").double_value(&[0]), ln2);
        close(kl("mse").double_value(&[0]), 0.5 * ln2 * ln2);
        // k3: ref − logp = ln 2 → e^{ln 2} − ln 2 − 1 = 1 − ln 2
        close(kl("low_var_kl").double_value(&[0]), 1.0 - ln2);
        // ref − logp = 30 → clamped to 20 → e^20 − 21 → clamped to 10
        close(kl("k3").double_value(&[1]), 10.0);
        // k3+: k3's value, k2's gradient d/dlogp ½Δ² = Δ = −ln 2.
        let st = kl("k3+");
        close(st.double_value(&[0]), 1.0 - ln2);
        st.sum(Kind::Float).backward();
        close(logp.grad().double_value(&[0]), -ln2);
        assert!("k2+".parse::<KlPenalty>().is_err() && "full".parse::<KlPenalty>().is_err());
    }

    #[test]
    fn clipped_value_loss_and_entropy_loss() {
        // Token 1: clip(1.5, 1.0 ± 0.2) = 1.2; (1.5 − 2)² = 0.25 < (1.2 − 2)² = 0.64 → 0.64, clipped.
        // Token 2: clip(0, 0 ± 0.2) = 0; both (0 − 1)² = 1 → 1.
        // Token 3 is masked. Loss = ½ (0.64 + 1) / 2 = 0.41; clipfrac 1/2.
        let vpreds = t(&[&[1.5, 0.0, 9.0]]);
        let values = t(&[&[1.0, 0.0, 0.0]]);
        let returns = t(&[&[2.0, 1.0, 0.0]]);
        let mask = t(&[&[1., 1., 0.]]);
        let (loss, clipfrac) = value_loss(
            &vpreds,
            &returns,
            &values,
            &mask,
            0.2,
            LossAggMode::TokenMean,
            &AggScale::default(),
        );
        close(scalar(&loss), 0.41);
        close(clipfrac, 0.5);
        // Uniform logits over 4 tokens: entropy ln 4 per token.
        let logits = Tensor::zeros([1, 3, 4], (Kind::Float, tch::Device::Cpu));
        close(
            scalar(&entropy_loss(
                &logits,
                &mask,
                LossAggMode::TokenMean,
                &AggScale::default(),
            )),
            4f64.ln(),
        );
    }
}
