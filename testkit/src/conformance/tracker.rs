//! The tracker suite: N steps logged, a table if declared, `finish` flushes, and nothing was lost.
//!
//! "Nothing lost" is checked offline: each step logs a step-unique key
//! (`conformance/step_<NNNN>`) next to common ones, and after `finish` every such key must be
//! found in the files the tracker wrote under the run directory (JSON lines, TensorBoard event
//! files, a spill file of what a server did not take, …). A tracker that writes nothing there
//! (console output, a remote service without a local spill) is skipped with that reason.

use std::path::Path;

use serde_json::json;
use verl_plugin_api::{ComponentInit, Metric, RunContext, Table, TrackerCapabilities};

use super::{Outcome, Suite, call, ensure, ok_or_unsupported, tempdir};

pub const CHECKS: &[&str] = &["init", "log_steps", "log_table", "finish", "nothing_lost"];

fn marker(step: u64) -> String {
    format!("conformance/step_{step:04}")
}

fn files(dir: &Path, out: &mut Vec<Vec<u8>>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files(&path, out);
        } else if let Ok(bytes) = std::fs::read(&path) {
            out.push(bytes);
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

pub fn run(suite: &mut Suite) {
    let caps: TrackerCapabilities = suite.component.capabilities();
    let steps = suite.options.tracker_steps.max(1);
    let dir = match tempdir() {
        Ok(d) => d,
        Err(e) => {
            suite.check("init", || Err(e.clone()));
            return;
        }
    };
    let component = suite.component.clone();
    let mut tracker = None;
    if !suite.check("init", || {
        let mut t = component.create_tracker().map_err(|e| e.to_string())?;
        let mut run = RunContext::default();
        run.project = "verl-conformance".into();
        run.experiment = format!("certify-{}", component.name);
        run.run_dir = dir.path().to_string_lossy().into_owned();
        let config = json!({"trainer": {
            "project_name": run.project, "experiment_name": run.experiment,
            "default_local_dir": run.run_dir, "total_training_steps": steps,
        }});
        call("init", t.init(&ComponentInit::new(config, run)))?;
        tracker = Some(t);
        Ok(Outcome::Pass)
    }) {
        for check in &CHECKS[1..] {
            suite.skip(check, "needs `init`, which failed");
        }
        return;
    }
    let mut tracker = tracker.expect("init passed");
    suite.check("log_steps", || {
        for step in 1..=steps {
            let metrics = [
                Metric::new("actor/pg_loss", 1.0 / step as f64),
                Metric::new("critic/score/mean", step as f64 * 0.5),
                Metric::new(marker(step), step as f64),
            ];
            call(&format!("log of step {step}"), tracker.log(step, &metrics))?;
        }
        Ok(Outcome::Pass)
    });
    suite.check("log_table", || {
        let table = Table::new(
            "val/generations",
            vec!["input".into(), "output".into(), "score".into()],
            vec![vec!["1+1=".into(), "#### 2".into(), "1.0".into()]],
        );
        let r = tracker.log_table(steps, &table);
        if caps.tables {
            call("log_table (tables declared)", r)?;
        } else {
            ok_or_unsupported("log_table (tables not declared)", r)?;
        }
        Ok(Outcome::Pass)
    });
    suite.check("finish", || {
        call("finish", tracker.finish(0))?;
        Ok(Outcome::Pass)
    });
    suite.check("nothing_lost", || {
        let mut written = Vec::new();
        files(dir.path(), &mut written);
        if written.iter().all(Vec::is_empty) {
            return Ok(Outcome::Skipped(
                "the tracker wrote nothing under the run directory, so delivery cannot be verified offline".into(),
            ));
        }
        let missing: Vec<u64> = (1..=steps)
            .filter(|&s| !written.iter().any(|f| contains(f, marker(s).as_bytes())))
            .collect();
        ensure(missing.is_empty(), || {
            format!("after finish, {} of {steps} logged steps are in no file under the run directory (first missing: step {})", missing.len(), missing[0])
        })?;
        Ok(Outcome::Pass)
    });
}
