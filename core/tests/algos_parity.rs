//! The advantage estimators, the KL estimators in the reward and the adaptive KL controller
//! against values computed by verl's own `core_algos.py` on the same inputs
//! (`data/verl_algos_reference.json`, made by `scripts/reference/algos_reference.py`; the verl
//! commit is in the file). The losses are checked the same way in the torch-runtime crate.

#[path = "support/verl_reference.rs"]
mod verl_reference;

use verl_reference::{check_cases, close, compare, floats};

use serde_json::Value;
use verl_core::algo::{
    AdvEstimator, AdvantageInput, AdvantageParams, KlController, KlCtrlType, KlPenalty, Matrix,
    compute_advantage, kl_penalty,
};

fn matrix(v: &Value) -> Matrix {
    let rows = v.as_array().expect("a list of rows");
    let cols = rows.first().and_then(Value::as_array).map_or(0, Vec::len);
    Matrix::new(rows.len(), cols, floats(v)).expect("rectangular")
}

fn advantage_case(set: &Value, case: &Value) -> Result<(), String> {
    let params_json = &case["params"];
    let name = case["name"].as_str().expect("name");
    let estimator: AdvEstimator =
        serde_json::from_value(case["name"].clone()).map_err(|e| format!("{name}: {e}"))?;
    let rewards = matrix(&set["rewards"]);
    let mask = matrix(&set["mask"]);
    let index: Vec<u64> = set["index"]
        .as_array()
        .expect("index")
        .iter()
        .map(|v| v.as_u64().expect("group id"))
        .collect();
    let mut params = AdvantageParams::default();
    if let Some(g) = params_json["gamma"].as_f64() {
        params.gamma = g as f32;
    }
    if let Some(l) = params_json["lam"].as_f64() {
        params.lam = l as f32;
    }
    if let Some(n) = params_json["norm_adv_by_std_in_grpo"].as_bool() {
        params.norm_adv_by_std_in_grpo = n;
    }
    let optional = |key: &str| set.get(key).map(matrix);
    let values = optional("values");
    let old_log_probs = optional("old_log_probs");
    let sum_pi_squared = optional("sum_pi_squared");
    let is_weights = optional("rollout_is_weights");
    let baselines = set.get("reward_baselines").map(floats);
    let components: Option<Vec<Matrix>> = set.get("components").map(|c| {
        c.as_array()
            .expect("components")
            .iter()
            .map(matrix)
            .collect()
    });
    let weights: Option<Vec<f32>> = params_json.get("weights").and_then(|w| {
        w.as_array().map(|w| {
            w.iter()
                .map(|x| x.as_f64().expect("weight") as f32)
                .collect()
        })
    });
    let mut input = AdvantageInput {
        values: values.as_ref(),
        reward_baselines: baselines.as_deref(),
        old_log_probs: old_log_probs.as_ref(),
        sum_pi_squared: sum_pi_squared.as_ref(),
        ..AdvantageInput::new(&rewards, &mask, &index)
    };
    if params_json["rollout_is_weights"].as_bool() == Some(true) {
        input.rollout_is_weights = is_weights.as_ref();
    }
    if params_json["components"].as_bool() == Some(true) {
        input.reward_components = components.as_deref();
        input.reward_weights = weights.as_deref();
    }
    let (adv, returns) =
        compute_advantage(estimator, &params, &input).map_err(|e| format!("{name}: {e}"))?;
    compare("advantages", adv.data(), &floats(&case["advantages"]))?;
    compare("returns", returns.data(), &floats(&case["returns"]))
}

fn kl_case(set: &Value, case: &Value) -> Result<(), String> {
    let name = case["name"].as_str().expect("name");
    let kind: KlPenalty = serde_json::from_value(case["name"].clone())
        .map_err(|e| format!("`{name}` is not accepted: {e}"))?;
    let logprob = floats(&set["logprob"]);
    let reference = floats(&set["ref"]);
    let values: Vec<f32> = logprob
        .iter()
        .zip(&reference)
        .map(|(&lp, &rp)| kl_penalty(lp, rp, kind))
        .collect();
    compare("kl", &values, &floats(&case["value"]))
}

fn kl_ctrl_case(case: &Value) -> Result<(), String> {
    let p = &case["params"];
    let mut c = KlController::new(
        KlCtrlType::Adaptive,
        p["init_kl_coef"].as_f64().expect("coef"),
        p["target_kl"].as_f64().expect("target"),
        p["horizon"].as_u64().expect("horizon"),
    )
    .map_err(|e| e.to_string())?;
    let kls = case["current_kl"].as_array().expect("kls");
    let expected = case["values"].as_array().expect("values");
    for (i, (kl, want)) in kls.iter().zip(expected).enumerate() {
        c.update(kl.as_f64().expect("kl"), 8 * (i + 1));
        let want = want.as_f64().expect("value");
        if !close(c.value, want) {
            return Err(format!("step {i}: β {} vs verl {want}", c.value));
        }
    }
    Ok(())
}

#[test]
fn estimators_kl_and_controllers_match_verl() {
    let checked = check_cases(|case, set| match case["kind"].as_str()? {
        "advantage" => Some(advantage_case(set, case)),
        "kl" => Some(kl_case(set, case)),
        "kl_ctrl" => Some(kl_ctrl_case(case)),
        _ => None,
    });
    let counts = &checked.counts;
    // Every estimator of verl's registry, every KL name and the controller are covered.
    for name in [
        "gae",
        "grpo",
        "grpo_vectorized",
        "gdpo",
        "grpo_passk",
        "rloo",
        "rloo_vectorized",
        "opo",
        "gpg",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "optimal_token_baseline",
        "tir_optimal_token_baseline",
    ] {
        assert!(
            counts
                .get(&format!("advantage/{name}"))
                .is_some_and(|&n| n >= 2),
            "no reference cases for {name}"
        );
    }
    assert_eq!(counts.get("kl_ctrl/"), Some(&2));
    assert!(counts.keys().filter(|k| k.starts_with("kl/")).count() >= 14);
    checked.assert_no_failures();
}
