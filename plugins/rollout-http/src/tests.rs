//! The pool against the mock server: matching answers to prompts, the bound on requests in
//! flight, retries, error messages, load balancing, and started servers that die.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use verl_plugin_api::{FinishReason, GenerateRequest, SamplingParams};

use crate::mock::{MockServer, Recorded, Reply};
use crate::process::is_zombie;
use crate::{HttpError, Launch, Pool, Protocol, Sample, ServerSettings, prompt_seed};

/// A protocol whose server answers `{"samples": [{"index", "ids"}]}`.
struct Echo;

impl Protocol for Echo {
    fn path(&self) -> &str {
        "/gen"
    }
    fn body(&self, prompt: &[u32], s: &SamplingParams, seed: Option<u64>) -> Value {
        json!({"prompt": prompt, "n": s.n, "seed": seed})
    }
    fn samples(&self, answer: &Value) -> Result<Vec<Sample>, String> {
        let list = answer["samples"].as_array().ok_or("no samples")?;
        Ok(list
            .iter()
            .map(|s| Sample {
                index: s["index"].as_u64().unwrap() as usize,
                token_ids: serde_json::from_value(s["ids"].clone()).unwrap(),
                logprobs: vec![-0.5; s["ids"].as_array().unwrap().len()],
                finish_reason: FinishReason::Length,
            })
            .collect())
    }
}

/// The echo server's answer: sample `j` of prompt `p` is `p` followed by `j`, samples listed last
/// first (a server may answer in any order).
fn echo(r: &Recorded) -> Reply {
    let n = r.body["n"].as_u64().unwrap();
    let prompt: Vec<u64> = serde_json::from_value(r.body["prompt"].clone()).unwrap();
    let samples: Vec<Value> = (0..n)
        .rev()
        .map(|j| {
            let mut ids = prompt.clone();
            ids.push(j);
            json!({"index": j, "ids": ids})
        })
        .collect();
    Reply::ok(json!({ "samples": samples }))
}

fn health_or(r: &Recorded, f: impl Fn(&Recorded) -> Reply) -> Reply {
    if r.path == "/health" {
        Reply::ok(Value::Null)
    } else {
        f(r)
    }
}

fn no_restore(_: &Pool, _: usize) -> Result<(), HttpError> {
    Ok(())
}

fn settings(urls: &[&MockServer]) -> ServerSettings {
    ServerSettings {
        urls: urls.iter().map(|m| m.url().to_owned()).collect(),
        startup_timeout_s: 5.0,
        request_timeout_s: 10.0,
        ..ServerSettings::default()
    }
}

fn request(prompts: Vec<Vec<u32>>, n: u32) -> GenerateRequest {
    let mut s = SamplingParams::default();
    s.n = n;
    GenerateRequest::new(prompts, s)
}

#[test]
fn every_completion_is_matched_to_its_prompt() {
    // Later prompts answer sooner, so answers arrive out of order.
    let mock = MockServer::start(|r| {
        health_or(r, |r| {
            let first = r.body["prompt"][0].as_u64().unwrap();
            Reply::After(Duration::from_millis(200 - first * 20), Box::new(echo(r)))
        })
    });
    let mut pool = Pool::attach("test", &settings(&[&mock])).unwrap();
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| vec![i, 100 + i]).collect();
    let out = pool
        .generate(&Echo, &request(prompts.clone(), 3), Some(9), &no_restore)
        .unwrap();
    assert_eq!(out.len(), 24);
    for (k, c) in out.iter().enumerate() {
        let (p, j) = (k / 3, k % 3);
        assert_eq!(c.prompt_index as usize, p);
        let mut want = prompts[p].clone();
        want.push(j as u32);
        assert_eq!(c.response_ids, want);
    }
    let sent = mock.requests_to("/gen");
    assert_eq!(sent.len(), 8, "one request per prompt");
    for r in &sent {
        let p = r.body["prompt"][0].as_u64().unwrap() as usize;
        assert_eq!(r.body["seed"], json!(prompt_seed(9, p)));
    }
}

#[test]
fn lost_or_duplicated_samples_are_errors() {
    for (case, reply) in [
        (
            "duplicated",
            json!({"samples": [{"index": 0, "ids": [1]}, {"index": 0, "ids": [2]}]}),
        ),
        ("lost", json!({"samples": [{"index": 1, "ids": [1]}]})),
    ] {
        let mock = MockServer::start(move |r| health_or(r, |_| Reply::ok(reply.clone())));
        let mut pool = Pool::attach("test", &settings(&[&mock])).unwrap();
        let err = pool
            .generate(&Echo, &request(vec![vec![5]], 2), None, &no_restore)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("prompt 0") && err.contains("asked for 2 sample(s)"),
            "{case}: {err}"
        );
        assert!(
            err.contains(&format!("{}/gen", mock.url())),
            "{case}: {err}"
        );
    }
}

#[test]
fn requests_in_flight_stay_within_the_bound() {
    let (now, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (n2, p2) = (now.clone(), peak.clone());
    let mock = MockServer::start(move |r| {
        health_or(r, |r| {
            let current = n2.fetch_add(1, Ordering::SeqCst) + 1;
            p2.fetch_max(current, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(100));
            n2.fetch_sub(1, Ordering::SeqCst);
            echo(r)
        })
    });
    let mut s = settings(&[&mock]);
    s.max_inflight = 3;
    let mut pool = Pool::attach("test", &s).unwrap();
    let prompts: Vec<Vec<u32>> = (0..12).map(|i| vec![i]).collect();
    assert_eq!(
        pool.generate(&Echo, &request(prompts, 1), None, &no_restore)
            .unwrap()
            .len(),
        12
    );
    assert_eq!(
        peak.load(Ordering::SeqCst),
        3,
        "at most 3 in flight, and 3 reached"
    );
}

#[test]
fn dropped_connections_are_retried_without_duplicates() {
    let drops = Arc::new(AtomicUsize::new(2));
    let d = drops.clone();
    let mock = MockServer::start(move |r| {
        health_or(r, |r| {
            let left = d.load(Ordering::SeqCst);
            if left > 0 && r.body["prompt"][0] == 1 {
                d.store(left - 1, Ordering::SeqCst);
                Reply::Drop
            } else {
                echo(r)
            }
        })
    });
    let mut pool = Pool::attach("test", &settings(&[&mock])).unwrap();
    let out = pool
        .generate(
            &Echo,
            &request(vec![vec![0], vec![1], vec![2]], 2),
            None,
            &no_restore,
        )
        .unwrap();
    let firsts: Vec<u32> = out.iter().map(|c| c.response_ids[0]).collect();
    assert_eq!(firsts, [0, 0, 1, 1, 2, 2]);
    assert_eq!(
        mock.requests_to("/gen").len(),
        5,
        "prompt 1 was sent three times"
    );

    // With fewer attempts than failures, the error says how many were made.
    drops.store(10, Ordering::SeqCst);
    let mut s = settings(&[&mock]);
    s.retries = 2;
    let mut pool = Pool::attach("test", &s).unwrap();
    let err = pool
        .generate(&Echo, &request(vec![vec![1]], 1), None, &no_restore)
        .unwrap_err();
    assert!(
        matches!(err, HttpError::Unreachable { attempts: 2, .. }),
        "{err}"
    );
}

#[test]
fn a_client_error_carries_the_servers_message_and_is_not_retried() {
    let mock = MockServer::start(|r| {
        health_or(r, |_| {
            Reply::Json(
                400,
                json!({"error": {"message": "max_tokens=1000 cannot be greater than max_model_len=256", "type": "BadRequestError", "code": 400}}),
            )
        })
    });
    let mut pool = Pool::attach("test", &settings(&[&mock])).unwrap();
    let err = pool
        .generate(&Echo, &request(vec![vec![1]], 1), None, &no_restore)
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.ends_with("HTTP 400: max_tokens=1000 cannot be greater than max_model_len=256"),
        "the client's error, nothing about the server's log: {text}"
    );
    assert_eq!(mock.requests_to("/gen").len(), 1);
}

#[test]
fn unavailable_is_retried() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let mock = MockServer::start(move |r| {
        health_or(r, |r| {
            if c.fetch_add(1, Ordering::SeqCst) == 0 {
                Reply::Json(503, json!({"error": {"message": "paused"}}))
            } else {
                echo(r)
            }
        })
    });
    let mut pool = Pool::attach("test", &settings(&[&mock])).unwrap();
    assert_eq!(
        pool.generate(&Echo, &request(vec![vec![1]], 1), None, &no_restore)
            .unwrap()
            .len(),
        1
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn replicas_share_the_load() {
    let slow = |r: &Recorded| {
        health_or(r, |r| {
            Reply::After(Duration::from_millis(50), Box::new(echo(r)))
        })
    };
    let (a, b) = (MockServer::start(slow), MockServer::start(slow));
    let mut pool = Pool::attach("test", &settings(&[&a, &b])).unwrap();
    let prompts: Vec<Vec<u32>> = (0..10).map(|i| vec![i]).collect();
    assert_eq!(
        pool.generate(&Echo, &request(prompts, 1), None, &no_restore)
            .unwrap()
            .len(),
        10
    );
    let (na, nb) = (a.requests_to("/gen").len(), b.requests_to("/gen").len());
    assert_eq!(na + nb, 10);
    assert!(na >= 3 && nb >= 3, "unbalanced: {na} and {nb}");
}

#[test]
fn an_attached_server_that_never_answers_is_named() {
    let mock = MockServer::start(|_| Reply::Json(503, json!({"error": "starting"})));
    let mut s = settings(&[&mock]);
    s.startup_timeout_s = 0.5;
    let err = Pool::attach("test", &s).unwrap_err().to_string();
    assert!(
        err.contains(&format!("{}/health", mock.url())) && err.contains("HTTP 503"),
        "{err}"
    );
}

fn sh(dir: &std::path::Path, script: &str) -> Launch {
    Launch {
        name: "test server".into(),
        program: "sh".into(),
        args: vec!["-c".into(), script.into()],
        env: Vec::new(),
        log: dir.join("server.log"),
    }
}

/// A shell command printing `name` of `src/testdata` (a real server's log, or one in its format).
fn replay(name: &str) -> String {
    format!("cat '{}/src/testdata/{name}'", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn a_started_server_that_exits_while_starting_reports_its_error_line_and_log() {
    let dir = tempfile::tempdir().unwrap();
    for (log, error_line) in [
        (
            "vllm-startup-max-model-len.log",
            ": pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig \
             Value error, User-specified max_model_len (512) is greater than the derived",
        ),
        (
            "sglang-startup-unsupported.log",
            ": ValueError: Unsupported architectures: ['TinyNetForCausalLM']. Supported: \
             LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM; its log",
        ),
    ] {
        let err = Pool::spawn(
            "test",
            &settings(&[]),
            &sh(dir.path(), &format!("{}; exit 1", replay(log))),
            "http://127.0.0.1:9",
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(
                err,
                HttpError::Died {
                    when: "while starting",
                    ..
                }
            ),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "exited (exit status: 1) while starting{error_line}"
            )),
            "{text}"
        );
        assert!(text.contains("| ") && text.contains("server.log"), "{text}");
    }
}

#[test]
fn a_started_server_that_never_gets_ready_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = settings(&[]);
    s.startup_timeout_s = 1.0;
    let url = format!(
        "http://127.0.0.1:{}",
        crate::free_port("127.0.0.1").unwrap()
    );
    let err =
        Pool::spawn("test", &s, &sh(dir.path(), "echo loading; sleep 100"), &url).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, HttpError::StartTimeout { .. }), "{text}");
    assert!(text.contains("| loading") && text.contains(&url), "{text}");
    assert!(text.contains("/health); its log"), "no error line: {text}");

    // SGLang's scheduler died, its launcher still up: the scheduler's error is the cause.
    let script = format!("{}; sleep 100", replay("sglang-scheduler-oom.log"));
    let err = Pool::spawn("test", &s, &sh(dir.path(), &script), &url).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains(
            "/health): torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB."
        ),
        "{text}"
    );
}

/// vLLM's answer to every request once its engine has died.
fn engine_dead() -> Reply {
    Reply::Json(
        500,
        json!({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
            "type": "InternalServerError", "param": null, "code": 500}}),
    )
}

#[test]
fn a_started_servers_5xx_carries_the_line_of_its_log_that_looks_like_the_error() {
    let dir = tempfile::tempdir().unwrap();
    // The mock answers for the server's HTTP side; the process prints a real vLLM log of an
    // engine killed by its first request.
    let mock = MockServer::start(|r| health_or(r, |_| engine_dead()));
    let script = format!("{}; exec sleep 100", replay("vllm-cpu-head-dim-16.log"));
    let mut pool =
        Pool::spawn("test", &settings(&[]), &sh(dir.path(), &script), mock.url()).unwrap();
    let log = dir.path().join("server.log");
    await_log(&log, "Finished server process");
    let err = pool
        .generate(&Echo, &request(vec![vec![1]], 1), None, &no_restore)
        .unwrap_err();
    let text = err.to_string();
    let pid = pool.servers()[0].process().unwrap().pid();
    assert_eq!(
        text,
        format!(
            "{}/gen: HTTP 500: EngineCore encountered an issue. See stack trace (above) for the \
             root cause.; test server (pid {pid}) logged: RuntimeError: Unsupported CPU attention \
             configuration: head_dim=16 isa=2 kv_cache_idx=0 (log: {})",
            mock.url(),
            log.display()
        )
    );
    assert_eq!(mock.requests_to("/gen").len(), 1, "a 500 is not retried");
}

#[test]
fn an_attached_servers_5xx_points_at_its_own_log() {
    let mock = MockServer::start(|r| health_or(r, |_| engine_dead()));
    let mut pool = Pool::attach("test", &settings(&[&mock])).unwrap();
    let err = pool
        .generate(&Echo, &request(vec![vec![1]], 1), None, &no_restore)
        .unwrap_err()
        .to_string();
    assert!(
        err.ends_with(
            "HTTP 500: EngineCore encountered an issue. See stack trace (above) for the root \
             cause.; the cause is in the server's own log (it was attached to, not started by the \
             plugin)"
        ),
        "{err}"
    );
}

/// Waits until `log` holds `text` (the shell may not have run yet on a loaded machine).
fn await_log(log: &std::path::Path, text: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(log).is_ok_and(|t| t.contains(text)) {
        assert!(
            Instant::now() < deadline,
            "{} never said {text:?}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGKILLs `pid` and waits until it is dead (a zombie, or gone): a fixed pause raced a loaded
/// machine.
fn kill(pid: u32) {
    // SAFETY: signals the test's own child process.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(pid) {
        assert!(Instant::now() < deadline, "process {pid} survived SIGKILL");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_started_server_that_dies_with_no_restarts_left_is_an_error_naming_its_log() {
    let dir = tempfile::tempdir().unwrap();
    // The mock stands in for the server's HTTP side; the process is the one that dies.
    let mock = MockServer::start(|r| health_or(r, echo));
    let mut s = settings(&[]);
    s.max_restarts = 0;
    let mut pool = Pool::spawn(
        "test",
        &s,
        &sh(dir.path(), "echo serving; exec sleep 100"),
        mock.url(),
    )
    .unwrap();
    assert_eq!(
        pool.generate(&Echo, &request(vec![vec![1]], 1), None, &no_restore)
            .unwrap()
            .len(),
        1
    );
    await_log(&dir.path().join("server.log"), "serving");
    kill(pool.servers()[0].process().unwrap().pid());
    let err = pool
        .generate(&Echo, &request(vec![vec![1]], 1), None, &no_restore)
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, HttpError::GaveUp { .. }), "{text}");
    assert!(
        text.contains("signal: 9")
            && text.contains("| serving")
            && text.contains("`max_restarts` is 0"),
        "{text}"
    );
    assert_eq!(
        mock.requests_to("/gen").len(),
        1,
        "nothing was sent to a dead server"
    );
}

/// A started server whose HTTP side is `mock` and whose process can be killed mid-request: the
/// request for prompt `fatal` kills the process and every request in flight then loses its
/// connection, as with a crashing server, until the server is waited for again (`/health`).
struct Crashing {
    mock: MockServer,
    pid: Arc<AtomicUsize>,
    /// Answers given, per prompt (the first id of the prompt).
    answered: Arc<Mutex<Vec<u32>>>,
}

fn crashing(fatal: u32, kills: usize) -> Crashing {
    let pid = Arc::new(AtomicUsize::new(0));
    let dead = Arc::new(AtomicBool::new(false));
    let kills = Arc::new(AtomicUsize::new(kills));
    let answered = Arc::new(Mutex::new(Vec::new()));
    let (p, a) = (pid.clone(), answered.clone());
    let mock = MockServer::start(move |r| {
        if r.path == "/health" {
            dead.store(false, Ordering::SeqCst);
            return Reply::ok(Value::Null);
        }
        if r.path != "/gen" {
            return Reply::ok(json!({}));
        }
        let first = r.body["prompt"][0].as_u64().unwrap() as u32;
        if first == fatal && kills.load(Ordering::SeqCst) > 0 && !dead.load(Ordering::SeqCst) {
            // The prompts before the fatal one are answered first, however the machine schedules
            // the requests in flight, so which ones must be sent again is known.
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while a.lock().unwrap().iter().filter(|&&p| p < fatal).count() < fatal as usize
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            kills.fetch_sub(1, Ordering::SeqCst);
            dead.store(true, Ordering::SeqCst);
            kill(p.load(Ordering::SeqCst) as u32);
            return Reply::Drop;
        }
        // Prompts after the fatal one are slow: in flight when it crashes.
        if first > fatal {
            std::thread::sleep(Duration::from_millis(300));
        }
        if dead.load(Ordering::SeqCst) {
            return Reply::Drop;
        }
        a.lock().unwrap().push(first);
        echo(r)
    });
    Crashing {
        mock,
        pid,
        answered,
    }
}

#[test]
fn a_started_server_killed_mid_generation_is_restarted_and_only_unfinished_requests_sent_again() {
    let dir = tempfile::tempdir().unwrap();
    let server = crashing(3, 1);
    let mut s = settings(&[]);
    s.max_inflight = 4;
    let launch = sh(dir.path(), "echo serving; exec sleep 100");
    let mut pool = Pool::spawn("test", &s, &launch, server.mock.url()).unwrap();
    server.pid.store(
        pool.servers()[0].process().unwrap().pid() as usize,
        Ordering::SeqCst,
    );
    let restored = Mutex::new(Vec::new());
    let restore = |pool: &Pool, i: usize| -> Result<(), HttpError> {
        // The new process is up before its weights are restored.
        let pid = pool.servers()[i].process().unwrap().pid();
        restored.lock().unwrap().push((i, pid));
        Ok(())
    };
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| vec![i, 100 + i]).collect();
    let out = pool
        .generate(&Echo, &request(prompts.clone(), 2), None, &restore)
        .unwrap();

    // Every prompt has exactly its 2 samples, in order, answered once.
    assert_eq!(out.len(), 16);
    for (k, c) in out.iter().enumerate() {
        let mut want = prompts[k / 2].clone();
        want.push((k % 2) as u32);
        assert_eq!((c.prompt_index as usize, &c.response_ids), (k / 2, &want));
    }
    let mut answered = server.answered.lock().unwrap().clone();
    answered.sort_unstable();
    assert_eq!(
        answered,
        (0..8).collect::<Vec<u32>>(),
        "each prompt answered once"
    );
    // Prompts 0-2 were answered before the crash and not sent again; 3 and those in flight were.
    let sent = |p: u64| {
        server
            .mock
            .requests_to("/gen")
            .iter()
            .filter(|r| r.body["prompt"][0] == p)
            .count()
    };
    for p in 0..3 {
        assert_eq!(sent(p), 1, "prompt {p}");
    }
    assert_eq!(sent(3), 2, "the fatal prompt, sent again");
    // One restart, its weights restored once, on a new process with a log of its own.
    let new_pid = pool.servers()[0].process().unwrap().pid();
    assert_eq!(*restored.lock().unwrap(), [(0, new_pid)]);
    assert_ne!(new_pid as usize, server.pid.load(Ordering::SeqCst));
    await_log(&dir.path().join("server.restart-1.log"), "serving");
    assert!(
        std::fs::read_to_string(dir.path().join("server.log"))
            .unwrap()
            .contains("serving"),
        "the first log is kept"
    );

    // Its allowance spent (max_restarts 1), a second death is the error.
    kill(new_pid);
    let err = pool
        .generate(&Echo, &request(prompts, 1), None, &restore)
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(
            err,
            HttpError::GaveUp {
                max_restarts: 1,
                ..
            }
        ) && text.contains("server.restart-1.log"),
        "{text}"
    );
    assert_eq!(restored.lock().unwrap().len(), 1);
}

#[test]
fn an_attached_server_that_drops_connections_is_not_restarted() {
    let mock = MockServer::start(|r| health_or(r, |_| Reply::Drop));
    let mut s = settings(&[&mock]);
    s.retries = 2;
    let mut pool = Pool::attach("test", &s).unwrap();
    let restore = |_: &Pool, _: usize| -> Result<(), HttpError> {
        panic!("an attached server is never restarted")
    };
    let err = pool
        .generate(&Echo, &request(vec![vec![1], vec![2]], 1), None, &restore)
        .unwrap_err();
    assert!(
        matches!(err, HttpError::Unreachable { attempts: 2, .. }),
        "{err}"
    );
}
