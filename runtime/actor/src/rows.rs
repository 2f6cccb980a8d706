//! A [`Batch`] as tch tensors on the engine's device, checked against the layout in
//! `verl_plugin_api::keys`, and cut into mini- and micro-batches along rows.

use serde::Deserialize;
use tch::{Device, Kind, Tensor};
use verl_plugin_api::{Batch, keys};

use verl_model::interop::{parse_config, to_tch};
use verl_model::{BlockContext, CausalLM, ScoreOutputs};

use crate::distill::{TEACHER_IDS, TEACHER_LOGPROBS};
use crate::{ActorError, PassLayout};

/// The per-call settings an engine reads from `Batch::meta_json`.
#[derive(Debug, Deserialize)]
pub struct Meta {
    /// The rollout's sampling temperature: log-probs are those of `softmax(logits / T)`.
    #[serde(default = "one")]
    pub temperature: f64,
    #[serde(default = "yes")]
    pub calculate_entropy: bool,
    /// verl's `calculate_sum_pi_squared`: `compute_log_prob` also returns Σπ² per token.
    #[serde(default)]
    pub calculate_sum_pi_squared: bool,
    /// A distillation teacher's `k`: `compute_log_prob` also returns the top-`k` tokens and
    /// log-probs of each response position.
    #[serde(default)]
    pub distill_topk: Option<i64>,
}

fn one() -> f64 {
    1.0
}
fn yes() -> bool {
    true
}

impl Meta {
    pub fn of(batch: &Batch) -> Result<Self, ActorError> {
        let meta: Self = parse_config(&batch.meta_json, "batch meta_json")?;
        if !(meta.temperature > 0.0 && meta.temperature.is_finite()) {
            return Err(ActorError::Batch(format!(
                "meta_json `temperature` must be positive, got {}",
                meta.temperature
            )));
        }
        Ok(meta)
    }

    /// The outputs `compute_log_prob` returns besides the log-probs.
    pub fn outputs(&self) -> ScoreOutputs {
        ScoreOutputs {
            entropy: self.calculate_entropy,
            sum_pi_squared: self.calculate_sum_pi_squared,
        }
    }
}

/// The dtype and ranks `keys.rs` specifies for a batch tensor.
fn kind_of(key: &str) -> (Kind, &'static [usize]) {
    match key {
        keys::INPUT_IDS | keys::ATTENTION_MASK | keys::RESPONSES => (Kind::Int64, &[2]),
        keys::ROUTED_EXPERTS => (Kind::Int64, &[4]),
        // The teacher's top-k per response token `[B, R, k]`; its log-probs of the sampled token
        // `[B, R]` for the single-sample estimators.
        TEACHER_IDS => (Kind::Int64, &[3]),
        TEACHER_LOGPROBS => (Kind::Float, &[2, 3]),
        _ => (Kind::Float, &[2]),
    }
}

/// Named row-aligned tensors: `[B, P+R]` for the sequence keys, `[B, R]` for the response keys
/// (`[B, R, k]` for the teacher's top-k), `[B, P+R, L, k]` for `routed_experts` (replayed by every
/// forward over these rows).
pub struct Rows {
    tensors: Vec<(&'static str, Tensor)>,
    /// `R`: the response columns at the end of each sequence.
    pub response_len: i64,
    /// How their forward passes lay them out.
    layout: PassLayout,
}

impl Rows {
    /// Copies `wanted` (which must include `input_ids`, `attention_mask` and `responses`) out of
    /// `batch`, checking dtypes and shapes, for passes laid out as `layout`.
    pub fn load(
        batch: &Batch,
        wanted: &[&'static str],
        device: Device,
        layout: PassLayout,
    ) -> Result<Self, ActorError> {
        let mut tensors = Vec::with_capacity(wanted.len());
        for &key in wanted {
            let abi = batch.require(key)?;
            let tensor = to_tch(key, abi, device)?;
            let (kind, dims) = kind_of(key);
            if tensor.kind() != kind || !dims.contains(&tensor.dim()) {
                return Err(ActorError::Batch(format!(
                    "`{key}` must be a {dims:?}-D {kind:?} tensor, got {:?} of shape {:?}",
                    tensor.kind(),
                    tensor.size()
                )));
            }
            tensors.push((key, tensor));
        }
        let size = |key: &str| {
            tensors
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, t)| t.size())
        };
        let (Some(seq), Some(resp)) = (size(keys::INPUT_IDS), size(keys::RESPONSES)) else {
            return Err(ActorError::Batch(
                "needs `input_ids` and `responses`".into(),
            ));
        };
        let response_len = resp[1];
        if resp[0] != seq[0] || response_len < 1 || response_len >= seq[1] {
            return Err(ActorError::Batch(format!(
                "`responses` {resp:?} must have the rows of `input_ids` {seq:?} and fewer columns"
            )));
        }
        for (key, tensor) in &tensors {
            let expected = match *key {
                // `routed_experts`' layers and top-k are the model's: the forward checks them.
                keys::INPUT_IDS | keys::ATTENTION_MASK | keys::ROUTED_EXPERTS => seq.clone(),
                _ => resp.clone(),
            };
            if tensor.size()[..2] != expected[..] {
                return Err(ActorError::Batch(format!(
                    "`{key}` has shape {:?}, expected {expected:?}",
                    tensor.size()
                )));
            }
        }
        Ok(Self {
            tensors,
            response_len,
            layout,
        })
    }

    pub fn get(&self, key: &str) -> &Tensor {
        self.try_get(key)
            .unwrap_or_else(|| panic!("`{key}` was loaded"))
    }

    /// A tensor that was loaded only when the batch had it.
    pub fn try_get(&self, key: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|(k, _)| *k == key).map(|(_, t)| t)
    }

    /// The block context of these rows' forward pass on `model`, laid out as [`Self::load`] was
    /// asked; replaying the rows' `routed_experts` when they were loaded (router replay). Its
    /// passes yield the response predictors' hidden states, all that the actor and critic read,
    /// with the last layer computed at those alone where it can be
    /// ([`BlockContext::score_predictors_only`]).
    pub fn block_context(&self, model: &CausalLM) -> verl_model::Result<BlockContext> {
        let (ids, mask, r) = (
            self.get(keys::INPUT_IDS),
            self.get(keys::ATTENTION_MASK),
            self.response_len,
        );
        let mut context = match self.layout {
            PassLayout::Padded => model.block_context(ids, mask)?,
            PassLayout::Packed {
                share_prompts: false,
            } => model.packed_block_context(ids, mask, r)?,
            PassLayout::Packed {
                share_prompts: true,
            } => model.prompt_sharing_block_context(ids, mask, r)?,
        };
        if let Some(experts) = self.try_get(keys::ROUTED_EXPERTS) {
            context.replay_experts(model, experts)?;
        }
        context.score_predictors_only(model, self.response_len)?;
        Ok(context)
    }

    pub fn rows(&self) -> i64 {
        self.tensors[0].1.size()[0]
    }

    /// Rows `start .. start + len` (views, no copy).
    pub fn narrow(&self, start: i64, len: i64) -> Self {
        self.map(|t| t.narrow(0, start, len))
    }

    /// The rows in the order of `index`.
    pub fn select(&self, index: &Tensor) -> Self {
        self.map(|t| t.index_select(0, index))
    }

    fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Self {
        Self {
            tensors: self.tensors.iter().map(|(k, t)| (*k, f(t))).collect(),
            response_len: self.response_len,
            layout: self.layout,
        }
    }

    /// Consecutive chunks of at most `size` rows (all rows in one chunk when `None`).
    pub fn chunks(&self, size: Option<usize>) -> impl Iterator<Item = Self> + '_ {
        let total = self.rows();
        let size = size.map_or(total, |s| s as i64).max(1);
        (0..total)
            .step_by(size as usize)
            .map(move |start| self.narrow(start, size.min(total - start)))
    }
}
