//! The JSON-over-HTTP client the server backends (MLflow, Trackio) share.

use std::time::Duration;

use serde_json::Value;
use ureq::http::Response;
use ureq::{Agent, Body, RequestBuilder};

use crate::TrackerError;

#[derive(Debug)]
pub struct Http {
    agent: Agent,
    base: String,
    headers: Vec<(&'static str, String)>,
}

impl Http {
    /// `base` without a trailing slash; `headers` go on every request (auth tokens).
    pub fn new(base: &str, timeout: Duration, headers: Vec<(&'static str, String)>) -> Self {
        // Statuses are errors we classify ourselves (transient or not), not ureq errors.
        let agent = Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build()
            .into();
        Self {
            agent,
            base: base.trim_end_matches('/').to_owned(),
            headers,
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    pub fn post(&self, path: &str, body: &Value) -> Result<Value, TrackerError> {
        let url = format!("{}{path}", self.base);
        answer(&url, self.headed(self.agent.post(&url)).send_json(body))
    }

    pub fn get(&self, path: &str, query: &[(&str, &str)]) -> Result<Value, TrackerError> {
        let url = format!("{}{path}", self.base);
        answer(
            &url,
            self.headed(self.agent.get(&url).query_pairs(query.iter().copied()))
                .call(),
        )
    }

    pub fn put(&self, path: &str, body: &[u8]) -> Result<Value, TrackerError> {
        let url = format!("{}{path}", self.base);
        answer(&url, self.headed(self.agent.put(&url)).send(body))
    }

    fn headed<T>(&self, mut request: RequestBuilder<T>) -> RequestBuilder<T> {
        for (name, value) in &self.headers {
            request = request.header(*name, value);
        }
        request
    }
}

/// A 2xx answer's JSON (null when empty); anything else as a [`TrackerError`].
fn answer(url: &str, result: Result<Response<Body>, ureq::Error>) -> Result<Value, TrackerError> {
    let mut response = result.map_err(|e| TrackerError::Unreachable {
        url: url.to_owned(),
        reason: e.to_string(),
    })?;
    let status = response.status().as_u16();
    let text = response
        .body_mut()
        .read_to_string()
        .map_err(|e| TrackerError::Unreachable {
            url: url.to_owned(),
            reason: format!("reading the answer: {e}"),
        })?;
    if !(200..300).contains(&status) {
        let body: String = text.chars().take(500).collect();
        return Err(TrackerError::Http {
            url: url.to_owned(),
            status,
            body,
        });
    }
    if text.trim().is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_str(&text).map_err(|e| TrackerError::Protocol {
        url: url.to_owned(),
        detail: format!("not JSON ({e}): {text:.200}"),
    })
}
