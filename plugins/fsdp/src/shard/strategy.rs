//! The sharded model as an engine [`Strategy`]: verl's actor/critic semantics
//! ([`verl_actor::ActorWorker`]) on a [`ShardedModel`] over the process's group
//! (shared with the other engines of the process, hence behind a mutex).
//!
//! Every method communicates, so every rank calls each one at the same point — including
//! `all_reduce` (the worker's global counts, metrics and micro-batch counts, over the same group),
//! `save` (each rank writes its shard, rank 0 the layout and the training state) and
//! `export_hf` (every rank gathers, rank 0 writes). `Strategy::clip_grad_norm` and
//! `Strategy::step` cannot return an error: a collective failure there is kept, reported as
//! a non-finite norm or a refused update (the worker then skips the update), and returned by
//! every later call.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use tch::{Device, Tensor};
use verl_actor::{LrSchedule, Reduction, Rows, Strategy, TrainState};
use verl_distributed::{Backend, Options, ProcessGroup, Rendezvous};
use verl_model::interop::LentTensors;
use verl_model::{
    BlockContext, CausalLM, ModelError, ModelSpec, ResponseScores, Rng, ScoreOutputs,
};
use verl_plugin_api::{RunContext, TensorRef};

use super::{ShardError, ShardOptions, ShardedModel};
use crate::dist::{Ranks, all_reduce};

/// Written by rank 0 next to the shards: the optimizer's update count, its settings, the
/// schedule and the worker's generator.
pub(crate) const TRAIN_STATE_FILE: &str = "train_state.json";

/// A [`ShardedModel`] driven by an `ActorWorker`.
pub struct ShardedStrategy {
    model: Mutex<ShardedModel>,
    group: Arc<Mutex<ProcessGroup>>,
    /// Where the model came from: the tokenizer files of the export.
    spec: ModelSpec,
    lent: LentTensors,
    /// The first collective failure of `clip_grad_norm` or `step`.
    failed: Option<String>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding either lock is caught at the ABI boundary; a failed collective
    // marks the group broken, so the state stays meaningful.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A sharded model's failure as the worker's model error.
pub(crate) fn shard_error(error: ShardError) -> ModelError {
    match error {
        ShardError::Model(e) => e,
        other => ModelError::Torch(format!("sharded model: {other}")),
    }
}

impl ShardedStrategy {
    pub fn new(model: ShardedModel, group: Arc<Mutex<ProcessGroup>>, spec: ModelSpec) -> Self {
        Self {
            model: Mutex::new(model),
            group,
            spec,
            lent: LentTensors::default(),
            failed: None,
        }
    }

    /// The sharded model of `run`'s rank over the process's shared group (`ranks`), or, on one
    /// rank (offloading), over a group of this process alone.
    pub fn for_run(
        model: CausalLM,
        ranks: &Ranks,
        run: &RunContext,
        options: ShardOptions,
        spec: ModelSpec,
    ) -> verl_model::Result<Self> {
        let group = match ranks.group() {
            Some(group) => Ok(Arc::clone(group)),
            None => {
                let rendezvous = Rendezvous {
                    rank: 0,
                    world_size: 1,
                    master_addr: "127.0.0.1".to_owned(),
                    // A port the system picks: a launcher's store may hold MASTER_PORT.
                    master_port: 0,
                };
                Backend::for_comm_backend(&run.comm_backend)
                    .and_then(|backend| {
                        ProcessGroup::init(&rendezvous, backend, &Options::default())
                    })
                    .map(|group| Arc::new(Mutex::new(group)))
            }
        }
        .map_err(|e| shard_error(e.into()))?;
        let model = ShardedModel::new(model, &mut lock(&group), options).map_err(shard_error)?;
        Ok(Self::new(model, group, spec))
    }

    /// Runs `f` on the model and the group, unless an earlier collective failed.
    fn run<T>(
        &self,
        f: impl FnOnce(&mut ShardedModel, &mut ProcessGroup) -> Result<T, ShardError>,
    ) -> verl_model::Result<T> {
        if let Some(failed) = &self.failed {
            return Err(ModelError::Torch(format!("sharded model: {failed}")));
        }
        let mut model = lock(&self.model);
        let mut group = lock(&self.group);
        f(&mut model, &mut group).map_err(shard_error)
    }

    /// The micro-batch's block context, laid out as the settings ask.
    fn context(&self, model: &ShardedModel, rows: &Rows) -> Result<BlockContext, ShardError> {
        Ok(rows.block_context(model.model())?)
    }

    /// Forward and backward of `rows` through the policy, with the model's load-balancing term
    /// × `aux_weight` when given and the model asks for one (see `Strategy::backward_scores_aux`).
    fn backward_with(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
        aux_weight: Option<f64>,
        loss: &mut dyn FnMut(&ResponseScores) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<Option<f64>> {
        self.run(|model, group| {
            let context = self.context(model, rows)?;
            model
                .forward_backward_aux(group, &context, aux_weight, |m, hidden| {
                    loss(&m.response_scores_in(
                        hidden,
                        &context,
                        rows.response_len,
                        temperature,
                        outputs,
                    )?)
                })
                .map(|(_, aux)| aux)
        })
    }

    /// The response scores of `rows` and the context of their forward pass.
    fn scored(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> verl_model::Result<(ResponseScores, BlockContext)> {
        self.run(|model, group| {
            let context = self.context(model, rows)?;
            let scores = model.forward(group, &context, |m, hidden| {
                m.response_scores_in(hidden, &context, rows.response_len, temperature, outputs)
            })?;
            Ok((scores, context))
        })
    }

    /// `f`'s value, or `fallback` with the failure kept for the next call.
    fn run_or_keep<T>(
        &mut self,
        fallback: T,
        f: impl FnOnce(&mut ShardedModel, &mut ProcessGroup) -> Result<T, ShardError>,
    ) -> T {
        match self.run(f) {
            Ok(value) => value,
            Err(error) => {
                self.failed.get_or_insert_with(|| error.to_string());
                fallback
            }
        }
    }
}

impl Strategy for ShardedStrategy {
    fn device(&self) -> Device {
        lock(&self.model).model().device()
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

    /// The forward records each sparse layer's experts in the context (a replayed pass records
    /// what it replayed).
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
        self.run(|model, group| {
            let context = self.context(model, rows)?;
            model.forward(group, &context, |m, hidden| {
                m.response_values_in(hidden, &context, rows.response_len)
            })
        })
    }

    fn backward_scores(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
        loss: &mut dyn FnMut(&ResponseScores) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<()> {
        self.backward_with(rows, temperature, outputs, None, loss)
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
        self.backward_with(rows, temperature, outputs, Some(aux_weight), loss)
    }

    fn backward_values(
        &self,
        rows: &Rows,
        loss: &mut dyn FnMut(&Tensor) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<()> {
        self.run(|model, group| {
            let context = self.context(model, rows)?;
            model.forward_backward(group, &context, |m, hidden| {
                loss(&m.response_values_in(hidden, &context, rows.response_len)?)
            })
        })
        .map(drop)
    }

    fn zero_grad(&mut self) {
        lock(&self.model).zero_grad();
    }

    fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        self.run_or_keep(f64::NAN, |model, group| {
            model.clip_grad_norm_global(group, max_norm)
        })
    }

    fn step(&mut self, lr: f64) -> bool {
        self.run_or_keep(false, |model, group| model.step(group, lr))
    }

    fn save(&self, dir: &Path, schedule: &LrSchedule, rng: &Rng) -> verl_model::Result<()> {
        self.run(|model, _| {
            model.save_shard(dir)?;
            let optimizer = model
                .options()
                .optimizer
                .ok_or(ShardError::NotTrainable { op: "save" })?;
            if model.rank() == 0 {
                let state = TrainState {
                    step: model.steps(),
                    optimizer,
                    schedule: *schedule,
                    rng: rng.clone(),
                };
                let path = dir.join(TRAIN_STATE_FILE);
                let json = serde_json::to_vec_pretty(&state).expect("the state serialises");
                std::fs::write(&path, json).map_err(|source| ModelError::Io { path, source })?;
            }
            Ok(())
        })
    }

    fn load(&mut self, dir: &Path) -> verl_model::Result<(LrSchedule, Rng)> {
        let path = dir.join(TRAIN_STATE_FILE);
        let text = std::fs::read(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        let state: TrainState =
            serde_json::from_slice(&text).map_err(|source| ModelError::Json { path, source })?;
        self.run(|model, _| model.load_shards(dir))?;
        Ok((state.schedule, state.rng))
    }

    /// Every rank gathers the whole model (each rank's rollout needs it).
    fn weights(&mut self) -> verl_model::Result<Vec<TensorRef<'_>>> {
        let named = self.run(|model, group| model.gather_full_weights(group))?;
        self.lent.lend(named)?;
        self.lent.views()
    }

    fn export_hf(&self, dir: &Path) -> verl_model::Result<()> {
        self.run(|model, group| model.export_hf(group, dir, Some(&self.spec.path)))
    }

    fn all_reduce(&mut self, values: &mut [f64], op: Reduction) -> verl_model::Result<()> {
        self.run(|model, group| Ok(all_reduce(group, values, op, model.model().device())?))
    }

    /// Nothing to do: the backward pass has already reduce-scattered (summed) every block's
    /// gradients into the shards.
    fn reduce_gradients(&mut self) -> verl_model::Result<()> {
        Ok(())
    }
}
