//! Reward managers (`reward_model.reward_manager`), as verl's `NaiveRewardManager` and
//! `DAPORewardManager`: each response's reward is its score (placed on its last token by the
//! trainer), and the result dicts' keys are collected as `reward_extra_info`. `dapo` also records
//! `acc` for plain float scores and adds DAPO's overlong penalty
//! (`reward_model.overlong_buffer`): 0 up to `max_response_length - len` tokens, then falling
//! linearly to `-penalty_factor` at `max_response_length`.

use std::collections::BTreeMap;

use serde_json::Value;
use verl_plugin_api::RewardScore;

use super::RewardError;
use verl_schema::OverlongBufferConfig;

/// verl's registered manager names this crate provides.
pub const MANAGERS: [&str; 2] = ["naive", "dapo"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ManagerKind {
    Naive,
    Dapo,
}

/// The overlong penalty in force.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Overlong {
    len: usize,
    penalty_factor: f64,
    log: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RewardManager {
    kind: ManagerKind,
    overlong: Option<Overlong>,
    max_resp_len: usize,
}

/// Each response's reward and verl's `reward_extra_info` (key → one value per response).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rewards {
    pub rewards: Vec<f64>,
    pub extra: BTreeMap<String, Vec<Value>>,
}

/// A number as verl averages it: bools count 1 and 0.
fn numeric(value: &Value) -> Option<f64> {
    match value {
        Value::Bool(b) => Some(f64::from(u8::from(*b))),
        Value::Number(n) => n.as_f64(),
        _ => None,
    }
}

impl Rewards {
    /// Appends another batch's rewards (a key only the other batch has keeps its rows' values
    /// only: [`Rewards::filter_metric`] refuses a key that does not cover every row).
    pub fn append(&mut self, other: Rewards) {
        self.rewards.extend(other.rewards);
        for (key, values) in other.extra {
            self.extra.entry(key).or_default().extend(values);
        }
    }

    /// `(section, data_source, variable, mean)` per data source for the reward and every
    /// numeric extra key covering every row, as verl's `process_validation_metrics` files them:
    /// the core variable (`acc` when there is one, else `reward`) in `val-core`, the rest in
    /// `val-aux`. `sources` gives each row's data source.
    pub fn validation_means(&self, sources: &[&str]) -> Vec<(&'static str, String, String, f64)> {
        let mut vars: Vec<(&str, Vec<f64>)> = vec![("reward", self.rewards.clone())];
        for (key, values) in &self.extra {
            let numbers: Option<Vec<f64>> = values.iter().map(numeric).collect();
            if let Some(numbers) = numbers.filter(|n| n.len() == self.rewards.len()) {
                vars.push((key, numbers));
            }
        }
        let core = if vars.iter().any(|(k, _)| *k == "acc") {
            "acc"
        } else {
            "reward"
        };
        let mut out = Vec::new();
        for (var, values) in vars {
            let mut by_source: BTreeMap<&str, (f64, usize)> = BTreeMap::new();
            for (source, value) in sources.iter().zip(values) {
                let entry = by_source.entry(source).or_default();
                entry.0 += value;
                entry.1 += 1;
            }
            let section = if var == core { "val-core" } else { "val-aux" };
            for (source, (sum, count)) in by_source {
                out.push((
                    section,
                    source.to_owned(),
                    var.to_owned(),
                    sum / count as f64,
                ));
            }
        }
        out
    }

    /// The values `algorithm.filter_groups.metric` names, one per response: `seq_reward` (and
    /// `seq_final_reward`, the same without a KL penalty in the reward) is the reward; any other
    /// name is a key of the extra information (`acc`, `score`, …), as in verl. Unset: `acc` when
    /// the reward gave one, else the reward.
    pub fn filter_metric(&self, metric: Option<&str>) -> Result<Vec<f64>, RewardError> {
        let name = match metric {
            None if !self.extra.contains_key("acc") => return Ok(self.rewards.clone()),
            None => "acc",
            Some("seq_reward" | "seq_final_reward") => return Ok(self.rewards.clone()),
            Some(name) => name,
        };
        self.numbers(
            name,
            &format!("algorithm.filter_groups.metric={name}"),
            "reward_model.reward_manager=dapo records `acc` for every score",
        )
    }

    /// Extra key `key` as numbers, one per response. Errors start with `context`; a missing
    /// key's ends with `hint`.
    fn numbers(&self, key: &str, context: &str, hint: &str) -> Result<Vec<f64>, RewardError> {
        let values = self.extra.get(key).ok_or_else(|| {
            let given = if self.extra.is_empty() {
                "a score only".to_owned()
            } else {
                self.extra.keys().cloned().collect::<Vec<_>>().join(", ")
            };
            RewardError::Config(format!(
                "{context}: the reward gave no `{key}` (it gave: {given}); {hint}"
            ))
        })?;
        if values.len() != self.rewards.len() {
            return Err(RewardError::Config(format!(
                "{context}: the reward gave `{key}` for {} of {} responses",
                values.len(),
                self.rewards.len()
            )));
        }
        values
            .iter()
            .map(|v| {
                numeric(v).ok_or_else(|| {
                    RewardError::Config(format!("{context}: `{key}` is not a number: {v}"))
                })
            })
            .collect()
    }

    /// The reward components `keys` name (verl's `algorithm.gdpo_reward_keys`: keys of the
    /// reward's result dict), one row per response holding one value per key (bools count 1 and
    /// 0, as numpy's float cast makes them). No keys: no rows.
    pub fn components(&self, keys: &[String]) -> Result<Vec<Vec<f64>>, RewardError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut rows = vec![Vec::with_capacity(keys.len()); self.rewards.len()];
        for key in keys {
            let values = self.numbers(
                key,
                "algorithm.gdpo_reward_keys",
                "GDPO needs a reward whose result dict holds every key",
            )?;
            for (row, value) in rows.iter_mut().zip(values) {
                row.push(value);
            }
        }
        Ok(rows)
    }
}

impl RewardManager {
    /// `name` is `reward_model.reward_manager`; `max_resp_len` is `data.max_response_length`.
    /// The overlong buffer is checked as verl's manager asserts (and only `dapo` reads it).
    pub fn new(
        name: &str,
        overlong: &OverlongBufferConfig,
        max_resp_len: usize,
    ) -> Result<Self, RewardError> {
        let kind = match name {
            "naive" => ManagerKind::Naive,
            "dapo" => ManagerKind::Dapo,
            other => {
                return Err(RewardError::Config(format!(
                    "reward_model.reward_manager={other} is not a reward manager here; choose one of: {}",
                    MANAGERS.join(", ")
                )));
            }
        };
        let overlong = match (kind, overlong.enable) {
            (ManagerKind::Dapo, true) => {
                if overlong.len == 0 {
                    return Err(RewardError::Config(
                        "reward_model.overlong_buffer.len must be positive when reward_model.overlong_buffer.enable=true (set enable=false to turn the penalty off)".into(),
                    ));
                }
                if overlong.len > max_resp_len {
                    return Err(RewardError::Config(format!(
                        "reward_model.overlong_buffer.len={} exceeds data.max_response_length={max_resp_len}",
                        overlong.len
                    )));
                }
                Some(Overlong {
                    len: overlong.len,
                    penalty_factor: overlong.penalty_factor,
                    log: overlong.log,
                })
            }
            (ManagerKind::Naive, true) => {
                return Err(RewardError::Config(
                    "reward_model.overlong_buffer.enable=true needs reward_model.reward_manager=dapo (the naive manager has no overlong penalty)".into(),
                ));
            }
            (_, false) => None,
        };
        Ok(Self {
            kind,
            overlong,
            max_resp_len,
        })
    }

    pub fn kind(&self) -> ManagerKind {
        self.kind
    }

    /// DAPO's penalty for a response of `length` tokens: `min(-(length - expected) / len ×
    /// penalty_factor, 0)` with `expected = max_response_length - len`.
    pub fn overlong_penalty(&self, length: usize) -> Option<f64> {
        self.overlong.map(|o| {
            let expected = self.max_resp_len as f64 - o.len as f64;
            let exceed = length as f64 - expected;
            (-exceed / o.len as f64 * o.penalty_factor).min(0.0)
        })
    }

    /// The rewards of responses with these scores and lengths (response tokens, EOS included).
    pub fn apply(&self, scores: &[RewardScore], lengths: &[usize]) -> Rewards {
        let mut out = Rewards::default();
        let mut push = |key: &str, value: Value| {
            out.extra.entry(key.to_owned()).or_default().push(value);
        };
        let mut rewards = Vec::with_capacity(scores.len());
        for (score, &length) in scores.iter().zip(lengths) {
            if score.extra.is_empty() {
                if self.kind == ManagerKind::Dapo {
                    push("acc", Value::from(score.score));
                }
            } else {
                // verl's dict result, `score` included.
                push("score", Value::from(score.score));
                for (key, value) in &score.extra {
                    push(key, value.clone());
                }
            }
            let mut reward = score.score;
            if let Some(penalty) = self.overlong_penalty(length) {
                reward += penalty;
                if self.overlong.is_some_and(|o| o.log) {
                    push("overlong_reward", Value::from(penalty));
                    push("overlong", Value::from(penalty < 0.0));
                }
            }
            rewards.push(reward);
        }
        out.rewards = rewards;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overlong(enable: bool, len: usize, penalty_factor: f64, log: bool) -> OverlongBufferConfig {
        OverlongBufferConfig {
            enable,
            len,
            penalty_factor,
            log,
        }
    }

    /// Hand-computed from verl's formula with max_resp_len 20, buffer 4, factor 1.0: expected
    /// length 16; 16 tokens → 0, 17 → -0.25, 18 → -0.5, 20 → -1, 10 → 0 (min with 0).
    #[test]
    fn overlong_penalty_as_verl() {
        let m = RewardManager::new("dapo", &overlong(true, 4, 1.0, true), 20).unwrap();
        let scores = vec![RewardScore::new(1.0); 5];
        let out = m.apply(&scores, &[16, 17, 18, 20, 10]);
        assert_eq!(out.rewards, vec![1.0, 0.75, 0.5, 0.0, 1.0]);
        assert_eq!(
            out.extra["overlong_reward"],
            vec![
                Value::from(0.0),
                Value::from(-0.25),
                Value::from(-0.5),
                Value::from(-1.0),
                Value::from(0.0)
            ]
        );
        assert_eq!(
            out.extra["overlong"],
            [false, true, true, true, false].map(Value::from).to_vec()
        );
        // Float scores are recorded as `acc` by the dapo manager.
        assert_eq!(out.extra["acc"], vec![Value::from(1.0); 5]);
        // Factor 0.5, buffer 8 of 32: 30 tokens exceed 24 by 6 → -6/8 × 0.5 = -0.375.
        let m = RewardManager::new("dapo", &overlong(true, 8, 0.5, false), 32).unwrap();
        let out = m.apply(&[RewardScore::new(-1.0)], &[30]);
        assert_eq!(out.rewards, vec![-1.375]);
        assert!(!out.extra.contains_key("overlong"));
    }

    #[test]
    fn naive_passes_scores_and_dicts_through() {
        let m = RewardManager::new("naive", &OverlongBufferConfig::default(), 8).unwrap();
        let out = m.apply(&[RewardScore::new(0.5)], &[8]);
        assert_eq!(out.rewards, vec![0.5]);
        assert!(out.extra.is_empty());
        let out = m.apply(&[RewardScore::new(-1.0).with("acc", false)], &[3]);
        assert_eq!(out.extra["score"], vec![Value::from(-1.0)]);
        assert_eq!(out.extra["acc"], vec![Value::from(false)]);
    }

    #[test]
    fn filter_metrics() {
        let dapo = RewardManager::new("dapo", &OverlongBufferConfig::default(), 8).unwrap();
        let naive = RewardManager::new("naive", &OverlongBufferConfig::default(), 8).unwrap();
        let dicts = [
            RewardScore::new(1.0).with("acc", true),
            RewardScore::new(-1.0).with("acc", false),
        ];
        let out = naive.apply(&dicts, &[1, 1]);
        assert_eq!(out.filter_metric(Some("acc")).unwrap(), vec![1.0, 0.0]);
        assert_eq!(out.filter_metric(None).unwrap(), vec![1.0, 0.0]);
        assert_eq!(out.filter_metric(Some("score")).unwrap(), vec![1.0, -1.0]);
        assert!(out.filter_metric(Some("pred")).is_err());
        let floats = [RewardScore::new(0.5), RewardScore::new(0.0)];
        let out = naive.apply(&floats, &[1, 1]);
        assert_eq!(out.filter_metric(None).unwrap(), vec![0.5, 0.0]);
        let err = out.filter_metric(Some("acc")).unwrap_err().to_string();
        assert!(err.contains("metric=acc") && err.contains("dapo"), "{err}");
        let out = dapo.apply(&floats, &[1, 1]);
        assert_eq!(out.filter_metric(Some("acc")).unwrap(), vec![0.5, 0.0]);
        assert_eq!(
            out.filter_metric(Some("seq_reward")).unwrap(),
            vec![0.5, 0.0]
        );
    }

    #[test]
    fn gdpo_components_come_from_the_result_dicts() {
        let naive = RewardManager::new("naive", &OverlongBufferConfig::default(), 8).unwrap();
        let dicts = [
            RewardScore::new(1.5)
                .with("format", true)
                .with("accuracy", 0.5),
            RewardScore::new(0.0)
                .with("format", false)
                .with("accuracy", -2),
        ];
        let out = naive.apply(&dicts, &[1, 1]);
        let keys = |k: &[&str]| k.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            out.components(&keys(&["accuracy", "format", "score"]))
                .unwrap(),
            vec![vec![0.5, 1.0, 1.5], vec![-2.0, 0.0, 0.0]]
        );
        assert!(out.components(&[]).unwrap().is_empty());
        let err = out.components(&keys(&["length"])).unwrap_err().to_string();
        assert!(
            err.contains("gdpo_reward_keys")
                && err.contains("`length`")
                && err.contains("accuracy, format, score"),
            "{err}"
        );
        let text = naive.apply(&[RewardScore::new(0.0).with("pred", "7")], &[1]);
        let err = text.components(&keys(&["pred"])).unwrap_err().to_string();
        assert!(err.contains("not a number"), "{err}");
    }

    #[test]
    fn validation_means_follow_verls_sections() {
        let naive = RewardManager::new("naive", &OverlongBufferConfig::default(), 8).unwrap();
        let scores = [0.0, 1.0, 0.5].map(RewardScore::new);
        let floats = naive.apply(&scores, &[1; 3]);
        assert_eq!(
            floats.validation_means(&["a", "a", "b"]),
            vec![
                ("val-core", "a".into(), "reward".into(), 0.5),
                ("val-core", "b".into(), "reward".into(), 0.5)
            ]
        );
        let dapo = RewardManager::new("dapo", &overlong(true, 4, 1.0, false), 8).unwrap();
        let dicts = [
            RewardScore::new(1.0).with("acc", true).with("pred", "7"),
            RewardScore::new(-1.0).with("acc", false).with("pred", "8"),
        ];
        // Lengths 8 and 4: the first loses 1 to the overlong penalty.
        let mut out = dapo.apply(&dicts, &[8, 4]);
        out.append(dapo.apply(&dicts[..1], &[4]));
        assert_eq!(
            out.validation_means(&["s", "s", "s"]),
            vec![
                (
                    "val-aux",
                    "s".into(),
                    "reward".into(),
                    (0.0 - 1.0 + 1.0) / 3.0
                ),
                ("val-core", "s".into(), "acc".into(), 2.0 / 3.0),
                ("val-aux", "s".into(), "score".into(), 1.0 / 3.0),
            ]
        );
        // A key some rows lack cannot be a filter metric.
        let mut partial = naive.apply(&[RewardScore::new(0.0)], &[1]);
        partial.append(naive.apply(&dicts[..1], &[1]));
        let err = partial.filter_metric(Some("acc")).unwrap_err().to_string();
        assert!(err.contains("1 of 2"), "{err}");
    }

    #[test]
    fn bad_settings_name_the_key() {
        let err = |name, o: OverlongBufferConfig, max| {
            RewardManager::new(name, &o, max).unwrap_err().to_string()
        };
        assert!(err("prime", OverlongBufferConfig::default(), 8).contains("naive, dapo"));
        assert!(err("dapo", overlong(true, 0, 1.0, false), 8).contains("overlong_buffer.len"));
        assert!(err("dapo", overlong(true, 9, 1.0, false), 8).contains("max_response_length=8"));
        assert!(err("naive", overlong(true, 4, 1.0, false), 8).contains("reward_manager=dapo"));
        // Disabled: the dapo manager adds nothing.
        let m = RewardManager::new("dapo", &overlong(false, 0, 1.0, false), 8).unwrap();
        assert_eq!(m.overlong_penalty(8), None);
    }
}
