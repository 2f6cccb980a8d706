//! The server settings every HTTP rollout shares, read from the plugin's own section
//! (`actor_rollout_ref.rollout.engine_kwargs.<name>`) next to the backend's own keys
//! (`verl_plugin_api::config::parse_section2`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::HttpError;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerSettings {
    /// Attach: base URLs of running servers (replicas, load-balanced). Empty: spawn one.
    pub urls: Vec<String>,
    /// Spawn: the Python that runs the server module (default: the set-up script's venv).
    pub python: Option<PathBuf>,
    /// Spawn: the command that starts a server, instead of `<python> -m <module>`; the model,
    /// host, port and backend flags are appended.
    pub command: Vec<String>,
    /// Spawn: more command-line flags, appended last (they win over ours).
    pub extra_args: Vec<String>,
    /// Spawn: environment variables for the server, over the defaults.
    pub env: BTreeMap<String, String>,
    /// Spawn: the address the server listens on.
    pub host: String,
    /// Spawn: its port; default a free one.
    pub port: Option<u16>,
    /// Spawn: seconds to wait for `/health` before giving up.
    pub startup_timeout_s: f64,
    /// Spawn: directory of the server log; default `<run_dir>/<backend>`, else a temporary one.
    pub log_dir: Option<PathBuf>,
    /// Seconds one request may take (a generation of one prompt, a weight reload).
    pub request_timeout_s: f64,
    /// Requests in flight over all servers at once.
    pub max_inflight: usize,
    /// Attempts of a request whose connection failed, with exponential backoff between them.
    pub retries: u32,
    /// Spawn: times a started server that died is started again (over the rollout's life), its
    /// weights restored and its unfinished requests sent again; 0: its death is an error.
    pub max_restarts: u32,
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            python: None,
            command: Vec::new(),
            extra_args: Vec::new(),
            env: BTreeMap::new(),
            host: "127.0.0.1".into(),
            port: None,
            startup_timeout_s: 600.0,
            log_dir: None,
            request_timeout_s: 600.0,
            max_inflight: 64,
            retries: 5,
            max_restarts: 1,
        }
    }
}

impl ServerSettings {
    /// Checks values serde cannot; `section` is the section's dotted path, for messages.
    pub fn validate(&self, section: &str) -> Result<(), String> {
        for (key, value) in [
            ("startup_timeout_s", self.startup_timeout_s),
            ("request_timeout_s", self.request_timeout_s),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!(
                    "config key `{section}.{key}`: must be a positive number of seconds, not {value}"
                ));
            }
        }
        if self.max_inflight == 0 {
            return Err(format!(
                "config key `{section}.max_inflight`: must be at least 1"
            ));
        }
        if self.retries == 0 {
            return Err(format!(
                "config key `{section}.retries`: must be at least 1 (the first attempt counts)"
            ));
        }
        for (i, url) in self.urls.iter().enumerate() {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!(
                    "config key `{section}.urls[{i}]`: `{url}` is not an http:// or https:// URL"
                ));
            }
        }
        Ok(())
    }

    /// Spawn: the port a started server listens on (`port`, else one free now) and its URL.
    pub fn address(&self) -> Result<(u16, String), HttpError> {
        let port = match self.port {
            Some(port) => port,
            None => crate::free_port(&self.host).map_err(|source| HttpError::Io {
                server: format!("a server on {}", self.host),
                what: "finding a free port".into(),
                source,
            })?,
        };
        Ok((port, format!("http://{}:{port}", self.host)))
    }

    pub fn startup_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.startup_timeout_s)
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.request_timeout_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_name_their_key() {
        let path = "actor_rollout_ref.rollout.engine_kwargs.vllm";
        let mut s = ServerSettings::default();
        assert_eq!(s.validate(path), Ok(()));
        s.request_timeout_s = 0.0;
        assert!(
            s.validate(path)
                .unwrap_err()
                .contains("vllm.request_timeout_s")
        );
        s = ServerSettings::default();
        s.urls = vec!["http://a:1".into(), "localhost:8000".into()];
        let err = s.validate(path).unwrap_err();
        assert!(
            err.contains("vllm.urls[1]") && err.contains("localhost:8000"),
            "{err}"
        );
        s = ServerSettings::default();
        s.max_inflight = 0;
        assert!(s.validate(path).unwrap_err().contains("max_inflight"));
    }

    #[test]
    fn unknown_keys_are_rejected_with_a_suggestion() {
        let err = verl_plugin_api::config::parse_section::<ServerSettings>(
            "actor_rollout_ref.rollout.engine_kwargs.vllm",
            r#"{"url": ["http://x:1"]}"#,
            r#"{"actor_rollout_ref.rollout.engine_kwargs.vllm.url": "config file run.yaml"}"#,
        )
        .unwrap_err();
        let text = err.message();
        assert!(
            text.contains("engine_kwargs.vllm.url`")
                && text.contains("run.yaml")
                && text
                    .contains("did you mean `actor_rollout_ref.rollout.engine_kwargs.vllm.urls`"),
            "{text}"
        );
    }
}
