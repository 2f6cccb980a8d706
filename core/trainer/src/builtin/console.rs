//! The `console` tracker: a progress bar with ETA and one compact line of the metrics people watch
//! per step (all metrics with `RUST_LOG=debug`).

use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use verl_plugin_api::{ComponentInit, Metric, PluginError, Table, Tracker, TrackerCapabilities};

/// Shown first, in this order, when present; validation means (`val-core/…`) follow.
const HEADLINE: &[(&str, &str)] = &[
    ("critic/score/mean", "score"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/entropy", "entropy"),
    ("actor/ppo_kl", "kl"),
    ("actor/grad_norm", "grad_norm"),
    ("critic/vf_loss", "vf_loss"),
    ("response_length/mean", "resp_len"),
    ("timing_s/step", "step_s"),
    ("perf/throughput", "tok/s"),
];

#[derive(Default)]
pub struct ConsoleTracker {
    bar: Option<ProgressBar>,
    started: Option<Instant>,
}

impl ConsoleTracker {
    fn println(&self, line: String) {
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.println(line),
            _ => eprintln!("{line}"),
        }
    }
}

/// `0.4375` → "0.438", `12345.6` → "1.23e4": short but never misleading.
fn short(value: f64) -> String {
    if value == 0.0 || (1e-3..1e4).contains(&value.abs()) {
        format!("{value:.3}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_owned()
    } else {
        format!("{value:.2e}")
    }
}

pub fn headline(step: u64, metrics: &[Metric]) -> String {
    let find = |key: &str| metrics.iter().find(|m| m.key == key).map(|m| m.value);
    let mut parts = vec![format!("step {step}")];
    parts.extend(
        HEADLINE
            .iter()
            .filter_map(|(key, label)| find(key).map(|v| format!("{label} {}", short(v)))),
    );
    parts.extend(
        metrics
            .iter()
            .filter(|m| m.key.starts_with("val-core/"))
            .map(|m| format!("{} {}", m.key, short(m.value))),
    );
    parts.join(" │ ")
}

impl Tracker for ConsoleTracker {
    fn capabilities() -> TrackerCapabilities {
        TrackerCapabilities::default().tables(true)
    }

    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        let total = init
            .config
            .pointer("/trainer/total_training_steps")
            .and_then(serde_json::Value::as_u64);
        let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} step {pos}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
            )
            .map_err(|e| PluginError::other(e.to_string()))?,
        );
        self.bar = Some(bar);
        self.started = Some(Instant::now());
        Ok(())
    }

    fn log(&mut self, step: u64, metrics: &[Metric]) -> Result<(), PluginError> {
        if tracing::enabled!(tracing::Level::DEBUG) {
            let all: Vec<String> = metrics
                .iter()
                .map(|m| format!("{}:{}", m.key, m.value))
                .collect();
            tracing::debug!("step:{step} - {}", all.join(" - "));
        }
        self.println(headline(step, metrics));
        if let Some(bar) = &self.bar {
            bar.set_position(step);
        }
        Ok(())
    }

    fn log_table(&mut self, step: u64, table: &Table) -> Result<(), PluginError> {
        self.println(format!(
            "step {step} │ {} ({} rows)",
            table.name,
            table.rows.len()
        ));
        if let Some(row) = table.rows.first() {
            for (column, cell) in table.columns.iter().zip(row.iter()) {
                self.println(format!(
                    "    {column}: {}",
                    cell.as_str().replace('\n', "⏎")
                ));
            }
        }
        Ok(())
    }

    fn finish(&mut self, exit_code: i32) -> Result<(), PluginError> {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        let elapsed = self
            .started
            .map(|t| t.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        let outcome = if exit_code == 0 { "finished" } else { "failed" };
        eprintln!("run {outcome} after {elapsed:.1} s");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headline_orders_known_metrics_and_abbreviates() {
        let metrics = vec![
            Metric::new("actor/pg_loss", -0.012345),
            Metric::new("critic/score/mean", 0.4375),
            Metric::new("val-core/arith/reward/mean@1", 0.5),
            Metric::new("perf/throughput", 123456.0),
            Metric::new("other", 1.0),
        ];
        assert_eq!(
            headline(3, &metrics),
            "step 3 │ score 0.438 │ pg_loss -0.012 │ tok/s 1.23e5 │ val-core/arith/reward/mean@1 0.5"
        );
        assert_eq!(short(0.0), "0");
        assert_eq!(short(2.0), "2");
        assert_eq!(short(-0.0001), "-1.00e-4");
    }
}
