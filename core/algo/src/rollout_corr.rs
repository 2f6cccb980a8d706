//! Rollout correction (`algorithm.rollout_correction.*`), as verl's `rollout_corr_helper.py`:
//! truncated importance-sampling weights `π_train / π_rollout` per token or per sequence, rejection
//! sampling by divergence estimators (the rejected tokens leave the response mask), and the
//! off-policy diagnostics (KL, perplexities, χ²), all logged under `rollout_corr/`.
//!
//! Elementwise work is done in f32 as verl's tensors are; sums and means accumulate in f64.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{AlgoError, Matrix};

/// verl's bound on a log-ratio before `exp` (exp(20) ≈ 4.9e8).
const SAFETY_BOUND: f32 = 20.0;

/// `rollout_is`: the level importance weights are taken at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IsLevel {
    /// `ρ_t = π_train(y_t) / π_rollout(y_t)`, one weight per token.
    Token,
    /// `∏_t ρ_t`, one weight per sequence.
    Sequence,
}

/// Which divergence estimator a rejection criterion reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Estimator {
    /// `−log ρ`, bounded below and above (in log space).
    K1,
    /// `½ (log ρ)²`.
    K2,
    /// `ρ − 1 − log ρ`.
    K3,
}

/// How token divergences are aggregated for a criterion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Aggregate {
    Token,
    SeqSum,
    SeqMean,
    SeqMax,
}

/// One `rollout_rs` option with its thresholds.
#[derive(Debug, Clone, PartialEq)]
pub struct RsCriterion {
    /// verl's option name (`token_k1`, `seq_mean_k3`, …).
    name: String,
    aggregate: Aggregate,
    estimator: Estimator,
    /// K1 only: the lower bound on the ratio.
    lower: Option<f64>,
    upper: f64,
}

/// The settings of a rollout correction, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutCorrection {
    pub rollout_is: Option<IsLevel>,
    pub rollout_is_threshold: f64,
    pub rollout_is_batch_normalize: bool,
    pub rollout_rs: Vec<RsCriterion>,
}

/// Positive (NaN is not).
fn positive(x: f64) -> bool {
    x > 0.0
}

fn invalid(key: &str, reason: impl std::fmt::Display) -> AlgoError {
    AlgoError::RolloutCorrection(format!("algorithm.rollout_correction.{key}: {reason}"))
}

impl RolloutCorrection {
    /// Checks the settings as verl does: `rollout_rs` is a comma-separated list of options,
    /// `rollout_rs_threshold` one threshold for all of them or one per option (`lower_upper` for
    /// the K1 options, whose lower bound is otherwise `1/upper`).
    pub fn new(
        rollout_is: Option<IsLevel>,
        rollout_is_threshold: f64,
        rollout_is_batch_normalize: bool,
        rollout_rs: Option<&str>,
        rollout_rs_threshold: Option<&str>,
    ) -> Result<Self, AlgoError> {
        if rollout_is.is_some() && !positive(rollout_is_threshold) {
            return Err(invalid(
                "rollout_is_threshold",
                format!("must be positive, got {rollout_is_threshold}"),
            ));
        }
        let rollout_rs = match rollout_rs {
            None => Vec::new(),
            Some(options) => parse_rs(options, rollout_rs_threshold)?,
        };
        Ok(Self {
            rollout_is,
            rollout_is_threshold,
            rollout_is_batch_normalize,
            rollout_rs,
        })
    }

    /// Whether it changes training (weights or mask), beyond logging diagnostics.
    pub fn corrects(&self) -> bool {
        self.rollout_is.is_some() || !self.rollout_rs.is_empty()
    }
}

const RS_OPTIONS: [&str; 11] = [
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
];

fn parse_rs(options: &str, thresholds: Option<&str>) -> Result<Vec<RsCriterion>, AlgoError> {
    let mut names: Vec<&str> = Vec::new();
    for option in options.split(',').map(str::trim).filter(|o| !o.is_empty()) {
        if !RS_OPTIONS.contains(&option) {
            return Err(invalid(
                "rollout_rs",
                format!(
                    "unknown option `{option}` (one of {})",
                    RS_OPTIONS.join(", ")
                ),
            ));
        }
        if !names.contains(&option) {
            names.push(option);
        }
    }
    if names.is_empty() {
        return Err(invalid("rollout_rs", "must name at least one option"));
    }
    let Some(thresholds) = thresholds else {
        return Err(invalid(
            "rollout_rs_threshold",
            "must be given when rollout_rs is set",
        ));
    };
    let mut specs: Vec<&str> = thresholds
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if specs.is_empty() {
        return Err(invalid("rollout_rs_threshold", "holds no threshold"));
    }
    if specs.len() == 1 {
        specs = vec![specs[0]; names.len()];
    } else if specs.len() != names.len() {
        return Err(invalid(
            "rollout_rs_threshold",
            format!(
                "has {} thresholds for {} rollout_rs options; give one for all or one per option",
                specs.len(),
                names.len()
            ),
        ));
    }
    let number = |spec: &str, option: &str| -> Result<f64, AlgoError> {
        spec.parse::<f64>().map_err(|_| {
            invalid(
                "rollout_rs_threshold",
                format!("`{spec}` (for {option}) is not a number"),
            )
        })
    };
    names
        .into_iter()
        .zip(specs)
        .map(|(name, spec)| {
            let (aggregate, rest) = if let Some(rest) = name.strip_prefix("token_") {
                (Aggregate::Token, rest)
            } else if let Some(rest) = name.strip_prefix("seq_sum_") {
                (Aggregate::SeqSum, rest)
            } else if let Some(rest) = name.strip_prefix("seq_mean_") {
                (Aggregate::SeqMean, rest)
            } else {
                (Aggregate::SeqMax, &name["seq_max_".len()..])
            };
            let estimator = match rest {
                "k1" => Estimator::K1,
                "k2" => Estimator::K2,
                _ => Estimator::K3,
            };
            let (lower, upper) = if estimator == Estimator::K1 {
                let (lower, upper) = match spec.split_once('_') {
                    Some((l, u)) => (number(l, name)?, number(u, name)?),
                    None => {
                        let upper = number(spec, name)?;
                        (1.0 / upper, upper)
                    }
                };
                if !(positive(lower) && positive(upper)) {
                    return Err(invalid(
                        "rollout_rs_threshold",
                        format!("the bounds for {name} must be positive, got `{spec}`"),
                    ));
                }
                (Some(lower), upper)
            } else {
                if spec.contains('_') {
                    return Err(invalid(
                        "rollout_rs_threshold",
                        format!("{name} takes a single upper bound, got `{spec}`"),
                    ));
                }
                let upper = number(spec, name)?;
                if !positive(upper) {
                    return Err(invalid(
                        "rollout_rs_threshold",
                        format!("the bound for {name} must be positive, got `{spec}`"),
                    ));
                }
                (None, upper)
            };
            Ok(RsCriterion {
                name: name.to_owned(),
                aggregate,
                estimator,
                lower,
                upper,
            })
        })
        .collect()
}

/// What a rollout correction gives the update.
#[derive(Debug, Clone, PartialEq)]
pub struct Correction {
    /// `rollout_is_weights`, truncated (and batch-normalised when asked), zero on padding; `None`
    /// without `rollout_is`.
    pub is_weights: Option<Matrix>,
    /// The response mask with the rejected tokens removed.
    pub response_mask: Matrix,
    /// Every metric, with verl's `rollout_corr/` prefix.
    pub metrics: BTreeMap<String, f64>,
}

/// A masked mean as verl's `masked_mean`: `Σ v·m / (Σ m + 1e-8)`, the `+ 1e-8` in f32 as
/// verl's (where it vanishes next to a count of one or more).
fn mean_of(values: impl Iterator<Item = (f64, f32)>) -> f64 {
    let (sum, count) = values
        .filter(|&(_, m)| m != 0.0)
        .fold((0.0, 0.0), |(s, c), (v, m)| {
            (s + v * f64::from(m), c + f64::from(m))
        });
    sum / f64::from(count as f32 + 1e-8)
}

/// verl's clamped standard deviation of a statistic: `sqrt(max(E[c²] − E[c]², 0))` over the
/// valid tokens of `c = clamp(values, lo, hi)`, 0 with fewer than two tokens. Squares are taken
/// in f64, so equal values give 0 exactly, as verl's f32 does.
fn clamped_std(values: &[f32], lo: f64, hi: f64, mask: &[f32]) -> f64 {
    let count: f64 = mask.iter().map(|&m| f64::from(m)).sum();
    if count <= 1.0 {
        return 0.0;
    }
    let clamped: Vec<f64> = values
        .iter()
        .map(|&v| f64::from(clamp(f64::from(v), lo, hi) as f32))
        .collect();
    let mean = mean_of(clamped.iter().copied().zip(mask.iter().copied()));
    let squares = mean_of(clamped.iter().map(|c| c * c).zip(mask.iter().copied()));
    (squares - mean * mean).max(0.0).sqrt()
}

/// Masked mean over the whole matrix.
fn masked_mean(values: &[f32], mask: &[f32]) -> f64 {
    mean_of(
        values
            .iter()
            .map(|&v| f64::from(v))
            .zip(mask.iter().copied()),
    )
}

fn plain_mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

/// torch's `std()` (unbiased), or 0 for fewer than two values, as verl guards it.
fn unbiased_std(values: &[f64]) -> f64 {
    if values.len() < 2 {
        return 0.0;
    }
    let mean = plain_mean(values);
    let ss: f64 = values.iter().map(|v| (v - mean).powi(2)).sum();
    (ss / (values.len() as f64 - 1.0)).sqrt()
}

fn max_of(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(f64::NEG_INFINITY, f64::max)
}

fn min_of(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(f64::INFINITY, f64::min)
}

/// torch's `clamp(min, max)`: `min(max(x, lo), hi)`, so `hi` wins when the bounds cross.
fn clamp(x: f64, lo: f64, hi: f64) -> f64 {
    x.max(lo).min(hi)
}

/// The per-row view of matrices shaped `[rows × cols]`.
struct Rows<'a> {
    cols: usize,
    mask: &'a [f32],
}

impl Rows<'_> {
    fn count(&self) -> usize {
        self.mask.len() / self.cols.max(1)
    }

    fn mask(&self, i: usize) -> &[f32] {
        &self.mask[i * self.cols..(i + 1) * self.cols]
    }

    fn sums(&self, values: &[f32]) -> Vec<f64> {
        (0..self.count())
            .map(|i| {
                let row = &values[i * self.cols..(i + 1) * self.cols];
                row.iter()
                    .zip(self.mask(i))
                    .filter(|&(_, &m)| m != 0.0)
                    .map(|(&v, &m)| f64::from(v) * f64::from(m))
                    .sum()
            })
            .collect()
    }

    fn means(&self, values: &[f32]) -> Vec<f64> {
        (0..self.count())
            .map(|i| {
                let row = &values[i * self.cols..(i + 1) * self.cols];
                mean_of(
                    row.iter()
                        .map(|&v| f64::from(v))
                        .zip(self.mask(i).iter().copied()),
                )
            })
            .collect()
    }

    fn valid(&self, i: usize) -> bool {
        self.mask(i).iter().map(|&m| f64::from(m)).sum::<f64>() > 0.0
    }
}

/// verl's `compute_rollout_correction_and_rejection_mask`: `old_log_probs` are the training
/// policy's (π_old, recomputed by the actor), `rollout_log_probs` the rollout's.
pub fn rollout_correction(
    old_log_probs: &Matrix,
    rollout_log_probs: &Matrix,
    response_mask: &Matrix,
    settings: &RolloutCorrection,
) -> Result<Correction, AlgoError> {
    rollout_log_probs.expect_shape("rollout_log_probs", old_log_probs.shape())?;
    response_mask.expect_shape("response_mask", old_log_probs.shape())?;
    let mask = response_mask.data();
    if !mask.iter().any(|&m| m != 0.0) {
        return Err(AlgoError::RolloutCorrection(
            "the response mask has no valid token".to_owned(),
        ));
    }
    let log_ratio: Vec<f32> = old_log_probs
        .data()
        .iter()
        .zip(rollout_log_probs.data())
        .map(|(&o, &r)| o - r)
        .collect();
    let rows = Rows {
        cols: old_log_probs.cols(),
        mask,
    };
    let mut metrics = BTreeMap::new();
    let is_weights = settings
        .rollout_is
        .map(|level| {
            is_weights(
                &log_ratio,
                &rows,
                level,
                settings.rollout_is_threshold,
                settings.rollout_is_batch_normalize,
                &mut metrics,
            )
        })
        .map(|w| Matrix::new(old_log_probs.rows(), old_log_probs.cols(), w))
        .transpose()?;
    let mut new_mask = mask.to_vec();
    if !settings.rollout_rs.is_empty() {
        new_mask = rejection_mask(&log_ratio, &rows, &settings.rollout_rs, &mut metrics);
    }
    offpolicy_metrics(
        old_log_probs.data(),
        rollout_log_probs.data(),
        &log_ratio,
        &rows,
        &mut metrics,
    );
    Ok(Correction {
        is_weights,
        response_mask: Matrix::new(old_log_probs.rows(), old_log_probs.cols(), new_mask)?,
        metrics: metrics
            .into_iter()
            .map(|(k, v)| (format!("rollout_corr/{k}"), v))
            .collect(),
    })
}

/// verl's `compute_rollout_correction_weights` and `compute_is_metrics`.
fn is_weights(
    log_ratio: &[f32],
    rows: &Rows<'_>,
    level: IsLevel,
    threshold: f64,
    batch_normalize: bool,
    metrics: &mut BTreeMap<String, f64>,
) -> Vec<f32> {
    let mask = rows.mask;
    let cols = rows.cols;
    let mut put = |k: &str, v: f64| {
        metrics.insert(k.to_owned(), v);
    };
    let lower = 1.0 / threshold;
    let mut weights: Vec<f32> = match level {
        IsLevel::Token => log_ratio
            .iter()
            .map(|&l| l.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp())
            .collect(),
        IsLevel::Sequence => {
            let sums = rows.sums(log_ratio);
            (0..log_ratio.len())
                .map(|j| {
                    (sums[j / cols.max(1)] as f32)
                        .clamp(-SAFETY_BOUND, SAFETY_BOUND)
                        .exp()
                })
                .collect()
        }
    };
    for (w, &m) in weights.iter_mut().zip(mask) {
        *w *= m;
    }
    let valid = || weights.iter().zip(mask).filter(|&(_, &m)| m != 0.0);
    put("rollout_is_mean", masked_mean(&weights, mask));
    match level {
        IsLevel::Sequence => {
            // Over every row's log-ratio sum, unclamped, empty rows (sum 0) included.
            let sums: Vec<f32> = rows.sums(log_ratio).iter().map(|&s| s as f32).collect();
            let log_max = sums.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let log_min = sums.iter().copied().fold(f32::INFINITY, f32::min);
            put("rollout_is_max", f64::from(log_max.min(SAFETY_BOUND).exp()));
            put("rollout_is_min", f64::from(log_min.exp()));
            let (log_hi, log_lo) = ((threshold as f32).ln(), (lower as f32).ln());
            let fraction = |hit: &dyn Fn(f32) -> bool| {
                sums.iter().filter(|&&s| hit(s)).count() as f64 / sums.len() as f64
            };
            put("rollout_is_ratio_fraction_high", fraction(&|s| s > log_hi));
            put("rollout_is_ratio_fraction_low", fraction(&|s| s < log_lo));
        }
        IsLevel::Token => {
            let (hi, lo) = (threshold as f32, lower as f32);
            let share = |hit: &dyn Fn(f32) -> bool| {
                mean_of(
                    weights
                        .iter()
                        .zip(mask)
                        .map(|(&w, &m)| (if hit(w) { 1.0 } else { 0.0 }, m)),
                )
            };
            put("rollout_is_ratio_fraction_high", share(&|w| w > hi));
            put("rollout_is_ratio_fraction_low", share(&|w| w < lo));
            put(
                "rollout_is_max",
                max_of(valid().map(|(&w, _)| f64::from(w))),
            );
            put(
                "rollout_is_min",
                min_of(valid().map(|(&w, _)| f64::from(w))),
            );
        }
    }
    put(
        "rollout_is_std",
        clamped_std(&weights, lower, threshold, mask),
    );
    let clamped: Vec<f32> = weights
        .iter()
        .map(|&w| clamp(f64::from(w), lower, threshold) as f32)
        .collect();
    let mean = masked_mean(&clamped, mask);
    let normalised: Vec<f32> = clamped
        .iter()
        .map(|&w| {
            let n = f64::from(w) / (mean + 1e-8);
            (n * n) as f32
        })
        .collect();
    put(
        "rollout_is_eff_sample_size",
        1.0 / masked_mean(&normalised, mask),
    );
    let seq = rows.means(&weights);
    put("rollout_is_seq_mean", plain_mean(&seq));
    put("rollout_is_seq_std", unbiased_std(&seq));
    put("rollout_is_seq_max", max_of(seq.iter().copied()));
    put("rollout_is_seq_min", min_of(seq.iter().copied()));
    put(
        "rollout_is_seq_max_deviation",
        max_of(seq.iter().map(|s| (s - 1.0).abs())),
    );
    let share = |hit: &dyn Fn(f64) -> bool| {
        seq.iter().filter(|&&s| hit(s)).count() as f64 / seq.len() as f64
    };
    put("rollout_is_seq_fraction_high", share(&|s| s > threshold));
    put("rollout_is_seq_fraction_low", share(&|s| s < lower));

    // Truncation (TIS), after the metrics so they see the raw ratios.
    for w in &mut weights {
        *w = w.min(threshold as f32);
    }
    if batch_normalize {
        let mean = match level {
            IsLevel::Token => masked_mean(&weights, mask),
            IsLevel::Sequence => {
                let seq = rows.means(&weights);
                let valid: Vec<bool> = (0..rows.count()).map(|i| rows.valid(i)).collect();
                let n = valid.iter().filter(|&&v| v).count() as f64;
                seq.iter()
                    .zip(&valid)
                    .filter(|&(_, &v)| v)
                    .map(|(s, _)| s)
                    .sum::<f64>()
                    / n.max(1e-8)
            }
        };
        if mean > 1e-8 {
            for w in &mut weights {
                *w = (f64::from(*w) / mean) as f32;
            }
            put("rollout_is_batch_norm_factor", mean);
        } else {
            put("rollout_is_batch_norm_factor", 1.0);
        }
    }
    weights
}

/// verl's `compute_rollout_rejection_mask` and `compute_rs_metrics`: the new mask (every
/// criterion must pass).
fn rejection_mask(
    log_ratio: &[f32],
    rows: &Rows<'_>,
    criteria: &[RsCriterion],
    metrics: &mut BTreeMap<String, f64>,
) -> Vec<f32> {
    let mask = rows.mask;
    let cols = rows.cols.max(1);
    let safe: Vec<f32> = log_ratio
        .iter()
        .map(|l| l.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        .collect();
    let token = |estimator: Estimator| -> Vec<f32> {
        safe.iter()
            .map(|&l| match estimator {
                Estimator::K1 => -l,
                Estimator::K2 => 0.5 * l * l,
                Estimator::K3 => l.exp() - 1.0 - l,
            })
            .collect()
    };
    let valid: Vec<bool> = (0..rows.count()).map(|i| rows.valid(i)).collect();
    let mut combined = vec![1.0f32; mask.len()];
    for criterion in criteria {
        let prefix = format!("rollout_rs_{}", criterion.name);
        let mut put = |k: &str, v: f64| {
            metrics.insert(format!("{prefix}_{k}"), v);
        };
        let per_token = token(criterion.estimator);
        let k1 = criterion.estimator == Estimator::K1;
        // K1 bounds apply to `−log ρ` in log space, the others to the statistic itself.
        let (upper, lower) = if k1 {
            (
                criterion.upper.ln(),
                criterion.lower.expect("K1 has a lower bound").ln(),
            )
        } else {
            (criterion.upper, 0.0)
        };
        let (hi, lo) = (upper as f32, lower as f32);
        let keeps = |v: f32| v <= hi && (!k1 || v >= lo);
        // The statistic per token (a sequence's own value repeated along it), and per sequence.
        let (stat, per_sequence): (Vec<f32>, Option<Vec<f64>>) = match criterion.aggregate {
            Aggregate::Token => (per_token, None),
            aggregate => {
                let seq: Vec<f64> = match aggregate {
                    Aggregate::SeqSum => rows.sums(&per_token),
                    Aggregate::SeqMean => rows.means(&per_token),
                    _ => (0..rows.count())
                        .map(|i| {
                            let m = max_of(
                                per_token[i * cols..(i + 1) * cols]
                                    .iter()
                                    .zip(rows.mask(i))
                                    .filter(|&(_, &m)| m != 0.0)
                                    .map(|(&v, _)| f64::from(v)),
                            );
                            if m == f64::NEG_INFINITY { 0.0 } else { m }
                        })
                        .collect(),
                };
                let stat = (0..mask.len()).map(|j| seq[j / cols] as f32).collect();
                (stat, Some(seq))
            }
        };
        let keep: Vec<f32> = stat
            .iter()
            .map(|&v| if keeps(v) { 1.0 } else { 0.0 })
            .collect();
        for (c, k) in combined.iter_mut().zip(&keep) {
            *c *= k;
        }

        // compute_rs_metrics
        let seq_values: Vec<f64> = per_sequence.unwrap_or_else(|| rows.means(&stat));
        let seq_valid: Vec<f64> = seq_values
            .iter()
            .zip(&valid)
            .filter(|&(_, &v)| v)
            .map(|(&s, _)| s)
            .collect();
        let sequence_level = criterion.aggregate != Aggregate::Token;
        put("mean", masked_mean(&stat, mask));
        let masked = || {
            stat.iter()
                .zip(mask)
                .filter(|&(_, &m)| m != 0.0)
                .map(|(&v, _)| f64::from(v))
        };
        let seq_share = |hit: &dyn Fn(f32) -> bool| {
            seq_valid.iter().filter(|&&s| hit(s as f32)).count() as f64 / seq_valid.len() as f64
        };
        let token_share = |hit: &dyn Fn(f32) -> bool| {
            mean_of(
                stat.iter()
                    .zip(mask)
                    .map(|(&v, &m)| (if hit(v) { 1.0 } else { 0.0 }, m)),
            )
        };
        if sequence_level && !seq_valid.is_empty() {
            put("max", max_of(seq_valid.iter().copied()));
            put("min", min_of(seq_valid.iter().copied()));
            put("fraction_high", seq_share(&|s| s > hi));
            put(
                "fraction_low",
                if k1 { seq_share(&|s| s < lo) } else { 0.0 },
            );
        } else {
            put("max", max_of(masked()));
            put("min", min_of(masked()));
            put("fraction_high", token_share(&|v| v > hi));
            put(
                "fraction_low",
                if k1 { token_share(&|v| v < lo) } else { 0.0 },
            );
        }
        put(
            "std",
            clamped_std(&stat, f64::from(lo), f64::from(hi), mask),
        );
        // verl's sequence summaries; at least one sequence is valid (checked above).
        put("seq_mean", plain_mean(&seq_valid));
        put("seq_std", unbiased_std(&seq_valid));
        put("seq_max", max_of(seq_valid.iter().copied()));
        put("seq_min", min_of(seq_valid.iter().copied()));
        put(
            "seq_max_deviation",
            max_of(seq_valid.iter().map(|s| s.abs())),
        );
        put("seq_fraction_high", seq_share(&|s| s > hi));
        if k1 {
            put("seq_fraction_low", seq_share(&|s| s < lo));
        }
        put(
            "masked_fraction",
            mean_of(
                keep.iter()
                    .zip(mask)
                    .map(|(&k, &m)| (f64::from(1.0 - k), m)),
            ),
        );
        let rejected_rows = (0..rows.count())
            .filter(|&i| {
                valid[i]
                    && keep[i * cols..(i + 1) * cols]
                        .iter()
                        .zip(rows.mask(i))
                        .any(|(&k, &m)| k == 0.0 && m != 0.0)
            })
            .count();
        let valid_rows = valid.iter().filter(|&&v| v).count();
        put(
            "seq_masked_fraction",
            rejected_rows as f64 / valid_rows as f64,
        );
    }
    metrics.insert(
        "rollout_rs_masked_fraction".to_owned(),
        mean_of(
            combined
                .iter()
                .zip(mask)
                .map(|(&k, &m)| (f64::from(1.0 - k), m)),
        ),
    );
    let rejected_rows = (0..rows.count())
        .filter(|&i| {
            combined[i * cols..(i + 1) * cols]
                .iter()
                .zip(rows.mask(i))
                .any(|(&k, &m)| k <= 0.5 && m != 0.0)
        })
        .count();
    metrics.insert(
        "rollout_rs_seq_masked_fraction".to_owned(),
        rejected_rows as f64 / rows.count() as f64,
    );
    mask.iter().zip(&combined).map(|(&m, &k)| m * k).collect()
}

/// verl's `compute_offpolicy_metrics` (with the rollout's log-probs present).
fn offpolicy_metrics(
    old: &[f32],
    rollout: &[f32],
    log_ratio: &[f32],
    rows: &Rows<'_>,
    metrics: &mut BTreeMap<String, f64>,
) {
    let mask = rows.mask;
    let mut put = |k: &str, v: f64| {
        metrics.insert(k.to_owned(), v);
    };
    let mean_train = rows.means(old);
    let mean_rollout = rows.means(rollout);
    let ppl = |means: &[f64]| plain_mean(&means.iter().map(|m| (-m).exp()).collect::<Vec<_>>());
    put("training_ppl", ppl(&mean_train));
    put("training_log_ppl", -plain_mean(&mean_train));
    let diff: Vec<f32> = rollout.iter().zip(old).map(|(&r, &o)| r - o).collect();
    put("kl", masked_mean(&diff, mask));
    let k3: Vec<f32> = log_ratio.iter().map(|&l| l.exp() - l - 1.0).collect();
    put("k3_kl", masked_mean(&k3, mask));
    put("rollout_ppl", ppl(&mean_rollout));
    put("rollout_log_ppl", -plain_mean(&mean_rollout));
    let log_ppl_diff: Vec<f64> = mean_rollout
        .iter()
        .zip(&mean_train)
        .map(|(r, t)| r - t)
        .collect();
    put("log_ppl_diff", plain_mean(&log_ppl_diff));
    put(
        "log_ppl_abs_diff",
        plain_mean(&log_ppl_diff.iter().map(|d| d.abs()).collect::<Vec<_>>()),
    );
    put("log_ppl_diff_max", max_of(log_ppl_diff.iter().copied()));
    put("log_ppl_diff_min", min_of(log_ppl_diff.iter().copied()));
    put(
        "ppl_ratio",
        plain_mean(&log_ppl_diff.iter().map(|d| d.exp()).collect::<Vec<_>>()),
    );
    let rho_squared: Vec<f32> = log_ratio
        .iter()
        .map(|&l| {
            let rho = l.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp();
            rho * rho
        })
        .collect();
    put("chi2_token", masked_mean(&rho_squared, mask) - 1.0);
    let seq = rows.sums(log_ratio);
    put(
        "chi2_seq",
        plain_mean(
            &seq.iter()
                .map(|&s| (2.0 * f64::from((s as f32).clamp(-SAFETY_BOUND, SAFETY_BOUND))).exp())
                .collect::<Vec<_>>(),
        ) - 1.0,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(rows: &[&[f32]]) -> Matrix {
        Matrix::from_rows(rows).unwrap()
    }

    #[test]
    fn token_weights_are_truncated_ratios_and_zero_on_padding() {
        let ln = |x: f32| x.ln();
        let old = m(&[&[ln(0.6), ln(0.1)], &[ln(0.2), 0.0]]);
        let rollout = m(&[&[ln(0.2), ln(0.4)], &[ln(0.2), -5.0]]);
        let mask = m(&[&[1.0, 1.0], &[1.0, 0.0]]);
        let settings =
            RolloutCorrection::new(Some(IsLevel::Token), 2.0, false, None, None).unwrap();
        let out = rollout_correction(&old, &rollout, &mask, &settings).unwrap();
        let w = out.is_weights.unwrap();
        // ratios 3 → truncated to 2, 0.25, 1; padding 0.
        let expected = [2.0, 0.25, 1.0, 0.0];
        for (a, e) in w.data().iter().zip(expected) {
            assert!((a - e).abs() < 1e-6, "{:?}", w.data());
        }
        assert_eq!(out.response_mask, mask);
        // One of three tokens above 2, one below 1/2.
        let metric = |k: &str| out.metrics[&format!("rollout_corr/{k}")];
        assert!((metric("rollout_is_ratio_fraction_high") - 1.0 / 3.0).abs() < 1e-6);
        assert!((metric("rollout_is_ratio_fraction_low") - 1.0 / 3.0).abs() < 1e-6);
        assert!((metric("rollout_is_max") - 3.0).abs() < 1e-5);
    }

    #[test]
    fn sequence_rejection_removes_whole_sequences() {
        // Row 0 far off-policy (log ratio −3 per token), row 1 on-policy.
        let old = m(&[&[-4.0, -4.0], &[-1.0, -1.0]]);
        let rollout = m(&[&[-1.0, -1.0], &[-1.0, -1.0]]);
        let mask = m(&[&[1.0, 1.0], &[1.0, 1.0]]);
        let settings =
            RolloutCorrection::new(None, 2.0, false, Some("seq_mean_k2"), Some("1.0")).unwrap();
        let out = rollout_correction(&old, &rollout, &mask, &settings).unwrap();
        assert_eq!(out.response_mask, m(&[&[0.0, 0.0], &[1.0, 1.0]]));
        assert!(out.is_weights.is_none());
        assert_eq!(
            out.metrics["rollout_corr/rollout_rs_seq_masked_fraction"],
            0.5
        );
        assert!((out.metrics["rollout_corr/kl"] - 1.5).abs() < 1e-6);
    }

    #[test]
    fn bad_settings_name_the_key() {
        let err = |rs: &str, t: Option<&str>| {
            RolloutCorrection::new(None, 2.0, false, Some(rs), t)
                .unwrap_err()
                .to_string()
        };
        assert!(err("token_k9", Some("1")).contains("rollout_rs: unknown option `token_k9`"));
        assert!(err("token_k2", None).contains("rollout_rs_threshold"));
        assert!(err("token_k2", Some("0.1_2")).contains("single upper bound"));
        assert!(err("token_k1,token_k2", Some("1,2,3")).contains("3 thresholds for 2"));
        assert!(
            RolloutCorrection::new(Some(IsLevel::Token), 0.0, false, None, None)
                .unwrap_err()
                .to_string()
                .contains("rollout_is_threshold")
        );
        let ok = RolloutCorrection::new(None, 2.0, false, Some("token_k1"), Some("0.5_2")).unwrap();
        assert_eq!(ok.rollout_rs[0].lower, Some(0.5));
    }
}
