//! # verl-rollout-http
//!
//! What verl-core's inference-server rollouts (`vllm`, `sglang`) share, so each backend plugin is
//! its protocol and nothing else:
//!
//! - [`ServerSettings`]: the server keys of a rollout's own config section (attach to `urls`, or
//!   spawn with `python`/`command`, `extra_args`, `env`, `port`, timeouts, requests in flight).
//! - [`ServerProcess`]: a server this plugin started, in its own process group with a
//!   parent-death signal, its output in a log file; stopped (the whole group) on drop; its death
//!   is noticed before and during every request, and reported with the log's last lines and the
//!   line of it that looks like the error ([`ServerProcess::error_line`]).
//! - [`Pool`]: the replicas, waited for (`/health`, with a progress line), the least busy one
//!   picked per request, a bound on requests in flight, retries with exponential backoff on
//!   connection failures and 503, the server's own message carried into an HTTP error (with a
//!   started server's error line on a 5xx).
//! - [`Pool::generate`] with a backend's [`Protocol`]: one request per prompt, all concurrent,
//!   every answer checked and put in its prompt's slot (no prompt lost or duplicated); a started
//!   server that dies is started again (`max_restarts`), given the rollout's weights back by the
//!   backend's [`Restore`], and sent exactly the requests that had not completed.
//!
//! Everything blocks the caller (the rollout trait is synchronous) on a single-threaded tokio
//! runtime owned by the pool: the work is waiting on sockets.

mod collective;
mod error;
mod generate;
mod log;
#[cfg(any(test, feature = "mock"))]
pub mod mock;
mod pool;
mod process;
mod settings;
mod support;
#[cfg(feature = "testing")]
pub mod testing;

pub use collective::{
    Collective, CollectiveGroup, CollectiveSettings, GroupPlan, NoCollective, TensorList,
    WeightSender, WeightSync, lost_server,
};
pub use error::{HttpError, LogExcerpt, ServerLog};
pub use generate::{Protocol, Sample, prompt_seed};
pub use log::{LOG_TAIL_LINES, log_tail};
pub use pool::{Method, Pool, Restore, Server};
pub use process::{Launch, ServerProcess, free_port};
pub use settings::ServerSettings;
pub use support::{check_weights_dir, excerpt, is_weights_file, link_weights, server_section};

#[cfg(test)]
mod tests;
