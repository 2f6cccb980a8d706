//! The reward interface (since 2.2.0): a batch of `{data_source, solution_str, ground_truth,
//! extra_info}` — the arguments of verl's `compute_score` — in, one score per item out, with the
//! extra information verl's reward functions return in their result dict (`acc`, `pred`, …).
//! The host's reward manager (`naive`, `dapo`) turns scores into token-level rewards.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::components::ComponentInit;
use crate::error::PluginError;

/// One response to score: verl's `compute_score(data_source, solution_str, ground_truth,
/// extra_info)` arguments.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(default)]
pub struct RewardItem {
    pub data_source: String,
    /// The decoded response, special tokens skipped.
    pub solution_str: String,
    /// The dataset's `reward_model.ground_truth`: a string, or structured (Search-R1's
    /// `{"target": [...]}`).
    pub ground_truth: Value,
    /// The dataset's `extra_info` column (`Null` when absent).
    pub extra_info: Value,
}

impl RewardItem {
    pub fn new(
        data_source: impl Into<String>,
        solution_str: impl Into<String>,
        ground_truth: impl Into<Value>,
    ) -> Self {
        Self {
            data_source: data_source.into(),
            solution_str: solution_str.into(),
            ground_truth: ground_truth.into(),
            extra_info: Value::Null,
        }
    }

    pub fn extra_info(mut self, extra_info: Value) -> Self {
        self.extra_info = extra_info;
        self
    }
}

/// A batch of responses to score.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(default)]
pub struct RewardRequest {
    pub items: Vec<RewardItem>,
}

impl RewardRequest {
    pub fn new(items: Vec<RewardItem>) -> Self {
        Self { items }
    }
}

/// The score of one item: verl's float result, or its dict's `score` with the other keys in
/// `extra`.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(default)]
pub struct RewardScore {
    pub score: f64,
    /// The result dict's other keys (`acc`, `pred`, …); empty for a plain float.
    pub extra: Map<String, Value>,
}

impl RewardScore {
    pub fn new(score: f64) -> Self {
        Self {
            score,
            extra: Map::new(),
        }
    }

    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(key.to_owned(), value.into());
        self
    }

    /// A verl result: a number (or bool) is the score; a dict must hold a numeric `score`.
    pub fn from_verl_result(result: &Value) -> Result<Self, String> {
        match result {
            Value::Number(n) => n
                .as_f64()
                .map(Self::new)
                .ok_or_else(|| format!("score {n} is not a finite number")),
            Value::Bool(b) => Ok(Self::new(if *b { 1.0 } else { 0.0 })),
            Value::Object(map) => {
                let mut extra = map.clone();
                match extra.remove("score") {
                    Some(Value::Number(n)) if n.as_f64().is_some() => Ok(Self {
                        score: n.as_f64().unwrap_or_default(),
                        extra,
                    }),
                    Some(other) => Err(format!("`score` is not a number: {other}")),
                    None => Err(format!("a result dict without `score`: {result}")),
                }
            }
            other => Err(format!(
                "expected a number or a dict with `score`, found {other}"
            )),
        }
    }
}

/// One score per request item, in order.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(default)]
pub struct RewardOutput {
    pub scores: Vec<RewardScore>,
}

impl RewardOutput {
    pub fn new(scores: Vec<RewardScore>) -> Self {
        Self { scores }
    }
}

/// What a reward component scores.
#[non_exhaustive]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[serde(default)]
pub struct RewardCapabilities {
    /// The `data_source` values it scores (`aime*`: every name with that prefix); empty: any
    /// (a user's function decides).
    pub data_sources: Vec<String>,
}

impl RewardCapabilities {
    pub fn data_sources<S: Into<String>>(mut self, sources: impl IntoIterator<Item = S>) -> Self {
        self.data_sources
            .extend(sources.into_iter().map(Into::into));
        self
    }
}

/// A reward function. `init.config` is the `custom_reward_function` section (`path`, `name`,
/// `reward_kwargs`), `init.section_path` its path.
pub trait Reward: Send + 'static {
    fn capabilities() -> RewardCapabilities
    where
        Self: Sized,
    {
        RewardCapabilities::default()
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError>;
    /// Exactly one score per item, in order; an error fails the whole batch (and names the item).
    fn compute(&mut self, request: &RewardRequest) -> Result<RewardOutput, PluginError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verl_results() {
        assert_eq!(
            RewardScore::from_verl_result(&serde_json::json!(0.5)).unwrap(),
            RewardScore::new(0.5)
        );
        assert_eq!(
            RewardScore::from_verl_result(&serde_json::json!(true))
                .unwrap()
                .score,
            1.0
        );
        let s =
            RewardScore::from_verl_result(&serde_json::json!({"score": -1, "acc": false})).unwrap();
        assert_eq!(s, RewardScore::new(-1.0).with("acc", false));
        assert!(
            RewardScore::from_verl_result(&serde_json::json!({"acc": 1}))
                .unwrap_err()
                .contains("score")
        );
        assert!(RewardScore::from_verl_result(&serde_json::json!("1")).is_err());
    }
}
