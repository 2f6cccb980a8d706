//! The `megatron` engine's own section (verl's `McoreEngineConfig`, under
//! `actor_rollout_ref.actor.megatron`, `…ref.megatron`, `critic.megatron`), parsed strictly. verl's
//! actor keys around it are the shared [`verl_actor::ActorConfig`].

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use verl_actor::{Role, engine_section_keys};
use verl_plugin_api::{ComponentInit, ConfigKeys, PluginError};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct MegatronConfig {
    pub param_offload: bool,
    pub grad_offload: bool,
    pub optimizer_offload: bool,
    pub tensor_model_parallel_size: u32,
    pub expert_model_parallel_size: u32,
    pub expert_tensor_parallel_size: Option<u32>,
    pub pipeline_model_parallel_size: u32,
    pub virtual_pipeline_model_parallel_size: Option<u32>,
    pub context_parallel_size: u32,
    pub sequence_parallel: bool,
    pub use_distributed_optimizer: bool,
    pub use_dist_checkpointing: bool,
    pub dist_checkpointing_path: Option<String>,
    pub dist_checkpointing_prefix: String,
    pub seed: u64,
    pub override_ddp_config: Value,
    pub override_transformer_config: Value,
    pub override_mcore_model_config: Value,
    pub use_mbridge: bool,
    pub vanilla_mbridge: bool,
    pub forward_only: bool,
    pub dtype: String,
}

impl Default for MegatronConfig {
    /// verl's defaults (`trainer/config/engine/megatron.yaml`).
    fn default() -> Self {
        Self {
            param_offload: false,
            grad_offload: false,
            optimizer_offload: false,
            tensor_model_parallel_size: 1,
            expert_model_parallel_size: 1,
            expert_tensor_parallel_size: None,
            pipeline_model_parallel_size: 1,
            virtual_pipeline_model_parallel_size: None,
            context_parallel_size: 1,
            sequence_parallel: true,
            use_distributed_optimizer: true,
            use_dist_checkpointing: false,
            dist_checkpointing_path: None,
            dist_checkpointing_prefix: String::new(),
            seed: 42,
            override_ddp_config: json!({}),
            override_transformer_config: json!({
                "recompute_granularity": null,
                "recompute_modules": ["core_attn"],
                "recompute_method": null,
                "recompute_num_layers": null,
                "attention_backend": "flash",
                "variable_seq_lengths": true,
                "moe_token_dispatcher_type": "alltoall",
            }),
            override_mcore_model_config: json!({}),
            use_mbridge: false,
            vanilla_mbridge: true,
            forward_only: false,
            dtype: "bfloat16".into(),
        }
    }
}

const PIPELINE: &str = "pipeline parallelism is not implemented by the megatron engine yet; use 1";
const EXPERTS: &str = "the engine's models (Llama, Qwen2) have no experts";
const OFFLOAD: &str = "CPU offloading is not implemented by the megatron engine; the fsdp engine offloads (fsdp_config.param_offload)";
const DTYPE: &str = "the engine computes in actor_rollout_ref.model.dtype (float32 by default); mixed precision is not implemented";
const DIST_CKPT: &str = "checkpoints are the engine's own per-rank shards (megatron_layout.json); Megatron dist-checkpointing is not read or written";
const MODEL_OVERRIDE: &str =
    "the model is built from its Hugging Face config.json; mcore model overrides are not applied";

/// How the engine splits the model and the sequences over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Tensor-parallel size.
    pub tp: u32,
    /// Context-parallel size.
    pub cp: u32,
    pub sequence_parallel: bool,
}

impl MegatronConfig {
    /// The keys of the section as the host's audit sees them: the two acted on, the ones that
    /// would change what is trained (an error when set) and those without effect here.
    pub fn declared_keys() -> ConfigKeys {
        let defaults = serde_json::to_value(Self::default()).expect("the section serialises");
        let unsupported = [
            ("pipeline_model_parallel_size", PIPELINE),
            ("virtual_pipeline_model_parallel_size", PIPELINE),
            ("expert_model_parallel_size", EXPERTS),
            ("expert_tensor_parallel_size", EXPERTS),
            ("param_offload", OFFLOAD),
            ("grad_offload", OFFLOAD),
            ("optimizer_offload", OFFLOAD),
            ("dtype", DTYPE),
            ("use_dist_checkpointing", DIST_CKPT),
            ("dist_checkpointing_path", DIST_CKPT),
            ("dist_checkpointing_prefix", DIST_CKPT),
            ("override_mcore_model_config", MODEL_OVERRIDE),
        ];
        let no_effect = [
            (
                "use_distributed_optimizer",
                "AdamW's moments are held per tensor-parallel shard and replicated over data-parallel ranks",
            ),
            ("seed", "the engine is seeded from trainer.seed"),
            (
                "override_ddp_config",
                "gradients are all-reduced over the data-parallel group in one flat buffer",
            ),
            (
                "override_transformer_config",
                "activation recomputation and attention kernels change memory and speed, not results; every activation is kept",
            ),
            (
                "use_mbridge",
                "weights are read from Hugging Face safetensors directly",
            ),
            (
                "vanilla_mbridge",
                "weights are read from Hugging Face safetensors directly",
            ),
            ("forward_only", "the role decides whether the engine trains"),
        ];
        let acted_on = [
            "tensor_model_parallel_size",
            "context_parallel_size",
            "sequence_parallel",
        ];
        engine_section_keys("megatron", &defaults, &acted_on, &unsupported, &no_effect).no_effect(
            "deterministic",
            false,
            "the megatron engine runs libtorch's default kernels, whose results depend on \
                 the batch; the fsdp engine implements the batch-invariant mode",
        )
    }

    /// The section of `init`'s config (`megatron` under the role's section), strictly: an
    /// unknown key is an error naming its full path and where it came from.
    pub fn of(init: &ComponentInit, role: Role) -> Result<Self, PluginError> {
        let section = init.config.get("megatron").cloned().unwrap_or(Value::Null);
        verl_plugin_api::config::parse_section(
            &Self::path(init, role),
            &section.to_string(),
            &init.origins_json(),
        )
    }

    /// The section's full key path: as the host sent it, else the role's place in verl's config.
    pub fn path(init: &ComponentInit, role: Role) -> String {
        role.engine_section_path(init, "megatron")
    }

    /// The parallel layout on `world_size` ranks: tensor- and context-parallel sizes and sequence
    /// parallelism (Megatron turns it off at tensor-parallel size 1). One process holds the whole
    /// model whatever the size asked (a config sized for a cluster runs in one process, as the
    /// trainer allows; the quickstart's warm-up runs on rank 0 alone). Sizes this engine does
    /// not build are errors naming the key, whoever launched it (the host's audit reports them
    /// too).
    pub fn layout(&self, path: &str, world_size: u32) -> Result<Layout, PluginError> {
        let error = |key: &str, reason: String| {
            Err(PluginError::invalid_config(format!(
                "config key `{path}.{key}`: {reason}"
            )))
        };
        for (key, size, why) in [
            (
                "pipeline_model_parallel_size",
                self.pipeline_model_parallel_size,
                PIPELINE,
            ),
            (
                "expert_model_parallel_size",
                self.expert_model_parallel_size,
                EXPERTS,
            ),
        ] {
            if size != 1 {
                return error(key, format!("{size}: {why}"));
            }
        }
        if let Some(size) = self.virtual_pipeline_model_parallel_size {
            return error(
                "virtual_pipeline_model_parallel_size",
                format!("{size}: {PIPELINE}"),
            );
        }
        for (key, on) in [
            ("param_offload", self.param_offload),
            ("grad_offload", self.grad_offload),
            ("optimizer_offload", self.optimizer_offload),
        ] {
            if on {
                return error(key, OFFLOAD.to_owned());
            }
        }
        let (tp, cp) = (self.tensor_model_parallel_size, self.context_parallel_size);
        let world = world_size.max(1);
        for (key, size) in [
            ("tensor_model_parallel_size", tp),
            ("context_parallel_size", cp),
        ] {
            if size == 0 {
                return error(key, "0 ranks; the smallest size is 1".to_owned());
            }
        }
        if world == 1 {
            return Ok(Layout {
                tp: 1,
                cp: 1,
                sequence_parallel: false,
            });
        }
        if !world.is_multiple_of(tp * cp) {
            return error(
                if world.is_multiple_of(tp) {
                    "context_parallel_size"
                } else {
                    "tensor_model_parallel_size"
                },
                format!(
                    "tensor-parallel size {tp} × context-parallel size {cp} does not divide the {world} ranks (data-parallel size × context-parallel size × tensor-parallel size is the world size)"
                ),
            );
        }
        Ok(Layout {
            tp,
            cp,
            sequence_parallel: self.sequence_parallel && tp > 1,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_declared_once() {
        let keys = MegatronConfig::declared_keys();
        let defaults = serde_json::to_value(MegatronConfig::default()).unwrap();
        let mut declared: Vec<String> = keys
            .acts_on
            .iter()
            .map(ToString::to_string)
            .chain(keys.unsupported.iter().map(|n| n.key.clone()))
            .chain(keys.no_effect.iter().map(|n| n.key.clone()))
            .collect();
        // The engine section's own `deterministic` (copied from `trainer.deterministic`) is
        // declared beside the `megatron` keys.
        assert!(
            declared.iter().any(|k| k == "deterministic"),
            "{declared:?}"
        );
        declared.retain(|k| k.starts_with("megatron."));
        declared.sort();
        let mut all: Vec<String> = defaults
            .as_object()
            .unwrap()
            .keys()
            .map(|k| format!("megatron.{k}"))
            .collect();
        all.sort();
        assert_eq!(declared, all);
    }

    #[test]
    fn layouts_not_built_are_errors_naming_the_key() {
        let path = "actor_rollout_ref.actor.megatron";
        let layout = |extra: Value, world| {
            let c: MegatronConfig = serde_json::from_value(extra).unwrap();
            c.layout(path, world)
                .map(|l| (l.tp, l.cp, l.sequence_parallel))
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            layout(json!({"tensor_model_parallel_size": 2}), 4),
            Ok((2, 1, true))
        );
        assert_eq!(
            layout(
                json!({"tensor_model_parallel_size": 2, "context_parallel_size": 2}),
                4
            ),
            Ok((2, 2, true))
        );
        // Megatron has no sequence parallelism without tensor parallelism.
        assert_eq!(layout(json!({}), 2), Ok((1, 1, false)));
        // One process holds the whole model.
        assert_eq!(
            layout(json!({"tensor_model_parallel_size": 2}), 1),
            Ok((1, 1, false))
        );
        for (extra, key) in [
            (
                json!({"pipeline_model_parallel_size": 2}),
                "pipeline_model_parallel_size",
            ),
            (
                json!({"tensor_model_parallel_size": 2, "context_parallel_size": 3}),
                "context_parallel_size",
            ),
            (
                json!({"virtual_pipeline_model_parallel_size": 2}),
                "virtual_pipeline_model_parallel_size",
            ),
            (json!({"param_offload": true}), "param_offload"),
            (
                json!({"tensor_model_parallel_size": 3}),
                "tensor_model_parallel_size",
            ),
        ] {
            let err = layout(extra, 4).unwrap_err();
            assert!(err.contains(&format!("config key `{path}.{key}`")), "{err}");
        }
    }
}
