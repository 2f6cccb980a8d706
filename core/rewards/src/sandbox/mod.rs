//! Code rewards through a SandboxFusion server, as verl's `reward_score/sandbox_fusion` computes
//! them for the data sources `codecontests`, `apps`, `codeforces` and `taco`: the code is taken
//! from the response's fenced block, run once per test case (stdin → stdout, a call of
//! `fn_name`, or an `assert_case` appended to it), each run classified as verl does (pass, wrong
//! answer, -1 API or sandbox error, -2 runtime error, -3 time-out, -4 compile error — which
//! also marks every later case), and scored as the pass rate over the first 10 cases
//! (`continuous`, what verl's `default_compute_score` uses) or over all of them.
//!
//! verl without a sandbox URL falls back to `prime_code`, which runs the model's code on the
//! trainer's host without isolation; verl-core refuses to (see [`no_sandbox_message`]).

pub mod api;
mod driver;

use std::borrow::Cow;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;

use self::api::{Client, CommandRunStatus, RunCodeRequest, RunCodeResponse, RunStatus};
use super::RewardError;
use super::py;
use verl_schema::SandboxFusionConfig;

/// `data_source` values verl scores by running the response's code.
pub const DATA_SOURCES: [&str; 4] = ["codecontests", "apps", "codeforces", "taco"];

/// verl's per-case compile and run time limit (seconds) for rewards.
pub const DEFAULT_TIMEOUT_S: f64 = 10.0;
/// The continuous score's pass rate is over this many first cases.
const CONTINUOUS_CASES: usize = 10;

/// The configuration error of a code data source without a sandbox.
pub fn no_sandbox_message(data_source: &str) -> String {
    format!(
        "data_source `{data_source}` is scored by running the response's code in a SandboxFusion \
         server (https://github.com/bytedance/SandboxFusion): set reward_model.sandbox_fusion.url \
         to its /run_code endpoint (e.g. http://127.0.0.1:8080/run_code). verl would fall back to \
         prime_code, which runs model-written code unsandboxed on the trainer host; verl-core \
         refuses to. To run verl's own function anyway (at your own risk), serve a FILE.py holding \
         `from verl.utils.reward_score import default_compute_score as compute_score` with \
         `python3 plugins/reward-http/reward_server.py FILE.py --port 8000` where verl is installed, \
         and set custom_reward_function.path=http://HOST:8000 (the `http` reward)"
    )
}

/// One test run's outcome: verl's result value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// `True`.
    Passed,
    /// `False`.
    WrongAnswer,
    /// -1: the request failed, or the sandbox failed or answered something unexpected.
    ApiError,
    /// -2.
    RuntimeError,
    /// -3.
    Timeout,
    /// -4.
    CompileError,
}

impl Verdict {
    /// verl's value: `true`, `false` or the negative code.
    pub fn verl_value(self) -> Value {
        match self {
            Self::Passed => Value::Bool(true),
            Self::WrongAnswer => Value::Bool(false),
            Self::ApiError => Value::from(-1),
            Self::RuntimeError => Value::from(-2),
            Self::Timeout => Value::from(-3),
            Self::CompileError => Value::from(-4),
        }
    }
}

/// One test case's result: the verdict, verl's metadata `status` (`success`, `wrong_answer`,
/// `timeout`, `compile_error_skipped`, …, or the error text of verl's error-only entries) and,
/// for API errors, the reason.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseOutcome {
    pub verdict: Verdict,
    pub status: Cow<'static, str>,
    pub detail: Option<String>,
}

impl CaseOutcome {
    fn new(verdict: Verdict, status: &'static str) -> Self {
        Self {
            verdict,
            status: status.into(),
            detail: None,
        }
    }
}

/// A response's score and its cases' outcomes; `problem` is set (and `cases` empty) when no case
/// ran: no code block, or test cases verl cannot read (verl's single `{"error": …}` entry).
#[derive(Debug, Clone, PartialEq)]
pub struct CodeScore {
    pub score: f64,
    pub cases: Vec<CaseOutcome>,
    pub problem: Option<&'static str>,
}

impl CodeScore {
    fn unscored(problem: &'static str) -> Self {
        Self {
            score: 0.0,
            cases: Vec::new(),
            problem: Some(problem),
        }
    }
}

/// The code verl takes from a response: the text after the last ```` ```python ```` up to the
/// next fence; else the first fenced block, less a first line that is a bare word (a language
/// tag); None without a fence.
pub fn extract_code(completion: &str) -> Option<&str> {
    if let Some(at) = completion.rfind("```python") {
        let rest = &completion[at + "```python".len()..];
        return Some(rest.split("```").next().unwrap_or_default());
    }
    let block = completion.split("```").nth(1)?;
    match block.split_once('\n') {
        Some((first, rest)) if is_alpha(py::strip(first)) => Some(rest),
        _ => Some(block),
    }
}

/// Python's `str.isalpha`.
fn is_alpha(s: &str) -> bool {
    !s.is_empty() && s.chars().all(char::is_alphabetic)
}

/// A problem's test cases as verl reads `ground_truth`: `{"inputs": [...], "outputs": [...]}`,
/// optionally `"fn_name"`, or `{"assert_case": [...]}` (code appended to the solution per case;
/// inputs default to empty, outputs to None), as an object or its JSON text.
#[derive(Debug, Clone, PartialEq)]
pub struct TestCases {
    pub inputs: Vec<Value>,
    pub outputs: Vec<Value>,
    pub fn_name: Option<String>,
    pub assert_cases: Option<Vec<String>>,
}

const BAD_STRUCTURE: &str = "Invalid test_cases structure (missing inputs/outputs)";

impl TestCases {
    /// The test cases, or verl's error text.
    pub fn parse(ground_truth: &Value) -> Result<Self, &'static str> {
        let parsed;
        let object = match ground_truth {
            Value::Object(object) => object,
            Value::String(text) => {
                parsed = serde_json::from_str::<Value>(text)
                    .map_err(|_| "Invalid test_cases JSON format")?;
                parsed.as_object().ok_or(BAD_STRUCTURE)?
            }
            _ => return Err(BAD_STRUCTURE),
        };
        let list = |key: &str| match object.get(key) {
            Some(Value::Array(items)) => Ok(Some(items.clone())),
            None => Ok(None),
            Some(_) => Err(BAD_STRUCTURE),
        };
        let assert_cases = match object.get("assert_case") {
            Some(Value::Array(items)) => Some(
                items
                    .iter()
                    .map(|c| c.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or("Unhandled exception: assert_case items must be strings")?,
            ),
            _ => None,
        };
        let (inputs, outputs) = match (&assert_cases, list("inputs")?, list("outputs")?) {
            (_, Some(inputs), Some(outputs)) => (inputs, outputs),
            (Some(cases), inputs, outputs) => (
                inputs.unwrap_or_else(|| vec![Value::from(""); cases.len()]),
                outputs.unwrap_or_else(|| vec![Value::Null; cases.len()]),
            ),
            _ => return Err(BAD_STRUCTURE),
        };
        let fn_name = match object.get("fn_name") {
            Some(Value::String(name)) if !name.is_empty() => Some(name.clone()),
            _ => None,
        };
        Ok(Self {
            inputs,
            outputs,
            fn_name,
            assert_cases,
        })
    }
}

/// One response to check: `generation` is the code (already extracted), run in `language`
/// with a compile and run limit of `timeout_s` each.
#[derive(Debug, Clone, PartialEq)]
pub struct Check<'a> {
    pub generation: &'a str,
    pub cases: &'a TestCases,
    pub timeout_s: f64,
    pub language: &'a str,
}

/// One response to score from its completion text.
#[derive(Debug, Clone, PartialEq)]
pub struct Task<'a> {
    pub completion: &'a str,
    pub ground_truth: &'a Value,
    /// The pass rate over the first 10 cases, else over all.
    pub continuous: bool,
    pub timeout_s: f64,
}

impl<'a> Task<'a> {
    /// As verl's `default_compute_score` scores a code data source.
    pub fn new(completion: &'a str, ground_truth: &'a Value) -> Self {
        Self {
            completion,
            ground_truth,
            continuous: true,
            timeout_s: DEFAULT_TIMEOUT_S,
        }
    }
}

/// One run to request: which check and case it belongs to, and what it expects.
struct Job<'a> {
    check: usize,
    case: usize,
    request: RunCodeRequest,
    expected: &'a Value,
}

/// A SandboxFusion server and verl's settings for it.
#[derive(Debug, Clone)]
pub struct Sandbox {
    client: Client,
    max_concurrent: usize,
    memory_limit_mb: i64,
}

impl Sandbox {
    /// From `reward_model.sandbox_fusion`; None without a URL.
    pub fn from_config(config: &SandboxFusionConfig) -> Result<Option<Self>, RewardError> {
        let Some(url) = config.url.as_deref().filter(|u| !u.is_empty()) else {
            return Ok(None);
        };
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(RewardError::Config(format!(
                "reward_model.sandbox_fusion.url={url}: expected the http(s) URL of a SandboxFusion /run_code endpoint"
            )));
        }
        if config.max_concurrent == 0 {
            return Err(RewardError::Config(
                "reward_model.sandbox_fusion.max_concurrent must be at least 1".into(),
            ));
        }
        Ok(Some(Self {
            client: Client::new(url),
            max_concurrent: config.max_concurrent,
            memory_limit_mb: config.memory_limit_mb,
        }))
    }

    pub fn url(&self) -> &str {
        self.client.url()
    }

    /// verl's `compute_score` for each task (Python code), the runs of all tasks at most
    /// `max_concurrent` at a time.
    pub fn score(&self, tasks: &[Task]) -> Vec<CodeScore> {
        let prepared: Vec<Result<(&str, TestCases), &'static str>> = tasks
            .iter()
            .map(|task| {
                let code = extract_code(task.completion)
                    .ok_or("Invalid completion (missing code block)")?;
                Ok((code, TestCases::parse(task.ground_truth)?))
            })
            .collect();
        let checks: Vec<Check> = tasks
            .iter()
            .zip(&prepared)
            .filter_map(|(task, p)| {
                p.as_ref().ok().map(|(code, cases)| Check {
                    generation: code,
                    cases,
                    timeout_s: task.timeout_s,
                    language: "python",
                })
            })
            .collect();
        let mut outcomes = self.check_correctness(&checks).into_iter();
        tasks
            .iter()
            .zip(&prepared)
            .map(|(task, p)| match p {
                Err(problem) => CodeScore::unscored(problem),
                Ok(_) => {
                    let cases = outcomes.next().unwrap_or_default();
                    CodeScore {
                        score: pass_rate(&cases, task.continuous),
                        cases,
                        problem: None,
                    }
                }
            })
            .collect()
    }

    /// verl's `check_correctness` for each check: one outcome per test case.
    pub fn check_correctness(&self, checks: &[Check]) -> Vec<Vec<CaseOutcome>> {
        let mut results: Vec<Vec<Option<CaseOutcome>>> = Vec::with_capacity(checks.len());
        let mut jobs = Vec::new();
        for (c, check) in checks.iter().enumerate() {
            let cases = check.cases;
            let n = cases.inputs.len();
            let asserts_fit = cases.assert_cases.as_ref().is_none_or(|a| a.len() == n);
            if cases.outputs.len() != n || !asserts_fit {
                let mismatch = CaseOutcome::new(Verdict::ApiError, "Input/output count mismatch");
                results.push(vec![Some(mismatch); n]);
                continue;
            }
            results.push(vec![None; n]);
            for (i, (input, expected)) in cases.inputs.iter().zip(&cases.outputs).enumerate() {
                let assert_case = cases.assert_cases.as_ref().map_or("", |a| &a[i]);
                let generation = format!("{}\n\n{assert_case}", check.generation);
                let code = match &cases.fn_name {
                    Some(name) if check.language == "python" => {
                        driver::call_based(&generation, name)
                    }
                    _ => generation,
                };
                let request = RunCodeRequest {
                    compile_timeout: check.timeout_s,
                    run_timeout: check.timeout_s,
                    memory_limit_mb: self.memory_limit_mb,
                    code,
                    stdin: (!input.is_null()).then(|| py::str_of(input)),
                    language: check.language.to_owned(),
                    files: Default::default(),
                    fetch_files: Vec::new(),
                };
                jobs.push(Job {
                    check: c,
                    case: i,
                    request,
                    expected,
                });
            }
        }
        let slots: Vec<Mutex<Option<CaseOutcome>>> =
            jobs.iter().map(|_| Mutex::new(None)).collect();
        let next = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..self.max_concurrent.min(jobs.len()) {
                scope.spawn(|| {
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(job) = jobs.get(k) else { break };
                        let outcome = match self.client.run(&job.request) {
                            Ok(response) => classify(&response, job.expected),
                            Err(reason) => CaseOutcome {
                                detail: Some(reason),
                                ..CaseOutcome::new(Verdict::ApiError, "api_error")
                            },
                        };
                        *slots[k].lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
                    }
                });
            }
        });
        for (job, slot) in jobs.iter().zip(slots) {
            results[job.check][job.case] = slot.into_inner().unwrap_or_else(|e| e.into_inner());
        }
        let api_errors: Vec<&str> = results
            .iter()
            .flatten()
            .flatten()
            .filter_map(|o| o.detail.as_deref())
            .collect();
        if let Some(first) = api_errors.first() {
            tracing::warn!(
                "SandboxFusion at {}: {} of {} test runs failed (scored as errors): {first}",
                self.client.url(),
                api_errors.len(),
                jobs.len()
            );
        }
        results
            .into_iter()
            .map(|cases| {
                let mut cases: Vec<CaseOutcome> = cases
                    .into_iter()
                    .map(|o| {
                        o.unwrap_or_else(|| CaseOutcome::new(Verdict::ApiError, "internal_error"))
                    })
                    .collect();
                spread_compile_error(&mut cases);
                cases
            })
            .collect()
    }
}

/// verl's classification of one run against the expected output (`None`: any output passes).
fn classify(response: &RunCodeResponse, expected: &Value) -> CaseOutcome {
    use CommandRunStatus::{Error, Finished, TimeLimitExceeded};
    let outcome = CaseOutcome::new;
    match response.status {
        RunStatus::SandboxError => outcome(Verdict::ApiError, "sandbox_error"),
        RunStatus::Failed => {
            if let Some(compile) = &response.compile_result {
                match compile.status {
                    TimeLimitExceeded => return outcome(Verdict::CompileError, "compile_timeout"),
                    Error => return outcome(Verdict::CompileError, "compile_error"),
                    Finished if compile.return_code != Some(0) => {
                        return outcome(Verdict::CompileError, "compile_error");
                    }
                    Finished => {}
                }
            }
            match &response.run_result {
                Some(run) => match run.status {
                    TimeLimitExceeded => outcome(Verdict::Timeout, "timeout"),
                    Error => outcome(Verdict::RuntimeError, "runtime_error"),
                    Finished if run.return_code != Some(0) => {
                        outcome(Verdict::RuntimeError, "runtime_error")
                    }
                    Finished => outcome(Verdict::ApiError, "unknown_failure"),
                },
                None => outcome(Verdict::ApiError, "unknown_failure_state"),
            }
        }
        RunStatus::Success => match &response.run_result {
            Some(run) if run.status == Finished => {
                let actual = run.stdout.as_deref().unwrap_or_default();
                let strip = |s: &str| s.trim_end_matches('\n').to_owned();
                if expected.is_null() || strip(actual) == strip(&py::str_of(expected)) {
                    outcome(Verdict::Passed, "success")
                } else {
                    outcome(Verdict::WrongAnswer, "wrong_answer")
                }
            }
            _ => outcome(Verdict::ApiError, "unexpected_success_state"),
        },
    }
}

/// verl marks every case after the first compile error as a compile error too.
fn spread_compile_error(cases: &mut [CaseOutcome]) {
    if let Some(first) = cases
        .iter()
        .position(|c| c.verdict == Verdict::CompileError)
    {
        for case in &mut cases[first + 1..] {
            if case.verdict != Verdict::CompileError {
                *case = CaseOutcome::new(Verdict::CompileError, "compile_error_skipped");
            }
        }
    }
}

/// The share of passed cases: among the first 10 (`continuous`) or all; 0 without cases.
fn pass_rate(cases: &[CaseOutcome], continuous: bool) -> f64 {
    let considered = if continuous {
        &cases[..cases.len().min(CONTINUOUS_CASES)]
    } else {
        cases
    };
    if considered.is_empty() {
        return 0.0;
    }
    let passed = considered
        .iter()
        .filter(|c| c.verdict == Verdict::Passed)
        .count();
    passed as f64 / considered.len() as f64
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::api::CommandRunResult;
    use super::*;

    #[test]
    fn code_is_extracted_by_verls_fence_rules() {
        let cases = [
            ("a\n```python\nx = 1\n```\nb", Some("\nx = 1\n")),
            // The last ```python block wins, even after a bare one.
            (
                "```python\n1\n```\n```\n2\n```\n```python\n3\n```",
                Some("\n3\n"),
            ),
            // Unclosed: everything after the tag.
            ("```python\nprint(1)", Some("\nprint(1)")),
            // ```python3 leaves "3" as the first line of code.
            ("```python3\nx\n```", Some("3\nx\n")),
            // A bare fence: the first block, less a language tag.
            ("```cpp\nint x;\n```\n```\ny\n```", Some("int x;\n")),
            ("``` py \nz\n```", Some("z\n")),
            ("```c++\nz\n```", Some("c++\nz\n")),
            ("```\nz\n```", Some("\nz\n")),
            ("```z```", Some("z")),
            ("no fence", None),
        ];
        for (completion, code) in cases {
            assert_eq!(extract_code(completion), code, "{completion:?}");
        }
    }

    fn response(
        status: RunStatus,
        compile: Option<(CommandRunStatus, Option<i64>)>,
        run: Option<(CommandRunStatus, Option<i64>, &str)>,
    ) -> RunCodeResponse {
        let result = |status, return_code, stdout: &str| CommandRunResult {
            status,
            execution_time: Some(0.1),
            return_code,
            stdout: Some(stdout.into()),
            stderr: None,
        };
        RunCodeResponse {
            status,
            message: String::new(),
            compile_result: compile.map(|(s, rc)| result(s, rc, "")),
            run_result: run.map(|(s, rc, out)| result(s, rc, out)),
            executor_pod_name: None,
            files: Default::default(),
        }
    }

    #[test]
    fn runs_are_classified_as_verl_does() {
        use CommandRunStatus::{Error, Finished, TimeLimitExceeded as Tle};
        use RunStatus::{Failed, SandboxError, Success};
        let expected = json!("3");
        let cases = [
            (
                response(Success, None, Some((Finished, Some(0), "3\n\n"))),
                Verdict::Passed,
                "success",
            ),
            (
                response(Success, None, Some((Finished, Some(0), "3 \n"))),
                Verdict::WrongAnswer,
                "wrong_answer",
            ),
            (
                response(Success, None, Some((Tle, None, ""))),
                Verdict::ApiError,
                "unexpected_success_state",
            ),
            (
                response(Success, None, None),
                Verdict::ApiError,
                "unexpected_success_state",
            ),
            (
                response(SandboxError, None, Some((Error, None, ""))),
                Verdict::ApiError,
                "sandbox_error",
            ),
            (
                response(Failed, Some((Finished, Some(1))), None),
                Verdict::CompileError,
                "compile_error",
            ),
            (
                response(Failed, Some((Tle, None)), None),
                Verdict::CompileError,
                "compile_timeout",
            ),
            (
                response(Failed, Some((Finished, Some(0))), Some((Tle, None, ""))),
                Verdict::Timeout,
                "timeout",
            ),
            (
                response(Failed, None, Some((Finished, Some(1), "3"))),
                Verdict::RuntimeError,
                "runtime_error",
            ),
            (
                response(Failed, None, Some((Finished, None, ""))),
                Verdict::RuntimeError,
                "runtime_error",
            ),
            (
                response(Failed, None, Some((Finished, Some(0), "3"))),
                Verdict::ApiError,
                "unknown_failure",
            ),
            (
                response(Failed, None, None),
                Verdict::ApiError,
                "unknown_failure_state",
            ),
        ];
        for (response, verdict, status) in cases {
            let outcome = classify(&response, &expected);
            assert_eq!(
                (outcome.verdict, &*outcome.status),
                (verdict, status),
                "{response:?}"
            );
        }
        // An expected output of None accepts anything; others compare as Python's str().
        let any = response(Success, None, Some((Finished, Some(0), "whatever")));
        assert_eq!(classify(&any, &Value::Null).verdict, Verdict::Passed);
        let list = response(Success, None, Some((Finished, Some(0), "[1, 'a']\n")));
        assert_eq!(classify(&list, &json!([1, "a"])).verdict, Verdict::Passed);
        let boolean = response(Success, None, Some((Finished, Some(0), "true\n")));
        assert_eq!(
            classify(&boolean, &json!(true)).verdict,
            Verdict::WrongAnswer
        );
    }

    #[test]
    fn a_compile_error_marks_the_later_cases_and_scores_count_passes() {
        let case = |verdict| CaseOutcome::new(verdict, "x");
        let mut cases = vec![
            case(Verdict::Passed),
            case(Verdict::CompileError),
            case(Verdict::Passed),
            case(Verdict::Timeout),
            case(Verdict::CompileError),
        ];
        spread_compile_error(&mut cases);
        let statuses: Vec<&str> = cases.iter().map(|c| &*c.status).collect();
        assert_eq!(
            statuses,
            [
                "x",
                "x",
                "compile_error_skipped",
                "compile_error_skipped",
                "x"
            ]
        );
        assert_eq!(cases[3].verdict, Verdict::CompileError);
        assert_eq!(pass_rate(&cases, true), 0.2);
        // 12 cases, the first 10 passing once: continuous 1/10, over all 3/12.
        let mut many = vec![case(Verdict::WrongAnswer); 12];
        many[0] = case(Verdict::Passed);
        many[10] = case(Verdict::Passed);
        many[11] = case(Verdict::Passed);
        assert_eq!(pass_rate(&many, true), 0.1);
        assert_eq!(pass_rate(&many, false), 0.25);
        assert_eq!(pass_rate(&[], true), 0.0);
    }

    #[test]
    fn test_cases_parse_as_verl_reads_them() {
        let cases = TestCases::parse(&json!(
            r#"{"fn_name": "f", "inputs": ["1"], "outputs": [2]}"#
        ))
        .unwrap();
        assert_eq!(cases.fn_name.as_deref(), Some("f"));
        assert_eq!(
            (cases.inputs, cases.outputs),
            (vec![json!("1")], vec![json!(2)])
        );
        let asserts =
            TestCases::parse(&json!({"assert_case": ["assert f()", "assert g()"]})).unwrap();
        assert_eq!(asserts.inputs, vec![json!(""); 2]);
        assert_eq!(asserts.outputs, vec![Value::Null; 2]);
        // An empty fn_name is none, as in verl.
        let plain = TestCases::parse(&json!({"fn_name": "", "inputs": [], "outputs": []})).unwrap();
        assert_eq!(plain.fn_name, None);
        assert_eq!(
            TestCases::parse(&json!({"assert_case": [1]})).unwrap_err(),
            "Unhandled exception: assert_case items must be strings"
        );
    }
}
