//! An engine's errors; each becomes a [`PluginError`] at the ABI boundary.

use verl_plugin_api::{ErrorKind, PluginError};

use verl_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum ActorError {
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

impl From<tch::TchError> for ActorError {
    fn from(e: tch::TchError) -> Self {
        Self::Model(e.into())
    }
}

impl From<ActorError> for PluginError {
    fn from(e: ActorError) -> Self {
        match e {
            ActorError::Model(e) => e.into(),
            ActorError::Plugin(e) => e,
            ActorError::Config { .. } => PluginError::invalid_config(e.to_string()),
            ActorError::Unsupported(_) => PluginError::new(ErrorKind::UNSUPPORTED, e.to_string()),
            ActorError::NotInitialised | ActorError::Batch(_) => PluginError::other(e.to_string()),
            ActorError::Checkpoint { .. } => PluginError::new(ErrorKind::IO, e.to_string()),
        }
    }
}
