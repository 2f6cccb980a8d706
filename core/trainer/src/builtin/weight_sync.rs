//! Weight sync from the trainer to the rollout (verl's checkpoint engines). `naive` hands the
//! actor's tensors over by reference — trainer and rollout share the process; `disk` writes them as
//! a safetensors directory and hands the rollout its path, the route to a rollout in another
//! process (e.g. an inference server's reload from disk). With `double_buffer`, `disk` writes into
//! a two-slot store ([`crate::weight_slots`]) instead: the slot the rollout may still be reading is
//! never rewritten, and [`crate::workers::sync_weights`] loads a slot while holding it — what a
//! rollout that reads while the trainer writes (an asynchronous trainer) needs.

use std::collections::HashMap;
use std::path::PathBuf;

use crate::weight_slots::SlotStore;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use verl_plugin_api::{
    CheckpointCapabilities, CheckpointEngine, ComponentInit, DType, Handover, PluginError,
    WeightSource, WeightSourceKind,
};

#[derive(Default)]
pub struct NaiveWeightSync;

impl CheckpointEngine for NaiveWeightSync {
    fn capabilities() -> CheckpointCapabilities {
        CheckpointCapabilities::default().handover(WeightSourceKind::Memory)
    }

    fn init(&mut self, _init: &ComponentInit) -> Result<(), PluginError> {
        Ok(())
    }

    fn send_weights(&mut self, _weights: &WeightSource<'_>) -> Result<Handover, PluginError> {
        Ok(Handover::memory())
    }
}

/// `actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.disk`.
#[derive(Deserialize, Serialize, Default)]
#[serde(default)]
struct DiskConfig {
    /// Directory for the handover directories; default `<run_dir>/weight_sync`.
    path: Option<PathBuf>,
    /// Write into two alternating slots with a checksum and a version each, flipping a pointer
    /// (instead of one directory per step, removed after the rollout loaded it).
    double_buffer: bool,
}

#[derive(Default)]
pub struct DiskWeightSync {
    dir: PathBuf,
    last: Option<PathBuf>,
    slots: Option<SlotStore>,
}

/// Metadata key of the weights' version in the safetensors header.
pub const VERSION_METADATA_KEY: &str = "global_steps";
/// The file a handover directory holds (the name Hugging Face loaders look for).
pub const WEIGHTS_FILE: &str = "model.safetensors";

fn to_safetensors_dtype(dtype: DType) -> Result<Dtype, PluginError> {
    Ok(match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::U8 => Dtype::U8,
        DType::BOOL => Dtype::BOOL,
        other => {
            return Err(PluginError::other(format!(
                "disk weight sync: unsupported dtype code {}",
                other.0
            )));
        }
    })
}

fn io_error(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> PluginError + '_ {
    move |e| {
        PluginError::new(
            verl_plugin_api::ErrorKind::IO,
            format!("{}: {e}", path.display()),
        )
    }
}

fn slot_error(e: crate::weight_slots::SlotError) -> PluginError {
    PluginError::new(verl_plugin_api::ErrorKind::IO, e.to_string())
}

impl CheckpointEngine for DiskWeightSync {
    fn capabilities() -> CheckpointCapabilities {
        CheckpointCapabilities::default().handover(WeightSourceKind::File)
    }

    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        let config: DiskConfig =
            init.section("actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.disk")?;
        self.dir = config
            .path
            .unwrap_or_else(|| PathBuf::from(&init.run.run_dir).join("weight_sync"));
        std::fs::create_dir_all(&self.dir).map_err(io_error(&self.dir))?;
        if config.double_buffer {
            let store = SlotStore::open(&self.dir, WEIGHTS_FILE).map_err(slot_error)?;
            // Versions are the run's steps: an earlier run's slots would look newer.
            store.clear().map_err(slot_error)?;
            self.slots = Some(store);
        }
        Ok(())
    }

    /// Writes `<dir>/step_<version>/model.safetensors` under a temporary name and renames the
    /// directory, so a reader never sees half a file; hands over the directory.
    fn send_weights(&mut self, weights: &WeightSource<'_>) -> Result<Handover, PluginError> {
        let views = weights
            .tensors
            .iter()
            .map(|t| {
                let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
                let view =
                    TensorView::new(to_safetensors_dtype(t.dtype)?, shape, t.data.as_slice())
                        .map_err(|e| PluginError::other(format!("tensor `{}`: {e}", t.name)))?;
                Ok((t.name.as_str(), view))
            })
            .collect::<Result<Vec<_>, PluginError>>()?;
        let metadata =
            HashMap::from([(VERSION_METADATA_KEY.to_owned(), weights.version.to_string())]);
        if let Some(store) = &self.slots {
            let record = store
                .publish(weights.version, |file| {
                    safetensors::serialize_to_file(views, Some(metadata), file)
                        .map_err(|e| e.to_string())
                })
                .map_err(slot_error)?;
            return Ok(Handover::file(
                store.slot_dir(record.slot).to_string_lossy(),
            ));
        }
        let name = format!("step_{}", weights.version);
        let target = self.dir.join(&name);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io_error(&tmp))?;
        }
        std::fs::create_dir_all(&tmp).map_err(io_error(&tmp))?;
        let file = tmp.join(WEIGHTS_FILE);
        safetensors::serialize_to_file(views, Some(metadata), &file)
            .map_err(|e| PluginError::other(format!("{}: {e}", file.display())))?;
        if target.exists() {
            std::fs::remove_dir_all(&target).map_err(io_error(&target))?;
        }
        std::fs::rename(&tmp, &target).map_err(io_error(&target))?;
        self.last = Some(target.clone());
        Ok(Handover::file(target.to_string_lossy()))
    }

    fn finalize(&mut self) -> Result<(), PluginError> {
        if let Some(dir) = self.last.take() {
            std::fs::remove_dir_all(&dir).map_err(io_error(&dir))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::weight_slots::SlotStore;
    use verl_plugin_api::{NamedTensor, RunContext, Tensor};

    use super::*;

    fn tensors() -> Vec<NamedTensor> {
        vec![
            NamedTensor::new(
                "a.weight",
                Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, -4.5]).unwrap(),
            ),
            NamedTensor::new("b.bias", Tensor::from_slice(&[3], &[7i64, 8, 9]).unwrap()),
        ]
    }

    #[test]
    fn naive_hands_over_the_memory() {
        let owned = tensors();
        let views: Vec<_> = owned.iter().map(NamedTensor::as_ref).collect();
        let handover = NaiveWeightSync
            .send_weights(&WeightSource::memory(3, &views))
            .unwrap();
        assert_eq!(handover.kind, WeightSourceKind::Memory);
    }

    #[test]
    fn disk_writes_a_directory_and_hands_over_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let mut sync = DiskWeightSync::default();
        let mut run = RunContext::default();
        run.run_dir = dir.path().to_string_lossy().into_owned();
        sync.init(&ComponentInit::new(serde_json::Value::Null, run))
            .unwrap();
        let owned = tensors();
        let views: Vec<_> = owned.iter().map(NamedTensor::as_ref).collect();
        let handover = sync
            .send_weights(&WeightSource::memory(12, &views))
            .unwrap();
        assert_eq!(handover.kind, WeightSourceKind::File);
        let target = dir.path().join("weight_sync/step_12");
        assert_eq!(PathBuf::from(&handover.path), target);
        let bytes = std::fs::read(target.join(WEIGHTS_FILE)).unwrap();
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            metadata.metadata().as_ref().unwrap()[VERSION_METADATA_KEY],
            "12"
        );
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for t in &owned {
            let read = file.tensor(&t.name).unwrap();
            assert_eq!(read.data(), t.tensor.data.as_slice(), "{}", t.name);
            assert_eq!(
                read.shape().iter().map(|&d| d as i64).collect::<Vec<_>>(),
                t.tensor.shape.to_vec()
            );
        }
        sync.finalize().unwrap();
        assert!(!target.exists());
    }

    #[test]
    fn double_buffered_disk_alternates_two_checked_slots() {
        let dir = tempfile::tempdir().unwrap();
        // A slot left by an earlier run, with a newer version than this run's first step.
        let stale = SlotStore::open(dir.path().join("weight_sync"), WEIGHTS_FILE).unwrap();
        stale
            .publish(99, |p| std::fs::write(p, b"old").map_err(|e| e.to_string()))
            .unwrap();
        let mut sync = DiskWeightSync::default();
        let mut run = RunContext::default();
        run.run_dir = dir.path().to_string_lossy().into_owned();
        sync.init(&ComponentInit::new(
            serde_json::json!({"double_buffer": true}),
            run,
        ))
        .unwrap();
        let owned = tensors();
        let views: Vec<_> = owned.iter().map(NamedTensor::as_ref).collect();
        let mut paths = Vec::new();
        for version in [1, 2, 3] {
            let handover = sync
                .send_weights(&WeightSource::memory(version, &views))
                .unwrap();
            sync.finalize().unwrap();
            paths.push(PathBuf::from(&handover.path));
            let store = SlotStore::of_slot_dir(&paths[paths.len() - 1], WEIGHTS_FILE)
                .expect("the handover is a slot of a store");
            let (record, bytes) = store.read(|p, _| std::fs::read(p).unwrap()).unwrap();
            assert_eq!(record.version, version);
            let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            assert_eq!(
                metadata.metadata().as_ref().unwrap()[VERSION_METADATA_KEY],
                version.to_string()
            );
        }
        let slot = |k: usize| dir.path().join(format!("weight_sync/slot_{k}"));
        assert_eq!(paths, [slot(0), slot(1), slot(0)]);
        // The previous version stays complete in the other slot (finalize removes nothing).
        assert!(slot(1).join(WEIGHTS_FILE).is_file());
    }

    #[test]
    fn disk_rejects_unknown_settings() {
        let mut init = ComponentInit::default();
        init.config = serde_json::json!({"pth": "/tmp"});
        let err = DiskWeightSync::default().init(&init).unwrap_err();
        assert!(
            err.message().contains("engine_kwargs.disk.pth")
                && err.message().contains("did you mean"),
            "{err}"
        );
    }
}
