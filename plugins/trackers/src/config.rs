//! Where a tracker's settings come from, and the config helpers the backends share.
//!
//! Precedence, highest first: the tracker's own section of the run config (top-level `<name>`,
//! over `trainer.<name>`), then the tool's usual environment variables, then defaults derived from
//! the run (project, experiment, run directory).
//!
//! The section is strict: a key that is neither a [`Delivery`] key nor one of the backend's own
//! settings is an error naming its full path, where it came from and the nearest valid key
//! ([`parse_settings`]).

use std::hash::{BuildHasher, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use verl_plugin_api::{ComponentInit, PluginError};

/// Settings of the delivery layer, the same keys for every tracker.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Delivery {
    /// Log calls buffered between the training thread and the sender thread.
    pub queue_capacity: usize,
    /// How long a log call may wait for room in a full queue before it spills that call's metrics
    /// to the spill file itself.
    pub enqueue_timeout_ms: u64,
    /// Retries of one request after the first attempt.
    pub retries: u32,
    /// First retry delay; doubles per retry, and is also the first rest after a request failed
    /// all its retries (doubling up to 30 s, reset by a success).
    pub backoff_ms: u64,
    /// Time `finish` gives the server to take what is still queued and close the run; it returns
    /// by then, having spilled the rest.
    pub finish_timeout_s: f64,
    /// Limit of one HTTP request.
    pub request_timeout_s: f64,
    /// JSONL file for what could not be delivered (default `<run_dir>/<name>-spill.jsonl`).
    pub spill_path: Option<PathBuf>,
}

impl Default for Delivery {
    fn default() -> Self {
        Self {
            queue_capacity: 256,
            enqueue_timeout_ms: 50,
            retries: 4,
            backoff_ms: 250,
            finish_timeout_s: 10.0,
            request_timeout_s: 10.0,
            spill_path: None,
        }
    }
}

impl Delivery {
    pub fn backoff(&self) -> Duration {
        Duration::from_millis(self.backoff_ms.max(1))
    }
    pub fn finish_timeout(&self) -> Duration {
        Duration::try_from_secs_f64(self.finish_timeout_s).unwrap_or(Duration::from_secs(10))
    }
    pub fn request_timeout(&self) -> Duration {
        Duration::try_from_secs_f64(self.request_timeout_s).unwrap_or(Duration::from_secs(10))
    }
}

/// What a backend is built from.
#[derive(Debug, Clone)]
pub struct Context {
    pub name: &'static str,
    pub project: String,
    pub experiment: String,
    pub run_dir: PathBuf,
    /// The whole run config, secrets masked: the run's params / hyper-parameters.
    pub config: Value,
    /// The tracker's own settings (see the module doc).
    pub section: Value,
    /// Where `section` sits in the run config (`<name>` or `trainer.<name>`), for errors.
    pub section_path: String,
    /// Full key path → where its value came from, as JSON (see [`parse_settings`]); empty when
    /// the host sent none.
    pub origins: String,
    pub delivery: Delivery,
    /// The step the run resumes after; `None` for a run that starts from scratch (see
    /// `ComponentInit::resume_step`).
    pub resume_step: Option<u64>,
}

impl Context {
    pub fn new(name: &'static str, init: &ComponentInit) -> Result<Self, PluginError> {
        let config: Value = init.config(name)?;
        let section_path = if init.section_path.is_empty() {
            section_path(&config, name)
        } else {
            init.section_path.clone()
        };
        let section = section(&config, name);
        let origins = init.origins_json();
        // Any other key is allowed here: the backend's own keys are only known to `settings`,
        // which is strict. A delivery key of the wrong type is named with where it came from.
        let (delivery, _): (Delivery, Map<String, Value>) =
            parse_settings(&section_path, &section.to_string(), &origins)?;
        // The host fills the run context; verl's own keys stand in when it is blank (direct use).
        let trainer_key = |key: &str, default: &str| {
            config
                .pointer(&format!("/trainer/{key}"))
                .and_then(Value::as_str)
                .unwrap_or(default)
                .to_owned()
        };
        let or = |value: &str, fallback: String| {
            if value.is_empty() {
                fallback
            } else {
                value.to_owned()
            }
        };
        let run_dir = if init.run.run_dir.is_empty() {
            PathBuf::from(".")
        } else {
            PathBuf::from(init.run.run_dir.as_str())
        };
        Ok(Self {
            name,
            project: or(&init.run.project, trainer_key("project_name", "verl")),
            experiment: or(&init.run.experiment, trainer_key("experiment_name", "run")),
            run_dir,
            config: redact(config),
            section,
            section_path,
            origins,
            delivery,
            resume_step: init.resume_step,
        })
    }

    /// The backend's own settings, deserialised from the section, which may hold nothing else
    /// but the [`Delivery`] keys.
    pub fn settings<T: DeserializeOwned + Serialize>(&self) -> Result<T, PluginError> {
        parse_settings(&self.section_path, &self.section.to_string(), &self.origins)
            .map(|(_, own)| own)
    }
}

/// Parses a tracker's section strictly into the delivery settings and the backend's own `T`.
/// `section_path` is the section's full dotted path, `origins_json` maps full key paths to where
/// their values came from (may be empty); see `verl_plugin_api::config::parse_section`.
pub fn parse_settings<T: DeserializeOwned + Serialize>(
    section_path: &str,
    section_json: &str,
    origins_json: &str,
) -> Result<(Delivery, T), PluginError> {
    verl_plugin_api::config::parse_section2(section_path, section_json, origins_json)
}

/// Where [`section`] reads from: the top-level `<name>` when set (it wins key by key), else
/// `trainer.<name>`.
fn section_path(config: &Value, name: &str) -> String {
    if config.get(name).is_none() && config.pointer(&format!("/trainer/{name}")).is_some() {
        format!("trainer.{name}")
    } else {
        name.to_owned()
    }
}

/// `trainer.<name>` overlaid key by key with the top-level `<name>` (where the host merges it).
fn section(config: &Value, name: &str) -> Value {
    let mut merged = Map::new();
    for part in [
        config.pointer(&format!("/trainer/{name}")),
        config.get(name),
    ] {
        if let Some(Value::Object(map)) = part {
            merged.extend(map.clone());
        }
    }
    Value::Object(merged)
}

/// A non-empty environment variable.
pub fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Masks values whose key names a credential, so a write token in the config never becomes a
/// visible run parameter.
fn redact(value: Value) -> Value {
    const SECRET: [&str; 5] = ["token", "password", "secret", "api_key", "apikey"];
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| {
                    let lower = k.to_ascii_lowercase();
                    let v = if SECRET.iter().any(|s| lower.contains(s)) && !v.is_null() {
                        Value::from("***")
                    } else {
                        redact(v)
                    };
                    (k, v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(redact).collect()),
        // URLs with credentials, like trackio's `…?write_token=…`.
        Value::String(s) if s.contains("token=") => Value::String(
            s.split('&')
                .map(|part| match part.split_once("token=") {
                    Some((head, _)) => format!("{head}token=***"),
                    None => part.to_owned(),
                })
                .collect::<Vec<_>>()
                .join("&"),
        ),
        other => other,
    }
}

/// The config as `a.b.c = value` pairs (lists as JSON text), as MLflow params want them.
pub fn flatten(config: &Value) -> Vec<(String, String)> {
    fn walk(prefix: &str, value: &Value, out: &mut Vec<(String, String)>) {
        match value {
            Value::Object(map) => {
                for (k, v) in map {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v, out);
                }
            }
            Value::String(s) => out.push((prefix.to_owned(), s.clone())),
            Value::Null => out.push((prefix.to_owned(), "None".to_owned())),
            other => out.push((prefix.to_owned(), other.to_string())),
        }
    }
    let mut out = Vec::new();
    walk("", config, &mut out);
    out
}

/// A metric value as JSON: a number, or for NaN/±inf the strings "NaN", "Infinity", "-Infinity"
/// that MLflow and Trackio both read back as floats (JSON has no such numbers).
pub fn json_number(value: f64) -> Value {
    match serde_json::Number::from_f64(value) {
        Some(n) => Value::Number(n),
        None if value.is_nan() => Value::from("NaN"),
        None if value > 0.0 => Value::from("Infinity"),
        None => Value::from("-Infinity"),
    }
}

/// A random lowercase alphanumeric id (wandb run ids, trackio run ids). The std hasher is seeded
/// from the OS per process; the clock and a counter separate ids within one process.
pub fn random_id(len: usize) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut hasher = std::hash::RandomState::new().build_hasher();
    hasher.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let mut state = hasher.finish();
    (0..len)
        .map(|_| {
            // xorshift: enough spread for ids, which need uniqueness, not secrecy.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ALPHABET[(state % ALPHABET.len() as u64) as usize] as char
        })
        .collect()
}

/// This machine's host name (TensorBoard file names, wandb run records).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Seconds since the Unix epoch.
pub fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn top_level_section_overrides_trainer_section() {
        let config = json!({"trainer": {"mlflow": {"a": 1, "b": 2}}, "mlflow": {"b": 3}});
        assert_eq!(section(&config, "mlflow"), json!({"a": 1, "b": 3}));
        assert_eq!(section(&config, "wandb"), json!({}));
    }

    #[derive(Debug, Default, Serialize, Deserialize)]
    #[serde(default)]
    struct Own {
        dir: Option<String>,
        tags: std::collections::BTreeMap<String, String>,
    }

    #[test]
    fn sections_are_strict() {
        let (delivery, own) = parse_settings::<Own>(
            "wandb",
            r#"{"dir": "/d", "retries": 1, "tags": {"any": "x"}}"#,
            "",
        )
        .unwrap();
        assert_eq!((delivery.retries, own.dir.as_deref()), (1, Some("/d")));
        assert_eq!(delivery.queue_capacity, 256);
        assert_eq!(own.tags["any"], "x");
        let origins =
            r#"{"trainer.wandb.retrys": "environment variable VERL_TRAINER__WANDB__RETRYS"}"#;
        let err = parse_settings::<Own>("trainer.wandb", r#"{"retrys": 1}"#, origins).unwrap_err();
        assert_eq!(
            err.message(),
            "unknown config key `trainer.wandb.retrys` (from environment variable VERL_TRAINER__WANDB__RETRYS); did you mean `trainer.wandb.retries`?"
        );
        let err = parse_settings::<Own>("wandb", r#"{"dirr": "/d"}"#, "").unwrap_err();
        assert!(
            err.message().ends_with("did you mean `wandb.dir`?"),
            "{err}"
        );
        let err = parse_settings::<Own>("wandb", r#"{"dir": 3}"#, "").unwrap_err();
        assert!(
            err.message()
                .starts_with("config key `wandb.dir` (from unknown source): invalid type"),
            "{err}"
        );
        // A tracker's context reads the delivery keys alone, naming a wrong one with its path.
        let init = ComponentInit::new(
            json!({"mlflow": {"finish_timeout_s": "soon", "tracking_uri": "http://x"}}),
            verl_plugin_api::RunContext::default(),
        );
        let err = Context::new("mlflow", &init).unwrap_err();
        assert!(
            err.message().starts_with(
                "config key `mlflow.finish_timeout_s` (from unknown source): invalid type"
            ),
            "{err}"
        );
        assert_eq!(
            section_path(&json!({"trainer": {"mlflow": {}}}), "mlflow"),
            "trainer.mlflow"
        );
        assert_eq!(
            section_path(&json!({"trainer": {"mlflow": {}}, "mlflow": {}}), "mlflow"),
            "mlflow"
        );
    }

    #[test]
    fn flattens_and_masks_secrets() {
        let config = redact(
            json!({"a": {"b": 1, "c": [1, 2]}, "t": {"write_token": "s3cret", "url": "http://h/?a=1&write_token=s3cret"}, "n": null}),
        );
        let flat = flatten(&config);
        assert!(flat.contains(&("a.b".into(), "1".into())));
        assert!(flat.contains(&("a.c".into(), "[1,2]".into())));
        assert!(flat.contains(&("t.write_token".into(), "***".into())));
        assert!(flat.contains(&("t.url".into(), "http://h/?a=1&write_token=***".into())));
        assert!(flat.contains(&("n".into(), "None".into())));
    }

    #[test]
    fn non_finite_values_become_strings() {
        assert_eq!(json_number(1.5), json!(1.5));
        assert_eq!(json_number(f64::NAN), json!("NaN"));
        assert_eq!(json_number(f64::INFINITY), json!("Infinity"));
        assert_eq!(json_number(f64::NEG_INFINITY), json!("-Infinity"));
    }

    #[test]
    fn ids_differ() {
        let (a, b) = (random_id(8), random_id(8));
        assert_eq!(a.len(), 8);
        assert_ne!(a, b);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        );
    }
}
