//! The loss kernels against values computed by verl's own `core_algos.py` on the same inputs
//! (`core/algo/tests/data/verl_algos_reference.json`, made by
//! `scripts/reference/algos_reference.py`): loss aggregation in every mode and with global batch
//! normalisers, every policy loss (value, gradient with respect to the log-probs, metrics), the
//! KL estimators (value and gradient), the value loss and the entropy loss; and the policy losses
//! with rollout-correction IS weights.

#[path = "../../../core/algo/tests/support/verl_reference.rs"]
mod verl_reference;

use verl_reference::{check_cases, close, compare, floats};

use serde_json::Value;
use tch::{Kind, Tensor};
use verl_actor::losses::{
    AggScale, ClipConfig, KlPenalty, LossAggMode, PolicyBatch, PolicyLossMode, PolicyLossOptions,
    agg_loss, entropy_loss, kl_penalty, policy_loss, value_loss,
};

/// A JSON list (of lists …) as a float tensor of that shape.
fn tensor(v: &Value) -> Tensor {
    let mut shape = Vec::new();
    let mut at = v;
    while let Value::Array(items) = at {
        shape.push(items.len() as i64);
        match items.first() {
            Some(first) => at = first,
            None => break,
        }
    }
    Tensor::from_slice(&floats(v)).view(shape.as_slice())
}

fn values(t: &Tensor) -> Vec<f32> {
    let flat = t.to_kind(Kind::Float).contiguous().view(-1);
    Vec::<f32>::try_from(&flat).expect("a float tensor")
}

fn scalar_matches(what: &str, actual: &Tensor, expected: &Value) -> Result<(), String> {
    compare(what, &values(actual), &floats(expected))
}

fn mode(case: &Value) -> LossAggMode {
    case["mode"]
        .as_str()
        .expect("mode")
        .parse()
        .expect("a verl loss_agg_mode")
}

fn scale(info: &Value) -> AggScale {
    let get = |k: &str| info.get(k).and_then(Value::as_f64);
    AggScale {
        dp_size: get("dp_size").unwrap_or(1.0),
        batch_num_tokens: get("batch_num_tokens"),
        global_batch_size: get("global_batch_size"),
        loss_scale_factor: get("loss_scale_factor"),
    }
}

fn agg_case(set: &Value, case: &Value) -> Result<(), String> {
    let loss = agg_loss(
        &tensor(&set["loss"]),
        &tensor(&set["mask"]),
        mode(case),
        &scale(&case["info"]),
    );
    scalar_matches("agg_loss", &loss, &case["value"])
}

fn policy_case(set: &Value, case: &Value) -> Result<(), String> {
    let c = &case["config"];
    let clip_ratio = c["clip_ratio"].as_f64().expect("clip_ratio");
    let clip = ClipConfig {
        clip_ratio_low: c["clip_ratio_low"].as_f64().unwrap_or(clip_ratio),
        clip_ratio_high: c["clip_ratio_high"].as_f64().unwrap_or(clip_ratio),
        clip_ratio_c: c["clip_ratio_c"].as_f64().expect("clip_ratio_c"),
    };
    let p = &c["policy_loss"];
    let num = |v: &Value| v.as_f64().expect("a number");
    let options = PolicyLossOptions {
        tau_pos: num(&c["tau_pos"]),
        tau_neg: num(&c["tau_neg"]),
        clip_cov_ratio: num(&p["clip_cov_ratio"]),
        clip_cov_lb: num(&p["clip_cov_lb"]),
        clip_cov_ub: num(&p["clip_cov_ub"]),
        kl_cov_ratio: num(&p["kl_cov_ratio"]),
        ppo_kl_coef: num(&p["ppo_kl_coef"]),
        dro_beta: p["dro_beta"].as_f64(),
    };
    let loss_mode: PolicyLossMode = case["name"]
        .as_str()
        .expect("name")
        .parse()
        .map_err(|e: verl_model::ModelError| e.to_string())?;
    let log_prob = tensor(&set["log_prob"]).set_requires_grad(true);
    let weights = set.get("rollout_is_weights").map(tensor);
    let out = policy_loss(
        loss_mode,
        PolicyBatch {
            old_log_prob: &tensor(&set["old_log_prob"]),
            log_prob: &log_prob,
            advantages: &tensor(&set["advantages"]),
            response_mask: &tensor(&set["mask"]),
            rollout_is_weights: weights.as_ref(),
        },
        &clip,
        &options,
        mode(case),
        &AggScale::default(),
    )
    .map_err(|e| e.to_string())?;
    scalar_matches("pg_loss", &out.pg_loss, &case["pg_loss"])?;
    out.pg_loss.backward();
    compare("grad", &values(&log_prob.grad()), &floats(&case["grad"]))?;
    let expected = case["metrics"].as_object().expect("metrics");
    let ours: Vec<&str> = out.metrics.iter().map(|(k, _)| *k).collect();
    let mut theirs: Vec<&str> = expected.keys().map(String::as_str).collect();
    let mut ours_sorted = ours.clone();
    ours_sorted.sort_unstable();
    theirs.sort_unstable();
    if ours_sorted != theirs {
        return Err(format!("metrics {ours:?}, verl reports {theirs:?}"));
    }
    for (key, want) in expected {
        let got = out.metric(key).expect("compared above");
        if !close(got, want.as_f64().expect("a number")) {
            return Err(format!("{key}: {got} vs verl {want}"));
        }
    }
    Ok(())
}

fn kl_case(set: &Value, case: &Value) -> Result<(), String> {
    let name = case["name"].as_str().expect("name");
    let penalty: KlPenalty = name
        .parse()
        .map_err(|e: verl_model::ModelError| e.to_string())?;
    let logprob = tensor(&set["logprob"]).set_requires_grad(true);
    let kl = kl_penalty(&logprob, &tensor(&set["ref"]), penalty);
    compare("value", &values(&kl), &floats(&case["value"]))?;
    kl.sum(Kind::Float).backward();
    compare("grad", &values(&logprob.grad()), &floats(&case["grad"]))
}

fn value_case(set: &Value, case: &Value) -> Result<(), String> {
    let (loss, clipfrac) = value_loss(
        &tensor(&set["vpreds"]),
        &tensor(&set["returns"]),
        &tensor(&set["values"]),
        &tensor(&set["mask"]),
        case["cliprange_value"].as_f64().expect("cliprange"),
        mode(case),
        &AggScale::default(),
    );
    scalar_matches("vf_loss", &loss, &case["vf_loss"])?;
    compare(
        "vf_clipfrac",
        &[clipfrac as f32],
        &floats(&case["vf_clipfrac"]),
    )
}

fn entropy_case(set: &Value, case: &Value) -> Result<(), String> {
    let loss = entropy_loss(
        &tensor(&set["logits"]),
        &tensor(&set["mask"]),
        mode(case),
        &AggScale::default(),
    );
    scalar_matches("entropy", &loss, &case["value"])
}

#[test]
fn losses_match_verl() {
    let checked = check_cases(|case, set| match case["kind"].as_str()? {
        "agg" => Some(agg_case(set, case)),
        "policy_loss" => Some(policy_case(set, case)),
        "kl" => Some(kl_case(set, case)),
        "value_loss" => Some(value_case(set, case)),
        "entropy_loss" => Some(entropy_case(set, case)),
        _ => None,
    });
    let counts = &checked.counts;
    for name in [
        "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean",
        "dro", "cispo",
    ] {
        assert!(
            counts
                .get(&format!("policy_loss/{name}"))
                .is_some_and(|&n| n >= 3),
            "no reference cases for {name}"
        );
    }
    for kind in ["agg/", "value_loss/", "entropy_loss/"] {
        assert!(counts.get(kind).is_some_and(|&n| n >= 10), "{kind}");
    }
    checked.assert_no_failures();
}

/// The losses with rollout-correction IS weights, against verl b178a3c's `compute_policy_loss_*`
/// with `rollout_is_weights` (`core/algo/tests/data/verl_rollout_corr_reference.json`, made by
/// `scripts/reference/rollout_corr_reference.py`, weights from verl's own
/// `compute_rollout_correction_weights`, token and sequence level).
#[test]
fn losses_with_rollout_is_weights_match_verl() {
    let root: Value = serde_json::from_str(include_str!(
        "../../../core/algo/tests/data/verl_rollout_corr_reference.json"
    ))
    .expect("reference JSON");
    let inputs = root["loss_inputs"].as_array().expect("loss_inputs");
    let cases = root["loss_cases"].as_array().expect("loss_cases");
    let mut names = std::collections::BTreeSet::new();
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|case| {
            let set = &inputs[case["input"].as_u64().expect("input") as usize];
            assert!(set.get("rollout_is_weights").is_some());
            names.insert(case["name"].as_str().expect("name").to_owned());
            policy_case(set, case)
                .err()
                .map(|e| format!("{} {}: {e}", case["name"], case["mode"]))
        })
        .collect();
    assert_eq!(names.len(), 8, "{names:?}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
