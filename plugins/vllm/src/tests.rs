//! The plugin against a mock of vLLM's HTTP API (answers in vLLM 0.32's shapes, as recorded from
//! the real server): request bodies, answer parsing, the reload sequence, stale weights, config.

use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use verl_plugin_api::{ComponentInit, GenerateRequest, Rollout, RunContext, WeightSource};
use verl_rollout_http::mock::{MockServer, Recorded, Reply};
use verl_rollout_http::testing::{self, Backend, file_handover, flag, init, sampling, weights_dir};

use super::*;

/// A vLLM server's answers; `version` is what `/weight_info` reports.
fn vllm_mock(version: Arc<Mutex<String>>) -> MockServer {
    MockServer::start(move |r: &Recorded| vllm_reply(&version, r))
}

/// A vLLM server's answer to `r`.
fn vllm_reply(version: &Mutex<String>, r: &Recorded) -> Reply {
    match r.path.split('?').next().unwrap() {
        "/health" => Reply::ok(Value::Null),
        "/v1/models" => Reply::ok(
            json!({"object": "list", "data": [{"id": "served", "object": "model", "root": "/m"}]}),
        ),
        "/weight_info" => Reply::ok(json!({"weight_version": *version.lock().unwrap()})),
        "/update_weight_version" => {
            *version.lock().unwrap() = r.body["new_version"].as_str().unwrap().to_owned();
            Reply::ok(json!({"success": true}))
        }
        "/pause" => Reply::ok(json!({"status": "paused"})),
        "/sleep" => Reply::ok(json!({"status": "sleeping", "level": 1})),
        "/wake_up" => Reply::ok(json!({"status": "awake", "tags": null})),
        "/resume" => Reply::ok(json!({"status": "resumed"})),
        "/collective_rpc" if r.body["method"] == EXTENSION_RELOAD => {
            Reply::ok(json!({"results": [{"refreshed": ["lm_head"], "stale": []}]}))
        }
        "/reset_prefix_cache" | "/collective_rpc" => Reply::Text(200, String::new()),
        "/v1/completions" => Reply::ok(completion(&r.body)),
        _ => Reply::Json(404, json!({"detail": "Not Found"})),
    }
}

/// The control requests (not generation) `mock` received, in order.
fn control(mock: &MockServer) -> Vec<(String, Value)> {
    mock.requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.path != "/v1/completions")
        .map(|r| (r.path, r.body))
        .collect()
}

/// vLLM's answer for `body`: sample `j` continues with `first prompt id + j`, then stops with
/// the last stop id if there is one (`finish_reason` "stop", `stop_reason` the id).
fn completion(body: &Value) -> Value {
    let first = body["prompt"][0].as_u64().unwrap();
    let stop = body["stop_token_ids"]
        .as_array()
        .and_then(|s| s.last())
        .cloned();
    let choices: Vec<Value> = (0..body["n"].as_u64().unwrap())
        .map(|j| {
            let mut ids = vec![json!(first + j)];
            if let Some(stop) = &stop {
                ids.push(stop.clone());
            }
            let lps: Vec<f64> = (0..ids.len()).map(|t| -0.25 * (t + 1) as f64).collect();
            json!({
                "index": j, "text": "xy",
                "logprobs": {"text_offset": [0, 1], "token_logprobs": lps, "tokens": ["x", "y"], "top_logprobs": [{"x": -0.25}, {"y": -0.5}]},
                "finish_reason": if stop.is_some() { "stop" } else { "length" },
                "stop_reason": stop,
                "token_ids": ids, "prompt_logprobs": null, "prompt_token_ids": body["prompt"], "routed_experts": null,
            })
        })
        .collect();
    json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "served", "choices": choices,
           "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}})
}

/// The shared suite's view of this backend.
struct Vllm;

impl Backend for Vllm {
    type Rollout = VllmRollout;
    const NAME: &'static str = "vllm";
    const MISSPELLED: (&'static str, &'static str) = ("kv_cache_space", "kv_cache_space_gib");
    fn mock(version: Arc<Mutex<String>>) -> MockServer {
        vllm_mock(version)
    }
    const GENERATE: &'static str = "/v1/completions";
    const LOAD: (&'static str, &'static str) = ("/collective_rpc", "/kwargs/weights_path");
}

verl_rollout_http::backend_tests!(super::Vllm);

fn attached(mock: &MockServer) -> VllmRollout {
    testing::attached::<Vllm>(&[mock])
}

#[test]
fn requests_carry_every_sampling_setting_in_vllms_names() {
    let mock = vllm_mock(Arc::new(Mutex::new("default".into())));
    let mut rollout = attached(&mock);
    rollout
        .generate(&GenerateRequest::new(vec![vec![5, 6, 7]], sampling(2)))
        .unwrap();
    let sent = mock.requests_to("/v1/completions");
    assert_eq!(sent.len(), 1);
    let body = &sent[0].body;
    let want = json!({
        "model": "served", "prompt": [5, 6, 7], "n": 2, "max_tokens": 8,
        "temperature": 0.7f32, "top_p": 0.9f32, "top_k": 0, "min_p": 0.0,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "seed": verl_rollout_http::prompt_seed(11, 0), "stop_token_ids": [9], "ignore_eos": false,
        "logprobs": 0, "return_token_ids": true,
    });
    assert_eq!(body, &want);

    // Greedy: temperature 0 and no filtering, whatever else the request says.
    let mut greedy = sampling(1);
    greedy.greedy = true;
    greedy.top_k = 20;
    rollout
        .generate(&GenerateRequest::new(vec![vec![5]], greedy))
        .unwrap();
    let body = &mock.requests_to("/v1/completions")[1].body;
    assert_eq!(
        (&body["temperature"], &body["top_p"], &body["top_k"]),
        (&json!(0.0), &json!(1.0), &json!(0))
    );
}

#[test]
fn per_prompt_seeds_seed_each_prompt_whatever_the_split() {
    let mock = vllm_mock(Arc::new(Mutex::new("default".into())));
    let mut rollout = attached(&mock);
    assert!(VllmRollout::capabilities().prompt_seeds);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| vec![10 + i]).collect();
    let seeds = vec![u64::MAX, 7, 7, 1 << 40];
    let seed_by_prompt = |mock: &MockServer, from: usize| -> Vec<(Value, Value)> {
        let mut sent: Vec<(Value, Value)> = mock.requests_to("/v1/completions")[from..]
            .iter()
            .map(|r| (r.body["prompt"].clone(), r.body["seed"].clone()))
            .collect();
        sent.sort_by_key(|(p, _)| p.to_string());
        sent
    };
    rollout
        .generate(&GenerateRequest::new(prompts.clone(), sampling(2)).with_seeds(seeds.clone()))
        .unwrap();
    let whole = seed_by_prompt(&mock, 0);
    for range in [0..1, 1..4] {
        rollout
            .generate(
                &GenerateRequest::new(prompts[range.clone()].to_vec(), sampling(2))
                    .with_seeds(seeds[range].to_vec()),
            )
            .unwrap();
    }
    assert_eq!(seed_by_prompt(&mock, 4), whole, "a split changed the seeds");
    // The prompt's own seed, in vLLM's i64 range, not the request's: equal seeds, equal seeds.
    assert_eq!(whole[0].1, json!(u64::MAX >> 1));
    assert_eq!(whole[1].1, whole[2].1);
    assert!(
        whole
            .iter()
            .all(|(_, s)| s.as_u64().unwrap() <= i64::MAX as u64)
    );

    let err = rollout
        .generate(&GenerateRequest::new(prompts, sampling(1)).with_seeds(vec![1]))
        .unwrap_err();
    assert!(
        err.message().contains("1 per-prompt seeds for 4 prompts"),
        "{err}"
    );
}

#[test]
fn malformed_answers_name_the_prompt_and_the_field() {
    let p = Completions {
        model: "m".into(),
        ignore_eos: false,
    };
    let mut answer = completion(&json!({"prompt": [1], "n": 1, "stop_token_ids": []}));
    answer["choices"][0]["logprobs"]["token_logprobs"] = json!([-1.0, -2.0]);
    assert!(
        p.samples(&answer)
            .unwrap_err()
            .contains("2 log-probs for 1 tokens")
    );
    answer["choices"][0]["logprobs"]["token_logprobs"] = json!([null]);
    assert!(
        p.samples(&answer)
            .unwrap_err()
            .contains("token 0 has no log-prob")
    );
    answer["choices"][0]["token_ids"] = Value::Null;
    assert!(p.samples(&answer).unwrap_err().contains("`token_ids`"));
    assert!(
        p.samples(&json!({"object": "error"}))
            .unwrap_err()
            .contains("no `choices`")
    );
}

#[test]
fn a_reload_runs_vllms_sequence_and_tags_the_version() {
    let version = Arc::new(Mutex::new("default".to_owned()));
    let mock = vllm_mock(version.clone());
    let mut rollout = attached(&mock);
    let dir = weights_dir();
    let handover = file_handover(dir.path());
    rollout
        .update_weights(&WeightSource::from_handover(4, &[], &handover))
        .unwrap();
    assert_eq!(
        control(&mock),
        [
            ("/pause?mode=wait".to_owned(), Value::Null),
            (
                "/collective_rpc".to_owned(),
                json!({"method": "verl_reload_weights", "kwargs": {"weights_path": dir.path()}})
            ),
            ("/reset_prefix_cache".to_owned(), Value::Null),
            (
                "/update_weight_version".to_owned(),
                json!({"new_version": "4"})
            ),
            ("/resume".to_owned(), Value::Null),
        ]
    );
    let out = rollout
        .generate(&GenerateRequest::new(vec![vec![1]], sampling(1)))
        .unwrap();
    assert_eq!(out.weight_version, Some(4));
}

#[test]
fn a_server_without_the_extension_is_reloaded_with_vllms_own_reload() {
    let version = Arc::new(Mutex::new("default".to_owned()));
    let held = version.clone();
    // vLLM 0.32's answer when its workers lack the method; everything else as the plain mock.
    let mock = MockServer::start(move |r: &Recorded| {
        if r.path == "/collective_rpc" && r.body["method"] == EXTENSION_RELOAD {
            return Reply::Json(
                500,
                json!({"error": {"message": "Call to collective_rpc method failed: Worker failed with error ''CPUWorker' object has no attribute 'verl_reload_weights'', please check the stack trace above for the root cause", "type": "InternalServerError", "code": 500}}),
            );
        }
        vllm_reply(&held, r)
    });
    let mut rollout = attached(&mock);
    let dir = weights_dir();
    let handover = file_handover(dir.path());
    for step in [1, 2] {
        rollout
            .update_weights(&WeightSource::from_handover(step, &[], &handover))
            .unwrap();
    }
    let methods: Vec<Value> = mock
        .requests_to("/collective_rpc")
        .into_iter()
        .map(|r| r.body["method"].clone())
        .collect();
    // The extension is asked once; vLLM's reload loads both steps.
    assert_eq!(
        methods,
        ["verl_reload_weights", "reload_weights", "reload_weights"]
    );
    assert_eq!(*version.lock().unwrap(), "2");
    let out = rollout
        .generate(&GenerateRequest::new(vec![vec![1]], sampling(1)))
        .unwrap();
    assert_eq!(out.weight_version, Some(2));
}

#[test]
fn stale_kernels_after_a_reload_stop_an_attached_server_from_generating() {
    let version = Arc::new(Mutex::new("default".to_owned()));
    let held = version.clone();
    let mock = MockServer::start(move |r: &Recorded| {
        if r.path == "/collective_rpc" {
            return Reply::ok(
                json!({"results": [{"refreshed": ["lm_head"], "stale": ["lm_head"]}]}),
            );
        }
        vllm_reply(&held, r)
    });
    let mut rollout = attached(&mock);
    let dir = weights_dir();
    let err = rollout
        .update_weights(&WeightSource::from_handover(
            5,
            &[],
            &file_handover(dir.path()),
        ))
        .unwrap_err();
    assert!(
        err.message().contains("left stale weights")
            && err.message().contains("lm_head")
            && err.message().contains(mock.url()),
        "{err}"
    );
    // Not tagged with the step, resumed, and generation refused.
    assert_eq!(*version.lock().unwrap(), "default");
    assert_eq!(mock.requests_to("/resume").len(), 1);
    let err = rollout
        .generate(&GenerateRequest::new(vec![vec![1]], sampling(1)))
        .unwrap_err();
    assert!(err.message().contains("refusing to generate"), "{err}");
}

#[test]
fn a_failed_reload_resumes_the_server_and_blocks_generation() {
    let mock = MockServer::start(|r: &Recorded| match r.path.split('?').next().unwrap() {
        "/collective_rpc" => Reply::Json(
            500,
            json!({"error": {"message": "FileNotFoundError: no safetensors in /gone", "type": "InternalServerError", "code": 500}}),
        ),
        "/weight_info" => Reply::ok(json!({"weight_version": "default"})),
        "/v1/models" => Reply::ok(json!({"data": [{"id": "served"}]})),
        _ => Reply::ok(json!({})),
    });
    let mut rollout = attached(&mock);
    let dir = weights_dir();
    let handover = file_handover(dir.path());
    let err = rollout
        .update_weights(&WeightSource::from_handover(3, &[], &handover))
        .unwrap_err();
    assert!(err.message().contains("no safetensors in /gone"), "{err}");
    assert_eq!(
        mock.requests_to("/resume").len(),
        1,
        "the server was left paused"
    );
    let err = rollout
        .generate(&GenerateRequest::new(vec![vec![1]], sampling(1)))
        .unwrap_err();
    assert!(err.message().contains("refusing to generate"), "{err}");
}

#[test]
fn a_server_without_dev_mode_is_explained() {
    let mock = MockServer::start(|r: &Recorded| match r.path.as_str() {
        "/weight_info" => Reply::Json(404, json!({"detail": "Not Found"})),
        _ => Reply::ok(json!({"data": [{"id": "served"}]})),
    });
    let mut rollout = VllmRollout::default();
    let err = rollout
        .init(&init::<Vllm>(json!({"urls": [mock.url()]})))
        .unwrap_err();
    assert!(err.message().contains("VLLM_SERVER_DEV_MODE=1"), "{err}");
}

fn launch_of(rollout: Value, section: Value, device: &str) -> Launch {
    let mut run = RunContext::default();
    run.device_type = device.into();
    run.run_dir = "/runs/r1".into();
    run.seed = 5;
    let mut config = rollout;
    config["engine_kwargs"] = json!({"vllm": section.clone()});
    let init = ComponentInit::new(config, run);
    let keys: RolloutKeys = init.config("vllm").unwrap();
    let (server, vllm): (ServerSettings, VllmSettings) =
        verl_plugin_api::config::parse_section2(SECTION, &section.to_string(), "").unwrap();
    launch(&init, &keys, &server, &vllm, "verl-rollout", 8123).unwrap()
}

#[test]
fn a_started_server_follows_verls_rollout_keys() {
    let l = launch_of(
        json!({"model": {"path": "/models/q"}, "dtype": "bfloat16", "prompt_length": 64, "response_length": 32, "enforce_eager": false}),
        json!({"python": "/venv/bin/python", "kv_cache_space_gib": 2, "extra_args": ["--max-num-seqs", "8"], "env": {"VLLM_CPU_OMP_THREADS_BIND": "0", "PYTHONPATH": "/mine"}}),
        "cpu",
    );
    assert_eq!(l.program, PathBuf::from("/venv/bin/python"));
    assert_eq!(&l.args[..2], ["-m", SERVER_MODULE]);
    assert_eq!(flag(&l, "--model"), Some("/models/q"));
    assert_eq!(flag(&l, "--port"), Some("8123"));
    assert_eq!(flag(&l, "--dtype"), Some("bfloat16"));
    assert_eq!(flag(&l, "--max-model-len"), Some("96"));
    assert_eq!(flag(&l, "--seed"), Some("5"));
    assert_eq!(flag(&l, "--logprobs-mode"), Some("processed_logprobs"));
    assert!(
        l.args.contains(&"--enforce-eager".to_owned()),
        "always eager on a CPU"
    );
    assert_eq!(&l.args[l.args.len() - 2..], ["--max-num-seqs", "8"]);
    let env: std::collections::HashMap<_, _> = l.env.iter().cloned().collect();
    assert_eq!(env["VLLM_SERVER_DEV_MODE"], "1");
    assert_eq!(env["VLLM_CPU_KVCACHE_SPACE"], "2");
    assert_eq!(env["VLLM_CPU_OMP_THREADS_BIND"], "0");
    assert_eq!(l.log, PathBuf::from("/runs/r1/vllm/server-8123.log"));
    // The worker extension, from beside the log, in front of the configured path.
    assert_eq!(flag(&l, "--worker-extension-cls"), Some(WORKER_EXTENSION));
    assert_eq!(
        l.env
            .iter()
            .rev()
            .find(|(k, _)| k == "PYTHONPATH")
            .unwrap()
            .1,
        "/runs/r1/vllm/python:/mine"
    );

    // The section wins over verl's keys; a GPU run is not forced eager nor given CPU settings.
    let l = launch_of(
        json!({"model": {"path": "/m"}, "dtype": "bfloat16", "max_model_len": 300, "enforce_eager": false}),
        json!({"command": ["vllm", "serve"], "dtype": "float32", "max_model_len": 128}),
        "cuda",
    );
    assert_eq!(l.program, PathBuf::from("vllm"));
    assert_eq!(l.args[0], "serve");
    assert_eq!(flag(&l, "--dtype"), Some("float32"));
    assert_eq!(flag(&l, "--max-model-len"), Some("128"));
    assert!(!l.args.contains(&"--enforce-eager".to_owned()));
    assert!(!l.env.iter().any(|(k, _)| k.starts_with("VLLM_CPU")));

    // Nothing known about lengths or dtype: vLLM's own defaults (the checkpoint's).
    let l = launch_of(
        json!({"model": {"path": "/m"}}),
        json!({"python": "/p"}),
        "cpu",
    );
    assert_eq!(flag(&l, "--dtype"), Some("auto"));
    assert_eq!(flag(&l, "--max-model-len"), None);
}

#[test]
fn the_worker_extension_is_written_where_the_server_looks() {
    let root = tempfile::tempdir().unwrap();
    let launch = Launch {
        name: "vLLM server on 127.0.0.1:1".into(),
        program: "python".into(),
        args: Vec::new(),
        env: Vec::new(),
        log: root.path().join("logs/server-1.log"),
    };
    write_worker_module(&launch).unwrap();
    let written = std::fs::read_to_string(root.path().join("logs/python/verl_vllm_worker.py"));
    assert_eq!(written.unwrap(), WORKER_MODULE_SOURCE);
    let class = WORKER_EXTENSION.rsplit('.').next().unwrap();
    assert!(WORKER_MODULE_SOURCE.contains(&format!("class {class}:")));
    assert!(WORKER_MODULE_SOURCE.contains(&format!("def {EXTENSION_RELOAD}(self, weights_path)")));
}

#[test]
fn a_restart_runs_on_the_original_files_and_the_new_weights() {
    let root = tempfile::tempdir().unwrap();
    let model = root.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    for (file, text) in [
        ("config.json", "{}"),
        ("tokenizer.json", "{}"),
        ("model.safetensors", "old"),
    ] {
        std::fs::write(model.join(file), text).unwrap();
    }
    let handover = root.path().join("weight_sync/step_3");
    std::fs::create_dir_all(&handover).unwrap();
    std::fs::write(handover.join("model.safetensors"), "new").unwrap();
    let launch = Launch {
        name: "vLLM server on 127.0.0.1:1".into(),
        program: "python".into(),
        args: vec![
            "-m".into(),
            SERVER_MODULE.into(),
            "--model".into(),
            model.display().to_string(),
            "--port".into(),
            "1".into(),
        ],
        env: Vec::new(),
        log: root.path().join("logs/server-1.log"),
    };
    let mut restart = Restart {
        launch,
        model: model.clone(),
        current: None,
    };
    let (next, dir) = restart.prepare(&handover, "3").unwrap();
    assert_eq!(dir, root.path().join("logs/weights/step_3"));
    assert_eq!(flag(&next, "--model"), Some(dir.to_str().unwrap()));
    assert_eq!(flag(&next, "--port"), Some("1"));
    assert_eq!(next.log, root.path().join("logs/server-1.step_3.log"));
    assert_eq!(
        std::fs::read_to_string(dir.join("model.safetensors")).unwrap(),
        "new"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("config.json")).unwrap(),
        "{}"
    );
    assert!(
        std::fs::symlink_metadata(dir.join("config.json"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    // The weight sync removes its directory once the update returns: the server's copy stays.
    std::fs::remove_dir_all(&handover).unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.join("model.safetensors")).unwrap(),
        "new"
    );
    restart.committed(dir.clone());
    std::fs::create_dir_all(&handover).unwrap();
    std::fs::write(handover.join("model.safetensors"), "newer").unwrap();
    let (_, dir4) = restart.prepare(&handover, "4").unwrap();
    restart.committed(dir4.clone());
    assert!(
        !dir.exists() && dir4.exists(),
        "the previous step's directory is removed"
    );
}

#[test]
fn restart_needs_a_started_server() {
    let mock = vllm_mock(Arc::new(Mutex::new("default".into())));
    let err = VllmRollout::default()
        .init(&init::<Vllm>(
            json!({"urls": [mock.url()], "reload": "restart"}),
        ))
        .unwrap_err();
    assert!(
        err.message().contains("vllm.reload") && err.message().contains("attached"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// `weight_sync: collective`

use verl_rollout_http::testing::{
    FakeCollective, TransferLog, eventually, lent_tensors, sync_lent,
};

/// A vLLM server with the weight transfer endpoints: `/init_weight_transfer_engine` and
/// `/update_weights` answer only once the trainer's side of them shows in `log` (as the real ones
/// return only when the NCCL collective they wait in has run), `/finish_weight_update` sets the
/// version.
fn transfer_mock(version: Arc<Mutex<String>>, log: Arc<Mutex<TransferLog>>) -> MockServer {
    let updates = std::sync::atomic::AtomicUsize::new(0);
    MockServer::start(move |r: &Recorded| match r.path.as_str() {
        "/init_weight_transfer_engine" => {
            if eventually(|| !log.lock().unwrap().joins.is_empty()) {
                Reply::ok(json!({"message": "Weight transfer initialized"}))
            } else {
                Reply::Json(500, json!({"error": "the trainer never joined the group"}))
            }
        }
        "/update_weights" => {
            // This server's k-th update receives the trainer's k-th broadcast.
            let k = updates.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            if eventually(|| log.lock().unwrap().sends.len() >= k) {
                Reply::ok(json!({"message": "Weights updated"}))
            } else {
                Reply::Json(500, json!({"error": "no broadcast from the trainer"}))
            }
        }
        "/start_weight_update" => Reply::ok(json!({"message": "Weight update started"})),
        "/finish_weight_update" => {
            if let Some(v) = r.body["weight_version"].as_str() {
                *version.lock().unwrap() = v.to_owned();
            }
            Reply::ok(json!({"message": "Weight update finished"}))
        }
        _ => vllm_reply(&version, r),
    })
}

/// A rollout in collective mode attached to `mocks`, its transport recording into the log it
/// returns.
fn collective_rollout(
    mocks: &[&MockServer],
    log: &Arc<Mutex<TransferLog>>,
    fail_send: Option<&str>,
) -> VllmRollout {
    let fake = FakeCollective {
        log: Arc::clone(log),
        fail_send: fail_send.map(str::to_owned),
    };
    let mut rollout = VllmRollout::with_transport(move || Box::new(fake.clone()));
    let urls: Vec<&str> = mocks.iter().map(|m| m.url()).collect();
    rollout
        .init(&init::<Vllm>(json!({
            "urls": urls, "startup_timeout_s": 5, "weight_sync": "collective",
            "collective": {"master_addr": "127.0.0.1", "master_port": 29517, "workers_per_server": 2},
        })))
        .unwrap();
    rollout
}

#[test]
fn a_collective_sync_runs_vllms_weight_transfer_sequence_on_every_server() {
    let log = Arc::new(Mutex::new(TransferLog::default()));
    let mocks: Vec<MockServer> = (0..2)
        .map(|_| transfer_mock(Arc::new(Mutex::new("default".into())), Arc::clone(&log)))
        .collect();
    let mut rollout = collective_rollout(&[&mocks[0], &mocks[1]], &log, None);
    sync_lent(&mut rollout, 7).unwrap();
    sync_lent(&mut rollout, 8).unwrap();

    // One group: the trainer and 2 × 2 workers; server i's workers start at 1 + 2i.
    let log = log.lock().unwrap();
    assert_eq!(log.joins.len(), 1, "{:?}", log.joins);
    assert_eq!(log.joins[0].world_size, 5);
    assert_eq!(log.joins[0].rank_offsets, [1, 3]);
    assert_eq!(log.joins[0].master_port, 29517);
    // Each sync broadcast the lent tensors as they are, in order.
    let lent = lent_tensors();
    assert_eq!(log.sends.len(), 2);
    for sent in &log.sends {
        let names: Vec<&str> = sent.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["model.embed_tokens.weight", "model.counts"]);
        assert_eq!(sent[0].data, lent[0].tensor.data.to_vec());
        assert_eq!(sent[1].shape, [2]);
    }

    let update = json!({"update_info": {
        "names": ["model.embed_tokens.weight", "model.counts"],
        "dtype_names": ["float32", "int64"], "shapes": [[2, 3], [2]],
    }});
    for (i, mock) in mocks.iter().enumerate() {
        let init = json!({"init_info": {
            "master_address": "127.0.0.1", "master_port": 29517, "rank_offset": 1 + 2 * i,
            "world_size": 5, "packed": false,
        }});
        let step = |v: &str| {
            vec![
                ("/pause?mode=wait".to_owned(), Value::Null),
                ("/start_weight_update".to_owned(), Value::Null),
                ("/update_weights".to_owned(), update.clone()),
                (
                    "/finish_weight_update".to_owned(),
                    json!({"weight_version": v}),
                ),
                ("/reset_prefix_cache".to_owned(), Value::Null),
                ("/resume".to_owned(), Value::Null),
            ]
        };
        let mut want = vec![("/init_weight_transfer_engine".to_owned(), init)];
        want.extend(step("7"));
        want.extend(step("8"));
        assert_eq!(control(mock), want, "server {i}");
    }
    drop(log);
    // The servers report step 8: generation goes on, tagged with it.
    let out = rollout
        .generate(&GenerateRequest::new(vec![vec![5, 6]], sampling(1)))
        .unwrap();
    assert_eq!(out.weight_version, Some(8));
}

#[test]
fn a_failed_broadcast_resumes_the_servers_and_blocks_generation() {
    let log = Arc::new(Mutex::new(TransferLog::default()));
    let version = Arc::new(Mutex::new("default".to_owned()));
    let mock = transfer_mock(Arc::clone(&version), Arc::clone(&log));
    let mut rollout =
        collective_rollout(&[&mock], &log, Some("NCCL error 6: remote process exited"));
    // The server's side of the broadcast never completes either.
    let err = sync_lent(&mut rollout, 3).unwrap_err();
    assert!(err.message().contains("remote process exited"), "{err}");
    let paths: Vec<String> = control(&mock).into_iter().map(|(p, _)| p).collect();
    assert_eq!(
        paths.last().map(String::as_str),
        Some("/resume"),
        "{paths:?}"
    );
    assert!(
        !paths.iter().any(|p| p == "/finish_weight_update"),
        "{paths:?}"
    );
    // Half-sent weights: no generation from them.
    let err = rollout
        .generate(&GenerateRequest::new(vec![vec![5]], sampling(1)))
        .unwrap_err();
    assert!(
        err.message().contains("refusing to generate with stale"),
        "{err}"
    );
}

#[test]
fn without_a_transport_the_collective_sync_stops_before_any_server_is_asked() {
    let version = Arc::new(Mutex::new("default".to_owned()));
    let mock = vllm_mock(Arc::clone(&version));
    // The default build's transport: no `collective` feature.
    let mut rollout = VllmRollout::default();
    rollout
        .init(&init::<Vllm>(
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
    assert!(control(&mock).is_empty(), "{:?}", control(&mock));
    // The servers hold what they held: generation goes on.
    rollout
        .generate(&GenerateRequest::new(vec![vec![5]], sampling(1)))
        .unwrap();
}

#[test]
fn collective_mode_takes_the_naive_syncs_tensors_and_file_mode_the_disk_syncs_files() {
    let log = Arc::new(Mutex::new(TransferLog::default()));
    let mock = transfer_mock(Arc::new(Mutex::new("default".into())), Arc::clone(&log));
    let mut rollout = collective_rollout(&[&mock], &log, None);
    let dir = weights_dir();
    let handover = file_handover(dir.path());
    let err = rollout
        .update_weights(&WeightSource::from_handover(1, &[], &handover))
        .unwrap_err();
    assert!(
        err.message().contains("checkpoint_engine.backend=naive"),
        "{err}"
    );
    assert!(control(&mock).is_empty());

    let mut file_mode = attached(&mock);
    let err = sync_lent(&mut file_mode, 1).unwrap_err();
    assert!(
        err.message().contains("checkpoint_engine.backend=disk"),
        "{err}"
    );
    assert!(err.message().contains("weight_sync: collective"), "{err}");
}

#[test]
fn a_started_server_in_collective_mode_gets_vllms_weight_transfer_config() {
    let model = json!({"model": {"path": "/models/q"}});
    let section = json!({"python": "/venv/bin/python", "weight_sync": "collective"});
    let launch = launch_of(model.clone(), section, "cuda");
    assert_eq!(
        flag(&launch, "--weight-transfer-config"),
        Some(r#"{"backend":"nccl"}"#)
    );
    let launch = launch_of(model, json!({"python": "/venv/bin/python"}), "cuda");
    assert_eq!(flag(&launch, "--weight-transfer-config"), None);
    // Restarts load files, which a collective sync does not write.
    let mut rollout = VllmRollout::default();
    let err = rollout
        .init(&init::<Vllm>(
            json!({"weight_sync": "collective", "reload": "restart",
            "command": ["/bin/false"]}),
        ))
        .unwrap_err();
    assert!(err.message().contains("sends no files"), "{err}");
}

/// A rollout attached to `mocks` on a `device` whose rollout section adds `rollout`.
fn attached_on(mocks: &[&MockServer], device: &str, rollout: Value) -> VllmRollout {
    let mut init = init::<Vllm>(json!({"urls": mocks.iter().map(|m| m.url()).collect::<Vec<_>>()}));
    init.run.device_type = device.into();
    for (k, v) in rollout.as_object().unwrap() {
        init.config[k] = v.clone();
    }
    let mut r = VllmRollout::default();
    r.init(&init).unwrap();
    r
}

#[test]
fn sleep_and_wake_run_vllms_sequence_on_every_server_and_block_work_between() {
    let (a, b) = (
        vllm_mock(Arc::new(Mutex::new("default".into()))),
        vllm_mock(Arc::new(Mutex::new("default".into()))),
    );
    let mut rollout = attached_on(&[&a, &b], "cuda", json!({}));
    rollout.sleep(1).unwrap();
    let asleep = rollout
        .generate(&GenerateRequest::new(vec![vec![1]], sampling(1)))
        .unwrap_err();
    assert!(asleep.message().contains("wake_up"), "{asleep}");
    let dir = weights_dir();
    let handover = file_handover(dir.path());
    let asleep = rollout
        .update_weights(&WeightSource::from_handover(2, &[], &handover))
        .unwrap_err();
    assert!(asleep.message().contains("wake_up"), "{asleep}");
    rollout.wake_up().unwrap();
    for mock in [&a, &b] {
        assert_eq!(
            control(mock),
            [
                ("/sleep?level=1&mode=wait".to_owned(), Value::Null),
                ("/wake_up".to_owned(), Value::Null),
                ("/reset_prefix_cache".to_owned(), Value::Null),
            ]
        );
    }
    rollout
        .generate(&GenerateRequest::new(vec![vec![1]], sampling(1)))
        .unwrap();
    assert!(rollout.sleep(3).is_err(), "vLLM has levels 0-2");
    assert!(VllmRollout::capabilities().sleep_wake);
}

#[test]
fn a_server_not_fully_awake_is_an_error_naming_it() {
    let mock = MockServer::start(|r: &Recorded| match r.path.as_str() {
        "/wake_up" => Reply::ok(json!({"status": "sleeping", "tags": ["weights"]})),
        _ => vllm_reply(&Mutex::new("default".into()), r),
    });
    let mut rollout = attached_on(&[&mock], "cuda", json!({}));
    rollout.sleep(1).unwrap();
    let err = rollout.wake_up().unwrap_err();
    assert!(
        err.message().contains(mock.url()) && err.message().contains("not fully awake"),
        "{err}"
    );
}

#[test]
fn without_sleep_mode_sleep_and_wake_call_nothing() {
    let mock = vllm_mock(Arc::new(Mutex::new("default".into())));
    let mut rollout = attached_on(&[&mock], "cuda", json!({"enable_sleep_mode": false}));
    rollout.sleep(1).unwrap();
    rollout.wake_up().unwrap();
    assert!(control(&mock).is_empty(), "{:?}", control(&mock));
}

#[test]
fn a_started_gpu_server_runs_in_sleep_mode_unless_told_not_to() {
    let sleep_mode = |rollout: Value, device: &str| {
        launch_of(rollout, json!({"python": "/p"}), device)
            .args
            .contains(&"--enable-sleep-mode".to_owned())
    };
    assert!(sleep_mode(json!({"model": {"path": "/m"}}), "cuda"));
    assert!(!sleep_mode(
        json!({"model": {"path": "/m"}, "enable_sleep_mode": false}),
        "cuda"
    ));
    // vLLM refuses the flag on its CPU backend.
    assert!(!sleep_mode(json!({"model": {"path": "/m"}}), "cpu"));
}
