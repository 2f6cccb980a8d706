//! The plugin against a mock of SGLang's native HTTP API (answers in the shapes of SGLang
//! 0.5's `http_server.py` and `io_struct.py`): request bodies, answer parsing, the reload
//! sequence, stale weights, sleep/wake, config.

use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use verl_plugin_api::{
    ComponentInit, ErrorKind, FinishReason, GenerateRequest, Rollout, RunContext, WeightSource,
};
use verl_rollout_http::mock::{MockServer, Recorded, Reply};
use verl_rollout_http::testing::{self, Backend, file_handover, flag, init, sampling, weights_dir};

use super::*;

/// An SGLang server's answers; `version` is the weight version it holds.
fn sglang_mock(version: Arc<Mutex<String>>) -> MockServer {
    MockServer::start(move |r: &Recorded| sglang_reply(&version, r))
}

/// An SGLang server's answer to `r`.
fn sglang_reply(version: &Mutex<String>, r: &Recorded) -> Reply {
    match r.path.as_str() {
        "/health" => Reply::Text(200, String::new()),
        "/model_info" => Reply::ok(json!({
            "model_path": "/m", "tokenizer_path": "/m", "is_generation": true,
            "weight_version": *version.lock().unwrap(),
        })),
        "/update_weights_from_disk" => {
            *version.lock().unwrap() = r.body["weight_version"].as_str().unwrap().to_owned();
            Reply::ok(
                json!({"success": true, "message": "Succeeded to update model weights.", "num_paused_requests": 0}),
            )
        }
        "/flush_cache" => Reply::Text(200, "Cache flushed.".into()),
        "/release_memory_occupation" | "/resume_memory_occupation" => Reply::ok(Value::Null),
        "/generate" => Reply::ok(generated(&r.body, &version.lock().unwrap())),
        _ => Reply::Json(404, json!({"detail": "Not Found"})),
    }
}

/// SGLang's answer to a batch: output `j` continues with `first prompt id + j`, then stops with
/// the last stop id if there is one (`finish_reason` `{type: "stop", matched: id}`).
fn generated(body: &Value, version: &str) -> Value {
    let batch = body["input_ids"].as_array().unwrap();
    let outputs: Vec<Value> = batch
        .iter()
        .enumerate()
        .map(|(j, prompt)| {
            let params = &body["sampling_params"][j];
            let stop = params["stop_token_ids"]
                .as_array()
                .and_then(|s| s.last())
                .cloned();
            let mut ids = vec![json!(prompt[0].as_u64().unwrap() + j as u64)];
            if let Some(stop) = &stop {
                ids.push(stop.clone());
            }
            let lps: Vec<Value> = ids
                .iter()
                .enumerate()
                .map(|(t, id)| json!([-0.25 * (t + 1) as f64, id, null]))
                .collect();
            let finish = match &stop {
                Some(id) => json!({"type": "stop", "matched": id}),
                None => json!({"type": "length", "length": ids.len()}),
            };
            json!({
                "text": "xy", "output_ids": ids,
                "meta_info": {
                    "id": format!("req-{j}"), "finish_reason": finish,
                    "prompt_tokens": prompt.as_array().unwrap().len(), "completion_tokens": ids.len(),
                    "cached_tokens": 0, "weight_version": version,
                    "input_token_logprobs": [[null, prompt[0], null]], "output_token_logprobs": lps,
                    "e2e_latency": 0.01,
                },
            })
        })
        .collect();
    Value::Array(outputs)
}

/// The shared suite's view of this backend.
struct Sglang;

impl Backend for Sglang {
    type Rollout = SglangRollout;
    const NAME: &'static str = "sglang";
    const MISSPELLED: (&'static str, &'static str) = ("context_len", "context_length");
    fn mock(version: Arc<Mutex<String>>) -> MockServer {
        sglang_mock(version)
    }
    const GENERATE: &'static str = "/generate";
    const LOAD: (&'static str, &'static str) = ("/update_weights_from_disk", "/model_path");
}

verl_rollout_http::backend_tests!(super::Sglang);

fn attached(mock: &MockServer) -> SglangRollout {
    testing::attached::<Sglang>(&[mock])
}

fn file_source(step: u64, handover: &str) -> WeightSource<'_> {
    WeightSource::from_handover(step, &[], handover)
}

#[test]
fn requests_carry_every_sampling_setting_in_sglangs_names() {
    let mock = sglang_mock(Arc::new(Mutex::new("default".into())));
    let mut rollout = attached(&mock);
    rollout
        .generate(&GenerateRequest::new(vec![vec![5, 6, 7]], sampling(2)))
        .unwrap();
    let sent = mock.requests_to("/generate");
    assert_eq!(sent.len(), 1, "one request per prompt");
    let seed = verl_rollout_http::prompt_seed(11, 0);
    let params = |j: usize| {
        json!({
            "max_new_tokens": 8, "temperature": 0.7f32, "top_p": 0.9f32, "top_k": -1, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "stop_token_ids": [9], "ignore_eos": false,
            "sampling_seed": verl_rollout_http::prompt_seed(seed, j),
        })
    };
    let want = json!({
        "input_ids": [[5, 6, 7], [5, 6, 7]],
        "sampling_params": [params(0), params(1)],
        "return_logprob": true,
    });
    assert_eq!(sent[0].body, want);
    // The n samples of a prompt have their own seeds, or they would all be the same.
    assert_ne!(
        sent[0].body["sampling_params"][0]["sampling_seed"],
        sent[0].body["sampling_params"][1]["sampling_seed"]
    );

    // Greedy: temperature 0 and no filtering, whatever else the request says.
    let mut greedy = sampling(1);
    greedy.greedy = true;
    greedy.top_k = 20;
    rollout
        .generate(&GenerateRequest::new(vec![vec![5]], greedy))
        .unwrap();
    let params = &mock.requests_to("/generate")[1].body["sampling_params"][0];
    assert_eq!(
        (&params["temperature"], &params["top_p"], &params["top_k"]),
        (&json!(0.0), &json!(1.0), &json!(-1))
    );
}

#[test]
fn without_stop_ids_an_output_ends_by_length() {
    let mock = sglang_mock(Arc::new(Mutex::new("default".into())));
    let mut rollout = attached(&mock);
    let mut long = sampling(1);
    long.stop_token_ids.clear();
    let out = rollout
        .generate(&GenerateRequest::new(vec![vec![1]], long))
        .unwrap();
    assert_eq!(out.completions[0].finish_reason, FinishReason::Length);
}

#[test]
fn malformed_answers_name_the_output_and_the_field() {
    let p = Generate {
        ignore_eos: false,
        weight_version: "default".into(),
    };
    let body = p.body(&[1], &sampling(1), Some(1));
    let good = generated(&body, "default");
    assert_eq!(p.samples(&good).unwrap()[0].token_ids, [1, 9]);

    let mut answer = good.clone();
    answer[0]["meta_info"]["output_token_logprobs"] = json!([[-1.0, 1, null]]);
    assert!(
        p.samples(&answer)
            .unwrap_err()
            .contains("1 log-probs for 2 tokens")
    );
    answer[0]["meta_info"]["output_token_logprobs"] = json!([[-1.0, 1, null], [-1.0, 8, null]]);
    assert!(
        p.samples(&answer)
            .unwrap_err()
            .contains("token 1 is 9 but its log-prob is for 8")
    );
    answer[0]["meta_info"]["output_token_logprobs"] = json!([[-1.0, 1, null], [null, 9, null]]);
    assert!(
        p.samples(&answer)
            .unwrap_err()
            .contains("token 1 has no log-prob")
    );
    answer[0]["output_ids"] = Value::Null;
    assert!(p.samples(&answer).unwrap_err().contains("`output_ids`"));
    assert!(
        p.samples(&json!({"error": "x"}))
            .unwrap_err()
            .contains("not a list of outputs")
    );
    // An output generated on other weights than expected is refused.
    let stale = generated(&body, "7");
    assert!(
        p.samples(&stale)
            .unwrap_err()
            .contains("weights of version `7`, not `default`")
    );
}

#[test]
fn a_reload_updates_from_disk_flushes_and_checks_the_version() {
    let version = Arc::new(Mutex::new("default".to_owned()));
    let mock = sglang_mock(version.clone());
    let mut rollout = attached(&mock);
    let dir = weights_dir();
    let handover = file_handover(dir.path());
    rollout.update_weights(&file_source(4, &handover)).unwrap();
    let control: Vec<(String, String, Value)> = mock
        .requests()
        .into_iter()
        .filter(|r| r.path != "/health")
        .map(|r| (r.method, r.path, r.body))
        .collect();
    let step = |m: &str, p: &str, b: Value| (m.to_owned(), p.to_owned(), b);
    assert_eq!(
        control,
        [
            step("GET", "/model_info", Value::Null),
            step(
                "POST",
                "/update_weights_from_disk",
                json!({"model_path": dir.path(), "weight_version": "4", "flush_cache": true})
            ),
            step("POST", "/flush_cache", Value::Null),
            step("GET", "/model_info", Value::Null),
        ]
    );
    let out = rollout
        .generate(&GenerateRequest::new(vec![vec![1]], sampling(1)))
        .unwrap();
    assert_eq!(out.weight_version, Some(4));
}

#[test]
fn a_failed_reload_carries_the_message_and_blocks_generation() {
    // SGLang answers a failed reload with 400 and `success: false`; a 200 with `success: false`
    // is refused the same way.
    for status in [400, 200] {
        let mock = MockServer::start(move |r: &Recorded| match r.path.as_str() {
            "/update_weights_from_disk" => Reply::Json(
                status,
                json!({"success": false, "message": "Failed to get weights iterator: no safetensors in /gone", "num_paused_requests": 0}),
            ),
            "/model_info" => Reply::ok(json!({"weight_version": "default"})),
            _ => Reply::ok(json!({})),
        });
        let mut rollout = attached(&mock);
        let dir = weights_dir();
        let handover = file_handover(dir.path());
        let err = rollout
            .update_weights(&file_source(3, &handover))
            .unwrap_err();
        assert!(
            err.message().contains("no safetensors in /gone")
                && err.message().contains("/update_weights_from_disk"),
            "{status}: {err}"
        );
        assert!(mock.requests_to("/flush_cache").is_empty());
        let err = rollout
            .generate(&GenerateRequest::new(vec![vec![1]], sampling(1)))
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::UNAVAILABLE);
        assert!(
            err.message().contains("refusing to generate")
                && err.message().contains("not `(reload to 3 incomplete)`"),
            "{err}"
        );
        assert!(mock.requests_to("/generate").is_empty());
    }
}

#[test]
fn a_server_that_does_not_take_the_version_is_refused() {
    // It answers success but keeps reporting its old version (a reload that did not happen).
    let mock = MockServer::start(|r: &Recorded| match r.path.as_str() {
        "/update_weights_from_disk" => Reply::ok(json!({"success": true, "message": "ok"})),
        "/model_info" => Reply::ok(json!({"weight_version": "default"})),
        _ => Reply::Text(200, String::new()),
    });
    let mut rollout = attached(&mock);
    let dir = weights_dir();
    let err = rollout
        .update_weights(&file_source(5, &file_handover(dir.path())))
        .unwrap_err();
    assert!(
        err.message()
            .contains("holds weights of version `default`, not `5`"),
        "{err}"
    );
}

#[test]
fn older_servers_report_their_version_in_get_model_info() {
    let mock = MockServer::start(|r: &Recorded| match r.path.as_str() {
        "/get_model_info" => Reply::ok(json!({"model_path": "/m", "weight_version": "v0"})),
        "/generate" => Reply::ok(generated(&r.body, "v0")),
        "/health" => Reply::Text(200, String::new()),
        _ => Reply::Json(404, json!({"detail": "Not Found"})),
    });
    let mut rollout = attached(&mock);
    rollout
        .generate(&GenerateRequest::new(vec![vec![1]], sampling(1)))
        .unwrap();
    assert_eq!(mock.requests_to("/get_model_info").len(), 2);
}

#[test]
fn sleep_and_wake_release_and_resume_every_server() {
    let (a, b) = (
        sglang_mock(Arc::new(Mutex::new("default".into()))),
        sglang_mock(Arc::new(Mutex::new("default".into()))),
    );
    let mut rollout = SglangRollout::default();
    rollout
        .init(&init::<Sglang>(json!({"urls": [a.url(), b.url()]})))
        .unwrap();
    rollout.sleep(1).unwrap();
    rollout.wake_up().unwrap();
    for mock in [&a, &b] {
        assert_eq!(mock.requests_to("/release_memory_occupation").len(), 1);
        assert_eq!(mock.requests_to("/resume_memory_occupation").len(), 1);
    }
    assert!(SglangRollout::capabilities().sleep_wake);
}

#[test]
fn a_failed_start_says_sglang_needs_a_gpu() {
    let mut rollout = SglangRollout::default();
    let err = rollout
        .init(&init::<Sglang>(
            json!({"command": ["/nonexistent/sglang-server"]}),
        ))
        .unwrap_err();
    assert!(
        err.message().contains("/nonexistent/sglang-server")
            && err.message().contains("no CPU build"),
        "{err}"
    );
}

fn launch_of(rollout: Value, section: Value) -> Launch {
    let mut run = RunContext::default();
    run.run_dir = "/runs/r1".into();
    run.seed = 5;
    let mut config = rollout;
    config["engine_kwargs"] = json!({"sglang": section.clone()});
    let init = ComponentInit::new(config, run);
    let keys: RolloutKeys = init.config("sglang").unwrap();
    let (server, sglang): (ServerSettings, SglangSettings) =
        verl_plugin_api::config::parse_section2(SECTION, &section.to_string(), "").unwrap();
    launch(&init, &keys, &server, &sglang, 8123).unwrap()
}

#[test]
fn a_started_server_follows_verls_rollout_keys() {
    let l = launch_of(
        json!({"model": {"path": "/models/q"}, "dtype": "bfloat16", "prompt_length": 64, "response_length": 32, "gpu_memory_utilization": 0.5}),
        json!({"python": "/venv/bin/python", "extra_args": ["--tp-size", "2"]}),
    );
    assert_eq!(l.program, PathBuf::from("/venv/bin/python"));
    assert_eq!(&l.args[..2], ["-m", SERVER_MODULE]);
    assert_eq!(flag(&l, "--model-path"), Some("/models/q"));
    assert_eq!(flag(&l, "--port"), Some("8123"));
    assert_eq!(flag(&l, "--random-seed"), Some("5"));
    assert_eq!(flag(&l, "--dtype"), Some("bfloat16"));
    assert_eq!(flag(&l, "--context-length"), Some("96"));
    assert_eq!(flag(&l, "--mem-fraction-static"), Some("0.5"));
    assert!(l.args.contains(&"--enable-memory-saver".to_owned()));
    assert_eq!(&l.args[l.args.len() - 2..], ["--tp-size", "2"]);
    assert_eq!(l.log, PathBuf::from("/runs/r1/sglang/server-8123.log"));

    // The section wins over verl's keys; nothing set: SGLang's own defaults.
    let l = launch_of(
        json!({"model": {"path": "/m"}, "max_model_len": 300, "gpu_memory_utilization": 0.5}),
        json!({"command": ["sglang", "serve"], "context_length": 128, "mem_fraction_static": 0.8, "enable_memory_saver": false}),
    );
    assert_eq!(l.program, PathBuf::from("sglang"));
    assert_eq!(l.args[0], "serve");
    assert_eq!(flag(&l, "--context-length"), Some("128"));
    assert_eq!(flag(&l, "--mem-fraction-static"), Some("0.8"));
    assert_eq!(flag(&l, "--dtype"), None);
    assert!(!l.args.contains(&"--enable-memory-saver".to_owned()));
}

// ---------------------------------------------------------------------------------------------
// `weight_sync: collective`

use verl_rollout_http::testing::{FakeCollective, TransferLog, eventually, sync_lent};

/// An SGLang server with the distributed update: `/init_weights_update_group` and
/// `/update_weights_from_distributed` answer only once the trainer's side of them shows in `log`
/// (as SGLang's return only when the torch.distributed calls they wait in have run); the update
/// sets the version it carries.
fn distributed_mock(version: Arc<Mutex<String>>, log: Arc<Mutex<TransferLog>>) -> MockServer {
    let updates = std::sync::atomic::AtomicUsize::new(0);
    MockServer::start(move |r: &Recorded| match r.path.as_str() {
        "/init_weights_update_group" => {
            if eventually(|| !log.lock().unwrap().joins.is_empty()) {
                Reply::ok(
                    json!({"success": true, "message": "Succeeded to initialize custom process group."}),
                )
            } else {
                Reply::Json(
                    400,
                    json!({"success": false, "message": "the trainer never joined"}),
                )
            }
        }
        "/update_weights_from_distributed" => {
            let k = updates.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            if eventually(|| log.lock().unwrap().sends.len() >= k) {
                *version.lock().unwrap() = r.body["weight_version"].as_str().unwrap().to_owned();
                Reply::ok(
                    json!({"success": true, "message": "Succeeded to update parameter online."}),
                )
            } else {
                Reply::Json(
                    400,
                    json!({"success": false, "message": "no broadcast from the trainer"}),
                )
            }
        }
        _ => sglang_reply(&version, r),
    })
}

/// A rollout in collective mode attached to `mocks`, its transport recording into `log`.
fn collective_rollout(
    mocks: &[&MockServer],
    log: &Arc<Mutex<TransferLog>>,
    fail_send: Option<&str>,
) -> SglangRollout {
    let fake = FakeCollective {
        log: Arc::clone(log),
        fail_send: fail_send.map(str::to_owned),
    };
    let mut rollout = SglangRollout::with_transport(move |_, _| Box::new(fake.clone()));
    let urls: Vec<&str> = mocks.iter().map(|m| m.url()).collect();
    rollout
        .init(&init::<Sglang>(json!({
            "urls": urls, "startup_timeout_s": 5, "weight_sync": "collective",
            "group_name": "verl", "group_backend": "gloo",
            "collective": {"master_port": 29518, "workers_per_server": 2},
        })))
        .unwrap();
    rollout
}

/// The POST requests `mock` received, in order.
fn posts(mock: &MockServer) -> Vec<(String, Value)> {
    mock.requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.path != "/generate")
        .map(|r| (r.path, r.body))
        .collect()
}

#[test]
fn a_collective_sync_runs_sglangs_distributed_update_on_every_server() {
    let log = Arc::new(Mutex::new(TransferLog::default()));
    let mocks: Vec<MockServer> = (0..2)
        .map(|_| distributed_mock(Arc::new(Mutex::new("default".into())), Arc::clone(&log)))
        .collect();
    let mut rollout = collective_rollout(&[&mocks[0], &mocks[1]], &log, None);
    sync_lent(&mut rollout, 4).unwrap();
    sync_lent(&mut rollout, 5).unwrap();

    let log = log.lock().unwrap();
    assert_eq!(log.joins.len(), 1);
    assert_eq!(
        (log.joins[0].world_size, log.joins[0].rank_offsets.clone()),
        (5, vec![1, 3])
    );
    assert_eq!(log.sends.len(), 2);
    assert_eq!(log.sends[1][1].name, "model.counts");
    for (i, mock) in mocks.iter().enumerate() {
        let init = json!({"master_address": "127.0.0.1", "master_port": 29518,
            "rank_offset": 1 + 2 * i, "world_size": 5, "group_name": "verl", "backend": "gloo"});
        let update = |v: &str| {
            json!({"names": ["model.embed_tokens.weight", "model.counts"],
                "dtypes": ["float32", "int64"], "shapes": [[2, 3], [2]], "group_name": "verl",
                "flush_cache": true, "weight_version": v})
        };
        let want = vec![
            ("/init_weights_update_group".to_owned(), init),
            ("/update_weights_from_distributed".to_owned(), update("4")),
            ("/flush_cache".to_owned(), Value::Null),
            ("/update_weights_from_distributed".to_owned(), update("5")),
            ("/flush_cache".to_owned(), Value::Null),
        ];
        assert_eq!(posts(mock), want, "server {i}");
    }
    drop(log);
    let out = rollout
        .generate(&GenerateRequest::new(vec![vec![5, 6]], sampling(1)))
        .unwrap();
    assert_eq!(out.weight_version, Some(5));
}

#[test]
fn a_failed_distributed_update_blocks_generation() {
    let log = Arc::new(Mutex::new(TransferLog::default()));
    let mock = distributed_mock(Arc::new(Mutex::new("default".into())), Arc::clone(&log));
    let mut rollout = collective_rollout(&[&mock], &log, Some("Gloo: connection closed by peer"));
    let err = sync_lent(&mut rollout, 3).unwrap_err();
    assert!(err.message().contains("connection closed by peer"), "{err}");
    assert!(
        err.message().contains("no broadcast from the trainer"),
        "{err}"
    );
    let err = rollout
        .generate(&GenerateRequest::new(vec![vec![5]], sampling(1)))
        .unwrap_err();
    assert!(err.message().contains("incomplete"), "{err}");
}

#[test]
fn without_a_transport_the_collective_sync_stops_before_any_server_is_asked() {
    let mock = sglang_mock(Arc::new(Mutex::new("default".into())));
    let mut rollout = SglangRollout::default();
    rollout
        .init(&init::<Sglang>(
            json!({"urls": [mock.url()], "startup_timeout_s": 5,
            "weight_sync": "collective"}),
        ))
        .unwrap();
    let err = sync_lent(&mut rollout, 1).unwrap_err();
    assert!(
        err.message()
            .contains("collective weight sync needs CUDA + NCCL; use weight_sync=file"),
        "{err}"
    );
    assert!(posts(&mock).is_empty(), "{:?}", posts(&mock));
    rollout
        .generate(&GenerateRequest::new(vec![vec![5]], sampling(1)))
        .unwrap();
}

#[test]
fn collective_mode_takes_the_naive_syncs_tensors() {
    let log = Arc::new(Mutex::new(TransferLog::default()));
    let mock = distributed_mock(Arc::new(Mutex::new("default".into())), Arc::clone(&log));
    let mut rollout = collective_rollout(&[&mock], &log, None);
    let dir = weights_dir();
    let handover = file_handover(dir.path());
    let err = rollout
        .update_weights(&file_source(1, &handover))
        .unwrap_err();
    assert!(
        err.message().contains("checkpoint_engine.backend=naive"),
        "{err}"
    );
    assert!(posts(&mock).is_empty());
}
