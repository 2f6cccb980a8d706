//! Plugin-owned sections: places in verl's config whose contents belong to a plugin (an engine's
//! `fsdp_config` or `megatron`, a rollout's `engine_kwargs.vllm`, a checkpoint backend's
//! `engine_kwargs.<backend>`, a logger's `wandb`). Core names none of them: the caller declares
//! the section names its plugins own ([`PluginSections`]), core accepts exactly those in their
//! slots, passes their contents through unchecked and records where each key came from, and the
//! plugin validates the contents ([`Config::plugin_section`], then
//! `verl_plugin_api::config::parse_section`).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value};

use super::{Config, EngineRole};

/// Which kind of plugin owns a section, and so where it may sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SectionKind {
    /// A key of `actor_rollout_ref.actor`, `actor_rollout_ref.ref` or `critic`.
    Engine,
    /// A key of `actor_rollout_ref.rollout.engine_kwargs`.
    Rollout,
    /// A key of `actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs`.
    Checkpoint,
    /// A top-level key, or a key of `trainer`.
    Tracker,
}

/// The parents of plugin sections, by dotted path ("" is the top level).
const SLOTS: [(&str, SectionKind); 7] = [
    ("actor_rollout_ref.actor", SectionKind::Engine),
    ("actor_rollout_ref.ref", SectionKind::Engine),
    ("critic", SectionKind::Engine),
    (
        "actor_rollout_ref.rollout.engine_kwargs",
        SectionKind::Rollout,
    ),
    (
        "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs",
        SectionKind::Checkpoint,
    ),
    ("", SectionKind::Tracker),
    ("trainer", SectionKind::Tracker),
];

/// The kind of section a key directly under `parent` would be.
pub(super) fn slot_kind(parent: &[String]) -> Option<SectionKind> {
    let parent = parent.join(".");
    SLOTS.iter().find(|(p, _)| *p == parent).map(|(_, k)| *k)
}

/// The section names plugins declared, per kind; built by the caller from the plugin registry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PluginSections {
    names: BTreeMap<SectionKind, BTreeSet<String>>,
}

impl PluginSections {
    /// No plugin sections: every slot key is an unknown key.
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares `name` as a section of `kind`.
    pub fn declare(&mut self, kind: SectionKind, name: impl Into<String>) -> &mut Self {
        self.names.entry(kind).or_default().insert(name.into());
        self
    }

    /// [`declare`](Self::declare), by value.
    pub fn with(mut self, kind: SectionKind, name: impl Into<String>) -> Self {
        self.declare(kind, name);
        self
    }

    /// The declared names of `kind`, sorted.
    pub fn names(&self, kind: SectionKind) -> impl Iterator<Item = &str> {
        self.names
            .get(&kind)
            .into_iter()
            .flatten()
            .map(String::as_str)
    }

    pub fn contains(&self, kind: SectionKind, name: &str) -> bool {
        self.names.get(&kind).is_some_and(|n| n.contains(name))
    }
}

/// Where a plugin section is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// The engine of a role: `actor_rollout_ref.actor.<name>`, `actor_rollout_ref.ref.<name>`
    /// (not inherited from the actor) or `critic.<name>`.
    Engine(EngineRole),
    /// `actor_rollout_ref.rollout.engine_kwargs.<name>`.
    Rollout,
    /// `actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.<name>` (verl passes the
    /// selected backend's entry).
    Checkpoint,
    /// `trainer.<name>` overlaid key by key with the top-level `<name>`.
    Tracker,
}

/// A plugin's section with where its values came from, as the plugin receives it.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginSection {
    /// Full dotted path, e.g. `actor_rollout_ref.actor.fsdp_config`; the plugin prefixes keys
    /// with it in errors.
    pub path: String,
    /// The contents: an object, empty when the config does not set the section.
    pub value: Value,
    /// Full dotted key path (`<path>.a.b`) → origin (`config file …`, `environment variable …`,
    /// `command-line override …`), for every key in `value`.
    pub origins: BTreeMap<String, String>,
}

impl PluginSection {
    /// `origins` as the JSON object `parse_section` takes.
    pub fn origins_json(&self) -> String {
        serde_json::to_string(&self.origins).expect("string maps serialise")
    }
}

/// Origins of the keys inside plugin sections, recorded at load. Not part of the config's value:
/// two configs with the same keys and values are equal wherever they came from.
#[derive(Debug, Clone, Default)]
pub(super) struct Provenance(pub(super) BTreeMap<String, String>);

impl PartialEq for Provenance {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Config {
    /// The section `name` of `slot`, with origins. Sections are only ever those declared at
    /// load; one the config does not set comes back empty.
    pub fn plugin_section(&self, slot: Slot, name: &str) -> PluginSection {
        let arr = &self.actor_rollout_ref;
        let (parent, value) = match slot {
            Slot::Engine(EngineRole::Actor) => {
                ("actor_rollout_ref.actor", arr.actor.sections.get(name))
            }
            Slot::Engine(EngineRole::Ref) => {
                ("actor_rollout_ref.ref", arr.reference.sections.get(name))
            }
            Slot::Engine(EngineRole::Critic) => ("critic", self.critic.sections.get(name)),
            // The teacher takes no plugin sections of its own.
            Slot::Engine(EngineRole::Teacher) => ("distillation.teacher_model", None),
            Slot::Rollout => (
                "actor_rollout_ref.rollout.engine_kwargs",
                arr.rollout.engine_kwargs.get(name),
            ),
            Slot::Checkpoint => (
                "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs",
                arr.rollout.checkpoint_engine.engine_kwargs.get(name),
            ),
            Slot::Tracker => return self.tracker_section(name),
        };
        self.section_at(&format!("{parent}.{name}"), value)
    }

    /// `trainer.<name>` under the top-level `<name>`. When both are set, the section is reported
    /// at the top-level path and keys that only `trainer.<name>` sets say so in their origin.
    fn tracker_section(&self, name: &str) -> PluginSection {
        let nested_path = format!("trainer.{name}");
        match (self.sections.get(name), self.trainer.sections.get(name)) {
            (top, None) => self.section_at(name, top),
            (None, nested) => self.section_at(&nested_path, nested),
            (Some(top), Some(nested)) => {
                let mut merged = self.section_at(&nested_path, Some(nested));
                let mut origins = BTreeMap::new();
                for (key, origin) in merged.origins {
                    let rel = &key[nested_path.len()..];
                    origins.insert(format!("{name}{rel}"), format!("{origin}, as `{key}`"));
                }
                let top = self.section_at(name, Some(top));
                if let (Value::Object(base), Value::Object(overlay)) =
                    (&mut merged.value, top.value)
                {
                    for (key, value) in overlay {
                        let (exact, below) = (format!("{name}.{key}"), format!("{name}.{key}."));
                        origins.retain(|k, _| *k != exact && !k.starts_with(&below));
                        base.insert(key, value);
                    }
                }
                origins.extend(top.origins);
                PluginSection {
                    path: name.to_owned(),
                    value: merged.value,
                    origins,
                }
            }
        }
    }

    fn section_at(&self, path: &str, value: Option<&Value>) -> PluginSection {
        let value = value
            .filter(|v| !v.is_null())
            .cloned()
            .unwrap_or_else(|| Value::Object(Map::new()));
        let prefix = format!("{path}.");
        let origins = self
            .provenance
            .0
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        PluginSection {
            path: path.to_owned(),
            value,
            origins,
        }
    }
}
