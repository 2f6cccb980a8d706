//! verl's actor semantics ([`ActorWorker`]) on a tensor-parallel shard: the [`Strategy`] of the
//! `megatron` engine. Each data-parallel rank holds its tensor-parallel group's model once
//! (sharded over the group); gradients are summed over the data-parallel group, AdamW runs on
//! each rank's shard, and the gradient norm is the whole model's.
//!
//! `Strategy::clip_grad_norm` and `Strategy::step` cannot return an error: a collective failure
//! there is kept, reported as a non-finite norm or a refused update (the worker then skips the
//! update), and returned by every later call.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Device, Tensor};
use verl_actor::{
    ActorWorker, AdamW, AdamWConfig, LrSchedule, Reduction, Rows, Strategy, TRAIN_STATE_FILE,
    TrainState, load_training_state_from,
};
use verl_distributed::ReduceOp;
use verl_model::interop::LentTensors;
use verl_model::{
    CausalLM, ModelError, ModelOptions, ModelSpec, ResponseScores, Rng, ScoreOutputs,
    read_safetensors, write_safetensors,
};
use verl_plugin_api::{TensorRef, keys};

use crate::comm::Scope;
use crate::model::{Split, TpModel};
use crate::tape::Tape;

/// The engine of one role.
pub type Worker = ActorWorker<TpStrategy>;

/// Which parameters a checkpoint holds and how they were split.
pub const LAYOUT_FILE: &str = "megatron_layout.json";

#[derive(Debug, Serialize, Deserialize)]
struct Layout {
    tensor_model_parallel_size: u32,
    /// Every parameter of the whole model: name, whole shape, split.
    params: Vec<(String, Vec<i64>, Split)>,
}

/// Tensor-parallel rank `rank`'s file of a checkpoint saved by `tp` ranks: its shard of every
/// parameter and of AdamW's moments.
pub fn shard_file(rank: u32, tp: u32) -> String {
    format!("megatron_tp_{rank:02}_of_{tp:02}.safetensors")
}

pub struct TpStrategy {
    model: TpModel,
    /// `None` for the reference policy.
    optimizer: Option<AdamW>,
    spec: ModelSpec,
    lent: LentTensors,
    /// The first collective failure of `clip_grad_norm` or `step`.
    failed: Option<String>,
}

fn checkpoint_error(path: &Path, reason: impl std::fmt::Display) -> ModelError {
    ModelError::InvalidInput {
        tensor: path.display().to_string(),
        reason: reason.to_string(),
    }
}

impl TpStrategy {
    /// The strategy of `model`, packing micro-batches when `spec` asks (`use_remove_padding`).
    pub fn new(mut model: TpModel, optimizer: Option<AdamWConfig>, spec: ModelSpec) -> Self {
        model.set_remove_padding(spec.use_remove_padding);
        Self {
            optimizer: optimizer.map(|config| AdamW::for_model(model.local(), config)),
            model,
            spec,
            lent: LentTensors::default(),
            failed: None,
        }
    }

    fn optimizer(&self) -> &AdamW {
        self.optimizer
            .as_ref()
            .expect("the worker only trains roles that have an optimizer")
    }

    fn check(&self) -> verl_model::Result<()> {
        match &self.failed {
            Some(first) => Err(ModelError::Torch(first.clone())),
            None => Ok(()),
        }
    }

    /// `f`'s value, or `fallback` with the failure kept for the next call.
    fn or_keep<T>(&mut self, fallback: T, f: impl FnOnce(&mut Self) -> verl_model::Result<T>) -> T {
        if self.failed.is_some() {
            return fallback;
        }
        match f(self) {
            Ok(value) => value,
            Err(error) => {
                self.failed = Some(error.to_string());
                fallback
            }
        }
    }

    fn rows(rows: &Rows) -> (&Tensor, &Tensor) {
        (rows.get(keys::INPUT_IDS), rows.get(keys::ATTENTION_MASK))
    }

    /// The whole model's parameters (every tensor-parallel rank calls it).
    fn full_weights(&self) -> verl_model::Result<Vec<(String, Tensor)>> {
        self.model.gather_full(&self.model.local().named_tensors())
    }

    /// Reads a checkpoint saved at any tensor-parallel size: this rank's shard of every
    /// parameter and moment, by name.
    fn read_shards(&self, dir: &Path) -> verl_model::Result<(PathBuf, HashMap<String, Tensor>)> {
        let path = dir.join(LAYOUT_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| checkpoint_error(&path, e))?;
        let layout: Layout = serde_json::from_str(&text).map_err(|e| checkpoint_error(&path, e))?;
        let (tp, rank) = (self.model.comm().tp_size(), self.model.comm().tp_rank());
        let mine = self.full_weights_shapes();
        let names = |v: Vec<&String>| v.into_iter().cloned().collect::<Vec<_>>();
        if names(mine.iter().map(|(n, _)| n).collect())
            != names(layout.params.iter().map(|(n, ..)| n).collect())
        {
            return Err(checkpoint_error(
                &path,
                "holds other parameters than this model (another architecture or head)",
            ));
        }
        for ((name, shape, _), (_, expected)) in layout.params.iter().zip(&mine) {
            if shape != expected {
                return Err(checkpoint_error(
                    &path,
                    format!(
                        "parameter {name} was saved with shape {shape:?}, this model's is {expected:?}"
                    ),
                ));
            }
        }
        let full = self.model.full_config();
        let saved_tp = layout.tensor_model_parallel_size;
        if saved_tp == tp {
            let source = dir.join(shard_file(rank, tp));
            return Ok((
                source.clone(),
                read_safetensors(&source)?.into_iter().collect(),
            ));
        }
        // Another tensor-parallel size: the whole tensors from every saved shard, then ours.
        let files: Vec<HashMap<String, Tensor>> = (0..saved_tp)
            .map(|r| {
                Ok(read_safetensors(&dir.join(shard_file(r, saved_tp)))?
                    .into_iter()
                    .collect())
            })
            .collect::<verl_model::Result<_>>()?;
        let split_of = |name: &str, tp: u32| {
            layout
                .params
                .iter()
                .find(|(param, ..)| name == param || name.ends_with(&format!(".{param}")))
                .map(|(param, ..)| Split::of(param, full, tp))
        };
        let mut out = HashMap::new();
        for name in files[0].keys() {
            let (Some(old), Some(new)) = (split_of(name, saved_tp), split_of(name, tp)) else {
                continue;
            };
            let stacked = Tensor::stack(
                &files
                    .iter()
                    .map(|f| f[name].shallow_clone())
                    .collect::<Vec<_>>(),
                0,
            );
            let whole = old.unshard(&stacked, saved_tp);
            out.insert(name.clone(), new.shard(&whole, rank, tp).contiguous());
        }
        Ok((dir.join(shard_file(0, saved_tp)), out))
    }
}

impl Strategy for TpStrategy {
    fn device(&self) -> Device {
        self.model.local().device()
    }

    fn scores(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> verl_model::Result<ResponseScores> {
        self.check()?;
        let (ids, mask) = Self::rows(rows);
        self.model
            .response_scores(ids, mask, rows.response_len, temperature, outputs, None)
    }

    fn values(&self, rows: &Rows) -> verl_model::Result<Tensor> {
        self.check()?;
        let (ids, mask) = Self::rows(rows);
        self.model
            .response_values(ids, mask, rows.response_len, None)
    }

    fn backward_scores(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
        loss: &mut dyn FnMut(&ResponseScores) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<()> {
        self.check()?;
        let (ids, mask) = Self::rows(rows);
        let tape = Tape::default();
        let scores = self.model.response_scores(
            ids,
            mask,
            rows.response_len,
            temperature,
            outputs,
            Some(&tape),
        )?;
        tape.backward(&loss(&scores)?, self.model.comm())
    }

    fn backward_values(
        &self,
        rows: &Rows,
        loss: &mut dyn FnMut(&Tensor) -> verl_model::Result<Tensor>,
    ) -> verl_model::Result<()> {
        self.check()?;
        let (ids, mask) = Self::rows(rows);
        let tape = Tape::default();
        let values = self
            .model
            .response_values(ids, mask, rows.response_len, Some(&tape))?;
        tape.backward(&loss(&values)?, self.model.comm())
    }

    fn zero_grad(&mut self) {
        self.optimizer().zero_grad();
    }

    fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        self.or_keep(f64::NAN, |s| {
            let total = s.model.grad_norm_squared()?.sqrt();
            if total.is_finite() {
                let coef = (max_norm / (total + 1e-6)).min(1.0);
                tch::no_grad(|| {
                    for (_, param) in s.model.local().named_tensors() {
                        let mut grad = param.grad();
                        if grad.defined() {
                            let _ = grad.g_mul_scalar_(coef);
                        }
                    }
                });
            }
            Ok(total)
        })
    }

    fn step(&mut self, lr: f64) -> bool {
        self.or_keep(false, |s| {
            let grads: Vec<Tensor> = s
                .model
                .local()
                .named_tensors()
                .into_iter()
                .filter(|(_, p)| p.requires_grad())
                .map(|(_, p)| p.grad())
                .collect();
            let comm = s.model.comm().clone();
            // Every rank applies its shard's update or every rank skips.
            s.optimizer
                .as_mut()
                .expect("the worker only trains roles that have an optimizer")
                .step_with_grads(lr, &grads, |finite| comm.all_agree(finite))
        })
    }

    /// This rank's shard of the parameters and moments; the tensor-parallel rank 0 adds the
    /// layout and the training state.
    fn save(&self, dir: &Path, schedule: &LrSchedule, rng: &Rng) -> verl_model::Result<()> {
        self.check()?;
        std::fs::create_dir_all(dir).map_err(|e| checkpoint_error(dir, e))?;
        let comm = self.model.comm();
        let optimizer = self.optimizer();
        let mut tensors = self.model.local().named_tensors();
        tensors.extend(optimizer.state_tensors());
        write_safetensors(
            &dir.join(shard_file(comm.tp_rank(), comm.tp_size())),
            &tensors,
        )?;
        if comm.tp_rank() == 0 {
            let full = self.model.full_config();
            let layout = Layout {
                tensor_model_parallel_size: comm.tp_size(),
                params: self
                    .full_weights_shapes()
                    .into_iter()
                    .map(|(name, shape)| {
                        let split = Split::of(&name, full, comm.tp_size());
                        (name, shape, split)
                    })
                    .collect(),
            };
            let state = TrainState {
                step: optimizer.steps(),
                optimizer: *optimizer.config(),
                schedule: *schedule,
                rng: rng.clone(),
            };
            for (file, text) in [
                (LAYOUT_FILE, serde_json::to_string_pretty(&layout)),
                (TRAIN_STATE_FILE, serde_json::to_string_pretty(&state)),
            ] {
                let path = dir.join(file);
                let text = text.map_err(|e| checkpoint_error(&path, e))?;
                std::fs::write(&path, text).map_err(|e| checkpoint_error(&path, e))?;
            }
        }
        Ok(())
    }

    fn load(&mut self, dir: &Path) -> verl_model::Result<(LrSchedule, Rng)> {
        self.check()?;
        let (source, tensors) = self.read_shards(dir)?;
        let optimizer = self
            .optimizer
            .as_mut()
            .expect("the worker only loads roles that have an optimizer");
        let state =
            load_training_state_from(dir, &source, &tensors, self.model.local(), optimizer)?;
        Ok((state.schedule, state.rng))
    }

    /// The whole model's weights (every rank takes part in the gather).
    fn weights(&mut self) -> verl_model::Result<Vec<TensorRef<'_>>> {
        self.check()?;
        let full = self.full_weights()?;
        self.lent.lend(full)?;
        self.lent.views()
    }

    /// The whole model in Hugging Face's layout, written by rank 0 as the `fsdp` engine writes
    /// it (every rank takes part in the gather).
    fn export_hf(&self, dir: &Path) -> verl_model::Result<()> {
        self.check()?;
        let full = self.full_weights()?;
        if self.model.comm().rank() != 0 {
            return Ok(());
        }
        let local = self.model.local();
        let options = ModelOptions {
            device: Device::Cpu,
            kind: local.kind(),
            head: local.head(),
            seed: 0,
        };
        let whole = CausalLM::zeroed(self.model.full_config().clone(), &options)?;
        whole.load_named_tensors(&full)?;
        whole.save_pretrained(dir, Some(&self.spec.path))
    }

    fn all_reduce(&mut self, values: &mut [f64], op: Reduction) -> verl_model::Result<()> {
        self.check()?;
        let op = match op {
            Reduction::Sum => ReduceOp::Sum,
            Reduction::Max => ReduceOp::Max,
        };
        self.model.comm().all_reduce_dp(values, op)
    }

    /// verl's Megatron worker: `max_token_len × context_parallel_size` (each context-parallel
    /// rank runs its share of every sequence).
    fn token_budget_scale(&self) -> usize {
        self.model.comm().cp_size() as usize
    }

    /// Shards held by several tensor-parallel ranks made whole, then every gradient summed over
    /// the data-parallel and context-parallel ranks (each saw its rows, its chunks).
    fn reduce_gradients(&mut self) -> verl_model::Result<()> {
        self.check()?;
        self.model.reduce_shared_gradients()?;
        let mut grads: Vec<Tensor> = self
            .model
            .local()
            .named_tensors()
            .into_iter()
            .filter(|(_, p)| p.requires_grad())
            .map(|(_, p)| p.grad())
            .filter(Tensor::defined)
            .collect();
        self.model
            .comm()
            .all_reduce_tensors(Scope::DataContext, &mut grads)
    }
}

impl TpStrategy {
    /// Every parameter's whole shape, from this rank's shard and its split.
    fn full_weights_shapes(&self) -> Vec<(String, Vec<i64>)> {
        let tp = self.model.comm().tp_size();
        self.model
            .local()
            .named_tensors()
            .into_iter()
            .zip(self.model.splits())
            .map(|((name, t), (_, split))| {
                let shape = split.whole_shape(&t.size(), tp);
                (name, shape)
            })
            .collect()
    }
}
