//! PRIME's math rule (`numina_*`) and Geometry3K's rule against verl's own
//! `default_compute_score` on the same inputs (`data/verl_rewards2_reference.json`, made by
//! `scripts/reference/rewards2_reference.py` from a verl checkout with sympy, pylatexenc and
//! mathruler; the verl commit and package versions are in the file): every case's score must be
//! equal, except the listed cases where verl's sympy decides otherwise than this port's numeric
//! equality check (each listed with the reason; a listed case that agrees, or a new
//! disagreement, fails the test).

use serde_json::Value;
use verl_rewards::rule_score;

#[path = "support/rule_cases.rs"]
mod rule_cases;
use rule_cases::{Tally, assert_every_rule_matches};

const REFERENCE: &str = include_str!("data/verl_rewards2_reference.json");

/// Cases (index) where this port and verl's sympy differ, each with the reason. None at present
/// (sympy's Float-against-irrational cases, e.g. `x^0.5` against `\sqrt{x}`, are modelled).
const KNOWN_DIFFERENCES: [(usize, &str); 0] = [];

#[test]
fn prime_math_and_geo3k_match_verl() {
    let reference: Value = serde_json::from_str(REFERENCE).expect("the reference parses");
    let cases = reference["cases"].as_array().expect("cases");
    let mut per_rule = Tally::new();
    let mut known = 0;
    for (i, case) in cases.iter().enumerate() {
        let rule = case["rule"].as_str().expect("rule");
        let source = case["data_source"].as_str().expect("data_source");
        let solution = case["solution"].as_str().expect("solution");
        let truth = &case["ground_truth"];
        let entry = per_rule.entry(rule).or_default();
        entry.0 += 1;
        let verl = case["result"].as_f64().expect("a numeric score");
        let ours = match rule_score(source, solution, truth) {
            Ok(s) => s.score,
            Err(e) => {
                entry.1.push(format!("case {i} ({source}): {e}"));
                continue;
            }
        };
        let listed = KNOWN_DIFFERENCES.iter().any(|(k, _)| *k == i);
        if ours != verl && listed {
            known += 1;
        } else if ours != verl || listed {
            entry.1.push(format!(
                "case {i} ({source}) {solution:?} vs {truth}: verl {verl}, ours {ours}{}",
                if listed {
                    " (listed as a known difference)"
                } else {
                    ""
                }
            ));
        }
    }
    assert_every_rule_matches(&per_rule, &["prime_math", "geo3k"], cases.len());
    assert_eq!(known, KNOWN_DIFFERENCES.len());
}
