//! The engine's errors; each becomes a [`PluginError`] at the ABI boundary.

use verl_model::ModelError;
use verl_plugin_api::{ErrorKind, PluginError};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("config key `{key}`: {reason}")]
    Config { key: String, reason: String },

    /// Set-up or input the engine cannot (yet) handle.
    #[error("{0}")]
    Unsupported(String),

    #[error("the engine is not initialised: call `init` first")]
    NotInitialised,

    /// A malformed batch (missing tensor, wrong shape or dtype).
    #[error("batch: {0}")]
    Batch(String),

    #[error("{path}: {reason}")]
    Checkpoint { path: String, reason: String },

    #[error(transparent)]
    Model(#[from] ModelError),

    #[error(transparent)]
    Plugin(#[from] PluginError),
}

impl From<tch::TchError> for EngineError {
    fn from(e: tch::TchError) -> Self {
        Self::Model(e.into())
    }
}

impl From<EngineError> for PluginError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Model(e) => e.into(),
            EngineError::Plugin(e) => e,
            EngineError::Config { .. } => PluginError::invalid_config(e.to_string()),
            EngineError::Unsupported(_) => PluginError::new(ErrorKind::UNSUPPORTED, e.to_string()),
            EngineError::NotInitialised | EngineError::Batch(_) => {
                PluginError::other(e.to_string())
            }
            EngineError::Checkpoint { .. } => PluginError::new(ErrorKind::IO, e.to_string()),
        }
    }
}
