//! Which reward component scores a run, from `custom_reward_function` ([`RewardSource`]): the
//! built-in `rule` rewards, the `http` reward plugin posting to a reward server, or the reward
//! component `name` of a plugin library, loaded and vetted like every plugin.

use std::path::Path;

use serde_json::json;
use verl_plugin_api::{ComponentInit, ComponentKind, RunContext};
use verl_plugin_host::vet::AllowList;
use verl_plugin_host::{Component, Origin, Registry};

use verl_config::Config;
use verl_rewards::{RULE_REWARD, RewardError, RewardSource};

/// The reward component a reward server is reached with.
pub const HTTP_REWARD: &str = "http";
/// `custom_reward_function.name`'s default (verl's): any single reward component of a library.
const DEFAULT_NAME: &str = "compute_score";

/// Loads the reward plugin library `custom_reward_function.path` names, if it names one, into
/// `registry` (vetted like every plugin; `allow_list` as for the plugin directories).
pub fn load_library(
    registry: &mut Registry,
    config: &Config,
    allow_list: Option<&AllowList>,
) -> Result<(), RewardError> {
    let RewardSource::Library(path) = RewardSource::of(&config.custom_reward_function)? else {
        return Ok(());
    };
    // A library of the plugin directories is already loaded (a second load would be a
    // duplicate).
    let loaded = registry.plugins().iter().any(|p| {
        p.status.is_ok() && matches!(&p.origin, Origin::Library(o) if same_file(o, &path))
    });
    if loaded {
        return Ok(());
    }
    let record = registry.load_file(&path, allow_list);
    match &record.status {
        Ok(()) => Ok(()),
        Err(e) => Err(RewardError::Config(format!(
            "custom_reward_function.path: {e}"
        ))),
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    a == b
        || matches!(
            (std::fs::canonicalize(a), std::fs::canonicalize(b)),
            (Ok(a), Ok(b)) if a == b
        )
}

fn loaded_from(component: &Component, path: &Path) -> bool {
    matches!(&component.origin, Origin::Library(p) if same_file(p, path))
}

/// The reward component the config selects.
pub fn resolve(registry: &Registry, config: &Config) -> Result<Component, RewardError> {
    let custom = &config.custom_reward_function;
    let lookup = |name: &str, key: &str| {
        registry
            .resolve(ComponentKind::REWARD, name)
            .map_err(|e| RewardError::Config(format!("{key}: {e}")))
    };
    match RewardSource::of(custom)? {
        RewardSource::Rule => lookup(RULE_REWARD, "rewards"),
        RewardSource::Server(_) => lookup(HTTP_REWARD, "custom_reward_function.path (a URL)"),
        RewardSource::Library(path) => {
            let rewards: Vec<Component> = registry
                .plugins()
                .iter()
                .filter(|p| p.status.is_ok())
                .flat_map(|p| &p.components)
                .filter(|c| c.kind == ComponentKind::REWARD && loaded_from(c, &path))
                .cloned()
                .collect();
            let named = rewards.iter().find(|c| c.name == custom.name);
            match (named, rewards.as_slice()) {
                (Some(c), _) => Ok(c.clone()),
                (None, [only]) if custom.name == DEFAULT_NAME => Ok(only.clone()),
                _ => Err(RewardError::Config(format!(
                    "custom_reward_function.name={}: {} has no such reward component (it has: {})",
                    custom.name,
                    path.display(),
                    if rewards.is_empty() {
                        "none".to_owned()
                    } else {
                        rewards
                            .iter()
                            .map(|c| c.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                ))),
            }
        }
    }
}

/// What the reward component is initialised with: the `custom_reward_function` section, and
/// for the rule reward `reward_model.sandbox_fusion` as `sandbox_fusion`.
pub fn init(config: &Config, run: &RunContext) -> ComponentInit {
    let custom = &config.custom_reward_function;
    let mut section = json!({
        "path": custom.path,
        "name": custom.name,
        "reward_kwargs": custom.reward_kwargs,
    });
    if RewardSource::of(custom) == Ok(RewardSource::Rule) {
        section["sandbox_fusion"] = json!(config.reward_model.sandbox_fusion);
    }
    let mut init = ComponentInit::new(section, run.clone());
    init.section_path = "custom_reward_function".into();
    init
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_that_does_not_load_is_named() {
        let mut registry = Registry::with_builtins();
        let mut config = Config::default();
        config.custom_reward_function.path = Some("/nonexistent/libmy_reward.so".into());
        let err = load_library(&mut registry, &config, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("custom_reward_function.path")
                && err.contains("/nonexistent/libmy_reward.so"),
            "{err}"
        );
        // Loaded or not, a library without the named reward component is an error listing
        // what it has.
        let err = resolve(&registry, &config).unwrap_err().to_string();
        assert!(
            err.contains("custom_reward_function.name=compute_score") && err.contains("none"),
            "{err}"
        );
    }

    #[test]
    fn the_rule_reward_is_the_default_component() {
        let registry = Registry::with_builtins();
        let config = Config::default();
        assert_eq!(resolve(&registry, &config).unwrap().name, RULE_REWARD);
        let mut config = Config::default();
        config.custom_reward_function.path = Some("http://localhost:1".into());
        let err = resolve(&registry, &config).unwrap_err().to_string();
        assert!(err.contains("http"), "{err}");
    }
}
