//! Where a run's rewards come from, by `custom_reward_function.path`: none set, the built-in
//! `rule` rewards; a URL, a reward server; a library file, a reward plugin. A Python file cannot
//! run here: the error says how to serve it.

use std::path::PathBuf;

use verl_data::expand_home;
use verl_schema::CustomRewardFunctionConfig;

use crate::RewardError;

/// Where the rewards come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RewardSource {
    Rule,
    Server(String),
    Library(PathBuf),
}

impl RewardSource {
    pub fn of(config: &CustomRewardFunctionConfig) -> Result<Self, RewardError> {
        let Some(path) = config.path.as_deref().filter(|p| !p.is_empty()) else {
            return Ok(Self::Rule);
        };
        if path.starts_with("http://") || path.starts_with("https://") {
            return Ok(Self::Server(path.to_owned()));
        }
        if path.ends_with(".py") {
            return Err(RewardError::Config(format!(
                "custom_reward_function.path={path}: a Python reward function does not run inside verl-core; \
                 serve it with `python3 plugins/reward-http/reward_server.py {path} --name {name} --port 8000` \
                 and set custom_reward_function.path=http://127.0.0.1:8000 (the `http` reward plugin posts each \
                 batch to it), or build a Rust reward plugin and give its library here",
                name = config.name
            )));
        }
        Ok(Self::Library(expand_home(path)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn custom(path: Option<&str>) -> CustomRewardFunctionConfig {
        CustomRewardFunctionConfig {
            path: path.map(str::to_owned),
            ..CustomRewardFunctionConfig::default()
        }
    }

    #[test]
    fn the_path_selects_the_source() {
        assert_eq!(RewardSource::of(&custom(None)), Ok(RewardSource::Rule));
        assert_eq!(
            RewardSource::of(&custom(Some("http://127.0.0.1:8000/score"))),
            Ok(RewardSource::Server("http://127.0.0.1:8000/score".into()))
        );
        assert_eq!(
            RewardSource::of(&custom(Some("/p/libmy_reward.so"))),
            Ok(RewardSource::Library("/p/libmy_reward.so".into()))
        );
        let err = RewardSource::of(&custom(Some("/x/reward.py")))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("/x/reward.py")
                && err.contains("reward_server.py")
                && err.contains("custom_reward_function.path=http://"),
            "{err}"
        );
    }
}
