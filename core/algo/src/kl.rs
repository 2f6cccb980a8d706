//! KL between the policy and the reference, and the KL penalty in the reward
//! (`algorithm.use_kl_in_reward`) with verl's fixed and adaptive coefficient controllers.

use serde::{Deserialize, Serialize};

use super::{AlgoError, Matrix};

/// `algorithm.kl_penalty`: the per-token KL estimator (<http://joschu.net/blog/kl-approx.html>).
/// The `+` spellings (`k3+`: k2's gradient through a straight-through estimator) differ only in
/// the gradient, so in the reward they are the plain estimator (verl's `kl_penalty` strips the
/// `+` too); `k2+`/`mse+` are k2 itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlPenalty {
    /// k1: `logp − ref`.
    #[serde(alias = "k1", alias = "k1+", alias = "kl+")]
    Kl,
    /// `|logp − ref|`.
    #[serde(alias = "abs+")]
    Abs,
    /// k2: `½(logp − ref)²`.
    #[serde(alias = "k2", alias = "k2+", alias = "mse+")]
    Mse,
    /// k3: `e^{ref−logp} − (ref−logp) − 1`, clamped to ±10.
    #[serde(alias = "k3", alias = "k3+", alias = "low_var_kl+")]
    LowVarKl,
}

/// The KL estimate of one token.
pub fn kl_penalty(logprob: f32, ref_logprob: f32, kind: KlPenalty) -> f32 {
    let diff = logprob - ref_logprob;
    match kind {
        KlPenalty::Kl => diff,
        KlPenalty::Abs => diff.abs(),
        KlPenalty::Mse => 0.5 * diff * diff,
        KlPenalty::LowVarKl => {
            // The inner clamp keeps exp() finite; the outer one bounds the estimate, as verl does.
            let kl = (-diff).clamp(-20.0, 20.0);
            (kl.exp() - kl - 1.0).clamp(-10.0, 10.0)
        }
    }
}

/// `algorithm.kl_ctrl.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlCtrlType {
    Fixed,
    Adaptive,
}

/// The KL coefficient β and how it moves. Serialisable so a checkpoint restores an adapted β.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KlController {
    pub kind: KlCtrlType,
    pub value: f64,
    pub target: f64,
    pub horizon: u64,
}

impl KlController {
    pub fn new(
        kind: KlCtrlType,
        kl_coef: f64,
        target_kl: f64,
        horizon: u64,
    ) -> Result<Self, AlgoError> {
        if kind == KlCtrlType::Adaptive && horizon == 0 {
            return Err(AlgoError::Horizon);
        }
        Ok(Self {
            kind,
            value: kl_coef,
            target: target_kl,
            horizon,
        })
    }

    /// Adaptive (Ziegler et al. 2019): `β ← β·(1 + clip(kl/target − 1, ±0.2)·n_steps/horizon)`.
    pub fn update(&mut self, current_kl: f64, n_steps: usize) {
        if self.kind == KlCtrlType::Adaptive {
            let error = (current_kl / self.target - 1.0).clamp(-0.2, 0.2);
            self.value *= 1.0 + error * n_steps as f64 / self.horizon as f64;
        }
    }
}

/// Rewards after the KL penalty, and what verl logs about it.
#[derive(Debug, Clone, PartialEq)]
pub struct KlPenaltyOutput {
    pub token_level_rewards: Matrix,
    /// Batch mean of the per-sequence masked-mean KL.
    pub current_kl: f64,
    /// The β that was applied (before the controller's update).
    pub beta: f64,
}

impl KlPenaltyOutput {
    /// `actor/reward_kl_penalty` and `actor/reward_kl_penalty_coeff`.
    pub fn metrics(&self) -> [(&'static str, f64); 2] {
        [
            ("actor/reward_kl_penalty", self.current_kl),
            ("actor/reward_kl_penalty_coeff", self.beta),
        ]
    }
}

/// `token_level_rewards = token_level_scores − β·KL(old ‖ ref)·mask`, then the controller is
/// updated with the batch KL and `n_steps` = batch size (verl's `apply_kl_penalty`).
pub fn apply_kl_penalty(
    token_level_scores: &Matrix,
    old_log_probs: &Matrix,
    ref_log_probs: &Matrix,
    response_mask: &Matrix,
    kind: KlPenalty,
    controller: &mut KlController,
) -> Result<KlPenaltyOutput, AlgoError> {
    let shape = token_level_scores.shape();
    old_log_probs.expect_shape("old_log_probs", shape)?;
    let kld = old_log_probs
        .zip_map(ref_log_probs, "ref_log_probs", |lp, rp| {
            kl_penalty(lp, rp, kind)
        })?
        .zip_map(response_mask, "response_mask", |k, m| k * m)?;
    let beta = controller.value;
    let token_level_rewards = token_level_scores.zip_map(&kld, "kl", |s, k| s - beta as f32 * k)?;
    let per_sequence: f64 = (0..shape.0)
        .map(|i| {
            let tokens: f64 = response_mask.row(i).iter().map(|&m| f64::from(m)).sum();
            kld.row(i).iter().map(|&k| f64::from(k)).sum::<f64>() / (tokens + 1e-8)
        })
        .sum();
    let current_kl = if shape.0 == 0 {
        0.0
    } else {
        per_sequence / shape.0 as f64
    };
    controller.update(current_kl, shape.0);
    Ok(KlPenaltyOutput {
        token_level_rewards,
        current_kl,
        beta,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimators_match_their_formulas() {
        // logp = −1, ref = −2: Δ = 1.
        assert_eq!(kl_penalty(-1.0, -2.0, KlPenalty::Kl), 1.0);
        assert_eq!(kl_penalty(-2.0, -1.0, KlPenalty::Abs), 1.0);
        assert_eq!(kl_penalty(-1.0, -2.0, KlPenalty::Mse), 0.5);
        // k3 with ref − logp = −1: e^{−1} + 1 − 1 = 0.367879.
        assert!((kl_penalty(-1.0, -2.0, KlPenalty::LowVarKl) - (-1.0f32).exp()).abs() < 1e-6);
        // ref − logp = 30 → clamped to 20 → e^20 − 21, clamped to 10.
        assert_eq!(kl_penalty(-30.0, 0.0, KlPenalty::LowVarKl), 10.0);
        for (name, kind) in [
            ("\"k3\"", KlPenalty::LowVarKl),
            ("\"k3+\"", KlPenalty::LowVarKl),
            ("\"k1\"", KlPenalty::Kl),
            ("\"k2\"", KlPenalty::Mse),
            ("\"k2+\"", KlPenalty::Mse),
            ("\"mse+\"", KlPenalty::Mse),
            ("\"abs+\"", KlPenalty::Abs),
        ] {
            assert_eq!(serde_json::from_str::<KlPenalty>(name).unwrap(), kind);
        }
    }

    #[test]
    fn adaptive_controller_follows_verls_formula() {
        let mut c = KlController::new(KlCtrlType::Adaptive, 0.1, 0.05, 100).unwrap();
        // kl/target − 1 = 1 → clipped to 0.2; β·(1 + 0.2·4/100) = 0.1·1.008.
        c.update(0.1, 4);
        assert!((c.value - 0.1008).abs() < 1e-12);
        // 0.045/0.05 − 1 = −0.1 → β·(1 − 0.1·4/100) = 0.1008·0.996.
        c.update(0.045, 4);
        assert!((c.value - 0.1008 * 0.996).abs() < 1e-12);
        let mut fixed = KlController::new(KlCtrlType::Fixed, 0.1, 0.05, 0).unwrap();
        fixed.update(10.0, 4);
        assert_eq!(fixed.value, 0.1);
        assert_eq!(
            KlController::new(KlCtrlType::Adaptive, 0.1, 0.05, 0),
            Err(AlgoError::Horizon)
        );
    }

    #[test]
    fn penalty_is_subtracted_on_response_tokens() {
        let scores = Matrix::from_rows(&[&[0.0, 1.0], &[0.0, 0.0]]).unwrap();
        let old = Matrix::from_rows(&[&[-1.0, -1.0], &[-1.0, -1.0]]).unwrap();
        let reference = Matrix::from_rows(&[&[-1.5, -2.0], &[-1.0, -3.0]]).unwrap();
        let mask = Matrix::from_rows(&[&[1.0, 1.0], &[1.0, 0.0]]).unwrap();
        let mut c = KlController::new(KlCtrlType::Adaptive, 0.5, 1.0, 10).unwrap();
        let out =
            apply_kl_penalty(&scores, &old, &reference, &mask, KlPenalty::Kl, &mut c).unwrap();
        // k1 = [0.5, 1.0 | 0, 2·0(masked)]; rewards = scores − 0.5·k1.
        assert_eq!(out.token_level_rewards.data(), &[-0.25, 0.5, 0.0, 0.0]);
        // Per-sequence means: 1.5/2 = 0.75 and 0/1 = 0 → batch 0.375.
        assert!((out.current_kl - 0.375).abs() < 1e-6);
        assert_eq!(out.beta, 0.5);
        // 0.375/1 − 1 = −0.625 → −0.2; β = 0.5·(1 − 0.2·2/10) = 0.48.
        assert!((c.value - 0.48).abs() < 1e-6);
        assert_eq!(out.metrics()[1], ("actor/reward_kl_penalty_coeff", 0.5));
    }
}
