//! # verl-plugin-fsdp
//!
//! The `fsdp` engine component: a libtorch (tch) policy, reference or critic model trained with
//! verl's losses, data-parallel over the job's ranks, each computing on its slice of the batch
//! over PyTorch's c10d (Gloo on CPU). As verl's FSDP (`fsdp_config.fsdp_size` −1), more than one
//! rank shards the model (ZeRO-3, [`shard`]): each rank holds `1/N` of the parameters, gradients
//! and AdamW moments, gathers a block to run it and reduce-scatters its gradients; every rank
//! writes its shard of a checkpoint (which reloads at any world size) and takes part in the
//! export's gathers, rank 0 writing it. With `fsdp_size: 1` every rank holds a replica instead,
//! the gradients are summed before each step, and rank 0 alone writes checkpoints and the
//! export. Ranks join one process group per process (module `dist`), created from the run context by
//! the first engine initialised; `nccl_timeout` in the engine's section (verl's
//! `actor_rollout_ref.nccl_timeout`, seconds) bounds each collective. The same group carries the
//! trainer's object exchange (`all_gather_object`).
//!
//! Config (`ComponentInit::config`): verl's `actor_rollout_ref.actor` (or `critic`) section
//! with verl's keys and defaults (the shared [`verl_actor::ActorConfig`]; its own
//! `fsdp_config` is [`config::FsdpConfig`], parsed strictly), plus `"role": "actor" | "ref" |
//! "critic"` and `"model": {"path", "random_init", "enable_gradient_checkpointing", "dtype"}`.
//! Mini-batch sizes count sequences (the trainer has multiplied them by `rollout.n`).
//!
//! ## Supervised fine-tuning through `update_actor`
//! There is no SFT method in the ABI and none is needed: call `update_actor` with
//! `old_log_probs` = the current log-probs (from `compute_log_prob`), `advantages` = 1 on every
//! response token, `use_kl_loss = false` and `entropy_coeff = 0`. The PPO ratio is then exactly 1,
//! inside any clip range, and the vanilla loss `-A·ratio` has the gradient of the token-mean
//! negative log-likelihood of the responses (with one mini-batch and one epoch it *is* the NLL
//! gradient; later mini-batches see a slightly stale `old_log_probs`, which only matters if the
//! ratio leaves the clip range). The trainer's `sft` command relies on this.

pub mod config;
pub mod shard;

mod dist;
mod engine;
mod local;
mod placement;

use std::path::Path;

use verl_plugin_api::{
    Batch, ComponentInit, Engine, EngineCapabilities, Metric, PluginBuilder, PluginError, TensorRef,
};

use dist::Ranks;
use engine::{Worker, new_worker};
use verl_actor::ActorError;

/// The `fsdp` engine as the ABI sees it: the model, optimizer and settings once `init` has run,
/// and its place among the data-parallel ranks.
#[derive(Default)]
pub struct FsdpEngine {
    worker: Option<(Worker, Ranks)>,
}

impl FsdpEngine {
    fn worker(&mut self) -> Result<&mut Worker, ActorError> {
        self.worker
            .as_mut()
            .map(|(w, _)| w)
            .ok_or(ActorError::NotInitialised)
    }

    fn ranks(&self) -> Result<&Ranks, ActorError> {
        self.worker
            .as_ref()
            .map(|(_, r)| r)
            .ok_or(ActorError::NotInitialised)
    }

    /// Whether this rank writes checkpoints and takes part in the export: every rank holds a
    /// shard of a sharded model, a replicated one is written by rank 0 only.
    fn writes_state(&self) -> Result<bool, ActorError> {
        let (worker, ranks) = self.worker.as_ref().ok_or(ActorError::NotInitialised)?;
        Ok(worker.strategy().is_sharded() || ranks.rank() == 0)
    }
}

impl Engine for FsdpEngine {
    fn capabilities() -> EngineCapabilities {
        EngineCapabilities::default()
            .roles(["actor", "ref", "critic", "teacher"])
            .max_world_size(u32::MAX)
            .object_exchange(true)
            // The shared actor worker (verl-actor) does verl's on-policy shortcut.
            .on_policy_updates(true)
            // Router replay of a mixture-of-experts actor (verl's R2 / R3): its forwards
            // replay the batch's `routed_experts`.
            .config_keys(
                config::FsdpConfig::declared_keys()
                    .acts_on(["router_replay.mode", "use_prefix_grouper"]),
            )
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        self.worker = Some(new_worker(init)?);
        Ok(())
    }
    fn compute_log_prob(&mut self, batch: &Batch) -> Result<Batch, PluginError> {
        Ok(self.worker()?.compute_log_prob(batch)?)
    }
    fn compute_values(&mut self, batch: &Batch) -> Result<Batch, PluginError> {
        Ok(self.worker()?.compute_values(batch)?)
    }
    fn update_actor(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        Ok(self.worker()?.update_actor(batch)?)
    }
    fn update_critic(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        Ok(self.worker()?.update_critic(batch)?)
    }
    fn save_checkpoint(&mut self, dir: &str, global_step: u64) -> Result<(), PluginError> {
        if !self.writes_state()? {
            return Ok(());
        }
        Ok(self
            .worker()?
            .save_checkpoint(Path::new(dir), global_step)?)
    }
    fn load_checkpoint(&mut self, dir: &str) -> Result<u64, PluginError> {
        Ok(self.worker()?.load_checkpoint(Path::new(dir))?)
    }
    fn weights(&mut self) -> Result<Vec<TensorRef<'_>>, PluginError> {
        Ok(self.worker()?.weights()?)
    }
    fn export_hf(&mut self, dir: &str) -> Result<(), PluginError> {
        if !self.writes_state()? {
            return Ok(());
        }
        Ok(self.worker()?.export_hf(Path::new(dir))?)
    }
    fn all_gather_object(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, PluginError> {
        self.ranks()?
            .all_gather_bytes(bytes)
            .map_err(|e| PluginError::other(format!("data-parallel group: {e}")))
    }
}

verl_plugin_api::export_plugin!(
    PluginBuilder::new(
        "fsdp",
        env!("CARGO_PKG_VERSION"),
        "libtorch training engine (actor, ref, critic)"
    )
    .engine(
        "fsdp",
        100,
        "verl's PPO/GRPO actor, reference and critic on libtorch; data-parallel over c10d",
        FsdpEngine::default
    )
    .config_section("fsdp_config")
);
