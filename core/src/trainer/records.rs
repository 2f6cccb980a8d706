//! Each step's record survives a crash, once. A checkpoint carries the records of the steps since
//! the previous one (its own included); on resume they are logged again after the trackers were
//! told the step the run resumes after, so a tracker that lost them (a crash between the commit
//! and the log, or metrics still queued for a server) gets them, and one that holds them drops
//! them (see `ComponentInit::resume_step`).

use serde::{Deserialize, Serialize};
use verl_plugin_api::Metric;

/// One step's metrics as the trackers were given them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct StepRecord {
    pub step: u64,
    /// `[key, value]` pairs in log order.
    pub metrics: Vec<(String, MetricValue)>,
}

impl StepRecord {
    pub fn new(step: u64, metrics: &[Metric]) -> Self {
        Self {
            step,
            metrics: metrics
                .iter()
                .map(|m| (m.key.to_string(), MetricValue(m.value)))
                .collect(),
        }
    }

    pub fn to_metrics(&self) -> Vec<Metric> {
        self.metrics
            .iter()
            .map(|(key, value)| Metric::new(key.as_str(), value.0))
            .collect()
    }
}

/// A metric value in JSON, which has no NaN or infinities: those are written as the strings
/// `NaN`, `inf` and `-inf`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "NumberOrText", into = "NumberOrText")]
pub(super) struct MetricValue(f64);

#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum NumberOrText {
    Number(f64),
    Text(String),
}

impl From<MetricValue> for NumberOrText {
    fn from(value: MetricValue) -> Self {
        if value.0.is_finite() {
            Self::Number(value.0)
        } else {
            Self::Text(value.0.to_string())
        }
    }
}

impl TryFrom<NumberOrText> for MetricValue {
    type Error = String;
    fn try_from(value: NumberOrText) -> Result<Self, String> {
        match value {
            NumberOrText::Number(n) => Ok(Self(n)),
            NumberOrText::Text(text) => match text.parse::<f64>() {
                Ok(n) if !n.is_finite() => Ok(Self(n)),
                _ => Err(format!(
                    "metric value `{text}` is neither a number nor NaN/inf/-inf"
                )),
            },
        }
    }
}

/// Test-only: `VERL_TEST_PAUSE_AT=<point>` stops the run at that point, after saying so on
/// stderr (`VERL_TEST_PAUSE_AT: paused at <point>`), for a test to kill it exactly there
/// (tests/integration/train.rs). Points: `committed:<step>` (checkpoint `<step>` committed, its
/// record not yet logged), `exported` (the final export written aside, not yet swapped in),
/// `swapping` (the previous export moved aside, the new one not yet in its place).
pub(super) fn test_pause_point(point: &str) {
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    if AT.get_or_init(|| std::env::var(PAUSE_ENV).ok()).as_deref() == Some(point) {
        eprintln!("{PAUSE_ENV}: paused at {point}");
        loop {
            std::thread::park();
        }
    }
}

pub(super) const PAUSE_ENV: &str = "VERL_TEST_PAUSE_AT";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_through_json_with_non_finite_values() {
        let metrics = [
            Metric::new("b", 0.1),
            Metric::new("a", f64::NAN),
            Metric::new("c", f64::INFINITY),
            Metric::new("d", f64::NEG_INFINITY),
            Metric::new("e", -3.0),
        ];
        let record = StepRecord::new(7, &metrics);
        let text = serde_json::to_string(&record).unwrap();
        assert_eq!(
            text,
            r#"{"step":7,"metrics":[["b",0.1],["a","NaN"],["c","inf"],["d","-inf"],["e",-3.0]]}"#
        );
        let back: StepRecord = serde_json::from_str(&text).unwrap();
        let back = back.to_metrics();
        // Order and keys as logged; values bit for bit (NaN compares unequal, so by bits).
        assert_eq!(
            back.iter().map(|m| m.key.as_str()).collect::<Vec<_>>(),
            ["b", "a", "c", "d", "e"]
        );
        for (a, b) in back.iter().zip(&metrics) {
            assert_eq!(a.value.to_bits(), b.value.to_bits(), "{}", a.key);
        }
        let err =
            serde_json::from_str::<StepRecord>(r#"{"step":1,"metrics":[["x","7"]]}"#).unwrap_err();
        assert!(err.to_string().contains("metric value `7`"), "{err}");
    }
}
