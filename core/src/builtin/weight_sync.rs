//! Weight sync from the trainer to the rollout (verl's checkpoint engines). `naive` hands the
//! tensors over in memory — trainer and rollout share the process; `disk` goes through a
//! safetensors file, the route to a rollout in another process (e.g. an inference server's
//! `update_weights_from_disk`).

use std::collections::HashMap;
use std::path::PathBuf;

use safetensors::tensor::{Dtype, TensorView};
use serde::Deserialize;
use verl_plugin_api::{CheckpointEngine, ComponentInit, DType, NamedTensor, PluginError, Tensor, WeightBundle};

#[derive(Default)]
pub struct NaiveWeightSync {
    pending: Option<WeightBundle>,
}

impl CheckpointEngine for NaiveWeightSync {
    fn init(&mut self, _init: &ComponentInit) -> Result<(), PluginError> {
        Ok(())
    }

    fn send_weights(&mut self, weights: &WeightBundle) -> Result<(), PluginError> {
        self.pending = Some(weights.clone());
        Ok(())
    }

    fn receive_weights(&mut self) -> Result<WeightBundle, PluginError> {
        self.pending.take().ok_or_else(|| PluginError::other("naive weight sync: receive_weights before send_weights"))
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct DiskConfig {
    /// Directory for the handover file; default `<run_dir>/weight_sync`.
    path: Option<PathBuf>,
}

#[derive(Default)]
pub struct DiskWeightSync {
    dir: PathBuf,
    last: Option<PathBuf>,
}

const META_STEPS: &str = "global_steps";

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
        other => return Err(PluginError::other(format!("disk weight sync: unsupported dtype code {}", other.0))),
    })
}

fn from_safetensors_dtype(dtype: Dtype) -> Result<DType, PluginError> {
    Ok(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::U8 => DType::U8,
        Dtype::BOOL => DType::BOOL,
        other => return Err(PluginError::other(format!("disk weight sync: unsupported safetensors dtype {other:?}"))),
    })
}

impl CheckpointEngine for DiskWeightSync {
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        let config: DiskConfig = init.config("checkpoint_engine disk")?;
        self.dir = config.path.unwrap_or_else(|| PathBuf::from(init.run.run_dir.as_str()).join("weight_sync"));
        std::fs::create_dir_all(&self.dir).map_err(|e| PluginError::other(format!("{}: {e}", self.dir.display())))
    }

    /// Written to a temporary name and renamed, so a reader never sees half a file.
    fn send_weights(&mut self, weights: &WeightBundle) -> Result<(), PluginError> {
        let views = weights
            .tensors
            .iter()
            .map(|t| {
                let shape: Vec<usize> = t.tensor.shape.iter().map(|&d| d as usize).collect();
                let view = TensorView::new(to_safetensors_dtype(t.tensor.dtype)?, shape, &t.tensor.data)
                    .map_err(|e| PluginError::other(format!("tensor `{}`: {e}", t.name)))?;
                Ok((t.name.to_string(), view))
            })
            .collect::<Result<Vec<_>, PluginError>>()?;
        let steps = weights.global_steps.into_option();
        let metadata = steps.map(|s| HashMap::from([(META_STEPS.to_owned(), s.to_string())]));
        let name = format!("weights_step_{}.safetensors", steps.map_or("none".to_owned(), |s| s.to_string()));
        let path = self.dir.join(&name);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        safetensors::serialize_to_file(views, metadata, &tmp).map_err(|e| PluginError::other(format!("{}: {e}", tmp.display())))?;
        std::fs::rename(&tmp, &path).map_err(|e| PluginError::other(format!("{}: {e}", path.display())))?;
        self.last = Some(path);
        Ok(())
    }

    fn receive_weights(&mut self) -> Result<WeightBundle, PluginError> {
        let path = self.last.clone().ok_or_else(|| PluginError::other("disk weight sync: receive_weights before send_weights"))?;
        let bytes = std::fs::read(&path).map_err(|e| PluginError::other(format!("{}: {e}", path.display())))?;
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| PluginError::other(format!("{}: {e}", path.display())))?;
        let global_steps = metadata.metadata().as_ref().and_then(|m| m.get(META_STEPS)).and_then(|s| s.parse().ok());
        let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| PluginError::other(format!("{}: {e}", path.display())))?;
        let mut tensors: Vec<NamedTensor> = file
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                let tensor = Tensor {
                    dtype: from_safetensors_dtype(view.dtype())?,
                    shape: view.shape().iter().map(|&d| d as i64).collect(),
                    data: view.data().to_vec().into(),
                };
                Ok(NamedTensor::new(name, tensor))
            })
            .collect::<Result<_, PluginError>>()?;
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(WeightBundle { tensors: tensors.into(), global_steps: global_steps.into() })
    }

    fn finalize(&mut self) -> Result<(), PluginError> {
        if let Some(path) = self.last.take() {
            std::fs::remove_file(&path).map_err(|e| PluginError::other(format!("{}: {e}", path.display())))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use verl_plugin_api::RunContext;

    fn bundle() -> WeightBundle {
        WeightBundle {
            tensors: vec![
                NamedTensor::new("a.weight", Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, -4.5]).unwrap()),
                NamedTensor::new("b.bias", Tensor::from_slice(&[3], &[7i64, 8, 9]).unwrap()),
            ]
            .into(),
            global_steps: Some(12).into(),
        }
    }

    #[test]
    fn naive_hands_over_once() {
        let mut sync = NaiveWeightSync::default();
        assert!(sync.receive_weights().is_err());
        sync.send_weights(&bundle()).unwrap();
        assert_eq!(sync.receive_weights().unwrap(), bundle());
        assert!(sync.receive_weights().is_err());
    }

    #[test]
    fn disk_round_trips_through_safetensors() {
        let dir = tempfile::tempdir().unwrap();
        let mut sync = DiskWeightSync::default();
        let init = ComponentInit { run: RunContext { run_dir: dir.path().to_str().unwrap().into(), ..Default::default() }, ..Default::default() };
        sync.init(&init).unwrap();
        sync.send_weights(&bundle()).unwrap();
        let file = dir.path().join("weight_sync/weights_step_12.safetensors");
        assert!(file.is_file());
        assert_eq!(sync.receive_weights().unwrap(), bundle());
        sync.finalize().unwrap();
        assert!(!file.exists());
    }
}
