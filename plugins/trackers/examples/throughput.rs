//! How long `Tracker::log` holds the training thread at 10 000 metrics per step for 100 steps:
//! with TensorBoard (local files) and with MLflow pointed at a server that accepts connections and
//! never answers (the worst case for a network tracker).
//!
//!     cargo run --release -p verl-plugin-trackers --example throughput

use std::io::Read;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use serde_json::json;
use verl_plugin_api::{ComponentInit, Metric, RunContext, Tracker};
use verl_plugin_trackers::{MlflowTracker, TensorboardTracker};

const STEPS: u64 = 100;
const METRICS: usize = 10_000;

fn measure(
    name: &str,
    tracker: &mut dyn Tracker,
    config: serde_json::Value,
    run_dir: &std::path::Path,
) {
    let mut run = RunContext::default();
    run.project = "bench".into();
    run.experiment = "throughput".into();
    run.run_dir = run_dir.to_string_lossy().into_owned();
    let init = ComponentInit::new(config, run);
    tracker.init(&init).unwrap();
    let keys: Vec<String> = (0..METRICS)
        .map(|i| format!("bench/metric_{i:05}"))
        .collect();
    let mut calls = Vec::with_capacity(STEPS as usize);
    let start = Instant::now();
    for step in 0..STEPS {
        // Built outside the timed call, as a trainer has its metrics before logging them.
        let metrics: Vec<Metric> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| Metric::new(k.as_str(), (i as u64 + step) as f64))
            .collect();
        let t = Instant::now();
        tracker.log(step, &metrics).unwrap();
        calls.push(t.elapsed());
    }
    let logging = start.elapsed();
    let t = Instant::now();
    tracker.finish(0).unwrap();
    let finish = t.elapsed();
    let total: Duration = calls.iter().sum();
    calls.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{name}: {STEPS} steps x {METRICS} metrics: log() mean {:.2} ms, median {:.2} ms, max {:.2} ms per step ({:.1} M metrics/s accepted); loop {:.0} ms; finish {:.0} ms",
        ms(total) / STEPS as f64,
        ms(calls[calls.len() / 2]),
        ms(*calls.last().unwrap()),
        (STEPS as f64 * METRICS as f64) / total.as_secs_f64() / 1e6,
        ms(logging),
        ms(finish),
    );
}

fn main() {
    let dir = tempfile::TempDir::new().unwrap();

    let tb_dir = dir.path().join("tb");
    measure(
        "tensorboard",
        &mut TensorboardTracker::new(),
        json!({"tensorboard": {"dir": tb_dir}}),
        dir.path(),
    );
    let written: u64 = walk_size(&tb_dir);
    println!(
        "tensorboard: {:.1} MB of events written",
        written as f64 / 1e6
    );

    // Accepts connections and never answers: every request runs into its timeout.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for mut stream in listener.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = stream.set_read_timeout(Some(Duration::from_millis(10)));
            let _ = stream.read(&mut buf);
            held.push(stream);
        }
    });
    let config = json!({"mlflow": {"tracking_uri": url, "request_timeout_s": 1, "retries": 0, "finish_timeout_s": 2}});
    measure(
        "mlflow (server never answers)",
        &mut MlflowTracker::new(),
        config,
        dir.path(),
    );
    let spill = std::fs::read_to_string(dir.path().join("mlflow-spill.jsonl")).unwrap_or_default();
    let spilled: usize = spill
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["metrics"]
                .as_object()
                .map_or(0, |m| m.len())
        })
        .sum();
    println!(
        "mlflow: {spilled} of {} metrics in the spill file, none lost",
        STEPS as usize * METRICS
    );
    assert_eq!(spilled, STEPS as usize * METRICS);
}

fn walk_size(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| {
                    if e.path().is_dir() {
                        walk_size(&e.path())
                    } else {
                        e.metadata().map_or(0, |m| m.len())
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}
