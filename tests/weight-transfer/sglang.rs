//! The `sglang` rollout's `collective` weight sync against SGLang's own code: the requests of two
//! syncs (recorded by a mock server; the trainer's end of the transfer is a recorder) parsed by
//! routes declared as SGLang's `http_server.py` declares them, with its own request classes
//! (`tests/fixtures/weight-transfer/check_sglang_requests.py`, in the venv of
//! `scripts/setup-sglang-protocol.sh`). The transfer against SGLang's group code is
//! verl-distributed's `weight_transfer` test.
//!
//! `cargo test -p verl-integration-tests --test weight_transfer_sglang`

mod common;

use std::sync::{Arc, Mutex};

use common::{fake, init, python, replay, two_syncs};
use serde_json::json;
use verl_plugin_api::Rollout;
use verl_plugin_sglang::SglangRollout;
use verl_rollout_http::mock::{MockServer, Recorded, Reply};
use verl_rollout_http::testing::TransferLog;

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
    let seen = replay(
        &mock,
        &python(
            "VERL_SGLANG_PROTOCOL_DIR",
            "sglang-protocol",
            "scripts/setup-sglang-protocol.sh (after scripts/setup-vllm.sh)",
        ),
        "check_sglang_requests.py",
    );
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
