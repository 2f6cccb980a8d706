//! What can go wrong between a rollout plugin and its inference servers; every error names the
//! server (its URL, or the process and its log) so the message alone says where to look.

use std::fmt;
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
        "{server} exited ({status}) {when}{}; its log {}:\n{}",
        logged(log.error_line.as_deref()),
        log.path.display(),
        log.tail
    )]
    Died {
        server: String,
        status: String,
        /// "while starting", "during a request", …
        when: &'static str,
        log: Box<LogExcerpt>,
    },
    /// A started server died once more than `max_restarts` allows.
    #[error("{died}\n(not started again: `max_restarts` is {max_restarts})")]
    GaveUp {
        max_restarts: u32,
        died: Box<HttpError>,
    },
    #[error(
        "{server} was not ready within {:.0} s (no answer from {url}){}; its log {}:\n{}",
        waited.as_secs_f64(),
        logged(log.error_line.as_deref()),
        log.path.display(),
        log.tail
    )]
    StartTimeout {
        server: String,
        url: String,
        waited: Duration,
        log: Box<LogExcerpt>,
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
    #[error(
        "{url}: HTTP {status}: {message}{}",
        server_log.as_ref().map(|l| format!("; {l}")).unwrap_or_default()
    )]
    Status {
        url: String,
        status: u16,
        message: String,
        /// Where the cause of a failure on the server's side (5xx) is to be read; `None` for the
        /// client's errors (4xx), which the message explains. Boxed: errors stay small.
        server_log: Option<Box<ServerLog>>,
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

/// What a started server's log shows of its failure (boxed in errors, which stay small).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogExcerpt {
    pub path: PathBuf,
    /// Its last lines, each quoted `  | `.
    pub tail: String,
    /// The line of it that looks like the error ([`crate::ServerProcess::error_line`]).
    pub error_line: Option<String>,
}

/// Where the cause of a failure on a server's side is to be read, beyond its answer: a server
/// says little there (vLLM: "EngineCore encountered an issue. See stack trace (above) for the root
/// cause.").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerLog {
    /// A server this plugin started: its name, its log, and the line of the log that looks like
    /// the error.
    Started {
        server: String,
        log: PathBuf,
        error_line: Option<String>,
    },
    /// A server attached to: its log is wherever it was started.
    Attached,
}

impl fmt::Display for ServerLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Started {
                server,
                log,
                error_line: Some(line),
            } => write!(f, "{server} logged: {line} (log: {})", log.display()),
            Self::Started {
                server,
                log,
                error_line: None,
            } => write!(f, "the cause is in the log of {server}: {}", log.display()),
            Self::Attached => f.write_str(
                "the cause is in the server's own log (it was attached to, not started by the plugin)",
            ),
        }
    }
}

/// `: <the error line>` after what happened to a started server, when its log has one.
pub(crate) fn logged(error_line: Option<&str>) -> String {
    error_line
        .map(|line| format!(": {line}"))
        .unwrap_or_default()
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
