//! `algorithm.rollout_correction` against verl's own `rollout_corr_helper.py` on the same inputs
//! (`data/verl_rollout_corr_reference.json`, made by `scripts/reference/rollout_corr_reference.py`;
//! the verl commit is in the file): the IS weights, the rejection mask and every `rollout_corr/`
//! metric, for token and sequence weights (with and without batch normalisation), each rejection
//! option alone and chained, on batches with padding holding junk and with empty rows.

use serde_json::Value;
use verl_algo::{IsLevel, Matrix, RolloutCorrection, rollout_correction};

const JSON: &str = include_str!("data/verl_rollout_corr_reference.json");

fn matrix(v: &Value) -> Matrix {
    let rows = v.as_array().expect("rows");
    let cols = rows[0].as_array().expect("a row").len();
    let data = rows
        .iter()
        .flat_map(|r| r.as_array().expect("a row").iter())
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect();
    Matrix::new(rows.len(), cols, data).expect("rectangular")
}

/// Within 1e-5, relative above 1 (verl sums in f32, verl-core in f64).
fn close(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() <= 1e-5 * expected.abs().max(1.0)
}

fn check(case: &Value, set: &Value) -> Result<(), String> {
    let s = &case["settings"];
    let level = s["rollout_is"]
        .as_str()
        .map(|l| serde_json::from_value::<IsLevel>(Value::String(l.to_owned())).unwrap());
    let settings = RolloutCorrection::new(
        level,
        s["rollout_is_threshold"].as_f64().unwrap_or(2.0),
        s["rollout_is_batch_normalize"].as_bool().unwrap_or(false),
        s["rollout_rs"].as_str(),
        s["rollout_rs_threshold"].as_str(),
    )
    .map_err(|e| e.to_string())?;
    let out = rollout_correction(
        &matrix(&set["old_log_prob"]),
        &matrix(&set["rollout_log_prob"]),
        &matrix(&set["response_mask"]),
        &settings,
    )
    .map_err(|e| e.to_string())?;
    let same = |what: &str, actual: &Matrix, expected: &Value| -> Result<(), String> {
        let expected = matrix(expected);
        match actual
            .data()
            .iter()
            .zip(expected.data())
            .position(|(&a, &e)| !close(f64::from(a), f64::from(e)))
        {
            Some(i) => Err(format!(
                "{what}[{i}]: {} vs verl {}",
                actual.data()[i],
                expected.data()[i]
            )),
            None if actual.shape() != expected.shape() => Err(format!("{what}: shape")),
            None => Ok(()),
        }
    };
    match (&out.is_weights, case["weights"].is_null()) {
        (Some(w), false) => same("weights", w, &case["weights"])?,
        (None, true) => {}
        _ => return Err("IS weights present in one and not the other".to_owned()),
    }
    same("response_mask", &out.response_mask, &case["response_mask"])?;
    let expected = case["metrics"].as_object().expect("metrics");
    let mut ours: Vec<&String> = out.metrics.keys().collect();
    let mut theirs: Vec<&String> = expected.keys().collect();
    ours.sort();
    theirs.sort();
    if ours != theirs {
        return Err(format!(
            "metric keys differ: ours {ours:?}, verl {theirs:?}"
        ));
    }
    for (key, value) in expected {
        let e = value.as_f64().expect("a number");
        let a = out.metrics[key];
        // verl's clamped stds are `sqrt(E[c²] − E[c]²)` in float32: where the values are (nearly)
        // equal, that difference is float32 rounding, up to about ε₃₂·E[c²] ≈ 1e-6 for |c| ≈ 3,
        // so verl reports up to ~1e-3 where the exact value is 0. Those get that much room.
        let noise = key.ends_with("_std") && !key.ends_with("_seq_std");
        if !(close(a, e) || noise && (a - e).abs() <= 2e-3) {
            return Err(format!("{key}: {a} vs verl {e}"));
        }
    }
    Ok(())
}

#[test]
fn rollout_correction_matches_verl() {
    let reference: Value = serde_json::from_str(JSON).expect("reference JSON");
    assert_eq!(
        reference["verl_commit"].as_str().map(str::len),
        Some(40),
        "the reference names its verl commit"
    );
    let inputs = reference["inputs"].as_array().expect("inputs");
    let cases = reference["cases"].as_array().expect("cases");
    assert!(cases.len() >= 200, "{} cases", cases.len());
    let failures: Vec<String> = cases
        .iter()
        .enumerate()
        .filter_map(|(i, case)| {
            let set = &inputs[case["input"].as_u64().expect("input") as usize];
            check(case, set)
                .err()
                .map(|e| format!("case {i} {}: {e}", case["settings"]))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from verl:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
