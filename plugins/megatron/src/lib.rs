//! # verl-plugin-megatron
//!
//! The `megatron` engine component (verl's `actor_rollout_ref.actor.strategy=megatron`): a
//! libtorch (tch) policy, reference or critic model trained with verl's losses (the shared
//! [`verl_actor::ActorWorker`]) and split over the job's ranks as Megatron-LM
//! splits it: `tensor_model_parallel_size` ranks hold one copy of the model between them
//! (column- and row-parallel projections, vocab-parallel embedding and LM head; [`model`]), with
//! `sequence_parallel` the norm and residual regions split along the sequence, and the
//! `world_size / tp` copies are data-parallel replicas. Ranks talk over PyTorch's c10d
//! (verl-distributed: one process group per process, split into tensor- and data-parallel
//! subgroups; module `comm`).
//!
//! The trainer hands every rank its contiguous slice of a batch, as for any data-parallel
//! engine; the ranks of a tensor-parallel group (adjacent ranks) gather their slices, compute on
//! the group's rows together, and each returns its own slice of per-token outputs.
//!
//! Config (`ComponentInit::config`): verl's `actor_rollout_ref.actor` (or `ref`, `critic`)
//! section with verl's keys and defaults, plus its own `megatron` section
//! ([`config::MegatronConfig`], verl's `McoreEngineConfig`, parsed strictly), `"role"` and
//! `"model"` as for the `fsdp` engine. Checkpoints hold one file per tensor-parallel rank with a
//! layout file and load at any tensor-parallel size; `export_hf` writes what the `fsdp` engine
//! writes for the same weights.

pub mod config;
pub mod model;
pub mod strategy;

mod comm;
mod seq;
mod tape;

use std::path::Path;
use std::time::Duration;

use tch::{Device, Tensor};
use verl_actor::{ActorConfig, ActorError, ActorWorker, Role};
use verl_model::interop::{from_tch, to_tch};
use verl_model::{Head, parse_device};
use verl_plugin_api::{
    Batch, ComponentInit, Engine, EngineCapabilities, Metric, PluginBuilder, PluginError, TensorRef,
};

pub use comm::{Comm, Scope, Traffic};
use config::MegatronConfig;
use model::TpModel;
use strategy::{TpStrategy, Worker};

/// verl's `nccl_timeout` default (seconds), for a host that does not send the key.
const DEFAULT_COLLECTIVE_TIMEOUT_S: u64 = 600;

/// The `megatron` engine as the ABI sees it: the worker once `init` has run, and its place in
/// the rank grid.
#[derive(Default)]
pub struct MegatronEngine {
    worker: Option<(Worker, Comm)>,
}

/// The worker of one role on this rank's shard, and the rank grid.
pub fn new_worker(init: &ComponentInit) -> Result<(Worker, Comm), ActorError> {
    let run = &init.run;
    let mut settings = init.config::<ActorConfig>("megatron")?.validate()?;
    let megatron = MegatronConfig::of(init, settings.role)?;
    let layout = megatron.layout(&MegatronConfig::path(init, settings.role), run.world_size)?;
    // As verl's workers: the (global) mini-batch is split over the data-parallel ranks.
    let dp = (run.world_size.max(1) / (layout.tp * layout.cp)) as usize;
    if settings.mini_batch % dp != 0 {
        return Err(ActorError::Config {
            key: "ppo_mini_batch_size".into(),
            reason: format!(
                "{} sequences (ppo_mini_batch_size × rollout.n) do not split evenly over {dp} data-parallel ranks",
                settings.mini_batch
            ),
        });
    }
    settings.mini_batch /= dp;
    let timeout = init
        .config
        .get("nccl_timeout")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(DEFAULT_COLLECTIVE_TIMEOUT_S);
    let comm = Comm::join(
        run,
        layout.tp,
        layout.cp,
        Duration::from_secs(timeout.max(1)),
    )?;
    let head = if settings.role == Role::Critic {
        Head::Value
    } else {
        Head::Lm
    };
    let full = settings
        .model
        .load(parse_device(&run.device)?, head, run.seed)?;
    let mut model = TpModel::new(full, comm.clone(), layout.sequence_parallel)?;
    let optimizer = settings.role.trains().then_some(settings.optimizer);
    if optimizer.is_none() {
        model.local_mut().set_trainable(false);
    }
    let spec = settings.model.clone();
    let strategy = TpStrategy::new(model, optimizer, spec);
    Ok((ActorWorker::new(settings, strategy, run.seed), comm))
}

/// The rows of this rank's model-parallel group (tensor × context ranks, adjacent), whose ranks
/// each received a slice of the batch: every slice gathered in rank order. Returns them with the
/// first row of this rank's slice and its length.
pub fn group_rows(comm: &Comm, batch: &Batch) -> Result<(Batch, i64, i64), ActorError> {
    let rows = batch.tensors.first().map_or(0, |t| t.tensor.shape[0]);
    if comm.size(Scope::Model) == 1 {
        return Ok((batch.clone(), 0, rows));
    }
    let counts = comm.all_gather(Scope::Model, &Tensor::from_slice(&[rows]))?;
    let counts: Vec<i64> = (0..counts.size()[0])
        .map(|r| counts.int64_value(&[r, 0]))
        .collect();
    let longest = counts.iter().copied().max().unwrap_or(0);
    let start = counts[..comm.rank_in(Scope::Model) as usize].iter().sum();
    let mut out = Batch {
        meta_json: batch.meta_json.clone(),
        ..Batch::default()
    };
    for named in &batch.tensors {
        let name = named.name.as_str();
        let tensor = to_tch(name, &named.tensor, Device::Cpu)?;
        let size = tensor.size();
        if size.first() != Some(&rows) {
            return Err(ActorError::Batch(format!(
                "`{name}` has shape {size:?}; every tensor of a batch has its {rows} rows"
            )));
        }
        let mut pad = size.clone();
        pad[0] = longest - rows;
        let zeros = Tensor::zeros(pad.as_slice(), (tensor.kind(), Device::Cpu));
        let padded = Tensor::cat(&[tensor, zeros], 0);
        let stacked = comm.all_gather(Scope::Model, &padded)?;
        let parts: Vec<Tensor> = counts
            .iter()
            .enumerate()
            .map(|(r, &n)| stacked.select(0, r as i64).narrow(0, 0, n))
            .collect();
        out.insert(name, from_tch(name, &Tensor::cat(&parts, 0))?);
    }
    Ok((out, start, rows))
}

/// Rows `start .. start + len` of every tensor of `batch`.
fn narrow_rows(batch: Batch, start: i64, len: i64) -> Result<Batch, ActorError> {
    let mut out = Batch {
        meta_json: batch.meta_json.clone(),
        ..Batch::default()
    };
    for named in &batch.tensors {
        let name = named.name.as_str();
        let tensor = to_tch(name, &named.tensor, Device::Cpu)?;
        out.insert(name, from_tch(name, &tensor.narrow(0, start, len))?);
    }
    Ok(out)
}

impl MegatronEngine {
    fn worker(&mut self) -> Result<(&mut Worker, &Comm), ActorError> {
        self.worker
            .as_mut()
            .map(|(w, c)| (w, &*c))
            .ok_or(ActorError::NotInitialised)
    }

    /// A per-row computation on the group's rows; this rank's rows of the result.
    fn per_row(
        &mut self,
        batch: &Batch,
        f: impl FnOnce(&mut Worker, &Batch) -> Result<Batch, ActorError>,
    ) -> Result<Batch, ActorError> {
        let (worker, comm) = self.worker()?;
        let (rows, start, len) = group_rows(comm, batch)?;
        narrow_rows(f(worker, &rows)?, start, len)
    }

    /// An update on the group's rows (every rank reports the same metrics).
    fn update(
        &mut self,
        batch: &Batch,
        f: impl FnOnce(&mut Worker, &Batch) -> Result<Vec<Metric>, ActorError>,
    ) -> Result<Vec<Metric>, ActorError> {
        let (worker, comm) = self.worker()?;
        let (rows, _, _) = group_rows(comm, batch)?;
        f(worker, &rows)
    }
}

impl Engine for MegatronEngine {
    fn capabilities() -> EngineCapabilities {
        EngineCapabilities::default()
            .roles(["actor", "ref", "critic"])
            .max_world_size(u32::MAX)
            .object_exchange(true)
            // The shared actor worker (verl-actor) does verl's on-policy shortcut.
            .on_policy_updates(true)
            // libtorch's own devices (ROCm builds expose AMD GPUs as `cuda`); an Ascend NPU needs
            // MindSpeed, which verl resolves `strategy=megatron` to there (a plugin engine
            // declaring `strategies(["megatron"])` on `npu`).
            .devices(["cpu", "cuda"])
            .config_keys(MegatronConfig::declared_keys())
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        self.worker = Some(new_worker(init)?);
        Ok(())
    }
    fn compute_log_prob(&mut self, batch: &Batch) -> Result<Batch, PluginError> {
        Ok(self.per_row(batch, |w, rows| w.compute_log_prob(rows))?)
    }
    fn compute_values(&mut self, batch: &Batch) -> Result<Batch, PluginError> {
        Ok(self.per_row(batch, |w, rows| w.compute_values(rows))?)
    }
    fn update_actor(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        Ok(self.update(batch, |w, rows| w.update_actor(rows))?)
    }
    fn update_critic(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        Ok(self.update(batch, |w, rows| w.update_critic(rows))?)
    }
    /// The first data- and context-parallel replica writes: one file per tensor-parallel rank.
    fn save_checkpoint(&mut self, dir: &str, global_step: u64) -> Result<(), PluginError> {
        let (worker, comm) = self.worker()?;
        if comm.rank_in(Scope::DataContext) != 0 {
            return Ok(());
        }
        Ok(worker.save_checkpoint(Path::new(dir), global_step)?)
    }
    fn load_checkpoint(&mut self, dir: &str) -> Result<u64, PluginError> {
        Ok(self.worker()?.0.load_checkpoint(Path::new(dir))?)
    }
    fn weights(&mut self) -> Result<Vec<TensorRef<'_>>, PluginError> {
        Ok(self.worker()?.0.weights()?)
    }
    fn export_hf(&mut self, dir: &str) -> Result<(), PluginError> {
        Ok(self.worker()?.0.export_hf(Path::new(dir))?)
    }
    fn all_gather_object(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, PluginError> {
        let (_, comm) = self.worker()?;
        comm.all_gather_bytes(bytes)
            .map_err(|e| PluginError::other(format!("object exchange: {e}")))
    }
}

verl_plugin_api::export_plugin!(
    PluginBuilder::new(
        "megatron",
        env!("CARGO_PKG_VERSION"),
        "tensor- and sequence-parallel training engine (actor, ref, critic)"
    )
    .engine(
        "megatron",
        100,
        "verl's PPO/GRPO actor, reference and critic on libtorch, split as Megatron-LM splits it: tensor and sequence parallel, data-parallel replicas, over c10d",
        MegatronEngine::default
    )
    .config_section("megatron")
);
