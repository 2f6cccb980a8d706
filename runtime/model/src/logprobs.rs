//! Per-token log-probabilities from logits, with entropy and Σπ² when wanted, in fp32: of the
//! sampled tokens, of a teacher's top-k tokens (distillation), or both from one log-softmax.

use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};

/// `log softmax(logits)[label]` per position: `logits [.., V]`, `labels [..]` → `[..]`, fp32.
pub fn log_probs_from_logits(logits: &Tensor, labels: &Tensor) -> Tensor {
    logits
        .log_softmax(-1, Kind::Float)
        .gather(-1, &labels.unsqueeze(-1), false)
        .squeeze_dim(-1)
}

/// Entropy of `softmax(logits)` per position, as verl: `logsumexp(z) − Σ softmax(z)·z`, fp32.
pub fn entropy_from_logits(logits: &Tensor) -> Tensor {
    let logits = logits.to_kind(Kind::Float);
    let p = logits.softmax(-1, Kind::Float);
    logits.logsumexp(-1, false) - (p * &logits).sum_dim_intlist(-1, false, Kind::Float)
}

/// Σ_v π(v)² of `softmax(logits)` per position, as verl's `calculate_sum_pi_squared_from_logits`:
/// `exp(logsumexp(2z) − 2·logsumexp(z))`, fp32.
pub fn sum_pi_squared_from_logits(logits: &Tensor) -> Tensor {
    let logits = logits.to_kind(Kind::Float);
    ((&logits * 2.0).logsumexp(-1, false) - logits.logsumexp(-1, false) * 2.0).exp()
}

/// The per-token outputs a scoring pass computes besides the log-probs (each costs a pass over
/// the `[.., vocab]` logits, so only when asked).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScoreOutputs {
    /// Entropy of the policy (verl's `calculate_entropy`).
    pub entropy: bool,
    /// Σ_v π(v)² over the vocabulary (verl's `calculate_sum_pi_squared`), for the optimal token
    /// baselines.
    pub sum_pi_squared: bool,
}

impl ScoreOutputs {
    /// Log-probs only.
    pub const NONE: Self = Self {
        entropy: false,
        sum_pi_squared: false,
    };
    /// Log-probs and entropy.
    pub const ENTROPY: Self = Self {
        entropy: true,
        sum_pi_squared: false,
    };
}

/// Log-probs (and the [`ScoreOutputs`] asked for) of the response part of a batch, `[B, R]` fp32,
/// zero where the response is padding.
#[derive(Debug)]
pub struct ResponseScores {
    pub log_probs: Tensor,
    pub entropy: Option<Tensor>,
    pub sum_pi_squared: Option<Tensor>,
}

impl ResponseScores {
    /// Applies `f` to every output (masking, unpacking).
    pub(crate) fn map(self, f: impl Fn(Tensor) -> Tensor) -> Self {
        Self {
            log_probs: f(self.log_probs),
            entropy: self.entropy.map(&f),
            sum_pi_squared: self.sum_pi_squared.map(&f),
        }
    }
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

/// Response scores with the student's log-probs of the teacher's top-k tokens, `[B, R, k]`
/// (zero on padding).
#[derive(Debug)]
pub struct DistillScores {
    pub scores: ResponseScores,
    pub topk_log_probs: Tensor,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_probs_and_entropy_match_hand_values() {
        // logits [0, ln 3] → p = [1/4, 3/4]; log p = [-ln 4, ln 3 - ln 4].
        let logits = Tensor::from_slice(&[0.0f32, 3f32.ln()]).view([1, 1, 2]);
        let labels = Tensor::from_slice(&[1i64]).view([1, 1]);
        let lp = log_probs_from_logits(&logits, &labels).double_value(&[0, 0]);
        assert!((lp - (0.75f64).ln()).abs() < 1e-6);
        // H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335...
        let h = entropy_from_logits(&logits).double_value(&[0, 0]);
        assert!((h - 0.562_335_144).abs() < 1e-6, "{h}");
        // Σπ² = 1/16 + 9/16.
        let s = sum_pi_squared_from_logits(&logits).double_value(&[0, 0]);
        assert!((s - 0.625).abs() < 1e-6, "{s}");
    }

    #[test]
    fn sum_pi_squared_stays_finite_for_large_logits() {
        // exp(2z) overflows fp32 at z = 60; the logsumexp form stays finite.
        let logits = Tensor::from_slice(&[60.0f32, 60.0, 0.0]).view([1, 3]);
        let s = sum_pi_squared_from_logits(&logits).double_value(&[0]);
        assert!((s - 0.5).abs() < 1e-6, "{s}");
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
