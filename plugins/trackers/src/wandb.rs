//! Weights & Biases, offline: a run directory in the format the wandb SDK writes in offline mode,
//! which `wandb sync <run dir>` uploads later. Online mode needs W&B's servers and their
//! credentials, which this plugin does not speak to: `WANDB_MODE=online` still writes offline,
//! with a notice to sync.
//!
//! Settings (`wandb.*` / `trainer.wandb.*`, then wandb's env variables): `dir` (`WANDB_DIR`,
//! default the run directory), `project` (`WANDB_PROJECT`, default the project), `entity`
//! (`WANDB_ENTITY`), `run_id` (`WANDB_RUN_ID`, default 8 random characters), `name`
//! (`WANDB_NAME`, default the experiment), `mode` (`WANDB_MODE`).
//!
//! Layout: `<dir>/wandb/offline-run-<YYYYmmdd_HHMMSS>-<id>/run-<id>.wandb` (and `files/`), a
//! LevelDB log (`:W&B` header, 32 KiB blocks, CRC-32 over type byte and data) of `Record`
//! protobufs: header, run (with the config), one history record per step (`_step`, `_runtime`,
//! `_timestamp` and the metrics; several log calls of one step are merged, as `wandb.log` does, so
//! a step is written when the next begins), a summary of the last values, and the exit code.
//! Field numbers are those of wandb's `wandb_internal.proto`. Tables are `table-file` media under
//! `files/media/table/`, registered with a files record for the upload.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use prost::Message;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use verl_plugin_api::{PluginError, Table};

use crate::TrackerError;
use crate::config::{Context, env, hostname, random_id, unix_seconds};
use crate::delivery::{Backend, Row, warn};

/// `Record`; its `record_type` oneof spelled as optional fields (the same wire format).
#[derive(Clone, PartialEq, Message)]
struct Record {
    #[prost(int64, tag = "1")]
    num: i64,
    #[prost(message, optional, tag = "2")]
    history: Option<HistoryRecord>,
    #[prost(message, optional, tag = "3")]
    summary: Option<SummaryRecord>,
    #[prost(message, optional, tag = "6")]
    files: Option<FilesRecord>,
    #[prost(message, optional, tag = "17")]
    run: Option<RunRecord>,
    #[prost(message, optional, tag = "18")]
    exit: Option<RunExitRecord>,
    #[prost(message, optional, tag = "21")]
    header: Option<HeaderRecord>,
}

/// `HistoryItem`, `SummaryItem` and `ConfigItem` share this shape (`key = 1`, `value_json = 16`).
#[derive(Clone, PartialEq, Message)]
struct Item {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(string, tag = "16")]
    value_json: String,
}

#[derive(Clone, PartialEq, Message)]
struct HistoryRecord {
    #[prost(message, repeated, tag = "1")]
    item: Vec<Item>,
    #[prost(message, optional, tag = "2")]
    step: Option<HistoryStep>,
}

#[derive(Clone, PartialEq, Message)]
struct HistoryStep {
    #[prost(int64, tag = "1")]
    num: i64,
}

/// `SummaryRecord` and `ConfigRecord`: `repeated update = 1`.
#[derive(Clone, PartialEq, Message)]
struct Updates {
    #[prost(message, repeated, tag = "1")]
    update: Vec<Item>,
}
type SummaryRecord = Updates;

#[derive(Clone, PartialEq, Message)]
struct FilesRecord {
    #[prost(message, repeated, tag = "1")]
    files: Vec<FilesItem>,
}

#[derive(Clone, PartialEq, Message)]
struct FilesItem {
    #[prost(string, tag = "1")]
    path: String,
    /// `PolicyType`: 0 = NOW.
    #[prost(int32, tag = "2")]
    policy: i32,
    /// `FileType`: 2 = MEDIA.
    #[prost(int32, tag = "3")]
    r#type: i32,
}

#[derive(Clone, PartialEq, Message)]
struct RunRecord {
    #[prost(string, tag = "1")]
    run_id: String,
    #[prost(string, tag = "2")]
    entity: String,
    #[prost(string, tag = "3")]
    project: String,
    #[prost(message, optional, tag = "4")]
    config: Option<Updates>,
    #[prost(string, tag = "8")]
    display_name: String,
    #[prost(string, tag = "13")]
    host: String,
    #[prost(message, optional, tag = "17")]
    start_time: Option<Timestamp>,
}

/// `google.protobuf.Timestamp`.
#[derive(Clone, PartialEq, Message)]
struct Timestamp {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

#[derive(Clone, PartialEq, Message)]
struct RunExitRecord {
    #[prost(int32, tag = "1")]
    exit_code: i32,
    #[prost(int32, tag = "2")]
    runtime: i32,
}

#[derive(Clone, PartialEq, Message)]
struct HeaderRecord {
    #[prost(message, optional, tag = "1")]
    version_info: Option<VersionInfo>,
}

#[derive(Clone, PartialEq, Message)]
struct VersionInfo {
    #[prost(string, tag = "1")]
    producer: String,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct Settings {
    dir: Option<PathBuf>,
    project: Option<String>,
    entity: Option<String>,
    run_id: Option<String>,
    name: Option<String>,
    mode: Option<String>,
}

#[derive(Debug)]
pub struct Wandb {
    root: PathBuf,
    project: String,
    entity: String,
    run_id: String,
    name: String,
    config: Value,
    start: f64,
    run_dir: PathBuf,
    log: Option<RecordLog<BufWriter<File>>>,
    records: i64,
    /// The step being gathered and its items.
    pending: Option<(u64, f64, Vec<Item>)>,
    summary: BTreeMap<String, String>,
}

impl Backend for Wandb {
    const NAME: &'static str = "wandb";

    fn create(ctx: &Context) -> Result<Self, PluginError> {
        let s: Settings = ctx.settings()?;
        if s.mode
            .or_else(|| env("WANDB_MODE"))
            .is_some_and(|m| m == "online")
        {
            warn(
                "wandb: online mode is not available here; writing an offline run to upload with `wandb sync`",
            );
        }
        Ok(Self {
            root: s
                .dir
                .or_else(|| env("WANDB_DIR").map(PathBuf::from))
                .unwrap_or_else(|| ctx.run_dir.clone()),
            project: s
                .project
                .or_else(|| env("WANDB_PROJECT"))
                .unwrap_or_else(|| ctx.project.clone()),
            entity: s.entity.or_else(|| env("WANDB_ENTITY")).unwrap_or_default(),
            run_id: s
                .run_id
                .or_else(|| env("WANDB_RUN_ID"))
                .unwrap_or_else(|| random_id(8)),
            name: s
                .name
                .or_else(|| env("WANDB_NAME"))
                .unwrap_or_else(|| ctx.experiment.clone()),
            config: ctx.config.clone(),
            start: unix_seconds(),
            run_dir: PathBuf::new(),
            log: None,
            records: 0,
            pending: None,
            summary: BTreeMap::new(),
        })
    }

    fn open(&mut self) -> Result<(), TrackerError> {
        self.run_dir = self.root.join("wandb").join(format!(
            "offline-run-{}-{}",
            utc_stamp(self.start),
            self.run_id
        ));
        std::fs::create_dir_all(self.run_dir.join("files"))?;
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(self.run_dir.join(format!("run-{}.wandb", self.run_id)))?;
        self.log = Some(RecordLog::new(BufWriter::new(file))?);
        let version_info = VersionInfo {
            producer: format!("verl-core {}", env!("CARGO_PKG_VERSION")),
        };
        self.write(Record {
            header: Some(HeaderRecord {
                version_info: Some(version_info),
            }),
            ..Default::default()
        })?;
        let config = match &self.config {
            Value::Object(map) => map
                .iter()
                .map(|(k, v)| Item {
                    key: k.clone(),
                    value_json: v.to_string(),
                })
                .collect(),
            _ => Vec::new(),
        };
        let run = RunRecord {
            run_id: self.run_id.clone(),
            entity: self.entity.clone(),
            project: self.project.clone(),
            config: Some(Updates { update: config }),
            display_name: self.name.clone(),
            host: hostname(),
            start_time: Some(Timestamp {
                seconds: self.start as i64,
                nanos: (self.start.fract() * 1e9) as i32,
            }),
        };
        self.write(Record {
            run: Some(run),
            ..Default::default()
        })?;
        self.flush()?;
        tracing::info!(
            "wandb: offline run in {} (upload with `wandb sync {}`)",
            self.run_dir.display(),
            self.run_dir.display()
        );
        Ok(())
    }

    fn send(&mut self, rows: &[Row]) -> Result<(), TrackerError> {
        for row in rows {
            let items = row
                .metrics
                .iter()
                .map(|(k, v)| Item {
                    key: k.clone(),
                    value_json: number_json(*v),
                })
                .collect();
            self.add(row.step, row.wall_time, items)?;
        }
        self.flush()
    }

    fn send_table(&mut self, step: u64, table: &Table) -> Result<(), TrackerError> {
        let content = serde_json::to_vec(&json!({"columns": table.columns, "data": table.rows}))
            .expect("strings serialise");
        let sha256: String = Sha256::digest(&content)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let key = table.name.replace(['/', ' '], "_");
        let path = format!("media/table/{key}_{step}_{}.table.json", &sha256[..20]);
        let file = self.run_dir.join("files").join(&path);
        std::fs::create_dir_all(file.parent().expect("has a parent"))?;
        std::fs::write(&file, &content)?;
        let value = json!({
            "_type": "table-file", "path": path, "sha256": sha256, "size": content.len(),
            "ncols": table.columns.len(), "nrows": table.rows.len(), "log_mode": "IMMUTABLE",
        });
        self.write(Record {
            files: Some(FilesRecord {
                files: vec![FilesItem {
                    path,
                    policy: 0,
                    r#type: 2,
                }],
            }),
            ..Default::default()
        })?;
        self.add(
            step,
            unix_seconds(),
            vec![Item {
                key: table.name.clone(),
                value_json: value.to_string(),
            }],
        )?;
        self.flush()
    }

    fn close(&mut self, exit_code: i32) -> Result<(), TrackerError> {
        self.write_pending()?;
        let update = self
            .summary
            .iter()
            .map(|(k, v)| Item {
                key: k.clone(),
                value_json: v.clone(),
            })
            .collect();
        self.write(Record {
            summary: Some(Updates { update }),
            ..Default::default()
        })?;
        let runtime = (unix_seconds() - self.start) as i32;
        self.write(Record {
            exit: Some(RunExitRecord { exit_code, runtime }),
            ..Default::default()
        })?;
        if let Some(log) = self.log.take() {
            let file = log.into_inner().into_inner().map_err(|e| e.into_error())?;
            file.sync_all()?;
        }
        Ok(())
    }
}

impl Wandb {
    /// Adds items to the step being gathered; a new step writes the previous one.
    fn add(&mut self, step: u64, wall_time: f64, items: Vec<Item>) -> Result<(), TrackerError> {
        if self.pending.as_ref().is_some_and(|(s, ..)| *s != step) {
            self.write_pending()?;
        }
        for item in &items {
            self.summary
                .insert(item.key.clone(), item.value_json.clone());
        }
        self.pending
            .get_or_insert_with(|| (step, wall_time, Vec::new()))
            .2
            .extend(items);
        Ok(())
    }

    fn write_pending(&mut self) -> Result<(), TrackerError> {
        let Some((step, wall_time, items)) = self.pending.take() else {
            return Ok(());
        };
        let mut all = vec![
            Item {
                key: "_step".into(),
                value_json: step.to_string(),
            },
            Item {
                key: "_runtime".into(),
                value_json: number_json(wall_time - self.start),
            },
            Item {
                key: "_timestamp".into(),
                value_json: number_json(wall_time),
            },
        ];
        self.summary
            .extend(all.iter().map(|i| (i.key.clone(), i.value_json.clone())));
        all.extend(items);
        self.write(Record {
            history: Some(HistoryRecord {
                item: all,
                step: Some(HistoryStep { num: step as i64 }),
            }),
            ..Default::default()
        })
    }

    fn write(&mut self, mut record: Record) -> Result<(), TrackerError> {
        let log = self
            .log
            .as_mut()
            .ok_or_else(|| TrackerError::Skipped("the run file is not open".into()))?;
        self.records += 1;
        record.num = self.records;
        log.append(&record.encode_to_vec())?;
        Ok(())
    }

    fn flush(&mut self) -> Result<(), TrackerError> {
        if let Some(log) = self.log.as_mut() {
            log.out.flush()?;
        }
        Ok(())
    }
}

/// A number as wandb's Python JSON writes it: NaN and the infinities as the bare words
/// `NaN`/`Infinity`/`-Infinity`, which its readers accept.
fn number_json(v: f64) -> String {
    match serde_json::Number::from_f64(v) {
        Some(n) => n.to_string(),
        None if v.is_nan() => "NaN".into(),
        None if v > 0.0 => "Infinity".into(),
        None => "-Infinity".into(),
    }
}

/// `YYYYmmdd_HHMMSS` in UTC, as wandb names run directories.
fn utc_stamp(unix: f64) -> String {
    let secs = unix as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}_{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

const BLOCK: usize = 32 * 1024;
const CHUNK_HEADER: usize = 7;

/// LevelDB's log format with W&B's file header: records split into chunks that never cross a
/// 32 KiB block; a block tail shorter than a chunk header is zero-filled.
#[derive(Debug)]
struct RecordLog<W: Write> {
    out: W,
    offset: usize,
}

impl<W: Write> RecordLog<W> {
    fn new(mut out: W) -> std::io::Result<Self> {
        // ident ":W&B", magic 0xBEE1, version 0.
        out.write_all(b":W&B\xe1\xbe\x00")?;
        Ok(Self { out, offset: 7 })
    }

    fn append(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        let mut first = true;
        loop {
            let left = BLOCK - self.offset % BLOCK;
            if left < CHUNK_HEADER {
                self.out.write_all(&[0; CHUNK_HEADER][..left])?;
                self.offset += left;
                continue;
            }
            let n = data.len().min(left - CHUNK_HEADER);
            let last = n == data.len();
            // FULL = 1, FIRST = 2, MIDDLE = 3, LAST = 4.
            let kind: u8 = match (first, last) {
                (true, true) => 1,
                (true, false) => 2,
                (false, false) => 3,
                (false, true) => 4,
            };
            let mut crc = crc32fast::Hasher::new();
            crc.update(&[kind]);
            crc.update(&data[..n]);
            self.out.write_all(&crc.finalize().to_le_bytes())?;
            self.out.write_all(&(n as u16).to_le_bytes())?;
            self.out.write_all(&[kind])?;
            self.out.write_all(&data[..n])?;
            self.offset += CHUNK_HEADER + n;
            data = &data[n..];
            first = false;
            if last {
                return Ok(());
            }
        }
    }

    fn into_inner(self) -> W {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_are_utc_dates() {
        assert_eq!(utc_stamp(0.0), "19700101_000000");
        assert_eq!(utc_stamp(1_795_939_563.0), "20261129_080603");
        assert_eq!(utc_stamp(951_782_400.0), "20000229_000000");
    }

    #[test]
    fn records_never_cross_blocks() {
        let mut log = RecordLog::new(Vec::new()).unwrap();
        log.append(&[7u8; 40_000]).unwrap();
        log.append(&[8u8; 32_754]).unwrap();
        let bytes = log.into_inner();
        // FIRST fills block 0, LAST continues block 1.
        assert_eq!(bytes[7 + 6], 2);
        let first_len = BLOCK - 7 - CHUNK_HEADER;
        assert_eq!(
            u16::from_le_bytes([bytes[11], bytes[12]]) as usize,
            first_len
        );
        assert_eq!(bytes[BLOCK + 6], 4);
        assert!(bytes.len() > 2 * BLOCK);
    }

    #[test]
    fn numbers_like_python() {
        assert_eq!(number_json(1.0), "1.0");
        assert_eq!(number_json(f64::NAN), "NaN");
        assert_eq!(number_json(f64::NEG_INFINITY), "-Infinity");
    }
}
