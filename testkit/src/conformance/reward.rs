//! The reward suite: one finite score per item in order, the same scores twice, order follows the
//! items, an empty batch, and a `data_source` outside the declared ones refused with an error.
//!
//! Items use the first `data_source` the component declares (any name when it declares none),
//! with awkward solutions: empty, whitespace, unicode, answer tags, braces, 20,000 characters.
//! The component is initialised with [`Options::reward_config`](super::Options::reward_config)
//! (the `custom_reward_function` section); a component that reports that config invalid (a server
//! URL it needs) has its checks skipped with its message.

use serde_json::json;
use verl_plugin_api::{
    ComponentInit, ErrorKind, RewardCapabilities, RewardItem, RewardRequest, RunContext,
};

use super::{Outcome, Suite, call, ensure};

pub const CHECKS: &[&str] = &[
    "init",
    "one_score_per_item",
    "deterministic",
    "order_follows_items",
    "empty_batch",
    "undeclared_source_refused",
];

const SOLUTIONS: [&str; 8] = [
    "",
    "   \n\t",
    "#### 42",
    "The answer is \\boxed{\\frac{1}{2}}.",
    "<answer>Paris</answer>",
    "Answer: 7\nunicode: ü ∑ 数学 🙂",
    "{{{{ unbalanced \\boxed{",
    "1",
];

fn request(source: &str) -> RewardRequest {
    let mut items: Vec<RewardItem> = SOLUTIONS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            RewardItem::new(source, *s, "42").extra_info(json!({"index": i, "split": "test"}))
        })
        .collect();
    items.push(RewardItem::new(
        source,
        "x".repeat(20_000) + " #### 42",
        "42",
    ));
    RewardRequest::new(items)
}

fn scores(out: &verl_plugin_api::RewardOutput) -> Vec<f64> {
    out.scores.iter().map(|s| s.score).collect()
}

pub fn run(suite: &mut Suite) {
    let caps: RewardCapabilities = suite.component.capabilities();
    let source = caps
        .data_sources
        .iter()
        .find(|s| !s.contains('*'))
        .cloned()
        .unwrap_or_else(|| "conformance/any".to_owned());
    let component = suite.component.clone();
    let config = suite.options.reward_config.clone();
    let mut reward = None;
    let mut needs = None;
    suite.check("init", || {
        let mut r = component.create_reward().map_err(|e| e.to_string())?;
        let mut init = ComponentInit::new(config, RunContext::default());
        init.section_path = "custom_reward_function".into();
        match r.init(&init) {
            Ok(()) => {
                reward = Some(r);
                Ok(Outcome::Pass)
            }
            Err(e) if e.kind == ErrorKind::INVALID_CONFIG => {
                let why = format!(
                    "needs config (Options::reward_config, the custom_reward_function section): {}",
                    e.message()
                );
                needs = Some(why.clone());
                Ok(Outcome::Skipped(why))
            }
            Err(e) => Err(format!("init: {e}")),
        }
    });
    let Some(mut reward) = reward else {
        let why = needs.unwrap_or_else(|| "needs `init`, which failed".to_owned());
        for check in &CHECKS[1..] {
            suite.skip(check, why.clone());
        }
        return;
    };
    let batch = request(&source);
    let mut first = None;
    suite.check("one_score_per_item", || {
        let out = call("compute", reward.compute(&batch))?;
        let s = scores(&out);
        ensure(s.len() == batch.items.len(), || {
            format!("{} scores for {} items", s.len(), batch.items.len())
        })?;
        ensure(s.iter().all(|v| v.is_finite()), || {
            format!("non-finite scores: {s:?}")
        })?;
        first = Some(s);
        Ok(Outcome::Pass)
    });
    suite.check("deterministic", || {
        let Some(first) = &first else {
            return Ok(Outcome::Skipped("needs `one_score_per_item`".into()));
        };
        let again = scores(&call("compute", reward.compute(&batch))?);
        ensure(&again == first, || {
            format!("the same batch scored {first:?}, then {again:?}")
        })?;
        Ok(Outcome::Pass)
    });
    suite.check("order_follows_items", || {
        let Some(first) = &first else {
            return Ok(Outcome::Skipped("needs `one_score_per_item`".into()));
        };
        let mut reversed = batch.clone();
        reversed.items.reverse();
        let mut got = scores(&call("compute", reward.compute(&reversed))?);
        got.reverse();
        ensure(&got == first, || {
            format!("reversed items scored {got:?} (reversed back), in order {first:?}")
        })?;
        Ok(Outcome::Pass)
    });
    suite.check("empty_batch", || {
        let out = call("compute", reward.compute(&RewardRequest::default()))?;
        ensure(out.scores.is_empty(), || {
            format!("{} scores for no items", out.scores.len())
        })?;
        Ok(Outcome::Pass)
    });
    suite.check("undeclared_source_refused", || {
        if caps.data_sources.is_empty() {
            return Ok(Outcome::Skipped(
                "declares no data_sources: it scores any".into(),
            ));
        }
        let odd = request("conformance/undeclared-source");
        match reward.compute(&odd) {
            Err(e) => {
                ensure(
                    e.message().contains("conformance/undeclared-source"),
                    || format!("the error does not name the data_source: {e}"),
                )?;
                Ok(Outcome::Pass)
            }
            Ok(out) => Err(format!(
                "scored {} items of an undeclared data_source instead of refusing them",
                out.scores.len()
            )),
        }
    });
}
