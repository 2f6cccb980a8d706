//! The `model` section that the engine and rollout plugins share: which checkpoint to build, in
//! what dtype, and where to put it.

use std::path::PathBuf;

use serde::Deserialize;
use tch::{Device, Kind};

use crate::config::{GenerationConfig, ModelConfig};
use crate::error::{ModelError, Result};
use crate::model::{CausalLM, Head, ModelOptions};

/// Parameter dtype of a model built from a [`ModelSpec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    #[serde(alias = "fp32")]
    Float32,
    #[serde(alias = "bf16")]
    Bfloat16,
}

impl Dtype {
    pub fn kind(self) -> Kind {
        match self {
            Self::Float32 => Kind::Float,
            Self::Bfloat16 => Kind::BFloat16,
        }
    }
}

/// verl's `actor_rollout_ref.model` keys this crate acts on; others are ignored.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ModelSpec {
    /// A Hugging Face model directory (`config.json`, weights, tokenizer, generation config).
    pub path: PathBuf,
    /// Build the weights from `config.json` and the run seed instead of reading safetensors.
    #[serde(default)]
    pub random_init: bool,
    /// Recompute activations layer by layer in the backward pass (training only).
    #[serde(default)]
    pub enable_gradient_checkpointing: bool,
    /// verl's `use_remove_padding`: engines run each micro-batch as one packed sequence of its
    /// real tokens instead of padded rows (the same results; no compute on padding).
    #[serde(default)]
    pub use_remove_padding: bool,
    #[serde(default)]
    pub dtype: Dtype,
}

impl ModelSpec {
    /// Builds the model on `device` with `head`; `seed` drives random initialisation (all weights
    /// with `random_init`, otherwise only a value head the checkpoint lacks).
    pub fn load(&self, device: Device, head: Head, seed: u64) -> Result<CausalLM> {
        let options = ModelOptions {
            device,
            kind: self.dtype.kind(),
            head,
            seed,
        };
        if self.random_init {
            CausalLM::random(ModelConfig::from_dir(&self.path)?, &options)
        } else {
            CausalLM::from_pretrained(&self.path, &options)
        }
    }

    /// EOS and padding ids from `generation_config.json`, falling back to `config.json`.
    pub fn generation_config(&self, model: &ModelConfig) -> Result<GenerationConfig> {
        GenerationConfig::from_dir(&self.path, model)
    }
}

/// Parses a torch device string: `cpu` (or empty), `cuda`, `cuda:N`.
pub fn parse_device(name: &str) -> Result<Device> {
    let invalid = || {
        ModelError::invalid_input(
            "device",
            format!("unknown device {name:?} (cpu, cuda, cuda:N)"),
        )
    };
    match name {
        "" | "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => {
            let index = other.strip_prefix("cuda:").ok_or_else(invalid)?;
            index.parse().map(Device::Cuda).map_err(|_| invalid())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices_and_specs() {
        assert_eq!(parse_device("cpu").unwrap(), Device::Cpu);
        assert_eq!(parse_device("cuda:1").unwrap(), Device::Cuda(1));
        assert!(
            parse_device("npu:0")
                .unwrap_err()
                .to_string()
                .contains("npu:0")
        );
        let spec: ModelSpec =
            serde_json::from_str(r#"{"path":"m","dtype":"bf16","external_lib":null}"#).unwrap();
        assert_eq!((spec.dtype, spec.random_init), (Dtype::Bfloat16, false));
    }
}
