//! The `sglang` rollout against SGLang's protocol as SGLang's own code defines it: the test server
//! `tests/fixtures/sglang-protocol/server.py` parses every request with the request classes of the
//! installed `sglang` package (`scripts/setup-sglang-protocol.sh`) and answers in SGLang's shapes,
//! generating with transformers on the vLLM plugin's tiny Qwen2 fixture. A real SGLang server
//! cannot run on a CPU. The plugin starts the test server itself (its `command`), as it would start
//! `sglang.launch_server`, so SGLang's own argument parser reads the plugin's command line too.
//!
//! The servers take turns with the vLLM tests' (one lock).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use verl_testkit::host::RolloutHandle;

use crate::helpers::*;
use crate::vllm::{
    alone, assert_same, assert_seeded_sampling, fixture, generate, greedy_request, load_step_7,
    prompt_flags, rollout_of, start_server_of, zombie,
};

/// The Python of `scripts/setup-sglang-protocol.sh`.
fn python() -> PathBuf {
    let dir = std::env::var_os("VERL_SGLANG_PROTOCOL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").expect("HOME is set"))
                .join(".cache/verl-core/sglang-protocol")
        });
    let python = dir.join("venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/setup-sglang-protocol.sh (after scripts/setup-vllm.sh)",
        python.display()
    );
    python
}

fn rollout(section: Value) -> RolloutHandle {
    rollout_of("sglang", section)
}

/// A test server started by the plugin (logs in `logs`), attachable at the URL returned; it stops
/// when the rollout is dropped.
fn start_server(logs: &Path) -> (RolloutHandle, String) {
    let server = workspace_root().join("tests/fixtures/sglang-protocol/server.py");
    start_server_of(
        "sglang",
        json!({"command": [python(), server], "log_dir": logs}),
    )
}

fn greedy_args(flags: &[String]) -> Vec<&str> {
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--greedy", "--max-new-tokens", "16"]);
    args
}

#[test]
fn generate_matches_the_native_rollout() {
    let _alone = alone();
    let logs = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(logs.path());
    let url = url.as_str();
    let flags = prompt_flags();
    let args = greedy_args(&flags);
    let (native, _) = generate("native", None, &fixture(), &args);
    let (sglang, took) = generate("sglang", Some(url), &fixture(), &args);
    eprintln!(
        "sglang tests: `generate` of 4 prompts × 16 tokens (attached): {:.2} s",
        took.as_secs_f64()
    );
    assert_same(&sglang, &native, "greedy");

    assert_seeded_sampling("sglang", url, &args);
}

#[test]
fn after_a_reload_the_output_equals_native_on_the_new_weights() {
    let _alone = alone();
    let work = tempfile::tempdir().unwrap();
    let (mut trainer_side, url) = start_server(&work.path().join("logs"));
    let mut bystander = rollout(json!({"urls": [url]}));
    let model = load_step_7(
        &mut trainer_side,
        work.path(),
        "sglang tests: weight sync by /update_weights_from_disk",
    );

    let flags = prompt_flags();
    let args = greedy_args(&flags);
    let out = trainer_side.generate(&greedy_request(16)).unwrap();
    assert_eq!(out.weight_version, Some(7));
    let (native, _) = generate("native", None, &model, &args);
    assert_same(&as_json(&out.completions), &native, "after the reload");
    let (original, _) = generate("native", None, &fixture(), &args);
    assert_ne!(native, original, "the perturbation changed nothing");
    // Attached, the CLI sees the version the server reports and generates from it.
    let (attached, _) = generate("sglang", Some(&url), &model, &args);
    assert_same(
        &attached,
        &native,
        "a new rollout attached after the reload",
    );

    // A rollout that did not load step 7 refuses to generate from it.
    let err = bystander.generate(&greedy_request(4)).unwrap_err();
    assert!(
        err.message()
            .contains("holds weights of version `7`, not `default`")
            && err
                .message()
                .contains("refusing to generate with stale weights"),
        "{err}"
    );
}

fn as_json(completions: &[verl_plugin_api::Completion]) -> Value {
    completions
        .iter()
        .map(|c| {
            json!({"prompt_index": c.prompt_index, "response_ids": c.response_ids,
                "logprobs": c.logprobs, "finish_reason": c.finish_reason.as_str()})
        })
        .collect()
}

/// The pid the test server prints in its log (`... (pid N)`).
fn server_pid(log: &Path) -> libc::pid_t {
    let text = std::fs::read_to_string(log).unwrap();
    text.split("(pid ")
        .nth(1)
        .and_then(|rest| rest.split(')').next()?.parse().ok())
        .filter(|&pid| pid > 1)
        .unwrap_or_else(|| panic!("no pid in {}:\n{text}", log.display()))
}

#[test]
fn a_server_killed_mid_generation_is_restarted_with_its_weights_and_no_sample_is_lost_or_doubled() {
    let _alone = alone();
    let work = tempfile::tempdir().unwrap();
    let logs = work.path().join("logs");
    let (mut rollout, _url) = start_server(&logs);
    let model = load_step_7(
        &mut rollout,
        work.path(),
        "sglang tests: weight sync by /update_weights_from_disk",
    );
    let first_log = std::fs::read_dir(&logs)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "log"))
        .unwrap();
    let pid = server_pid(&first_log);

    // 64 prompts (the fixture's 4, 16 times) served one at a time: the kill lands mid-way.
    let mut long = greedy_request(16);
    long.prompts = long.prompts.iter().cycle().take(64).cloned().collect();
    let log = first_log.clone();
    let killer = std::thread::spawn(move || {
        // Once 8 requests are answered: some complete, the others in flight or waiting.
        let deadline = Instant::now() + Duration::from_secs(120);
        while std::fs::read_to_string(&log)
            .unwrap()
            .matches("answered ")
            .count()
            < 8
        {
            assert!(Instant::now() < deadline, "no 8 answers within 120 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        // The whole group. Not with procps' `kill`: 4.0.2 misparses a group id.
        // SAFETY: signals the server's own process group; no memory is involved.
        assert_eq!(unsafe { libc::kill(-pid, libc::SIGKILL) }, 0, "kill -{pid}");
    });
    let begin = Instant::now();
    let out = rollout
        .generate(&long)
        .unwrap_or_else(|e| panic!("the call did not survive the kill: {e}"));
    killer.join().unwrap();
    eprintln!(
        "sglang tests: 64 prompts with a kill and a restart: {:.1} s",
        begin.elapsed().as_secs_f64()
    );
    let restart_log = first_log.with_file_name(format!(
        "{}.restart-1.log",
        first_log.file_stem().unwrap().to_string_lossy()
    ));
    assert!(restart_log.exists(), "no restart");
    let answered_before = std::fs::read_to_string(&first_log)
        .unwrap()
        .matches("answered ")
        .count();
    assert!(
        (8..64).contains(&answered_before),
        "{answered_before} answered before the kill"
    );

    // Exactly one completion per prompt, in order, each equal to native's on step 7's weights:
    // the restarted server got them back.
    assert_eq!(out.weight_version, Some(7));
    let indices: Vec<u32> = out.completions.iter().map(|c| c.prompt_index).collect();
    assert_eq!(indices, (0..64).collect::<Vec<u32>>());
    let flags = prompt_flags();
    let (native, _) = generate("native", None, &model, &greedy_args(&flags));
    let native = native.as_array().unwrap();
    let want: Vec<Value> = (0..64)
        .map(|i| {
            let mut c = native[i % 4].clone();
            c["prompt_index"] = json!(i);
            c
        })
        .collect();
    assert_same(
        &as_json(&out.completions),
        &Value::Array(want),
        "after the restart",
    );
    // The allowance (max_restarts 1) is spent: another death is an error naming the log.
    let pid = server_pid(&restart_log);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(-pid, libc::SIGKILL) }, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() && !zombie(pid as u32) {
        assert!(Instant::now() < deadline, "the server survived SIGKILL");
        std::thread::sleep(Duration::from_millis(20));
    }
    let err = rollout.generate(&greedy_request(2)).unwrap_err();
    assert!(
        err.message().contains("max_restarts")
            && err.message().contains(&restart_log.display().to_string()),
        "{err}"
    );
}
