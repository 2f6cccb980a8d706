//! Advantage estimators (verl `core_algos.compute_*_advantage*`). Statistics are accumulated in f64
//! and the results stored as f32; verl computes in the tensors' f32, so values can differ in the
//! last ulp.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::{AlgoError, Matrix};

/// `algorithm.adv_estimator`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvEstimator {
    Gae,
    Grpo,
    Rloo,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    Remax,
}

impl AdvEstimator {
    /// Only GAE bootstraps from a value function; the others are critic-free.
    pub fn needs_critic(self) -> bool {
        self == Self::Gae
    }

    /// ReMax needs the reward of one extra greedy rollout per prompt as its baseline.
    pub fn needs_greedy_baseline(self) -> bool {
        self == Self::Remax
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

/// One batch, `[batch × response_length]`.
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
        AdvEstimator::Grpo => {
            let eps = f64::from(params.epsilon);
            let adv = group_outcome(input, |score, g| {
                if params.norm_adv_by_std_in_grpo {
                    (score - g.mean) / (g.std + eps)
                } else {
                    score - g.mean
                }
            });
            Ok((adv.clone(), adv))
        }
        AdvEstimator::Rloo => {
            // Leave-one-out baseline: R - mean(others) = n/(n-1)·(R - mean_g).
            let adv = group_outcome(input, |score, g| {
                if g.n > 1 {
                    let n = g.n as f64;
                    score * n / (n - 1.0) - g.mean * n / (n - 1.0)
                } else {
                    score
                }
            });
            Ok((adv.clone(), adv))
        }
        AdvEstimator::ReinforcePlusPlusBaseline => {
            let centred = group_outcome(input, |score, g| score - g.mean);
            let adv = mask_out(
                masked_whiten(&centred, input.response_mask)?,
                input.response_mask,
            );
            Ok((adv.clone(), adv))
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
    }
}

/// Mean of `values` where `mask` is set: `Σ v·m / (Σ m + 1e-8)` (verl's `masked_mean`).
pub fn masked_mean(values: &Matrix, mask: &Matrix) -> Result<f64, AlgoError> {
    mask.expect_shape("mask", values.shape())?;
    let (sum, count) = masked_sum(values, mask, |v| v);
    Ok(sum / (count + 1e-8))
}

/// `(v − mean) / sqrt(var + 1e-8)` with the mean and the unbiased variance taken over the mask,
/// applied to every entry (masked-out entries too, as verl's `masked_whiten` does).
pub fn masked_whiten(values: &Matrix, mask: &Matrix) -> Result<Matrix, AlgoError> {
    let mean = masked_mean(values, mask)?;
    let (squares, count) = masked_sum(values, mask, |v| (v - mean).powi(2));
    if count < 2.0 {
        return Err(AlgoError::TooFewMasked(count as usize));
    }
    let var = squares / (count + 1e-8) * count / (count - 1.0);
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

/// Size, mean and unbiased std of one group's sequence scores. A group of one has mean 0 and
/// std 1 so its score passes through (verl's convention).
struct GroupStats {
    n: usize,
    mean: f64,
    std: f64,
}

/// Per-row sequence score (sum of token rewards) turned into an advantage by `f` from its group's
/// statistics, then broadcast over the row's response tokens.
fn group_outcome(input: &AdvantageInput<'_>, f: impl Fn(f64, &GroupStats) -> f64) -> Matrix {
    let scores = input.token_level_rewards.row_sums();
    let mut groups: HashMap<u64, Vec<f64>> = HashMap::new();
    for (&id, &score) in input.index.iter().zip(&scores) {
        groups.entry(id).or_default().push(score);
    }
    let stats: HashMap<u64, GroupStats> = groups
        .into_iter()
        .map(|(id, members)| {
            let n = members.len();
            let stats = if n == 1 {
                GroupStats {
                    n,
                    mean: 0.0,
                    std: 1.0,
                }
            } else {
                let mean = members.iter().sum::<f64>() / n as f64;
                let var =
                    members.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (n as f64 - 1.0);
                GroupStats {
                    n,
                    mean,
                    std: var.sqrt(),
                }
            };
            (id, stats)
        })
        .collect();
    let mask = input.response_mask;
    let mut out = Matrix::zeros(mask.rows(), mask.cols());
    for (i, (&id, &score)) in input.index.iter().zip(&scores).enumerate() {
        let adv = f(score, &stats[&id]) as f32;
        for (o, &m) in out.row_mut(i).iter_mut().zip(mask.row(i)) {
            *o = adv * m;
        }
    }
    out
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

/// REINFORCE++ returns: `G_t = r_t + γ·G_{t+1}`, restarted after the last response token.
fn discounted_returns(rewards: &Matrix, mask: &Matrix, gamma: f32) -> Matrix {
    let mut returns = Matrix::zeros(rewards.rows(), rewards.cols());
    for i in 0..rewards.rows() {
        let (r, m) = (rewards.row(i), mask.row(i));
        let out = returns.row_mut(i);
        let mut running = 0.0f32;
        for t in (0..r.len()).rev() {
            running = r[t] + gamma * running;
            out[t] = running;
            running *= m[t];
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
    let mut returns = Matrix::zeros(rewards.rows(), rewards.cols());
    let mut adv = Matrix::zeros(rewards.rows(), rewards.cols());
    for (i, &baseline) in baselines.iter().enumerate() {
        let (r, m) = (rewards.row(i), mask.row(i));
        let mut to_go = 0.0f32;
        for t in (0..r.len()).rev() {
            to_go += r[t] * m[t];
            returns.row_mut(i)[t] = to_go;
            adv.row_mut(i)[t] = to_go - baseline * m[t];
        }
    }
    Ok((adv, returns))
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
        let input = AdvantageInput {
            token_level_rewards: rewards,
            response_mask: mask,
            index,
            values: None,
            reward_baselines: None,
        };
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
        // Row 0: G = [0.25, 0.5, 1]. Row 1: G_2 = 5 then reset (mask 0), G_1 = 0 (reset again), G_0 = 1.
        close(returns.data(), &[0.25, 0.5, 1.0, 1.0, 0.0, 5.0]);
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
            token_level_rewards: &rewards,
            response_mask: &mask,
            index: &[0, 1],
            values: None,
            reward_baselines: Some(&baselines),
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
            token_level_rewards: &rewards,
            response_mask: &mask,
            index: &[0, 1],
            values: Some(&values),
            reward_baselines: None,
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
        let input = AdvantageInput {
            token_level_rewards: &rewards,
            response_mask: &mask,
            index: &[0],
            values: None,
            reward_baselines: None,
        };
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
        let input = AdvantageInput {
            token_level_rewards: &rewards,
            response_mask: &mask,
            index: &[0],
            values: None,
            reward_baselines: None,
        };
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
    }
}
