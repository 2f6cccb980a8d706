//! The servers a rollout talks to (replicas of one model, started here or attached to), and the
//! request path every call takes: a bound on requests in flight, the least busy server, retries
//! with backoff when a connection fails, a started server's death noticed, the server's own
//! message carried into errors.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::Semaphore;

use crate::process::{Launch, ServerProcess};
use crate::{HttpError, ServerSettings};

/// One server: its base URL and, when this plugin started it, its process.
#[derive(Debug)]
pub struct Server {
    url: String,
    process: Option<ServerProcess>,
    inflight: AtomicUsize,
}

impl Server {
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn process(&self) -> Option<&ServerProcess> {
        self.process.as_ref()
    }
}

/// First delay between attempts of a failed connection; doubled each time, at most
/// [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How often the wait for a starting server polls `/health`, and says it is still waiting.
const HEALTH_POLL: Duration = Duration::from_millis(500);
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub struct Pool {
    /// "vLLM", "SGLang": for messages.
    backend: String,
    servers: Vec<Server>,
    client: reqwest::Client,
    runtime: tokio::runtime::Runtime,
    limit: Semaphore,
    retries: u32,
    request_timeout: Duration,
    /// Rotates the tie-break among equally busy servers.
    turn: AtomicUsize,
}

/// How a request reads its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Post,
}

impl Pool {
    fn new(
        backend: &str,
        settings: &ServerSettings,
        servers: Vec<Server>,
    ) -> Result<Self, HttpError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| HttpError::Io {
                server: backend.to_owned(),
                what: "starting the HTTP client's runtime".into(),
                source,
            })?;
        // The client's connection pool registers with the runtime it is built in.
        let client = {
            let _context = runtime.enter();
            reqwest::Client::builder()
                .build()
                .map_err(|e| HttpError::Config(format!("the HTTP client: {}", chain(&e))))?
        };
        Ok(Self {
            backend: backend.to_owned(),
            servers,
            client,
            runtime,
            limit: Semaphore::new(settings.max_inflight),
            retries: settings.retries,
            request_timeout: settings.request_timeout(),
            turn: AtomicUsize::new(0),
        })
    }

    /// Servers already running at `settings.urls`; waits (up to the startup timeout) until each
    /// answers `/health`.
    pub fn attach(backend: &str, settings: &ServerSettings) -> Result<Self, HttpError> {
        let servers = settings
            .urls
            .iter()
            .map(|url| Server {
                url: url.trim_end_matches('/').to_owned(),
                process: None,
                inflight: AtomicUsize::new(0),
            })
            .collect();
        let pool = Self::new(backend, settings, servers)?;
        for server in &pool.servers {
            pool.wait_ready(server, settings.startup_timeout())?;
        }
        Ok(pool)
    }

    /// Starts a server with `launch`, listening at `url`, and waits until it answers `/health`
    /// (printing a progress line on stderr every few seconds). The server is stopped when the pool
    /// is dropped.
    pub fn spawn(
        backend: &str,
        settings: &ServerSettings,
        launch: &Launch,
        url: &str,
    ) -> Result<Self, HttpError> {
        let process = ServerProcess::spawn(launch)?;
        eprintln!(
            "{}: started; waiting for {url}/health (log: {})",
            process.name(),
            launch.log.display()
        );
        let server = Server {
            url: url.trim_end_matches('/').to_owned(),
            process: Some(process),
            inflight: AtomicUsize::new(0),
        };
        let pool = Self::new(backend, settings, vec![server])?;
        pool.wait_ready(&pool.servers[0], settings.startup_timeout())?;
        Ok(pool)
    }

    pub fn servers(&self) -> &[Server] {
        &self.servers
    }

    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// Runs `future` on the pool's runtime, blocking the caller.
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }

    fn wait_ready(&self, server: &Server, timeout: Duration) -> Result<(), HttpError> {
        let start = Instant::now();
        let url = format!("{}/health", server.url);
        let name = server.process.as_ref().map_or_else(
            || format!("{} server {}", self.backend, server.url),
            |p| p.name().to_owned(),
        );
        let mut last_progress = start;
        loop {
            if let Some(died) = server
                .process
                .as_ref()
                .and_then(|p| p.died("while starting"))
            {
                return Err(died);
            }
            // `send` arms its timer at once: it must run inside the runtime.
            let probe = async { self.client.get(&url).timeout(HEALTH_POLL * 4).send().await };
            let last_answer = match self.block_on(probe) {
                Ok(response) if response.status().is_success() => {
                    if server.process.is_some() {
                        eprintln!("{name}: ready in {:.1} s", start.elapsed().as_secs_f64());
                    }
                    return Ok(());
                }
                Ok(response) => format!("HTTP {}", response.status()),
                Err(e) => chain(&e),
            };
            if start.elapsed() >= timeout {
                return Err(match &server.process {
                    Some(p) => HttpError::StartTimeout {
                        server: name,
                        url,
                        waited: timeout,
                        log: p.log().to_path_buf(),
                        tail: p.log_tail(),
                    },
                    None => HttpError::Unreachable {
                        url,
                        attempts: 1,
                        message: format!(
                            "not ready within {:.0} s: {last_answer}",
                            timeout.as_secs_f64()
                        ),
                    },
                });
            }
            if last_progress.elapsed() >= PROGRESS_EVERY {
                last_progress = Instant::now();
                eprintln!(
                    "{name}: waiting for {url} ({:.0} s of {:.0} s)",
                    start.elapsed().as_secs_f64(),
                    timeout.as_secs_f64()
                );
            }
            std::thread::sleep(HEALTH_POLL);
        }
    }

    /// Stops the servers this pool started (also done on drop).
    pub fn stop(&self) {
        for process in self.servers.iter().filter_map(|s| s.process.as_ref()) {
            process.stop();
        }
    }

    /// An error if a server this pool started has exited.
    pub fn check_alive(&self) -> Result<(), HttpError> {
        match self.servers.iter().find_map(|s| {
            s.process
                .as_ref()
                .and_then(|p| p.died("since the last request"))
        }) {
            Some(died) => Err(died),
            None => Ok(()),
        }
    }

    /// The least busy server (ties rotate).
    fn pick(&self) -> usize {
        let n = self.servers.len();
        let start = self.turn.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|k| (start + k) % n)
            .min_by_key(|&i| self.servers[i].inflight.load(Ordering::Relaxed))
            .expect("a pool has at least one server")
    }

    /// POSTs `body` to `path` on the least busy server, within the bound on requests in flight.
    /// Returns the server's index and its JSON answer.
    pub async fn post_any(&self, path: &str, body: &Value) -> Result<(usize, Value), HttpError> {
        let _permit = self
            .limit
            .acquire()
            .await
            .expect("the pool's semaphore is never closed");
        let i = self.pick();
        let server = &self.servers[i];
        server.inflight.fetch_add(1, Ordering::Relaxed);
        let answer = self.request(i, Method::Post, path, Some(body)).await;
        server.inflight.fetch_sub(1, Ordering::Relaxed);
        Ok((i, answer?))
    }

    /// One request to server `i`, retried with backoff while the connection fails. The answer is
    /// the body as JSON (`null` when empty, a string when not JSON).
    pub async fn request(
        &self,
        i: usize,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, HttpError> {
        let server = &self.servers[i];
        let url = format!("{}{path}", server.url);
        let mut backoff = FIRST_BACKOFF;
        let mut last = String::new();
        for attempt in 1..=self.retries {
            if let Some(died) = server
                .process
                .as_ref()
                .and_then(|p| p.died("during a request"))
            {
                return Err(died);
            }
            let mut builder = match method {
                Method::Get => self.client.get(&url),
                Method::Post => self.client.post(&url),
            }
            .timeout(self.request_timeout);
            if let Some(body) = body {
                builder = builder.json(body);
            }
            match builder.send().await {
                Ok(response) => {
                    let status = response.status();
                    let text = match response.text().await {
                        Ok(text) => text,
                        Err(e) => {
                            last = format!("reading the answer: {}", chain(&e));
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(MAX_BACKOFF);
                            continue;
                        }
                    };
                    // 503: not ready or overloaded, worth another try; any other error status is
                    // the server's verdict on this request.
                    if status.as_u16() == 503 && attempt < self.retries {
                        last = format!("HTTP 503: {}", error_message(&text));
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        continue;
                    }
                    if !status.is_success() {
                        return Err(HttpError::Status {
                            url,
                            status: status.as_u16(),
                            message: error_message(&text),
                        });
                    }
                    return Ok(parse_body(text));
                }
                Err(e) if e.is_timeout() => {
                    return Err(
                        match server
                            .process
                            .as_ref()
                            .and_then(|p| p.died("during a request"))
                        {
                            Some(died) => died,
                            None => HttpError::Timeout {
                                url,
                                after: self.request_timeout,
                            },
                        },
                    );
                }
                // Refused, reset, closed mid-answer: the server may be restarting or overloaded.
                // A retried generation cannot duplicate samples: each answer fills its request's
                // one slot.
                Err(e) => {
                    last = chain(&e);
                    if attempt < self.retries {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                }
            }
        }
        if let Some(died) = server
            .process
            .as_ref()
            .and_then(|p| p.died("during a request"))
        {
            return Err(died);
        }
        Err(HttpError::Unreachable {
            url,
            attempts: self.retries,
            message: last,
        })
    }

    /// The same request to every server in turn (weight reloads, cache resets), stopping at the
    /// first failure; the answers in server order.
    pub fn broadcast(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Vec<Value>, HttpError> {
        self.block_on(async {
            let mut answers = Vec::with_capacity(self.servers.len());
            for i in 0..self.servers.len() {
                answers.push(self.request(i, method, path, body).await?);
            }
            Ok(answers)
        })
    }
}

/// An error and its sources, joined: reqwest's own message says little ("error sending request").
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

fn parse_body(text: String) -> Value {
    if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    }
}

/// Longest server message quoted in an error.
const MAX_MESSAGE: usize = 2000;

/// The server's explanation in an error body: OpenAI's `{"error": {"message"}}`, a plain
/// `{"message"}`, FastAPI's `{"detail": …}`, else the text itself.
pub(crate) fn error_message(text: &str) -> String {
    let message = match serde_json::from_str::<Value>(text) {
        Ok(v) => {
            let pick = v["error"]["message"]
                .as_str()
                .or_else(|| v["error"].as_str())
                .or_else(|| v["message"].as_str())
                .map(str::to_owned)
                .or_else(|| match &v["detail"] {
                    Value::Null => None,
                    Value::String(s) => Some(s.clone()),
                    detail => Some(detail.to_string()),
                });
            pick.unwrap_or_else(|| text.to_owned())
        }
        Err(_) => text.to_owned(),
    };
    let message = message.trim();
    if message.is_empty() {
        return "(no message)".to_owned();
    }
    match message.char_indices().nth(MAX_MESSAGE) {
        Some((cut, _)) => format!("{}…", &message[..cut]),
        None => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_messages_are_the_servers_own() {
        assert_eq!(
            error_message(
                r#"{"error": {"message": "max_tokens is too large", "type": "BadRequestError", "code": 400}}"#
            ),
            "max_tokens is too large"
        );
        assert_eq!(
            error_message(r#"{"object": "error", "message": "old style", "code": 400}"#),
            "old style"
        );
        assert_eq!(
            error_message(r#"{"detail": [{"loc": ["body", "n"], "msg": "bad"}]}"#),
            r#"[{"loc":["body","n"],"msg":"bad"}]"#
        );
        assert_eq!(
            error_message("Internal Server Error"),
            "Internal Server Error"
        );
        assert_eq!(error_message("  "), "(no message)");
        assert_eq!(
            error_message(&"x".repeat(3000)).chars().count(),
            MAX_MESSAGE + 1
        );
    }
}
