//! The scores of a batch's responses: per-token log-probs (with entropy and Σπ² when asked), a
//! critic's values, and a distillation teacher's top-k log-probs, from the final hidden states of
//! a padded or packed pass.

use tch::{Kind, Tensor};

use super::forward::Layout;
use super::{BlockContext, CausalLM, Packing};
use crate::error::{ModelError, Result};
use crate::logprobs::{
    DistillScores, ResponseScores, ScoreOutputs, TopkLogProbs, entropy_from_logits, fused_scores,
    sum_pi_squared_from_logits, topk_log_probs,
};

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

    /// [`crate::log_probs_from_logits`] with the log-softmax over fixed row tiles in the
    /// deterministic mode (the rollout's log-probs go through the same function).
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
    fn tempered_logits(&self, hidden: &Tensor, temperature: f64) -> Result<Tensor> {
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
        let predictors = predictors_in(hidden, context, response_len)?;
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

/// The final hidden states of the response tokens' predictors among a block context's pass
/// `hidden`: padded `[B, R, hidden]` (position t predicts token t + 1, so the last `R + 1`
/// columns but the last), packed `[n, hidden]` (the packing's predictors). After
/// [`BlockContext::score_predictors_only`] the pass computed those alone, and `hidden` is them.
fn predictors_in(hidden: &Tensor, context: &BlockContext, response_len: i64) -> Result<Tensor> {
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
pub(super) fn check_packed_response_len(packing: &Packing, response_len: i64) -> Result<()> {
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
pub(super) fn check_response_len(seq: i64, response_len: i64) -> Result<()> {
    if response_len < 1 || response_len >= seq {
        return Err(ModelError::invalid_input(
            "response_len",
            format!("must lie in [1, {seq}) for sequences of length {seq}, got {response_len}"),
        ));
    }
    Ok(())
}

/// Where per-predictor outputs belong in the `[B, R, ..]` response layout.
enum Placement<'a> {
    /// Predictors are already `[B, R]`; the response mask.
    Padded(Tensor),
    /// Predictors are the packing's `[n]` scored tokens.
    Packed(&'a Packing),
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
