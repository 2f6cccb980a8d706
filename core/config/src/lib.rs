//! The run config with verl's keys and defaults, layered with `figment`:
//! built-in defaults < config file (YAML or TOML by extension) < `VERL_` environment variables <
//! Hydra-style command-line overrides (`actor_rollout_ref.actor.optim.lr=1e-6`,
//! `trainer.logger=[console,file]`). `${trainer.project_name}`-style interpolation is resolved
//! last, on the merged result.
//!
//! Environment variables: `VERL_` + the key path with sections joined by `__`, any case:
//! `VERL_TRAINER__TOTAL_EPOCHS=3`, `VERL_ACTOR_ROLLOUT_REF__ACTOR__OPTIM__LR=1e-6`. Values use the
//! override syntax. Every config key sits in a section, so only names containing `__` are config:
//! `VERL_PLATFORM`, `VERL_PLUGIN_PATH`, `VERL_PROBE_ROOT`, `VERL_PLUGIN_ALLOWLIST`,
//! `VERL_FILE_LOGGER_PATH` and verl's own single-level variables are never read as config.
//!
//! Unknown keys and wrong types are errors naming the full key path and where the value came from;
//! unknown keys come with the nearest valid key. In files, verl's `_target_` markers and Hydra's
//! top-level `defaults`/`hydra` entries are ignored.
//!
//! Plugin-owned sections (an engine's `fsdp_config`, a logger's `wandb`, …; see [`Slot`]) are
//! accepted only under the names the caller declares in [`PluginSections`]; their contents pass
//! through to the plugin ([`Config::plugin_section`]), which checks them.

mod audit;
#[cfg(test)]
mod distill_tests;
mod interp;
mod jobs;
mod overrides;
mod plugin;
mod sections;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use figment::providers::{Format, Serialized, Toml, Yaml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use audit::{
    AuditContext, AuditScope, Finding, RULES, Rule, Severity, Treatment, audit, generate_scope,
    rule_for, score_scope,
};
pub use jobs::{QuickstartConfig, SftConfig, TinyModel};
pub use plugin::{EngineRole, REF_INHERITS_MEGATRON, TokenBudget};
pub use sections::{PluginSection, PluginSections, SectionKind, Slot};
pub use verl_schema::*;

/// Prefix of config environment variables.
pub const ENV_PREFIX: &str = "VERL_";
/// Separator of key-path segments in config environment variables.
pub const ENV_SEPARATOR: &str = "__";

/// The whole config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    pub data: DataConfig,
    pub actor_rollout_ref: ActorRolloutRefConfig,
    pub critic: CriticConfig,
    pub reward_model: RewardModelConfig,
    pub custom_reward_function: CustomRewardFunctionConfig,
    pub algorithm: AlgorithmConfig,
    pub trainer: TrainerConfig,
    /// verl's fully-async settings (`trainer.training_mode=fully_async`).
    pub async_training: AsyncTrainingConfig,
    /// On-policy distillation from a teacher model.
    pub distillation: DistillationConfig,
    /// Prepare the synthetic task, a tiny model and its warm-up when missing (`verl-core run`'s
    /// embedded default).
    pub quickstart: QuickstartConfig,
    /// Supervised fine-tuning (`verl-core sft`, and the quickstart's warm-up).
    pub sft: SftConfig,
    /// verl's Ray settings: accepted so verl's scripts run; nothing here uses Ray.
    pub ray_kwargs: Value,
    /// verl's profiler settings: accepted so verl's scripts run; no profiler is wired.
    pub global_profiler: Value,
    /// Logger sections (also accepted under `trainer.<name>`).
    #[serde(flatten)]
    pub sections: Sections,
    #[serde(skip)]
    pub(crate) provenance: sections::Provenance,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            data: DataConfig::default(),
            actor_rollout_ref: ActorRolloutRefConfig::default(),
            critic: CriticConfig::default(),
            reward_model: RewardModelConfig::default(),
            custom_reward_function: CustomRewardFunctionConfig::default(),
            algorithm: AlgorithmConfig::default(),
            trainer: TrainerConfig::default(),
            async_training: AsyncTrainingConfig::default(),
            distillation: DistillationConfig::default(),
            quickstart: QuickstartConfig::default(),
            sft: SftConfig::default(),
            ray_kwargs: empty_object(),
            global_profiler: empty_object(),
            sections: Sections::new(),
            provenance: sections::Provenance::default(),
        }
    }
}

/// verl's pass-through dicts, whose contents are not checked (plugin sections are declared
/// separately, see [`PluginSections`]).
pub const FREE_FORM: [&str; 11] = [
    "data.apply_chat_template_kwargs",
    "custom_reward_function.reward_kwargs",
    "actor_rollout_ref.model.override_config",
    "actor_rollout_ref.actor.profiler",
    "actor_rollout_ref.ref.profiler",
    "critic.model",
    "critic.profiler",
    "reward_model.model",
    "ray_kwargs",
    "global_profiler",
    "distillation.teacher_model.inference",
];

/// A config that cannot be used; every variant says which key and which source.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("unknown config key `{key}` (from {origin}){}", suggestion.as_ref().map(|s| format!("; did you mean `{s}`?")).unwrap_or_default())]
    UnknownKey {
        key: String,
        origin: String,
        suggestion: Option<String>,
    },
    #[error("config key `{key}` (from {origin}): {message}")]
    Invalid {
        key: String,
        origin: String,
        message: String,
    },
    #[error("config file {}: {message}", path.display())]
    File { path: PathBuf, message: String },
    #[error("{origin}: {message}")]
    Syntax { origin: String, message: String },
    #[error("config key `{key}`: {message}")]
    Interpolation { key: String, message: String },
}

/// One layer's values with where they came from, as a figment provider.
struct Layer {
    tree: Value,
    metadata: Metadata,
}

impl Layer {
    /// `origin(key path)` names the source of a key in errors.
    fn new(
        tree: Value,
        name: &'static str,
        origin: impl Fn(&[&str]) -> String + Clone + Send + Sync + 'static,
    ) -> Self {
        let metadata =
            Metadata::named(name).interpolater(move |_: &Profile, keys: &[&str]| origin(keys));
        Self { tree, metadata }
    }
}

impl Provider for Layer {
    fn metadata(&self) -> Metadata {
        self.metadata.clone()
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Serialized::defaults(&self.tree).data()
    }
}

/// The valid keys: the defaults serialised, with [`FREE_FORM`] sections and the declared plugin
/// sections taking anything.
struct Schema<'a> {
    root: Value,
    sections: &'a PluginSections,
}

/// An env/CLI layer's operation: the key path, the value set (None: `~key`), its origin.
type Op = (Vec<String>, Option<Value>, String);

/// Where a key path ends in the schema.
enum Lookup<'a> {
    Value(&'a Value),
    FreeForm,
}

impl<'a> Schema<'a> {
    fn new(sections: &'a PluginSections) -> Self {
        Self {
            root: serde_json::to_value(Config::default()).expect("defaults serialise"),
            sections,
        }
    }

    /// Whether `name` under `parent` is a declared plugin section (core's own keys come first).
    fn is_plugin_section(&self, parent: &[String], name: &str) -> bool {
        sections::slot_kind(parent).is_some_and(|kind| self.sections.contains(kind, name))
    }

    /// Checks `path` exists; `origin` names the source for the error.
    fn lookup(&self, path: &[String], origin: &str) -> Result<Lookup<'_>, ConfigError> {
        let mut node = &self.root;
        for (i, segment) in path.iter().enumerate() {
            if i > 0 && FREE_FORM.contains(&path[..i].join(".").as_str()) {
                return Ok(Lookup::FreeForm);
            }
            let key = path[..=i].join(".");
            let Value::Object(map) = node else {
                return Err(ConfigError::Invalid {
                    key: path[..i].join("."),
                    origin: origin.to_owned(),
                    message: format!("is a value, not a section (cannot set `{key}`)"),
                });
            };
            match map.get(segment) {
                Some(child) => node = child,
                None if FREE_FORM.contains(&key.as_str()) => return Ok(Lookup::FreeForm),
                None if self.is_plugin_section(&path[..i], segment) => {
                    return Ok(Lookup::FreeForm);
                }
                None => {
                    return Err(ConfigError::UnknownKey {
                        suggestion: self.suggest(&path[..i], segment),
                        key,
                        origin: origin.to_owned(),
                    });
                }
            }
        }
        if FREE_FORM.contains(&path.join(".").as_str()) {
            Ok(Lookup::FreeForm)
        } else {
            Ok(Lookup::Value(node))
        }
    }

    /// The nearest sibling (a plugin section declared there included) by edit distance, else the
    /// first key with the same name elsewhere.
    fn suggest(&self, parent: &[String], segment: &str) -> Option<String> {
        let prefix = |k: &str| {
            parent
                .iter()
                .map(String::as_str)
                .chain([k])
                .collect::<Vec<_>>()
                .join(".")
        };
        let siblings = parent
            .iter()
            .try_fold(&self.root, |v, k| v.get(k))
            .and_then(Value::as_object);
        let declared = sections::slot_kind(parent)
            .into_iter()
            .flat_map(|kind| self.sections.names(kind));
        let close = siblings
            .into_iter()
            .flat_map(|m| m.keys().map(String::as_str))
            .chain(declared)
            .map(|k| (strsim::levenshtein(k, segment), k))
            .filter(|(d, k)| *d <= (k.len() / 3).max(2))
            .min();
        if let Some((_, k)) = close {
            return Some(prefix(k));
        }
        let mut found = Vec::new();
        collect_paths(&self.root, &mut Vec::new(), &mut |path| {
            if path.last().is_some_and(|k| k == segment) {
                found.push(path.join("."));
            }
        });
        // Sorted key order: `actor_rollout_ref.*` comes before `critic.*`.
        found.into_iter().next()
    }

    /// Parses an env/CLI `text` for `path` and records it in the layer's `tree` and in `ops`.
    /// Null on a free-form section or a plugin slot resets it, so it is a deletion: merged into
    /// the layers below, an empty mapping would keep their keys.
    fn set(
        &self,
        tree: &mut Value,
        ops: &mut Vec<Op>,
        path: Vec<String>,
        text: &str,
        origin: String,
    ) -> Result<(), ConfigError> {
        let mut value = parse_for(self, &path, text, &origin)?;
        let null = value.is_null();
        self.check_layer(&mut value, &mut path.clone(), &origin)?;
        if null && value.is_object() {
            ops.push((path, None, origin));
        } else {
            insert(tree, &path, value.clone());
            ops.push((path, Some(value), origin));
        }
        Ok(())
    }

    /// Checks every key of a layer's `tree` (the value at `path`; empty for a whole file) and
    /// resolves its nulls: an optional key keeps null (unset); a free-form section or a plugin
    /// slot goes back to its default (empty); inside a plugin or free-form section null stays, for
    /// its owner to read; on any other key null is an error naming it.
    fn check_layer(
        &self,
        tree: &mut Value,
        path: &mut Vec<String>,
        origin: &str,
    ) -> Result<(), ConfigError> {
        let found = if path.is_empty() {
            Lookup::Value(&self.root)
        } else {
            self.lookup(path, origin)?
        };
        match (tree, found) {
            (tree @ Value::Null, found) if !path.is_empty() => {
                let key = path.join(".");
                let message = match found {
                    Lookup::Value(Value::Null) => return Ok(()),
                    Lookup::FreeForm if !FREE_FORM.contains(&key.as_str()) => return Ok(()),
                    Lookup::FreeForm => {
                        *tree = empty_object();
                        return Ok(());
                    }
                    Lookup::Value(Value::Object(m)) if m.is_empty() => {
                        *tree = empty_object();
                        return Ok(());
                    }
                    Lookup::Value(Value::Object(_)) => {
                        "is a section and cannot be null (`~key` resets a key to its default)"
                            .to_owned()
                    }
                    Lookup::Value(default) => {
                        format!("cannot be null: it has no unset value (its default is {default})")
                    }
                };
                Err(ConfigError::Invalid {
                    key,
                    origin: origin.to_owned(),
                    message,
                })
            }
            (Value::Object(map), Lookup::Value(Value::Object(_))) => {
                for (k, v) in map.iter_mut() {
                    path.push(k.clone());
                    self.check_layer(v, path, origin)?;
                    path.pop();
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

fn collect_paths(v: &Value, path: &mut Vec<String>, f: &mut impl FnMut(&[String])) {
    if let Value::Object(map) = v {
        for (k, child) in map {
            path.push(k.clone());
            f(path);
            collect_paths(child, path, f);
            path.pop();
        }
    }
}

/// Sets `path` in `tree`, creating sections.
fn insert(tree: &mut Value, path: &[String], value: Value) {
    let mut node = tree;
    for segment in &path[..path.len() - 1] {
        if !node.get(segment).is_some_and(Value::is_object) {
            node[segment.as_str()] = Value::Object(Default::default());
        }
        node = &mut node[segment.as_str()];
    }
    node[path[path.len() - 1].as_str()] = value;
}

/// Drops verl's structured-config markers and Hydra's composition entries.
fn strip_markers(tree: &mut Value, top: bool) {
    if let Value::Object(map) = tree {
        map.remove("_target_");
        if top {
            map.remove("defaults");
            map.remove("hydra");
        }
        map.values_mut().for_each(|v| strip_markers(v, false));
    }
}

/// The format of a config file's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileFormat {
    Yaml,
    Toml,
}

impl FileFormat {
    /// By extension: `.yaml`/`.yml` or `.toml`.
    pub fn from_path(path: &Path) -> Option<Self> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("yaml" | "yml") => Some(Self::Yaml),
            Some("toml") => Some(Self::Toml),
            _ => None,
        }
    }
}

/// The config-file layer: a file on disk, or config text held in memory (the quickstart YAML
/// embedded in the binary), which is parsed from the string.
#[derive(Debug, Clone, Copy)]
pub enum ConfigSource<'a> {
    /// A file; its format follows its extension.
    File(&'a Path),
    /// Text; `name` stands for it in errors (`config key `x` (from <name>)`).
    Text {
        text: &'a str,
        format: FileFormat,
        name: &'a str,
    },
}

impl ConfigSource<'_> {
    /// How errors name where a key came from.
    fn origin(&self) -> String {
        match self {
            Self::File(path) => format!("config file {}", path.display()),
            Self::Text { name, .. } => (*name).to_owned(),
        }
    }

    /// The layer's tree, markers stripped.
    fn read(&self) -> Result<Value, ConfigError> {
        match *self {
            Self::File(path) => {
                let file_err = |message: String| ConfigError::File {
                    path: path.to_owned(),
                    message,
                };
                let text = std::fs::read_to_string(path).map_err(|e| file_err(e.to_string()))?;
                let format = FileFormat::from_path(path).ok_or_else(|| {
                    file_err("unknown format (expected .yaml, .yml or .toml)".into())
                })?;
                parse_text(&text, format).map_err(file_err)
            }
            Self::Text { text, format, name } => {
                parse_text(text, format).map_err(|message| ConfigError::Syntax {
                    origin: name.to_owned(),
                    message,
                })
            }
        }
    }
}

fn parse_text(text: &str, format: FileFormat) -> Result<Value, String> {
    let data = match format {
        FileFormat::Yaml => {
            // figment's YAML reader keeps the last of two equal keys; verl's (OmegaConf) refuses
            // them, and so does serde_yaml's own mapping (naming the key and its mapping's line).
            serde_yaml::from_str::<serde_yaml::Value>(text).map_err(|e| e.to_string())?;
            Yaml::string(text).data()
        }
        FileFormat::Toml => Toml::string(text).data(),
    }
    .map_err(|e| e.to_string())?;
    let dict = data.into_values().next().unwrap_or_default();
    reject_non_finite("", &dict)?;
    let mut tree = serde_json::to_value(dict).map_err(|e| e.to_string())?;
    if tree.is_null() {
        tree = Value::Object(Default::default());
    }
    strip_markers(&mut tree, true);
    Ok(tree)
}

/// TOML and YAML spell NaN and infinities (`nan`, `.inf`); JSON has no such numbers and would
/// turn them into null, so they are refused here, by key.
fn reject_non_finite(prefix: &str, dict: &Dict) -> Result<(), String> {
    fn check(path: &str, value: &figment::value::Value) -> Result<(), String> {
        use figment::value::Value as V;
        match value {
            V::Num(_, num) => match num.to_f64() {
                Some(x) if !x.is_finite() => Err(format!("`{path}` is {x}: give a finite number")),
                _ => Ok(()),
            },
            V::Dict(_, dict) => reject_non_finite(path, dict),
            V::Array(_, items) => items
                .iter()
                .enumerate()
                .try_for_each(|(i, item)| check(&format!("{path}[{i}]"), item)),
            _ => Ok(()),
        }
    }
    dict.iter().try_for_each(|(key, value)| {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        check(&path, value)
    })
}

impl Config {
    /// Loads the config from the process environment (see [`Config::load`]).
    pub fn from_process(
        file: Option<&Path>,
        overrides: &[String],
        sections: &PluginSections,
    ) -> Result<Self, ConfigError> {
        Self::load(file, std::env::vars(), overrides, sections)
    }

    /// [`Config::from_process`] with the file layer from `source` (a file, or text in memory).
    pub fn from_process_source(
        source: Option<ConfigSource<'_>>,
        overrides: &[String],
        sections: &PluginSections,
    ) -> Result<Self, ConfigError> {
        Self::load_source(source, std::env::vars(), overrides, sections)
    }

    /// Layers defaults, `file`, the `VERL_…__…` variables among `env`, and `overrides`; then
    /// resolves interpolations (`${oc.env:…}` reads `env`). `sections` are the plugin sections
    /// accepted in their slots (built from the plugin registry).
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        overrides: &[String],
        sections: &PluginSections,
    ) -> Result<Self, ConfigError> {
        Self::load_source(file.map(ConfigSource::File), env, overrides, sections)
    }

    /// [`Config::load`] with the file layer from `source` (a file, or text in memory).
    pub fn load_source(
        source: Option<ConfigSource<'_>>,
        env: impl IntoIterator<Item = (String, String)>,
        overrides: &[String],
        sections: &PluginSections,
    ) -> Result<Self, ConfigError> {
        let env: HashMap<String, String> = env.into_iter().collect();
        let schema = Schema::new(sections);
        let mut figment =
            Figment::from(Layer::new(schema.root.clone(), "built-in defaults", |_| {
                "built-in defaults".to_owned()
            }));
        // Each layer's tree and origins, lowest first: where plugin-section keys came from.
        let mut layers = Vec::new();
        let mut merge = |figment: Figment, layer: Layer| {
            layers.push((layer.tree.clone(), layer.metadata.clone()));
            figment.merge(layer)
        };

        if let Some(source) = source {
            let mut tree = source.read()?;
            let origin = source.origin();
            schema.check_layer(&mut tree, &mut Vec::new(), &origin)?;
            figment = merge(
                figment,
                Layer::new(tree, "config file", move |_| origin.clone()),
            );
        }

        // Every env/CLI set and deletion in order (path, value or None for a deletion, origin):
        // deletions are applied after the merge, and what follows one is applied again on top.
        let mut ops: Vec<Op> = Vec::new();
        let mut env_tree = Value::Object(Default::default());
        let mut vars: Vec<(&String, &String)> = env
            .iter()
            .filter(|(k, _)| k.starts_with(ENV_PREFIX) && k.contains(ENV_SEPARATOR))
            .collect();
        vars.sort();
        for (name, text) in vars {
            let origin = format!("environment variable {name}");
            let path: Vec<String> = name[ENV_PREFIX.len()..]
                .split(ENV_SEPARATOR)
                .map(str::to_ascii_lowercase)
                .collect();
            schema.set(&mut env_tree, &mut ops, path, text, origin)?;
        }
        figment = merge(
            figment,
            Layer::new(env_tree, "environment", |keys| {
                format!(
                    "environment variable {ENV_PREFIX}{}",
                    keys.join(ENV_SEPARATOR).to_ascii_uppercase()
                )
            }),
        );

        let mut cli_tree = Value::Object(Default::default());
        let mut cli_args: HashMap<String, String> = HashMap::new();
        for arg in overrides {
            let origin = format!("command-line override `{arg}`");
            let syntax = |message| ConfigError::Syntax {
                origin: origin.clone(),
                message,
            };
            match overrides::parse_override(arg).map_err(syntax)? {
                overrides::Override::Set(path, text) => {
                    cli_args.insert(path.join("."), arg.clone());
                    schema.set(&mut cli_tree, &mut ops, path, text, origin)?;
                }
                overrides::Override::Delete(path) => {
                    schema.lookup(&path, &origin)?;
                    ops.push((path, None, origin));
                }
            }
        }
        let cli_args = Arc::new(cli_args);
        figment = merge(
            figment,
            Layer::new(cli_tree, "command line", move |keys| {
                // A type error may name a key inside the overridden value: report the override.
                (1..=keys.len())
                    .rev()
                    .find_map(|n| cli_args.get(&keys[..n].join(".")))
                    .map_or_else(
                        || "the command line".to_owned(),
                        |arg| format!("command-line override `{arg}`"),
                    )
            }),
        );

        let config: Config = figment.extract().map_err(from_figment)?;
        let mut tree = serde_json::to_value(&config).expect("config serialises");
        apply_deletions(&mut tree, &schema, &ops)?;
        interp::resolve_all(&mut tree, &env)
            .map_err(|(key, message)| ConfigError::Interpolation { key, message })?;
        let provenance = origins(&tree, &schema, &layers)?;
        let mut config: Config = serde_json::from_value(tree).map_err(|e| ConfigError::Syntax {
            origin: "the merged config".to_owned(),
            message: e.to_string(),
        })?;
        config.provenance = provenance;
        Ok(config)
    }

    /// Where `key` (a dotted path) was last set: a config file, an environment variable or a
    /// command-line override; None when only the built-in defaults set it.
    pub fn origin(&self, key: &str) -> Option<&str> {
        self.provenance.0.get(key).map(String::as_str)
    }

    /// Whether a config file, variable or override sets `key` (a dotted path) or a key inside it.
    pub fn sets(&self, key: &str) -> bool {
        let inside = format!("{key}.");
        self.provenance
            .0
            .keys()
            .any(|k| k == key || k.starts_with(&inside))
    }

    /// The config as YAML (`verl-core config show`).
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).expect("config serialises")
    }

    /// The config as JSON (what trackers log as run parameters).
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("config serialises")
    }

    /// One key or section by dotted path (`verl-core config show trainer`).
    pub fn get(&self, path: &str) -> Option<Value> {
        path.split('.')
            .filter(|s| !s.is_empty())
            .try_fold(self.to_json(), |v, k| v.get(k).cloned())
    }
}

/// The origin of every key of the merged `tree` that a layer sets (a config file, an environment
/// variable, an override): the highest such layer, or the one that sets a section above the key.
/// Keys left at their built-in default have none. A plugin section must be a mapping.
fn origins(
    tree: &Value,
    schema: &Schema,
    layers: &[(Value, Metadata)],
) -> Result<sections::Provenance, ConfigError> {
    let origin = |path: &[String]| {
        let keys: Vec<&str> = path.iter().map(String::as_str).collect();
        layers
            .iter()
            .rev()
            .find(|(layer, _)| keys.iter().try_fold(layer, |v, k| v.get(k)).is_some())
            .map(|(_, metadata)| metadata.interpolate(&Profile::default(), &keys))
    };
    let mut origins = std::collections::BTreeMap::new();
    let mut not_a_mapping = None;
    collect_paths(tree, &mut Vec::new(), &mut |path| {
        let (name, parent) = path.split_last().expect("paths are not empty");
        let value = path.iter().try_fold(tree, |v, k| v.get(k));
        if not_a_mapping.is_none()
            && schema.is_plugin_section(parent, name)
            && !schema_has(&schema.root, path)
            && !matches!(value, Some(Value::Object(_) | Value::Null))
        {
            not_a_mapping = Some(ConfigError::Invalid {
                key: path.join("."),
                origin: origin(path).unwrap_or_else(|| "built-in defaults".to_owned()),
                message: "a plugin section is a mapping of keys, not a single value".into(),
            });
        }
        // A section's origin is its keys' (a layer that only sets `a.b` does not set `a`).
        if (!matches!(value, Some(Value::Object(m)) if !m.is_empty())
            || !schema_has(&schema.root, path))
            && let Some(origin) = origin(path)
        {
            origins.insert(path.join("."), origin);
        }
    });
    match not_a_mapping {
        Some(error) => Err(error),
        None => Ok(sections::Provenance(origins)),
    }
}

/// Applies the `~key` deletions among `ops` (path, value set or None for a deletion, origin) to
/// the merged `tree`, in order: a key of core's schema goes back to its default, anything else (a
/// plugin section, a key inside one or inside a free-form section) is removed. Sets that follow a
/// deletion and touch the same keys are applied again on top of it, as Hydra would.
fn apply_deletions(tree: &mut Value, schema: &Schema, ops: &[Op]) -> Result<(), ConfigError> {
    for (i, (path, value, origin)) in ops.iter().enumerate() {
        if value.is_some() {
            continue;
        }
        let (last, parent) = path.split_last().expect("key paths are not empty");
        let default = path.iter().try_fold(&schema.root, |v, k| v.get(k));
        let Some(Value::Object(siblings)) = parent.iter().try_fold(&mut *tree, |v, k| v.get_mut(k))
        else {
            return Err(not_set(path, origin));
        };
        match default {
            Some(default) => {
                siblings.insert(last.clone(), default.clone());
            }
            None => {
                siblings.remove(last).ok_or_else(|| not_set(path, origin))?;
            }
        }
        let overlaps = |p: &[String]| p.starts_with(path) || path.starts_with(p);
        for (later, value, _) in &ops[i + 1..] {
            if let Some(value) = value.as_ref().filter(|_| overlaps(later)) {
                merge_at(tree, later, value.clone());
            }
        }
    }
    Ok(())
}

fn not_set(path: &[String], origin: &str) -> ConfigError {
    ConfigError::Invalid {
        key: path.join("."),
        origin: origin.to_owned(),
        message: "is not set, so there is nothing to delete".into(),
    }
}

/// Sets `path` in `tree` as a layer merge does: mappings are merged key by key, anything else
/// replaces what was there.
fn merge_at(tree: &mut Value, path: &[String], value: Value) {
    let mut node = tree;
    for segment in path {
        if !node.is_object() {
            *node = Value::Object(Default::default());
        }
        node = &mut node[segment.as_str()];
    }
    merge_value(node, value);
}

fn merge_value(base: &mut Value, overlay: Value) {
    match (base, overlay) {
        (Value::Object(base), Value::Object(overlay)) => {
            for (key, value) in overlay {
                merge_value(base.entry(key).or_insert(Value::Null), value);
            }
        }
        (base, overlay) => *base = overlay,
    }
}

/// Whether `path` is one of core's own keys.
fn schema_has(root: &Value, path: &[String]) -> bool {
    path.iter().try_fold(root, |v, k| v.get(k)).is_some()
}

/// Parses an env/CLI value after checking its key; bare values of string keys stay strings.
fn parse_for(
    schema: &Schema,
    path: &[String],
    text: &str,
    origin: &str,
) -> Result<Value, ConfigError> {
    let as_string = matches!(
        schema.lookup(path, origin)?,
        Lookup::Value(Value::String(_))
    );
    overrides::parse_value(text, as_string).map_err(|message| ConfigError::Syntax {
        origin: origin.to_owned(),
        message,
    })
}

fn from_figment(error: figment::Error) -> ConfigError {
    let key = error.path.join(".");
    let origin = match &error.metadata {
        Some(m) => m.interpolate(&error.profile.clone().unwrap_or_default(), &error.path),
        None => "unknown source".to_owned(),
    };
    ConfigError::Invalid {
        key,
        origin,
        message: error.kind.to_string(),
    }
}

#[cfg(test)]
mod tests;
