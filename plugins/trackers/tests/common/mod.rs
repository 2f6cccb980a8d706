//! Shared by the tracker tests: the tools' Python, servers on free ports, read-back helpers.
#![allow(dead_code)] // each test binary uses its own subset

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use verl_plugin_api::{ComponentInit, Metric, RunContext, Tracker};

/// The venv's Python with mlflow, tensorboard, trackio and wandb: `VERL_TOOLS_PYTHON`, else
/// where scripts/setup-python-tools.sh puts it (`$XDG_CACHE_HOME` or `~/.cache`, then
/// `verl-core/tools-venv/bin/python`). A missing one fails the test: these tests exist to prove
/// the formats with the real tools.
pub fn python() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cache")))
        .unwrap_or_default();
    let default = cache.join("verl-core/tools-venv/bin/python");
    let python = std::env::var_os("VERL_TOOLS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or(default);
    assert!(
        python.exists(),
        "no Python with the tracking tools at {}: run scripts/setup-python-tools.sh (or set VERL_TOOLS_PYTHON)",
        python.display()
    );
    python
}

/// A program of the tools' venv (`mlflow`, `trackio`).
pub fn tool(name: &str) -> PathBuf {
    python().with_file_name(name)
}

/// Runs a Python script with arguments; returns its stdout parsed as JSON.
pub fn run_python(script: &str, args: &[&str]) -> Value {
    let out = Command::new(python())
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "python failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("python printed no JSON ({e}):\n{stdout}"))
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A server process in its own process group, killed (the whole group, SIGKILL: as abruptly as a
/// crash) when this is dropped or when the test process exits: a shell holds the server and kills
/// it once its stdin closes.
pub struct Server {
    shell: Child,
    stdin: Option<ChildStdin>,
    pub url: String,
}

impl Server {
    /// Starts `program args` with `envs` and waits until `GET url+ready_path` answers 2xx.
    pub fn start(
        program: &Path,
        args: &[&str],
        envs: &[(&str, &str)],
        port: u16,
        ready_path: &str,
    ) -> Self {
        // setsid: the server and whatever it forks (uvicorn workers) form one process group.
        let mut shell = Command::new("bash")
            .arg("-c")
            .arg(r#"setsid "$@" >/dev/null 2>&1 & pid=$!; read _; kill -KILL -- -$pid; wait"#)
            .arg("bash")
            .arg(program)
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::piped())
            .spawn()
            .expect("sh starts");
        let stdin = shell.stdin.take();
        let server = Self {
            shell,
            stdin,
            url: format!("http://127.0.0.1:{port}"),
        };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(90) {
            if ureq::get(&format!("{}{ready_path}", server.url))
                .call()
                .is_ok()
            {
                eprintln!(
                    "{} ready after {:.1} s",
                    program.display(),
                    start.elapsed().as_secs_f64()
                );
                return server;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "{} did not start on port {port} within 90 s",
            program.display()
        );
    }

    pub fn stop(&mut self) {
        drop(self.stdin.take());
        let _ = self.shell.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn init(config: Value, project: &str, experiment: &str, run_dir: &Path) -> ComponentInit {
    let mut run = RunContext::default();
    run.project = project.into();
    run.experiment = experiment.into();
    run.run_dir = run_dir.to_string_lossy().into_owned();
    ComponentInit::new(config, run)
}

/// A tracker of type `T`, initialised with `config` for a run of `project`/`experiment` in `run_dir`.
pub fn started<T: Tracker + Default>(
    config: Value,
    project: &str,
    experiment: &str,
    run_dir: &Path,
) -> T {
    let mut tracker = T::default();
    tracker
        .init(&init(config, project, experiment, run_dir))
        .unwrap();
    tracker
}

/// Like [`started`], for a run that resumes after `resume_step` (`None`: a new run).
pub fn resumed<T: Tracker + Default>(
    config: Value,
    project: &str,
    experiment: &str,
    run_dir: &Path,
    resume_step: Option<u64>,
) -> T {
    let mut tracker = T::default();
    let mut init = init(config, project, experiment, run_dir);
    init.resume_step = resume_step;
    tracker.init(&init).unwrap();
    tracker
}

pub fn metrics(pairs: &[(&str, f64)]) -> Vec<Metric> {
    pairs.iter().map(|(k, v)| Metric::new(*k, *v)).collect()
}

pub fn get_json(url: &str) -> Value {
    body_json(url, ureq::get(url).call())
}

pub fn post_json(url: &str, body: &Value) -> Value {
    body_json(url, ureq::post(url).send_json(body))
}

fn body_json(url: &str, response: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Value {
    let mut text = String::new();
    response
        .unwrap_or_else(|e| panic!("{url}: {e}"))
        .into_body()
        .into_reader()
        .read_to_string(&mut text)
        .unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{url} answered no JSON ({e}): {text}"))
}

/// The spill file's lines.
pub fn spill_lines(path: &Path) -> Vec<Value> {
    match std::fs::read_to_string(path) {
        Ok(text) => text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect(),
        Err(_) => Vec::new(),
    }
}
