//! Reading `data/verl_algos_reference.json` (values computed by verl's own `core_algos.py`, made by
//! `scripts/reference/algos_reference.py`) and comparing with it. Shared by the parity tests of
//! `verl-core` (estimators, KL, controllers) and `verl-actor` (losses) through `#[path]`.

use std::collections::BTreeMap;

use serde_json::Value;

const JSON: &str = include_str!("../data/verl_algos_reference.json");

/// Within 1e-5, relative for values above 1 (verl computes in f32; verl-core may accumulate in f64).
pub fn close(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() <= 1e-5 * expected.abs().max(1.0)
}

/// A number or a list (of lists …) of numbers, flattened.
pub fn floats(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(items) => items.iter().flat_map(floats).collect(),
        Value::Number(n) => vec![n.as_f64().expect("a number") as f32],
        other => panic!("not a number or list: {other}"),
    }
}

/// Compares element by element; returns a description of the first difference.
pub fn compare(what: &str, actual: &[f32], expected: &[f32]) -> Result<(), String> {
    if actual.len() != expected.len() {
        return Err(format!(
            "{what}: {} values, verl has {}",
            actual.len(),
            expected.len()
        ));
    }
    match actual
        .iter()
        .zip(expected)
        .position(|(&a, &e)| !close(f64::from(a), f64::from(e)))
    {
        Some(i) => Err(format!(
            "{what}[{i}]: {} vs verl {}",
            actual[i], expected[i]
        )),
        None => Ok(()),
    }
}

/// What [`check_cases`] found: cases run per `kind/name`, and each difference from verl.
pub struct Checked {
    pub counts: BTreeMap<String, usize>,
    pub failures: Vec<String>,
}

impl Checked {
    /// Fails the test with every difference.
    pub fn assert_no_failures(&self) {
        assert!(
            self.failures.is_empty(),
            "{} of {} cases differ from verl:\n{}",
            self.failures.len(),
            self.counts.values().sum::<usize>(),
            self.failures.join("\n")
        );
    }
}

/// Runs `check(case, input set)` on every case of the reference; `check` returns `None` for a
/// kind it does not check. The input set is `Value::Null` for a case without one.
pub fn check_cases(mut check: impl FnMut(&Value, &Value) -> Option<Result<(), String>>) -> Checked {
    let root: Value = serde_json::from_str(JSON).expect("the reference is JSON");
    assert!(
        root["verl_commit"].as_str().is_some_and(|c| c.len() == 40),
        "the reference names the verl commit it was made from"
    );
    let inputs = root["inputs"].as_array().expect("inputs");
    let mut checked = Checked {
        counts: BTreeMap::new(),
        failures: Vec::new(),
    };
    for (i, case) in root["cases"].as_array().expect("cases").iter().enumerate() {
        let set = case["input"]
            .as_u64()
            .map_or(&Value::Null, |id| &inputs[id as usize]);
        let Some(outcome) = check(case, set) else {
            continue;
        };
        let kind = case["kind"].as_str().expect("kind");
        let label = format!("{kind}/{}", case["name"].as_str().unwrap_or(""));
        *checked.counts.entry(label.clone()).or_default() += 1;
        if let Err(e) = outcome {
            let detail = [&case["params"], &case["mode"]]
                .into_iter()
                .filter(|v| !v.is_null())
                .map(Value::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            checked
                .failures
                .push(format!("case {i} ({label}, {detail}): {e}"));
        }
    }
    println!("{:?}", checked.counts);
    checked
}
