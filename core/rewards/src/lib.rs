//! Rewards. The rule rewards are dispatched on a sample's `data_source` with verl's names and
//! score semantics (`verl.utils.reward_score.default_compute_score`) and make up the built-in
//! `rule` reward component, code data sources scored by running the code in a SandboxFusion
//! server ([`sandbox`]); `custom_reward_function.path` selects another reward component (a
//! Rust plugin, or the `http` plugin for a reward server) ([`RewardSource`]). The reward manager
//! ([`manager`]) turns the scores into each response's reward, as verl's `naive` and `dapo`
//! managers do.

pub mod geo3k;
pub mod gsm8k;
mod latex_text;
pub mod manager;
pub mod math;
pub mod math_dapo;
pub mod prime_math;
mod prm800k;
mod py;
pub mod sandbox;
pub mod search_r1;
mod source;
mod symbolic;

use serde::Deserialize;
use serde_json::Value;
use verl_plugin_api::{
    ComponentInit, PluginError, Reward, RewardCapabilities, RewardOutput, RewardRequest,
    RewardScore,
};

pub use source::RewardSource;
use verl_data::synthetic;
use verl_schema::{CustomRewardFunctionConfig, RewardModelConfig, SandboxFusionConfig};

/// The reward of one response could not be computed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RewardError {
    #[error("no rule reward for data_source `{0}`; built-in sources: {known}; set custom_reward_function.path for others", known = KNOWN_SOURCES.join(", "))]
    UnknownDataSource(String),
    #[error("data_source `{data_source}`: ground truth: {reason}")]
    GroundTruth { data_source: String, reason: String },
    #[error("{}", sandbox::no_sandbox_message(.0))]
    NoSandbox(String),
    #[error("{0}")]
    Config(String),
}

/// `data_source` values that verl scores with the MATH rule.
const MATH_SOURCES: [&str; 3] = [
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
];

/// `data_source` values (besides any starting with `aime`) that verl scores with DAPO's rule.
const DAPO_SOURCES: [&str; 3] = ["math_dapo", "math", "math_dapo_reasoning"];

const SEARCH_R1_SOURCES: [&str; 7] = [
    "searchR1_nq",
    "searchR1_triviaqa",
    "searchR1_popqa",
    "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa",
    "searchR1_musique",
    "searchR1_bamboogle",
];

/// `data_source` values verl scores with PRIME's math rule.
const PRIME_MATH_SOURCES: [&str; 6] = [
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
];

const KNOWN_SOURCES: [&str; 27] = [
    gsm8k::DATA_SOURCE,
    MATH_SOURCES[0],
    MATH_SOURCES[1],
    MATH_SOURCES[2],
    DAPO_SOURCES[0],
    DAPO_SOURCES[1],
    DAPO_SOURCES[2],
    "aime*",
    PRIME_MATH_SOURCES[0],
    PRIME_MATH_SOURCES[1],
    PRIME_MATH_SOURCES[2],
    PRIME_MATH_SOURCES[3],
    PRIME_MATH_SOURCES[4],
    PRIME_MATH_SOURCES[5],
    geo3k::DATA_SOURCE,
    SEARCH_R1_SOURCES[0],
    SEARCH_R1_SOURCES[1],
    SEARCH_R1_SOURCES[2],
    SEARCH_R1_SOURCES[3],
    SEARCH_R1_SOURCES[4],
    SEARCH_R1_SOURCES[5],
    SEARCH_R1_SOURCES[6],
    synthetic::DATA_SOURCE,
    sandbox::DATA_SOURCES[0],
    sandbox::DATA_SOURCES[1],
    sandbox::DATA_SOURCES[2],
    sandbox::DATA_SOURCES[3],
];

/// The ground truth as the text rules compare with.
fn ground_truth_text(ground_truth: &Value) -> std::borrow::Cow<'_, str> {
    match ground_truth {
        Value::String(s) => s.into(),
        other => other.to_string().into(),
    }
}

/// The rule score of `response` for a sample from `data_source`: verl's float, or its result
/// dict (`math_dapo`: `score`, `acc`, `pred`). The code sources need a sandbox
/// ([`RuleReward`] has one): here they are [`RewardError::NoSandbox`].
pub fn rule_score(
    data_source: &str,
    response: &str,
    ground_truth: &Value,
) -> Result<RewardScore, RewardError> {
    let truth = ground_truth_text(ground_truth);
    let gsm8k =
        |truth: &str| gsm8k::compute_score(response, truth, gsm8k::Method::Strict, 0.0, 1.0);
    Ok(if data_source == gsm8k::DATA_SOURCE {
        RewardScore::new(gsm8k(&truth))
    } else if MATH_SOURCES.contains(&data_source) {
        RewardScore::new(math::compute_score(response, &truth))
    } else if DAPO_SOURCES.contains(&data_source) || data_source.starts_with("aime") {
        let s = math_dapo::compute_score(response, &truth);
        RewardScore::new(s.score)
            .with("acc", s.acc)
            .with("pred", s.pred)
    } else if PRIME_MATH_SOURCES.contains(&data_source) {
        RewardScore::new(prime_math::compute_score(response, &truth))
    } else if data_source == geo3k::DATA_SOURCE {
        RewardScore::new(geo3k::compute_score(response, &truth))
    } else if SEARCH_R1_SOURCES.contains(&data_source) {
        let targets =
            search_r1::targets(ground_truth).map_err(|reason| RewardError::GroundTruth {
                data_source: data_source.to_owned(),
                reason,
            })?;
        RewardScore::new(search_r1::compute_score(response, &targets))
    } else if sandbox::DATA_SOURCES.contains(&data_source) {
        return Err(RewardError::NoSandbox(data_source.to_owned()));
    } else if data_source == synthetic::DATA_SOURCE {
        // The synthetic task answers in GSM8K's `#### <number>` format, so it is scored the same way.
        RewardScore::new(gsm8k(&truth))
    } else {
        return Err(RewardError::UnknownDataSource(data_source.to_owned()));
    })
}

/// The score of `response` against a textual `ground_truth` for a sample from `data_source`.
pub fn compute_score(
    data_source: &str,
    response: &str,
    ground_truth: &str,
) -> Result<f64, RewardError> {
    rule_score(
        data_source,
        response,
        &Value::String(ground_truth.to_owned()),
    )
    .map(|s| s.score)
}

/// The dataset's ground truth as a reward component receives it: the text, or the object it
/// holds when the column was structured (Search-R1's `{"target": [...]}`; the data layer keeps
/// such values as their JSON text).
pub fn ground_truth_value(text: &str) -> Value {
    match serde_json::from_str::<Value>(text) {
        Ok(object @ Value::Object(_)) => object,
        _ => Value::String(text.to_owned()),
    }
}

/// Fails before a run when the rule reward scores it and a data source the run uses needs a
/// sandbox that `reward_model.sandbox_fusion.url` does not give; warns that the sandbox settings
/// do nothing when another reward component scores the run (verl ignores them then too).
pub fn check_sources<'a>(
    reward_model: &RewardModelConfig,
    custom_reward_function: &CustomRewardFunctionConfig,
    sources: impl IntoIterator<Item = &'a str>,
) -> Result<(), RewardError> {
    let url = reward_model.sandbox_fusion.url.as_deref();
    let has_sandbox = url.is_some_and(|u| !u.is_empty());
    if RewardSource::of(custom_reward_function)? != RewardSource::Rule {
        if has_sandbox {
            tracing::warn!(
                "reward_model.sandbox_fusion has no effect: custom_reward_function.path selects the reward"
            );
        }
        return Ok(());
    }
    if has_sandbox {
        return Ok(());
    }
    match sources
        .into_iter()
        .find(|s| sandbox::DATA_SOURCES.contains(s))
    {
        Some(source) => Err(RewardError::NoSandbox(source.to_owned())),
        None => Ok(()),
    }
}

/// The built-in `rule` reward component: verl's `default_compute_score`. Its init config is
/// the `custom_reward_function` section plus `sandbox_fusion` (`reward_model.sandbox_fusion`).
#[derive(Debug, Default)]
pub struct RuleReward {
    sandbox: Option<sandbox::Sandbox>,
}

/// The name of the built-in rule reward component.
pub const RULE_REWARD: &str = "rule";

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RuleSection {
    sandbox_fusion: SandboxFusionConfig,
}

impl Reward for RuleReward {
    fn capabilities() -> RewardCapabilities {
        RewardCapabilities::default().data_sources(KNOWN_SOURCES)
    }

    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        let section: RuleSection = init.config(RULE_REWARD)?;
        self.sandbox = sandbox::Sandbox::from_config(&section.sandbox_fusion)
            .map_err(|e| PluginError::invalid_config(e.to_string()))?;
        Ok(())
    }

    fn compute(&mut self, request: &RewardRequest) -> Result<RewardOutput, PluginError> {
        let is_code = |i: &&verl_plugin_api::RewardItem| {
            sandbox::DATA_SOURCES.contains(&i.data_source.as_str())
        };
        // The code items go to the sandbox together, so that their runs overlap.
        let code: Vec<sandbox::Task> = request
            .items
            .iter()
            .filter(is_code)
            .map(|item| sandbox::Task::new(&item.solution_str, &item.ground_truth))
            .collect();
        let mut code_scores = match &self.sandbox {
            Some(sandbox) if !code.is_empty() => sandbox.score(&code),
            _ => Vec::new(),
        }
        .into_iter();
        let scores = request
            .items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let score = if is_code(&item) {
                    code_scores
                        .next()
                        .map(|s| RewardScore::new(s.score))
                        .ok_or_else(|| RewardError::NoSandbox(item.data_source.clone()))
                } else {
                    rule_score(&item.data_source, &item.solution_str, &item.ground_truth)
                };
                score.map_err(|e| PluginError::other(format!("item {i}: {e}")))
            })
            .collect::<Result<_, _>>()?;
        Ok(RewardOutput::new(scores))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synthetic_tasks_sft_targets_earn_the_full_reward() {
        let task = synthetic::AdditionTask {
            train_size: 300,
            val_size: 50,
            ..Default::default()
        };
        let (train, val) = task.generate().unwrap();
        for s in train.iter().chain(&val) {
            let target = s.extra_info["answer"].as_str().unwrap();
            assert_eq!(
                compute_score(&s.data_source, target, &s.reward_model.ground_truth),
                Ok(1.0),
                "{target}"
            );
        }
    }

    #[test]
    fn dispatches_on_data_source() {
        assert_eq!(compute_score("openai/gsm8k", "so #### 72", "72"), Ok(1.0));
        assert_eq!(
            compute_score(
                "DigitalLearningGmbH/MATH-lighteval",
                "\\boxed{\\frac12}",
                "\\frac{1}{2}"
            ),
            Ok(1.0)
        );
        assert_eq!(compute_score("lighteval/MATH", "\\boxed{3}", "4"), Ok(0.0));
        assert_eq!(
            compute_score(synthetic::DATA_SOURCE, "#### 579", "579"),
            Ok(1.0)
        );
        assert_eq!(compute_score(synthetic::DATA_SOURCE, "579", "579"), Ok(0.0));
        assert_eq!(compute_score("aime2025", "Answer: 7", "7"), Ok(1.0));
        assert_eq!(compute_score("math_dapo", "Answer: 8", "7"), Ok(-1.0));
        assert_eq!(
            compute_score("numina_olympiads", "The answer is \\boxed{0.5}", "\\frac12"),
            Ok(1.0)
        );
        assert_eq!(
            compute_score("hiyouga/geometry3k", "<think>x</think>\\boxed{60}", "60"),
            Ok(1.0)
        );
        let err = compute_score("my/data", "x", "y").unwrap_err();
        assert!(err.to_string().contains("my/data") && err.to_string().contains("openai/gsm8k"));
    }

    #[test]
    fn dapo_returns_acc_and_pred() {
        let s = rule_score("math_dapo", "Answer: 1,000", &Value::from("1000")).unwrap();
        assert_eq!(
            s,
            RewardScore::new(1.0).with("acc", true).with("pred", "1000")
        );
    }

    #[test]
    fn search_r1_reads_structured_ground_truth() {
        let truth = ground_truth_value(r#"{"target":["Paris","paris city"]}"#);
        let s = rule_score("searchR1_nq", "<answer> paris </answer>", &truth).unwrap();
        assert_eq!(s.score, 1.0);
        // A plain string is no `{"target": ...}` object (verl raises a TypeError).
        let err = rule_score(
            "searchR1_nq",
            "<answer>x</answer>",
            &ground_truth_value("x"),
        )
        .unwrap_err();
        assert!(err.to_string().contains("searchR1_nq") && err.to_string().contains("target"));
        // A text that is not an object stays text, even when it is valid JSON.
        assert_eq!(ground_truth_value("[1, 2]"), Value::from("[1, 2]"));
    }

    #[test]
    fn code_sources_need_a_sandbox() {
        let err = compute_score("taco", "```python\nprint(1)\n```", "{}").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("data_source `taco`")
                && text.contains("reward_model.sandbox_fusion.url")
                && text.contains("prime_code")
                && text.contains("reward_server.py"),
            "{text}"
        );
        let request = RewardRequest::new(vec![
            verl_plugin_api::RewardItem::new("openai/gsm8k", "#### 1", "1"),
            verl_plugin_api::RewardItem::new("apps", "```python\nprint(1)\n```", "{}"),
        ]);
        let err = RuleReward::default().compute(&request).unwrap_err();
        assert!(
            err.message().contains("item 1") && err.message().contains("`apps`"),
            "{err}"
        );
        // Checked before a run: only when the rule reward scores it.
        let mut reward_model = RewardModelConfig::default();
        let mut custom = CustomRewardFunctionConfig::default();
        let sources = ["openai/gsm8k", "codeforces"];
        let err = check_sources(&reward_model, &custom, sources)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`codeforces`"), "{err}");
        assert!(check_sources(&reward_model, &custom, ["openai/gsm8k"]).is_ok());
        reward_model.sandbox_fusion.url = Some("http://127.0.0.1:8080/run_code".into());
        assert!(check_sources(&reward_model, &custom, sources).is_ok());
        reward_model.sandbox_fusion.url = None;
        custom.path = Some("http://127.0.0.1:8000".into());
        assert!(check_sources(&reward_model, &custom, sources).is_ok());
    }

    #[test]
    fn the_rule_component_reads_its_sandbox_settings() {
        let init = |section: Value| {
            let mut reward = RuleReward::default();
            reward
                .init(&ComponentInit::new(section, Default::default()))
                .map(|()| reward.sandbox.map(|s| s.url().to_owned()))
        };
        assert_eq!(init(serde_json::json!({"path": null})).unwrap(), None);
        let url = "http://127.0.0.1:8080/run_code";
        let section = serde_json::json!({"sandbox_fusion": {"url": url, "max_concurrent": 2, "memory_limit_mb": -1}});
        assert_eq!(init(section).unwrap().as_deref(), Some(url));
        let err = init(serde_json::json!({"sandbox_fusion": {"url": url, "max_concurent": 2}}))
            .unwrap_err();
        assert!(err.message().contains("max_concurent"), "{err}");
    }

    #[test]
    fn the_component_names_the_failing_item() {
        let request = RewardRequest::new(vec![
            verl_plugin_api::RewardItem::new("openai/gsm8k", "#### 1", "1"),
            verl_plugin_api::RewardItem::new("nope", "x", "y"),
        ]);
        let err = RuleReward::default().compute(&request).unwrap_err();
        assert!(
            err.message().contains("item 1") && err.message().contains("nope"),
            "{err}"
        );
    }
}
