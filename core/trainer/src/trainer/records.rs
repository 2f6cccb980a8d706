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

/// A metric value, in JSON as the text Rust's `{:?}` writes (`0.25`, `1e-7`, `NaN`, `inf`):
/// JSON numbers have no NaN or infinities, and serde_json parses them back only to within one
/// unit in the last place, while a replayed record must be the logged one bit for bit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct MetricValue(f64);

impl Serialize for MetricValue {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&format_args!("{:?}", self.0))
    }
}

impl<'de> Deserialize<'de> for MetricValue {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse()
            .map(Self)
            .map_err(|_| serde::de::Error::custom(format!("metric value `{text}` is not a number")))
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

const PAUSE_ENV: &str = "VERL_TEST_PAUSE_AT";

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
            // serde_json parses this JSON number one unit in the last place off.
            Metric::new("f", 0.24999999995689653),
            Metric::new("g", 1e-300),
        ];
        let record = StepRecord::new(7, &metrics);
        let text = serde_json::to_string(&record).unwrap();
        assert_eq!(
            text,
            r#"{"step":7,"metrics":[["b","0.1"],["a","NaN"],["c","inf"],["d","-inf"],["e","-3.0"],["f","0.24999999995689653"],["g","1e-300"]]}"#
        );
        let back: StepRecord = serde_json::from_str(&text).unwrap();
        let back = back.to_metrics();
        // Order and keys as logged; values bit for bit (NaN compares unequal, so by bits).
        assert_eq!(
            back.iter().map(|m| m.key.as_str()).collect::<Vec<_>>(),
            ["b", "a", "c", "d", "e", "f", "g"]
        );
        for (a, b) in back.iter().zip(&metrics) {
            assert_eq!(a.value.to_bits(), b.value.to_bits(), "{}", a.key);
        }
        let err = serde_json::from_str::<StepRecord>(r#"{"step":1,"metrics":[["x","seven"]]}"#)
            .unwrap_err();
        assert!(err.to_string().contains("metric value `seven`"), "{err}");
    }
}
