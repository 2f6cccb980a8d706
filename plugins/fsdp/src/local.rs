//! The model whole in this process: one rank, or verl's `fsdp_size: 1`, where every rank holds
//! a replica and the gradients are summed across ranks before the step, so every replica
//! applies the same update.

use std::path::Path;

use tch::{Device, Tensor};
use verl_actor::{
    AdamW, AdamWConfig, LrSchedule, Reduction, Rows, Strategy, load_training_state,
    load_training_state_from, save_training_state,
};
use verl_model::interop::LentTensors;
use verl_model::{
    BlockContext, CausalLM, DistillScores, ModelSpec, ResponseScores, Rng, ScoreOutputs,
    TopkLogProbs,
};
use verl_plugin_api::TensorRef;

use crate::dist::{Ranks, model_error};
use crate::shard::strategy::shard_error;

/// The model, its optimizer (none for the reference policy) and the weights last lent.
pub struct LocalModel {
    model: CausalLM,
    spec: ModelSpec,
    optimizer: Option<AdamW>,
    lent: LentTensors,
    ranks: Ranks,
}

impl LocalModel {
    /// `model` with an AdamW of `optimizer` over its trainable parameters (none for a role that
    /// does not train).
    pub fn new(
        model: CausalLM,
        spec: ModelSpec,
        optimizer: Option<AdamWConfig>,
        ranks: Ranks,
    ) -> Self {
        Self {
            optimizer: optimizer.map(|config| AdamW::for_model(&model, config)),
            model,
            spec,
            lent: LentTensors::default(),
            ranks,
        }
    }

    fn optimizer(&mut self) -> &mut AdamW {
        self.optimizer
            .as_mut()
            .expect("the worker only trains roles that have an optimizer")
    }

    /// The micro-batch's block context, laid out as the settings ask.
    fn context(&self, rows: &Rows) -> verl_model::Result<BlockContext> {
        rows.block_context(&self.model)
    }

    /// Forward and backward of one micro-batch; `loss_fn` maps final hidden states (of the
    /// context's layout) to the scalar loss (with activation checkpointing when the model
    /// config asks for it). With `aux_weight`, adds that × `router_aux_loss_coef` × the
    /// load-balancing loss when the model's config asks for it, and returns that loss.
    fn backward(
        &self,
        rows: &Rows,
        aux_weight: Option<f64>,
        loss_fn: impl FnOnce(&Tensor, &BlockContext) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<Option<f64>> {
        let context = self.context(rows)?;
        if self.spec.enable_gradient_checkpointing {
            // The returned (detached) loss is not needed: `loss_fn` records its values.
            let (_, aux) =
                self.model
                    .backward_checkpointed_aux_in(&context, aux_weight, |hidden| {
                        loss_fn(hidden, &context)
                    })?;
            return Ok(aux);
        }
        let hidden = self.model.hidden_states_in(&context);
        let mut loss = loss_fn(&hidden, &context)?;
        let mut aux = None;
        if let Some((weight, coef)) = aux_weight.zip(self.model.router_aux_loss_coef()) {
            // The router logits this pass recorded are in its graph.
            let balance = self.model.load_balancing_loss_in(&context)?;
            aux = Some(balance.double_value(&[]));
            loss += balance * (weight * coef);
        }
        loss.f_backward()?;
        Ok(aux)
    }

    /// The response scores of `rows` and the context of their forward pass (which recorded the
    /// experts of a mixture-of-experts model).
    fn scored(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> verl_model::Result<(ResponseScores, BlockContext)> {
        let context = self.context(rows)?;
        let hidden = self.model.hidden_states_in(&context);
        let scores = self.model.response_scores_in(
            &hidden,
            &context,
            rows.response_len,
            temperature,
            outputs,
        )?;
        Ok((scores, context))
    }

    fn backward_scores_with(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
        aux_weight: Option<f64>,
        loss: &mut dyn FnMut(&ResponseScores) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<Option<f64>> {
        self.backward(rows, aux_weight, |hidden, context| {
            loss(&self.model.response_scores_in(
                hidden,
                context,
                rows.response_len,
                temperature,
                outputs,
            )?)
        })
    }
}

impl Strategy for LocalModel {
    fn device(&self) -> Device {
        self.model.device()
    }

    fn scores(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> verl_model::Result<ResponseScores> {
        self.scored(rows, temperature, outputs)
            .map(|(scores, _)| scores)
    }

    fn scores_routed(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> verl_model::Result<(ResponseScores, Tensor)> {
        let (scores, context) = self.scored(rows, temperature, outputs)?;
        Ok((scores, context.take_routed_experts()?))
    }

    fn values(&self, rows: &Rows) -> verl_model::Result<Tensor> {
        let context = self.context(rows)?;
        let hidden = self.model.hidden_states_in(&context);
        self.model
            .response_values_in(&hidden, &context, rows.response_len)
    }

    fn backward_scores(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
        loss: &mut dyn FnMut(&ResponseScores) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<()> {
        self.backward_scores_with(rows, temperature, outputs, None, loss)
            .map(drop)
    }

    fn backward_scores_aux(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
        aux_weight: f64,
        loss: &mut dyn FnMut(&ResponseScores) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<Option<f64>> {
        self.backward_scores_with(rows, temperature, outputs, Some(aux_weight), loss)
    }

    fn topk(&self, rows: &Rows, temperature: f64, k: i64) -> verl_model::Result<TopkLogProbs> {
        let context = self.context(rows)?;
        let hidden = self.model.hidden_states_in(&context);
        self.model
            .response_topk_in(&hidden, &context, rows.response_len, temperature, k)
    }

    fn backward_distill_scores(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
        aux_weight: f64,
        ids: &Tensor,
        loss: &mut dyn FnMut(&DistillScores) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<Option<f64>> {
        self.backward(rows, Some(aux_weight), |hidden, context| {
            loss(&self.model.response_distill_scores_in(
                hidden,
                context,
                rows.response_len,
                temperature,
                outputs,
                ids,
            )?)
        })
    }

    fn backward_values(
        &self,
        rows: &Rows,
        loss: &mut dyn FnMut(&Tensor) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<()> {
        self.backward(rows, None, |hidden, context| {
            loss(
                &self
                    .model
                    .response_values_in(hidden, context, rows.response_len)?,
            )
        })
        .map(drop)
    }

    fn zero_grad(&mut self) {
        self.optimizer().zero_grad();
    }

    fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        self.optimizer().clip_grad_norm(max_norm)
    }

    fn step(&mut self, lr: f64) -> bool {
        self.optimizer().step(lr)
    }

    /// verl-actor's training state: weights, optimizer moments, schedule and generator.
    fn save(&self, dir: &Path, schedule: &LrSchedule, rng: &Rng) -> verl_model::Result<()> {
        let optimizer = self
            .optimizer
            .as_ref()
            .expect("the worker only saves roles that have an optimizer");
        save_training_state(dir, &self.model, optimizer, schedule, rng)
    }

    fn load(&mut self, dir: &Path) -> verl_model::Result<(LrSchedule, Rng)> {
        let optimizer = self
            .optimizer
            .as_mut()
            .expect("the worker only loads roles that have an optimizer");
        // A checkpoint saved sharded (on more ranks) is read whole.
        let saved = match crate::shard::checkpoint::read_whole(dir).map_err(shard_error)? {
            Some((source, tensors)) => {
                load_training_state_from(dir, &source, &tensors, &self.model, optimizer)?
            }
            None => load_training_state(dir, &self.model, optimizer)?,
        };
        Ok((saved.schedule, saved.rng))
    }

    /// The parameters as views, in place for contiguous host tensors.
    fn weights(&mut self) -> verl_model::Result<Vec<TensorRef<'_>>> {
        self.lent.lend(self.model.named_tensors())?;
        self.lent.views()
    }

    fn export_hf(&self, dir: &Path) -> verl_model::Result<()> {
        self.model.save_pretrained(dir, Some(&self.spec.path))
    }

    fn all_reduce(&mut self, values: &mut [f64], op: Reduction) -> verl_model::Result<()> {
        self.ranks.all_reduce(values, op).map_err(model_error)
    }

    /// Every replica's accumulated gradients, summed (each rank's loss is already its share of
    /// the global loss).
    fn reduce_gradients(&mut self) -> verl_model::Result<()> {
        let mut grads: Vec<Tensor> = self
            .model
            .named_tensors()
            .into_iter()
            .filter(|(_, p)| p.requires_grad())
            .map(|(_, p)| p.grad())
            .filter(Tensor::defined)
            .collect();
        self.ranks
            .all_reduce_sum_tensors(&mut grads)
            .map_err(model_error)
    }
}
