//! Advantage estimators (verl `core_algos.compute_*_advantage*`). Statistics are accumulated in f64
//! and the results stored as f32; verl computes in the tensors' f32, so values can differ in the
//! last ulp.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::{AlgoError, Matrix};

/// `algorithm.adv_estimator`: every estimator of verl's registry, by verl's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvEstimator {
    Gae,
    Grpo,
    /// verl's vectorized GRPO: the same values as `grpo`.
    GrpoVectorized,
    /// GRPO on each reward component separately, weighted sum, whitened over the batch.
    Gdpo,
    /// Pass@k: only each group's best response gets `r_max − r_second`.
    GrpoPassk,
    Rloo,
    /// verl's vectorized RLOO: as `rloo`, except that a response alone in its group gets 0.
    RlooVectorized,
    /// GRPO-like with a length-weighted group baseline.
    Opo,
    /// Group-centred scores scaled by `batch / nonzero scores`.
    Gpg,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    Remax,
    /// A per-token baseline weighted by the cumulative path variance (needs `sum_pi_squared`).
    OptimalTokenBaseline,
    /// The optimal token baseline over each response's unmasked tokens only (tool-use turns).
    TirOptimalTokenBaseline,
}

impl AdvEstimator {
    /// verl's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gae => "gae",
            Self::Grpo => "grpo",
            Self::GrpoVectorized => "grpo_vectorized",
            Self::Gdpo => "gdpo",
            Self::GrpoPassk => "grpo_passk",
            Self::Rloo => "rloo",
            Self::RlooVectorized => "rloo_vectorized",
            Self::Opo => "opo",
            Self::Gpg => "gpg",
            Self::ReinforcePlusPlus => "reinforce_plus_plus",
            Self::ReinforcePlusPlusBaseline => "reinforce_plus_plus_baseline",
            Self::Remax => "remax",
            Self::OptimalTokenBaseline => "optimal_token_baseline",
            Self::TirOptimalTokenBaseline => "tir_optimal_token_baseline",
        }
    }

    /// Only GAE bootstraps from a value function; the others are critic-free.
    pub fn needs_critic(self) -> bool {
        self == Self::Gae
    }

    /// ReMax needs the reward of one extra greedy rollout per prompt as its baseline.
    pub fn needs_greedy_baseline(self) -> bool {
        self == Self::Remax
    }

    /// The optimal token baselines need the old log-probs and Σπ² over the vocabulary per token
    /// (verl's `actor.calculate_sum_pi_squared`).
    pub fn needs_sum_pi_squared(self) -> bool {
        matches!(
            self,
            Self::OptimalTokenBaseline | Self::TirOptimalTokenBaseline
        )
    }
}

/// The `algorithm.*` numbers the estimators read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdvantageParams {
    pub gamma: f32,
    pub lam: f32,
    pub norm_adv_by_std_in_grpo: bool,
    /// Added to the group std in GRPO (verl's `epsilon=1e-6`).
    pub epsilon: f32,
}

impl Default for AdvantageParams {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            lam: 1.0,
            norm_adv_by_std_in_grpo: true,
            epsilon: 1e-6,
        }
    }
}

/// One batch, `[batch × response_length]`. Build it with [`AdvantageInput::new`] and set the
/// inputs the estimator needs.
#[derive(Debug, Clone, Copy)]
pub struct AdvantageInput<'a> {
    pub token_level_rewards: &'a Matrix,
    pub response_mask: &'a Matrix,
    /// Group (prompt uid) of every row: the n responses of one prompt share an id.
    pub index: &'a [u64],
    /// Critic values, for `gae`.
    pub values: Option<&'a Matrix>,
    /// Reward of the greedy response to each row's prompt, for `remax`.
    pub reward_baselines: Option<&'a [f32]>,
    /// Log-probs of the responses under the policy that generated them, for the optimal token
    /// baselines.
    pub old_log_probs: Option<&'a Matrix>,
    /// Σ over the vocabulary of π², per token, for the optimal token baselines.
    pub sum_pi_squared: Option<&'a Matrix>,
    /// Truncated importance weights of rollout correction; the optimal token baselines scale
    /// their path variance by their square.
    pub rollout_is_weights: Option<&'a Matrix>,
    /// `gdpo`: one token-level reward matrix per reward component (verl's `gdpo_reward_keys`);
    /// None normalises `token_level_rewards` as the only component.
    pub reward_components: Option<&'a [Matrix]>,
    /// `gdpo`: one weight per component (`gdpo_reward_weights`); None: all 1.
    pub reward_weights: Option<&'a [f32]>,
}

impl<'a> AdvantageInput<'a> {
    pub fn new(
        token_level_rewards: &'a Matrix,
        response_mask: &'a Matrix,
        index: &'a [u64],
    ) -> Self {
        Self {
            token_level_rewards,
            response_mask,
            index,
            values: None,
            reward_baselines: None,
            old_log_probs: None,
            sum_pi_squared: None,
            rollout_is_weights: None,
            reward_components: None,
            reward_weights: None,
        }
    }
}

/// `(advantages, returns)` for `estimator`, both shaped like the rewards.
pub fn compute_advantage(
    estimator: AdvEstimator,
    params: &AdvantageParams,
    input: &AdvantageInput<'_>,
) -> Result<(Matrix, Matrix), AlgoError> {
    let shape = input.token_level_rewards.shape();
    input.response_mask.expect_shape("response_mask", shape)?;
    if input.index.len() != shape.0 {
        return Err(AlgoError::Length {
            what: "index",
            expected: shape.0,
            got: input.index.len(),
        });
    }
    let outcome = |adv: Matrix| (adv.clone(), adv);
    let eps = f64::from(params.epsilon);
    let scores = input.token_level_rewards.row_sums();
    match estimator {
        AdvEstimator::Gae => {
            let values = input
                .values
                .ok_or(AlgoError::MissingInput("gae", "values"))?;
            values.expect_shape("values", shape)?;
            gae(
                input.token_level_rewards,
                values,
                input.response_mask,
                params.gamma,
                params.lam,
            )
        }
        AdvEstimator::Grpo | AdvEstimator::GrpoVectorized => Ok(outcome(grpo(
            input.token_level_rewards,
            input,
            params.norm_adv_by_std_in_grpo,
            eps,
        ))),
        AdvEstimator::Gdpo => gdpo(input, params.norm_adv_by_std_in_grpo, eps).map(outcome),
        AdvEstimator::GrpoPassk => {
            grpo_passk(&scores, input, params.norm_adv_by_std_in_grpo, eps).map(outcome)
        }
        AdvEstimator::Rloo | AdvEstimator::RlooVectorized => {
            // Leave-one-out baseline: R - mean(others) = n/(n-1)·(R - mean_g). A response alone
            // keeps its score in verl's `rloo` and gets 0 in its vectorized twin.
            let alone = if estimator == AdvEstimator::Rloo {
                1.0
            } else {
                0.0
            };
            let adv = group_outcome(&scores, input, |score, g| {
                if g.n > 1 {
                    let n = g.n as f64;
                    score * n / (n - 1.0) - g.mean * n / (n - 1.0)
                } else {
                    score * alone
                }
            });
            Ok(outcome(adv))
        }
        AdvEstimator::Opo => Ok(outcome(opo(&scores, input))),
        AdvEstimator::Gpg => {
            // α = batch size / number of non-zero scores (at least 1); f_norm is verl's fixed 1.
            let nonzero = scores.iter().filter(|&&s| s != 0.0).count().max(1);
            let alpha = scores.len() as f64 / nonzero as f64;
            Ok(outcome(group_outcome(&scores, input, |score, g| {
                alpha * (score - g.mean)
            })))
        }
        AdvEstimator::ReinforcePlusPlusBaseline => {
            let centred = group_outcome(&scores, input, |score, g| score - g.mean);
            let adv = mask_out(
                masked_whiten(&centred, input.response_mask)?,
                input.response_mask,
            );
            Ok(outcome(adv))
        }
        AdvEstimator::ReinforcePlusPlus => {
            let returns =
                discounted_returns(input.token_level_rewards, input.response_mask, params.gamma);
            let adv = mask_out(
                masked_whiten(&returns, input.response_mask)?,
                input.response_mask,
            );
            Ok((adv, returns))
        }
        AdvEstimator::Remax => {
            let baselines = input
                .reward_baselines
                .ok_or(AlgoError::MissingInput("remax", "reward_baselines"))?;
            if baselines.len() != shape.0 {
                return Err(AlgoError::Length {
                    what: "reward_baselines",
                    expected: shape.0,
                    got: baselines.len(),
                });
            }
            remax(input.token_level_rewards, input.response_mask, baselines)
        }
        AdvEstimator::OptimalTokenBaseline | AdvEstimator::TirOptimalTokenBaseline => {
            let name = estimator.name();
            let w = path_variance(name, input)?;
            let returns = reward_to_go(input.token_level_rewards, input.response_mask);
            let adv = if estimator == AdvEstimator::OptimalTokenBaseline {
                optimal_token_baseline(&returns, &w, input)
            } else {
                tir_optimal_token_baseline(&returns, &w, input)
            };
            Ok((adv, returns))
        }
    }
}

/// Mean of `values` where `mask` is set: `Σ v·m / (Σ m + 1e-8)` (verl's `masked_mean`).
pub fn masked_mean(values: &Matrix, mask: &Matrix) -> Result<f64, AlgoError> {
    mask.expect_shape("mask", values.shape())?;
    let (sum, count) = masked_sum(values, mask, |v| v);
    Ok(sum / count_plus_eps(count))
}

/// `Σ m + 1e-8` as verl's f32 tensors compute it: from one token on the 1e-8 is rounded away, so
/// the mean of equal values is that value exactly and whitening them gives 0, not 1e-8/√1e-8.
pub(super) fn count_plus_eps(count: f64) -> f64 {
    f64::from(count as f32 + 1e-8f32)
}

/// `(v − mean) / sqrt(var + 1e-8)` with the mean and the unbiased variance taken over the mask,
/// applied to every entry (masked-out entries too, as verl's `masked_whiten` does).
pub fn masked_whiten(values: &Matrix, mask: &Matrix) -> Result<Matrix, AlgoError> {
    let mean = masked_mean(values, mask)?;
    let (squares, count) = masked_sum(values, mask, |v| (v - mean).powi(2));
    if count < 2.0 {
        return Err(AlgoError::TooFewMasked(count as usize));
    }
    let var = squares / count_plus_eps(count) * count / (count - 1.0);
    let scale = 1.0 / (var + 1e-8).sqrt();
    let data = values
        .data()
        .iter()
        .map(|&v| ((f64::from(v) - mean) * scale) as f32)
        .collect();
    Matrix::new(values.rows(), values.cols(), data)
}

/// `(Σ f(v)·m, Σ m)`.
fn masked_sum(values: &Matrix, mask: &Matrix, f: impl Fn(f64) -> f64) -> (f64, f64) {
    values
        .data()
        .iter()
        .zip(mask.data())
        .fold((0.0, 0.0), |(sum, count), (&v, &m)| {
            (sum + f(f64::from(v)) * f64::from(m), count + f64::from(m))
        })
}

fn mask_out(values: Matrix, mask: &Matrix) -> Matrix {
    values
        .zip_map(mask, "mask", |v, m| v * m)
        .expect("shapes checked by the caller")
}

/// The rows of each group (prompt uid), groups in the order they first appear.
fn group_rows(index: &[u64]) -> Vec<Vec<usize>> {
    let mut slot: HashMap<u64, usize> = HashMap::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (row, &id) in index.iter().enumerate() {
        let next = groups.len();
        let g = *slot.entry(id).or_insert(next);
        if g == next {
            groups.push(Vec::new());
        }
        groups[g].push(row);
    }
    groups
}

/// Size, mean and unbiased std of one group's sequence scores. A group of one has mean 0 and
/// std 1 so its score passes through (verl's convention).
struct GroupStats {
    n: usize,
    mean: f64,
    std: f64,
}

fn group_stats(scores: &[f64], rows: &[usize]) -> GroupStats {
    let n = rows.len();
    if n == 1 {
        return GroupStats {
            n,
            mean: 0.0,
            std: 1.0,
        };
    }
    let mean = rows.iter().map(|&i| scores[i]).sum::<f64>() / n as f64;
    let var = rows
        .iter()
        .map(|&i| (scores[i] - mean).powi(2))
        .sum::<f64>()
        / (n as f64 - 1.0);
    GroupStats {
        n,
        mean,
        std: var.sqrt(),
    }
}

/// One advantage per row, repeated on the row's response tokens.
fn broadcast(per_row: &[f64], mask: &Matrix) -> Matrix {
    let mut out = Matrix::zeros(mask.rows(), mask.cols());
    for (i, &adv) in per_row.iter().enumerate() {
        for (o, &m) in out.row_mut(i).iter_mut().zip(mask.row(i)) {
            *o = adv as f32 * m;
        }
    }
    out
}

/// Per-row sequence score turned into an advantage by `f` from its group's statistics, then
/// broadcast over the row's response tokens.
fn group_outcome(
    scores: &[f64],
    input: &AdvantageInput<'_>,
    f: impl Fn(f64, &GroupStats) -> f64,
) -> Matrix {
    let mut per_row = vec![0.0; scores.len()];
    for rows in group_rows(input.index) {
        let stats = group_stats(scores, &rows);
        for &i in &rows {
            per_row[i] = f(scores[i], &stats);
        }
    }
    broadcast(&per_row, input.response_mask)
}

/// GRPO on the sequence sums of `rewards`; Dr. GRPO when not normalised by the std.
fn grpo(rewards: &Matrix, input: &AdvantageInput<'_>, norm_by_std: bool, eps: f64) -> Matrix {
    group_outcome(&rewards.row_sums(), input, |score, g| {
        if norm_by_std {
            (score - g.mean) / (g.std + eps)
        } else {
            score - g.mean
        }
    })
}

/// GDPO: GRPO on each reward component, `Σ_k w_k·A_k`, whitened over the batch's tokens.
fn gdpo(input: &AdvantageInput<'_>, norm_by_std: bool, eps: f64) -> Result<Matrix, AlgoError> {
    let mask = input.response_mask;
    let components = input
        .reward_components
        .unwrap_or(std::slice::from_ref(input.token_level_rewards));
    if let Some(weights) = input.reward_weights
        && weights.len() != components.len()
    {
        return Err(AlgoError::Length {
            what: "gdpo_reward_weights",
            expected: components.len(),
            got: weights.len(),
        });
    }
    let mut sum = vec![0.0f64; mask.data().len()];
    for (k, component) in components.iter().enumerate() {
        component.expect_shape("reward component", mask.shape())?;
        let weight = f64::from(input.reward_weights.map_or(1.0, |w| w[k]));
        let adv = grpo(component, input, norm_by_std, eps);
        for (s, &a) in sum.iter_mut().zip(adv.data()) {
            *s += weight * f64::from(a);
        }
    }
    let sum = Matrix::new(
        mask.rows(),
        mask.cols(),
        sum.into_iter().map(|v| v as f32).collect(),
    )?;
    Ok(mask_out(masked_whiten(&sum, mask)?, mask))
}

/// Pass@k: in each group only the best response learns, from `r_max − r_second` (over the group
/// std when normalising). Needs two responses per group.
fn grpo_passk(
    scores: &[f64],
    input: &AdvantageInput<'_>,
    norm_by_std: bool,
    eps: f64,
) -> Result<Matrix, AlgoError> {
    let mut per_row = vec![0.0; scores.len()];
    for rows in group_rows(input.index) {
        if rows.len() < 2 {
            return Err(AlgoError::GroupTooSmall {
                estimator: "grpo_passk",
                needs: 2,
                got: rows.len(),
            });
        }
        // On a tie for the best the advantage is 0, whichever row holds it.
        let best = rows
            .iter()
            .copied()
            .fold(rows[0], |b, i| if scores[i] > scores[b] { i } else { b });
        let second = rows
            .iter()
            .filter(|&&i| i != best)
            .map(|&i| scores[i])
            .fold(f64::NEG_INFINITY, f64::max);
        let mut adv = scores[best] - second;
        if norm_by_std {
            adv /= group_stats(scores, &rows).std + eps;
        }
        per_row[best] = adv;
    }
    Ok(broadcast(&per_row, input.response_mask))
}

/// OPO: the group baseline is the length-weighted mean score `Σ|y|·R / Σ|y|`.
fn opo(scores: &[f64], input: &AdvantageInput<'_>) -> Matrix {
    let lengths = input.response_mask.row_sums();
    let mut per_row = vec![0.0; scores.len()];
    for rows in group_rows(input.index) {
        let baseline = if rows.len() == 1 {
            0.0
        } else {
            rows.iter().map(|&i| lengths[i] * scores[i]).sum::<f64>()
                / rows.iter().map(|&i| lengths[i]).sum::<f64>()
        };
        for &i in &rows {
            per_row[i] = scores[i] - baseline;
        }
    }
    broadcast(&per_row, input.response_mask)
}

fn gae(
    rewards: &Matrix,
    values: &Matrix,
    mask: &Matrix,
    gamma: f32,
    lam: f32,
) -> Result<(Matrix, Matrix), AlgoError> {
    let mut adv = Matrix::zeros(rewards.rows(), rewards.cols());
    for i in 0..rewards.rows() {
        let (r, v, m) = (rewards.row(i), values.row(i), mask.row(i));
        let (mut next_value, mut last_gae) = (0.0f32, 0.0f32);
        let out = adv.row_mut(i);
        for t in (0..r.len()).rev() {
            let delta = r[t] + gamma * next_value - v[t];
            let gae_t = delta + gamma * lam * last_gae;
            // Masked (padding/observation) tokens carry the next value and advantage through.
            next_value = v[t] * m[t] + (1.0 - m[t]) * next_value;
            last_gae = gae_t * m[t] + (1.0 - m[t]) * last_gae;
            out[t] = last_gae;
        }
    }
    let returns = adv.zip_map(values, "values", |a, v| a + v)?;
    Ok((masked_whiten(&adv, mask)?, returns))
}

/// REINFORCE++ returns `G_t = r_t + γ·G_{t+1}` over response tokens. A masked token (padding, or
/// a tool observation inside a multi-turn response) gets return 0 and passes the running return
/// through unchanged, so a later turn's reward reaches earlier turns (verl #7300).
fn discounted_returns(rewards: &Matrix, mask: &Matrix, gamma: f32) -> Matrix {
    let mut returns = Matrix::zeros(rewards.rows(), rewards.cols());
    for i in 0..rewards.rows() {
        let (r, m) = (rewards.row(i), mask.row(i));
        let out = returns.row_mut(i);
        let mut running = 0.0f32;
        for t in (0..r.len()).rev() {
            let g = r[t] + gamma * running;
            out[t] = g * m[t];
            running = g * m[t] + running * (1.0 - m[t]);
        }
    }
    returns
}

/// Undiscounted reward-to-go of the response tokens' rewards.
fn reward_to_go(rewards: &Matrix, mask: &Matrix) -> Matrix {
    let mut returns = Matrix::zeros(rewards.rows(), rewards.cols());
    for i in 0..rewards.rows() {
        let (r, m) = (rewards.row(i), mask.row(i));
        let out = returns.row_mut(i);
        let mut to_go = 0.0f32;
        for t in (0..r.len()).rev() {
            to_go += r[t] * m[t];
            out[t] = to_go;
        }
    }
    returns
}

/// ReMax: reward-to-go minus the greedy response's reward on every response token.
fn remax(
    rewards: &Matrix,
    mask: &Matrix,
    baselines: &[f32],
) -> Result<(Matrix, Matrix), AlgoError> {
    let returns = reward_to_go(rewards, mask);
    let mut adv = returns.clone();
    for (i, &baseline) in baselines.iter().enumerate() {
        for (a, &m) in adv.row_mut(i).iter_mut().zip(mask.row(i)) {
            *a -= baseline * m;
        }
    }
    Ok((adv, returns))
}

/// The cumulative path variance `W_t = Σ_{j≤t} m_j·w_j` with `w_j = 1 − 2π_j + Σπ²` (times the
/// squared rollout-correction weight), row-major.
fn path_variance(name: &'static str, input: &AdvantageInput<'_>) -> Result<Vec<f64>, AlgoError> {
    let mask = input.response_mask;
    let old = input
        .old_log_probs
        .ok_or(AlgoError::MissingInput(name, "old_log_probs"))?;
    let sum_pi_squared = input
        .sum_pi_squared
        .ok_or(AlgoError::MissingInput(name, "sum_pi_squared"))?;
    old.expect_shape("old_log_probs", mask.shape())?;
    sum_pi_squared.expect_shape("sum_pi_squared", mask.shape())?;
    if let Some(rho) = input.rollout_is_weights {
        rho.expect_shape("rollout_is_weights", mask.shape())?;
    }
    let mut w = vec![0.0f64; mask.data().len()];
    for i in 0..mask.rows() {
        let mut cumulative = 0.0f64;
        for t in 0..mask.cols() {
            let at = i * mask.cols() + t;
            let mut w_t = score_norm(old.data()[at], sum_pi_squared.data()[at]);
            if let Some(rho) = input.rollout_is_weights {
                w_t *= f64::from(rho.data()[at]).powi(2);
            }
            cumulative += w_t * f64::from(mask.data()[at]);
            w[at] = cumulative;
        }
    }
    Ok(w)
}

/// verl's score-norm proxy of one token, `w = 1 − 2π + Σπ²` with `π = exp(log_prob)`: the
/// squared norm of the token's log-prob gradient with respect to the logits.
pub(super) fn score_norm(log_prob: f32, sum_pi_squared: f32) -> f64 {
    1.0 - 2.0 * f64::from(log_prob).exp() + f64::from(sum_pi_squared)
}

/// verl's `handle_zero_tail`: when one response of a group is strictly the longest, its tokens
/// beyond the second-longest length get no baseline. Returns that row and the length.
fn zero_tail(rows: &[usize], lengths: &[f64]) -> Option<(usize, usize)> {
    let mut sorted: Vec<f64> = rows.iter().map(|&i| lengths[i]).collect();
    sorted.sort_by(f64::total_cmp);
    let (longest, second) = (sorted[sorted.len() - 1], sorted[sorted.len() - 2]);
    let mut at_longest = rows.iter().filter(|&&i| lengths[i] == longest);
    match (at_longest.next(), at_longest.next()) {
        (Some(&row), None) if longest > second => Some((row, second as usize)),
        _ => None,
    }
}

/// Optimal token baseline: per group and position, `B_t = Σ G_t·W_t / Σ W_t` over the group's
/// responses; a response alone in its group keeps its return as advantage.
fn optimal_token_baseline(returns: &Matrix, w: &[f64], input: &AdvantageInput<'_>) -> Matrix {
    let mask = input.response_mask;
    let cols = mask.cols();
    let lengths = mask.row_sums();
    let mut baselines = vec![0.0f64; mask.data().len()];
    for rows in group_rows(input.index) {
        if rows.len() == 1 {
            continue;
        }
        for t in 0..cols {
            let (mut num, mut den) = (0.0, 0.0);
            for &i in &rows {
                let at = i * cols + t;
                let m = f64::from(mask.data()[at]);
                num += f64::from(returns.data()[at]) * w[at] * m;
                den += w[at] * m;
            }
            let b = num / (den + 1e-8);
            for &i in &rows {
                baselines[i * cols + t] = b;
            }
        }
        if let Some((row, from)) = zero_tail(&rows, &lengths) {
            baselines[row * cols + from..(row + 1) * cols].fill(0.0);
        }
    }
    advantages_from(returns, &baselines, mask)
}

/// The optimal token baseline over each response's unmasked tokens only: every response is
/// compacted to its response tokens (dropping tool-observation spans) before the positions of a
/// group are compared; the advantages go back to the token positions.
fn tir_optimal_token_baseline(returns: &Matrix, w: &[f64], input: &AdvantageInput<'_>) -> Matrix {
    let mask = input.response_mask;
    let cols = mask.cols();
    let lengths = mask.row_sums();
    // Row i's response-token positions, in order.
    let positions: Vec<Vec<usize>> = (0..mask.rows())
        .map(|i| (0..cols).filter(|&t| mask.row(i)[t] != 0.0).collect())
        .collect();
    let width = positions.iter().map(Vec::len).max().unwrap_or(0);
    let compact = |i: usize, k: usize, values: &dyn Fn(usize) -> f64| {
        positions[i].get(k).map_or(0.0, |&t| values(i * cols + t))
    };
    let mut baselines = vec![0.0f64; mask.rows() * width];
    for mut rows in group_rows(input.index) {
        rows.retain(|&i| !positions[i].is_empty());
        if rows.len() < 2 {
            continue;
        }
        for k in 0..width {
            let (mut num, mut den) = (0.0, 0.0);
            for &i in &rows {
                let w_k = compact(i, k, &|at| w[at]);
                num += compact(i, k, &|at| f64::from(returns.data()[at])) * w_k;
                den += w_k;
            }
            let b = num / (den + 1e-8);
            for &i in &rows {
                baselines[i * width + k] = b;
            }
        }
        if let Some((row, from)) = zero_tail(&rows, &lengths) {
            baselines[row * width + from..(row + 1) * width].fill(0.0);
        }
    }
    // Back to token positions: the baseline of a row's k-th response token.
    let mut spread = vec![0.0f64; mask.data().len()];
    for (i, row_positions) in positions.iter().enumerate() {
        for (k, &t) in row_positions.iter().enumerate() {
            spread[i * cols + t] = baselines[i * width + k];
        }
    }
    advantages_from(returns, &spread, mask)
}

/// `(G − B)·mask`.
fn advantages_from(returns: &Matrix, baselines: &[f64], mask: &Matrix) -> Matrix {
    let data = returns
        .data()
        .iter()
        .zip(baselines)
        .zip(mask.data())
        .map(|((&g, &b), &m)| ((f64::from(g) - b) * f64::from(m)) as f32)
        .collect();
    Matrix::new(mask.rows(), mask.cols(), data).expect("shaped like the mask")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(rows: &[&[f32]]) -> Matrix {
        Matrix::from_rows(rows).unwrap()
    }

    fn close(actual: &[f32], expected: &[f32]) {
        assert_eq!(actual.len(), expected.len(), "{actual:?} vs {expected:?}");
        for (a, e) in actual.iter().zip(expected) {
            assert!((a - e).abs() < 1e-4, "{actual:?} vs {expected:?}");
        }
    }

    fn run(
        est: AdvEstimator,
        params: AdvantageParams,
        rewards: &Matrix,
        mask: &Matrix,
        index: &[u64],
    ) -> (Matrix, Matrix) {
        let input = AdvantageInput::new(rewards, mask, index);
        compute_advantage(est, &params, &input).unwrap()
    }

    /// Group 7: scores 1, 0, 1, 0 (the reward sits on the last valid token); group 9: one score 3.
    fn grouped() -> (Matrix, Matrix, Vec<u64>) {
        let rewards = m(&[
            &[0.0, 1.0],
            &[0.0, 0.0],
            &[1.0, 0.0],
            &[0.0, 0.0],
            &[0.0, 3.0],
        ]);
        let mask = m(&[
            &[1.0, 1.0],
            &[1.0, 1.0],
            &[1.0, 0.0],
            &[1.0, 0.0],
            &[1.0, 1.0],
        ]);
        (rewards, mask, vec![7, 7, 7, 7, 9])
    }

    #[test]
    fn grpo_normalises_by_the_unbiased_group_std() {
        let (rewards, mask, index) = grouped();
        let (adv, returns) = run(
            AdvEstimator::Grpo,
            AdvantageParams::default(),
            &rewards,
            &mask,
            &index,
        );
        // Group 7: mean 0.5, unbiased var = 4·0.25/3 = 1/3, std = 0.57735 → ±0.5/0.57735 = ±0.866025.
        // Group 9 (alone): mean 0, std 1 → 3/(1+1e-6) ≈ 3.
        let a = 0.5 / (1.0f32 / 3.0).sqrt();
        close(adv.data(), &[a, a, -a, -a, a, 0.0, -a, 0.0, 3.0, 3.0]);
        assert_eq!(adv, returns);
    }

    #[test]
    fn dr_grpo_only_centres() {
        let (rewards, mask, index) = grouped();
        let params = AdvantageParams {
            norm_adv_by_std_in_grpo: false,
            ..Default::default()
        };
        let (adv, _) = run(AdvEstimator::Grpo, params, &rewards, &mask, &index);
        // Group 7: R − 0.5; group 9: 3 − 0.
        close(
            adv.data(),
            &[0.5, 0.5, -0.5, -0.5, 0.5, 0.0, -0.5, 0.0, 3.0, 3.0],
        );
    }

    #[test]
    fn grpo_with_equal_scores_gives_zero() {
        let rewards = m(&[&[1.0], &[1.0]]);
        let mask = m(&[&[1.0], &[1.0]]);
        let (adv, _) = run(
            AdvEstimator::Grpo,
            AdvantageParams::default(),
            &rewards,
            &mask,
            &[1, 1],
        );
        // std 0: (1−1)/(0+1e-6) = 0.
        close(adv.data(), &[0.0, 0.0]);
    }

    #[test]
    fn rloo_uses_the_leave_one_out_mean() {
        let rewards = m(&[&[1.0], &[0.0], &[0.0], &[2.0]]);
        let mask = m(&[&[1.0], &[1.0], &[1.0], &[1.0]]);
        let (adv, _) = run(
            AdvEstimator::Rloo,
            AdvantageParams::default(),
            &rewards,
            &mask,
            &[1, 1, 1, 2],
        );
        // Group 1 (n=3, mean 1/3): 3/2·(1 − 1/3) = 1, 3/2·(0 − 1/3) = −0.5. Group 2 alone: 2.
        close(adv.data(), &[1.0, -0.5, -0.5, 2.0]);
    }

    #[test]
    fn reinforce_plus_plus_baseline_centres_then_whitens() {
        let rewards = m(&[&[0.0, 1.0], &[0.0, 0.0]]);
        let mask = m(&[&[1.0, 1.0], &[1.0, 0.0]]);
        let (adv, returns) = run(
            AdvEstimator::ReinforcePlusPlusBaseline,
            AdvantageParams::default(),
            &rewards,
            &mask,
            &[4, 4],
        );
        // Centred: 1 − 0.5 = 0.5 on both tokens of row 0, −0.5 on row 1's one token.
        // Over the mask {0.5, 0.5, −0.5}: mean 1/6, deviations 1/3, 1/3, −2/3, Σd² = 2/3,
        // unbiased var = (2/3)/2 = 1/3, std 0.57735 → 0.57735, 0.57735, −1.1547; padding stays 0.
        let s = (1.0f32 / 3.0).sqrt();
        close(
            adv.data(),
            &[(1.0 / 3.0) / s, (1.0 / 3.0) / s, (-2.0 / 3.0) / s, 0.0],
        );
        assert_eq!(adv, returns);
    }

    #[test]
    fn reinforce_plus_plus_discounts_and_whitens() {
        let rewards = m(&[&[0.0, 0.0, 1.0], &[1.0, 0.0, 5.0]]);
        let mask = m(&[&[1.0, 1.0, 1.0], &[1.0, 0.0, 0.0]]);
        let params = AdvantageParams {
            gamma: 0.5,
            ..Default::default()
        };
        let (adv, returns) = run(
            AdvEstimator::ReinforcePlusPlus,
            params,
            &rewards,
            &mask,
            &[0, 1],
        );
        // Row 0: G = [0.25, 0.5, 1]. Row 1: the reward 5 sits on trailing padding, which gets
        // return 0 and carries the running return (still 0) through: G = [1, 0, 0].
        close(returns.data(), &[0.25, 0.5, 1.0, 1.0, 0.0, 0.0]);
        // Over {0.25, 0.5, 1, 1}: mean 0.6875, Σd² = 0.421875, unbiased var 0.140625, std 0.375.
        close(
            adv.data(),
            &[
                -0.4375 / 0.375,
                -0.1875 / 0.375,
                0.3125 / 0.375,
                0.3125 / 0.375,
                0.0,
                0.0,
            ],
        );
    }

    #[test]
    fn remax_subtracts_the_greedy_reward() {
        let rewards = m(&[&[0.0, 0.0, 1.0], &[0.0, 2.0, 7.0]]);
        let mask = m(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let baselines = [0.4, 1.0];
        let input = AdvantageInput {
            reward_baselines: Some(&baselines),
            ..AdvantageInput::new(&rewards, &mask, &[0, 1])
        };
        let (adv, returns) =
            compute_advantage(AdvEstimator::Remax, &AdvantageParams::default(), &input).unwrap();
        // Row 0: reward-to-go [1, 1, 1] − 0.4. Row 1: masked rewards [0, 2, 0] → to-go [2, 2, 0];
        // the baseline only on response tokens → [1, 1, 0].
        close(returns.data(), &[1.0, 1.0, 1.0, 2.0, 2.0, 0.0]);
        close(adv.data(), &[0.6, 0.6, 0.6, 1.0, 1.0, 0.0]);
        let missing = AdvantageInput {
            reward_baselines: None,
            ..input
        };
        assert_eq!(
            compute_advantage(AdvEstimator::Remax, &AdvantageParams::default(), &missing),
            Err(AlgoError::MissingInput("remax", "reward_baselines"))
        );
    }

    #[test]
    fn gae_matches_the_recursion_and_whitens() {
        let rewards = m(&[&[0.0, 0.0, 1.0], &[0.0, 2.0, 0.0]]);
        let values = m(&[&[0.5, 0.5, 0.5], &[1.0, 1.0, 9.0]]);
        let mask = m(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let params = AdvantageParams {
            gamma: 0.5,
            lam: 0.5,
            ..Default::default()
        };
        let input = AdvantageInput {
            values: Some(&values),
            ..AdvantageInput::new(&rewards, &mask, &[0, 1])
        };
        let (adv, returns) = compute_advantage(AdvEstimator::Gae, &params, &input).unwrap();
        // Row 0 (γλ = 0.25): t2 δ = 1 − 0.5 = 0.5 → A=0.5; t1 δ = 0.5·0.5 − 0.5 = −0.25 → A = −0.25 + 0.25·0.5 = −0.125;
        //   t0 δ = −0.25 → A = −0.25 + 0.25·(−0.125) = −0.28125.
        // Row 1: t2 masked → A stays 0, next value stays 0; t1 δ = 2 − 1 = 1 → A = 1;
        //   t0 δ = 0.5·1 − 1 = −0.5 → A = −0.5 + 0.25·1 = −0.25.
        // Returns = A + V (the masked t2 keeps its value 9).
        close(returns.data(), &[0.21875, 0.375, 1.0, 0.75, 2.0, 9.0]);
        // Whitening over the 5 masked A's: mean 0.84375/5 = 0.16875, Σd² = 1.26484375,
        // unbiased var = 1.26484375/4 = 0.3162109375.
        let std = 0.316_210_94f32.sqrt();
        let raw = [-0.28125, -0.125, 0.5, -0.25, 1.0, 0.0];
        let expected: Vec<f32> = raw.iter().map(|a| (a - 0.16875) / std).collect();
        close(adv.data(), &expected);
    }

    #[test]
    fn gae_without_values_or_enough_tokens_is_an_error() {
        let rewards = m(&[&[1.0, 0.0]]);
        let mask = m(&[&[1.0, 0.0]]);
        let input = AdvantageInput::new(&rewards, &mask, &[0]);
        assert_eq!(
            compute_advantage(AdvEstimator::Gae, &AdvantageParams::default(), &input),
            Err(AlgoError::MissingInput("gae", "values"))
        );
        let values = m(&[&[0.0, 0.0]]);
        let input = AdvantageInput {
            values: Some(&values),
            ..input
        };
        assert_eq!(
            compute_advantage(AdvEstimator::Gae, &AdvantageParams::default(), &input),
            Err(AlgoError::TooFewMasked(1))
        );
    }

    #[test]
    fn shapes_are_checked() {
        let rewards = m(&[&[1.0, 0.0]]);
        let mask = m(&[&[1.0]]);
        let input = AdvantageInput::new(&rewards, &mask, &[0]);
        assert!(matches!(
            compute_advantage(AdvEstimator::Grpo, &AdvantageParams::default(), &input),
            Err(AlgoError::Shape {
                what: "response_mask",
                ..
            })
        ));
        let input = AdvantageInput {
            response_mask: &rewards,
            index: &[],
            ..input
        };
        assert!(matches!(
            compute_advantage(AdvEstimator::Grpo, &AdvantageParams::default(), &input),
            Err(AlgoError::Length { what: "index", .. })
        ));
    }

    #[test]
    fn estimator_names_are_verls() {
        let parsed: AdvEstimator =
            serde_json::from_str("\"reinforce_plus_plus_baseline\"").unwrap();
        assert_eq!(parsed, AdvEstimator::ReinforcePlusPlusBaseline);
        assert!(AdvEstimator::Gae.needs_critic() && !AdvEstimator::Grpo.needs_critic());
        for name in [
            "grpo_vectorized",
            "gdpo",
            "grpo_passk",
            "rloo_vectorized",
            "opo",
            "gpg",
            "optimal_token_baseline",
            "tir_optimal_token_baseline",
        ] {
            let parsed: AdvEstimator = serde_json::from_str(&format!("\"{name}\"")).unwrap();
            assert_eq!(parsed.name(), name);
        }
    }

    #[test]
    fn reinforce_plus_plus_carries_returns_through_observations() {
        // verl #7300's example: an observation token (mask 0) between two turns.
        let rewards = m(&[&[0.0, 0.0, 0.0, 1.0], &[0.0, 0.0, 0.0, 2.0]]);
        let mask = m(&[&[1.0, 1.0, 0.0, 1.0], &[1.0, 1.0, 1.0, 1.0]]);
        let (adv, returns) = run(
            AdvEstimator::ReinforcePlusPlus,
            AdvantageParams::default(),
            &rewards,
            &mask,
            &[0, 1],
        );
        close(returns.data(), &[1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]);
        // Over the 7 tokens {1,1,1,2,2,2,2}: mean 11/7; the observation's advantage stays 0.
        let mean = 11.0f32 / 7.0;
        let var = (3.0 * (1.0 - mean).powi(2) + 4.0 * (2.0 - mean).powi(2)) / 6.0;
        let lo = (1.0 - mean) / var.sqrt();
        let hi = (2.0 - mean) / var.sqrt();
        close(adv.data(), &[lo, lo, 0.0, lo, hi, hi, hi, hi]);
    }

    #[test]
    fn rloo_vectorized_zeroes_lone_responses() {
        let rewards = m(&[&[1.0], &[0.0], &[0.0], &[2.0]]);
        let mask = m(&[&[1.0], &[1.0], &[1.0], &[1.0]]);
        let params = AdvantageParams::default();
        let (adv, _) = run(
            AdvEstimator::RlooVectorized,
            params,
            &rewards,
            &mask,
            &[1, 1, 1, 2],
        );
        close(adv.data(), &[1.0, -0.5, -0.5, 0.0]);
        let (grpo, _) = run(AdvEstimator::Grpo, params, &rewards, &mask, &[1, 1, 1, 2]);
        let (vectorized, _) = run(
            AdvEstimator::GrpoVectorized,
            params,
            &rewards,
            &mask,
            &[1, 1, 1, 2],
        );
        assert_eq!(grpo, vectorized);
    }

    #[test]
    fn opo_weights_the_baseline_by_length() {
        // Lengths 1 and 3, scores 4 and 0: baseline (1·4 + 3·0)/4 = 1.
        let rewards = m(&[&[4.0, 0.0, 0.0], &[0.0, 0.0, 0.0], &[5.0, 0.0, 0.0]]);
        let mask = m(&[&[1.0, 0.0, 0.0], &[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let (adv, _) = run(
            AdvEstimator::Opo,
            AdvantageParams::default(),
            &rewards,
            &mask,
            &[0, 0, 1],
        );
        close(
            adv.data(),
            &[3.0, 0.0, 0.0, -1.0, -1.0, -1.0, 5.0, 5.0, 0.0],
        );
    }

    #[test]
    fn gpg_scales_by_the_share_of_nonzero_scores() {
        // Scores 1, 0, 0, 0 in one group: mean 0.25, α = 4/1.
        let rewards = m(&[&[1.0], &[0.0], &[0.0], &[0.0]]);
        let mask = m(&[&[1.0], &[1.0], &[1.0], &[1.0]]);
        let (adv, _) = run(
            AdvEstimator::Gpg,
            AdvantageParams::default(),
            &rewards,
            &mask,
            &[0, 0, 0, 0],
        );
        close(adv.data(), &[3.0, -1.0, -1.0, -1.0]);
    }

    #[test]
    fn passk_rewards_only_the_best_and_needs_two() {
        let rewards = m(&[&[0.5], &[2.0], &[1.0]]);
        let mask = m(&[&[1.0], &[1.0], &[1.0]]);
        let dr = AdvantageParams {
            norm_adv_by_std_in_grpo: false,
            ..Default::default()
        };
        let (adv, _) = run(AdvEstimator::GrpoPassk, dr, &rewards, &mask, &[0, 0, 0]);
        close(adv.data(), &[0.0, 1.0, 0.0]);
        let input = AdvantageInput::new(&rewards, &mask, &[0, 0, 1]);
        assert_eq!(
            compute_advantage(AdvEstimator::GrpoPassk, &dr, &input),
            Err(AlgoError::GroupTooSmall {
                estimator: "grpo_passk",
                needs: 2,
                got: 1
            })
        );
    }

    #[test]
    fn gdpo_normalises_each_component_then_whitens() {
        // Two components on two responses of one group: any two distinct scores GRPO-normalise
        // to ±1/√2, so the component scales (1 and 5) do not matter, only the weights (1 and 3).
        let format = m(&[&[0.0, 1.0], &[0.0, 0.0]]);
        let accuracy = m(&[&[0.0, 0.0], &[0.0, 5.0]]);
        let mask = m(&[&[1.0, 1.0], &[1.0, 1.0]]);
        let components = [format.clone(), accuracy];
        let input = AdvantageInput {
            reward_components: Some(&components),
            reward_weights: Some(&[1.0, 3.0]),
            ..AdvantageInput::new(&format, &mask, &[0, 0])
        };
        let (adv, _) =
            compute_advantage(AdvEstimator::Gdpo, &AdvantageParams::default(), &input).unwrap();
        // Row 0: +0.7071 − 3·0.7071 < 0; row 1 the opposite; whitened ±√(3/4).
        let a = 0.75f32.sqrt();
        close(adv.data(), &[-a, -a, a, a]);
        let wrong = AdvantageInput {
            reward_weights: Some(&[1.0]),
            ..input
        };
        assert!(matches!(
            compute_advantage(AdvEstimator::Gdpo, &AdvantageParams::default(), &wrong),
            Err(AlgoError::Length {
                what: "gdpo_reward_weights",
                ..
            })
        ));
    }

    #[test]
    fn optimal_token_baseline_weights_returns_by_path_variance() {
        // π = 1 everywhere except row 1's first token (π = 0.5), Σπ² = 1: w = 1 − 2π + 1 = 0, so
        // only row 1 has path variance (w = 1 at t0, cumulative 1, 1, …).
        let rewards = m(&[&[0.0, 3.0], &[0.0, 1.0]]);
        let mask = m(&[&[1.0, 1.0], &[1.0, 1.0]]);
        let old = m(&[&[0.0, 0.0], &[0.5f32.ln(), 0.0]]);
        let spp = m(&[&[1.0, 1.0], &[1.0, 1.0]]);
        let input = AdvantageInput {
            old_log_probs: Some(&old),
            sum_pi_squared: Some(&spp),
            ..AdvantageInput::new(&rewards, &mask, &[0, 0])
        };
        for est in [
            AdvEstimator::OptimalTokenBaseline,
            AdvEstimator::TirOptimalTokenBaseline,
        ] {
            let (adv, returns) =
                compute_advantage(est, &AdvantageParams::default(), &input).unwrap();
            close(returns.data(), &[3.0, 3.0, 1.0, 1.0]);
            // B_t = (3·0 + 1·1)/(0 + 1) = 1 at both positions.
            close(adv.data(), &[2.0, 2.0, 0.0, 0.0]);
        }
        let missing = AdvantageInput::new(&rewards, &mask, &[0, 0]);
        assert_eq!(
            compute_advantage(
                AdvEstimator::OptimalTokenBaseline,
                &AdvantageParams::default(),
                &missing
            ),
            Err(AlgoError::MissingInput(
                "optimal_token_baseline",
                "old_log_probs"
            ))
        );
    }
}
