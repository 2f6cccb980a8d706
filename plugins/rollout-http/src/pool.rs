//! The servers a rollout talks to (replicas of one model, started here or attached to), and the
//! request path every call takes: a bound on requests in flight, the least busy server, retries
//! with backoff when a connection fails, a started server's death noticed, the server's own
//! message carried into errors.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::Semaphore;

use verl_plugin_api::{ErrorKind, PluginError};

use crate::error::logged;
use crate::process::{Launch, ServerProcess};
use crate::support::cut;
use crate::{HttpError, ServerLog, ServerSettings, link_weights};

/// One server: its base URL and, when this plugin started it, its process and how it was
/// started (to start it again when it dies).
#[derive(Debug)]
pub struct Server {
    url: String,
    process: Option<ServerProcess>,
    launch: Option<Launch>,
    /// Times it was started again after it died.
    restarts: u32,
    inflight: AtomicUsize,
}

impl Server {
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn process(&self) -> Option<&ServerProcess> {
        self.process.as_ref()
    }

    fn new(url: &str, launch: Option<Launch>) -> Self {
        Self {
            url: url.trim_end_matches('/').to_owned(),
            process: None,
            launch,
            restarts: 0,
            inflight: AtomicUsize::new(0),
        }
    }

    /// Where the cause of a failure on its side is to be read.
    fn log(&self) -> ServerLog {
        self.process
            .as_ref()
            .map_or(ServerLog::Attached, |p| ServerLog::Started {
                server: p.name().to_owned(),
                log: p.log().to_path_buf(),
                error_line: p.error_line(),
            })
    }

    /// What messages call it: its process, else its URL.
    fn name(&self, backend: &str) -> String {
        self.process.as_ref().map_or_else(
            || format!("{backend} server {}", self.url),
            |p| p.name().to_owned(),
        )
    }
}

/// How long a started server whose connections failed gets to be seen dead (its sockets close
/// before it can be reaped) before the failure is taken as the server's answer.
const DEATH_GRACE: Duration = Duration::from_secs(3);

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
    startup_timeout: Duration,
    max_restarts: u32,
    /// The copy of the last weights loaded by file that a restarted server gets back.
    kept: Option<PathBuf>,
    /// Rotates the tie-break among equally busy servers.
    turn: AtomicUsize,
}

/// What a backend does to a server the pool started again after it died, before any request
/// goes to it: give it the weights the rollout last loaded (it comes back with those it was
/// launched with) and check it reports their version.
pub type Restore<'a> = dyn Fn(&Pool, usize) -> Result<(), HttpError> + 'a;

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
            startup_timeout: settings.startup_timeout(),
            max_restarts: settings.max_restarts,
            kept: None,
            turn: AtomicUsize::new(0),
        })
    }

    /// Servers already running at `settings.urls`; waits (up to the startup timeout) until each
    /// answers `/health`.
    pub fn attach(backend: &str, settings: &ServerSettings) -> Result<Self, HttpError> {
        let servers = settings
            .urls
            .iter()
            .map(|url| Server::new(url, None))
            .collect();
        let pool = Self::new(backend, settings, servers)?;
        for i in 0..pool.servers.len() {
            pool.wait_ready(i, settings.startup_timeout())?;
        }
        Ok(pool)
    }

    /// Starts a server with `launch`, listening at `url`, and waits until it answers `/health`
    /// (printing a progress line on stderr every few seconds). The server is stopped when the pool
    /// is dropped, and started again with `launch` when it dies (up to `max_restarts` times; see
    /// [`Pool::recover`]).
    pub fn spawn(
        backend: &str,
        settings: &ServerSettings,
        launch: &Launch,
        url: &str,
    ) -> Result<Self, HttpError> {
        let mut pool = Self::new(backend, settings, vec![Server::new(url, None)])?;
        pool.relaunch(0, launch.clone())?;
        Ok(pool)
    }

    /// Stops started server `i` if it still runs and starts it with `launch` from now on (a
    /// restart on new weights; its restarts after deaths stay counted).
    pub fn relaunch(&mut self, i: usize, launch: Launch) -> Result<(), HttpError> {
        let server = &mut self.servers[i];
        if let Some(old) = server.process.take() {
            old.stop();
        }
        let process = ServerProcess::spawn(&launch)?;
        eprintln!(
            "{}: started; waiting for {}/health (log: {})",
            process.name(),
            server.url,
            launch.log.display()
        );
        server.process = Some(process);
        server.launch = Some(launch);
        self.wait_ready(i, self.startup_timeout)
    }

    pub fn servers(&self) -> &[Server] {
        &self.servers
    }

    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// The one weight version all servers report (`versions`, in server order); replicas holding
    /// different weights are an error naming two of them.
    pub fn agreed_version(&self, versions: Vec<String>) -> Result<String, HttpError> {
        match versions.iter().position(|v| *v != versions[0]) {
            None => Ok(versions[0].clone()),
            Some(i) => Err(HttpError::Config(format!(
                "the {} replicas hold different weights: {} reports version `{}`, {} reports `{}`",
                self.backend, self.servers[0].url, versions[0], self.servers[i].url, versions[i]
            ))),
        }
    }

    /// Runs `future` on the pool's runtime, blocking the caller.
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }

    fn wait_ready(&self, i: usize, timeout: Duration) -> Result<(), HttpError> {
        let server = &self.servers[i];
        let start = Instant::now();
        let url = format!("{}/health", server.url);
        let name = server.name(&self.backend);
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
                        log: Box::new(p.log_excerpt()),
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

    /// Keeps the weights of `handover` (a weight sync's directory, removed once the update
    /// returns) for the started servers to be given again if they die: hard links in
    /// `<log dir>/weights/step_<version>`, the previous step's removed. Nothing for attached
    /// servers.
    pub fn keep_weights(&mut self, handover: &Path, version: &str) -> Result<(), PluginError> {
        let Some(launch) = self.servers.iter().find_map(|s| s.launch.as_ref()) else {
            return Ok(());
        };
        let log_dir = launch.log.parent().unwrap_or(Path::new("."));
        let dir = log_dir.join("weights").join(format!("step_{version}"));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| {
                PluginError::new(ErrorKind::IO, format!("removing {}: {e}", dir.display()))
            })?;
        }
        link_weights(handover, &dir)?;
        if let Some(old) = self.kept.take()
            && old != dir
        {
            let _ = std::fs::remove_dir_all(old);
        }
        self.kept = Some(dir);
        Ok(())
    }

    /// The weights [`Pool::keep_weights`] last kept.
    pub fn kept_weights(&self) -> Option<&Path> {
        self.kept.as_deref()
    }

    /// The started servers that have exited.
    fn dead(&self) -> Vec<usize> {
        (0..self.servers.len())
            .filter(|&i| {
                self.servers[i]
                    .process
                    .as_ref()
                    .is_some_and(|p| p.exit_status().is_some())
            })
            .collect()
    }

    /// Starts again every started server that has exited, within `max_restarts` per server over
    /// the pool's life, and has `restore` give each the weights the others hold (a started
    /// server comes back with the weights it was launched with). A server past its allowance is
    /// the error of its death, with its log.
    pub fn recover(&mut self, restore: &Restore<'_>) -> Result<(), HttpError> {
        for i in self.dead() {
            self.restart(i, "since the last request")?;
            restore(self, i)?;
        }
        Ok(())
    }

    /// The started servers that have exited, waiting up to [`DEATH_GRACE`] for one to be seen
    /// dead when none is yet (a connection fails as a server dies, before it can be reaped).
    pub(crate) fn dead_after_failure(&self) -> Vec<usize> {
        let deadline = Instant::now() + DEATH_GRACE;
        loop {
            let dead = self.dead();
            if !dead.is_empty()
                || Instant::now() >= deadline
                || self.servers.iter().all(|s| s.process.is_none())
            {
                return dead;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub(crate) fn restart(&mut self, i: usize, when: &'static str) -> Result<(), HttpError> {
        let server = &self.servers[i];
        let (Some(process), Some(launch)) = (&server.process, &server.launch) else {
            return Ok(());
        };
        let Some(died) = process.died(when) else {
            return Ok(());
        };
        if server.restarts >= self.max_restarts {
            return Err(HttpError::GaveUp {
                max_restarts: self.max_restarts,
                died: Box::new(died),
            });
        }
        let k = server.restarts + 1;
        let mut again = launch.clone();
        again.log = restart_log(&launch.log, k);
        eprintln!(
            "warning: {} exited ({}) {when}{}; its log: {}. Starting it again (restart {k} of \
             max_restarts {}), log: {}",
            process.name(),
            process.exit_status().unwrap_or_default(),
            logged(process.error_line().as_deref()),
            process.log().display(),
            self.max_restarts,
            again.log.display()
        );
        let server = &mut self.servers[i];
        server.restarts = k;
        if let Some(old) = server.process.take() {
            // Reaps it and ends what is left of its process group.
            old.stop();
        }
        server.process = Some(ServerProcess::spawn(&again)?);
        self.wait_ready(i, self.startup_timeout)
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
                            server_log: status.is_server_error().then(|| Box::new(server.log())),
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

/// The log of restart `k` of a server whose first log is `log`: `server-8000.log` →
/// `server-8000.restart-1.log` (the first log keeps why it died).
fn restart_log(log: &Path, k: u32) -> PathBuf {
    let stem = log.file_stem().unwrap_or_default().to_string_lossy();
    log.with_file_name(format!("{stem}.restart-{k}.log"))
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
    cut(message, MAX_MESSAGE)
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
