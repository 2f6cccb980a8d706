//! MLflow through the REST API of a tracking server (`mlflow server`), as verl's MLflow logger
//! lays a run out: experiment = project, run name = experiment name, params = the flattened config.
//!
//! Settings (`mlflow.*` / `trainer.mlflow.*`, then env): `tracking_uri` (`MLFLOW_TRACKING_URI`,
//! http(s) only: a local `./mlruns` store belongs to the Python client), `experiment_name`
//! (`MLFLOW_EXPERIMENT_NAME`, default the project), `run_name` (default the experiment), `tags`
//! (a map). `MLFLOW_TRACKING_TOKEN` is sent as a bearer token.
//!
//! Limits are MLflow's (`mlflow/utils/validation.py`, 3.17): ≤ 1000 metrics and ≤ 100 params/tags
//! per `log-batch`, keys ≤ 250 chars of `[/\w.\- :]`, param values ≤ 6000 and tag values ≤ 8000
//! chars. Keys are made valid the way verl does (`@` → `_at_`, other characters → `_`); longer
//! values are cut, with a debug log. A param may not change value, so duplicates after cleaning
//! keep their first value. Validation tables are uploaded as `tables/<name>_step<N>.json` artifacts
//! in `mlflow.log_table`'s format (pandas "split") and listed in the `mlflow.loggedArtifacts` tag,
//! where the server proxies artifacts (`mlflow-artifacts:` URIs, `mlflow server`'s default).
//!
//! A resumed run (`ComponentInit::resume_step`) continues the MLflow run it started, whose id is
//! kept in `<run_dir>/mlflow-run-id` (a new one is created when that run is gone), and skips what
//! the run already holds: per metric, the steps up to the latest one stored (MLflow delivers in
//! order; it cannot delete values, so steps the interrupted attempt delivered after its checkpoint
//! keep their first values, the same as the new ones when training is deterministic), and params
//! already set (MLflow refuses to change one; a changed value keeps the first, with a warning).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use verl_plugin_api::{PluginError, Table};

use crate::TrackerError;
use crate::config::{Context, env, flatten, json_number, unix_seconds};
use crate::delivery::{Backend, Row, warn};
use crate::http::Http;

const API: &str = "/api/2.0/mlflow";
const MAX_METRICS_PER_BATCH: usize = 1000;
const MAX_PARAMS_PER_BATCH: usize = 100;
const MAX_KEY_LENGTH: usize = 250;
const MAX_PARAM_VALUE_LENGTH: usize = 6000;
const MAX_TAG_VALUE_LENGTH: usize = 8000;
/// In the run directory: the id of the MLflow run, for a resumed run to continue it.
const RUN_ID_FILE: &str = "mlflow-run-id";

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct Settings {
    tracking_uri: Option<String>,
    experiment_name: Option<String>,
    run_name: Option<String>,
    tags: BTreeMap<String, String>,
}

#[derive(Debug)]
pub struct Mlflow {
    /// None when the tracking URI is unusable; `open` then reports why.
    http: Result<Http, String>,
    experiment: String,
    run_name: String,
    tags: Vec<(String, String)>,
    params: Vec<(String, String)>,
    run: Option<RunIds>,
    params_logged: usize,
    /// Entries of the `mlflow.loggedArtifacts` tag.
    logged_tables: Vec<Value>,
    resume_step: Option<u64>,
    id_file: PathBuf,
    /// Of a continued run: per (cleaned) metric key, the latest step it holds.
    held: HashMap<String, u64>,
}

#[derive(Debug)]
struct RunIds {
    run_id: String,
    /// The run's artifact path on the server's artifact proxy, when it has one.
    artifact_path: Option<String>,
}

impl Backend for Mlflow {
    const NAME: &'static str = "mlflow";

    fn create(ctx: &Context) -> Result<Self, PluginError> {
        let s: Settings = ctx.settings()?;
        let http = match s.tracking_uri.or_else(|| env("MLFLOW_TRACKING_URI")) {
            Some(uri) if uri.starts_with("http://") || uri.starts_with("https://") => {
                let auth =
                    env("MLFLOW_TRACKING_TOKEN").map(|t| ("Authorization", format!("Bearer {t}")));
                Ok(Http::new(
                    &uri,
                    ctx.delivery.request_timeout(),
                    auth.into_iter().collect(),
                ))
            }
            Some(uri) => Err(format!(
                "tracking URI `{uri}` is not an http(s) server; start `mlflow server` and point MLFLOW_TRACKING_URI at it"
            )),
            None => {
                Err("no tracking server: set MLFLOW_TRACKING_URI or mlflow.tracking_uri".to_owned())
            }
        };
        let run_name = s.run_name.unwrap_or_else(|| ctx.experiment.clone());
        let mut tags = vec![
            ("mlflow.runName".to_owned(), run_name.clone()),
            ("mlflow.source.name".to_owned(), "verl-core".to_owned()),
            ("mlflow.source.type".to_owned(), "LOCAL".to_owned()),
        ];
        tags.extend(env("USER").map(|u| ("mlflow.user".to_owned(), u)));
        tags.extend(s.tags);
        let tags = tags
            .into_iter()
            .map(|(k, v)| (clean_key(&k), cut(v, MAX_TAG_VALUE_LENGTH)))
            .collect();
        let mut seen = HashSet::new();
        let params = flatten(&ctx.config)
            .into_iter()
            .map(|(k, v)| (clean_key(&k), cut(v, MAX_PARAM_VALUE_LENGTH)))
            .filter(|(k, _)| seen.insert(k.clone()))
            .collect();
        Ok(Self {
            http,
            experiment: s
                .experiment_name
                .or_else(|| env("MLFLOW_EXPERIMENT_NAME"))
                .unwrap_or_else(|| ctx.project.clone()),
            run_name,
            tags,
            params,
            run: None,
            params_logged: 0,
            logged_tables: Vec::new(),
            resume_step: ctx.resume_step,
            id_file: ctx.run_dir.join(RUN_ID_FILE),
            held: HashMap::new(),
        })
    }

    fn max_metrics(&self) -> usize {
        MAX_METRICS_PER_BATCH
    }

    /// Idempotent across retries: each stage (run, params) is done once.
    fn open(&mut self) -> Result<(), TrackerError> {
        if self.run.is_none()
            && let Some(step) = self.resume_step
        {
            self.continue_run(step)?;
        }
        let http = self
            .http
            .as_ref()
            .map_err(|e| TrackerError::Config(e.clone()))?;
        if self.run.is_none() {
            let experiment_id = experiment_id(http, &self.experiment)?;
            let tags: Vec<Value> = self
                .tags
                .iter()
                .map(|(k, v)| json!({"key": k, "value": v}))
                .collect();
            let body = json!({
                "experiment_id": experiment_id, "run_name": self.run_name,
                "start_time": now_ms(), "tags": tags,
            });
            let answer = http.post(&format!("{API}/runs/create"), &body)?;
            let info = &answer["run"]["info"];
            let run_id = info["run_id"]
                .as_str()
                .ok_or_else(|| protocol(http, "runs/create", &answer))?
                .to_owned();
            let artifact_path = info["artifact_uri"]
                .as_str()
                .and_then(proxied_artifact_path);
            tracing::info!(
                "mlflow: run {run_id} in experiment `{}` at {}",
                self.experiment,
                http.base()
            );
            if let Err(e) = std::fs::write(&self.id_file, &run_id) {
                warn(&format!(
                    "mlflow: cannot keep the run id in {} ({e}); a resumed run will start a new MLflow run",
                    self.id_file.display()
                ));
            }
            self.run = Some(RunIds {
                run_id,
                artifact_path,
            });
        }
        let run_id = &self.run.as_ref().expect("created above").run_id;
        while self.params_logged < self.params.len() {
            let batch = &self.params[self.params_logged
                ..(self.params_logged + MAX_PARAMS_PER_BATCH).min(self.params.len())];
            let params: Vec<Value> = batch
                .iter()
                .map(|(k, v)| json!({"key": k, "value": v}))
                .collect();
            http.post(
                &format!("{API}/runs/log-batch"),
                &json!({"run_id": run_id, "params": params}),
            )?;
            self.params_logged += batch.len();
        }
        Ok(())
    }

    fn send(&mut self, rows: &[Row]) -> Result<(), TrackerError> {
        let (http, run_id) = self.ready()?;
        let held = &self.held;
        let metrics: Vec<Value> = rows
            .iter()
            .flat_map(|row| {
                let timestamp = (row.wall_time * 1000.0) as i64;
                row.metrics.iter().filter_map(move |(k, v)| {
                    let key = clean_key(k);
                    let stored = held.get(&key).is_some_and(|&last| row.step <= last);
                    (!stored).then(|| json!({"key": key, "value": json_number(*v), "timestamp": timestamp, "step": row.step}))
                })
            })
            .collect();
        if metrics.is_empty() {
            return Ok(());
        }
        http.post(
            &format!("{API}/runs/log-batch"),
            &json!({"run_id": run_id, "metrics": metrics}),
        )?;
        Ok(())
    }

    fn send_table(&mut self, step: u64, table: &Table) -> Result<(), TrackerError> {
        let (http, run_id) = self.ready()?;
        let Some(artifacts) = self.run.as_ref().and_then(|r| r.artifact_path.as_deref()) else {
            return Err(TrackerError::NoTables);
        };
        let file = format!(
            "tables/{}_step{step}.json",
            clean_key(&table.name).replace(['/', ' ', ':'], "_")
        );
        let body = serde_json::to_vec(&json!({"columns": table.columns, "data": table.rows}))
            .expect("strings serialise");
        http.put(
            &format!("/api/2.0/mlflow-artifacts/artifacts/{artifacts}/{file}"),
            &body,
        )?;
        let entry = json!({"path": file, "type": "table"});
        let mut listed = self.logged_tables.clone();
        if !listed.contains(&entry) {
            listed.push(entry);
        }
        let tag = json!({"run_id": run_id, "key": "mlflow.loggedArtifacts", "value": Value::from(listed.clone()).to_string()});
        http.post(&format!("{API}/runs/set-tag"), &tag)?;
        self.logged_tables = listed;
        Ok(())
    }

    fn close(&mut self, exit_code: i32) -> Result<(), TrackerError> {
        let (http, run_id) = self.ready()?;
        let status = if exit_code == 0 { "FINISHED" } else { "FAILED" };
        http.post(
            &format!("{API}/runs/update"),
            &json!({"run_id": run_id, "status": status, "end_time": now_ms()}),
        )?;
        Ok(())
    }
}

impl Mlflow {
    /// Takes up the run named in the id file, if it is still there and active: what it holds is
    /// not sent again, and it is marked running again.
    fn continue_run(&mut self, resume_step: u64) -> Result<(), TrackerError> {
        let http = self
            .http
            .as_ref()
            .map_err(|e| TrackerError::Config(e.clone()))?;
        let run_id = match std::fs::read_to_string(&self.id_file) {
            Ok(id) => id.trim().to_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => {
                warn(&format!(
                    "mlflow: cannot read {} ({e}); starting a new MLflow run",
                    self.id_file.display()
                ));
                return Ok(());
            }
        };
        let answer = match http.get(&format!("{API}/runs/get"), &[("run_id", &run_id)]) {
            Ok(answer) => answer,
            Err(TrackerError::Http { status: 404, .. }) => Value::Null,
            Err(e) => return Err(e),
        };
        let run = &answer["run"];
        if run["info"]["lifecycle_stage"] != "active" {
            warn(&format!(
                "mlflow: the run {run_id} of {} is gone or deleted; the resumed run starts a new MLflow run",
                self.id_file.display()
            ));
            return Ok(());
        }
        let list = |key: &str| run["data"][key].as_array().cloned().unwrap_or_default();
        self.held = list("metrics")
            .iter()
            .filter_map(|m| Some((m["key"].as_str()?.to_owned(), json_u64(&m["step"])?)))
            .collect();
        let params: HashMap<String, String> = list("params")
            .iter()
            .filter_map(|p| {
                Some((
                    p["key"].as_str()?.to_owned(),
                    p["value"].as_str()?.to_owned(),
                ))
            })
            .collect();
        self.params.retain(|(key, value)| match params.get(key) {
            None => true,
            Some(first) => {
                if first != value {
                    warn(&format!(
                        "mlflow: param `{key}` keeps its first value `{first}` (MLflow refuses to change a param; this run has `{value}`)"
                    ));
                }
                false
            }
        });
        self.logged_tables = list("tags")
            .iter()
            .find(|t| t["key"] == "mlflow.loggedArtifacts")
            .and_then(|t| serde_json::from_str(t["value"].as_str()?).ok())
            .unwrap_or_default();
        http.post(
            &format!("{API}/runs/update"),
            &json!({"run_id": run_id, "status": "RUNNING"}),
        )?;
        tracing::info!("mlflow: continuing run {run_id} after step {resume_step}");
        self.run = Some(RunIds {
            artifact_path: run["info"]["artifact_uri"]
                .as_str()
                .and_then(proxied_artifact_path),
            run_id,
        });
        Ok(())
    }

    fn ready(&self) -> Result<(&Http, String), TrackerError> {
        match (&self.http, &self.run) {
            (Ok(http), Some(run)) => Ok((http, run.run_id.clone())),
            _ => Err(TrackerError::Skipped("the run was not created".into())),
        }
    }
}

/// The experiment's id, creating it when absent. Another process may create it between the two
/// calls (RESOURCE_ALREADY_EXISTS): then it is looked up again.
fn experiment_id(http: &Http, name: &str) -> Result<String, TrackerError> {
    let lookup = || -> Result<Option<String>, TrackerError> {
        match http.get(
            &format!("{API}/experiments/get-by-name"),
            &[("experiment_name", name)],
        ) {
            Ok(answer) => answer["experiment"]["experiment_id"]
                .as_str()
                .map(|id| Some(id.to_owned()))
                .ok_or_else(|| protocol(http, "experiments/get-by-name", &answer)),
            Err(TrackerError::Http {
                status: 404, body, ..
            }) if body.contains("RESOURCE_DOES_NOT_EXIST") => Ok(None),
            Err(e) => Err(e),
        }
    };
    if let Some(id) = lookup()? {
        return Ok(id);
    }
    match http.post(&format!("{API}/experiments/create"), &json!({"name": name})) {
        Ok(answer) => answer["experiment_id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| protocol(http, "experiments/create", &answer)),
        Err(TrackerError::Http { body, .. }) if body.contains("RESOURCE_ALREADY_EXISTS") => {
            lookup()?.ok_or_else(|| TrackerError::Protocol {
                url: http.base().to_owned(),
                detail: format!("experiment `{name}` exists but cannot be found"),
            })
        }
        Err(e) => Err(e),
    }
}

/// MLflow's REST API writes int64 fields as JSON strings (protobuf's JSON mapping), or numbers.
fn json_u64(value: &Value) -> Option<u64> {
    value
        .as_u64()
        .or_else(|| value.as_str().and_then(|s| s.parse().ok()))
}

fn protocol(http: &Http, endpoint: &str, answer: &Value) -> TrackerError {
    TrackerError::Protocol {
        url: format!("{}{API}/{endpoint}", http.base()),
        detail: answer.to_string().chars().take(300).collect(),
    }
}

/// `mlflow-artifacts:/1/<run>/artifacts` (or `mlflow-artifacts://host:port/…`) → `1/<run>/artifacts`.
fn proxied_artifact_path(uri: &str) -> Option<String> {
    let rest = uri.strip_prefix("mlflow-artifacts:")?;
    let path = match rest.strip_prefix("//") {
        Some(authority_and_path) => authority_and_path.split_once('/').map_or("", |(_, p)| p),
        None => rest,
    };
    Some(path.trim_matches('/').to_owned())
}

/// A metric/param/tag key MLflow accepts: verl's `@` → `_at_`, characters outside `[/\w.\- :]`
/// → `_`, no empty, `.` or `..` path segments (MLflow rejects keys that normalise to another
/// path), at most 250 characters.
fn clean_key(key: &str) -> String {
    let chars: String = key
        .replace('@', "_at_")
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || "_/.- :".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let segments: Vec<&str> = chars
        .split('/')
        .filter(|s| !s.is_empty() && *s != ".")
        .map(|s| if s == ".." { "__" } else { s })
        .collect();
    let key = if segments.is_empty() {
        "_".to_owned()
    } else {
        segments.join("/")
    };
    key.chars().take(MAX_KEY_LENGTH).collect()
}

fn cut(value: String, max: usize) -> String {
    if value.chars().count() <= max {
        return value;
    }
    tracing::debug!(
        "mlflow: a value of {} characters is cut to MLflow's limit of {max}",
        value.chars().count()
    );
    value.chars().take(max).collect()
}

fn now_ms() -> i64 {
    (unix_seconds() * 1000.0) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_become_valid() {
        assert_eq!(clean_key("actor/pg_loss"), "actor/pg_loss");
        assert_eq!(
            clean_key("val-core/gsm8k/reward/mean@4"),
            "val-core/gsm8k/reward/mean_at_4"
        );
        assert_eq!(clean_key("/a//b/./c/../d#e"), "a/b/c/__/d_e");
        assert_eq!(clean_key("//"), "_");
        assert_eq!(clean_key(&"x".repeat(300)).len(), 250);
    }

    #[test]
    fn artifact_paths() {
        assert_eq!(
            proxied_artifact_path("mlflow-artifacts:/1/abc/artifacts").as_deref(),
            Some("1/abc/artifacts")
        );
        assert_eq!(
            proxied_artifact_path("mlflow-artifacts://h:5000/1/abc/artifacts").as_deref(),
            Some("1/abc/artifacts")
        );
        assert_eq!(proxied_artifact_path("s3://bucket/1/abc/artifacts"), None);
    }

    #[test]
    fn long_values_are_cut() {
        assert_eq!(
            cut("é".repeat(7000), MAX_PARAM_VALUE_LENGTH)
                .chars()
                .count(),
            6000
        );
        assert_eq!(cut("short".into(), MAX_PARAM_VALUE_LENGTH), "short");
    }
}
