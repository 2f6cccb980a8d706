//! The `file` tracker: verl's file logger. One JSON object per step, `{"step": N, "data": {…}}`,
//! appended and flushed as it is logged, at `VERL_FILE_LOGGER_PATH` when set, else
//! `<run_dir>/metrics.jsonl`. Non-finite values are written as JSON `null`. Lines are whole: a write
//! that fails part-way (a full disk) is cut back off the file, and the error says the disk is full.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;

use verl_plugin_api::{
    ComponentInit, ErrorKind, Metric, PluginError, Table, Tracker, TrackerCapabilities,
};

pub const FILE_LOGGER_PATH_ENV: &str = "VERL_FILE_LOGGER_PATH";

#[derive(Default)]
pub struct FileTracker {
    path: PathBuf,
    out: Option<File>,
}

/// An I/O error on `path`, naming a full disk as such.
fn io_error(path: &std::path::Path, e: &std::io::Error) -> PluginError {
    let reason = if e.kind() == std::io::ErrorKind::StorageFull {
        format!("the disk is full ({e})")
    } else {
        e.to_string()
    };
    PluginError::new(ErrorKind::IO, format!("{}: {reason}", path.display()))
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
            .append(true)
            .open(&self.path)
            .map_err(|e| PluginError::other(format!("{}: {e}", self.path.display())))?;
        self.out = Some(file);
        tracing::info!("metrics are written to {}", self.path.display());
        Ok(())
    }

    fn log(&mut self, step: u64, metrics: &[Metric]) -> Result<(), PluginError> {
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

    /// A full disk (Linux's `/dev/full` fails every write with ENOSPC) is named as such.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_full_disk_is_named() {
        let full = OpenOptions::new().append(true).open("/dev/full").unwrap();
        let mut tracker = FileTracker {
            path: PathBuf::from("/dev/full"),
            out: Some(full),
        };
        let err = tracker.log(1, &[Metric::new("x", 1.0)]).unwrap_err();
        assert_eq!(err.kind, ErrorKind::IO);
        assert!(
            err.message().contains("/dev/full: the disk is full"),
            "{err}"
        );
    }
}
