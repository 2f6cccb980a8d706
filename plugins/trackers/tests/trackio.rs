//! The Trackio tracker against a real `trackio show` server, read back through its HTTP API.

mod common;

use std::path::Path;

use common::{Server, free_port, metrics, post_json, spill_lines, started, tool};
use serde_json::json;
use tempfile::TempDir;
use verl_plugin_api::{Metric, Table, Tracker};
use verl_plugin_trackers::TrackioTracker;

/// `trackio show` with its data in `dir` and the write token `token`.
fn start_trackio(dir: &Path, token: &str) -> Server {
    let port = free_port();
    let data = dir.join("trackio");
    let envs = [
        ("TRACKIO_DIR", data.to_str().unwrap()),
        ("TRACKIO_WRITE_TOKEN", token),
        ("GRADIO_SERVER_PORT", &port.to_string()),
    ];
    Server::start(&tool("trackio"), &["show"], &envs, port, "/version")
}

#[test]
fn metrics_config_and_tables_read_back() {
    let dir = TempDir::new().unwrap();
    let server = start_trackio(dir.path(), "tok");
    let url = &server.url;

    // The write-access URL as `trackio show` prints it carries the token.
    let config =
        json!({"trackio": {"server_url": format!("{url}/?write_token=tok")}, "actor": {"lr": 0.5}});
    let mut tracker: TrackioTracker = started(config, "tproj", "trun", dir.path());
    for step in 0..25u64 {
        tracker
            .log(
                step,
                &metrics(&[
                    ("actor/pg_loss", step as f64 * 2.0),
                    ("critic/score", 1.0 - step as f64),
                ]),
            )
            .unwrap();
    }
    tracker.log(25, &[Metric::new("odd", f64::NAN)]).unwrap();
    let table = Table::new(
        "val/generations",
        vec!["prompt".into(), "score".into()],
        vec![vec!["q".into(), "1".into()]],
    );
    tracker.log_table(25, &table).unwrap();
    tracker.finish(0).unwrap();

    let api = |name: &str, body: serde_json::Value| {
        post_json(&format!("{url}/api/{name}"), &body)["data"].clone()
    };
    let values = api(
        "get_metric_values",
        json!({"project": "tproj", "run": "trun", "metric_name": "actor/pg_loss"}),
    );
    let points: Vec<(u64, f64)> = values
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["step"].as_u64().unwrap(), v["value"].as_f64().unwrap()))
        .collect();
    assert_eq!(
        points,
        (0..25).map(|s| (s, s as f64 * 2.0)).collect::<Vec<_>>()
    );

    let logs = api("get_logs", json!({"project": "tproj", "run": "trun"}));
    let logs = logs.as_array().unwrap();
    assert_eq!(
        logs.iter()
            .filter(|l| l.get("critic/score").is_some())
            .count(),
        25
    );
    // JSON cannot carry NaN: trackio stores it as "NaN" and its API answers null.
    let odd = logs
        .iter()
        .find(|l| l.get("odd").is_some())
        .expect("the NaN step is stored");
    assert_eq!(odd["step"], 25);
    assert!(odd["odd"].is_null());
    let logged_table = logs
        .iter()
        .find_map(|l| l.get("val/generations"))
        .expect("the table is stored");
    assert_eq!(logged_table["_type"], "trackio.table");
    assert_eq!(
        logged_table["_value"],
        json!([{"prompt": "q", "score": "1"}])
    );

    let configs = api("get_run_configs", json!({"project": "tproj"}));
    let run_config = configs.as_object().unwrap().values().next().unwrap();
    assert_eq!(run_config["actor"]["lr"], 0.5);
    assert_eq!(
        run_config["trackio"]["server_url"],
        format!("{url}/?write_token=***"),
        "credentials are masked"
    );
    assert!(spill_lines(&dir.path().join("trackio-spill.jsonl")).is_empty());
}

#[test]
fn a_wrong_token_spills_and_never_fails_the_run() {
    let dir = TempDir::new().unwrap();
    let server = start_trackio(dir.path(), "right");
    let config = json!({"trackio": {"server_url": server.url, "write_token": "wrong"}});
    let mut tracker: TrackioTracker = started(config, "p", "r", dir.path());
    for step in 0..5 {
        tracker.log(step, &[Metric::new("m", step as f64)]).unwrap();
    }
    tracker.finish(0).unwrap();
    let spilled = spill_lines(&dir.path().join("trackio-spill.jsonl"));
    let steps: Vec<u64> = spilled
        .iter()
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [0, 1, 2, 3, 4]);
    assert!(
        spilled[0]["reason"]
            .as_str()
            .unwrap()
            .contains("write_token"),
        "{}",
        spilled[0]
    );
}
