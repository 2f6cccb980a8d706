//! TensorBoard event files, written directly (no TensorFlow): one scalar per metric, one event per
//! step, flushed after every batch so `tensorboard --logdir` shows steps as they come.
//!
//! Settings (`tensorboard.*` / `trainer.tensorboard.*`, then env): `dir` (`TENSORBOARD_DIR`,
//! default `<run_dir>/tensorboard`); files go to `<dir>/<project>/<experiment>/`. Values are
//! stored as float32 (`simple_value`), as TensorBoard scalars are. Tables go to the side file.
//!
//! Format: records of `u64le len | u32le masked_crc32c(len) | data | u32le masked_crc32c(data)`
//! holding `tensorflow.Event` protobufs, the first one `file_version: "brain.Event:2"`.
//!
//! Each step once across crashes and resumes: every process writes a new event file, and before
//! its first scalar a `SessionLog.START` event at that scalar's step. TensorBoard then drops what
//! earlier files of the directory hold from that step on (the first START of a directory only
//! marks its start): after a resume the trainer first logs again the steps since the previous
//! checkpoint, so the interrupted attempt's records of those and later steps are replaced, the way
//! PyTorch's `SummaryWriter(purge_step=…)` does it. TensorBoard's Rust data server reaches the
//! same view by its own rule (a step preempts the records of that step and later ones, per tag).

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use prost::Message;
use serde::{Deserialize, Serialize};
use verl_plugin_api::PluginError;

use crate::TrackerError;
use crate::config::{Context, env, hostname, unix_seconds};
use crate::delivery::{Backend, Row};

/// `tensorflow.Event`, the fields a scalar log needs (oneof `what` spelled as optional fields:
/// the same wire format).
#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
    #[prost(message, optional, tag = "7")]
    session_log: Option<SessionLog>,
}

/// `tensorflow.SessionLog`, its status alone.
#[derive(Clone, PartialEq, Message)]
struct SessionLog {
    /// `SessionStatus`: 1 = START.
    #[prost(int32, tag = "1")]
    status: i32,
}

const SESSION_START: i32 = 1;

#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    /// Optional so that 0.0 is still written: without the field TensorBoard sees no scalar.
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct Settings {
    dir: Option<PathBuf>,
}

#[derive(Debug)]
pub struct Tensorboard {
    dir: PathBuf,
    file: Option<BufWriter<File>>,
    /// Whether this process's `SessionLog.START` is written (before its first scalar).
    started: bool,
}

impl Tensorboard {
    fn write_event(&mut self, event: &Event) -> Result<(), TrackerError> {
        let out = self
            .file
            .as_mut()
            .ok_or_else(|| TrackerError::Skipped("the event file is not open".into()))?;
        out.write_all(&record(&event.encode_to_vec()))?;
        Ok(())
    }
}

impl Backend for Tensorboard {
    const NAME: &'static str = "tensorboard";

    fn create(ctx: &Context) -> Result<Self, PluginError> {
        let s: Settings = ctx.settings()?;
        let root = s
            .dir
            .or_else(|| env("TENSORBOARD_DIR").map(PathBuf::from))
            .unwrap_or_else(|| ctx.run_dir.join("tensorboard"));
        Ok(Self {
            dir: root.join(&ctx.project).join(&ctx.experiment),
            file: None,
            started: false,
        })
    }

    fn open(&mut self) -> Result<(), TrackerError> {
        std::fs::create_dir_all(&self.dir)?;
        let host = hostname();
        let now = unix_seconds();
        // TensorBoard reads every file of a directory in name order; the suffix only keeps two
        // trackers of one process and second apart.
        let file = (0..)
            .map(|n| {
                let name = format!(
                    "events.out.tfevents.{}.{host}.{}.{n}",
                    now as u64,
                    std::process::id()
                );
                OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(self.dir.join(name))
            })
            .find(|r| !matches!(r, Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists))
            .expect("the range is endless")?;
        tracing::info!("tensorboard: writing to {}", self.dir.display());
        self.file = Some(BufWriter::new(file));
        self.write_event(&Event {
            wall_time: now,
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
            session_log: None,
        })?;
        self.file.as_mut().expect("opened above").flush()?;
        Ok(())
    }

    fn send(&mut self, rows: &[Row]) -> Result<(), TrackerError> {
        if let Some(first) = rows.first().filter(|_| !self.started) {
            self.write_event(&Event {
                wall_time: first.wall_time,
                step: first.step as i64,
                file_version: None,
                summary: None,
                session_log: Some(SessionLog {
                    status: SESSION_START,
                }),
            })?;
            self.started = true;
        }
        for row in rows {
            let value = row
                .metrics
                .iter()
                .map(|(k, v)| SummaryValue {
                    tag: k.clone(),
                    simple_value: Some(*v as f32),
                })
                .collect();
            let event = Event {
                wall_time: row.wall_time,
                step: row.step as i64,
                file_version: None,
                summary: Some(Summary { value }),
                session_log: None,
            };
            self.write_event(&event)?;
        }
        self.file.as_mut().expect("written above").flush()?;
        Ok(())
    }

    fn close(&mut self, _exit_code: i32) -> Result<(), TrackerError> {
        if let Some(mut file) = self.file.take() {
            file.flush()?;
            file.get_ref().sync_all()?;
        }
        Ok(())
    }
}

/// One TFRecord: length and data, each followed by its masked CRC-32C.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// TFRecord's CRC masking, so a CRC stored in data does not checksum to itself.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xA282_EAD8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_matches_tensorflow() {
        // crc32c("") = 0, so the masked value is the mask's delta.
        assert_eq!(masked_crc(b""), 0xA282_EAD8);
        // CRC-32C check value of "123456789" (RFC 3720) is 0xE3069283.
        assert_eq!(
            masked_crc(b"123456789"),
            0xE306_9283u32.rotate_right(15).wrapping_add(0xA282_EAD8)
        );
    }

    #[test]
    fn zero_values_are_encoded() {
        let v = SummaryValue {
            tag: "x".into(),
            simple_value: Some(0.0),
        };
        assert_eq!(v.encode_to_vec(), vec![0x0a, 1, b'x', 0x15, 0, 0, 0, 0]);
    }
}
