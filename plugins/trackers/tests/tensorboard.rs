//! The TensorBoard tracker's event files, read back by TensorBoard's own EventAccumulator.

mod common;

use std::path::Path;

use common::{metrics, resumed, run_python, started};
use serde_json::{Value, json};
use tempfile::TempDir;
use verl_plugin_api::{Table, Tracker};
use verl_plugin_trackers::TensorboardTracker;

/// Every scalar of every tag as `{tag: [[step, value], …]}`. EventAccumulator drops corrupt
/// records silently, so callers compare counts.
const READ_SCALARS: &str = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
print(json.dumps({tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}))
"#;

fn scalars(dir: &Path) -> Value {
    run_python(READ_SCALARS, &[dir.to_str().unwrap()])
}

#[test]
fn scalars_read_back_with_steps_and_values() {
    let dir = TempDir::new().unwrap();
    let logdir = dir.path().join("tb");
    let mut tracker: TensorboardTracker = started(
        json!({"tensorboard": {"dir": logdir}}),
        "proj",
        "exp",
        dir.path(),
    );
    let value = |step: u64| step as f64 * 0.25 - 3.0;
    let log_steps = |tracker: &mut TensorboardTracker, steps: std::ops::Range<u64>| {
        for step in steps {
            let values = [
                ("actor/pg_loss", value(step)),
                ("zero", 0.0),
                ("critic/vf_loss", 1e6 + step as f64),
            ];
            tracker.log(step, &metrics(&values)).unwrap();
        }
    };
    log_steps(&mut tracker, 0..40);
    // Written incrementally: readable before `finish`.
    let events_dir = logdir.join("proj").join("exp");
    let start = std::time::Instant::now();
    let early = loop {
        let read = scalars(&events_dir);
        if read["zero"].as_array().is_some_and(|s| s.len() == 40) || start.elapsed().as_secs() > 10
        {
            break read;
        }
    };
    assert_eq!(early["zero"].as_array().unwrap().len(), 40);

    log_steps(&mut tracker, 40..100);
    let table = Table::new(
        "val/generations",
        vec!["prompt".into()],
        vec![vec!["q".into()]],
    );
    tracker.log_table(99, &table).unwrap();
    tracker.finish(0).unwrap();

    let read = scalars(&events_dir);
    let tags: Vec<&String> = read.as_object().unwrap().keys().collect();
    assert_eq!(tags, ["actor/pg_loss", "critic/vf_loss", "zero"]);
    let expect = |f: &dyn Fn(u64) -> f64| {
        json!(
            (0..100)
                .map(|s| json!([s, f(s) as f32 as f64]))
                .collect::<Vec<_>>()
        )
    };
    assert_eq!(read["actor/pg_loss"], expect(&value));
    assert_eq!(read["zero"], expect(&|_| 0.0));
    assert_eq!(read["critic/vf_loss"], expect(&|s| 1e6 + s as f64));

    let tables = std::fs::read_to_string(dir.path().join("tensorboard-tables.jsonl")).unwrap();
    assert_eq!(tables.lines().count(), 1);
    assert!(tables.contains("val/generations"));
    assert!(!dir.path().join("tensorboard-spill.jsonl").exists());
}

/// A run killed after logging step 5, whose latest checkpoint is step 3, resumes: the trainer logs
/// steps 2 and 3 again (the records since checkpoint 1) and trains 4 and on again. TensorBoard
/// shows each step once, the resumed process's values from step 2 on, and the tables file keeps
/// the tables up to step 3. A new run in the same directory then replaces everything.
#[test]
fn a_resumed_run_shows_each_step_once() {
    let dir = TempDir::new().unwrap();
    let config = json!({"tensorboard": {"dir": dir.path().join("tb")}});
    let events_dir = dir.path().join("tb/proj/exp");
    let table = Table::new("val/generations", vec!["p".into()], vec![vec!["q".into()]]);
    let run = |resume_step: Option<u64>, steps: std::ops::RangeInclusive<u64>, offset: f64| {
        let mut tracker: TensorboardTracker =
            resumed(config.clone(), "proj", "exp", dir.path(), resume_step);
        for step in steps {
            // Validation tables at steps 2 and 5; a resumed trainer logs none again.
            if step % 3 == 2 && resume_step.is_none_or(|r| step > r) {
                tracker.log_table(step, &table).unwrap();
            }
            tracker
                .log(step, &metrics(&[("m", step as f64 + offset)]))
                .unwrap();
        }
        tracker.finish(0).unwrap();
    };
    let table_steps = || -> Vec<u64> {
        std::fs::read_to_string(dir.path().join("tensorboard-tables.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect()
    };

    run(None, 0..=5, 0.0);
    run(Some(3), 2..=7, 100.0);
    let steps: Vec<Value> = (0..=7)
        .map(|s| json!([s, if s < 2 { s as f64 } else { s as f64 + 100.0 }]))
        .collect();
    assert_eq!(scalars(&events_dir)["m"], json!(steps));
    // Step 5's table of the first attempt is dropped; the resumed process logs it again.
    assert_eq!(table_steps(), [2, 5]);

    run(None, 0..=1, 1000.0);
    assert_eq!(scalars(&events_dir)["m"], json!([[0, 1000.0], [1, 1001.0]]));
    assert_eq!(table_steps(), Vec::<u64>::new());
}
