//! SandboxFusion's `/run_code` (bytedance/SandboxFusion: `RunCodeRequest`/`RunCodeResponse` in
//! `sandbox/server/sandbox_api.py`, `CommandRunResult` in `sandbox/runners/types.py`), called as
//! verl's `call_sandbox_api` does: up to 3 attempts, retrying only HTTP 504 (after 1 s, then 2 s);
//! any other failure ends the attempts. Fields the server adds beyond the schema are ignored.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use ureq::Agent;

/// verl's `MAX_RETRIES`: attempts per request.
const ATTEMPTS: u32 = 3;
/// verl's `INITIAL_RETRY_DELAY`: the wait after the n-th 504 is n times this.
const RETRY_DELAY: Duration = Duration::from_secs(1);
/// verl's `API_TIMEOUT`: the HTTP time limit is the compile and run limits plus this.
const API_TIMEOUT_S: f64 = 10.0;

/// `RunCodeRequest`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunCodeRequest {
    pub compile_timeout: f64,
    pub run_timeout: f64,
    /// Megabytes; -1: no limit.
    #[serde(rename = "memory_limit_MB")]
    pub memory_limit_mb: i64,
    pub code: String,
    pub stdin: Option<String>,
    pub language: String,
    /// Path → base64 content.
    pub files: BTreeMap<String, Option<String>>,
    pub fetch_files: Vec<String>,
}

/// `RunStatus`: the outcome of the whole request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunStatus {
    Success,
    Failed,
    SandboxError,
}

/// `CommandRunStatus`: the outcome of the compile or run command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CommandRunStatus {
    Finished,
    Error,
    TimeLimitExceeded,
}

/// `CommandRunResult`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommandRunResult {
    pub status: CommandRunStatus,
    pub execution_time: Option<f64>,
    pub return_code: Option<i64>,
    pub stdout: Option<String>,
    pub stderr: Option<String>,
}

/// `RunCodeResponse`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunCodeResponse {
    pub status: RunStatus,
    pub message: String,
    pub compile_result: Option<CommandRunResult>,
    pub run_result: Option<CommandRunResult>,
    pub executor_pod_name: Option<String>,
    #[serde(default)]
    pub files: BTreeMap<String, String>,
}

/// A SandboxFusion endpoint.
#[derive(Debug, Clone)]
pub struct Client {
    agent: Agent,
    url: String,
}

impl Client {
    /// `url` is the `/run_code` endpoint itself (verl posts to it as given).
    pub fn new(url: &str) -> Self {
        // Statuses are classified here (504 is retried), not turned into transport errors.
        let agent = Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        Self {
            agent,
            url: url.to_owned(),
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Runs `request`; the error is verl's `API Call Failed: …` message (the case is then an
    /// API error, -1).
    pub fn run(&self, request: &RunCodeRequest) -> Result<RunCodeResponse, String> {
        let limit = Duration::from_secs_f64(
            (request.compile_timeout + request.run_timeout + API_TIMEOUT_S).max(0.0),
        );
        let mut last_error = String::new();
        for attempt in 1..=ATTEMPTS {
            let sent = self
                .agent
                .post(&self.url)
                .config()
                .timeout_global(Some(limit))
                .build()
                .header("Accept", "application/json")
                .send_json(request);
            let mut response = match sent {
                Ok(response) => response,
                Err(e) => return Err(format!("API Call Failed: {}: {e}", self.url)),
            };
            let status = response.status().as_u16();
            if status == 504 {
                last_error = format!("Gateway Timeout (504) on attempt {attempt}/{ATTEMPTS}");
                if attempt < ATTEMPTS {
                    std::thread::sleep(RETRY_DELAY * attempt);
                }
                continue;
            }
            let body = response
                .body_mut()
                .read_to_string()
                .map_err(|e| format!("API Call Failed: reading the answer: {e}"))?;
            if !(200..300).contains(&status) {
                return Err(format!(
                    "API Call Failed: {}: HTTP {status}: {}",
                    self.url,
                    body.chars().take(300).collect::<String>()
                ));
            }
            return serde_json::from_str(&body).map_err(|e| {
                format!(
                    "API Call Failed: the answer is not SandboxFusion's RunCodeResponse ({e}): {}",
                    body.chars().take(300).collect::<String>()
                )
            });
        }
        Err(format!("API Call Failed: {}: {last_error}", self.url))
    }
}
