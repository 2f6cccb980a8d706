//! The wandb tracker's offline run, read back with the wandb package: its own protobuf classes
//! (`wandb_internal_pb2.Record`) parse every record, and `wandb sync` (wandb-core's reader, the
//! one that uploads) reads the header and run record. wandb 0.31 has no Python LevelDB-log reader
//! any more, so the script unpacks the log chunks itself.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{metrics, run_python, started, tool};
use serde_json::{Value, json};
use tempfile::TempDir;
use verl_plugin_api::{Metric, Table, Tracker};
use verl_plugin_trackers::WandbTracker;

/// The records of a `.wandb` file as JSON (non-finite floats as their Python repr).
const READ_RUN: &str = r#"
import json, math, struct, sys, zlib
from wandb.proto import wandb_internal_pb2 as pb

def records(path):
    """LevelDB log: 7-byte W&B header, 32 KiB blocks of chunks (crc32, u16 length, type)."""
    raw = open(path, "rb").read()
    assert raw[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), raw[:7]
    pos, parts = 7, b""
    while pos < len(raw):
        if 32768 - pos % 32768 < 7:
            assert raw[pos:pos + 32768 - pos % 32768].strip(b"\0") == b""
            pos += 32768 - pos % 32768
            continue
        crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data = raw[pos + 7:pos + 7 + length]
        assert crc == zlib.crc32(data, zlib.crc32(bytes([kind]))), f"bad crc at {pos}"
        assert 32768 - pos % 32768 >= 7 + length, "chunk crosses a block"
        pos += 7 + length
        parts += data
        if kind in (1, 4):
            yield parts
            parts = b""
    assert parts == b"", "truncated record"

def value(text):
    v = json.loads(text)
    return repr(v) if isinstance(v, float) and not math.isfinite(v) else v

def items(entries):
    return {i.key: value(i.value_json) for i in entries}

out = {"history": [], "files": [], "kinds": []}
for data in records(sys.argv[1]):
    r = pb.Record()
    r.ParseFromString(data)
    kind = r.WhichOneof("record_type")
    out["kinds"].append(kind)
    if kind == "history":
        out["history"].append({"step": r.history.step.num, "items": items(r.history.item)})
    elif kind == "summary":
        out["summary"] = items(r.summary.update)
    elif kind == "run":
        out["run"] = {"run_id": r.run.run_id, "project": r.run.project, "name": r.run.display_name,
                      "config": items(r.run.config.update), "start": r.run.start_time.seconds}
    elif kind == "exit":
        out["exit_code"] = r.exit.exit_code
    elif kind == "files":
        out["files"] += [[f.path, f.policy, f.type] for f in r.files.files]
    elif kind == "header":
        out["producer"] = r.header.version_info.producer
print(json.dumps(out))
"#;

/// What `wandb sync` (wandb-core's transaction-log reader) makes of the run's first records: it
/// reads the header and run record, then starts the upload, which is pointed at a closed port and
/// stopped once the run is set up (or the read failed).
fn sync_reads(run_dir: &Path) -> String {
    // wandb sync writes its debug logs under ./wandb: keep them out of the source tree.
    let cwd = TempDir::new().unwrap();
    let mut sync = Command::new("setsid")
        .current_dir(cwd.path())
        .arg(tool("wandb"))
        .args(["sync", "-v"])
        .arg(run_dir)
        .env("WANDB_BASE_URL", "http://127.0.0.1:9")
        .env("WANDB_API_KEY", "a".repeat(40))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(sync.stderr.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = stderr
            .lines()
            .map_while(Result::ok)
            .map(|l| l.trim_start_matches("wandb: ").to_owned());
        let _ = tx.send(lines.find(|l| l.contains("setting up run") || l.contains("ERROR")));
    });
    let found = rx
        .recv_timeout(Duration::from_secs(30))
        .ok()
        .flatten()
        .unwrap_or_default();
    // setsid made it a process group with wandb-core: stop them all.
    Command::new("kill")
        .args(["-TERM", "--", &format!("-{}", sync.id())])
        .status()
        .unwrap();
    sync.wait().unwrap();
    found
}

#[test]
fn offline_run_reads_back_with_wandb() {
    let dir = TempDir::new().unwrap();
    let config = json!({"wandb": {"dir": dir.path(), "run_id": "abc123xy", "project": "wproj"}, "actor": {"lr": 1e-6}});
    let mut tracker: WandbTracker = started(config, "ignored", "exp-1", dir.path());
    for step in 1..=30u64 {
        tracker
            .log(step, &metrics(&[("actor/pg_loss", step as f64 / 4.0)]))
            .unwrap();
        // A second call for the same step joins the same history row, as in wandb.
        tracker
            .log(step, &metrics(&[("critic/score", -(step as f64))]))
            .unwrap();
    }
    tracker
        .log(
            31,
            &[
                Metric::new("odd", f64::NAN),
                Metric::new("big", f64::INFINITY),
            ],
        )
        .unwrap();
    // One record larger than a 32 KiB block: split into FIRST/MIDDLE/LAST chunks.
    let wide: Vec<Metric> = (0..5000)
        .map(|i| Metric::new(format!("wide/{i:04}"), i as f64))
        .collect();
    tracker.log(32, &wide).unwrap();
    let table = Table::new(
        "val/generations",
        vec!["prompt".into(), "response".into(), "score".into()],
        vec![vec!["1+1?".into(), "2".into(), "1.0".into()]],
    );
    tracker.log_table(32, &table).unwrap();
    tracker.finish(0).unwrap();

    let runs: Vec<_> = std::fs::read_dir(dir.path().join("wandb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(runs.len(), 1);
    let run_dir = &runs[0];
    let name = run_dir.file_name().unwrap().to_str().unwrap();
    assert!(
        name.starts_with("offline-run-") && name.ends_with("-abc123xy"),
        "{name}"
    );
    let read = run_python(
        READ_RUN,
        &[run_dir.join("run-abc123xy.wandb").to_str().unwrap()],
    );
    assert_eq!(
        sync_reads(run_dir),
        "[wproj/abc123xy] setting up run abc123xy"
    );

    let kinds = read["kinds"].as_array().unwrap();
    assert_eq!(kinds[..2], [json!("header"), json!("run")]);
    assert_eq!(kinds[kinds.len() - 2..], [json!("summary"), json!("exit")]);
    assert!(read["producer"].as_str().unwrap().starts_with("verl-core"));
    assert_eq!(read["run"]["run_id"], "abc123xy");
    assert_eq!(read["run"]["project"], "wproj");
    assert_eq!(read["run"]["name"], "exp-1");
    assert_eq!(read["run"]["config"]["actor"], json!({"lr": 1e-6}));
    assert_eq!(read["exit_code"], 0);

    let history = read["history"].as_array().unwrap();
    assert_eq!(history.len(), 32, "one row per step");
    for (row, step) in history[..30].iter().zip(1u64..) {
        assert_eq!(row["step"], step);
        let items = &row["items"];
        assert_eq!(items["_step"], step);
        assert_eq!(items["actor/pg_loss"], json!(step as f64 / 4.0));
        assert_eq!(items["critic/score"], json!(-(step as f64)));
        assert!(items["_timestamp"].as_f64().unwrap() > 1.7e9);
    }
    assert_eq!(history[30]["items"]["odd"], "nan");
    assert_eq!(history[30]["items"]["big"], "inf");
    let last = &history[31]["items"];
    assert_eq!(last["wide/4999"], json!(4999.0));
    assert_eq!(
        last.as_object()
            .unwrap()
            .keys()
            .filter(|k| k.starts_with("wide/"))
            .count(),
        5000
    );

    let table_ref = &last["val/generations"];
    assert_eq!(table_ref["_type"], "table-file");
    let path = table_ref["path"].as_str().unwrap();
    assert_eq!(read["files"], json!([[path, 0, 2]]));
    let content: Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("files").join(path)).unwrap()).unwrap();
    assert_eq!(
        content,
        json!({"columns": ["prompt", "response", "score"], "data": [["1+1?", "2", "1.0"]]})
    );

    assert_eq!(read["summary"]["actor/pg_loss"], json!(7.5));
    assert_eq!(read["summary"]["_step"], 32);
    assert!(!dir.path().join("wandb-spill.jsonl").exists());
}

/// A tracker dropped without `finish` (a panic or Ctrl-C unwinding the trainer) still writes
/// every step and closes the run as failed.
#[test]
fn dropping_without_finish_flushes_and_fails_the_run() {
    let dir = TempDir::new().unwrap();
    let config = json!({"wandb": {"dir": dir.path(), "run_id": "dropped1"}});
    let mut tracker: WandbTracker = started(config, "p", "e", dir.path());
    for step in 0..10u64 {
        tracker.log(step, &[Metric::new("m", step as f64)]).unwrap();
    }
    drop(tracker);
    let run_dir = std::fs::read_dir(dir.path().join("wandb"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let read = run_python(
        READ_RUN,
        &[run_dir.join("run-dropped1.wandb").to_str().unwrap()],
    );
    let steps: Vec<u64> = read["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (0..10).collect::<Vec<_>>());
    assert_eq!(read["exit_code"], 1);
}
