//! Sizes checked before anything is loaded or allocated for them: a model's context window holds
//! the prompt and the response together (verl's vLLM rollout asserts the same), and counts that
//! cross the plugin boundary as 32-bit values must fit in one. The rollout checks its own request
//! against the memory available; these checks come first and name the config keys and flags the
//! user wrote.

use std::fmt::Display;
use std::path::{Path, PathBuf};

use serde_json::Value;

use verl_config::Config;
use verl_data::expand_home;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LimitError {
    #[error(
        "{what} = {total} positions, more than the model's context of {limit} (max_position_embeddings in {})",
        config.display()
    )]
    TooLong {
        what: String,
        total: u128,
        limit: u64,
        config: PathBuf,
    },
    #[error("{key}={value} is more than the largest supported, {}", u32::MAX)]
    TooLarge { key: String, value: u64 },
}

/// How many positions a model attends over, from its `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ContextWindow {
    pub positions: u64,
    pub config: PathBuf,
}

impl ContextWindow {
    /// `max_position_embeddings` of `dir/config.json` (the top level, else a multimodal config's
    /// `llm_config` or `text_config`, where verl looks), times the factor of linear RoPE scaling.
    /// None when the file is missing or unreadable or names no limit: loading the model reports a
    /// broken file, naming it.
    pub fn of_model(dir: &Path) -> Option<Self> {
        let config = dir.join("config.json");
        let json: Value = serde_json::from_str(&std::fs::read_to_string(&config).ok()?).ok()?;
        let section = [&json, &json["llm_config"], &json["text_config"]]
            .into_iter()
            .find(|s| s.get("max_position_embeddings").is_some())?;
        let base = section["max_position_embeddings"].as_u64()?;
        let scaling = [&section["rope_scaling"], &section["rope_parameters"]]
            .into_iter()
            .find(|s| s["rope_type"].as_str().or(s["type"].as_str()) == Some("linear"));
        let factor = scaling
            .and_then(|s| s["factor"].as_f64())
            .filter(|f| *f >= 1.0)
            .unwrap_or(1.0);
        Some(Self {
            positions: (base as f64 * factor) as u64,
            config,
        })
    }

    /// `what` (the lengths that add up to `total`, as the user named them) fits the window.
    pub fn check(&self, what: impl Display, total: u128) -> Result<(), LimitError> {
        if total <= u128::from(self.positions) {
            return Ok(());
        }
        Err(LimitError::TooLong {
            what: what.to_string(),
            total,
            limit: self.positions,
            config: self.config.clone(),
        })
    }
}

/// `value` of `key` fits the 32-bit field it is sent in.
pub fn fits_u32(key: &str, value: u64) -> Result<u32, LimitError> {
    u32::try_from(value).map_err(|_| LimitError::TooLarge {
        key: key.to_owned(),
        value,
    })
}

/// The checks of `verl-core run`, before any data or model is loaded: prompt + response fit the
/// actor's model (`data.*`, which the trainer generates with, and the rollout's own
/// `prompt_length` / `response_length` when set, which an inference server is sized by), and the
/// sampling counts fit the request.
pub fn check_rl(config: &Config) -> Result<(), LimitError> {
    let rollout = &config.actor_rollout_ref.rollout;
    let data = &config.data;
    fits_u32("actor_rollout_ref.rollout.n", rollout.n as u64)?;
    fits_u32(
        "actor_rollout_ref.rollout.val_kwargs.n",
        rollout.val_kwargs.n as u64,
    )?;
    fits_u32("data.max_response_length", data.max_response_length as u64)?;
    let prompt = ("data.max_prompt_length", data.max_prompt_length as u64);
    let response = ("data.max_response_length", data.max_response_length as u64);
    let model = expand_home(&config.actor_rollout_ref.model.path);
    check_lengths(&model, &[prompt, response])?;
    if rollout.prompt_length.is_some() || rollout.response_length.is_some() {
        let own = |key, value: Option<usize>, default| value.map_or(default, |v| (key, v as u64));
        check_lengths(
            &model,
            &[
                own(
                    "actor_rollout_ref.rollout.prompt_length",
                    rollout.prompt_length,
                    prompt,
                ),
                own(
                    "actor_rollout_ref.rollout.response_length",
                    rollout.response_length,
                    response,
                ),
            ],
        )?;
    }
    Ok(())
}

/// The check of `verl-core sft`: `data.max_prompt_length` + `data.max_response_length` fit the
/// model trained (`base`).
pub fn check_sft(config: &Config, base: &Path) -> Result<(), LimitError> {
    let data = &config.data;
    check_lengths(
        base,
        &[
            ("data.max_prompt_length", data.max_prompt_length as u64),
            ("data.max_response_length", data.max_response_length as u64),
        ],
    )
}

fn check_lengths(model: &Path, lengths: &[(&str, u64)]) -> Result<(), LimitError> {
    let Some(window) = ContextWindow::of_model(model) else {
        return Ok(());
    };
    let what = lengths
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect::<Vec<_>>()
        .join(" + ");
    window.check(what, lengths.iter().map(|(_, v)| u128::from(*v)).sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn model(config: Value) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        dir
    }

    #[test]
    fn the_window_comes_from_config_json() {
        let plain = model(json!({"max_position_embeddings": 128}));
        let window = ContextWindow::of_model(plain.path()).unwrap();
        assert_eq!(window.positions, 128);
        assert_eq!(window.config, plain.path().join("config.json"));
        let linear = model(json!({"max_position_embeddings": 100,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0}}));
        assert_eq!(
            ContextWindow::of_model(linear.path()).unwrap().positions,
            400
        );
        // Llama 3's scaling is already counted in max_position_embeddings.
        let llama3 = model(json!({"max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}));
        assert_eq!(
            ContextWindow::of_model(llama3.path()).unwrap().positions,
            131072
        );
        let nested = model(json!({"text_config": {"max_position_embeddings": 64}}));
        assert_eq!(
            ContextWindow::of_model(nested.path()).unwrap().positions,
            64
        );
        for broken in [json!({}), json!({"max_position_embeddings": "many"})] {
            assert_eq!(ContextWindow::of_model(model(broken).path()), None);
        }
        assert_eq!(ContextWindow::of_model(Path::new("/nonexistent")), None);
    }

    #[test]
    fn rl_lengths_must_fit_the_model_and_name_their_keys() {
        let dir = model(json!({"max_position_embeddings": 128}));
        let mut config = Config::default();
        config.actor_rollout_ref.model.path = dir.path().display().to_string();
        config.data.max_prompt_length = 64;
        config.data.max_response_length = 64;
        assert_eq!(check_rl(&config), Ok(()));
        config.data.max_response_length = 1_000_000_000;
        let error = check_rl(&config).unwrap_err().to_string();
        assert!(
            error.starts_with(
                "data.max_prompt_length=64 + data.max_response_length=1000000000 = 1000000064 positions, more than the model's context of 128"
            ),
            "{error}"
        );
        assert!(error.contains("config.json"), "{error}");
        config.data.max_response_length = 64;
        config.actor_rollout_ref.rollout.prompt_length = Some(100);
        let error = check_rl(&config).unwrap_err().to_string();
        assert!(
            error.starts_with(
                "actor_rollout_ref.rollout.prompt_length=100 + data.max_response_length=64 = 164"
            ),
            "{error}"
        );
        assert!(check_sft(&config, dir.path()).is_ok(), "sft reads data.*");
        config.data.max_prompt_length = 100;
        assert!(check_sft(&config, dir.path()).is_err());
    }

    #[test]
    fn counts_must_fit_the_request() {
        let mut config = Config::default();
        config.actor_rollout_ref.model.path = "/nonexistent".into();
        config.actor_rollout_ref.rollout.n = 5_000_000_000;
        assert_eq!(
            check_rl(&config).unwrap_err().to_string(),
            "actor_rollout_ref.rollout.n=5000000000 is more than the largest supported, 4294967295"
        );
        config.actor_rollout_ref.rollout.n = 4;
        config.data.max_response_length = 1 << 33;
        assert!(matches!(
            check_rl(&config),
            Err(LimitError::TooLarge { key, .. }) if key == "data.max_response_length"
        ));
    }
}
