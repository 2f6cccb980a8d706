//! What can go wrong between a rollout plugin and its inference servers; every error names the
//! server (its URL, or the process and its log) so the message alone says where to look.

use std::path::PathBuf;
use std::time::Duration;

use verl_plugin_api::{ErrorKind, PluginError};

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("starting {server}: cannot run `{program}`: {source}")]
    Spawn {
        server: String,
        program: String,
        source: std::io::Error,
    },
    #[error("{server} ({what}): {source}")]
    Io {
        server: String,
        what: String,
        source: std::io::Error,
    },
    #[error(
        "{server} exited ({status}) {when}; its log {}:\n{tail}",
        log.display()
    )]
    Died {
        server: String,
        status: String,
        /// "while starting", "during a request", …
        when: &'static str,
        log: PathBuf,
        tail: String,
    },
    /// A started server died once more than `max_restarts` allows.
    #[error("{died}\n(not started again: `max_restarts` is {max_restarts})")]
    GaveUp {
        max_restarts: u32,
        died: Box<HttpError>,
    },
    #[error(
        "{server} was not ready within {:.0} s (no answer from {url}); its log {}:\n{tail}",
        waited.as_secs_f64(),
        log.display()
    )]
    StartTimeout {
        server: String,
        url: String,
        waited: Duration,
        log: PathBuf,
        tail: String,
    },
    #[error("{url}: unreachable after {attempts} attempt(s): {message}")]
    Unreachable {
        url: String,
        attempts: u32,
        message: String,
    },
    #[error("{url}: no answer within {:.0} s", after.as_secs_f64())]
    Timeout { url: String, after: Duration },
    /// The server answered with an error status; `message` is the server's own explanation.
    #[error("{url}: HTTP {status}: {message}")]
    Status {
        url: String,
        status: u16,
        message: String,
    },
    /// A server holds other weights than those the rollout last loaded.
    #[error(
        "{server} holds weights of version `{reported}`, not `{expected}`: refusing to generate \
         with stale weights"
    )]
    Stale {
        server: String,
        reported: String,
        expected: String,
    },
    /// The server's answer is not what the protocol says it sends.
    #[error("{url}: unexpected answer: {message}")]
    Protocol { url: String, message: String },
    #[error("{0}")]
    Config(String),
}

impl HttpError {
    pub fn protocol(url: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Protocol {
            url: url.into(),
            message: message.into(),
        }
    }

    fn kind(&self) -> ErrorKind {
        match self {
            Self::Spawn { .. } | Self::Io { .. } => ErrorKind::IO,
            Self::Died { .. }
            | Self::GaveUp { .. }
            | Self::Unreachable { .. }
            | Self::Stale { .. } => ErrorKind::UNAVAILABLE,
            Self::StartTimeout { .. } | Self::Timeout { .. } => ErrorKind::TIMEOUT,
            Self::Config(_) => ErrorKind::INVALID_CONFIG,
            Self::Status { .. } | Self::Protocol { .. } => ErrorKind::OTHER,
        }
    }
}

impl From<HttpError> for PluginError {
    fn from(e: HttpError) -> Self {
        PluginError::new(e.kind(), e.to_string())
    }
}
