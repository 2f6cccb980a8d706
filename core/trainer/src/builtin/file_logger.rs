//! The `file` tracker: verl's file logger. One JSON object per step, `{"step": N, "data": {…}}`,
//! appended and flushed as it is logged, at `VERL_FILE_LOGGER_PATH` when set, else
//! `<run_dir>/metrics.jsonl`. Non-finite values are written as JSON `null`. Lines are whole: a write
//! that fails part-way (a full disk) is cut back off the file, and the error says the disk is full.
//!
//! The file holds each step once, in order, across crashes and resumes: a run that starts from
//! scratch starts the file over (as verl's file logger does); a run resuming after step N cuts the
//! file back to its whole lines of steps up to N (later ones were left by the interrupted attempt
//! and are trained again) and drops a step it is given again that the file already holds (the
//! trainer logs the steps since the previous checkpoint again after a resume; see
//! `ComponentInit::resume_step`).

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use verl_plugin_api::{
    ComponentInit, ErrorKind, Metric, PluginError, Table, Tracker, TrackerCapabilities,
};

pub const FILE_LOGGER_PATH_ENV: &str = "VERL_FILE_LOGGER_PATH";

#[derive(Default)]
pub struct FileTracker {
    path: PathBuf,
    out: Option<File>,
    /// Steps whose `data` line the file already holds, up to the step the run resumes after.
    held: BTreeSet<u64>,
}

/// An I/O error on `path`, naming a full disk as such.
fn io_error(path: &Path, e: &std::io::Error) -> PluginError {
    let reason = if e.kind() == std::io::ErrorKind::StorageFull {
        format!("the disk is full ({e})")
    } else {
        e.to_string()
    };
    PluginError::new(ErrorKind::IO, format!("{}: {reason}", path.display()))
}

/// Where `file` must be cut so that it keeps only whole lines of steps up to `resume_step`, and
/// the steps whose `data` line it keeps. Lines are in step order; the first later step, torn line
/// (no newline: a crash during a write) or unreadable line ends what is kept.
fn kept_prefix(file: &File, resume_step: u64) -> std::io::Result<(u64, BTreeSet<u64>)> {
    let mut reader = BufReader::new(file);
    let (mut keep, mut held) = (0u64, BTreeSet::new());
    let mut line = Vec::new();
    loop {
        line.clear();
        let read = reader.read_until(b'\n', &mut line)?;
        if read == 0 || line.last() != Some(&b'\n') {
            break;
        }
        let Ok(record) = serde_json::from_slice::<serde_json::Value>(&line) else {
            break;
        };
        match record["step"].as_u64() {
            Some(step) if step <= resume_step => {
                if record.get("data").is_some() {
                    held.insert(step);
                }
            }
            _ => break,
        }
        keep += read as u64;
    }
    Ok((keep, held))
}

impl FileTracker {
    /// Appends `value` as one line in one write; if the write fails part-way, the file is cut back
    /// to where it was, so readers never meet half a line.
    fn write_line(&mut self, value: &serde_json::Value) -> Result<(), PluginError> {
        let path = self.path.clone();
        let out = self
            .out
            .as_mut()
            .ok_or_else(|| PluginError::other("file tracker used before init"))?;
        let mut line = serde_json::to_vec(value)?;
        line.push(b'\n');
        let before = out.metadata().map_err(|e| io_error(&path, &e))?.len();
        if let Err(e) = out.write_all(&line) {
            let _ = out.set_len(before);
            return Err(io_error(&path, &e));
        }
        Ok(())
    }
}

impl Tracker for FileTracker {
    fn capabilities() -> TrackerCapabilities {
        TrackerCapabilities::default().tables(true)
    }

    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        self.path = match std::env::var_os(FILE_LOGGER_PATH_ENV) {
            Some(path) if !path.is_empty() => PathBuf::from(path),
            _ => PathBuf::from(init.run.run_dir.as_str()).join("metrics.jsonl"),
        };
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| PluginError::other(format!("{}: {e}", dir.display())))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&self.path)
            .map_err(|e| io_error(&self.path, &e))?;
        let keep = match init.resume_step {
            None => 0,
            Some(step) => {
                let (keep, held) =
                    kept_prefix(&file, step).map_err(|e| io_error(&self.path, &e))?;
                self.held = held;
                keep
            }
        };
        let len = file.metadata().map_err(|e| io_error(&self.path, &e))?.len();
        if keep < len {
            file.set_len(keep)
                .and_then(|()| file.sync_data())
                .map_err(|e| io_error(&self.path, &e))?;
            let after = init
                .resume_step
                .map_or("a new run starts it over".to_owned(), |s| {
                    format!("the run resumes after step {s}")
                });
            tracing::info!(
                "{}: {} bytes of records dropped: {after}",
                self.path.display(),
                len - keep
            );
        }
        self.out = Some(file);
        tracing::info!("metrics are written to {}", self.path.display());
        Ok(())
    }

    fn log(&mut self, step: u64, metrics: &[Metric]) -> Result<(), PluginError> {
        if self.held.contains(&step) {
            return Ok(());
        }
        let data: serde_json::Map<String, serde_json::Value> = metrics
            .iter()
            .map(|m| (m.key.to_string(), serde_json::json!(m.value)))
            .collect();
        self.write_line(&serde_json::json!({ "step": step, "data": data }))
    }

    /// Tables go to the same file as `{"step", "table": {"name", "columns", "rows"}}` lines, which
    /// readers of `data` skip.
    fn log_table(&mut self, step: u64, table: &Table) -> Result<(), PluginError> {
        let rows: Vec<Vec<&str>> = table
            .rows
            .iter()
            .map(|r| r.iter().map(|c| c.as_str()).collect())
            .collect();
        let columns: Vec<&str> = table.columns.iter().map(|c| c.as_str()).collect();
        self.write_line(&serde_json::json!({ "step": step, "table": { "name": table.name.as_str(), "columns": columns, "rows": rows } }))
    }

    fn finish(&mut self, _exit_code: i32) -> Result<(), PluginError> {
        match self.out.take() {
            Some(out) => out.sync_data().map_err(|e| io_error(&self.path, &e)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_one_flushed_object_per_step() {
        let dir = tempfile::tempdir().unwrap();
        let mut tracker = FileTracker::default();
        let mut init = ComponentInit::default();
        init.run.run_dir = dir.path().to_string_lossy().into_owned();
        tracker.init(&init).unwrap();
        tracker
            .log(
                1,
                &[
                    Metric::new("actor/pg_loss", 0.5),
                    Metric::new("x", f64::NAN),
                ],
            )
            .unwrap();
        // Flushed before finish: a crash loses nothing already logged.
        let text = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        assert_eq!(
            text,
            "{\"data\":{\"actor/pg_loss\":0.5,\"x\":null},\"step\":1}\n"
        );
        tracker
            .log(2, &[Metric::new("actor/pg_loss", 0.25)])
            .unwrap();
        tracker.finish(0).unwrap();
        let lines: Vec<serde_json::Value> =
            std::fs::read_to_string(dir.path().join("metrics.jsonl"))
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
        assert_eq!(lines[1]["step"], 2);
        assert_eq!(lines[1]["data"]["actor/pg_loss"], 0.25);
    }

    fn steps_in(path: &Path) -> Vec<(u64, &'static str)> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                let kind = if v.get("table").is_some() {
                    "table"
                } else {
                    "data"
                };
                (v["step"].as_u64().unwrap(), kind)
            })
            .collect()
    }

    /// Resuming after step 3 keeps the whole lines of steps up to 3, drops the steps logged again
    /// that the file holds and takes those it lacks; a new run starts the file over.
    #[test]
    fn a_resumed_run_holds_each_step_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut init = ComponentInit::default();
        init.run.run_dir = dir.path().to_string_lossy().into_owned();
        let table = Table::new("val/generations", vec!["a".into()], vec![vec!["x".into()]]);
        let mut first = FileTracker::default();
        first.init(&init).unwrap();
        for step in 0..=5 {
            if step == 2 {
                first.log_table(step, &table).unwrap();
            }
            // The interrupted attempt crashed between checkpoint 3's commit and its log.
            if step != 3 {
                first.log(step, &[Metric::new("m", step as f64)]).unwrap();
            }
        }
        // And a torn line at the end, as a kill during a write would leave it.
        OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"step\":6,\"da")
            .unwrap();

        let mut resumed = FileTracker::default();
        init.resume_step = Some(3);
        resumed.init(&init).unwrap();
        assert_eq!(
            steps_in(&path),
            [(0, "data"), (1, "data"), (2, "table"), (2, "data")]
        );
        // The trainer logs steps 2 and 3 again from checkpoint 3, then trains on.
        for step in 2..=5 {
            resumed
                .log(step, &[Metric::new("m", step as f64 + 0.5)])
                .unwrap();
        }
        resumed.finish(0).unwrap();
        let lines = steps_in(&path);
        assert_eq!(
            lines,
            [
                (0, "data"),
                (1, "data"),
                (2, "table"),
                (2, "data"),
                (3, "data"),
                (4, "data"),
                (5, "data")
            ]
        );
        // Step 2 is the first attempt's line; 3.. are new.
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("\"m\":2.0") && text.contains("\"m\":3.5"),
            "{text}"
        );
        assert!(!text.contains("\"m\":2.5"), "{text}");

        init.resume_step = None;
        let mut fresh = FileTracker::default();
        fresh.init(&init).unwrap();
        fresh.log(0, &[Metric::new("m", 9.0)]).unwrap();
        assert_eq!(steps_in(&path), [(0, "data")]);
    }

    /// A full disk (Linux's `/dev/full` fails every write with ENOSPC) is named as such.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_full_disk_is_named() {
        let full = OpenOptions::new().append(true).open("/dev/full").unwrap();
        let mut tracker = FileTracker {
            path: PathBuf::from("/dev/full"),
            out: Some(full),
            held: BTreeSet::new(),
        };
        let err = tracker.log(1, &[Metric::new("x", 1.0)]).unwrap_err();
        assert_eq!(err.kind, ErrorKind::IO);
        assert!(
            err.message().contains("/dev/full: the disk is full"),
            "{err}"
        );
    }
}
