//! The `fsdp` engine's own section, `fsdp_config` (verl's `FSDPEngineConfig`), parsed strictly;
//! verl's actor keys around it are the shared [`verl_actor::ActorConfig`].

use serde::{Deserialize, Serialize};
use serde_json::Value;
use verl_actor::{AdamWConfig, Role, engine_section_keys};
use verl_plugin_api::{ComponentInit, ConfigKeys, PluginError};

use crate::shard::ShardOptions;

/// verl's `FSDPEngineConfig.wrap_policy`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct WrapPolicy {
    pub min_num_params: u64,
    pub transformer_layer_cls_to_wrap: Option<Vec<String>>,
}

/// The engine's own section, `fsdp_config` (verl's `FSDPEngineConfig`): verl's keys and defaults,
/// any other key is an error. `fsdp_size` and the offload keys decide where the model lives
/// ([`FsdpConfig::shard_options`]); the other keys are accepted so verl's configs run unchanged,
/// and [`FsdpConfig::declared_keys`] tells verl-core which of them to report when they are set.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct FsdpConfig {
    pub wrap_policy: WrapPolicy,
    pub param_offload: bool,
    pub optimizer_offload: bool,
    pub offload_policy: bool,
    pub reshard_after_forward: bool,
    /// GPUs per shard group; −1: all.
    pub fsdp_size: i64,
    pub forward_prefetch: bool,
    pub model_dtype: String,
    pub dtype: String,
    /// `param_dtype`, `reduce_dtype`, `buffer_dtype`.
    pub mixed_precision: Option<Value>,
    pub use_orig_params: bool,
    pub seed: u64,
    pub full_determinism: bool,
    pub ulysses_sequence_parallel_size: usize,
    pub entropy_from_logits_with_chunking: bool,
    pub use_torch_compile: bool,
    pub entropy_checkpointing: bool,
    pub forward_only: bool,
    /// `fsdp` | `fsdp2`.
    pub strategy: String,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            wrap_policy: WrapPolicy::default(),
            param_offload: false,
            optimizer_offload: false,
            offload_policy: false,
            reshard_after_forward: true,
            fsdp_size: -1,
            forward_prefetch: false,
            model_dtype: "fp32".into(),
            dtype: "bfloat16".into(),
            mixed_precision: None,
            use_orig_params: false,
            seed: 42,
            full_determinism: false,
            ulysses_sequence_parallel_size: 1,
            entropy_from_logits_with_chunking: false,
            use_torch_compile: true,
            entropy_checkpointing: false,
            forward_only: false,
            strategy: "fsdp".into(),
        }
    }
}

const PARALLEL: &str = "sequence parallelism (Ulysses) is not implemented";
const DTYPE: &str = "the engine computes in actor_rollout_ref.model.dtype (float32 by default); mixed precision is not implemented";
const WRAP: &str = "the sharded model gathers one transformer block (or the embedding, or the norm with the head) at a time; this changes memory or speed, not results";
const KERNELS: &str = "an option of verl's kernels; it changes speed or memory, not results";

impl FsdpConfig {
    /// What the engine does with its section's keys, for verl-core's audit: every key is acted
    /// on, or (with its default) unsupported (it would change what is trained) or without effect.
    pub fn declared_keys() -> ConfigKeys {
        let defaults = serde_json::to_value(Self::default()).expect("the section serialises");
        let unsupported = [
            ("model_dtype", DTYPE),
            ("dtype", DTYPE),
            ("mixed_precision", DTYPE),
            ("ulysses_sequence_parallel_size", PARALLEL),
        ];
        let no_effect = [
            ("wrap_policy", WRAP),
            ("reshard_after_forward", WRAP),
            ("forward_prefetch", WRAP),
            ("use_orig_params", WRAP),
            (
                "strategy",
                "fsdp and fsdp2 shard the same way here (per block, flat shards)",
            ),
            ("seed", "the engine is seeded from trainer.seed"),
            (
                "full_determinism",
                "trainer.deterministic makes runs bit-identical",
            ),
            ("entropy_from_logits_with_chunking", KERNELS),
            ("entropy_checkpointing", KERNELS),
            ("use_torch_compile", KERNELS),
            ("forward_only", "the role decides whether the engine trains"),
        ];
        // They decide where the model lives (see `shard_options`).
        engine_section_keys(
            "fsdp_config",
            &defaults,
            &Self::PLACEMENT_KEYS,
            &unsupported,
            &no_effect,
        )
    }

    const PLACEMENT_KEYS: [&str; 4] = [
        "fsdp_size",
        "param_offload",
        "optimizer_offload",
        "offload_policy",
    ];

    /// How to shard the model over `world_size` ranks, or `None` to hold it whole, as verl's
    /// device mesh does: `fsdp_size` −1 (or at least the world size) shards every parameter over
    /// all ranks (ZeRO-3); `fsdp_size` 1 replicates the whole model on every rank (plain data
    /// parallel); a size in between (hybrid sharding) is refused, naming `{path}.fsdp_size`.
    /// One rank holds the whole model unless CPU offloading (verl's `param_offload`,
    /// `optimizer_offload`; FSDP2's `offload_policy` is both), which only the sharded model
    /// does, is asked for. `optimizer`: the role's AdamW, `None` for the reference.
    pub fn shard_options(
        &self,
        path: &str,
        optimizer: Option<AdamWConfig>,
        world_size: u32,
    ) -> Result<Option<ShardOptions>, PluginError> {
        let param_offload = self.param_offload || self.offload_policy;
        let optimizer_offload = self.optimizer_offload || self.offload_policy;
        let offload = param_offload || optimizer_offload;
        let world = i64::from(world_size.max(1));
        let error = |reason: String| {
            Err(PluginError::invalid_config(format!(
                "config key `{path}.fsdp_size`: {reason}"
            )))
        };
        let sharded = match self.fsdp_size {
            size if size < 0 || size >= world => world > 1 || offload,
            0 => return error("0 ranks per shard group; use -1 (all ranks) or 1".into()),
            1 if offload => {
                return error(format!(
                    "1 replicates the whole model on each of the {world} ranks, but CPU offloading (param_offload / optimizer_offload / offload_policy) needs the sharded model; use -1"
                ));
            }
            1 => false,
            size => {
                return error(format!(
                    "hybrid sharding (shard groups of {size} within {world} ranks) is not implemented; use -1 (shard over all ranks) or 1 (replicate)"
                ));
            }
        };
        Ok(sharded.then_some(ShardOptions {
            optimizer,
            param_offload,
            optimizer_offload,
        }))
    }

    /// Parses the section at `section_path` strictly: an unknown key is an error naming its full
    /// path, where it came from (`origins_json`: full key path → origin, may be empty) and the
    /// nearest valid key.
    pub fn parse(
        section_path: &str,
        section_json: &str,
        origins_json: &str,
    ) -> Result<Self, PluginError> {
        verl_plugin_api::config::parse_section(section_path, section_json, origins_json)
    }

    /// The section of `init`'s config (`fsdp_config` under the role's section), at the path and
    /// with the key origins the host sent, else at the role's place in verl's config.
    pub fn of(init: &ComponentInit, role: Role) -> Result<Self, PluginError> {
        let section = init
            .config
            .get("fsdp_config")
            .cloned()
            .unwrap_or(Value::Null);
        Self::parse(
            &Self::path(init, role),
            &section.to_string(),
            &init.origins_json(),
        )
    }

    /// The section's full key path: as the host sent it, else the role's place in verl's config.
    pub fn path(init: &ComponentInit, role: Role) -> String {
        role.engine_section_path(init, "fsdp_config")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key of the section is declared, once, with the section's own default.
    #[test]
    fn every_key_is_declared() {
        let keys = FsdpConfig::declared_keys();
        let mut declared: Vec<&str> = keys
            .unsupported
            .iter()
            .chain(&keys.no_effect)
            .map(|note| note.key.as_str())
            .chain(keys.acts_on.iter().map(String::as_str))
            .map(|key| key.strip_prefix("fsdp_config.").unwrap())
            .collect();
        declared.sort();
        let defaults = serde_json::to_value(FsdpConfig::default()).unwrap();
        let mut all: Vec<&str> = defaults
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        all.sort();
        assert_eq!(declared, all);
        let dtype = keys
            .unsupported
            .iter()
            .find(|n| n.key == "fsdp_config.model_dtype")
            .unwrap();
        assert_eq!(dtype.default, serde_json::json!("fp32"));
        assert!(
            keys.acts_on
                .contains(&"fsdp_config.param_offload".to_owned())
        );
    }

    #[test]
    fn fsdp_size_and_offloading_place_the_model() {
        let adamw = Some(AdamWConfig::default());
        let place = |json: &str, world: u32| {
            section(json)
                .unwrap()
                .shard_options("a.fsdp_config", adamw, world)
        };
        // One rank holds the whole model; more ranks shard it, unless fsdp_size 1 replicates.
        assert_eq!(place("{}", 1).unwrap(), None);
        for world in [2, 4] {
            let options = place("{}", world).unwrap().unwrap();
            assert!(!options.param_offload && !options.optimizer_offload);
            assert_eq!(options.optimizer, adamw);
            let all = format!(r#"{{"fsdp_config":{{"fsdp_size":{world}}}}}"#);
            assert_eq!(place(&all, world).unwrap(), Some(options));
            assert_eq!(
                place(r#"{"fsdp_config":{"fsdp_size":1}}"#, world).unwrap(),
                None
            );
        }
        for (json, param, optimizer) in [
            (r#"{"fsdp_config":{"param_offload":true}}"#, true, false),
            (r#"{"fsdp_config":{"optimizer_offload":true}}"#, false, true),
            (r#"{"fsdp_config":{"offload_policy":true}}"#, true, true),
        ] {
            for world in [1, 2] {
                let options = place(json, world).unwrap().unwrap();
                assert_eq!(
                    (options.param_offload, options.optimizer_offload),
                    (param, optimizer),
                    "{json} on {world}"
                );
            }
        }
        for (json, world, says) in [
            (r#"{"fsdp_config":{"fsdp_size":2}}"#, 4, "hybrid sharding"),
            (r#"{"fsdp_config":{"fsdp_size":0}}"#, 2, "0 ranks"),
            (
                r#"{"fsdp_config":{"fsdp_size":1,"param_offload":true}}"#,
                2,
                "needs the sharded model",
            ),
        ] {
            let err = place(json, world).unwrap_err().to_string();
            assert!(
                err.contains("config key `a.fsdp_config.fsdp_size`: ") && err.contains(says),
                "{json}: {err}"
            );
        }
    }

    fn section(json: &str) -> Result<FsdpConfig, PluginError> {
        let init = ComponentInit::new(serde_json::from_str(json).unwrap(), Default::default());
        FsdpConfig::of(&init, Role::Actor)
    }

    #[test]
    fn fsdp_config_is_strict() {
        let s =
            section(r#"{"fsdp_config":{"param_offload":true,"wrap_policy":{"min_num_params":8}}}"#)
                .unwrap();
        assert!(s.param_offload && s.reshard_after_forward);
        assert_eq!((s.wrap_policy.min_num_params, s.fsdp_size), (8, -1));
        // Keys of the actor section around it are the host's and the shared actor config's.
        assert!(section(r#"{"use_dynamic_bsz":true,"checkpoint":{"x":1}}"#).is_ok());
        let err = section(r#"{"fsdp_config":{"param_ofload":true}}"#)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "unknown config key `actor_rollout_ref.actor.fsdp_config.param_ofload` (from unknown source); did you mean `actor_rollout_ref.actor.fsdp_config.param_offload`?"
        );
        let origins = r#"{"critic.fsdp_config.fsdp_size": "config file run.yaml"}"#;
        let err = FsdpConfig::parse("critic.fsdp_config", r#"{"fsdp_size": "all"}"#, origins)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(
                "config key `critic.fsdp_config.fsdp_size` (from config file run.yaml): invalid type"
            ),
            "{err}"
        );
    }
}
