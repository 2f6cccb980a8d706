//! Per-token log-probabilities of response tokens, with entropy and Σπ² when wanted, in fp32.

use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};
use crate::model::{BlockContext, CausalLM, Layout, Packing};

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
    fn map(self, f: impl Fn(Tensor) -> Tensor) -> Self {
        Self {
            log_probs: f(self.log_probs),
            entropy: self.entropy.map(&f),
            sum_pi_squared: self.sum_pi_squared.map(&f),
        }
    }
}

impl CausalLM {
    /// Scores the last `response_len` tokens of each row, verl's layout: `input_ids` is the prompt
    /// (any padding) followed by the response (right-padded), `attention_mask` marks real tokens.
    /// Logits are divided by `temperature` first, as the rollout sampled them. Gradients flow
    /// unless the caller wraps this in `tch::no_grad`.
    pub fn response_scores(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        response_len: i64,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> Result<ResponseScores> {
        self.lm_head()?;
        let hidden = self.hidden_states(input_ids, attention_mask)?;
        self.response_scores_from_hidden(
            &hidden,
            input_ids,
            attention_mask,
            response_len,
            temperature,
            outputs,
        )
    }

    /// [`Self::response_scores`] from final hidden states already computed (e.g. inside
    /// [`Self::backward_checkpointed`]).
    pub fn response_scores_from_hidden(
        &self,
        hidden: &Tensor,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        response_len: i64,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> Result<ResponseScores> {
        let seq = hidden.size()[1];
        check_response_len(seq, response_len)?;
        // Position t predicts token t + 1: the response's predictors end one before the sequence.
        // Only those positions go through the (large) LM head.
        self.padded_scores(
            &hidden.narrow(1, seq - response_len - 1, response_len),
            input_ids,
            attention_mask,
            temperature,
            outputs,
        )
    }

    /// The scores of a padded batch's response from its predictors' hidden states `[B, R,
    /// hidden]`.
    fn padded_scores(
        &self,
        predictors: &Tensor,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> Result<ResponseScores> {
        let (seq, response_len) = (input_ids.size()[1], predictors.size()[1]);
        let labels = input_ids
            .to_device(self.device())
            .narrow(1, seq - response_len, response_len);
        let scores = self.scores_of(predictors, &labels, temperature, outputs)?;
        let mask = self.response_mask(attention_mask, response_len);
        Ok(scores.map(|t| t * &mask))
    }

    /// [`Self::response_scores_from_hidden`] for the final hidden states of a block context's
    /// batch, padded or packed (see [`CausalLM::packed_block_context`]): `[B, R]` either way.
    /// A packed batch runs the LM head on the scored response tokens' predictors only.
    pub fn response_scores_in(
        &self,
        hidden: &Tensor,
        context: &BlockContext,
        response_len: i64,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> Result<ResponseScores> {
        let predictors = predictors_in(hidden, context, response_len)?;
        match &context.layout {
            Layout::Padded(mask) => {
                self.padded_scores(&predictors, &context.batch_ids, mask, temperature, outputs)
            }
            Layout::Packed(packing) => {
                let labels = packing.labels(&context.batch_ids);
                let scores = self.scores_of(&predictors, &labels, temperature, outputs)?;
                Ok(scores.map(|t| packing.unpack_response(&t)))
            }
        }
    }

    /// Log-probs (and the `outputs` asked for) of `labels` `[..]` from their predictors' hidden
    /// states `[.., hidden]` at `temperature`, fp32.
    fn scores_of(
        &self,
        hidden: &Tensor,
        labels: &Tensor,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> Result<ResponseScores> {
        let logits = self.tempered_logits(hidden, temperature)?;
        Ok(ResponseScores {
            log_probs: self.log_probs_in_rows(&logits, labels),
            entropy: outputs.entropy.then(|| {
                self.row_wise(&logits, |t| entropy_from_logits(t).unsqueeze(-1))
                    .squeeze_dim(-1)
            }),
            sum_pi_squared: outputs.sum_pi_squared.then(|| {
                self.row_wise(&logits, |t| sum_pi_squared_from_logits(t).unsqueeze(-1))
                    .squeeze_dim(-1)
            }),
        })
    }

    /// [`log_probs_from_logits`] with the log-softmax over fixed row tiles in the deterministic
    /// mode (the rollout's log-probs go through the same function).
    pub(crate) fn log_probs_in_rows(&self, logits: &Tensor, labels: &Tensor) -> Tensor {
        self.row_wise(logits, |t| t.log_softmax(-1, Kind::Float))
            .gather(-1, &labels.unsqueeze(-1), false)
            .squeeze_dim(-1)
    }

    /// Values of the response tokens, `[B, R]` fp32, zero on padding: the value at the position
    /// that predicts each response token, as verl's critic takes them.
    pub fn response_values(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        response_len: i64,
    ) -> Result<Tensor> {
        let hidden = self.hidden_states(input_ids, attention_mask)?;
        self.response_values_from_hidden(&hidden, attention_mask, response_len)
    }

    /// [`Self::response_values`] from final hidden states already computed.
    pub fn response_values_from_hidden(
        &self,
        hidden: &Tensor,
        attention_mask: &Tensor,
        response_len: i64,
    ) -> Result<Tensor> {
        let seq = hidden.size()[1];
        check_response_len(seq, response_len)?;
        let values =
            self.values_from_hidden(&hidden.narrow(1, seq - response_len - 1, response_len))?;
        Ok(values * self.response_mask(attention_mask, response_len))
    }

    /// [`Self::response_values_from_hidden`] for the final hidden states of a block context's
    /// batch, padded or packed: `[B, R]` either way.
    pub fn response_values_in(
        &self,
        hidden: &Tensor,
        context: &BlockContext,
        response_len: i64,
    ) -> Result<Tensor> {
        let values = self.values_from_hidden(&predictors_in(hidden, context, response_len)?)?;
        Ok(match &context.layout {
            Layout::Padded(mask) => values * self.response_mask(mask, response_len),
            Layout::Packed(packing) => packing.unpack_response(&values),
        })
    }

    /// The last `response_len` columns of the mask as fp32 on the model's device.
    fn response_mask(&self, attention_mask: &Tensor, response_len: i64) -> Tensor {
        let seq = attention_mask.size()[1];
        attention_mask
            .to_device(self.device())
            .narrow(1, seq - response_len, response_len)
            .to_kind(Kind::Float)
    }
}

/// The final hidden states of the response tokens' predictors among a block context's pass
/// `hidden`: padded `[B, R, hidden]` (position t predicts token t + 1, so the last `R + 1`
/// columns but the last), packed `[n, hidden]` (the packing's predictors). After
/// [`BlockContext::score_predictors_only`] the pass computed those alone, and `hidden` is them.
pub(crate) fn predictors_in(
    hidden: &Tensor,
    context: &BlockContext,
    response_len: i64,
) -> Result<Tensor> {
    let size = hidden.size();
    let computed = context.tail.is_some();
    let wrong = |want: String| {
        Err(ModelError::invalid_input(
            "hidden",
            format!("must be {want}, got {size:?}"),
        ))
    };
    match &context.layout {
        Layout::Padded(mask) => {
            let (rows, seq) = (mask.size()[0], mask.size()[1]);
            check_response_len(seq, response_len)?;
            let width = if computed { response_len } else { seq };
            if size.len() != 3 || size[0] != rows || size[1] != width {
                return wrong(format!("[{rows}, {width}, hidden]"));
            }
            Ok(if computed {
                hidden.shallow_clone()
            } else {
                hidden.narrow(1, seq - response_len - 1, response_len)
            })
        }
        Layout::Packed(packing) => {
            check_packed_response_len(packing, response_len)?;
            let predictors = packing.predictors();
            let width = if computed {
                predictors.size()[0]
            } else {
                packing.len()
            };
            if size.len() != 3 || size[0] != 1 || size[1] != width {
                return wrong(format!("the packed stream's [1, {width}, hidden]"));
            }
            let stream = hidden.squeeze_dim(0);
            Ok(if computed {
                stream
            } else {
                stream.index_select(0, predictors)
            })
        }
    }
}

/// A packing scores the response length it was made for.
pub(crate) fn check_packed_response_len(packing: &Packing, response_len: i64) -> Result<()> {
    if packing.response_len() != response_len {
        return Err(ModelError::invalid_input(
            "response_len",
            format!(
                "{response_len} differs from the packing's {}",
                packing.response_len()
            ),
        ));
    }
    Ok(())
}

/// A response needs at least one prompt token before it to be predicted from.
pub(crate) fn check_response_len(seq: i64, response_len: i64) -> Result<()> {
    if response_len < 1 || response_len >= seq {
        return Err(ModelError::invalid_input(
            "response_len",
            format!("must lie in [1, {seq}) for sequences of length {seq}, got {response_len}"),
        ));
    }
    Ok(())
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
}
