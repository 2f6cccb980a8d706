//! Per-step data metrics under verl's names (`metric_utils.compute_data_metrics`).

use std::collections::BTreeMap;

use super::advantage::{count_plus_eps, score_norm};
use super::{AlgoError, Matrix};

/// One training batch after advantages were computed; every matrix is `[batch × response_length]`.
#[derive(Debug, Clone, Copy)]
pub struct DataMetricsInput<'a> {
    pub token_level_scores: &'a Matrix,
    pub token_level_rewards: &'a Matrix,
    pub advantages: &'a Matrix,
    pub returns: &'a Matrix,
    pub response_mask: &'a Matrix,
    /// Critic values, when a critic is used (adds `critic/values/*` and `critic/vf_explained_var`).
    pub values: Option<&'a Matrix>,
    /// Prompt tokens of every row.
    pub prompt_lengths: &'a [usize],
    /// `data.max_prompt_length` (for `prompt_length/clip_ratio`).
    pub max_prompt_length: usize,
    /// `data.max_response_length` (for `response_length/clip_ratio`): the matrices are only as
    /// wide as the batch's longest response, which need not have used the whole budget.
    pub max_response_length: usize,
}

/// `critic/{score,rewards,advantages,returns}/{mean,max,min}`, `critic/values/*`,
/// `critic/vf_explained_var`, `response_length/{mean,max,min,clip_ratio}`, the same over the
/// non-empty responses as `response_length_non_aborted/*`, `response/aborted_ratio` and
/// `prompt_length/{mean,max,min,clip_ratio}`. Scores and rewards skip aborted (empty)
/// responses, as verl does; a response is clipped when it used all `response_length` tokens.
pub fn compute_data_metrics(
    input: &DataMetricsInput<'_>,
) -> Result<BTreeMap<String, f64>, AlgoError> {
    let mask = input.response_mask;
    let shape = mask.shape();
    for (what, m) in [
        ("token_level_scores", input.token_level_scores),
        ("token_level_rewards", input.token_level_rewards),
        ("advantages", input.advantages),
        ("returns", input.returns),
    ]
    .into_iter()
    .chain(input.values.map(|v| ("values", v)))
    {
        m.expect_shape(what, shape)?;
    }
    if input.prompt_lengths.len() != shape.0 {
        return Err(AlgoError::Length {
            what: "prompt_lengths",
            expected: shape.0,
            got: input.prompt_lengths.len(),
        });
    }
    let response_lengths = mask.row_sums();
    let live: Vec<usize> = (0..shape.0)
        .filter(|&i| response_lengths[i] > 0.0)
        .collect();
    if live.is_empty() {
        return Err(AlgoError::AllAborted);
    }
    let mut out = BTreeMap::new();
    let scores = input.token_level_scores.row_sums();
    let rewards = input.token_level_rewards.row_sums();
    put_stats(
        &mut out,
        "critic/score",
        &live.iter().map(|&i| scores[i]).collect::<Vec<_>>(),
    );
    put_stats(
        &mut out,
        "critic/rewards",
        &live.iter().map(|&i| rewards[i]).collect::<Vec<_>>(),
    );
    let masked = |m: &Matrix| -> Vec<f64> {
        m.data()
            .iter()
            .zip(mask.data())
            .filter(|(_, k)| **k > 0.0)
            .map(|(&v, _)| f64::from(v))
            .collect()
    };
    let returns = masked(input.returns);
    put_stats(&mut out, "critic/advantages", &masked(input.advantages));
    put_stats(&mut out, "critic/returns", &returns);
    if let Some(values) = input.values {
        let values = masked(values);
        put_stats(&mut out, "critic/values", &values);
        let residual: Vec<f64> = returns.iter().zip(&values).map(|(r, v)| r - v).collect();
        out.insert(
            "critic/vf_explained_var".into(),
            1.0 - unbiased_var(&residual) / (unbiased_var(&returns) + 1e-5),
        );
    }
    let max_response = input.max_response_length as f64;
    put_stats(&mut out, "response_length", &response_lengths);
    out.insert(
        "response_length/clip_ratio".into(),
        fraction(&response_lengths, |l| l == max_response),
    );
    let live_lengths: Vec<f64> = live.iter().map(|&i| response_lengths[i]).collect();
    put_stats(&mut out, "response_length_non_aborted", &live_lengths);
    out.insert(
        "response_length_non_aborted/clip_ratio".into(),
        fraction(&live_lengths, |l| l == max_response),
    );
    out.insert(
        "response/aborted_ratio".into(),
        fraction(&response_lengths, |l| l == 0.0),
    );
    let prompts: Vec<f64> = input.prompt_lengths.iter().map(|&l| l as f64).collect();
    put_stats(&mut out, "prompt_length", &prompts);
    out.insert(
        "prompt_length/clip_ratio".into(),
        fraction(&prompts, |l| l == input.max_prompt_length as f64),
    );
    Ok(out)
}

/// verl's `compute_timing_metrics`: `timing_s/<stage>` for every stage, and
/// `timing_per_token_ms/<stage>` for generation (per response token) and for the stages that
/// process whole sequences, `ref`, `values`, `adv`, `update_critic` and `update_actor` (per prompt
/// and response token).
pub fn timing_metrics(
    timing: &[(&str, f64)],
    prompt_tokens: usize,
    response_tokens: usize,
) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for &(stage, seconds) in timing {
        *out.entry(format!("timing_s/{stage}")).or_insert(0.0) += seconds;
    }
    for &(stage, _) in timing {
        let tokens = match stage {
            "gen" => response_tokens,
            "ref" | "values" | "adv" | "update_critic" | "update_actor" => {
                prompt_tokens + response_tokens
            }
            _ => continue,
        };
        let seconds = out[&format!("timing_s/{stage}")];
        out.insert(
            format!("timing_per_token_ms/{stage}"),
            seconds * 1000.0 / tokens as f64,
        );
    }
    out
}

/// Validation metrics from one score per response (verl's `process_validation_metrics` for the
/// `reward` variable): per data source, `mean@N` over each prompt's N responses averaged over
/// prompts, as `val-core/<source>/reward/mean@N` (N the largest group), and `std@N` (population
/// std, N > 1) as `val-aux/…`. verl's bootstrapped `best@k`/`worst@k`/`maj@k` are not computed.
pub fn validation_metrics(
    data_sources: &[String],
    uids: &[u64],
    scores: &[f64],
) -> Result<BTreeMap<String, f64>, AlgoError> {
    for (what, len) in [("uids", uids.len()), ("scores", scores.len())] {
        if len != data_sources.len() {
            return Err(AlgoError::Length {
                what,
                expected: data_sources.len(),
                got: len,
            });
        }
    }
    // source → uid → scores, in first-seen order of uids so sums are reproducible.
    let mut groups: BTreeMap<&str, Vec<(u64, Vec<f64>)>> = BTreeMap::new();
    for ((source, &uid), &score) in data_sources.iter().zip(uids).zip(scores) {
        let per_source = groups.entry(source).or_default();
        match per_source.iter_mut().find(|(u, _)| *u == uid) {
            Some((_, values)) => values.push(score),
            None => per_source.push((uid, vec![score])),
        }
    }
    let mut out = BTreeMap::new();
    for (source, prompts) in groups {
        let n_max = prompts.iter().map(|(_, v)| v.len()).max().unwrap_or(0);
        // metric name → per-prompt values.
        let mut per_metric: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for (_, values) in &prompts {
            let n = values.len();
            let mean = values.iter().sum::<f64>() / n as f64;
            per_metric
                .entry(format!("mean@{n}"))
                .or_default()
                .push(mean);
            if n > 1 {
                let std =
                    (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
                per_metric.entry(format!("std@{n}")).or_default().push(std);
            }
        }
        for (metric, values) in per_metric {
            let section = if metric == format!("mean@{n_max}") {
                "val-core"
            } else {
                "val-aux"
            };
            out.insert(
                format!("{section}/{source}/reward/{metric}"),
                values.iter().sum::<f64>() / values.len() as f64,
            );
        }
    }
    Ok(out)
}

/// verl's `calculate_debug_metrics` (`verl/utils/debug/metrics.py`), logged when the rollout
/// returned log-probs: over the response tokens of `mask`, `|exp(actor) − exp(rollout)|` (a
/// difference of probabilities, not of log-probs) as `training/rollout_probs_diff_{max,mean,std}`
/// (std Bessel-corrected, as `torch.std`), the Pearson correlation of the two probabilities as
/// `training/rollout_actor_probs_pearson_corr`, and `training/rollout_probs_diff_valid` (0, the
/// others NaN, when the mask holds no token).
pub fn rollout_probs_diff(
    rollout_log_probs: &Matrix,
    actor_log_probs: &Matrix,
    mask: &Matrix,
) -> Result<BTreeMap<String, f64>, AlgoError> {
    rollout_log_probs.expect_shape("rollout_log_probs", mask.shape())?;
    actor_log_probs.expect_shape("old_log_probs", mask.shape())?;
    let (rollout, actor): (Vec<f64>, Vec<f64>) = rollout_log_probs
        .data()
        .iter()
        .zip(actor_log_probs.data())
        .zip(mask.data())
        .filter(|&(_, &m)| m != 0.0)
        .map(|((&r, &a), _)| (f64::from(r).exp(), f64::from(a).exp()))
        .unzip();
    let key = |name: &str| format!("training/rollout_{name}");
    let mut out = BTreeMap::new();
    if rollout.is_empty() {
        out.insert(key("probs_diff_valid"), 0.0);
        for name in [
            "probs_diff_max",
            "probs_diff_mean",
            "probs_diff_std",
            "actor_probs_pearson_corr",
        ] {
            out.insert(key(name), f64::NAN);
        }
        return Ok(out);
    }
    let diff: Vec<f64> = rollout
        .iter()
        .zip(&actor)
        .map(|(r, a)| (a - r).abs())
        .collect();
    out.insert(key("probs_diff_valid"), 1.0);
    out.insert(
        key("probs_diff_max"),
        diff.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    out.insert(key("probs_diff_mean"), mean(&diff));
    out.insert(key("probs_diff_std"), unbiased_var(&diff).sqrt());
    out.insert(key("actor_probs_pearson_corr"), pearson(&actor, &rollout));
    Ok(out)
}

/// The step's batch as verl's `compute_variance_proxy_metrics` reads it, every matrix
/// `[batch × response_length]`, and the actor's gradient norm.
#[derive(Debug, Clone, Copy)]
pub struct VarianceProxyInput<'a> {
    /// The old policy's log-probs of the response tokens.
    pub old_log_probs: &'a Matrix,
    /// Σπ² over the vocabulary per token, from the actor's log-prob pass.
    pub sum_pi_squared: &'a Matrix,
    pub advantages: &'a Matrix,
    /// The mask the update trains on (rollout correction's rejections removed, as verl's batch
    /// holds it by then).
    pub response_mask: &'a Matrix,
    /// Rollout correction's IS weights, when token or sequence IS applies.
    pub rollout_is_weights: Option<&'a Matrix>,
    /// The step's `actor/grad_norm`; `None` when the actor was not updated.
    pub grad_norm: Option<f64>,
}

/// verl's `compute_variance_proxy_metrics`: with the score-norm proxy `W = Σ_t m_t·w_t`,
/// `w_t = 1 − 2π_t + Σπ²_t` (times `ρ_t²` with IS weights) and the per-response mean advantage
/// `Ā`, `variance_proxy/proxy1_signal_strength` = grad_norm² (0 without one),
/// `proxy2_total_power` = mean of `Ā²·max(W, 0)` (with IS weights: of `ρ̄²·Ā²·max(W₀, 0)`, `ρ̄`
/// the response's mean weight and `W₀ = Σ m·w_t·ρ_t²/max(ρ_t², 1e-10)`), `proxy3_pure_noise` =
/// `max(0, (proxy2 − proxy1)/(N − 1))` (0 without a grad norm or with one response),
/// `expected_a_squared` = mean of `Ā²` and `expected_w` = mean of `W` (IS-scaled, unclamped).
pub fn variance_proxy_metrics(
    input: &VarianceProxyInput<'_>,
) -> Result<BTreeMap<String, f64>, AlgoError> {
    let mask = input.response_mask;
    let shape = mask.shape();
    for (what, m) in [
        ("old_log_probs", input.old_log_probs),
        ("sum_pi_squared", input.sum_pi_squared),
        ("advantages", input.advantages),
    ]
    .into_iter()
    .chain(input.rollout_is_weights.map(|w| ("rollout_is_weights", w)))
    {
        m.expect_shape(what, shape)?;
    }
    // torch.clamp(min=0), which keeps a NaN (f64::max would not).
    let clamp = |w: f64| if w < 0.0 { 0.0 } else { w };
    let (rows, cols) = shape;
    let (mut a_squared, mut w_total, mut power) = (0.0, 0.0, 0.0);
    for i in 0..rows {
        // Masked sums of the advantages, W, W₀ and ρ; the mask's token count.
        let (mut adv, mut w, mut w_original, mut rho, mut count) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for t in (0..cols).map(|t| i * cols + t) {
            let m = f64::from(mask.data()[t]);
            if m == 0.0 {
                // verl's masked_sum zeroes masked entries before multiplying (NaNs stay out).
                continue;
            }
            count += m;
            adv += f64::from(input.advantages.data()[t]) * m;
            let w_t = score_norm(
                input.old_log_probs.data()[t],
                input.sum_pi_squared.data()[t],
            );
            match input.rollout_is_weights {
                Some(weights) => {
                    let rho_t = f64::from(weights.data()[t]);
                    let scaled = w_t * rho_t * rho_t;
                    w += scaled * m;
                    w_original += scaled / (rho_t * rho_t).max(1e-10) * m;
                    rho += rho_t * m;
                }
                None => w += w_t * m,
            }
        }
        let adv = adv / count_plus_eps(count);
        a_squared += adv * adv;
        w_total += w;
        power += match input.rollout_is_weights {
            Some(_) => (rho / count_plus_eps(count)).powi(2) * adv * adv * clamp(w_original),
            None => adv * adv * clamp(w),
        };
    }
    let n = rows as f64;
    let proxy2 = power / n;
    let proxy1 = input.grad_norm.map(|g| g * g);
    let proxy3 = match proxy1 {
        // Python's max(0.0, x): 0 unless x > 0 (a NaN too).
        Some(p1) if rows > 1 => {
            let noise = (1.0 / (n - 1.0)) * (proxy2 - p1);
            if noise > 0.0 { noise } else { 0.0 }
        }
        _ => 0.0,
    };
    let key = |name: &str| format!("variance_proxy/{name}");
    Ok(BTreeMap::from([
        (key("proxy1_signal_strength"), proxy1.unwrap_or(0.0)),
        (key("proxy2_total_power"), proxy2),
        (key("proxy3_pure_noise"), proxy3),
        (key("expected_a_squared"), a_squared / n),
        (key("expected_w"), w_total / n),
    ]))
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

/// `torch.corrcoef`'s off-diagonal entry: NaN when either side is constant.
fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let (mx, my) = (mean(x), mean(y));
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in x.iter().zip(y) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx).powi(2);
        syy += (b - my).powi(2);
    }
    sxy / (sxx * syy).sqrt()
}

fn put_stats(out: &mut BTreeMap<String, f64>, prefix: &str, values: &[f64]) {
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    out.insert(format!("{prefix}/mean"), mean);
    out.insert(format!("{prefix}/max"), max);
    out.insert(format!("{prefix}/min"), min);
}

fn fraction(values: &[f64], pred: impl Fn(f64) -> bool) -> f64 {
    values.iter().filter(|&&v| pred(v)).count() as f64 / values.len() as f64
}

/// torch.var's default (Bessel-corrected); NaN below two values, as torch gives.
fn unbiased_var(values: &[f64]) -> f64 {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_have_verls_names_and_values() {
        let m = |rows: &[&[f32]]| Matrix::from_rows(rows).unwrap();
        let mask = m(&[&[1.0, 1.0, 1.0], &[1.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
        let scores = m(&[&[0.0, 0.0, 1.0], &[0.0, 0.0, 0.0], &[0.0, 0.0, 9.0]]);
        let rewards = m(&[&[0.0, -0.5, 1.0], &[0.0, 0.0, 0.0], &[0.0, 0.0, 9.0]]);
        let adv = m(&[&[1.0, 2.0, 3.0], &[-4.0, 7.0, 7.0], &[7.0, 7.0, 7.0]]);
        let returns = m(&[&[2.0, 2.0, 2.0], &[0.0, 7.0, 7.0], &[7.0, 7.0, 7.0]]);
        let values = m(&[&[1.0, 2.0, 3.0], &[0.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
        let input = DataMetricsInput {
            token_level_scores: &scores,
            token_level_rewards: &rewards,
            advantages: &adv,
            returns: &returns,
            response_mask: &mask,
            values: Some(&values),
            prompt_lengths: &[4, 2, 4],
            max_prompt_length: 4,
            max_response_length: 3,
        };
        let out = compute_data_metrics(&input).unwrap();
        // Row 2 is aborted (no tokens): scores over rows 0, 1 = {1, 0}; rewards {0.5, 0}.
        assert_eq!(out["critic/score/mean"], 0.5);
        assert_eq!(out["critic/score/max"], 1.0);
        assert_eq!(out["critic/rewards/min"], 0.0);
        assert_eq!(out["critic/rewards/max"], 0.5);
        // Masked advantages {1, 2, 3, −4}: mean 0.5.
        assert_eq!(out["critic/advantages/mean"], 0.5);
        assert_eq!(out["critic/advantages/min"], -4.0);
        assert_eq!(out["critic/returns/mean"], 1.5);
        // returns {2,2,2,0} − values {1,2,3,0} = {1,0,−1,0}: var 2/3; var(returns) = 1 → 1 − (2/3)/(1+1e-5).
        assert!((out["critic/vf_explained_var"] - (1.0 - (2.0 / 3.0) / (1.0 + 1e-5))).abs() < 1e-9);
        // Lengths {3, 1, 0}: one of three is full length 3, one is aborted.
        assert_eq!(out["response_length/mean"], 4.0 / 3.0);
        assert_eq!(out["response_length/clip_ratio"], 1.0 / 3.0);
        // Clipped means the whole `max_response_length`, not the batch's longest response.
        let wider = DataMetricsInput {
            max_response_length: 4,
            ..input
        };
        assert_eq!(
            compute_data_metrics(&wider).unwrap()["response_length/clip_ratio"],
            0.0
        );
        assert_eq!(out["response/aborted_ratio"], 1.0 / 3.0);
        // Without the aborted row: lengths {3, 1}.
        assert_eq!(out["response_length_non_aborted/mean"], 2.0);
        assert_eq!(out["response_length_non_aborted/min"], 1.0);
        assert_eq!(out["response_length_non_aborted/clip_ratio"], 0.5);
        assert_eq!(out["prompt_length/clip_ratio"], 2.0 / 3.0);
        assert_eq!(out["prompt_length/min"], 2.0);
        assert!(out.values().all(|v| v.is_finite()));
    }

    #[test]
    fn timing_per_token_divides_as_verl() {
        let out = timing_metrics(
            &[
                ("gen", 2.0),
                ("old_log_prob", 1.0),
                ("update_actor", 3.0),
                ("step", 6.0),
            ],
            100,
            400,
        );
        assert_eq!(out["timing_s/gen"], 2.0);
        assert_eq!(out["timing_s/step"], 6.0);
        // Generation per response token, the update per prompt and response token.
        assert_eq!(out["timing_per_token_ms/gen"], 5.0);
        assert_eq!(out["timing_per_token_ms/update_actor"], 6.0);
        assert!(!out.contains_key("timing_per_token_ms/old_log_prob"));
        assert!(!out.contains_key("timing_per_token_ms/step"));
    }

    #[test]
    fn validation_metrics_average_per_prompt() {
        let sources: Vec<String> = ["a", "a", "a", "a", "b"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        // Source a: prompt 1 scores {1, 0} (mean 0.5, std 0.5), prompt 2 {1, 1} (mean 1, std 0).
        let out =
            validation_metrics(&sources, &[1, 1, 2, 2, 3], &[1.0, 0.0, 1.0, 1.0, 0.25]).unwrap();
        assert_eq!(out["val-core/a/reward/mean@2"], 0.75);
        assert_eq!(out["val-aux/a/reward/std@2"], 0.25);
        assert_eq!(out["val-core/b/reward/mean@1"], 0.25);
        assert_eq!(out.len(), 3);
        assert!(validation_metrics(&sources, &[1], &[]).is_err());
    }

    #[test]
    fn rollout_probs_diff_compares_probabilities_over_response_tokens() {
        let m = |rows: &[&[f32]]| Matrix::from_rows(rows).unwrap();
        let ln = |p: f32| p.ln();
        // Response tokens: row 0 has 2, row 1 has 1; the padded cells differ wildly and must
        // not count.
        let mask = m(&[&[1.0, 1.0], &[1.0, 0.0]]);
        let rollout = m(&[&[ln(0.5), ln(0.25)], &[ln(0.9), -30.0]]);
        let actor = m(&[&[ln(0.6), ln(0.25)], &[ln(0.6), 0.0]]);
        let out = rollout_probs_diff(&rollout, &actor, &mask).unwrap();
        // |Δp| = 0.1, 0, 0.3: max 0.3, mean 0.4/3, unbiased std sqrt(Σ(d−mean)²/2).
        let d = [0.1, 0.0, 0.3];
        let mean = 0.4 / 3.0;
        let std = (d.iter().map(|v: &f64| (v - mean).powi(2)).sum::<f64>() / 2.0).sqrt();
        let close = |name: &str, want: f64| {
            let got = out[&format!("training/rollout_{name}")];
            assert!((got - want).abs() < 1e-6, "{name}: {got} vs {want}");
        };
        close("probs_diff_valid", 1.0);
        close("probs_diff_max", 0.3);
        close("probs_diff_mean", mean);
        close("probs_diff_std", std);
        // Actor 0.6, 0.25, 0.6 against rollout 0.5, 0.25, 0.9: means 29/60 and 33/60.
        let (x, y) = ([0.6, 0.25, 0.6], [0.5, 0.25, 0.9]);
        let (mx, my) = (1.45 / 3.0, 1.65 / 3.0);
        let sxy: f64 = (0..3).map(|i| (x[i] - mx) * (y[i] - my)).sum();
        let sxx: f64 = x.iter().map(|v| (v - mx).powi(2)).sum();
        let syy: f64 = y.iter().map(|v| (v - my).powi(2)).sum();
        close("actor_probs_pearson_corr", sxy / (sxx * syy).sqrt());
        assert_eq!(out.len(), 5);

        // Equal log-probs: no difference at all.
        let same = rollout_probs_diff(&actor, &actor, &mask).unwrap();
        assert_eq!(same["training/rollout_probs_diff_max"], 0.0);

        // No response token: not valid, values NaN (verl's defaults).
        let none = rollout_probs_diff(&rollout, &actor, &Matrix::zeros(2, 2)).unwrap();
        assert_eq!(none["training/rollout_probs_diff_valid"], 0.0);
        assert!(none["training/rollout_probs_diff_mean"].is_nan());

        assert!(rollout_probs_diff(&Matrix::zeros(1, 2), &actor, &mask).is_err());
    }

    #[test]
    fn variance_proxies_follow_verls_formulas() {
        let m = |rows: &[&[f32]]| Matrix::from_rows(rows).unwrap();
        // π = ½ and Σπ² = ½ everywhere: w = 1 − 1 + ½ = ½ per token, so W = ½·(tokens).
        let full = |v: f32| Matrix::new(3, 3, vec![v; 9]).unwrap();
        let half = full(0.5f32.ln());
        let spp = full(0.5);
        // Rows of 2, 1 and 0 tokens (an aborted response); masked entries must not count.
        let mask = m(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
        let adv = m(&[&[1.0, 3.0, 99.0], &[-1.0, 99.0, 99.0], &[99.0, 99.0, 99.0]]);
        let input = VarianceProxyInput {
            old_log_probs: &half,
            sum_pi_squared: &spp,
            advantages: &adv,
            response_mask: &mask,
            rollout_is_weights: None,
            grad_norm: Some(1.0),
        };
        let get = |input: &VarianceProxyInput<'_>| {
            let out = variance_proxy_metrics(input).unwrap();
            assert_eq!(out.len(), 5);
            let v = |name: &str| out[&format!("variance_proxy/{name}")];
            [
                v("proxy1_signal_strength"),
                v("proxy2_total_power"),
                v("proxy3_pure_noise"),
                v("expected_a_squared"),
                v("expected_w"),
            ]
        };
        let near = |got: [f64; 5], want: [f64; 5]| {
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
            }
        };
        // Ā = 2, −1, 0; W = 1, ½, 0: proxy2 = (4·1 + 1·½)/3 = 1.5, proxy3 = (1.5 − 1)/2.
        near(get(&input), [1.0, 1.5, 0.25, 5.0 / 3.0, 0.5]);
        // A signal above the total power: the noise is clamped to 0.
        near(
            get(&VarianceProxyInput {
                grad_norm: Some(2.0),
                ..input
            }),
            [4.0, 1.5, 0.0, 5.0 / 3.0, 0.5],
        );
        // Without a grad norm proxy1 and proxy3 are 0; one response has no noise estimate.
        near(
            get(&VarianceProxyInput {
                grad_norm: None,
                ..input
            }),
            [0.0, 1.5, 0.0, 5.0 / 3.0, 0.5],
        );
        let one = |rows: &Matrix| Matrix::new(1, 3, rows.row(0).to_vec()).unwrap();
        let (half1, spp1, mask1, adv1) = (one(&half), one(&spp), one(&mask), one(&adv));
        near(
            get(&VarianceProxyInput {
                old_log_probs: &half1,
                sum_pi_squared: &spp1,
                advantages: &adv1,
                response_mask: &mask1,
                rollout_is_weights: None,
                grad_norm: Some(1.0),
            }),
            [1.0, 4.0, 0.0, 4.0, 1.0],
        );

        // IS weights 2 on row 0, 0 on row 1: W·ρ² = 4 and 0 (expected_w = 4/3); the power
        // takes ρ̄²·Ā²·W₀ with W₀ the unweighted W (row 1's ρ² = 0 is clamped to 1e-10 and
        // its ρ̄ is 0): 4·4·1/3.
        let rho = m(&[&[2.0, 2.0, 7.0], &[0.0, 7.0, 7.0], &[7.0, 7.0, 7.0]]);
        near(
            get(&VarianceProxyInput {
                rollout_is_weights: Some(&rho),
                ..input
            }),
            [
                1.0,
                16.0 / 3.0,
                (16.0 / 3.0 - 1.0) / 2.0,
                5.0 / 3.0,
                4.0 / 3.0,
            ],
        );

        // Σπ² below π² (inconsistent, but verl takes it): π = 0.9, Σπ² = 0 gives w = −0.8.
        // The power clamps W at 0; expected_w keeps it.
        let sure = full(0.9f32.ln());
        let zero = Matrix::zeros(3, 3);
        near(
            get(&VarianceProxyInput {
                old_log_probs: &sure,
                sum_pi_squared: &zero,
                ..input
            }),
            [1.0, 0.0, 0.0, 5.0 / 3.0, -0.8],
        );

        let wrong = Matrix::zeros(3, 2);
        assert_eq!(
            variance_proxy_metrics(&VarianceProxyInput {
                sum_pi_squared: &wrong,
                ..input
            }),
            Err(AlgoError::Shape {
                what: "sum_pi_squared",
                expected: (3, 3),
                got: (3, 2)
            })
        );
    }

    #[test]
    fn all_aborted_is_an_error() {
        let zero = Matrix::zeros(1, 2);
        let input = DataMetricsInput {
            token_level_scores: &zero,
            token_level_rewards: &zero,
            advantages: &zero,
            returns: &zero,
            response_mask: &zero,
            values: None,
            prompt_lengths: &[1],
            max_prompt_length: 4,
            max_response_length: 2,
        };
        assert_eq!(compute_data_metrics(&input), Err(AlgoError::AllAborted));
    }
}
