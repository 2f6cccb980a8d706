//! The `http` reward against a scripted server (std only) and against `reward_server.py` serving a
//! Python reward function; its conformance suite, as a plugin author runs it without the host.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use verl_plugin_api::{
    ComponentInit, ComponentKind, Reward, RewardItem, RewardRequest, RewardScore, RunContext,
};
use verl_plugin_host::Registry;
use verl_plugin_reward_http::HttpReward;
use verl_testkit::conformance::{Options, certify_components};

type Handler = dyn Fn(usize, &Value) -> (u16, String, Duration) + Send + Sync;

/// A one-request-per-connection HTTP server; `handler` gets the request's number and JSON body.
struct Mock {
    url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

impl Mock {
    fn start(
        handler: impl Fn(usize, &Value) -> (u16, String, Duration) + Send + Sync + 'static,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/score", listener.local_addr().unwrap());
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let handler: Arc<Handler> = Arc::new(handler);
        let seen = bodies.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (handler, seen) = (handler.clone(), seen.clone());
                std::thread::spawn(move || serve(stream, &*handler, &seen));
            }
        });
        Self { url, bodies }
    }

    fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().clone()
    }
}

fn serve(stream: TcpStream, handler: &Handler, seen: &Mutex<Vec<Value>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    let body: Value = serde_json::from_slice(&body).unwrap();
    let number = {
        let mut seen = seen.lock().unwrap();
        seen.push(body.clone());
        seen.len() - 1
    };
    let (status, text, delay) = handler(number, &body);
    std::thread::sleep(delay);
    let mut stream = stream;
    let _ = write!(
        stream,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
}

/// Scores each item with the number in its solution.
fn echo(body: &Value) -> String {
    let scores: Vec<Value> = body["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| {
            json!(
                item["solution_str"]
                    .as_str()
                    .unwrap()
                    .parse::<f64>()
                    .unwrap()
            )
        })
        .collect();
    json!({ "scores": scores }).to_string()
}

fn ok(text: String) -> (u16, String, Duration) {
    (200, text, Duration::ZERO)
}

fn reward(url: &str, kwargs: Value) -> Result<HttpReward, verl_plugin_api::PluginError> {
    let mut r = HttpReward::default();
    let config = json!({"path": url, "name": "my_score", "reward_kwargs": kwargs});
    r.init(&ComponentInit::new(config, RunContext::default()))?;
    Ok(r)
}

fn items(n: usize) -> RewardRequest {
    RewardRequest::new(
        (0..n)
            .map(|i| {
                RewardItem::new("my/data", i.to_string(), json!({"target": ["x"]}))
                    .extra_info(json!({"index": i}))
            })
            .collect(),
    )
}

#[test]
fn batches_concurrently_in_order_with_kwargs() {
    let mock = Mock::start(|_, body| ok(echo(body)));
    let mut r = reward(
        &mock.url,
        json!({"batch_size": 3, "max_concurrency": 2, "format_score": 0.1}),
    )
    .unwrap();
    let out = r.compute(&items(10)).unwrap();
    let scores: Vec<f64> = out.scores.iter().map(|s| s.score).collect();
    assert_eq!(scores, (0..10).map(f64::from).collect::<Vec<_>>());
    let bodies = mock.bodies();
    assert_eq!(bodies.len(), 4);
    for body in &bodies {
        assert!(body["items"].as_array().unwrap().len() <= 3);
        assert_eq!(body["name"], "my_score");
        // The plugin's own keys stay here; the rest are the function's.
        assert_eq!(body["kwargs"], json!({"format_score": 0.1}));
    }
    let first = &bodies
        .iter()
        .find(|b| b["items"][0]["solution_str"] == "0")
        .unwrap()["items"][0];
    assert_eq!(
        *first,
        json!({"data_source": "my/data", "solution_str": "0", "ground_truth": {"target": ["x"]}, "extra_info": {"index": 0}})
    );
    assert!(r.compute(&items(0)).unwrap().scores.is_empty());
}

#[test]
fn dict_results_keep_their_extra_keys() {
    let mock = Mock::start(|_, _| {
        ok(json!({"scores": [{"score": -1, "acc": false, "pred": "7"}, true]}).to_string())
    });
    let out = reward(&mock.url, json!({}))
        .unwrap()
        .compute(&items(2))
        .unwrap();
    assert_eq!(
        out.scores,
        vec![
            RewardScore::new(-1.0).with("acc", false).with("pred", "7"),
            RewardScore::new(1.0)
        ]
    );
}

#[test]
fn transient_failures_are_retried() {
    let mock = Mock::start(|n, body| {
        if n < 2 {
            (
                503,
                json!({"error": "warming up"}).to_string(),
                Duration::ZERO,
            )
        } else {
            ok(echo(body))
        }
    });
    let out = reward(&mock.url, json!({}))
        .unwrap()
        .compute(&items(2))
        .unwrap();
    assert_eq!(out.scores.len(), 2);
    assert_eq!(mock.bodies().len(), 3);

    let mock = Mock::start(|_, _| {
        (
            503,
            json!({"error": "warming up"}).to_string(),
            Duration::ZERO,
        )
    });
    let err = reward(&mock.url, json!({"max_retries": 1}))
        .unwrap()
        .compute(&items(2))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("HTTP 503")
            && err.contains("warming up")
            && err.contains("2 attempts")
            && err.contains(&mock.url),
        "{err}"
    );
}

#[test]
fn client_errors_fail_at_once_with_the_servers_words() {
    let mock = Mock::start(|_, _| {
        (
            400,
            json!({"error": "item 1: KeyError: 'target'"}).to_string(),
            Duration::ZERO,
        )
    });
    let err = reward(&mock.url, json!({}))
        .unwrap()
        .compute(&items(2))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("HTTP 400")
            && err.contains("KeyError: 'target'")
            && err.contains("items 0..=1"),
        "{err}"
    );
    assert_eq!(mock.bodies().len(), 1);
    // Wrong shapes: a score short, a score that is text.
    for reply in [
        json!({"scores": [1]}),
        json!({"scores": [1, "high"]}),
        json!({"score": 1}),
    ] {
        let text = reply.to_string();
        let mock = Mock::start(move |_, _| ok(text.clone()));
        let err = reward(&mock.url, json!({}))
            .unwrap()
            .compute(&items(2))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("scores") || err.contains("item 1"),
            "{reply}: {err}"
        );
    }
}

#[test]
fn a_slow_server_times_out() {
    let mock = Mock::start(|_, body| (200, echo(body), Duration::from_secs(3)));
    let start = Instant::now();
    let err = reward(&mock.url, json!({"timeout_s": 0.3, "max_retries": 0}))
        .unwrap()
        .compute(&items(1))
        .unwrap_err()
        .to_string();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert!(
        err.to_lowercase().contains("timeout") || err.to_lowercase().contains("timed out"),
        "{err}"
    );
}

#[test]
fn bad_settings_are_config_errors() {
    for (path, kwargs, words) in [
        (Value::Null, json!({}), "URL"),
        (json!("/tmp/x.so"), json!({}), "URL"),
        (
            json!("http://127.0.0.1:9"),
            json!({"timeout_s": 0}),
            "timeout_s",
        ),
        (
            json!("http://127.0.0.1:9"),
            json!({"batch_size": 0}),
            "batch_size",
        ),
        (
            json!("http://127.0.0.1:9"),
            json!({"max_retries": "x"}),
            "reward_kwargs",
        ),
    ] {
        let mut r = HttpReward::default();
        let config = json!({"path": path, "name": "compute_score", "reward_kwargs": kwargs});
        let err = r
            .init(&ComponentInit::new(config, RunContext::default()))
            .unwrap_err();
        assert_eq!(
            err.kind,
            verl_plugin_api::ErrorKind::INVALID_CONFIG,
            "{err}"
        );
        assert!(err.message().contains(words), "{err}");
    }
}

fn certify(url: &str) -> verl_testkit::conformance::Report {
    let mut registry = Registry::default();
    registry.add_builtin(verl_plugin_reward_http::plugin());
    let component = registry.resolve(ComponentKind::REWARD, "http").unwrap();
    let options = Options::default()
        .reward_config(json!({"path": url, "name": "compute_score", "reward_kwargs": {}}));
    verl_testkit::conformance::Report {
        plugin: "reward-http".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        path: "<test>".into(),
        checks: certify_components(&[component], &options),
    }
}

#[test]
fn conformance_against_a_scripted_server() {
    let mock = Mock::start(|_, body| ok(echo_lengths(body)));
    let report = certify(&mock.url);
    assert!(report.passed(), "{}", report.table());
    assert!(
        report
            .checks
            .iter()
            .all(|c| c.outcome == verl_testkit::conformance::Outcome::Pass
                || c.name == "undeclared_source_refused"),
        "{}",
        report.table()
    );
    // Without a server URL the suite says what it needs instead of failing.
    let mut registry = Registry::default();
    registry.add_builtin(verl_plugin_reward_http::plugin());
    let component = registry.resolve(ComponentKind::REWARD, "http").unwrap();
    let checks = certify_components(&[component], &Options::default());
    assert!(checks.iter().all(|c| !c.outcome.is_fail()), "{checks:?}");
    assert!(checks[0].reason.contains("URL"), "{checks:?}");
}

/// The built library, loaded as the host loads plugins (vetted, dlopen'ed, its reward component
/// created through the factory's 2.2 entry) and certified against a scripted server.
#[test]
fn the_library_certifies_through_the_abi() {
    // Cargo builds the cdylib next to this test binary (target/<profile>/deps).
    let exe = std::env::current_exe().unwrap();
    let library = exe.parent().unwrap().join(format!(
        "{}verl_plugin_reward_http{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    let mock = Mock::start(|_, body| ok(echo_lengths(body)));
    let options = Options::default().reward_config(
        json!({"path": mock.url, "name": "compute_score", "reward_kwargs": {"batch_size": 4}}),
    );
    let report = verl_testkit::conformance::certify_file(&library, None, &options)
        .unwrap_or_else(|e| panic!("{}: {e}", library.display()));
    assert!(report.passed(), "{}", report.table());
    assert_eq!(report.plugin, "reward-http");
    let passed = report.counts().0;
    assert_eq!(passed, 5, "{}", report.table());
    assert!(!mock.bodies().is_empty());
}

/// A deterministic function of each solution's length.
fn echo_lengths(body: &Value) -> String {
    let scores: Vec<f64> = body["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["solution_str"].as_str().unwrap().len() % 7) as f64)
        .collect();
    json!({ "scores": scores }).to_string()
}

/// `reward_server.py` running a Python reward function, killed when dropped.
struct PythonServer {
    child: Child,
    url: String,
}

impl Drop for PythonServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn python_server(dir: &std::path::Path, source: &str) -> Option<PythonServer> {
    let file = dir.join("my_reward.py");
    std::fs::write(&file, source).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/reward_server.py");
    let mut child = match Command::new("python3")
        .args([script, file.to_str().unwrap(), "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => panic!("python3 is needed for this test: {e}"),
    };
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line.trim().strip_prefix("listening on ")?.to_owned();
    Some(PythonServer { child, url })
}

const PYTHON_REWARD: &str = r#"
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    if data_source == "boom":
        raise ValueError("cannot score " + solution_str)
    correct = solution_str.strip().endswith(str(ground_truth))
    if data_source == "dict":
        return {"score": 1.0 if correct else -1.0, "acc": correct, "index": (extra_info or {}).get("index")}
    return (1.0 if correct else 0.0) + bonus
"#;

#[test]
fn a_python_reward_function_behind_reward_server_py() {
    let dir = tempfile::tempdir().unwrap();
    let server = python_server(dir.path(), PYTHON_REWARD).expect("the server starts");
    let mut r = reward(&server.url, json!({"bonus": 0.5, "batch_size": 2})).unwrap();
    // `reward()` names `my_score`, which the file lacks: the server's message says so.
    let err = r.compute(&items(1)).unwrap_err().to_string();
    assert!(err.contains("no function `my_score`"), "{err}");

    let mut r = HttpReward::default();
    let config = json!({"path": server.url, "name": "compute_score", "reward_kwargs": {"bonus": 0.5, "batch_size": 2}});
    r.init(&ComponentInit::new(config, RunContext::default()))
        .unwrap();
    let request = RewardRequest::new(vec![
        RewardItem::new("plain", "so #### 42", "42"),
        RewardItem::new("plain", "so 41", "42"),
        RewardItem::new("dict", "42", "42").extra_info(json!({"index": 7})),
    ]);
    let out = r.compute(&request).unwrap();
    assert_eq!(
        out.scores,
        vec![
            RewardScore::new(1.5),
            RewardScore::new(0.5),
            RewardScore::new(1.0).with("acc", true).with("index", 7)
        ]
    );
    let err = r
        .compute(&RewardRequest::new(vec![RewardItem::new("boom", "x", "1")]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ValueError: cannot score x") && err.contains("HTTP 500"),
        "{err}"
    );
    let report = certify(&server.url);
    assert!(report.passed(), "{}", report.table());
}
