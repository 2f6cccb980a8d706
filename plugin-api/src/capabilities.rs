//! What each component declares it can do. Declared statically (an associated function of the
//! component trait), so `plugins list` shows them without creating the component, and the trainer
//! checks a config against them before step 1: asking for what a component cannot do fails at
//! start with a message naming both. Defaults are the conservative answer.

use serde::{Deserialize, Serialize};

/// How new weights reach a rollout.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[serde(rename_all = "lowercase")]
pub enum WeightSourceKind {
    /// Borrowed tensors in the trainer's memory (the rollout shares the process).
    #[default]
    Memory,
    /// A directory of safetensors files.
    File,
    /// A collective transfer the rollout joins.
    Collective,
    /// A kind this build does not know (declared by a newer peer).
    #[serde(other)]
    Other,
}

impl WeightSourceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::File => "file",
            Self::Collective => "collective",
            Self::Other => "other",
        }
    }
}

#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(default)]
pub struct EngineCapabilities {
    /// The roles the engine can hold: "actor", "ref", "critic".
    pub roles: Vec<String>,
    /// Largest world size the engine runs on (1: single rank only).
    pub max_world_size: u32,
    /// Whether each rank writes its own shard of a checkpoint.
    pub sharded_checkpoints: bool,
    /// Torch device types it computes on ("cpu", "cuda", "npu"); empty means any.
    pub devices: Vec<String>,
    /// What it does with the keys of its role's section (`actor_rollout_ref.actor`, `…ref`,
    /// `critic`) beyond those verl-core acts on.
    pub config_keys: ConfigKeys,
    /// Whether `Engine::all_gather_object` exchanges bytes over the engine's process group
    /// (since 2.1.0): the multi-rank trainer gathers scores, metrics and checkpoint agreement
    /// through it.
    pub object_exchange: bool,
    /// The `strategy` values (verl's engine backends) the engine serves besides its own name, on
    /// the devices in `devices` (since 2.3.0): an engine named `mindspeed` serving `megatron` on
    /// `npu` is what `strategy=megatron` resolves to on an Ascend platform, as verl's
    /// `EngineRegistry` keys engines by backend and device.
    pub strategies: Vec<String>,
    /// Whether `update_actor`, when the batch is one mini-batch trained for one epoch, takes the
    /// old log-probs from its own forward (verl's on-policy shortcut in `dp_actor.update_policy`)
    /// and so needs no `old_log_probs` in the batch, and then reports `actor/entropy` of that
    /// forward when the batch meta has `"calculate_entropy": true` (since 2.4.0). The trainer then
    /// skips the old-log-prob pass when nothing else reads it.
    pub on_policy_updates: bool,
}

impl Default for EngineCapabilities {
    fn default() -> Self {
        Self {
            roles: Vec::new(),
            max_world_size: 1,
            sharded_checkpoints: false,
            devices: Vec::new(),
            config_keys: ConfigKeys::default(),
            object_exchange: false,
            strategies: Vec::new(),
            on_policy_updates: false,
        }
    }
}

impl EngineCapabilities {
    pub fn roles<S: Into<String>>(mut self, roles: impl IntoIterator<Item = S>) -> Self {
        self.roles = roles.into_iter().map(Into::into).collect();
        self
    }
    pub fn max_world_size(mut self, n: u32) -> Self {
        self.max_world_size = n;
        self
    }
    pub fn sharded_checkpoints(mut self, yes: bool) -> Self {
        self.sharded_checkpoints = yes;
        self
    }
    pub fn devices<S: Into<String>>(mut self, devices: impl IntoIterator<Item = S>) -> Self {
        self.devices = devices.into_iter().map(Into::into).collect();
        self
    }
    pub fn config_keys(mut self, keys: ConfigKeys) -> Self {
        self.config_keys = keys;
        self
    }
    pub fn object_exchange(mut self, yes: bool) -> Self {
        self.object_exchange = yes;
        self
    }
    /// The strategies it serves besides its own name (see [`EngineCapabilities::strategies`]).
    pub fn strategies<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        self.strategies = names.into_iter().map(Into::into).collect();
        self
    }
    /// See [`EngineCapabilities::on_policy_updates`].
    pub fn on_policy_updates(mut self, yes: bool) -> Self {
        self.on_policy_updates = yes;
        self
    }
    pub fn supports_role(&self, role: &str) -> bool {
        self.roles.iter().any(|r| r == role)
    }
    pub fn supports_device(&self, device_type: &str) -> bool {
        self.devices.is_empty() || self.devices.iter().any(|d| d == device_type)
    }
}

#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[serde(default)]
pub struct RolloutCapabilities {
    /// The weight sources `update_weights` accepts; empty: the weights never change.
    pub weight_sources: Vec<WeightSourceKind>,
    /// Whether `sleep` / `wake_up` free and restore memory.
    pub sleep_wake: bool,
    /// Whether completions carry per-token log-probs.
    pub logprobs: bool,
    /// What it does with the keys of `actor_rollout_ref.rollout` beyond those verl-core acts on.
    pub config_keys: ConfigKeys,
    /// Whether `GenerateRequest::seeds` (one seed per prompt, since 2.1.0) decides each prompt's
    /// samples, whatever else is in the request.
    pub prompt_seeds: bool,
    /// Whether completions can carry the experts each token was routed through
    /// (`Completion::routed_experts`, since 2.4.0): rollout router replay (verl's R3,
    /// `enable_rollout_routing_replay`) needs it.
    pub routed_experts: bool,
}

impl RolloutCapabilities {
    pub fn routed_experts(mut self, yes: bool) -> Self {
        self.routed_experts = yes;
        self
    }
    pub fn weight_sources(mut self, kinds: impl IntoIterator<Item = WeightSourceKind>) -> Self {
        self.weight_sources = kinds.into_iter().collect();
        self
    }
    pub fn sleep_wake(mut self, yes: bool) -> Self {
        self.sleep_wake = yes;
        self
    }
    pub fn logprobs(mut self, yes: bool) -> Self {
        self.logprobs = yes;
        self
    }
    pub fn prompt_seeds(mut self, yes: bool) -> Self {
        self.prompt_seeds = yes;
        self
    }
    pub fn config_keys(mut self, keys: ConfigKeys) -> Self {
        self.config_keys = keys;
        self
    }
    pub fn accepts(&self, kind: WeightSourceKind) -> bool {
        self.weight_sources.contains(&kind)
    }
}

#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[serde(default)]
pub struct CheckpointCapabilities {
    /// What the weight sync hands the rollout.
    pub handover: WeightSourceKind,
    /// What it does with the keys of `actor_rollout_ref.rollout.checkpoint_engine` beyond those
    /// verl-core acts on.
    pub config_keys: ConfigKeys,
}

impl CheckpointCapabilities {
    pub fn handover(mut self, kind: WeightSourceKind) -> Self {
        self.handover = kind;
        self
    }
    pub fn config_keys(mut self, keys: ConfigKeys) -> Self {
        self.config_keys = keys;
        self
    }
}

/// What a component does with the verl keys it is handed, beyond those verl-core acts on itself.
/// verl-core reports every key it accepts that nothing acts on (an error for a key that would
/// change what is trained, a warning for one that would not); a component declares here which of
/// its section's keys it does act on, and which keys of its own plugin section it accepts without
/// honouring them. Keys are relative to the component's verl section: `use_dynamic_bsz`,
/// `tensor_model_parallel_size`, `fsdp_config.param_offload`.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[serde(default)]
pub struct ConfigKeys {
    /// Keys verl-core would report as unused that this component acts on (a vLLM rollout's
    /// `gpu_memory_utilization`).
    pub acts_on: Vec<String>,
    /// Keys it accepts but cannot honour yet: set to anything but their default, the run stops
    /// before anything is created (a warning with `trainer.strict_config=false`).
    pub unsupported: Vec<KeyNote>,
    /// Keys it accepts that change nothing here: set to anything but their default, the run
    /// warns.
    pub no_effect: Vec<KeyNote>,
}

/// A key a component accepts without acting on it: its default and why it is not acted on.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[serde(default)]
pub struct KeyNote {
    pub key: String,
    pub default: serde_json::Value,
    pub why: String,
}

impl ConfigKeys {
    pub fn acts_on<S: Into<String>>(mut self, keys: impl IntoIterator<Item = S>) -> Self {
        self.acts_on.extend(keys.into_iter().map(Into::into));
        self
    }
    /// `key` (with its `default`) cannot be honoured yet: `why` says what would provide it.
    pub fn unsupported(
        mut self,
        key: &str,
        default: impl Into<serde_json::Value>,
        why: &str,
    ) -> Self {
        self.unsupported.push(KeyNote::new(key, default, why));
        self
    }
    /// `key` (with its `default`) changes nothing here: `why` says why.
    pub fn no_effect(
        mut self,
        key: &str,
        default: impl Into<serde_json::Value>,
        why: &str,
    ) -> Self {
        self.no_effect.push(KeyNote::new(key, default, why));
        self
    }
}

impl KeyNote {
    pub fn new(key: &str, default: impl Into<serde_json::Value>, why: &str) -> Self {
        Self {
            key: key.to_owned(),
            default: default.into(),
            why: why.to_owned(),
        }
    }
}

#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[serde(default)]
pub struct TrackerCapabilities {
    /// Whether `log_table` records tables.
    pub tables: bool,
}

impl TrackerCapabilities {
    pub fn tables(mut self, yes: bool) -> Self {
        self.tables = yes;
        self
    }
}
