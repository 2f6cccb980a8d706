//! The rule rewards against verl's own `default_compute_score` on the same inputs
//! (`data/verl_rewards_reference.json`, made by `scripts/reference/rewards_reference.py` from a
//! verl checkout; the verl commit is in the file): every case's score, and for DAPO's rule its
//! `acc` and `pred`, must be equal.

use serde_json::Value;
use verl_rewards::{ground_truth_value, rule_score};

#[path = "support/rule_cases.rs"]
mod rule_cases;
use rule_cases::{Tally, assert_every_rule_matches};

const REFERENCE: &str = include_str!("data/verl_rewards_reference.json");

/// The ground truth as the data layer hands it on: text, or a structured column's JSON text.
fn ground_truth(case: &Value) -> Value {
    match &case["ground_truth"] {
        Value::String(s) => Value::String(s.clone()),
        other => ground_truth_value(&other.to_string()),
    }
}

#[test]
fn rule_rewards_match_verl() {
    let reference: Value = serde_json::from_str(REFERENCE).expect("the reference parses");
    let cases = reference["cases"].as_array().expect("cases");
    let mut per_rule = Tally::new();
    for (i, case) in cases.iter().enumerate() {
        let rule = case["rule"].as_str().expect("rule");
        let source = case["data_source"].as_str().expect("data_source");
        let solution = case["solution"].as_str().expect("solution");
        let entry = per_rule.entry(rule).or_default();
        entry.0 += 1;
        let ours = match rule_score(source, solution, &ground_truth(case)) {
            Ok(s) => s,
            Err(e) => {
                entry.1.push(format!("case {i} ({source}): {e}"));
                continue;
            }
        };
        let verl = &case["result"];
        let (score, extra) = match verl {
            Value::Object(map) => (&map["score"], Some(map)),
            number => (number, None),
        };
        let mut differs = ours.score != score.as_f64().expect("a numeric score");
        if let Some(map) = extra {
            differs |= ours.extra.get("acc") != map.get("acc");
            differs |= ours.extra.get("pred") != map.get("pred");
        }
        if differs {
            entry.1.push(format!(
                "case {i} ({source}) {solution:?} vs {}: verl {verl}, ours {} {:?}",
                case["ground_truth"], ours.score, ours.extra
            ));
        }
    }
    assert_every_rule_matches(
        &per_rule,
        &["gsm8k", "math", "math_dapo", "search_r1"],
        cases.len(),
    );
}
