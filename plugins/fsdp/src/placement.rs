//! Where an engine's model lives: whole in this process ([`LocalModel`]: one rank, or every
//! rank with `fsdp_size` 1) or sharded over the process group ([`ShardedStrategy`]: more than one
//! rank, or offloading; see `FsdpConfig::shard_options`).

use std::path::Path;

use tch::{Device, Tensor};
use verl_actor::{LrSchedule, Reduction, Rows, Strategy};
use verl_model::{DistillScores, ResponseScores, Rng, ScoreOutputs, TopkLogProbs};
use verl_plugin_api::TensorRef;

use crate::local::LocalModel;
use crate::shard::strategy::ShardedStrategy;

/// The engine's strategy: one of the two, each method passed on.
pub enum Placement {
    Local(LocalModel),
    Sharded(ShardedStrategy),
}

/// `$call` on whichever strategy this is.
macro_rules! each {
    ($self:expr, $s:ident => $call:expr) => {
        match $self {
            Placement::Local($s) => $call,
            Placement::Sharded($s) => $call,
        }
    };
}

impl Strategy for Placement {
    fn device(&self) -> Device {
        each!(self, s => s.device())
    }

    fn scores(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> verl_model::Result<ResponseScores> {
        each!(self, s => s.scores(rows, temperature, outputs))
    }

    fn scores_routed(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> verl_model::Result<(ResponseScores, Tensor)> {
        each!(self, s => s.scores_routed(rows, temperature, outputs))
    }

    fn values(&self, rows: &Rows) -> verl_model::Result<Tensor> {
        each!(self, s => s.values(rows))
    }

    fn backward_scores(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
        loss: &mut dyn FnMut(&ResponseScores) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<()> {
        each!(self, s => s.backward_scores(rows, temperature, outputs, loss))
    }

    fn topk(&self, rows: &Rows, temperature: f64, k: i64) -> verl_model::Result<TopkLogProbs> {
        each!(self, s => s.topk(rows, temperature, k))
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
        each!(self, s => s.backward_distill_scores(rows, temperature, outputs, aux_weight, ids, loss))
    }

    fn backward_scores_aux(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
        aux_weight: f64,
        loss: &mut dyn FnMut(&ResponseScores) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<Option<f64>> {
        each!(self, s => s.backward_scores_aux(rows, temperature, outputs, aux_weight, loss))
    }

    fn backward_values(
        &self,
        rows: &Rows,
        loss: &mut dyn FnMut(&Tensor) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<()> {
        each!(self, s => s.backward_values(rows, loss))
    }

    fn zero_grad(&mut self) {
        each!(self, s => s.zero_grad())
    }

    fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        each!(self, s => s.clip_grad_norm(max_norm))
    }

    fn step(&mut self, lr: f64) -> bool {
        each!(self, s => s.step(lr))
    }

    fn save(&self, dir: &Path, schedule: &LrSchedule, rng: &Rng) -> verl_model::Result<()> {
        each!(self, s => s.save(dir, schedule, rng))
    }

    fn load(&mut self, dir: &Path) -> verl_model::Result<(LrSchedule, Rng)> {
        each!(self, s => s.load(dir))
    }

    fn weights(&mut self) -> verl_model::Result<Vec<TensorRef<'_>>> {
        each!(self, s => s.weights())
    }

    fn export_hf(&self, dir: &Path) -> verl_model::Result<()> {
        each!(self, s => s.export_hf(dir))
    }

    fn all_reduce(&mut self, values: &mut [f64], op: Reduction) -> verl_model::Result<()> {
        each!(self, s => s.all_reduce(values, op))
    }

    fn reduce_gradients(&mut self) -> verl_model::Result<()> {
        each!(self, s => s.reduce_gradients())
    }
}

impl Placement {
    /// Whether every rank holds part of the model's state, so every rank writes checkpoints and
    /// takes part in the export (a whole model is written by rank 0 alone).
    pub fn is_sharded(&self) -> bool {
        matches!(self, Placement::Sharded(_))
    }
}
