//! Why a delivery failed, and whether trying again can help.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum TrackerError {
    /// No answer at all (refused, reset, timed out): the server may come back.
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{url} answered HTTP {status}: {body}")]
    Http {
        url: String,
        status: u16,
        body: String,
    },
    /// The server answered, but not what its API documents.
    #[error("unexpected answer from {url}: {detail}")]
    Protocol { url: String, detail: String },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("the backend panicked; it is not used again")]
    Panicked,
    #[error("this tool has no tables")]
    NoTables,
    /// Delivery stopped: `finish` ran out of time, or earlier attempts failed and the backend is
    /// resting before the next try.
    #[error("not sent: {0}")]
    Skipped(String),
}

impl TrackerError {
    /// Worth retrying: the network, a server error, or a server asking us to slow down. A 4xx means
    /// the request itself is wrong and would fail again.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Unreachable { .. } => true,
            Self::Http { status, .. } => *status >= 500 || *status == 429 || *status == 408,
            _ => false,
        }
    }
}
