//! The bad-input corpus (`tests/corpus/bad-inputs/*.toml`), replayed against the release binary:
//! every case exits with its expected status and a message holding its expected words, and
//! nothing anywhere prints a Rust panic, a backtrace or a C++ stack trace. Each case runs in a
//! fresh directory with its files made there; binary ones (noise, truncated or copied libraries
//! and weights) are made here, named in the case.
//!
//! A case (all paths relative to its directory `{case}`, where it runs):
//! - `args`: the command line; `{rl}` expands to the overrides of a small valid `run`, `{sft}` to
//!   those of a valid `sft`, so that a case adds only what is wrong.
//! - `plugins = true`: the fsdp, native and trackers plugins are found (`VERL_PLUGIN_PATH`).
//! - `model = true`: `model/` is a copy of the tiny-llama fixture, to break.
//! - `files` (text), `json` (keys merged into a JSON file), `copy` (from a path or a built
//!   library: `plugin:rocm`, `api:3.0.0`, `feature:NAME`), `replace` (the first occurrence of a
//!   byte string), `noise` (that many random bytes), `truncate` (to that many bytes), `remove`,
//!   `mode`; then `env`.
//! - `exit` and `expect`: the status and words of the message (stdout and stderr together).
//!
//! Placeholders in every string: `{case}`, `{plugins}`, `{model}` (the fixture, read-only),
//! `{data}` (the synthetic task's train.parquet and test.parquet), `{fixtures}`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::helpers::*;

/// Text no output may hold: a Rust panic (`panicked at`, or a plugin's caught one, `panicked in
/// <method>`: bad input must be an error, not a bug), a hint at backtraces, a C++ stack trace.
/// Only a case about a plugin that panics on purpose expects `panicked in`.
const FORBIDDEN: [&str; 5] = [
    "panicked",
    "RUST_BACKTRACE",
    "stack backtrace",
    "Exception raised from",
    "frame #",
];

/// A case that has not ended by then hangs.
const CASE_TIMEOUT: Duration = Duration::from_secs(120);

/// A small, valid `verl-core run` (one step on the tiny-llama fixture).
const RL: &[&str] = &[
    "data.train_files=[{data}/train.parquet]",
    "data.val_files=[{data}/test.parquet]",
    "actor_rollout_ref.model.path={model}",
    "trainer.default_local_dir={case}/out",
    "data.train_batch_size=4",
    "data.max_prompt_length=16",
    "data.max_response_length=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.n=2",
    "trainer.total_training_steps=1",
    "trainer.save_freq=-1",
    "trainer.logger=[console]",
    "quickstart.enable=false",
];

/// A small, valid `verl-core sft`.
const SFT: &[&str] = &[
    "data.train_files=[{data}/train.parquet]",
    "actor_rollout_ref.model.path={model}",
    "trainer.default_local_dir={case}/out",
    "data.max_prompt_length=16",
    "data.max_response_length=8",
    "sft.steps=1",
    "sft.batch_size=4",
];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Corpus {
    case: Vec<Case>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    args: Vec<String>,
    #[serde(default)]
    plugins: bool,
    #[serde(default)]
    model: bool,
    #[serde(default)]
    files: BTreeMap<String, String>,
    #[serde(default)]
    json: BTreeMap<String, serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    copy: BTreeMap<String, String>,
    #[serde(default)]
    replace: BTreeMap<String, [String; 2]>,
    #[serde(default)]
    noise: BTreeMap<String, usize>,
    #[serde(default)]
    truncate: BTreeMap<String, u64>,
    #[serde(default)]
    remove: Vec<String>,
    #[serde(default)]
    mode: BTreeMap<String, u32>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    exit: i32,
    expect: Vec<String>,
}

/// What every case shares: the plugin directory, the data, the fixture model.
struct Shared {
    plugins: tempfile::TempDir,
    data: tempfile::TempDir,
}

impl Shared {
    fn new() -> Self {
        let plugins = bundled_plugins(&[
            "verl_plugin_native",
            "verl_plugin_fsdp",
            "verl_plugin_trackers",
        ]);
        let data = tempfile::tempdir().unwrap();
        let out = verl_core(
            &[
                "data",
                "gen",
                "--output",
                data.path().to_str().unwrap(),
                "--train-size",
                "64",
                "--val-size",
                "8",
            ],
            &[],
        );
        assert!(out.status.success(), "{out:?}");
        Self { plugins, data }
    }

    fn fixtures() -> PathBuf {
        workspace_root().join("runtime/model/fixtures")
    }

    /// `text` with the placeholders filled in for the case in `dir`.
    fn fill(&self, text: &str, dir: &Path) -> String {
        text.replace("{case}", &dir.display().to_string())
            .replace("{plugins}", &self.plugins.path().display().to_string())
            .replace(
                "{model}",
                &Self::fixtures().join("tiny-llama").display().to_string(),
            )
            .replace("{data}", &self.data.path().display().to_string())
            .replace("{fixtures}", &Self::fixtures().display().to_string())
    }
}

/// Deterministic noise: an xorshift stream.
fn noise(len: usize) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A library `copy` names: `plugin:NAME` (a bundled plugin), `api:VERSION` (the test plugin built
/// against that plugin API), `feature:NAME` (the test plugin with that feature).
fn library(source: &str) -> Option<PathBuf> {
    if let Some(name) = source.strip_prefix("plugin:") {
        return Some(bundled_plugin(&format!("verl_plugin_{name}")));
    }
    if let Some(version) = source.strip_prefix("api:") {
        return Some(fixture_plugin(&[], Some(Api::at(version))));
    }
    source
        .strip_prefix("feature:")
        .map(|feature| fixture_plugin(&[feature], None))
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

impl Case {
    /// Makes the case's files in `dir`.
    fn prepare(&self, shared: &Shared, dir: &Path) {
        let path = |rel: &str| {
            let path = dir.join(shared.fill(rel, dir));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            path
        };
        if self.model {
            copy_dir(&Shared::fixtures().join("tiny-llama"), &dir.join("model"));
        }
        for (rel, text) in &self.files {
            std::fs::write(path(rel), shared.fill(text, dir)).unwrap();
        }
        for (rel, keys) in &self.json {
            let file = path(rel);
            let mut value: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
            for (key, v) in keys {
                value[key] = v.clone();
            }
            std::fs::write(file, value.to_string()).unwrap();
        }
        for (rel, source) in &self.copy {
            let from = library(source).unwrap_or_else(|| PathBuf::from(shared.fill(source, dir)));
            std::fs::copy(&from, path(rel))
                .unwrap_or_else(|e| panic!("{}: copying {}: {e}", self.name, from.display()));
        }
        for (rel, [from, to]) in &self.replace {
            let file = path(rel);
            let bytes = std::fs::read(&file).unwrap();
            let at = bytes
                .windows(from.len())
                .position(|w| w == from.as_bytes())
                .unwrap_or_else(|| panic!("{}: no `{from}` in {rel}", self.name));
            let edited = [&bytes[..at], to.as_bytes(), &bytes[at + from.len()..]].concat();
            std::fs::write(file, edited).unwrap();
        }
        for (rel, len) in &self.noise {
            std::fs::write(path(rel), noise(*len)).unwrap();
        }
        for (rel, len) in &self.truncate {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(path(rel))
                .unwrap();
            file.set_len(*len).unwrap();
        }
        for rel in &self.remove {
            std::fs::remove_file(path(rel)).unwrap();
        }
        for (rel, mode) in &self.mode {
            set_mode(&path(rel), *mode);
        }
    }

    fn args(&self, shared: &Shared, dir: &Path) -> Vec<String> {
        self.args
            .iter()
            .flat_map(|arg| match arg.as_str() {
                "{rl}" => RL.to_vec(),
                "{sft}" => SFT.to_vec(),
                other => vec![other],
            })
            .map(|arg| shared.fill(arg, dir))
            .collect()
    }

    /// Runs the case; returns what is wrong with its outcome, if anything, and how long it took.
    fn check(&self, shared: &Shared) -> (Option<String>, Duration) {
        let dir = tempfile::tempdir().unwrap();
        self.prepare(shared, dir.path());
        let mut env: Vec<(String, String)> =
            vec![("HOME".into(), dir.path().display().to_string())];
        if self.plugins {
            env.push((
                "VERL_PLUGIN_PATH".into(),
                shared.plugins.path().display().to_string(),
            ));
        }
        env.extend(
            self.env
                .iter()
                .map(|(k, v)| (k.clone(), shared.fill(v, dir.path()))),
        );
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let args = self.args(shared, dir.path());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let log = dir.path().join(".output");
        let started = Instant::now();
        let status = run_with_timeout(verl_core_command(&args, &env).current_dir(dir.path()), &log);
        let took = started.elapsed();
        let output = std::fs::read_to_string(&log).unwrap_or_default();
        let problem = match status {
            None => Some(format!("no exit within {CASE_TIMEOUT:?}")),
            Some(code) => {
                let mut wrong = Vec::new();
                if code != self.exit {
                    wrong.push(format!("exit {code}, expected {}", self.exit));
                }
                for word in &self.expect {
                    let word = shared.fill(word, dir.path());
                    if !output.contains(&word) {
                        wrong.push(format!("no `{word}` in the output"));
                    }
                }
                let expected = |text: &str| self.expect.iter().any(|w| w.contains(text));
                for text in FORBIDDEN {
                    if output.contains(text) && !expected(text) {
                        wrong.push(format!("`{text}` in the output"));
                    }
                }
                (!wrong.is_empty()).then(|| wrong.join("; "))
            }
        };
        let problem = problem.map(|p| {
            let tail: String = output.chars().take(1500).collect();
            format!(
                "{}: {p}\n  $ verl-core {}\n{tail}",
                self.name,
                args.join(" ")
            )
        });
        (problem, took)
    }
}

/// Runs `cmd` with stdout and stderr into `log`; its exit code, None if it had to be killed.
fn run_with_timeout(cmd: &mut Command, log: &Path) -> Option<i32> {
    let file = std::fs::File::create(log).unwrap();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .spawn()
        .expect("starting verl-core");
    let deadline = Instant::now() + CASE_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            // A signal (an abort) has no code: report it as one no case expects.
            return Some(status.code().unwrap_or(-1));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn corpus() -> Vec<Case> {
    let dir = workspace_root().join("tests/corpus/bad-inputs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    files
        .iter()
        .flat_map(|file| {
            let text = std::fs::read_to_string(file).unwrap();
            toml::from_str::<Corpus>(&text)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
                .case
        })
        .collect()
}

#[test]
fn every_bad_input_gets_a_clean_error() {
    let cases = corpus();
    let mut names: Vec<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), cases.len(), "case names are unique");
    assert!(cases.len() >= 100, "the corpus has {} cases", cases.len());
    // Libraries the cases copy are built before the cases run in parallel.
    for source in cases.iter().flat_map(|c| c.copy.values()) {
        library(source);
    }
    let shared = Shared::new();
    let next = AtomicUsize::new(0);
    let results = Mutex::new(Vec::new());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                while let Some(case) = cases.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let (problem, took) = case.check(&shared);
                    results
                        .lock()
                        .unwrap()
                        .push((case.name.as_str(), problem, took));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|r| std::cmp::Reverse(r.2));
    eprintln!(
        "{} bad inputs in {:.1?} ({workers} at a time); slowest: {}",
        results.len(),
        started.elapsed(),
        results
            .iter()
            .take(5)
            .map(|(name, _, took)| format!("{name} {took:.1?}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let problems: Vec<&String> = results.iter().filter_map(|r| r.1.as_ref()).collect();
    assert!(
        problems.is_empty(),
        "{} of {} cases failed:\n\n{}",
        problems.len(),
        results.len(),
        problems
            .iter()
            .map(|p| p.as_str())
            .collect::<Vec<_>>()
            .join("\n\n")
    );
}

/// Each `--prompt-ids` flag is one prompt (it once joined them all into one).
#[test]
fn each_prompt_ids_flag_is_one_prompt() {
    let plugins = bundled_plugins(&["verl_plugin_native"]);
    let model = Shared::fixtures().join("tiny-llama");
    let out = verl_core(
        &[
            "--plugin-dir",
            plugins.path().to_str().unwrap(),
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt-ids",
            "4,5,6",
            "--prompt-ids",
            "7,8,9",
            "--max-new-tokens",
            "3",
            "--json",
        ],
        &[],
    );
    assert!(out.status.success(), "{out:?}");
    let results = stdout_json(&out)["results"].as_array().unwrap().clone();
    let prompts: Vec<u64> = results
        .iter()
        .map(|r| r["prompt_index"].as_u64().unwrap())
        .collect();
    assert_eq!(prompts, vec![0, 1]);
    for r in &results {
        assert_eq!(r["response_ids"].as_array().unwrap().len(), 3, "{r}");
    }
}
