//! The FFI-safe side: `#[sabi_trait]` objects for the six component kinds, the adapters that wrap a
//! plugin author's plain Rust trait impls (catching panics), the factory, and the root module.
#![allow(non_camel_case_types, non_local_definitions)] // both come from abi_stable's generated code

use abi_stable::library::RootModule;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{RBox, RResult, RSlice, RStr, RString, RVec};
use abi_stable::{StableAbi, sabi_trait};
use serde::{Deserialize, Serialize};

use crate::components::{
    CheckpointEngine, ComponentInit, Engine, GenerateRequest, Rollout, Table, Tracker,
};
use crate::device::{Device, ProbeContext};
use crate::error::{PluginError, guard};
use crate::reward::{Reward, RewardRequest};
use crate::wire::{decode, encode};
use crate::{Batch, Metric, TensorRef, WeightSource};

// Records (`ComponentInit`, `GenerateRequest`, `DeviceInfo`, …) cross as JSON text (see `wire`);
// batches, tensors, weights and metrics cross as fixed binary containers.

#[sabi_trait]
pub trait StableDevice: Send + Sync {
    /// `DeviceInfo` JSON.
    fn info(&self) -> RResult<RString, PluginError>;
    /// `ProbeContext` JSON in, `Detection` JSON out.
    #[sabi(last_prefix_field)]
    fn detect(&self, probe: RStr<'_>) -> RResult<RString, PluginError>;
}

#[sabi_trait]
pub trait StableEngine: Send {
    /// `ComponentInit` JSON.
    fn init(&mut self, init: RStr<'_>) -> RResult<(), PluginError>;
    fn compute_log_prob(&mut self, batch: &Batch) -> RResult<Batch, PluginError>;
    fn compute_values(&mut self, batch: &Batch) -> RResult<Batch, PluginError>;
    fn update_actor(&mut self, batch: &Batch) -> RResult<RVec<Metric>, PluginError>;
    fn update_critic(&mut self, batch: &Batch) -> RResult<RVec<Metric>, PluginError>;
    fn save_checkpoint(&mut self, dir: RStr<'_>, global_step: u64) -> RResult<(), PluginError>;
    fn load_checkpoint(&mut self, dir: RStr<'_>) -> RResult<u64, PluginError>;
    /// Views into the engine's memory, valid until the next call on the engine.
    fn weights(&mut self) -> RResult<RVec<TensorRef<'_>>, PluginError>;
    #[sabi(last_prefix_field)]
    fn export_hf(&mut self, dir: RStr<'_>) -> RResult<(), PluginError>;
    /// Since 2.1.0: every rank's bytes in rank order. A plugin built against 2.0 lacks the
    /// entry; calling it then runs this default (unsupported).
    fn all_gather_object(&mut self, bytes: RSlice<'_, u8>) -> RResult<RVec<RVec<u8>>, PluginError> {
        let _ = bytes;
        RResult::RErr(PluginError::unsupported("all_gather_object"))
    }
}

#[sabi_trait]
pub trait StableRollout: Send {
    fn init(&mut self, init: RStr<'_>) -> RResult<(), PluginError>;
    /// `GenerateRequest` JSON in, `GenerateOutput` JSON out.
    fn generate(&mut self, request: RStr<'_>) -> RResult<RString, PluginError>;
    fn update_weights(&mut self, source: &WeightSource<'_>) -> RResult<(), PluginError>;
    fn sleep(&mut self, level: u32) -> RResult<(), PluginError>;
    #[sabi(last_prefix_field)]
    fn wake_up(&mut self) -> RResult<(), PluginError>;
}

#[sabi_trait]
pub trait StableCheckpoint: Send {
    fn init(&mut self, init: RStr<'_>) -> RResult<(), PluginError>;
    /// `Handover` JSON out.
    fn send_weights(&mut self, weights: &WeightSource<'_>) -> RResult<RString, PluginError>;
    #[sabi(last_prefix_field)]
    fn finalize(&mut self) -> RResult<(), PluginError>;
}

#[sabi_trait]
pub trait StableTracker: Send {
    fn init(&mut self, init: RStr<'_>) -> RResult<(), PluginError>;
    fn log(&mut self, step: u64, metrics: RSlice<'_, Metric>) -> RResult<(), PluginError>;
    /// `Table` JSON.
    fn log_table(&mut self, step: u64, table: RStr<'_>) -> RResult<(), PluginError>;
    #[sabi(last_prefix_field)]
    fn finish(&mut self, exit_code: i32) -> RResult<(), PluginError>;
}

/// Since 2.2.0.
#[sabi_trait]
pub trait StableReward: Send {
    /// `ComponentInit` JSON.
    fn init(&mut self, init: RStr<'_>) -> RResult<(), PluginError>;
    /// `RewardRequest` JSON in, `RewardOutput` JSON out.
    #[sabi(last_prefix_field)]
    fn compute(&mut self, request: RStr<'_>) -> RResult<RString, PluginError>;
}

pub type DeviceBox = StableDevice_TO<'static, RBox<()>>;
pub type EngineBox = StableEngine_TO<'static, RBox<()>>;
pub type RolloutBox = StableRollout_TO<'static, RBox<()>>;
pub type CheckpointBox = StableCheckpoint_TO<'static, RBox<()>>;
pub type TrackerBox = StableTracker_TO<'static, RBox<()>>;
pub type RewardBox = StableReward_TO<'static, RBox<()>>;

/// Wraps a plugin author's component so that every call is panic-guarded and records are decoded
/// and encoded on the plugin's side.
struct Guarded<T>(T);

impl<T: Device> StableDevice for Guarded<T> {
    fn info(&self) -> RResult<RString, PluginError> {
        guard("info", || Ok(encode(&self.0.info())))
    }
    fn detect(&self, probe: RStr<'_>) -> RResult<RString, PluginError> {
        guard("detect", || {
            let probe: ProbeContext = decode("probe context", probe.as_str())?;
            self.0.detect(&probe).map(|d| encode(&d))
        })
    }
}

fn init_record(init: RStr<'_>) -> Result<ComponentInit, PluginError> {
    decode("component init", init.as_str())
}

impl<T: Engine> StableEngine for Guarded<T> {
    fn init(&mut self, init: RStr<'_>) -> RResult<(), PluginError> {
        guard("init", || self.0.init(&init_record(init)?))
    }
    fn compute_log_prob(&mut self, batch: &Batch) -> RResult<Batch, PluginError> {
        guard("compute_log_prob", || self.0.compute_log_prob(batch))
    }
    fn compute_values(&mut self, batch: &Batch) -> RResult<Batch, PluginError> {
        guard("compute_values", || self.0.compute_values(batch))
    }
    fn update_actor(&mut self, batch: &Batch) -> RResult<RVec<Metric>, PluginError> {
        guard("update_actor", || {
            self.0.update_actor(batch).map(RVec::from)
        })
    }
    fn update_critic(&mut self, batch: &Batch) -> RResult<RVec<Metric>, PluginError> {
        guard("update_critic", || {
            self.0.update_critic(batch).map(RVec::from)
        })
    }
    fn save_checkpoint(&mut self, dir: RStr<'_>, global_step: u64) -> RResult<(), PluginError> {
        guard("save_checkpoint", || {
            self.0.save_checkpoint(dir.as_str(), global_step)
        })
    }
    fn load_checkpoint(&mut self, dir: RStr<'_>) -> RResult<u64, PluginError> {
        guard("load_checkpoint", || self.0.load_checkpoint(dir.as_str()))
    }
    fn weights(&mut self) -> RResult<RVec<TensorRef<'_>>, PluginError> {
        guard("weights", || self.0.weights().map(RVec::from))
    }
    fn export_hf(&mut self, dir: RStr<'_>) -> RResult<(), PluginError> {
        guard("export_hf", || self.0.export_hf(dir.as_str()))
    }
    fn all_gather_object(&mut self, bytes: RSlice<'_, u8>) -> RResult<RVec<RVec<u8>>, PluginError> {
        guard("all_gather_object", || {
            let all = self.0.all_gather_object(bytes.as_slice())?;
            Ok(all.into_iter().map(RVec::from).collect())
        })
    }
}

impl<T: Rollout> StableRollout for Guarded<T> {
    fn init(&mut self, init: RStr<'_>) -> RResult<(), PluginError> {
        guard("init", || self.0.init(&init_record(init)?))
    }
    fn generate(&mut self, request: RStr<'_>) -> RResult<RString, PluginError> {
        guard("generate", || {
            let request: GenerateRequest = decode("generate request", request.as_str())?;
            self.0.generate(&request).map(|out| encode(&out))
        })
    }
    fn update_weights(&mut self, source: &WeightSource<'_>) -> RResult<(), PluginError> {
        guard("update_weights", || self.0.update_weights(source))
    }
    fn sleep(&mut self, level: u32) -> RResult<(), PluginError> {
        guard("sleep", || self.0.sleep(level))
    }
    fn wake_up(&mut self) -> RResult<(), PluginError> {
        guard("wake_up", || self.0.wake_up())
    }
}

impl<T: CheckpointEngine> StableCheckpoint for Guarded<T> {
    fn init(&mut self, init: RStr<'_>) -> RResult<(), PluginError> {
        guard("init", || self.0.init(&init_record(init)?))
    }
    fn send_weights(&mut self, weights: &WeightSource<'_>) -> RResult<RString, PluginError> {
        guard("send_weights", || {
            self.0.send_weights(weights).map(|h| encode(&h))
        })
    }
    fn finalize(&mut self) -> RResult<(), PluginError> {
        guard("finalize", || self.0.finalize())
    }
}

impl<T: Tracker> StableTracker for Guarded<T> {
    fn init(&mut self, init: RStr<'_>) -> RResult<(), PluginError> {
        guard("init", || self.0.init(&init_record(init)?))
    }
    fn log(&mut self, step: u64, metrics: RSlice<'_, Metric>) -> RResult<(), PluginError> {
        guard("log", || self.0.log(step, metrics.as_slice()))
    }
    fn log_table(&mut self, step: u64, table: RStr<'_>) -> RResult<(), PluginError> {
        guard("log_table", || {
            let table: Table = decode("table", table.as_str())?;
            self.0.log_table(step, &table)
        })
    }
    fn finish(&mut self, exit_code: i32) -> RResult<(), PluginError> {
        guard("finish", || self.0.finish(exit_code))
    }
}

impl<T: Reward> StableReward for Guarded<T> {
    fn init(&mut self, init: RStr<'_>) -> RResult<(), PluginError> {
        guard("init", || self.0.init(&init_record(init)?))
    }
    fn compute(&mut self, request: RStr<'_>) -> RResult<RString, PluginError> {
        guard("compute", || {
            let request: RewardRequest = decode("reward request", request.as_str())?;
            self.0.compute(&request).map(|out| encode(&out))
        })
    }
}

/// The kinds of component. A newtype so kinds can be added without a layout change; a host
/// skips components of a kind it does not know.
#[repr(transparent)]
#[derive(
    StableAbi, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord,
)]
#[serde(transparent)]
pub struct ComponentKind(pub u8);

impl ComponentKind {
    pub const DEVICE: Self = Self(0);
    pub const ENGINE: Self = Self(1);
    pub const ROLLOUT: Self = Self(2);
    pub const CHECKPOINT: Self = Self(3);
    pub const TRACKER: Self = Self(4);
    /// Since 2.2.0.
    pub const REWARD: Self = Self(5);
    pub const ALL: [Self; 6] = [
        Self::DEVICE,
        Self::ENGINE,
        Self::ROLLOUT,
        Self::CHECKPOINT,
        Self::TRACKER,
        Self::REWARD,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::DEVICE => "device",
            Self::ENGINE => "engine",
            Self::ROLLOUT => "rollout",
            Self::CHECKPOINT => "checkpoint",
            Self::TRACKER => "tracker",
            Self::REWARD => "reward",
            _ => "unknown",
        }
    }
}

impl std::fmt::Display for ComponentKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One component a plugin offers. Among components of the same kind and name the highest priority
/// wins; for devices, priority is also the detection order.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(default)]
pub struct ComponentMeta {
    pub kind: ComponentKind,
    pub name: String,
    pub priority: i32,
    pub description: String,
    /// The kind's capabilities record (`EngineCapabilities`, `RolloutCapabilities`, …) as JSON.
    pub capabilities: serde_json::Value,
    /// The plugin-owned config section the component reads (e.g. `fsdp_config` under an engine's
    /// role section, `wandb` for a tracker), if any.
    pub config_section: Option<String>,
}

impl Default for ComponentKind {
    fn default() -> Self {
        Self::DEVICE
    }
}

#[sabi_trait]
pub trait StableFactory: Send + Sync {
    fn create_device(&self, name: RStr<'_>) -> RResult<DeviceBox, PluginError>;
    fn create_engine(&self, name: RStr<'_>) -> RResult<EngineBox, PluginError>;
    fn create_rollout(&self, name: RStr<'_>) -> RResult<RolloutBox, PluginError>;
    fn create_checkpoint(&self, name: RStr<'_>) -> RResult<CheckpointBox, PluginError>;
    #[sabi(last_prefix_field)]
    fn create_tracker(&self, name: RStr<'_>) -> RResult<TrackerBox, PluginError>;
    /// Since 2.2.0; a plugin built against an older minor has no reward components.
    fn create_reward(&self, name: RStr<'_>) -> RResult<RewardBox, PluginError> {
        RResult::RErr(PluginError::unsupported(&format!(
            "reward component `{name}`"
        )))
    }
}

pub type FactoryBox = StableFactory_TO<'static, RBox<()>>;

/// What a plugin declares about itself.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(default)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
    pub description: String,
    pub components: Vec<ComponentMeta>,
}

/// What a plugin library hands the host: its [`PluginInfo`] (as JSON) and the factory that
/// creates its components.
#[repr(C)]
#[derive(StableAbi)]
pub struct PluginManifest {
    info: RString,
    pub factory: FactoryBox,
}

impl PluginManifest {
    pub fn info(&self) -> Result<PluginInfo, PluginError> {
        decode("plugin manifest", self.info.as_str())
    }
}

/// The root module every plugin library exports (see [`export_plugin!`](crate::export_plugin)).
/// Prefix type: fields may only be appended after the last one.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModule_Ref)))]
#[sabi(missing_field(panic))]
pub struct PluginModule {
    #[sabi(last_prefix_field)]
    pub manifest: extern "C" fn() -> RResult<PluginManifest, PluginError>,
}

impl RootModule for PluginModule_Ref {
    abi_stable::declare_root_module_statics! {PluginModule_Ref}
    const BASE_NAME: &'static str = "verl_plugin";
    const NAME: &'static str = "verl_plugin";
    const VERSION_STRINGS: VersionStrings = abi_stable::package_version_strings!();
}

#[doc(hidden)]
pub fn __root_module(
    manifest: extern "C" fn() -> RResult<PluginManifest, PluginError>,
) -> PluginModule_Ref {
    use abi_stable::prefix_type::PrefixTypeTrait;
    PluginModule { manifest }.leak_into_prefix()
}

enum Constructor {
    Device(Box<dyn Fn() -> DeviceBox + Send + Sync>),
    Engine(Box<dyn Fn() -> EngineBox + Send + Sync>),
    Rollout(Box<dyn Fn() -> RolloutBox + Send + Sync>),
    Checkpoint(Box<dyn Fn() -> CheckpointBox + Send + Sync>),
    Tracker(Box<dyn Fn() -> TrackerBox + Send + Sync>),
    Reward(Box<dyn Fn() -> RewardBox + Send + Sync>),
}

impl Constructor {
    fn kind(&self) -> ComponentKind {
        match self {
            Self::Device(_) => ComponentKind::DEVICE,
            Self::Engine(_) => ComponentKind::ENGINE,
            Self::Rollout(_) => ComponentKind::ROLLOUT,
            Self::Checkpoint(_) => ComponentKind::CHECKPOINT,
            Self::Tracker(_) => ComponentKind::TRACKER,
            Self::Reward(_) => ComponentKind::REWARD,
        }
    }
}

/// Declares a plugin: its metadata and its components. Used by `export_plugin!` in a plugin library
/// and by the host for its built-in components, so both go through the same guarded objects.
pub struct PluginBuilder {
    name: String,
    version: String,
    description: String,
    components: Vec<(ComponentMeta, Constructor)>,
}

impl PluginBuilder {
    pub fn new(
        name: impl Into<String>,
        version: impl Into<String>,
        description: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            version: version.into(),
            description: description.into(),
            components: Vec::new(),
        }
    }

    fn add(
        mut self,
        name: &str,
        priority: i32,
        description: &str,
        capabilities: serde_json::Value,
        ctor: Constructor,
    ) -> Self {
        let meta = ComponentMeta {
            kind: ctor.kind(),
            name: name.into(),
            priority,
            description: description.into(),
            capabilities,
            config_section: None,
        };
        self.components.push((meta, ctor));
        self
    }

    /// Declares the plugin-owned config section the last added component reads (its own keys are
    /// checked by the component; the host passes the section through).
    pub fn config_section(mut self, section: &str) -> Self {
        if let Some((meta, _)) = self.components.last_mut() {
            meta.config_section = Some(section.to_owned());
        }
        self
    }

    pub fn device<T: Device>(
        self,
        name: &str,
        priority: i32,
        description: &str,
        new: impl Fn() -> T + Send + Sync + 'static,
    ) -> Self {
        let ctor = Constructor::Device(Box::new(move || {
            DeviceBox::from_value(Guarded(new()), abi_stable::sabi_trait::TD_Opaque)
        }));
        self.add(name, priority, description, serde_json::Value::Null, ctor)
    }

    pub fn engine<T: Engine>(
        self,
        name: &str,
        priority: i32,
        description: &str,
        new: impl Fn() -> T + Send + Sync + 'static,
    ) -> Self {
        let ctor = Constructor::Engine(Box::new(move || {
            EngineBox::from_value(Guarded(new()), abi_stable::sabi_trait::TD_Opaque)
        }));
        self.add(
            name,
            priority,
            description,
            capabilities(&T::capabilities()),
            ctor,
        )
    }

    pub fn rollout<T: Rollout>(
        self,
        name: &str,
        priority: i32,
        description: &str,
        new: impl Fn() -> T + Send + Sync + 'static,
    ) -> Self {
        let ctor = Constructor::Rollout(Box::new(move || {
            RolloutBox::from_value(Guarded(new()), abi_stable::sabi_trait::TD_Opaque)
        }));
        self.add(
            name,
            priority,
            description,
            capabilities(&T::capabilities()),
            ctor,
        )
    }

    pub fn checkpoint<T: CheckpointEngine>(
        self,
        name: &str,
        priority: i32,
        description: &str,
        new: impl Fn() -> T + Send + Sync + 'static,
    ) -> Self {
        let ctor = Constructor::Checkpoint(Box::new(move || {
            CheckpointBox::from_value(Guarded(new()), abi_stable::sabi_trait::TD_Opaque)
        }));
        self.add(
            name,
            priority,
            description,
            capabilities(&T::capabilities()),
            ctor,
        )
    }

    pub fn tracker<T: Tracker>(
        self,
        name: &str,
        priority: i32,
        description: &str,
        new: impl Fn() -> T + Send + Sync + 'static,
    ) -> Self {
        let ctor = Constructor::Tracker(Box::new(move || {
            TrackerBox::from_value(Guarded(new()), abi_stable::sabi_trait::TD_Opaque)
        }));
        self.add(
            name,
            priority,
            description,
            capabilities(&T::capabilities()),
            ctor,
        )
    }

    /// A reward function (since 2.2.0).
    pub fn reward<T: Reward>(
        self,
        name: &str,
        priority: i32,
        description: &str,
        new: impl Fn() -> T + Send + Sync + 'static,
    ) -> Self {
        let ctor = Constructor::Reward(Box::new(move || {
            RewardBox::from_value(Guarded(new()), abi_stable::sabi_trait::TD_Opaque)
        }));
        self.add(
            name,
            priority,
            description,
            capabilities(&T::capabilities()),
            ctor,
        )
    }

    pub fn into_manifest(self) -> PluginManifest {
        let info = PluginInfo {
            name: self.name.clone(),
            version: self.version,
            description: self.description,
            components: self
                .components
                .iter()
                .map(|(meta, _)| meta.clone())
                .collect(),
        };
        let factory = Factory {
            plugin: self.name,
            components: self.components,
        };
        PluginManifest {
            info: encode(&info),
            factory: FactoryBox::from_value(factory, abi_stable::sabi_trait::TD_Opaque),
        }
    }
}

fn capabilities<T: Serialize>(record: &T) -> serde_json::Value {
    serde_json::to_value(record).expect("capability records serialise")
}

struct Factory {
    plugin: String,
    components: Vec<(ComponentMeta, Constructor)>,
}

impl Factory {
    fn create<T>(
        &self,
        kind: ComponentKind,
        name: RStr<'_>,
        pick: impl Fn(&Constructor) -> Option<T>,
    ) -> RResult<T, PluginError> {
        guard("component constructor", || {
            self.components
                .iter()
                .filter(|(meta, _)| meta.kind == kind && meta.name == name.as_str())
                .find_map(|(_, ctor)| pick(ctor))
                .ok_or_else(|| {
                    PluginError::other(format!(
                        "plugin `{}` has no {kind} component `{name}`",
                        self.plugin
                    ))
                })
        })
    }
}

impl StableFactory for Factory {
    fn create_device(&self, name: RStr<'_>) -> RResult<DeviceBox, PluginError> {
        self.create(ComponentKind::DEVICE, name, |c| {
            if let Constructor::Device(f) = c {
                Some(f())
            } else {
                None
            }
        })
    }
    fn create_engine(&self, name: RStr<'_>) -> RResult<EngineBox, PluginError> {
        self.create(ComponentKind::ENGINE, name, |c| {
            if let Constructor::Engine(f) = c {
                Some(f())
            } else {
                None
            }
        })
    }
    fn create_rollout(&self, name: RStr<'_>) -> RResult<RolloutBox, PluginError> {
        self.create(ComponentKind::ROLLOUT, name, |c| {
            if let Constructor::Rollout(f) = c {
                Some(f())
            } else {
                None
            }
        })
    }
    fn create_checkpoint(&self, name: RStr<'_>) -> RResult<CheckpointBox, PluginError> {
        self.create(ComponentKind::CHECKPOINT, name, |c| {
            if let Constructor::Checkpoint(f) = c {
                Some(f())
            } else {
                None
            }
        })
    }
    fn create_tracker(&self, name: RStr<'_>) -> RResult<TrackerBox, PluginError> {
        self.create(ComponentKind::TRACKER, name, |c| {
            if let Constructor::Tracker(f) = c {
                Some(f())
            } else {
                None
            }
        })
    }
    fn create_reward(&self, name: RStr<'_>) -> RResult<RewardBox, PluginError> {
        self.create(ComponentKind::REWARD, name, |c| {
            if let Constructor::Reward(f) = c {
                Some(f())
            } else {
                None
            }
        })
    }
}
