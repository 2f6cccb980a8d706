//! Trackio through the HTTP API of a Trackio server (`trackio show`, or a self-hosted one).
//!
//! Settings (`trackio.*` / `trainer.trackio.*`, then trackio's own env variables): `server_url`
//! (`TRACKIO_SERVER_URL`, default `http://127.0.0.1:7860`; the write-access URL `trackio show`
//! prints, with its `?write_token=…`, works as is), `write_token` (`TRACKIO_WRITE_TOKEN`, sent as
//! `X-Trackio-Write-Token`), `project` (default the project), `run` (default the experiment).
//!
//! Steps go to `POST /api/bulk_log`, the run config with the first of them. Every entry carries a
//! `log_id` that stays the same across retries of a request: the server inserts with `INSERT OR
//! IGNORE` on it, so a retry after a lost answer stores nothing twice. NaN/±inf are sent as the
//! strings trackio itself stores them as. Tables are logged as `trackio.table` values.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use verl_plugin_api::{PluginError, Table};

use crate::TrackerError;
use crate::config::{Context, env, json_number, random_id};
use crate::delivery::{Backend, Row};
use crate::http::Http;

/// Metrics per request: keeps a request (and the server's one SQLite transaction) small.
const MAX_METRICS_PER_REQUEST: usize = 5000;

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct Settings {
    server_url: Option<String>,
    write_token: Option<String>,
    project: Option<String>,
    run: Option<String>,
}

#[derive(Debug)]
pub struct Trackio {
    http: Http,
    project: String,
    run: String,
    run_id: String,
    config: Value,
    config_sent: bool,
    /// Numbers the successful requests; with the entry index it makes the `log_id`.
    sent: u64,
}

impl Backend for Trackio {
    const NAME: &'static str = "trackio";

    fn create(ctx: &Context) -> Result<Self, PluginError> {
        let s: Settings = ctx.settings()?;
        let url = s
            .server_url
            .or_else(|| env("TRACKIO_SERVER_URL"))
            .unwrap_or_else(|| "http://127.0.0.1:7860".into());
        let (base, url_token) = split_write_token(&url);
        let token = s
            .write_token
            .or_else(|| env("TRACKIO_WRITE_TOKEN"))
            .or(url_token);
        let headers = token
            .map(|t| ("X-Trackio-Write-Token", t))
            .into_iter()
            .collect();
        Ok(Self {
            http: Http::new(&base, ctx.delivery.request_timeout(), headers),
            project: s.project.unwrap_or_else(|| ctx.project.clone()),
            run: s.run.unwrap_or_else(|| ctx.experiment.clone()),
            run_id: random_id(32),
            config: ctx.config.clone(),
            config_sent: false,
            sent: 0,
        })
    }

    fn max_metrics(&self) -> usize {
        MAX_METRICS_PER_REQUEST
    }

    fn open(&mut self) -> Result<(), TrackerError> {
        let version = self.http.get("/version", &[])?;
        tracing::info!(
            "trackio: run `{}` ({}) of project `{}` at {} (trackio {})",
            self.run,
            self.run_id,
            self.project,
            self.http.base(),
            version["version"]
        );
        Ok(())
    }

    fn send(&mut self, rows: &[Row]) -> Result<(), TrackerError> {
        let entries = rows
            .iter()
            .map(|row| {
                (
                    row.step,
                    row.metrics
                        .iter()
                        .map(|(k, v)| (k.clone(), json_number(*v)))
                        .collect(),
                )
            })
            .collect();
        self.bulk_log(entries)
    }

    fn send_table(&mut self, step: u64, table: &Table) -> Result<(), TrackerError> {
        let rows: Vec<Value> = table
            .rows
            .iter()
            .map(|row| {
                Value::Object(
                    table
                        .columns
                        .iter()
                        .cloned()
                        .zip(row.iter().map(|c| Value::from(c.as_str())))
                        .collect(),
                )
            })
            .collect();
        let value = json!({"_type": "trackio.table", "_value": rows});
        self.bulk_log(vec![(step, Map::from_iter([(table.name.clone(), value)]))])
    }

    /// Trackio has no run status to set: every step is stored when sent.
    fn close(&mut self, _exit_code: i32) -> Result<(), TrackerError> {
        Ok(())
    }
}

impl Trackio {
    fn bulk_log(&mut self, entries: Vec<(u64, Map<String, Value>)>) -> Result<(), TrackerError> {
        let logs: Vec<Value> = entries
            .into_iter()
            .enumerate()
            .map(|(i, (step, metrics))| {
                let config = if i == 0 && !self.config_sent {
                    self.config.clone()
                } else {
                    Value::Null
                };
                json!({
                    "project": self.project, "run": self.run, "run_id": self.run_id,
                    "metrics": metrics, "step": step, "config": config,
                    "log_id": format!("{}-{}-{i}", self.run_id, self.sent),
                })
            })
            .collect();
        self.http
            .post("/api/bulk_log", &json!({"logs": logs, "hf_token": null}))?;
        self.sent += 1;
        self.config_sent = true;
        Ok(())
    }
}

/// Splits the write-access URL `trackio show` prints (`http://h:p/?write_token=T`) into the
/// server's base URL and the token.
fn split_write_token(url: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), None);
    };
    let token = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("write_token="))
        .map(str::to_owned);
    (base.to_owned(), token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_token_comes_out_of_the_url() {
        assert_eq!(
            split_write_token("http://h:1/?a=b&write_token=T"),
            ("http://h:1/".into(), Some("T".into()))
        );
        assert_eq!(split_write_token("http://h:1"), ("http://h:1".into(), None));
    }
}
