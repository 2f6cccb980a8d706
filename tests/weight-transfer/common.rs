//! What both test targets share: the servers' Python, the recorded requests replayed through a
//! checker, two syncs of lent tensors. (Two targets, since one binary cannot link both plugins:
//! each exports the plugin root module's symbol.)

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use verl_plugin_api::{ComponentInit, Rollout, RunContext};
use verl_rollout_http::mock::MockServer;
use verl_rollout_http::testing::{FakeCollective, TransferLog, sync_lent};

/// `<venv>/bin/python` of a set-up script: under `$env` when set, else
/// `~/.cache/verl-core/<dir>`.
pub fn python(env: &str, dir: &str, script: &str) -> PathBuf {
    let root = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var("HOME").expect("HOME is set"))
            .join(".cache/verl-core")
            .join(dir)
    });
    let python = root.join("venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run {script}",
        python.display()
    );
    python
}

/// Two syncs of the lent test tensors (steps 1 and 2) through `rollout`.
pub fn two_syncs(rollout: &mut dyn Rollout) {
    for step in [1, 2] {
        sync_lent(rollout, step).unwrap();
    }
}

/// Every POST `mock` received, replayed by `checker` (in `tests/fixtures/weight-transfer/`)
/// under `python`; what the checker's routes saw.
pub fn replay(mock: &MockServer, python: &Path, checker: &str) -> Value {
    let requests: Vec<Value> = mock
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .map(|r| json!({"method": r.method, "path": r.path, "body": r.body}))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("requests.json");
    std::fs::write(&file, Value::Array(requests).to_string()).unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/weight-transfer");
    let out = Command::new(python)
        .arg(fixtures.join(checker))
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{checker}: a request was rejected:\n{stderr}"
    );
    serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap()
}

/// A transport recording into `log`.
pub fn fake(log: &Arc<Mutex<TransferLog>>) -> FakeCollective {
    FakeCollective {
        log: Arc::clone(log),
        fail_send: None,
    }
}

/// What the trainer sends rollout `name`, with `section` as its own.
pub fn init(name: &str, section: Value) -> ComponentInit {
    ComponentInit::new(
        json!({"name": name, "model": {"path": "/m"}, "engine_kwargs": {name: section}}),
        RunContext::default(),
    )
}
