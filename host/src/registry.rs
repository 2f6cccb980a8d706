//! One registry for every component, whether built in (registered with `inventory`) or loaded from
//! a plugin library. Same kind and name: the higher priority wins and the other is shadowed; equal
//! priorities are a conflict that makes the name unusable until one plugin is removed.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use verl_plugin_api::{ComponentKind, FactoryBox, PluginBuilder, PluginError, PluginInfo};

use crate::discovery::{Candidate, PluginSearch};
use crate::handle::{
    CheckpointHandle, DeviceHandle, EngineHandle, RewardHandle, RolloutHandle, TrackerHandle,
};
use crate::{LoadError, load, vet};

/// A host's built-in components, registered from any crate linked into the binary with
/// `inventory::submit! { BuiltinPlugin(builder_fn) }`.
pub struct BuiltinPlugin(pub fn() -> PluginBuilder);
inventory::collect!(BuiltinPlugin);

/// Where a component comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Builtin,
    Library(PathBuf),
}

impl Origin {
    pub fn describe(&self) -> String {
        match self {
            Self::Builtin => "<built-in>".to_owned(),
            Self::Library(p) => p.display().to_string(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComponentStatus {
    Active,
    /// A component of the same kind and name with a higher priority is active.
    Shadowed,
    /// Another component of the same kind, name and priority exists.
    Conflict,
}

impl ComponentStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Shadowed => "shadowed",
            Self::Conflict => "conflict",
        }
    }
}

#[derive(Clone)]
pub struct Component {
    pub kind: ComponentKind,
    pub name: String,
    pub priority: i32,
    pub description: String,
    /// The kind's capabilities record as the plugin declared it (JSON).
    pub capabilities: serde_json::Value,
    /// The plugin-owned config section the component reads, if any.
    pub config_section: Option<String>,
    pub plugin: String,
    pub origin: Origin,
    factory: Arc<FactoryBox>,
}

impl std::fmt::Debug for Component {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Component")
            .field("kind", &self.kind)
            .field("name", &self.name)
            .field("priority", &self.priority)
            .field("plugin", &self.plugin)
            .field("origin", &self.origin)
            .finish()
    }
}

/// A plugin library (or the built-in set) and what became of it.
#[derive(Debug, Clone)]
pub struct PluginRecord {
    pub name: String,
    pub version: String,
    pub description: String,
    pub origin: Origin,
    /// `Err` holds why the library was rejected.
    pub status: Result<(), LoadError>,
    pub components: Vec<Component>,
}

/// Two or more components of one kind and name with the same priority.
#[derive(Debug, Clone)]
pub struct Conflict {
    pub kind: ComponentKind,
    pub name: String,
    pub priority: i32,
    pub origins: Vec<Origin>,
}

impl Conflict {
    pub fn message(&self) -> String {
        let origins: Vec<String> = self.origins.iter().map(Origin::describe).collect();
        format!(
            "{} `{}` is registered with the same priority {} by {}; remove one of them or give them different priorities",
            self.kind,
            self.name,
            self.priority,
            origins.join(" and ")
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("no {kind} component named `{name}`; available: {}{}", if available.is_empty() { "none".to_owned() } else { available.join(", ") }, refused_note(refused))]
    Unknown {
        kind: ComponentKind,
        name: String,
        available: Vec<String>,
        /// Plugin files that were refused or failed to load: one of them may have provided it.
        refused: Vec<LoadError>,
    },
    #[error("{}", .0.message())]
    Conflict(Conflict),
    #[error("strategy `{strategy}` has no engine for `{device_type}` devices: engine `{strategy}` runs on [{}]; {}", devices.join(", "), missing_engine_hint(strategy, device_type))]
    NoEngineForDevice {
        strategy: String,
        device_type: String,
        /// The devices the engine named `strategy` declares.
        devices: Vec<String>,
    },
    #[error("strategy `{strategy}` on `{device_type}` is served by several engines at priority {priority}: {}; remove one or give them different priorities", engines.join(", "))]
    AmbiguousEngine {
        strategy: String,
        device_type: String,
        priority: i32,
        /// Each engine's name and origin.
        engines: Vec<String>,
    },
    #[error("creating {kind} `{name}` from {origin}: {source}")]
    Create {
        kind: ComponentKind,
        name: String,
        origin: String,
        source: PluginError,
    },
}

/// The refused plugin files, one line each, after the sentence they complete.
fn refused_note(refused: &[LoadError]) -> String {
    refused.iter().fold(String::new(), |note, error| {
        let lead = if note.is_empty() {
            "; plugin files not loaded (one of them may provide it):"
        } else {
            ""
        };
        format!("{note}{lead}\n  {error}")
    })
}

/// The hint of a [`LookupError::NoEngineForDevice`] error: what would serve the strategy there.
fn missing_engine_hint(strategy: &str, device_type: &str) -> String {
    let verl = if (strategy, device_type) == ("megatron", "npu") {
        " (verl runs MindSpeed there: an engine named `mindspeed` that serves `megatron` on `npu`)"
    } else {
        ""
    };
    format!(
        "load a plugin whose engine declares strategies [{strategy}] and devices [{device_type}]{verl}, or select another platform (VERL_PLATFORM, trainer.device)"
    )
}

#[derive(Default)]
pub struct Registry {
    plugins: Vec<PluginRecord>,
    /// Device and inode of every library loaded.
    loaded_files: HashSet<(u64, u64)>,
}

impl Registry {
    /// A registry holding the built-in components of every crate linked into this binary.
    pub fn with_builtins() -> Self {
        let mut registry = Self::default();
        for builtin in inventory::iter::<BuiltinPlugin> {
            registry.add_builtin(builtin.0());
        }
        registry
    }

    /// Vets, loads and registers every plugin `search` finds, in its order. Failures are recorded
    /// on the plugin's record and never stop the others. A file named like one already loaded is
    /// a copy found later in the search order: it is not opened at all. A file already loaded
    /// through another path (a link, a hard link) is left out quietly once opened.
    pub fn load_all(&mut self, search: &PluginSearch) {
        for candidate in search.candidates() {
            let path = match candidate {
                Candidate::Library(path) => path,
                Candidate::Unreadable(error) => {
                    self.reject(error);
                    continue;
                }
            };
            if let Some(first) = self.loaded_file_named_like(&path) {
                self.reject(LoadError::DuplicateFile { path, first });
                continue;
            }
            match vet::open(&path, search.allow_list.as_ref()) {
                Ok(library) if self.loaded_files.contains(&library.identity()) => {
                    tracing::debug!(path = %path.display(), "a plugin file already loaded, skipped");
                }
                opened => {
                    self.register(&path, opened);
                }
            }
        }
    }

    /// The loaded library whose file name is `path`'s.
    fn loaded_file_named_like(&self, path: &Path) -> Option<PathBuf> {
        self.plugins.iter().find_map(|p| match &p.origin {
            Origin::Library(first) if p.status.is_ok() && first.file_name() == path.file_name() => {
                Some(first.clone())
            }
            _ => None,
        })
    }

    /// Vets, loads and registers one library; returns its record.
    pub fn load_file(&mut self, path: &Path, allow_list: Option<&vet::AllowList>) -> &PluginRecord {
        let opened = vet::open(path, allow_list);
        self.register(path, opened)
    }

    /// Loads the library `vet::open` checked (or records why it did not) and registers it.
    fn register(
        &mut self,
        path: &Path,
        opened: Result<vet::CheckedLibrary, LoadError>,
    ) -> &PluginRecord {
        let loaded = opened.and_then(|library| {
            let identity = library.identity();
            let manifest = load::load_manifest(library)?;
            let info = manifest.info().map_err(|e| LoadError::Registration {
                path: path.into(),
                reason: e.to_string(),
            })?;
            match self
                .plugins
                .iter()
                .find(|p| p.status.is_ok() && p.name == info.name)
            {
                Some(first) => Err(LoadError::Duplicate {
                    path: path.into(),
                    name: info.name,
                    first: PathBuf::from(first.origin.describe()),
                }),
                None => Ok((info, manifest.factory, identity)),
            }
        });
        match loaded {
            Ok((info, factory, identity)) => {
                tracing::debug!(plugin = %info.name, path = %path.display(), "loaded plugin");
                self.loaded_files.insert(identity);
                self.add(info, factory, Origin::Library(path.into()));
            }
            Err(error) => self.reject(error),
        }
        self.plugins.last().expect("a record was just pushed")
    }

    fn reject(&mut self, error: LoadError) {
        tracing::warn!("{error}");
        let path = error.path().to_owned();
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().trim_start_matches("lib").to_owned())
            .unwrap_or_default();
        self.plugins.push(PluginRecord {
            name,
            version: String::new(),
            description: String::new(),
            origin: Origin::Library(path),
            status: Err(error),
            components: Vec::new(),
        });
    }

    /// Registers in-process components as built-ins (what `inventory` submissions become; also lets
    /// plugin authors test a builder without building a library).
    pub fn add_builtin(&mut self, builder: PluginBuilder) {
        let manifest = builder.into_manifest();
        let info = manifest.info().expect("a builder's manifest reads back");
        self.add(info, manifest.factory, Origin::Builtin);
    }

    fn add(&mut self, info: PluginInfo, factory: FactoryBox, origin: Origin) {
        let factory = Arc::new(factory);
        let components = info
            .components
            .into_iter()
            .filter(|meta| {
                let known = ComponentKind::ALL.contains(&meta.kind);
                if !known {
                    tracing::warn!(
                        "{}: component `{}` is of a kind (code {}) this verl-core does not know; skipped",
                        origin.describe(),
                        meta.name,
                        meta.kind.0
                    );
                }
                known
            })
            .map(|meta| Component {
                kind: meta.kind,
                name: meta.name,
                priority: meta.priority,
                description: meta.description,
                capabilities: meta.capabilities,
                config_section: meta.config_section,
                plugin: info.name.clone(),
                origin: origin.clone(),
                factory: Arc::clone(&factory),
            })
            .collect();
        self.plugins.push(PluginRecord {
            name: info.name,
            version: info.version,
            description: info.description,
            origin,
            status: Ok(()),
            components,
        });
    }

    pub fn plugins(&self) -> &[PluginRecord] {
        &self.plugins
    }

    /// Why each plugin file that could have provided a component was not loaded (copies of a
    /// loaded plugin left out).
    fn refused(&self) -> Vec<LoadError> {
        self.plugins
            .iter()
            .filter_map(|p| p.status.as_ref().err())
            .filter(|e| {
                !matches!(
                    e,
                    LoadError::Duplicate { .. } | LoadError::DuplicateFile { .. }
                )
            })
            .cloned()
            .collect()
    }

    /// Components of loaded plugins grouped by (kind, name), highest priority first.
    fn groups(&self) -> BTreeMap<(ComponentKind, &str), Vec<&Component>> {
        let mut groups: BTreeMap<(ComponentKind, &str), Vec<&Component>> = BTreeMap::new();
        for c in self
            .plugins
            .iter()
            .filter(|p| p.status.is_ok())
            .flat_map(|p| &p.components)
        {
            groups.entry((c.kind, c.name.as_str())).or_default().push(c);
        }
        for group in groups.values_mut() {
            group.sort_by_key(|c| std::cmp::Reverse(c.priority));
        }
        groups
    }

    /// Whether `component` is the one used for its kind and name.
    pub fn status(&self, component: &Component) -> ComponentStatus {
        let groups = self.groups();
        let group = &groups[&(component.kind, component.name.as_str())];
        let top = group[0].priority;
        if component.priority < top {
            ComponentStatus::Shadowed
        } else if group.iter().filter(|c| c.priority == top).count() > 1 {
            ComponentStatus::Conflict
        } else {
            ComponentStatus::Active
        }
    }

    pub fn conflicts(&self) -> Vec<Conflict> {
        self.groups()
            .into_iter()
            .filter_map(|((kind, name), group)| {
                let top: Vec<&&Component> = group
                    .iter()
                    .filter(|c| c.priority == group[0].priority)
                    .collect();
                (top.len() > 1).then(|| Conflict {
                    kind,
                    name: name.to_owned(),
                    priority: group[0].priority,
                    origins: top.iter().map(|c| c.origin.clone()).collect(),
                })
            })
            .collect()
    }

    /// The names usable for `kind`, sorted.
    pub fn names(&self, kind: ComponentKind) -> Vec<String> {
        self.groups()
            .keys()
            .filter(|(k, _)| *k == kind)
            .map(|(_, n)| (*n).to_owned())
            .collect()
    }

    /// The winning component of `kind` called `name`.
    pub fn resolve(&self, kind: ComponentKind, name: &str) -> Result<Component, LookupError> {
        let groups = self.groups();
        let Some(group) = groups.get(&(kind, name)) else {
            return Err(LookupError::Unknown {
                kind,
                name: name.to_owned(),
                available: self.names(kind),
                refused: self.refused(),
            });
        };
        if let Some(conflict) = self
            .conflicts()
            .into_iter()
            .find(|c| c.kind == kind && c.name == name)
        {
            return Err(LookupError::Conflict(conflict));
        }
        Ok(group[0].clone())
    }

    /// Every device name with its winning component (or why there is none), highest priority first.
    pub fn devices(&self) -> Vec<(String, Result<Component, LookupError>)> {
        let mut tops: Vec<(i32, String)> = self
            .groups()
            .into_iter()
            .filter(|((kind, _), _)| *kind == ComponentKind::DEVICE)
            .map(|((_, name), group)| (group[0].priority, name.to_owned()))
            .collect();
        tops.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        tops.into_iter()
            .map(|(_, name)| {
                let resolved = self.resolve(ComponentKind::DEVICE, &name);
                (name, resolved)
            })
            .collect()
    }
}

impl Component {
    fn created<T>(
        &self,
        made: abi_stable::std_types::RResult<T, PluginError>,
    ) -> Result<T, LookupError> {
        made.into_result().map_err(|source| LookupError::Create {
            kind: self.kind,
            name: self.name.clone(),
            origin: self.origin.describe(),
            source,
        })
    }
    pub fn create_device(&self) -> Result<DeviceHandle, LookupError> {
        self.created(self.factory.create_device(self.name.as_str().into()))
            .map(DeviceHandle)
    }
    pub fn create_engine(&self) -> Result<EngineHandle, LookupError> {
        self.created(self.factory.create_engine(self.name.as_str().into()))
            .map(EngineHandle)
    }
    pub fn create_rollout(&self) -> Result<RolloutHandle, LookupError> {
        self.created(self.factory.create_rollout(self.name.as_str().into()))
            .map(RolloutHandle)
    }
    pub fn create_checkpoint(&self) -> Result<CheckpointHandle, LookupError> {
        self.created(self.factory.create_checkpoint(self.name.as_str().into()))
            .map(CheckpointHandle)
    }
    pub fn create_tracker(&self) -> Result<TrackerHandle, LookupError> {
        self.created(self.factory.create_tracker(self.name.as_str().into()))
            .map(TrackerHandle)
    }
    pub fn create_reward(&self) -> Result<RewardHandle, LookupError> {
        self.created(self.factory.create_reward(self.name.as_str().into()))
            .map(RewardHandle)
    }

    /// The declared capabilities as the kind's record (defaults where the plugin declared none
    /// or declared fields this build does not know).
    pub fn capabilities<T: serde::de::DeserializeOwned + Default>(&self) -> T {
        serde_json::from_value(self.capabilities.clone()).unwrap_or_else(|e| {
            tracing::warn!(
                "{} `{}` from {}: unreadable capabilities ({e}); assuming none",
                self.kind,
                self.name,
                self.origin.describe()
            );
            T::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use verl_plugin_api::{Detection, Device, DeviceInfo, PluginError, ProbeContext};

    use super::*;

    struct Fake(&'static str);
    impl Device for Fake {
        fn info(&self) -> DeviceInfo {
            DeviceInfo::new(self.0, "test", "cpu", "gloo")
        }
        fn detect(&self, _: &ProbeContext) -> Result<Detection, PluginError> {
            Ok(Detection::available(1, self.0))
        }
    }

    fn plugin(name: &str, devices: &[(&'static str, i32)]) -> PluginBuilder {
        devices.iter().fold(
            PluginBuilder::new(name, "1.0.0", "test"),
            |b, &(dev, prio)| b.device(dev, prio, "d", move || Fake(dev)),
        )
    }

    #[test]
    fn higher_priority_shadows_and_equal_priority_conflicts() {
        let mut registry = Registry::default();
        registry.add_builtin(plugin("low", &[("x", 1), ("y", 5)]));
        registry.add_builtin(plugin("high", &[("x", 9)]));
        registry.add_builtin(plugin("twin", &[("y", 5)]));
        let x = registry.resolve(ComponentKind::DEVICE, "x").unwrap();
        assert_eq!((x.plugin.as_str(), x.priority), ("high", 9));
        let statuses: Vec<(String, &str)> = registry
            .plugins()
            .iter()
            .flat_map(|p| {
                p.components.iter().map(|c| {
                    (
                        format!("{}:{}", p.name, c.name),
                        registry.status(c).as_str(),
                    )
                })
            })
            .collect();
        assert_eq!(
            statuses,
            vec![
                ("low:x".into(), "shadowed"),
                ("low:y".into(), "conflict"),
                ("high:x".into(), "active"),
                ("twin:y".into(), "conflict")
            ]
        );
        let err = registry
            .resolve(ComponentKind::DEVICE, "y")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`y`") && err.contains("priority 5"), "{err}");
        let err = registry
            .resolve(ComponentKind::DEVICE, "z")
            .unwrap_err()
            .to_string();
        assert_eq!(err, "no device component named `z`; available: x, y");
        let err = registry
            .resolve(ComponentKind::ENGINE, "fsdp")
            .unwrap_err()
            .to_string();
        assert_eq!(err, "no engine component named `fsdp`; available: none");
        let names: Vec<String> = registry
            .devices()
            .into_iter()
            .map(|(n, r)| format!("{n}:{}", r.is_ok()))
            .collect();
        assert_eq!(names, vec!["x:true", "y:false"]);
        assert_eq!(
            registry
                .resolve(ComponentKind::DEVICE, "x")
                .unwrap()
                .create_device()
                .unwrap()
                .detect(&ProbeContext::new("/", Vec::<(String, String)>::new()))
                .unwrap()
                .reason,
            "x"
        );
    }

    #[test]
    fn a_missing_component_names_the_plugin_files_not_loaded() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let writable = dir.path().join("libverl_plugin_fsdp.so");
        std::fs::write(&writable, b"x").unwrap();
        std::fs::set_permissions(&writable, std::fs::Permissions::from_mode(0o666)).unwrap();
        let mut registry = Registry::default();
        registry.add_builtin(plugin("cpu", &[("cpu", 1)]));
        let record = registry.load_file(&writable, None);
        assert!(matches!(record.status, Err(LoadError::Writable { .. })));
        let err = registry
            .resolve(ComponentKind::ENGINE, "fsdp")
            .unwrap_err()
            .to_string();
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(
            lines[0],
            "no engine component named `fsdp`; available: none; plugin files not loaded (one of them may provide it):"
        );
        assert_eq!(lines.len(), 2, "{err}");
        assert!(
            lines[1].starts_with(&format!("  {}: refused before loading", writable.display())),
            "{err}"
        );
    }
}
