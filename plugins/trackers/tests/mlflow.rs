//! The MLflow tracker against a real `mlflow server` (sqlite backend), read back over REST.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use common::{
    Server, free_port, get_json, metrics, post_json, resumed, spill_lines, started, tool,
};
use serde_json::{Value, json};
use tempfile::TempDir;
use verl_plugin_api::{Metric, Table, Tracker};
use verl_plugin_trackers::MlflowTracker;

const API: &str = "/api/2.0/mlflow";

fn start_mlflow(dir: &Path, port: u16) -> Server {
    let db = format!("sqlite:///{}", dir.join("mlflow.db").display());
    let artifacts = dir.join("artifacts").display().to_string();
    let port_text = port.to_string();
    let args = [
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        &port_text,
        "--backend-store-uri",
        &db,
        "--artifacts-destination",
        &artifacts,
        "--workers",
        "1",
    ];
    Server::start(
        &tool("mlflow"),
        &args,
        &[("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")],
        port,
        "/health",
    )
}

/// One server for the tests that do not stop it (~5.5 s to start).
fn shared_server() -> &'static str {
    static SERVER: OnceLock<(Server, TempDir)> = OnceLock::new();
    &SERVER
        .get_or_init(|| {
            let dir = TempDir::new().unwrap();
            (start_mlflow(dir.path(), free_port()), dir)
        })
        .0
        .url
}

/// The one run of an experiment (each test uses its own experiment).
fn the_run(url: &str, experiment: &str) -> Value {
    try_run(url, experiment).expect("the experiment has a run")
}

/// The experiment's only run, or None while it has none.
fn try_run(url: &str, experiment: &str) -> Option<Value> {
    let lookup = format!("{url}{API}/experiments/get-by-name?experiment_name={experiment}");
    ureq::get(&lookup).call().ok()?;
    let id = get_json(&lookup)["experiment"]["experiment_id"]
        .as_str()?
        .to_owned();
    let runs = post_json(
        &format!("{url}{API}/runs/search"),
        &json!({"experiment_ids": [id]}),
    );
    let runs = runs["runs"].as_array()?;
    assert!(runs.len() <= 1, "{runs:?}");
    runs.first().cloned()
}

/// (step, value) pairs of a metric's history; non-finite values come back as strings.
fn history(url: &str, run_id: &str, key: &str) -> Vec<(u64, Value)> {
    let answer = get_json(&format!(
        "{url}{API}/metrics/get-history?run_id={run_id}&metric_key={}&max_results=100000",
        key.replace('@', "%40")
    ));
    let mut points: Vec<(u64, Value)> = answer["metrics"]
        .as_array()
        .map(|m| {
            m.iter()
                .map(|p| {
                    (
                        p["step"].as_str().map_or_else(
                            || p["step"].as_u64().unwrap_or(0),
                            |s| s.parse().unwrap(),
                        ),
                        p["value"].clone(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    points.sort_by_key(|p| p.0);
    points
}

fn pairs(list: &Value) -> BTreeMap<String, String> {
    list.as_array()
        .map(|l| {
            l.iter()
                .map(|kv| {
                    (
                        kv["key"].as_str().unwrap().to_owned(),
                        kv["value"].as_str().unwrap_or_default().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn metrics_params_tags_and_tables_round_trip() {
    let url = shared_server();
    let dir = TempDir::new().unwrap();
    let config = json!({
        "actor": {"lr": 1e-6, "epochs": 2, "long": "x".repeat(7000)},
        "trackio": {"write_token": "hush"},
        "mlflow": {"tracking_uri": url, "tags": {"team": "rl"}},
    });
    let mut tracker: MlflowTracker = started(config, "roundtrip", "run-a", dir.path());
    for step in 0..20u64 {
        let s = step as f64;
        tracker
            .log(
                step,
                &metrics(&[
                    ("actor/pg_loss", s * 0.5),
                    ("critic/score/mean@4", -s),
                    ("zero", 0.0),
                ]),
            )
            .unwrap();
    }
    let table = Table::new(
        "val/generations",
        vec!["prompt".into(), "response".into(), "score".into()],
        vec![vec!["1+1?".into(), "2".into(), "1.0".into()]],
    );
    tracker.log_table(3, &table).unwrap();
    tracker.finish(0).unwrap();

    let run = the_run(url, "roundtrip");
    let info = &run["info"];
    assert_eq!(info["status"], "FINISHED");
    assert_eq!(info["run_name"], "run-a");
    let run_id = info["run_id"].as_str().unwrap();
    let params = pairs(&run["data"]["params"]);
    assert_eq!(params["actor.lr"], "1e-6");
    assert_eq!(params["actor.epochs"], "2");
    assert_eq!(
        params["actor.long"].len(),
        6000,
        "cut to MLflow's param limit"
    );
    assert_eq!(params["trackio.write_token"], "***");
    let tags = pairs(&run["data"]["tags"]);
    assert_eq!(tags["team"], "rl");
    assert_eq!(tags["mlflow.runName"], "run-a");

    let loss = history(url, run_id, "actor/pg_loss");
    assert_eq!(
        loss,
        (0..20)
            .map(|s| (s, json!(s as f64 * 0.5)))
            .collect::<Vec<_>>()
    );
    assert_eq!(history(url, run_id, "critic/score/mean_at_4").len(), 20);
    assert_eq!(
        history(url, run_id, "zero")
            .iter()
            .filter(|p| p.1 == json!(0.0))
            .count(),
        20
    );

    let artifact = format!(
        "{url}/api/2.0/mlflow-artifacts/artifacts/{}/tables/val_generations_step3.json",
        info["artifact_uri"]
            .as_str()
            .unwrap()
            .trim_start_matches("mlflow-artifacts:/")
    );
    assert_eq!(
        get_json(&artifact),
        json!({"columns": ["prompt", "response", "score"], "data": [["1+1?", "2", "1.0"]]})
    );
    assert!(tags["mlflow.loggedArtifacts"].contains("tables/val_generations_step3.json"));
    assert!(spill_lines(&dir.path().join("mlflow-spill.jsonl")).is_empty());
}

#[test]
fn non_finite_values_are_stored() {
    let url = shared_server();
    let dir = TempDir::new().unwrap();
    let mut tracker: MlflowTracker = started(
        json!({"mlflow": {"tracking_uri": url}}),
        "nonfinite",
        "r",
        dir.path(),
    );
    for (step, v) in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1.25]
        .into_iter()
        .enumerate()
    {
        tracker.log(step as u64, &[Metric::new("x", v)]).unwrap();
    }
    tracker.finish(0).unwrap();
    let run = the_run(url, "nonfinite");
    let points = history(url, run["info"]["run_id"].as_str().unwrap(), "x");
    let values: Vec<String> = points.iter().map(|p| p.1.to_string()).collect();
    assert_eq!(
        points.iter().map(|p| p.0).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    // MLflow's SQL store keeps NaN and clips ±inf to ±f64::MAX (documented MLflow behaviour).
    assert_eq!(
        values,
        vec![
            "\"NaN\"",
            "1.7976931348623157e+308",
            "-1.7976931348623157e+308",
            "1.25"
        ]
    );
    assert!(spill_lines(&dir.path().join("mlflow-spill.jsonl")).is_empty());
}

#[test]
fn steps_larger_than_one_batch_are_split() {
    let url = shared_server();
    let dir = TempDir::new().unwrap();
    let mut tracker: MlflowTracker = started(
        json!({"mlflow": {"tracking_uri": url}}),
        "wide",
        "r",
        dir.path(),
    );
    let wide = |n: usize, step: u64| {
        (0..n)
            .map(|i| Metric::new(format!("m/{i}"), (i as u64 * 10 + step) as f64))
            .collect::<Vec<_>>()
    };
    tracker.log(0, &wide(2500, 0)).unwrap();
    tracker.log(1, &wide(1200, 1)).unwrap();
    tracker.finish(0).unwrap();
    let run = the_run(url, "wide");
    let run_id = run["info"]["run_id"].as_str().unwrap();
    let latest = run["data"]["metrics"].as_array().unwrap();
    assert_eq!(latest.len(), 2500);
    assert_eq!(
        history(url, run_id, "m/0"),
        vec![(0, json!(0.0)), (1, json!(1.0))]
    );
    assert_eq!(history(url, run_id, "m/2499"), vec![(0, json!(24990.0))]);
    assert_eq!(
        history(url, run_id, "m/1199"),
        vec![(0, json!(11990.0)), (1, json!(11991.0))]
    );
    assert!(spill_lines(&dir.path().join("mlflow-spill.jsonl")).is_empty());
}

/// The server goes away mid-run and comes back: every metric ends up on the server or in the
/// spill file, and the run is still marked finished.
#[test]
fn server_restart_loses_nothing() {
    let dir = TempDir::new().unwrap();
    let port = free_port();
    let mut server = start_mlflow(dir.path(), port);
    let url = server.url.clone();
    let config = json!({"mlflow": {"tracking_uri": url, "retries": 1, "backoff_ms": 100, "request_timeout_s": 2}});
    let mut tracker: MlflowTracker = started(config, "restart", "r", dir.path());
    let log = |tracker: &mut MlflowTracker, steps: std::ops::Range<u64>| {
        for step in steps {
            tracker.log(step, &[Metric::new("m", step as f64)]).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    log(&mut tracker, 0..10);
    let run_id = {
        let start = std::time::Instant::now();
        loop {
            if let Some(run) = try_run(&url, "restart") {
                let id = run["info"]["run_id"].as_str().unwrap().to_owned();
                if history(&url, &id, "m").len() == 10 {
                    break id;
                }
            }
            assert!(
                start.elapsed().as_secs() < 30,
                "the first steps never reached the server"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    server.stop();
    log(&mut tracker, 10..20);
    let server = start_mlflow(dir.path(), port);
    log(&mut tracker, 20..30);
    tracker.finish(0).unwrap();

    let on_server: Vec<u64> = history(&server.url, &run_id, "m")
        .iter()
        .map(|p| p.0)
        .collect();
    let spilled: Vec<u64> = spill_lines(&dir.path().join("mlflow-spill.jsonl"))
        .iter()
        .filter(|l| l["metrics"]["m"].is_number())
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    eprintln!("on the server: {on_server:?}\nspilled: {spilled:?}");
    assert!(
        !spilled.is_empty(),
        "steps logged while the server was down are spilled"
    );
    for step in 0..30 {
        assert!(
            on_server.contains(&step) || spilled.contains(&step),
            "step {step} is lost"
        );
    }
    assert_eq!(
        the_run(&server.url, "restart")["info"]["status"],
        "FINISHED"
    );
}

/// A run killed after step 5 was delivered, whose latest checkpoint is step 3, resumes: the
/// tracker continues the same MLflow run, and of what the trainer logs (steps 2 and 3 again from
/// the checkpoint, 4 and 5 trained again, then 6 and 7) nothing the run holds is stored twice. A
/// param whose value changed (a longer run) keeps its first value instead of failing the run.
#[test]
fn a_resumed_run_continues_its_mlflow_run_and_stores_each_step_once() {
    let url = shared_server();
    let dir = TempDir::new().unwrap();
    let config = |total: u64| json!({"mlflow": {"tracking_uri": url}, "trainer": {"total_training_steps": total}});
    let table = Table::new("val/generations", vec!["p".into()], vec![vec!["q".into()]]);
    let mut first: MlflowTracker = started(config(6), "resume", "r", dir.path());
    for step in 0..=5u64 {
        first.log(step, &[Metric::new("m", step as f64)]).unwrap();
    }
    first.log_table(4, &table).unwrap();
    first.finish(1).unwrap();
    let run_id = the_run(url, "resume")["info"]["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        std::fs::read_to_string(dir.path().join("mlflow-run-id")).unwrap(),
        run_id
    );

    let mut again: MlflowTracker = resumed(config(8), "resume", "r", dir.path(), Some(3));
    for step in 2..=7u64 {
        let mut logged = vec![Metric::new("m", step as f64 + 100.0)];
        // A key the run has only from step 6 on.
        if step >= 6 {
            logged.push(Metric::new("late", 1.0));
        }
        again.log(step, &logged).unwrap();
    }
    again.log_table(4, &table).unwrap();
    again.finish(0).unwrap();

    let run = the_run(url, "resume");
    assert_eq!(run["info"]["run_id"], run_id.as_str());
    assert_eq!(run["info"]["status"], "FINISHED");
    let expected: Vec<(u64, Value)> = (0..=7u64)
        .map(|s| (s, json!(if s <= 5 { s as f64 } else { s as f64 + 100.0 })))
        .collect();
    assert_eq!(history(url, &run_id, "m"), expected);
    assert_eq!(
        history(url, &run_id, "late"),
        vec![(6, json!(1.0)), (7, json!(1.0))]
    );
    assert_eq!(
        pairs(&run["data"]["params"])["trainer.total_training_steps"],
        "6"
    );
    let tags = pairs(&run["data"]["tags"]);
    assert_eq!(
        tags["mlflow.loggedArtifacts"]
            .matches("tables/val_generations_step4.json")
            .count(),
        1,
        "{tags:?}"
    );
    assert!(spill_lines(&dir.path().join("mlflow-spill.jsonl")).is_empty());
}
