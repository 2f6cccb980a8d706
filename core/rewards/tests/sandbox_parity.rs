//! The SandboxFusion code reward against verl's own `sandbox_fusion.compute_score` on the same
//! inputs (`data/verl_sandbox_reference.json`, made by `scripts/reference/sandbox_reference.py`
//! from a verl checkout against `scripts/fake_sandbox_fusion.py`): this test starts the same fake
//! server (system `python3`, standard library; `g++` for the C++ checks) and requires every
//! sample's score and every case's status to equal verl's. The client's request and response
//! structs are checked against SandboxFusion's schema (`data/sandbox_fusion_schema.json`,
//! extracted from SandboxFusion's source by `scripts/reference/sandbox_schema.py`), and the
//! error paths (unreachable server, HTTP 500 and 504, malformed answers, bad test cases) against
//! verl's behaviour.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use serde_json::{Value, json};
use verl_plugin_api::{ComponentInit, Reward, RewardItem, RewardRequest};
use verl_rewards::sandbox::api::{
    CommandRunResult, CommandRunStatus, RunCodeRequest, RunCodeResponse, RunStatus,
};
use verl_rewards::sandbox::{Check, CodeScore, Sandbox, Task, TestCases, Verdict};
use verl_rewards::{RuleReward, ground_truth_value};
use verl_schema::SandboxFusionConfig;

const REFERENCE: &str = include_str!("data/verl_sandbox_reference.json");
const SCHEMA: &str = include_str!("data/sandbox_fusion_schema.json");

/// The fake SandboxFusion server, stopped on drop.
struct FakeServer {
    child: Child,
    base: String,
}

impl FakeServer {
    fn start() -> Self {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../scripts/fake_sandbox_fusion.py"
        );
        let mut child = Command::new("python3")
            .args([script, "--port", "0"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 runs the fake SandboxFusion server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the server's first line");
        let base = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_owned();
        Self { child, base }
    }

    fn sandbox(&self, path: &str, max_concurrent: usize, memory_limit_mb: i64) -> Sandbox {
        sandbox_at(
            &format!("{}{path}", self.base),
            max_concurrent,
            memory_limit_mb,
        )
    }

    /// `GET path`'s answer: `/requests` (per path), `/max_in_flight`.
    fn get(&self, path: &str) -> Value {
        let mut response = ureq::get(&format!("{}{path}", self.base))
            .call()
            .expect("a GET");
        serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap()
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sandbox_at(url: &str, max_concurrent: usize, memory_limit_mb: i64) -> Sandbox {
    Sandbox::from_config(&SandboxFusionConfig {
        url: Some(url.to_owned()),
        max_concurrent,
        memory_limit_mb,
    })
    .expect("a valid config")
    .expect("a sandbox")
}

/// verl's metadata as the reference script flattens it: each entry's `status`, or the `error`
/// of its error-only entries.
fn statuses(score: &CodeScore) -> Vec<String> {
    match score.problem {
        Some(problem) => vec![problem.to_owned()],
        None => score.cases.iter().map(|c| c.status.to_string()).collect(),
    }
}

fn field_names(schema: &Value, model: &str) -> Vec<String> {
    let mut names: Vec<String> = schema["models"][model]
        .as_array()
        .unwrap_or_else(|| panic!("the schema has no model {model}"))
        .iter()
        .map(|f| f["name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

fn keys(value: &Value) -> Vec<String> {
    let mut keys: Vec<String> = value.as_object().unwrap().keys().cloned().collect();
    keys.sort();
    keys
}

#[test]
fn the_client_follows_sandbox_fusions_schema() {
    let schema: Value = serde_json::from_str(SCHEMA).unwrap();
    let request = RunCodeRequest {
        compile_timeout: 10.0,
        run_timeout: 10.0,
        memory_limit_mb: 1024,
        code: "print(1)".into(),
        stdin: Some(String::new()),
        language: "python".into(),
        files: Default::default(),
        fetch_files: Vec::new(),
    };
    assert_eq!(
        keys(&serde_json::to_value(&request).unwrap()),
        field_names(&schema, "RunCodeRequest")
    );
    let result = CommandRunResult {
        status: CommandRunStatus::Finished,
        execution_time: Some(0.1),
        return_code: Some(0),
        stdout: Some("1\n".into()),
        stderr: Some(String::new()),
    };
    assert_eq!(
        keys(&serde_json::to_value(&result).unwrap()),
        field_names(&schema, "CommandRunResult")
    );
    let response = RunCodeResponse {
        status: RunStatus::Success,
        message: String::new(),
        compile_result: None,
        run_result: Some(result),
        executor_pod_name: None,
        files: Default::default(),
    };
    assert_eq!(
        keys(&serde_json::to_value(&response).unwrap()),
        field_names(&schema, "RunCodeResponse")
    );
    let statuses = [
        RunStatus::Success,
        RunStatus::Failed,
        RunStatus::SandboxError,
    ];
    assert_eq!(json!(statuses), schema["enums"]["RunStatus"]);
    let statuses = [
        CommandRunStatus::Finished,
        CommandRunStatus::Error,
        CommandRunStatus::TimeLimitExceeded,
    ];
    assert_eq!(json!(statuses), schema["enums"]["CommandRunStatus"]);
    // Fields a newer server adds are ignored; a status outside the schema is not accepted.
    let extended: RunCodeResponse = serde_json::from_value(json!({
        "status": "Failed", "message": "", "run_result": {"status": "TimeLimitExceeded",
        "cpu_time": 1.5}, "executor_pod_name": "pod-1", "trace_id": "x"
    }))
    .unwrap();
    assert_eq!(
        extended.run_result.unwrap().status,
        CommandRunStatus::TimeLimitExceeded
    );
    assert!(
        serde_json::from_value::<RunCodeResponse>(json!({"status": "Done", "message": ""}))
            .is_err()
    );
}

#[test]
fn scores_match_verl() {
    let reference: Value = serde_json::from_str(REFERENCE).expect("the reference parses");
    let server = FakeServer::start();
    let memory = reference["memory_limit_mb"].as_i64().unwrap();
    let sandbox = server.sandbox("/run_code", 6, memory);
    let samples = reference["samples"].as_array().expect("samples");
    assert!(samples.len() >= 300, "{} samples", samples.len());
    let tasks: Vec<Task> = samples
        .iter()
        .map(|s| Task {
            completion: s["completion"].as_str().unwrap(),
            ground_truth: &s["test_cases"],
            continuous: s["continuous"].as_bool().unwrap(),
            timeout_s: s["timeout"].as_f64().unwrap(),
        })
        .collect();
    let scores = sandbox.score(&tasks);
    let mut failures = Vec::new();
    for (i, (sample, ours)) in samples.iter().zip(&scores).enumerate() {
        let verl_statuses: Vec<String> =
            serde_json::from_value(sample["statuses"].clone()).unwrap();
        let verl_score = sample["score"].as_f64().unwrap();
        if ours.score != verl_score || statuses(ours) != verl_statuses {
            failures.push(format!(
                "sample {i} ({}): verl {verl_score} {verl_statuses:?}, ours {} {:?}",
                sample["kind"],
                ours.score,
                statuses(ours)
            ));
        }
    }
    for check in reference["cpp"].as_array().expect("cpp") {
        let cases = TestCases::parse(&check["in_outs"]).unwrap();
        let outcome = sandbox
            .check_correctness(&[Check {
                generation: check["code"].as_str().unwrap(),
                cases: &cases,
                timeout_s: 10.0,
                language: "cpp",
            }])
            .remove(0);
        let results: Vec<Value> = outcome.iter().map(|c| c.verdict.verl_value()).collect();
        let ours: Vec<String> = outcome.iter().map(|c| c.status.to_string()).collect();
        let verl: Vec<String> = serde_json::from_value(check["statuses"].clone()).unwrap();
        if results != check["results"].as_array().unwrap().clone() || ours != verl {
            failures.push(format!(
                "{}: verl {} {verl:?}, ours {results:?} {ours:?}",
                check["kind"], check["results"]
            ));
        }
    }
    let passed = scores.iter().filter(|s| s.score == 1.0).count();
    let partial = scores
        .iter()
        .filter(|s| s.score > 0.0 && s.score < 1.0)
        .count();
    eprintln!(
        "{} samples ({passed} all passed, {partial} partly) and {} C++ checks against verl",
        samples.len(),
        reference["cpp"].as_array().unwrap().len()
    );
    assert!(
        failures.is_empty(),
        "{} differences from verl:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn one_case_task(ground_truth: &Value) -> Task<'_> {
    Task::new("```python\nprint(input())\n```", ground_truth)
}

#[test]
fn failures_to_reach_the_sandbox_are_verls_api_errors() {
    let server = FakeServer::start();
    let truth = json!({"inputs": ["1\n", "2\n"], "outputs": ["1", "2"]});
    let task = one_case_task(&truth);

    // Nothing listens: every case is an API error naming the URL, scored 0.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/run_code", closed.local_addr().unwrap());
    drop(closed);
    let score = sandbox_at(&url, 2, 1024)
        .score(std::slice::from_ref(&task))
        .remove(0);
    assert_eq!(score.score, 0.0);
    for case in &score.cases {
        assert_eq!(
            (case.verdict, &*case.status),
            (Verdict::ApiError, "api_error")
        );
        assert!(case.detail.as_ref().unwrap().contains(&url), "{case:?}");
    }

    // 504 is retried (3 attempts, 1 s then 2 s apart), other statuses are not.
    let score = server
        .sandbox("/status/504", 2, 1024)
        .score(std::slice::from_ref(&task))
        .remove(0);
    let detail = score.cases[0].detail.as_deref().unwrap();
    assert!(
        detail.contains("Gateway Timeout (504) on attempt 3/3"),
        "{detail}"
    );
    let score = server
        .sandbox("/status/500", 1, 1024)
        .score(std::slice::from_ref(&task))
        .remove(0);
    let detail = score.cases[1].detail.as_deref().unwrap();
    assert!(
        detail.contains("HTTP 500") && detail.contains("fault injected"),
        "{detail}"
    );
    // An answer that is not JSON.
    let score = server
        .sandbox("/malformed", 1, 1024)
        .score(std::slice::from_ref(&task))
        .remove(0);
    let detail = score.cases[0].detail.as_deref().unwrap();
    assert!(
        detail.contains("not SandboxFusion's RunCodeResponse"),
        "{detail}"
    );
    assert!(score.cases.iter().all(|c| c.verdict == Verdict::ApiError));
    assert_eq!(
        server.get("/requests"),
        json!({"/status/504": 6, "/status/500": 2, "/malformed": 2})
    );

    // The same test cases through the real endpoint pass.
    let score = server
        .sandbox("/run_code", 2, 1024)
        .score(&[task])
        .remove(0);
    assert_eq!(score.score, 1.0);
}

#[test]
fn test_cases_verl_cannot_read_score_zero_without_a_request() {
    // No server: nothing may be requested.
    let sandbox = sandbox_at("http://127.0.0.1:9/run_code", 1, 1024);
    let cases = [
        (json!("{\"inputs\": [1"), "Invalid test_cases JSON format"),
        (
            json!({"inputs": ["1"]}),
            "Invalid test_cases structure (missing inputs/outputs)",
        ),
        (
            json!({}),
            "Invalid test_cases structure (missing inputs/outputs)",
        ),
        (
            json!(7),
            "Invalid test_cases structure (missing inputs/outputs)",
        ),
        (
            json!({"inputs": "1", "outputs": "1"}),
            "Invalid test_cases structure (missing inputs/outputs)",
        ),
    ];
    for (truth, problem) in &cases {
        let score = sandbox.score(&[one_case_task(truth)]).remove(0);
        assert_eq!(
            (score.score, score.problem),
            (0.0, Some(*problem)),
            "{truth}"
        );
    }
    let truth = json!({"inputs": ["1"], "outputs": ["1"]});
    let score = sandbox.score(&[Task::new("print(1)", &truth)]).remove(0);
    assert_eq!(
        score.problem,
        Some("Invalid completion (missing code block)")
    );
    // Mismatched counts: one error entry per input, as verl.
    let truth = json!({"inputs": ["1", "2"], "outputs": ["1"]});
    let score = sandbox.score(&[one_case_task(&truth)]).remove(0);
    assert_eq!(statuses(&score), vec!["Input/output count mismatch"; 2]);
    // No inputs: no case, score 0.
    let truth = json!({"inputs": [], "outputs": []});
    let score = sandbox.score(&[one_case_task(&truth)]).remove(0);
    assert_eq!(
        (score.score, score.cases.len(), score.problem),
        (0.0, 0, None)
    );
}

#[test]
fn bad_settings_name_the_key() {
    let err = |config: SandboxFusionConfig| Sandbox::from_config(&config).unwrap_err().to_string();
    let url = |u: &str| SandboxFusionConfig {
        url: Some(u.into()),
        ..SandboxFusionConfig::default()
    };
    assert!(
        err(url("localhost:8080/run_code"))
            .contains("reward_model.sandbox_fusion.url=localhost:8080")
    );
    let zero = SandboxFusionConfig {
        max_concurrent: 0,
        ..url("http://127.0.0.1:8080/run_code")
    };
    assert!(err(zero).contains("reward_model.sandbox_fusion.max_concurrent"));
    assert!(
        Sandbox::from_config(&SandboxFusionConfig::default())
            .unwrap()
            .is_none()
    );
}

/// The rule reward scores a batch mixing code and math sources in order, the code ones through
/// the sandbox with at most `max_concurrent` runs at once.
#[test]
fn the_rule_reward_scores_code_sources_through_the_sandbox() {
    let server = FakeServer::start();
    let mut reward = RuleReward::default();
    let section = json!({"sandbox_fusion": {"url": format!("{}/run_code", server.base),
        "max_concurrent": 3, "memory_limit_mb": 1024}});
    reward
        .init(&ComponentInit::new(section, Default::default()))
        .unwrap();
    // As the trainer hands ground truths over: JSON text of an object becomes the object.
    let io = ground_truth_value(
        r#"{"inputs": ["1 2\n", "5 5\n", "0 0\n", "2 2\n"], "outputs": ["3", "10", "0", "4"]}"#,
    );
    let call = ground_truth_value(
        r#"{"fn_name": "add", "inputs": ["1\n2", "3\n4"], "outputs": ["3", "7"]}"#,
    );
    let slow_add = "```python\nimport time\ntime.sleep(0.3)\na, b = map(int, input().split())\nprint(a + b)\n```";
    let items = vec![
        RewardItem::new("openai/gsm8k", "#### 3", "3"),
        RewardItem::new("codecontests", slow_add, io.clone()),
        RewardItem::new("apps", "```python\nprint(0)\n```", io.clone()),
        RewardItem::new(
            "taco",
            "```python\ndef add(a, b):\n    return a + b\n```",
            call,
        ),
        RewardItem::new("codeforces", "no code here", io),
        RewardItem::new("openai/gsm8k", "#### 4", "3"),
    ];
    let output = reward.compute(&RewardRequest::new(items)).unwrap();
    let scores: Vec<f64> = output.scores.iter().map(|s| s.score).collect();
    assert_eq!(scores, [1.0, 1.0, 0.25, 1.0, 0.0, 0.0]);
    assert_eq!(server.get("/max_in_flight"), json!(3));
}
