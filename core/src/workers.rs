//! The trainer's view of its engines and rollout: plain Rust signatures, whatever runs behind them.
//!
//! This is the seam for placement. Today every engine and rollout is one local plugin object (the
//! host's [`EngineHandle`] / [`RolloutHandle`]). A multi-rank worker group implements the same
//! traits by sending each call to its ranks (splitting the batch over data-parallel ranks and
//! gathering the outputs), so the trainer's loop does not change when it scales out.

use verl_plugin_api::{
    Batch, GenerateOutput, GenerateRequest, Metric, PluginError, TensorRef, WeightSource,
};
use verl_plugin_host::{CheckpointHandle, EngineHandle, RolloutHandle};

/// A training backend for one role (actor, ref or critic), already initialised.
pub trait EngineWorker {
    fn compute_log_prob(&mut self, batch: &Batch) -> Result<Batch, PluginError>;
    fn compute_values(&mut self, batch: &Batch) -> Result<Batch, PluginError>;
    fn update_actor(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError>;
    fn update_critic(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError>;
    fn save_checkpoint(&mut self, dir: &str, global_step: u64) -> Result<(), PluginError>;
    fn load_checkpoint(&mut self, dir: &str) -> Result<u64, PluginError>;
    /// The full weights as views, valid while the borrow lasts.
    fn weights(&mut self) -> Result<Vec<TensorRef<'_>>, PluginError>;
    fn export_hf(&mut self, dir: &str) -> Result<(), PluginError>;
}

/// A generator, already initialised.
pub trait RolloutWorker {
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError>;
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError>;
}

impl EngineWorker for EngineHandle {
    fn compute_log_prob(&mut self, batch: &Batch) -> Result<Batch, PluginError> {
        EngineHandle::compute_log_prob(self, batch)
    }
    fn compute_values(&mut self, batch: &Batch) -> Result<Batch, PluginError> {
        EngineHandle::compute_values(self, batch)
    }
    fn update_actor(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        EngineHandle::update_actor(self, batch)
    }
    fn update_critic(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        EngineHandle::update_critic(self, batch)
    }
    fn save_checkpoint(&mut self, dir: &str, global_step: u64) -> Result<(), PluginError> {
        EngineHandle::save_checkpoint(self, dir, global_step)
    }
    fn load_checkpoint(&mut self, dir: &str) -> Result<u64, PluginError> {
        EngineHandle::load_checkpoint(self, dir)
    }
    fn weights(&mut self) -> Result<Vec<TensorRef<'_>>, PluginError> {
        EngineHandle::weights(self)
    }
    fn export_hf(&mut self, dir: &str) -> Result<(), PluginError> {
        EngineHandle::export_hf(self, dir)
    }
}

impl RolloutWorker for RolloutHandle {
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        RolloutHandle::generate(self, request)
    }
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        RolloutHandle::update_weights(self, source)
    }
}

/// Which step of a weight sync failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("taking the actor's weights: {0}")]
    Export(PluginError),
    #[error("weight sync `{backend}`: {error}")]
    Publish { backend: String, error: PluginError },
    #[error("updating the rollout's weights: {0}")]
    Update(PluginError),
}

/// What one sync moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncStats {
    /// Bytes of weights the actor lent (the rollout copies them once).
    pub bytes: usize,
    pub tensors: usize,
}

/// Actor → weight sync → rollout, by reference: the actor lends views of its weights, the weight
/// sync publishes them (memory: as they are; file: a directory; collective: a transfer) and the
/// rollout takes them from where the sync says. The views outlive neither call.
pub fn sync_weights(
    actor: &mut dyn EngineWorker,
    weight_sync: &mut CheckpointHandle,
    backend: &str,
    rollout: &mut dyn RolloutWorker,
    version: u64,
) -> Result<SyncStats, SyncError> {
    let views = actor.weights().map_err(SyncError::Export)?;
    let lent = WeightSource::memory(version, &views);
    let stats = SyncStats {
        bytes: lent.bytes(),
        tensors: views.len(),
    };
    let publish = |error| SyncError::Publish {
        backend: backend.to_owned(),
        error,
    };
    let handover = weight_sync.send_weights(&lent).map_err(publish)?;
    let handover_json = WeightSource::encode_handover(&handover);
    rollout
        .update_weights(&WeightSource::from_handover(
            version,
            &views,
            &handover_json,
        ))
        .map_err(SyncError::Update)?;
    drop(views);
    weight_sync.finalize().map_err(publish)?;
    Ok(stats)
}
