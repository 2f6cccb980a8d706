//! On-policy distillation through the `fsdp` engine's ABI: a teacher engine's top-k log-probs
//! (`compute_log_prob` with `distill_topk`), and an actor trained on the top-k KL to them.

#[allow(dead_code, reason = "the helpers of the engine tests, some used here")]
mod common;

use common::*;
use serde_json::json;
use tch::Kind;
use verl_actor::testing::{metric, set_meta, update, with_ppo_fields};
use verl_model::interop::to_tch;
use verl_model::testing::fixture;
use verl_model::{CausalLM, ModelOptions};
use verl_plugin_api::{Batch, keys};

const K: i64 = 5;

fn t(batch: &Batch, key: &str) -> tch::Tensor {
    to_tch(key, batch.require(key).unwrap(), tch::Device::Cpu).unwrap()
}

fn teacher_outputs(teacher: &mut verl_plugin_host::EngineHandle, batch: &Batch) -> Batch {
    let mut request = batch.clone();
    set_meta(&mut request, json!({"temperature": 0.7, "distill_topk": K}));
    teacher.compute_log_prob(&request).unwrap()
}

/// The teacher's top-k equal the top-k of the full log-softmax (temperature 0.7) at every scored
/// position, are zero on padding, and are the same packed and padded.
#[test]
fn teacher_top_k_are_the_full_distributions_top_k() {
    let (batch, _) = fixture_batch("tiny-llama");
    let mut teacher = engine(&json!({"role": "teacher", "model": {"path": fixture("tiny-llama")}}));
    let out = teacher_outputs(&mut teacher, &batch);
    let (ids, lp) = (t(&out, "teacher_ids"), t(&out, "teacher_logprobs"));
    let r = batch.require(keys::RESPONSES).unwrap().shape[1];
    let b = batch.require(keys::RESPONSES).unwrap().shape[0];
    assert_eq!(ids.size(), [b, r, K]);
    let model =
        CausalLM::from_pretrained(&fixture("tiny-llama"), &ModelOptions::default()).unwrap();
    let (input, mask) = (t(&batch, keys::INPUT_IDS), t(&batch, keys::ATTENTION_MASK));
    let logits = tch::no_grad(|| model.forward(&input, &mask).unwrap());
    let seq = input.size()[1];
    let full = (logits.narrow(1, seq - r - 1, r) / 0.7).log_softmax(-1, Kind::Float);
    let (want_lp, want_ids) = full.topk(K, -1, true, true);
    let response_mask = t(&batch, keys::RESPONSE_MASK).unsqueeze(-1);
    let lp_diff = ((&lp - &want_lp * &response_mask).abs())
        .max()
        .double_value(&[]);
    assert!(lp_diff < 1e-5, "{lp_diff}");
    let real = response_mask.to_kind(Kind::Int64);
    assert!(ids.equal(&(want_ids * &real)), "top-k ids differ");
    assert!(lp.eq(0.0).logical_or(&real.eq(1)).all().int64_value(&[]) == 1);
    // verl's use_remove_padding (packed stream): the same values.
    let mut packed = engine(&json!({"role": "teacher",
        "model": {"path": fixture("tiny-llama"), "use_remove_padding": true}}));
    let p = teacher_outputs(&mut packed, &batch);
    assert!(t(&p, "teacher_ids").equal(&ids));
    let d = (t(&p, "teacher_logprobs") - &lp)
        .abs()
        .max()
        .double_value(&[]);
    assert!(d < 1e-5, "{d}");
}

/// An actor initialised at random learns the teacher's distribution on the teacher's top-k: in
/// six updates the KL falls below 60% of its start, with and without the tail bucket, forward and
/// reverse (the reverse, mode-seeking, may rise at first).
#[test]
fn the_top_k_kl_to_the_teacher_falls() {
    let (batch, _) = fixture_batch("tiny-llama");
    let mut teacher = engine(&json!({"role": "teacher", "model": {"path": fixture("tiny-llama")}}));
    let mut batch_t = batch.clone();
    for (name, tensor) in teacher_outputs(&mut teacher, &batch)
        .tensors
        .into_iter()
        .map(|n| (n.name, n.tensor))
    {
        batch_t.insert(name.as_str(), tensor);
    }
    for mode in [
        "forward_kl_topk",
        "forward_kl_topk_tail",
        "reverse_kl_topk",
        "reverse_kl_topk_tail",
    ] {
        let config = actor_config(
            "tiny-llama",
            json!({"model": {"random_init": true}, "optim": {"lr": 1e-2},
                   "distillation_loss": {"loss_mode": mode, "topk": K, "use_task_rewards": false,
                                         "use_policy_gradient": false}}),
        );
        let mut actor = engine(&config);
        let mut batch = with_ppo_fields(&mut actor, batch_t.clone(), 0);
        set_meta(&mut batch, json!({"temperature": 0.7}));
        let mut kl = Vec::new();
        for _ in 0..6 {
            let metrics = update(&mut actor, &batch);
            assert!(
                metrics.iter().all(|m| m.key != "actor/pg_loss"),
                "{metrics:?}"
            );
            kl.push(metric(&metrics, "distillation/token_loss"));
        }
        assert!(
            kl[0] > 0.0 && kl[5] < 0.6 * kl[0],
            "{mode}: the KL must fall: {kl:?}"
        );
    }
}

/// With the task's reward kept (`use_task_rewards`), the policy loss is there too; with the
/// policy-gradient form the distillation loss is a PPO loss on the negated KL; a sampled-token
/// estimator (k3) takes the teacher's log-probs of the sampled tokens.
#[test]
fn combined_policy_gradient_and_estimator_modes_run() {
    let (batch, _) = fixture_batch("tiny-llama");
    let mut teacher = engine(&json!({"role": "teacher", "model": {"path": fixture("tiny-llama")}}));
    let out = teacher_outputs(&mut teacher, &batch);
    for (loss, tensors) in [
        (
            json!({"loss_mode": "forward_kl_topk", "topk": K}),
            vec!["teacher_ids", "teacher_logprobs"],
        ),
        (
            json!({"loss_mode": "k3", "use_policy_gradient": false}),
            vec![],
        ),
        (json!({"loss_mode": "k1"}), vec![]),
    ] {
        let config = actor_config("tiny-llama", json!({"distillation_loss": loss.clone()}));
        let mut actor = engine(&config);
        let mut b = with_ppo_fields(&mut actor, batch.clone(), 0);
        for name in &tensors {
            b.insert(*name, out.require(name).unwrap().clone());
        }
        if tensors.is_empty() {
            // Estimators: the teacher's log-probs of the sampled tokens.
            let lp = teacher.compute_log_prob(&batch).unwrap();
            b.insert(
                "teacher_logprobs",
                lp.require(keys::LOG_PROBS).unwrap().clone(),
            );
        }
        let metrics = update(&mut actor, &b);
        assert!(
            metric(&metrics, "actor/pg_loss").is_finite(),
            "{loss}: {metrics:?}"
        );
        assert!(
            metric(&metrics, "distillation/loss").is_finite(),
            "{loss}: {metrics:?}"
        );
    }
}

#[test]
fn bad_distillation_settings_name_the_key() {
    for (loss, key) in [
        (
            json!({"loss_mode": "forward_kl"}),
            "distillation.distillation_loss.loss_mode",
        ),
        (
            json!({"loss_mode": "forward_kl_topk", "topk": 0}),
            "distillation.distillation_loss.topk",
        ),
        (
            json!({"loss_mode": "k1", "use_policy_gradient": false}),
            "distillation.distillation_loss.loss_mode",
        ),
        (
            json!({"policy_loss_mode": "gspo"}),
            "distillation.distillation_loss.policy_loss_mode",
        ),
        (json!({"unknown": 1}), "unknown"),
    ] {
        let mut engine = new_engine();
        let err = engine
            .init(&init_for(&actor_config(
                "tiny-llama",
                json!({"distillation_loss": loss.clone()}),
            )))
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{loss}: {err}");
    }
    // The actor refuses a batch without the teacher's tensors, naming the missing one.
    let mut actor = engine(&actor_config(
        "tiny-llama",
        json!({"distillation_loss": {"loss_mode": "forward_kl_topk", "topk": K}}),
    ));
    let b = ppo_batch(&mut actor, "tiny-llama");
    let err = actor.update_actor(&b).unwrap_err().to_string();
    assert!(err.contains("teacher_ids"), "{err}");
}
