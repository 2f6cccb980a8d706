//! The advantage estimators, the KL estimators in the reward and the adaptive KL controller
//! against values computed by verl's own `core_algos.py` on the same inputs
//! (`data/verl_algos_reference.json`, made by `scripts/reference/algos_reference.py`; the verl
//! commit is in the file), and the `variance_proxy/*` metrics against its `metric_utils.py`. The
//! losses are checked the same way in verl-actor.

#[path = "support/verl_reference.rs"]
mod verl_reference;

use verl_reference::{check_cases, close, compare, floats};

use serde_json::Value;
use verl_algo::{
    AdvEstimator, AdvantageInput, AdvantageParams, KlController, KlCtrlType, KlPenalty, Matrix,
    VarianceProxyInput, compute_advantage, kl_penalty, place_scores, variance_proxy_metrics,
};
use verl_plugin_api::RewardScore;
use verl_rewards::manager::RewardManager;
use verl_schema::OverlongBufferConfig;

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

/// GDPO from the reward's result dicts, as a run does it: the `naive` manager collects the dicts'
/// keys, `Rewards::components` takes `gdpo_reward_keys` from them, each value goes on its
/// response's last token, and the estimator weighs the components — against verl's
/// `compute_gdpo_outcome_advantage` reading the same dicts from `non_tensor_batch`.
fn gdpo_rewards_case(case: &Value) -> Result<(), String> {
    let results: Vec<RewardScore> = case["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(RewardScore::from_verl_result)
        .collect::<Result<_, _>>()?;
    let lengths: Vec<usize> = serde_json::from_value(case["lengths"].clone()).expect("lengths");
    let width = case["width"].as_u64().expect("width") as usize;
    let index: Vec<u64> = serde_json::from_value(case["index"].clone()).expect("index");
    let keys: Vec<String> = serde_json::from_value(case["keys"].clone()).expect("keys");
    let weights: Option<Vec<f32>> =
        serde_json::from_value(case["weights"].clone()).expect("weights");
    let manager = RewardManager::new("naive", &OverlongBufferConfig::default(), width)
        .map_err(|e| e.to_string())?;
    let rewards = manager.apply(&results, &lengths);
    let rows = rewards.components(&keys).map_err(|e| e.to_string())?;
    let mask = Matrix::new(
        lengths.len(),
        width,
        lengths
            .iter()
            .flat_map(|&n| (0..width).map(move |t| if t < n { 1.0 } else { 0.0 }))
            .collect(),
    )
    .expect("mask");
    let components: Vec<Matrix> = (0..keys.len())
        .map(|k| {
            let scores: Vec<f32> = rows.iter().map(|r| r[k] as f32).collect();
            place_scores(&scores, &mask).expect("placed")
        })
        .collect();
    let zeros = Matrix::zeros(lengths.len(), width);
    let input = AdvantageInput {
        reward_components: Some(&components),
        reward_weights: weights.as_deref(),
        ..AdvantageInput::new(&zeros, &mask, &index)
    };
    let params = AdvantageParams {
        norm_adv_by_std_in_grpo: case["norm_adv_by_std_in_grpo"].as_bool().expect("norm"),
        ..AdvantageParams::default()
    };
    let (adv, _) =
        compute_advantage(AdvEstimator::Gdpo, &params, &input).map_err(|e| e.to_string())?;
    compare("advantages", adv.data(), &floats(&case["advantages"]))
}

#[test]
fn gdpo_from_reward_result_dicts_matches_verl() {
    let checked = check_cases(|case, _| match case["kind"].as_str()? {
        "gdpo_rewards" => Some(gdpo_rewards_case(case)),
        _ => None,
    });
    assert!(
        checked
            .counts
            .iter()
            .filter(|(k, _)| k.starts_with("gdpo_rewards/"))
            .map(|(_, n)| n)
            .sum::<usize>()
            >= 12
    );
    checked.assert_no_failures();
}

/// verl's `compute_variance_proxy_metrics` on one input set, with or without its IS weights and
/// with or without a gradient norm: the same five keys, each within 1e-6 relative (verl computes
/// in f32, verl-core in f64; its own f32 result is within 2.2e-7 of its f64 one on these inputs).
fn variance_proxy_case(set: &Value, case: &Value, worst: &mut f64) -> Result<(), String> {
    let params = &case["params"];
    let [
        old_log_probs,
        sum_pi_squared,
        advantages,
        response_mask,
        weights,
    ] = [
        "old_log_probs",
        "sum_pi_squared",
        "advantages",
        "response_mask",
        "rollout_is_weights",
    ]
    .map(|key| matrix(&set[key]));
    let input = VarianceProxyInput {
        old_log_probs: &old_log_probs,
        sum_pi_squared: &sum_pi_squared,
        advantages: &advantages,
        response_mask: &response_mask,
        rollout_is_weights: (params["rollout_is_weights"] == true).then_some(&weights),
        grad_norm: params["grad_norm"].as_f64(),
    };
    let got = variance_proxy_metrics(&input).map_err(|e| e.to_string())?;
    let want = case["metrics"].as_object().expect("metrics");
    let keys: Vec<&String> = got.keys().collect();
    if keys != want.keys().collect::<Vec<_>>() {
        return Err(format!("keys {keys:?}, verl has {:?}", want.keys()));
    }
    for (key, value) in want {
        let want = value.as_f64().expect("a number");
        let got = got[key];
        if got != want {
            *worst = worst.max((got - want).abs() / want.abs());
        }
        if (got - want).abs() > 1e-6 * want.abs() {
            return Err(format!("{key}: {got} vs verl {want}"));
        }
    }
    Ok(())
}

#[test]
fn variance_proxy_metrics_match_verl() {
    let mut kinds = std::collections::BTreeSet::new();
    let mut worst = 0.0f64;
    let checked = check_cases(|case, set| match case["kind"].as_str()? {
        "variance_proxy" => {
            let p = &case["params"];
            kinds.insert((p["rollout_is_weights"] == true, p["grad_norm"].is_null()));
            Some(variance_proxy_case(set, case, &mut worst))
        }
        _ => None,
    });
    let counts = &checked.counts;
    let total: usize = counts
        .iter()
        .filter(|(k, _)| k.starts_with("variance_proxy/"))
        .map(|(_, n)| n)
        .sum();
    assert!(total >= 40, "{total} variance proxy cases");
    println!("variance proxies: largest relative difference from verl {worst:.2e}");
    // With and without IS weights, each with and without a grad norm; one response; aborted
    // responses; W below 0; IS weights under the 1e-10 clamp.
    assert_eq!(kinds.len(), 4, "{kinds:?}");
    for layout in ["left", "interior", "empty", "negative", "tiny_weights"] {
        assert!(
            counts.contains_key(&format!("variance_proxy/{layout}")),
            "no {layout} cases"
        );
    }
    checked.assert_no_failures();
}
