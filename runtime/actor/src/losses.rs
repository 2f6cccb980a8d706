//! verl's loss kernels (`verl/trainer/ppo/core_algos.py`): loss aggregation, every policy loss of
//! verl's registry (vanilla PPO, DPPO, GSPO, SAPO, GPG, Clip-Cov, KL-Cov, GMPO, DRO, CISPO), KL
//! penalties, the clipped value loss and the entropy loss. Inputs are `[batch, response_len]`
//! tensors with a response mask (1 = token, 0 = padding).

use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use verl_model::{ModelError, Result, entropy_from_logits};

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
    /// Sum over all response tokens of the batch.
    TokenSum,
    /// Sum over each sequence's tokens, mean over sequences.
    SeqMeanTokenSum,
    /// Mean over each sequence's tokens, mean over sequences.
    SeqMeanTokenMean,
    /// As `seq-mean-token-sum`, then divided by a constant (default: the response length), as
    /// Dr. GRPO. verl averages over sequences since its change #5417; its GRPO doc page still
    /// shows the older formula, a plain token sum over the constant.
    SeqMeanTokenSumNorm,
}

impl LossAggMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TokenMean => "token-mean",
            Self::TokenSum => "token-sum",
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
            Self::TokenSum,
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
        LossAggMode::TokenSum => masked_sum(loss_mat, &mask),
        LossAggMode::SeqMeanTokenSum
        | LossAggMode::SeqMeanTokenMean
        | LossAggMode::SeqMeanTokenSumNorm => {
            let tokens = mask.sum_dim_intlist(-1, false, Kind::Float);
            let seq_losses = match mode {
                LossAggMode::SeqMeanTokenMean => seq_sums() / (&tokens + 1e-8),
                _ => seq_sums(),
            };
            // Fully masked sequences do not count.
            let seq_mask = tokens.gt(0.0).to_kind(Kind::Float);
            let seq_mean = masked_sum(&seq_losses, &seq_mask)
                / count(seq_mask.sum(Kind::Float), scale.global_batch_size);
            if mode == LossAggMode::SeqMeanTokenSumNorm {
                let factor = scale
                    .loss_scale_factor
                    .unwrap_or(*loss_mask.size().last().unwrap_or(&1) as f64);
                seq_mean / factor
            } else {
                seq_mean
            }
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

/// A policy loss and the metrics verl reports for it (`actor/pg_clipfrac`, `actor/ppo_kl`,
/// `actor/pg_clipfrac_lower`; each loss reports the ones verl's does).
#[derive(Debug)]
pub struct PolicyLoss {
    pub pg_loss: Tensor,
    pub metrics: Vec<(&'static str, f64)>,
}

impl PolicyLoss {
    pub fn metric(&self, key: &str) -> Option<f64> {
        self.metrics
            .iter()
            .find(|(k, _)| *k == key)
            .map(|&(_, v)| v)
    }
}

const PG_CLIPFRAC: &str = "actor/pg_clipfrac";
const PPO_KL: &str = "actor/ppo_kl";
const PG_CLIPFRAC_LOWER: &str = "actor/pg_clipfrac_lower";

/// verl's `policy_loss.loss_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyLossMode {
    /// PPO's clipped surrogate with dual clip.
    #[default]
    Vanilla,
    /// DPPO-Binary-TV: the update of a token stops once its probability moved more than the clip
    /// range (total variation of the binary distribution); truncated IS otherwise.
    DppoTv,
    /// DPPO-Binary-KL: as `dppo_tv` with the binary KL as the divergence.
    DppoKl,
    /// One importance ratio per sequence (geometric mean of the token ratios).
    Gspo,
    /// Soft, temperature-controlled sigmoid gates instead of hard clipping.
    Sapo,
    /// Plain policy gradient `−A·log π`.
    Gpg,
    /// PPO with the gradient of a few high-covariance tokens removed.
    ClipCov,
    /// Policy gradient with a KL penalty on the highest-covariance tokens.
    KlCov,
    /// GMPO: the geometric mean of clipped token ratios, one term per sequence.
    GeoMean,
    /// Direct Reward Optimization: `−(A·log π − β/2·(log π − log π_old)²)`.
    Dro,
    /// The clipped, stop-gradient ratio weights `A·log π`.
    Cispo,
}

impl PolicyLossMode {
    const ALL: [Self; 11] = [
        Self::Vanilla,
        Self::DppoTv,
        Self::DppoKl,
        Self::Gspo,
        Self::Sapo,
        Self::Gpg,
        Self::ClipCov,
        Self::KlCov,
        Self::GeoMean,
        Self::Dro,
        Self::Cispo,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Vanilla => "vanilla",
            Self::DppoTv => "dppo_tv",
            Self::DppoKl => "dppo_kl",
            Self::Gspo => "gspo",
            Self::Sapo => "sapo",
            Self::Gpg => "gpg",
            Self::ClipCov => "clip_cov",
            Self::KlCov => "kl_cov",
            Self::GeoMean => "geo_mean",
            Self::Dro => "dro",
            Self::Cispo => "cispo",
        }
    }
}

impl FromStr for PolicyLossMode {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|m| m.as_str()).collect();
                ModelError::invalid_input(
                    "loss_mode",
                    format!("unknown policy loss {s:?} ({})", names.join(", ")),
                )
            })
    }
}

/// The knobs of the policy losses beyond the clip ranges, by verl's names and with its defaults
/// (`actor.tau_pos`/`tau_neg`, the rest under `actor.policy_loss`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PolicyLossOptions {
    /// SAPO's gate temperature for positive advantages.
    pub tau_pos: f64,
    /// SAPO's gate temperature for the others.
    pub tau_neg: f64,
    /// Clip-Cov: the share of tokens whose gradient is removed.
    pub clip_cov_ratio: f64,
    /// Clip-Cov: only tokens with covariance in (lb, ub) are candidates.
    pub clip_cov_lb: f64,
    pub clip_cov_ub: f64,
    /// KL-Cov: the share of tokens that get the KL penalty.
    pub kl_cov_ratio: f64,
    /// KL-Cov: the penalty's coefficient.
    pub ppo_kl_coef: f64,
    /// DRO's β; required (positive) for `dro`.
    pub dro_beta: Option<f64>,
}

impl Default for PolicyLossOptions {
    fn default() -> Self {
        Self {
            tau_pos: 1.0,
            tau_neg: 1.05,
            clip_cov_ratio: 0.0002,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 0.0002,
            ppo_kl_coef: 0.1,
            dro_beta: None,
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
    /// verl's `rollout_is_weights` (rollout correction): truncated importance weights that
    /// multiply the per-token loss; `None` without rollout correction.
    pub rollout_is_weights: Option<&'a Tensor>,
}

/// The per-token loss times the rollout-correction IS weights, when there are any (as every
/// `compute_policy_loss_*` of verl does before aggregating).
fn rollout_weighted(pg_losses: Tensor, batch: &PolicyBatch<'_>) -> Tensor {
    match batch.rollout_is_weights {
        Some(weights) => pg_losses * weights,
        None => pg_losses,
    }
}

/// Computes the policy loss of `mode`. GSPO and SAPO always aggregate with seq-mean-token-mean
/// and GMPO averages its per-sequence terms, as verl's do; the others use `agg`.
pub fn policy_loss(
    mode: PolicyLossMode,
    batch: PolicyBatch<'_>,
    clip: &ClipConfig,
    options: &PolicyLossOptions,
    agg: LossAggMode,
    scale: &AggScale,
) -> Result<PolicyLoss> {
    match mode {
        PolicyLossMode::Vanilla => policy_loss_vanilla(batch, clip, agg, scale),
        PolicyLossMode::DppoTv | PolicyLossMode::DppoKl => {
            Ok(policy_loss_dppo(mode, batch, clip, agg, scale))
        }
        PolicyLossMode::Gspo => Ok(policy_loss_gspo(batch, clip, scale)),
        PolicyLossMode::Sapo => Ok(policy_loss_sapo(batch, options, scale)),
        PolicyLossMode::Gpg => {
            let pg_losses = rollout_weighted(-batch.log_prob * batch.advantages, &batch);
            Ok(PolicyLoss {
                pg_loss: agg_loss(&pg_losses, batch.response_mask, agg, scale),
                metrics: Vec::new(),
            })
        }
        PolicyLossMode::ClipCov => policy_loss_clip_cov(batch, clip, options, agg, scale),
        PolicyLossMode::KlCov => policy_loss_kl_cov(batch, options, agg, scale),
        PolicyLossMode::GeoMean => Ok(policy_loss_geo_mean(batch, clip, scale)),
        PolicyLossMode::Dro => policy_loss_dro(batch, options, agg, scale),
        PolicyLossMode::Cispo => Ok(policy_loss_cispo(batch, clip, agg, scale)),
    }
}

/// `log π − log π_old`, clamped to ±20 where verl clamps it for a stable `exp`.
fn log_ratio(batch: &PolicyBatch<'_>, clamped: bool) -> Tensor {
    let diff = batch.log_prob - batch.old_log_prob;
    if clamped {
        diff.clamp(-20.0, 20.0)
    } else {
        diff
    }
}

fn float(t: &Tensor) -> Tensor {
    t.to_kind(Kind::Float)
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
        advantages,
        response_mask: mask,
        ..
    } = batch;
    let negative_approx_kl = log_ratio(&batch, true);
    let ratio = negative_approx_kl.exp();
    let ppo_kl = masked_mean(&negative_approx_kl.neg(), mask);

    let losses1 = -advantages * &ratio;
    let losses2 = -advantages * ratio.clamp(1.0 - clip.clip_ratio_low, 1.0 + clip.clip_ratio_high);
    let clipped = losses1.maximum(&losses2);
    let pg_clipfrac = masked_mean(&float(&losses2.gt_tensor(&losses1)), mask);

    let losses3 = -advantages * clip.clip_ratio_c;
    let dual_clipped = losses3.minimum(&clipped);
    let negative = advantages.lt(0.0);
    let pg_clipfrac_lower = masked_mean(
        &float(&clipped.gt_tensor(&losses3).logical_and(&negative)),
        mask,
    );

    let pg_losses = rollout_weighted(dual_clipped.where_self(&negative, &clipped), &batch);
    Ok(PolicyLoss {
        pg_loss: agg_loss(&pg_losses, mask, agg, scale),
        metrics: vec![
            (PG_CLIPFRAC, scalar(&pg_clipfrac)),
            (PPO_KL, scalar(&ppo_kl)),
            (PG_CLIPFRAC_LOWER, scalar(&pg_clipfrac_lower)),
        ],
    })
}

/// DPPO (<https://arxiv.org/pdf/2602.04879>): `−A·sg[min(r, c)]·log π` on the tokens whose
/// probability has not yet moved beyond the clip range in the advantage's direction — measured as
/// `π − π_old` (`dppo_tv`) or as the binary KL (`dppo_kl`); the clip ratios are divergence bounds.
pub fn policy_loss_dppo(
    mode: PolicyLossMode,
    batch: PolicyBatch<'_>,
    clip: &ClipConfig,
    agg: LossAggMode,
    scale: &AggScale,
) -> PolicyLoss {
    let PolicyBatch {
        old_log_prob,
        log_prob,
        advantages,
        response_mask: mask,
        ..
    } = batch;
    let negative_approx_kl = log_ratio(&batch, true);
    let ratio = negative_approx_kl.exp();
    let ppo_kl = masked_mean(&negative_approx_kl.neg(), mask);
    let truncated = ratio.clamp_max(clip.clip_ratio_c).detach();

    let prob = log_prob.exp();
    let old_prob = old_log_prob.exp();
    let (valid_positive, valid_negative) = if mode == PolicyLossMode::DppoTv {
        let moved = &prob - &old_prob;
        (
            moved.le(clip.clip_ratio_high),
            moved.ge(-clip.clip_ratio_low),
        )
    } else {
        let old_rest = -&old_prob + 1.0;
        let binary_kl = &old_prob * (old_log_prob - log_prob)
            + &old_rest * ((&old_rest + 1e-8) / (-&prob + 1.0 + 1e-8)).log();
        (
            binary_kl
                .le(clip.clip_ratio_high)
                .logical_or(&prob.le_tensor(&old_prob)),
            binary_kl
                .le(clip.clip_ratio_low)
                .logical_or(&prob.ge_tensor(&old_prob)),
        )
    };
    let valid = float(&valid_positive.where_self(&advantages.gt(0.0), &valid_negative)).detach();

    let pg_losses = rollout_weighted(-advantages * &truncated * log_prob * &valid, &batch);
    let pg_clipfrac = masked_mean(&(-&valid + 1.0), mask);
    let pg_clipfrac_lower = masked_mean(&(float(&ratio.gt(clip.clip_ratio_c)) * &valid), mask);
    PolicyLoss {
        pg_loss: agg_loss(&pg_losses, mask, agg, scale),
        metrics: vec![
            (PG_CLIPFRAC, scalar(&pg_clipfrac)),
            (PPO_KL, scalar(&ppo_kl)),
            (PG_CLIPFRAC_LOWER, scalar(&pg_clipfrac_lower)),
        ],
    }
}

/// GSPO: one importance ratio per sequence, `exp(mean_t log r_t)`, with each token's gradient
/// flowing through its own log-prob (`sg[s_i] · π/sg[π]`).
pub fn policy_loss_gspo(batch: PolicyBatch<'_>, clip: &ClipConfig, scale: &AggScale) -> PolicyLoss {
    let PolicyBatch {
        log_prob,
        advantages,
        response_mask: mask,
        ..
    } = batch;
    let maskf = float(mask);
    let negative_approx_kl = log_ratio(&batch, false);
    let lengths = maskf.sum_dim_intlist(-1, false, Kind::Float).clamp_min(1.0);
    let seq_log_ratio =
        (&negative_approx_kl * &maskf).sum_dim_intlist(-1, false, Kind::Float) / lengths;
    let log_ratio =
        (log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp_max(10.0);
    let ratio = log_ratio.exp();

    let losses1 = -advantages * &ratio;
    let losses2 = -advantages * ratio.clamp(1.0 - clip.clip_ratio_low, 1.0 + clip.clip_ratio_high);
    let pg_losses = rollout_weighted(losses1.maximum(&losses2), &batch);
    PolicyLoss {
        pg_loss: agg_loss(&pg_losses, mask, LossAggMode::SeqMeanTokenMean, scale),
        metrics: vec![
            (
                PG_CLIPFRAC,
                scalar(&masked_mean(&float(&losses2.gt_tensor(&losses1)), mask)),
            ),
            (
                PPO_KL,
                scalar(&masked_mean(&negative_approx_kl.neg(), mask)),
            ),
            (PG_CLIPFRAC_LOWER, 0.0),
        ],
    }
}

/// SAPO (<https://arxiv.org/pdf/2511.20347>): `−A·σ(τ(r − 1))·4/τ`, τ = `tau_pos` for positive
/// advantages and `tau_neg` otherwise; always seq-mean-token-mean.
pub fn policy_loss_sapo(
    batch: PolicyBatch<'_>,
    options: &PolicyLossOptions,
    scale: &AggScale,
) -> PolicyLoss {
    let PolicyBatch {
        advantages,
        response_mask: mask,
        ..
    } = batch;
    let negative_approx_kl = log_ratio(&batch, true);
    let ratio = negative_approx_kl.exp();
    let tau = Tensor::where_scalar(&advantages.gt(0.0), options.tau_pos, options.tau_neg)
        .to_kind(advantages.kind())
        .to_device(advantages.device());
    let gates = (&tau * (ratio - 1.0)).sigmoid() * (tau.reciprocal() * 4.0);
    let pg_losses = rollout_weighted(-gates * advantages, &batch);
    PolicyLoss {
        pg_loss: agg_loss(&pg_losses, mask, LossAggMode::SeqMeanTokenMean, scale),
        metrics: vec![
            (PG_CLIPFRAC, 0.0),
            (
                PPO_KL,
                scalar(&masked_mean(&negative_approx_kl.neg(), mask)),
            ),
            (PG_CLIPFRAC_LOWER, 0.0),
        ],
    }
}

/// A share of tokens that must be positive (NaN is refused too).
fn require_positive(key: &str, value: f64) -> Result<()> {
    if value > 0.0 {
        Ok(())
    } else {
        Err(ModelError::invalid_input(
            key,
            format!("must be positive, got {value}"),
        ))
    }
}

/// Clip-Cov (<https://arxiv.org/abs/2505.22617>): PPO's clipped loss, with the gradient removed
/// from up to `clip_cov_ratio` of the tokens, drawn at random (libtorch's generator, as verl draws
/// from torch's) among the unclipped ones whose `(A − Ā)(log π − mean log π)` lies in (lb, ub).
pub fn policy_loss_clip_cov(
    batch: PolicyBatch<'_>,
    clip: &ClipConfig,
    options: &PolicyLossOptions,
    agg: LossAggMode,
    scale: &AggScale,
) -> Result<PolicyLoss> {
    require_positive("policy_loss.clip_cov_ratio", options.clip_cov_ratio)?;
    let PolicyBatch {
        log_prob,
        advantages,
        response_mask: mask,
        ..
    } = batch;
    let negative_approx_kl = log_ratio(&batch, false);
    let ratio = negative_approx_kl.exp();
    let ppo_kl = masked_mean(&negative_approx_kl.neg(), mask);
    let losses1 = -advantages * &ratio;
    let losses2 = -advantages * ratio.clamp(1.0 - clip.clip_ratio_low, 1.0 + clip.clip_ratio_high);
    let valid = mask.gt(0.0);
    let clipped_by_origin = losses2.gt_tensor(&losses1).logical_and(&valid);

    let cov = (advantages - masked_mean(advantages, mask))
        * (log_prob - masked_mean(&log_prob.detach(), mask));
    let candidates = cov
        .lt(options.clip_cov_ub)
        .logical_and(&cov.gt(options.clip_cov_lb))
        .logical_and(&valid)
        .logical_and(&clipped_by_origin.logical_not())
        .reshape(-1)
        .nonzero()
        .squeeze_dim(-1);
    let tokens = scalar(&float(mask).sum(Kind::Float));
    let clip_num = ((options.clip_cov_ratio * tokens) as i64).max(1);
    let found = candidates.size()[0];
    let chosen = candidates.index_select(
        0,
        &Tensor::randperm(found, (Kind::Int64, candidates.device())).narrow(
            0,
            0,
            clip_num.min(found),
        ),
    );
    let corr = advantages
        .ones_like()
        .reshape(-1)
        .index_fill(0, &chosen, 0.0)
        .view_as(advantages);
    let pg_clipfrac = masked_mean(&float(&corr.eq(0.0)), mask);
    let pg_losses = rollout_weighted(losses1.maximum(&losses2) * corr, &batch);
    Ok(PolicyLoss {
        pg_loss: agg_loss(&pg_losses, mask, agg, scale),
        metrics: vec![
            (PG_CLIPFRAC, scalar(&pg_clipfrac)),
            (PPO_KL, scalar(&ppo_kl)),
        ],
    })
}

/// KL-Cov (<https://arxiv.org/abs/2505.22617>): `−A·r`, plus `ppo_kl_coef·|log r|` on the
/// `kl_cov_ratio` share of tokens with the largest `(A − Ā)(log π − mean log π)`.
pub fn policy_loss_kl_cov(
    batch: PolicyBatch<'_>,
    options: &PolicyLossOptions,
    agg: LossAggMode,
    scale: &AggScale,
) -> Result<PolicyLoss> {
    require_positive("policy_loss.kl_cov_ratio", options.kl_cov_ratio)?;
    let PolicyBatch {
        log_prob,
        advantages,
        response_mask: mask,
        ..
    } = batch;
    let negative_approx_kl = log_ratio(&batch, false);
    let abs_kl = negative_approx_kl.abs();
    let ratio = negative_approx_kl.exp();
    let ppo_kl_abs = masked_mean(&abs_kl, mask);
    let losses1 = -advantages * &ratio;
    let losses_kl = &losses1 + &abs_kl * options.ppo_kl_coef;

    let valid = mask.gt(0.0).reshape(-1).nonzero().squeeze_dim(-1);
    let n = valid.size()[0];
    let mut penalised = advantages.zeros_like().reshape(-1).to_kind(Kind::Bool);
    if n > 0 {
        let adv = advantages.detach().reshape(-1).index_select(0, &valid);
        let logp = log_prob.detach().reshape(-1).index_select(0, &valid);
        let cov = (&adv - adv.mean(Kind::Float)) * (&logp - logp.mean(Kind::Float));
        let k = ((n as f64 * options.kl_cov_ratio) as i64).max(1);
        let (_, top) = cov.topk(k, 0, true, true);
        penalised = penalised.index_fill(0, &valid.index_select(0, &top), 1);
    }
    let pg_losses = rollout_weighted(
        losses_kl.where_self(&penalised.view_as(advantages), &losses1),
        &batch,
    );
    Ok(PolicyLoss {
        pg_loss: agg_loss(&pg_losses, mask, agg, scale),
        metrics: vec![(PPO_KL, scalar(&ppo_kl_abs))],
    })
}

/// GMPO (<https://arxiv.org/abs/2507.20673>): per sequence, `−Ā·exp(mean_t clip(log r_t))` with
/// the token log-ratios clipped in the advantage's direction, averaged over the sequences of the
/// batch (`loss_agg_mode` does not apply, as in verl).
pub fn policy_loss_geo_mean(
    batch: PolicyBatch<'_>,
    clip: &ClipConfig,
    scale: &AggScale,
) -> PolicyLoss {
    let PolicyBatch {
        advantages,
        response_mask: mask,
        ..
    } = batch;
    let maskf = float(mask);
    let negative_approx_kl = log_ratio(&batch, false);
    let ppo_kl = masked_mean(&negative_approx_kl.neg(), mask);
    let sign = advantages.sign();
    let kl_clamped = negative_approx_kl.clamp(-clip.clip_ratio_low, clip.clip_ratio_high);
    let kl_min = (&sign * &negative_approx_kl).minimum(&(&sign * &kl_clamped)) * &sign;
    let lengths = maskf.sum_dim_intlist(-1, false, Kind::Float) + 1e-8;
    let ratio = ((kl_min * &maskf).sum_dim_intlist(-1, false, Kind::Float) / &lengths).exp();
    let seq_advantage = (advantages * &maskf).sum_dim_intlist(-1, false, Kind::Float) / &lengths;
    let mut pg_losses = -seq_advantage * ratio;
    if let Some(weights) = batch.rollout_is_weights {
        // One weight per sequence: the geometric mean of its tokens' weights, as verl.
        let log_weights =
            ((weights + 1e-10).log() * &maskf).sum_dim_intlist(-1, false, Kind::Float);
        pg_losses *= (log_weights / &lengths).exp();
    }
    let sequences = scale
        .global_batch_size
        .unwrap_or(advantages.size()[0] as f64)
        .max(1.0);
    let clipped = negative_approx_kl.ne_tensor(&kl_clamped);
    PolicyLoss {
        pg_loss: pg_losses.sum(Kind::Float) / sequences * scale.dp_size,
        metrics: vec![
            (
                PG_CLIPFRAC,
                scalar(&masked_mean(
                    &float(&clipped.logical_and(&advantages.gt(0.0))),
                    mask,
                )),
            ),
            (PPO_KL, scalar(&ppo_kl)),
            (
                PG_CLIPFRAC_LOWER,
                scalar(&masked_mean(
                    &float(&clipped.logical_and(&advantages.lt(0.0))),
                    mask,
                )),
            ),
        ],
    }
}

/// DRO: `−(A·log π − β/2·(log π − log π_old)²)`.
pub fn policy_loss_dro(
    batch: PolicyBatch<'_>,
    options: &PolicyLossOptions,
    agg: LossAggMode,
    scale: &AggScale,
) -> Result<PolicyLoss> {
    let beta = options.dro_beta.filter(|b| *b > 0.0).ok_or_else(|| {
        ModelError::invalid_input(
            "policy_loss.dro_beta",
            format!(
                "must be a positive value when using DRO, got {:?}",
                options.dro_beta
            ),
        )
    })?;
    let log_ratio = log_ratio(&batch, false);
    let pg_losses = rollout_weighted(
        -(batch.log_prob * batch.advantages - log_ratio.square() * (0.5 * beta)),
        &batch,
    );
    Ok(PolicyLoss {
        pg_loss: agg_loss(&pg_losses, batch.response_mask, agg, scale),
        metrics: vec![(
            PPO_KL,
            scalar(&masked_mean(&log_ratio.neg(), batch.response_mask)),
        )],
    })
}

/// CISPO (<https://arxiv.org/pdf/2506.13585>): `−sg[clip(r)]·A·log π`, so clipped tokens keep a
/// gradient through `log π`.
pub fn policy_loss_cispo(
    batch: PolicyBatch<'_>,
    clip: &ClipConfig,
    agg: LossAggMode,
    scale: &AggScale,
) -> PolicyLoss {
    let PolicyBatch {
        log_prob,
        advantages,
        response_mask: mask,
        ..
    } = batch;
    let negative_approx_kl = log_ratio(&batch, true);
    let ratio = negative_approx_kl.exp();
    let clipped = ratio.clamp(1.0 - clip.clip_ratio_low, 1.0 + clip.clip_ratio_high);
    let pg_losses = rollout_weighted(-clipped.detach() * advantages * log_prob, &batch);
    PolicyLoss {
        pg_loss: agg_loss(&pg_losses, mask, agg, scale),
        metrics: vec![
            (
                PG_CLIPFRAC,
                scalar(&masked_mean(&float(&ratio.ne_tensor(&clipped)), mask)),
            ),
            (
                PPO_KL,
                scalar(&masked_mean(&negative_approx_kl.neg(), mask)),
            ),
            (PG_CLIPFRAC_LOWER, 0.0),
        ],
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
            // k2's own gradient is the straight-through one: `k2+` is k2.
            "mse" | "k2" => {
                return Ok(Self {
                    estimator: KlEstimator::K2,
                    straight_through: false,
                });
            }
            "low_var_kl" | "k3" => KlEstimator::K3,
            _ => {
                return Err(ModelError::invalid_input(
                    "kl_penalty",
                    format!(
                        "unknown KL penalty {s:?} (kl, k1, abs, mse, k2, low_var_kl, k3, each also with +)"
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
        // seq-mean-token-sum-norm: seq-mean-token-sum / response_len 3 (verl #5417)
        close(agg(LossAggMode::SeqMeanTokenSumNorm), 3.5 / 3.0);
        // token-sum: 1 + 2 + 4
        close(agg(LossAggMode::TokenSum), 7.0);
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
            7.0 / 7.0 / 2.0 * 2.0,
        );
        close(
            scalar(&agg_loss(&loss, &mask, LossAggMode::TokenSum, &scale)),
            7.0 * 2.0,
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
        assert_eq!(
            "token-sum".parse::<LossAggMode>().unwrap(),
            LossAggMode::TokenSum
        );
        assert!("token-max".parse::<LossAggMode>().is_err());
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
            rollout_is_weights: None,
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
        close(out.metric("actor/pg_clipfrac").unwrap(), 2.0 / 5.0);
        close(out.metric("actor/pg_clipfrac_lower").unwrap(), 1.0 / 5.0);
        // ppo_kl = mean(-ln r) = -(2 ln 1.5 + 2 ln 0.5 + ln 4) / 5 = -2 ln 1.5 / 5
        close(
            out.metric("actor/ppo_kl").unwrap(),
            -2.0 * 1.5f64.ln() / 5.0,
        );
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
            rollout_is_weights: None,
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
            &PolicyLossOptions::default(),
            LossAggMode::TokenMean,
            &AggScale::default(),
        )
        .unwrap();
        close(scalar(&out.pg_loss), -0.24);
        close(out.metric("actor/pg_clipfrac").unwrap(), 1.0);
        // ppo_kl = -(ln 2 + 0 + ln 0.25) / 3 = ln 2 / 3
        close(out.metric("actor/ppo_kl").unwrap(), 2f64.ln() / 3.0);
        close(out.metric("actor/pg_clipfrac_lower").unwrap(), 0.0);
        // Every token is clipped, so no gradient reaches the log-probs.
        out.pg_loss.backward();
        close(scalar(&log_prob.grad().abs().sum(Kind::Float)), 0.0);
    }

    #[test]
    fn every_verl_loss_mode_parses_and_the_required_knobs_are_checked() {
        for mode in PolicyLossMode::ALL {
            assert_eq!(mode.as_str().parse::<PolicyLossMode>().unwrap(), mode);
        }
        let err = "bypass_mode"
            .parse::<PolicyLossMode>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("dppo_tv") && err.contains("cispo"), "{err}");
        let ones = t(&[&[-1.0, -1.0]]);
        let batch = PolicyBatch {
            old_log_prob: &ones,
            log_prob: &ones,
            advantages: &ones,
            response_mask: &ones,
            rollout_is_weights: None,
        };
        let run = |mode, options: PolicyLossOptions| {
            policy_loss(
                mode,
                batch,
                &ClipConfig::default(),
                &options,
                LossAggMode::TokenMean,
                &AggScale::default(),
            )
        };
        let err = run(PolicyLossMode::Dro, PolicyLossOptions::default()).unwrap_err();
        assert!(err.to_string().contains("dro_beta"), "{err}");
        let no_ratio = PolicyLossOptions {
            clip_cov_ratio: 0.0,
            kl_cov_ratio: 0.0,
            ..PolicyLossOptions::default()
        };
        for mode in [PolicyLossMode::ClipCov, PolicyLossMode::KlCov] {
            assert!(run(mode, no_ratio).is_err());
        }
    }

    #[test]
    fn clip_cov_removes_at_most_its_share_of_tokens() {
        // Ratio 1 everywhere (no PPO clipping), advantages ±2 and log-probs spread, so every
        // token's covariance lies in (lb, ub) = (-100, 100): all 20 are candidates, 25% = 5 are
        // drawn and lose their gradient.
        let old = Tensor::arange(20, (Kind::Float, tch::Device::Cpu)).view([4, 5]) * -0.1;
        let log_prob = old.copy().set_requires_grad(true);
        let advantages = Tensor::from_slice(&[2.0f32, -2.0, 2.0, -2.0])
            .view([4, 1])
            .expand([4, 5], false)
            .contiguous();
        let mask = advantages.ones_like();
        let options = PolicyLossOptions {
            clip_cov_ratio: 0.25,
            clip_cov_lb: -100.0,
            clip_cov_ub: 100.0,
            ..PolicyLossOptions::default()
        };
        let out = policy_loss(
            PolicyLossMode::ClipCov,
            PolicyBatch {
                old_log_prob: &old,
                log_prob: &log_prob,
                advantages: &advantages,
                response_mask: &mask,
                rollout_is_weights: None,
            },
            &ClipConfig::default(),
            &options,
            LossAggMode::TokenMean,
            &AggScale::default(),
        )
        .unwrap();
        close(out.metric("actor/pg_clipfrac").unwrap(), 5.0 / 20.0);
        out.pg_loss.backward();
        let zero_grads = scalar(
            &log_prob
                .grad()
                .eq(0.0)
                .to_kind(Kind::Float)
                .sum(Kind::Float),
        );
        close(zero_grads, 5.0);
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
        // k2+ and mse+ are k2 (its gradient already is the straight-through one).
        for name in ["k2+", "mse+"] {
            assert_eq!(
                name.parse::<KlPenalty>().unwrap(),
                "k2".parse::<KlPenalty>().unwrap()
            );
        }
        assert!("full".parse::<KlPenalty>().is_err() && "k4+".parse::<KlPenalty>().is_err());
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
