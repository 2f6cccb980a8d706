//! The `fsdp` engine loaded from its built library and driven through the stable ABI.

mod common;

use common::*;
use serde_json::json;
use verl_actor::testing::{
    GROUPING_FREE_METRICS, log_probs, max_abs_diff, merge, metric, metrics_diff, seqlens, set_meta,
    update, values, weights, weights_diff, with_ppo_fields,
};
use verl_model::testing::{expected, fixture};
use verl_model::{CausalLM, ModelOptions, ScoreOutputs};
use verl_plugin_api::{ErrorKind, NamedTensor, Tensor, keys};

fn rstr(path: &std::path::Path) -> &str {
    path.to_str().unwrap()
}

/// The engine's log-probs and entropy of the fixture sequences (left-padded prompts of different
/// lengths, right-padded responses) equal transformers' (unpadded, fp32) within 1e-5, at
/// temperature 1 and at the fixture's temperature, and verl-model's direct result exactly.
#[test]
fn compute_log_prob_matches_transformers_and_verl_model() {
    for model in ["tiny-llama", "tiny-qwen2"] {
        let want = expected(model);
        let (mut batch, lens) = fixture_batch(model);
        let mut engine = engine(&json!({"role": "ref", "model": {"path": fixture(model)}}));
        for temperature in [1.0, want.temperature] {
            set_meta(&mut batch, json!({"temperature": temperature}));
            let out = engine.compute_log_prob(&batch).unwrap();
            let (lp, ent) = (rows(&out, keys::LOG_PROBS), rows(&out, keys::ENTROPYS));
            for (i, seq) in want.sequences.iter().enumerate() {
                let n = seq.logprobs.len();
                let reference = if temperature == 1.0 {
                    &seq.logprobs
                } else {
                    &seq.logprobs_temperature
                };
                let reference: Vec<f32> =
                    reference[n - lens[i]..].iter().map(|&x| x as f32).collect();
                assert!(
                    max_abs_diff(&lp[i][..lens[i]], &reference) < 1e-5,
                    "{model} T={temperature} row {i}"
                );
                assert!(
                    lp[i][lens[i]..].iter().all(|&x| x == 0.0),
                    "padding is zero"
                );
                if temperature == 1.0 {
                    let reference: Vec<f32> = seq.entropy[n - lens[i]..]
                        .iter()
                        .map(|&x| x as f32)
                        .collect();
                    assert!(
                        max_abs_diff(&ent[i][..lens[i]], &reference) < 1e-5,
                        "{model} entropy row {i}"
                    );
                }
            }
            // verl-model called directly on the same tensors, as the engine calls it
            // (padded, the last layer at the predictors only), gives the same bits.
            let direct =
                CausalLM::from_pretrained(&fixture(model), &ModelOptions::default()).unwrap();
            let t = |key: &str| {
                verl_model::interop::to_tch(key, batch.require(key).unwrap(), tch::Device::Cpu)
                    .unwrap()
            };
            let r = batch.require(keys::RESPONSES).unwrap().shape[1];
            let scores = tch::no_grad(|| {
                let mut context = direct
                    .block_context(&t(keys::INPUT_IDS), &t(keys::ATTENTION_MASK))
                    .unwrap();
                assert!(context.score_predictors_only(&direct, r).unwrap());
                let hidden = direct.hidden_states_in(&context);
                direct
                    .response_scores_in(&hidden, &context, r, temperature, ScoreOutputs::ENTROPY)
                    .unwrap()
            });
            let direct_lp = verl_model::interop::from_tch("lp", &scores.log_probs).unwrap();
            assert_eq!(&direct_lp, out.require(keys::LOG_PROBS).unwrap(), "{model}");
        }
    }
}

/// verl's `calculate_sum_pi_squared`: the engine returns `sum_pi_squared` only when the meta asks,
/// equal (relative 1e-5) to verl's `calculate_sum_pi_squared_from_logits` on transformers' logits
/// (`fixtures/sum_pi_squared.json`) on the left/right-padded fixture batch, zero on padding.
#[test]
fn compute_log_prob_returns_sum_pi_squared_when_asked() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("sum_pi_squared.json")).unwrap())
            .unwrap();
    for model in ["tiny-llama", "tiny-qwen2"] {
        let (mut batch, lens) = fixture_batch(model);
        let mut engine = engine(&json!({"role": "ref", "model": {"path": fixture(model)}}));
        set_meta(&mut batch, json!({"temperature": 0.3}));
        let out = engine.compute_log_prob(&batch).unwrap();
        assert!(out.get(keys::SUM_PI_SQUARED).is_none(), "not asked for");
        set_meta(
            &mut batch,
            json!({"temperature": 0.3, "calculate_sum_pi_squared": true, "calculate_entropy": false}),
        );
        let out = engine.compute_log_prob(&batch).unwrap();
        assert!(out.get(keys::ENTROPYS).is_none());
        let spp = rows(&out, keys::SUM_PI_SQUARED);
        let cases: Vec<&serde_json::Value> = reference["models"][model]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["temperature"] == 0.3)
            .collect();
        assert_eq!(cases.len(), lens.len());
        for (i, case) in cases.iter().enumerate() {
            let want: Vec<f64> = serde_json::from_value(case["sum_pi_squared"].clone()).unwrap();
            let want = &want[want.len() - lens[i]..];
            for (a, e) in spp[i][..lens[i]].iter().zip(want) {
                assert!(
                    (f64::from(*a) - e).abs() / e < 1e-5,
                    "{model} row {i}: {a} vs {e}"
                );
            }
            assert!(
                spp[i][lens[i]..].iter().all(|&x| x == 0.0),
                "padding is zero"
            );
        }
    }
}

const ACTOR_METRICS: [&str; 11] = [
    "actor/pg_loss",
    "actor/loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
    "actor/entropy",
    "actor/kl_loss",
    "actor/kl_coef",
    "actor/grad_norm",
    "actor/lr",
    "actor/skipped_updates",
];

#[test]
fn update_actor_moves_weights_and_reports_verl_metrics() {
    for model in ["tiny-llama", "tiny-qwen2"] {
        let config = actor_config(
            model,
            json!({"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": 2,
                   "use_kl_loss": true, "entropy_coeff": 0.01}),
        );
        let mut engine = engine(&config);
        let batch = ppo_batch(&mut engine, model);
        let before = weights(&mut engine);
        let metrics = update(&mut engine, &batch);
        let mut names: Vec<&str> = metrics.iter().map(|m| m.key.as_str()).collect();
        names.sort();
        let mut want = ACTOR_METRICS.to_vec();
        want.sort();
        assert_eq!(names, want);
        assert!(metrics.iter().all(|m| m.value.is_finite()), "{metrics:?}");
        assert_eq!(metric(&metrics, "actor/lr"), 1e-3);
        assert_eq!(metric(&metrics, "actor/skipped_updates"), 0.0);
        assert!(metric(&metrics, "actor/grad_norm") > 0.0);
        // Epoch 2 sees a moved policy: the ratio is no longer 1 everywhere.
        assert!(metric(&metrics, "actor/ppo_kl") != 0.0);
        assert!(
            weights_diff(&before, &weights(&mut engine)) > 1e-5,
            "{model}: weights did not move"
        );
    }
}

/// An update with a non-finite gradient (an entropy bonus of 1e300 is infinite in the f32 loss),
/// or one whose result would overflow the weights (lr 1e39 is a finite f64 beyond f32's range),
/// is not applied, and every one left out is counted.
#[test]
fn non_finite_updates_are_left_out_and_counted() {
    for (extra, finite_norm) in [
        (json!({"entropy_coeff": 1e300}), false),
        (json!({"optim": {"lr": 1e39}}), true),
    ] {
        let mut config = actor_config("tiny-llama", json!({"ppo_mini_batch_size": 2}));
        merge(&mut config, extra.clone());
        let mut engine = engine(&config);
        let batch = ppo_batch(&mut engine, "tiny-llama");
        let rows = batch.require(keys::RESPONSES).unwrap().shape[0] as f64;
        let before = weights(&mut engine);
        let metrics = update(&mut engine, &batch);
        assert_eq!(
            metric(&metrics, "actor/skipped_updates"),
            (rows / 2.0).ceil(),
            "{extra}: every mini-batch's update is left out"
        );
        assert_eq!(
            metric(&metrics, "actor/grad_norm").is_finite(),
            finite_norm,
            "{extra}"
        );
        assert_eq!(weights_diff(&before, &weights(&mut engine)), 0.0, "{extra}");
    }
}

/// verl's global-batch loss normalisation: accumulating micro-batches of 1 gives the gradient of
/// the whole mini-batch, for token-mean and seq-mean modes, with or without activation
/// checkpointing. The gradient norm and loss catch any scaling error (Adam's step is nearly
/// scale-invariant); the weights agree up to float summation order amplified by Adam's
/// normalisation of near-zero gradients.
#[test]
fn micro_batching_and_checkpointing_do_not_change_the_update() {
    for mode in ["token-mean", "seq-mean-token-mean"] {
        let run = |extra: serde_json::Value| {
            let mut config = actor_config(
                "tiny-qwen2",
                json!({"loss_agg_mode": mode, "use_kl_loss": true}),
            );
            merge(&mut config, extra);
            let mut engine = engine(&config);
            let batch = ppo_batch(&mut engine, "tiny-qwen2");
            let metrics = update(&mut engine, &batch);
            (
                weights(&mut engine),
                metric(&metrics, "actor/pg_loss"),
                metric(&metrics, "actor/grad_norm"),
            )
        };
        let (whole, loss, norm) = run(json!({}));
        let (micro, micro_loss, micro_norm) = run(json!({"ppo_micro_batch_size_per_gpu": 1}));
        let (ckpt, ckpt_loss, _) = run(
            json!({"ppo_micro_batch_size_per_gpu": 2, "model": {"enable_gradient_checkpointing": true}}),
        );
        assert!(
            weights_diff(&whole, &micro) < adamw_rounding_tolerance(1e-3),
            "{mode}: {}",
            weights_diff(&whole, &micro)
        );
        assert!(
            weights_diff(&whole, &ckpt) < adamw_rounding_tolerance(1e-3),
            "{mode}: {}",
            weights_diff(&whole, &ckpt)
        );
        assert!(
            (loss - micro_loss).abs() < 1e-6 && (loss - ckpt_loss).abs() < 1e-6,
            "{loss} {micro_loss} {ckpt_loss}"
        );
        assert!(
            (norm - micro_norm).abs() < 1e-5 * norm.max(1.0),
            "{norm} {micro_norm}"
        );
    }
}

/// update → save → (new engine) load → update equals update → update bit for bit, with shuffled
/// mini-batches (the shuffling RNG is part of the checkpoint) and a warm-up schedule.
#[test]
fn save_load_resume_is_bit_identical() {
    let config = actor_config(
        "tiny-llama",
        json!({"ppo_mini_batch_size": 2, "shuffle": true,
               "optim": {"lr_warmup_steps": 3, "lr_scheduler_type": "cosine", "total_training_steps": 10}}),
    );
    let dir = tempfile::tempdir().unwrap();
    let mut straight = engine(&config);
    let batch = ppo_batch(&mut straight, "tiny-llama");
    update(&mut straight, &batch);
    let want_metrics = update(&mut straight, &batch);

    let mut first = engine(&config);
    update(&mut first, &batch);
    first.save_checkpoint(rstr(dir.path()), 1).unwrap();
    let mut resumed = engine(&config);
    assert_eq!(resumed.load_checkpoint(rstr(dir.path())).unwrap(), 1);
    let metrics = update(&mut resumed, &batch);
    assert_eq!(
        weights(&mut resumed),
        weights(&mut straight),
        "weights differ after resuming"
    );
    assert_eq!(metrics, want_metrics);
    assert!(
        metric(&metrics, "actor/lr") > 0.0 && metric(&metrics, "actor/lr") < 1e-3,
        "second step is in warm-up"
    );

    // A critic cannot load an actor's checkpoint; a reference engine has no training state.
    let mut critic = engine(&json!({"role": "critic", "model": {"path": fixture("tiny-llama")}}));
    let err = critic.load_checkpoint(rstr(dir.path())).unwrap_err();
    assert!(
        err.message().contains("actor") && err.message().contains("engine_state.json"),
        "{err}"
    );
    let mut reference = engine(&json!({"role": "ref", "model": {"path": fixture("tiny-llama")}}));
    assert_eq!(
        reference
            .save_checkpoint(rstr(dir.path()), 1)
            .unwrap_err()
            .kind,
        ErrorKind::UNSUPPORTED
    );
}

/// The exported Hugging Face directory loads back (through verl-model and through a new engine)
/// to the trained weights and identical log-probs; it carries the tokenizer.
#[test]
fn export_hf_round_trips() {
    for model in ["tiny-llama", "tiny-qwen2"] {
        let mut engine = engine(&actor_config(model, json!({})));
        let batch = ppo_batch(&mut engine, model);
        update(&mut engine, &batch);
        let dir = tempfile::tempdir().unwrap();
        engine.export_hf(rstr(dir.path())).unwrap();
        assert!(
            dir.path().join("tokenizer.json").is_file()
                && dir.path().join("generation_config.json").is_file()
        );

        let reloaded = CausalLM::from_pretrained(dir.path(), &ModelOptions::default()).unwrap();
        let exported = weights(&mut engine);
        let reloaded_weights: Vec<NamedTensor> = reloaded
            .named_tensors()
            .iter()
            .map(|(name, t)| {
                NamedTensor::new(
                    name.clone(),
                    verl_model::interop::from_tch(name, t).unwrap(),
                )
            })
            .collect();
        assert_eq!(exported, reloaded_weights, "{model}");

        let mut again = common::engine(&json!({"role": "ref", "model": {"path": dir.path()}}));
        assert_eq!(
            log_probs(&mut again, &batch),
            log_probs(&mut engine, &batch),
            "{model}"
        );
    }
}

/// The SFT recipe documented in the crate: old log-probs = current, advantages = 1, no KL or
/// entropy. Each step's pg_loss is exactly -1 (ratio 1) and the NLL of the batch falls.
#[test]
fn sft_through_update_actor_lowers_nll() {
    let mut engine = engine(&actor_config("tiny-llama", json!({"optim": {"lr": 1e-2}})));
    let (mut batch, _) = fixture_batch("tiny-llama");
    let mask = batch
        .require(keys::RESPONSE_MASK)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let tokens: f32 = mask.iter().sum();
    batch.insert(
        keys::ADVANTAGES,
        batch.require(keys::RESPONSE_MASK).unwrap().clone(),
    );
    let mut nll = Vec::new();
    for _ in 0..5 {
        let lp = log_probs(&mut engine, &batch);
        nll.push(
            -lp.to_vec::<f32>()
                .unwrap()
                .iter()
                .zip(&mask)
                .map(|(l, m)| l * m)
                .sum::<f32>()
                / tokens,
        );
        batch.insert(keys::OLD_LOG_PROBS, lp);
        let metrics = update(&mut engine, &batch);
        assert!(
            (metric(&metrics, "actor/pg_loss") + 1.0).abs() < 1e-6,
            "{metrics:?}"
        );
        assert_eq!(metric(&metrics, "actor/pg_clipfrac"), 0.0);
    }
    assert!(
        nll.windows(2).all(|w| w[1] < w[0]),
        "NLL must fall: {nll:?}"
    );
}

/// A critic batch's `values` and returns one above them on every token.
fn insert_values_and_returns(batch: &mut verl_plugin_api::Batch, values: Tensor) {
    let returns: Vec<f32> = values
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v + 1.0)
        .collect();
    batch.insert(
        keys::RETURNS,
        Tensor::from_slice(&values.shape, &returns).unwrap(),
    );
    batch.insert(keys::VALUES, values);
}

#[test]
fn critic_computes_and_updates_values() {
    let mut critic = engine(&json!({
        "role": "critic", "model": {"path": fixture("tiny-qwen2")},
        "optim": {"lr": 1e-2}, "ppo_mini_batch_size": 4, "cliprange_value": 0.2,
    }));
    let (mut batch, lens) = fixture_batch("tiny-qwen2");
    let values = critic
        .compute_values(&batch)
        .unwrap()
        .require(keys::VALUES)
        .unwrap()
        .clone();
    assert_eq!(values.shape, batch.require(keys::RESPONSES).unwrap().shape);
    let value_rows = rows(
        &{
            let mut b = verl_plugin_api::Batch::default();
            b.insert(keys::VALUES, values.clone());
            b
        },
        keys::VALUES,
    );
    assert!(
        value_rows
            .iter()
            .zip(&lens)
            .all(|(row, &n)| row[n..].iter().all(|&v| v == 0.0)),
        "padding is zero"
    );
    insert_values_and_returns(&mut batch, values.clone());
    let metrics: Vec<_> = critic.update_critic(&batch).unwrap().into_iter().collect();
    let mut names: Vec<&str> = metrics.iter().map(|m| m.key.as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "critic/grad_norm",
            "critic/lr",
            "critic/skipped_updates",
            "critic/vf_clipfrac",
            "critic/vf_loss",
            "critic/vpred_mean"
        ]
    );
    let vf_loss = metric(&metrics, "critic/vf_loss");
    assert!(
        (vf_loss - 0.5).abs() < 1e-5,
        "the loss before the step is ½·1² on every token, got {vf_loss}"
    );
    let after = critic
        .compute_values(&batch)
        .unwrap()
        .require(keys::VALUES)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert!(
        max_abs_diff(&after, &values.to_vec::<f32>().unwrap()) > 1e-4,
        "values must move toward the returns"
    );
    // A critic has no LM head.
    assert_eq!(
        critic.compute_log_prob(&batch).unwrap_err().kind,
        ErrorKind::UNSUPPORTED
    );
}

#[test]
fn other_policy_losses_and_aggregations_run() {
    for extra in [
        json!({"policy_loss": {"loss_mode": "gspo"}}),
        json!({"loss_agg_mode": "seq-mean-token-sum", "clip_ratio_high": 0.28}),
        json!({"loss_agg_mode": "seq-mean-token-sum-norm", "use_kl_loss": true, "kl_loss_type": "k1"}),
        json!({"loss_agg_mode": "token-sum", "use_kl_loss": true, "kl_loss_type": "k2+"}),
        json!({"policy_loss": {"loss_mode": "dppo_tv"}}),
        json!({"policy_loss": {"loss_mode": "dppo_kl"}, "clip_ratio_c": 20.0}),
        json!({"policy_loss": {"loss_mode": "sapo"}, "tau_pos": 1.0, "tau_neg": 1.05}),
        json!({"policy_loss": {"loss_mode": "gpg"}}),
        json!({"policy_loss": {"loss_mode": "clip_cov", "clip_cov_ratio": 0.5, "clip_cov_lb": -1.0}}),
        json!({"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 0.2}}),
        json!({"policy_loss": {"loss_mode": "geo_mean"}}),
        json!({"policy_loss": {"loss_mode": "dro", "dro_beta": 0.1}}),
        json!({"policy_loss": {"loss_mode": "cispo"}, "clip_ratio_high": 0.28}),
    ] {
        let mut engine = engine(&actor_config("tiny-llama", extra.clone()));
        let batch = ppo_batch(&mut engine, "tiny-llama");
        let metrics = update(&mut engine, &batch);
        assert!(
            metrics.iter().all(|m| m.value.is_finite()),
            "{extra}: {metrics:?}"
        );
        // Each loss reports the metrics verl's does: GPG none of the clip fractions.
        let reports_clipfrac = metrics
            .iter()
            .any(|m| m.key.as_str() == "actor/pg_clipfrac");
        assert_eq!(
            reports_clipfrac,
            !["gpg", "kl_cov", "dro"]
                .contains(&extra["policy_loss"]["loss_mode"].as_str().unwrap_or("")),
            "{extra}: {metrics:?}"
        );
    }
}

/// verl's on-policy shortcut (`dp_actor.update_policy`): with one epoch and one mini-batch the old
/// log-probs are the update's own forward, detached, so the ratio is exactly 1 and the batch's
/// `old_log_probs` are not read: an update without them, or with wrong ones, equals the update
/// with the engine's own recomputed ones.
#[test]
fn on_policy_updates_take_the_old_log_probs_from_their_own_forward() {
    let config = actor_config("tiny-llama", json!({}));
    let mut engine = common::engine(&config);
    let with_old = ppo_batch(&mut engine, "tiny-llama");
    let mut wrong = with_old.clone();
    let shape = with_old
        .require(keys::OLD_LOG_PROBS)
        .unwrap()
        .shape
        .to_vec();
    let n = (shape[0] * shape[1]) as usize;
    wrong.insert(
        keys::OLD_LOG_PROBS,
        Tensor::from_slice(&shape, &vec![-50.0f32; n]).unwrap(),
    );
    let mut without = with_old.clone();
    without.tensors.retain(|t| t.name != keys::OLD_LOG_PROBS);
    let mut results = Vec::new();
    for batch in [&with_old, &wrong, &without] {
        let mut engine = common::engine(&config);
        let metrics = update(&mut engine, batch);
        assert_eq!(metric(&metrics, "actor/ppo_kl"), 0.0, "{metrics:?}");
        assert_eq!(metric(&metrics, "actor/pg_clipfrac"), 0.0, "{metrics:?}");
        results.push((weights(&mut engine), metric(&metrics, "actor/pg_loss")));
    }
    let moved = weights_diff(&results[0].0, &weights(&mut engine));
    assert!(moved > 1e-4, "the update must move the weights ({moved})");
    for (w, loss) in &results[1..] {
        assert_eq!(weights_diff(w, &results[0].0), 0.0);
        assert_eq!(*loss, results[0].1);
    }

    // Asked for `actor/entropy` (the trainer skipped its old-log-prob pass), the update reports
    // its own forward's, which is what `compute_log_prob` measures, and trains the same.
    let mut asked = without.clone();
    let mut meta: serde_json::Value =
        serde_json::from_str(asked.meta_json.as_str()).unwrap_or_else(|_| json!({}));
    meta["calculate_entropy"] = json!(true);
    set_meta(&mut asked, meta);
    let entropys = common::engine(&config).compute_log_prob(&asked).unwrap();
    let mask = rows(&asked, keys::RESPONSE_MASK);
    let (sum, tokens) = rows(&entropys, keys::ENTROPYS)
        .iter()
        .zip(&mask)
        .flat_map(|(e, m)| e.iter().zip(m))
        .fold((0.0f64, 0.0f64), |(s, n), (&e, &m)| {
            (s + f64::from(e * m), n + f64::from(m))
        });
    let mut engine = common::engine(&config);
    let metrics = update(&mut engine, &asked);
    let reported = metric(&metrics, "actor/entropy");
    assert!(
        (reported - sum / tokens).abs() < 1e-5,
        "{reported} vs {}",
        sum / tokens
    );
    assert_eq!(weights_diff(&weights(&mut engine), &results[0].0), 0.0);
    // Not asked, an update without entropy in its loss reports none.
    let mut not_asked = without.clone();
    let mut meta: serde_json::Value =
        serde_json::from_str(not_asked.meta_json.as_str()).unwrap_or_else(|_| json!({}));
    meta["calculate_entropy"] = json!(false);
    set_meta(&mut not_asked, meta);
    assert!(
        update(&mut common::engine(&config), &not_asked)
            .iter()
            .all(|m| m.key != "actor/entropy")
    );
}

#[test]
fn errors_name_the_problem() {
    let init_err = |config: serde_json::Value| {
        let mut engine = new_engine();
        engine.init(&init_for(&config)).unwrap_err()
    };
    let base = || actor_config("tiny-llama", json!({}));

    let mut config = base();
    config["optim"]["lr"] = json!("fast");
    let err = init_err(config);
    assert_eq!(err.kind, ErrorKind::INVALID_CONFIG);
    assert!(err.message().contains("`optim.lr`"), "{err}");

    let mut config = base();
    config["loss_agg_mode"] = json!("token-max");
    assert!(init_err(config).message().contains("`loss_agg_mode`"));

    let mut config = base();
    config["ppo_micro_batch_size_per_gpu"] = json!(3);
    assert!(
        init_err(config)
            .message()
            .contains("`ppo_micro_batch_size_per_gpu`")
    );

    let mut config = base();
    config["role"] = json!("student");
    assert!(init_err(config).message().contains("`role`"));

    // Prompts are not shared in the deterministic mode: asking for it there is an error (left
    // unset, it is simply off there).
    let mut config = base();
    config["use_prefix_grouper"] = json!(true);
    config["model"]["use_remove_padding"] = json!(true);
    config["deterministic"] = json!(true);
    let err = init_err(config.clone());
    assert_eq!(err.kind, ErrorKind::INVALID_CONFIG);
    assert!(err.message().contains("`use_prefix_grouper`"), "{err}");
    config["use_prefix_grouper"] = serde_json::Value::Null;
    new_engine().init(&init_for(&config)).unwrap();

    let mut config = base();
    config["model"]["path"] = json!("/nonexistent/model");
    assert!(
        init_err(config)
            .message()
            .contains("/nonexistent/model/config.json")
    );

    // Several ranks need the rendezvous, and a mini-batch that splits over them.
    let mut init = init_for(&base());
    init.run.world_size = 2;
    init.run.rank = 1;
    let err = new_engine().init(&init).unwrap_err();
    assert!(
        err.message().contains(
            "joining the data-parallel group: rendezvous: MASTER_ADDR is not set (rank 1 of 2)"
        ),
        "{err}"
    );
    // Hybrid sharding is refused, naming the key, before any rendezvous.
    let mut config = base();
    config["fsdp_config"] = json!({"fsdp_size": 2});
    let mut init = init_for(&config);
    init.run.world_size = 4;
    let err = new_engine().init(&init).unwrap_err();
    assert_eq!(err.kind, ErrorKind::INVALID_CONFIG);
    assert!(
        err.message()
            .contains("`actor_rollout_ref.actor.fsdp_config.fsdp_size`: hybrid sharding"),
        "{err}"
    );
    let mut config = base();
    config["ppo_mini_batch_size"] = json!(3);
    let mut init = init_for(&config);
    init.run.world_size = 2;
    let err = new_engine().init(&init).unwrap_err();
    assert!(
        err.message()
            .contains("3 sequences (ppo_mini_batch_size × rollout.n) do not split evenly over 2 data-parallel ranks"),
        "{err}"
    );

    let (batch, _) = fixture_batch("tiny-llama");
    assert!(
        new_engine()
            .compute_log_prob(&batch)
            .unwrap_err()
            .message()
            .contains("init")
    );
    // Two mini-batches: the update is off-policy after the first, so it needs the old log-probs
    // (with one, verl's on-policy shortcut takes them from the update's own forward).
    let mut engine = common::engine(&actor_config(
        "tiny-llama",
        json!({"ppo_mini_batch_size": 2}),
    ));
    let err = engine.update_actor(&batch).unwrap_err();
    assert!(err.message().contains("old_log_probs"), "{err}");
    let mut reference =
        common::engine(&json!({"role": "ref", "model": {"path": fixture("tiny-llama")}}));
    assert_eq!(
        reference.update_actor(&batch).unwrap_err().kind,
        ErrorKind::UNSUPPORTED
    );
}

/// `model.dtype = bfloat16`: parameters and exported weights are bf16, log-probs stay fp32 and
/// close to the fp32 model's, and an update runs.
#[test]
fn bfloat16_parameters() {
    let (mut batch, _) = fixture_batch("tiny-qwen2");
    let fp32 = log_probs(&mut engine(&actor_config("tiny-qwen2", json!({}))), &batch)
        .to_vec::<f32>()
        .unwrap();
    let mut bf16 = engine(&actor_config(
        "tiny-qwen2",
        json!({"model": {"dtype": "bfloat16"}}),
    ));
    let lp = log_probs(&mut bf16, &batch);
    assert_eq!(lp.dtype, verl_plugin_api::DType::F32);
    let diff = max_abs_diff(&lp.to_vec::<f32>().unwrap(), &fp32);
    assert!(
        diff > 0.0 && diff < 0.1,
        "bf16 vs fp32 log-probs differ by {diff}"
    );
    assert!(
        weights(&mut bf16)
            .iter()
            .all(|w| w.tensor.dtype == verl_plugin_api::DType::BF16)
    );
    let shape = lp.shape.to_vec();
    batch.insert(
        keys::ADVANTAGES,
        Tensor::from_slice(&shape, &vec![1.0f32; lp.numel()]).unwrap(),
    );
    batch.insert(keys::OLD_LOG_PROBS, lp);
    assert!(
        update(&mut bf16, &batch)
            .iter()
            .all(|m| m.value.is_finite())
    );
}

/// How far the weights of two engines whose gradients agree to fp32 summation order may drift
/// apart in AdamW updates at learning rate `lr`. AdamW moves an element by lr · g / (|g| + ε): where
/// |g| is near ε (1e-8) a rounding difference δ in g moves it up to lr · δ / ε differently. With
/// gradients of the fixtures' scale, δ ~ 1e-10 in fp32 (the CPU's summation order decides: over 3
/// updates at lr 1e-3, 2.2e-5 measured on an AMD EPYC and 1.9e-5 on an Intel Xeon for the
/// fixture's rows, up to 5.2e-5 on the AMD for a GRPO batch). A wrong gradient instead moves
/// elements by a different sign or magnitude, O(lr); the update metrics (loss, grad-norm) are
/// checked within 1e-5 besides.
fn adamw_rounding_tolerance(lr: f64) -> f64 {
    0.1 * lr
}

/// The largest difference between two engines' log-probs and entropy of `batch`.
fn scores_diff(
    a: &mut verl_plugin_host::EngineHandle,
    b: &mut verl_plugin_host::EngineHandle,
    batch: &verl_plugin_api::Batch,
) -> f64 {
    let (a, b) = (
        a.compute_log_prob(batch).unwrap(),
        b.compute_log_prob(batch).unwrap(),
    );
    [keys::LOG_PROBS, keys::ENTROPYS]
        .into_iter()
        .map(|key| {
            let values =
                |x: &verl_plugin_api::Batch| x.require(key).unwrap().to_vec::<f32>().unwrap();
            max_abs_diff(&values(&a), &values(&b))
        })
        .fold(0.0, f64::max)
}

/// `model.use_remove_padding` (packed batches): log-probs and entropy and every update metric
/// within 1e-5 of the padded engine's, the weights after each of 3 updates within
/// [`adamw_rounding_tolerance`], on the whole model (with and without activation checkpointing,
/// micro-batches of 2 rows) and on the sharded one (offload), for both fixtures (Qwen2: q/k/v
/// biases, tied head; Llama: grouped-query attention); on the fixture's rows and on a GRPO batch
/// whose groups share their prompts (`use_prefix_grouper`, on by default when packed).
#[test]
fn packed_batches_equal_padded() {
    const TOLERANCE: f64 = 1e-5;
    let mut worst = [0.0f64; 3];
    for model in ["tiny-qwen2", "tiny-llama"] {
        for extra in [
            json!({}),
            json!({"model": {"enable_gradient_checkpointing": true}}),
            json!({"fsdp_config": {"param_offload": true}}),
        ] {
            let config = |packed: bool| {
                let mut config = actor_config(
                    model,
                    json!({
                        "use_kl_loss": true, "entropy_coeff": 0.01,
                        "ppo_micro_batch_size_per_gpu": 2,
                        "model": {"use_remove_padding": packed},
                    }),
                );
                merge(&mut config, extra.clone());
                config
            };
            for (rows, mut batch) in [
                ("fixture", fixture_batch(model).0),
                ("grouped", grouped_batch(model)),
            ] {
                let (mut padded, mut packed) = (engine(&config(false)), engine(&config(true)));
                set_meta(&mut batch, json!({"temperature": 0.7}));
                let diff = scores_diff(&mut padded, &mut packed, &batch);
                worst[0] = worst[0].max(diff);
                assert!(diff <= TOLERANCE, "{model} {extra} {rows}: scores {diff:e}");
                set_meta(&mut batch, json!({}));
                let batch = with_ppo_fields(&mut padded, batch, 0);
                for step in 0..3 {
                    let (want, got) = (update(&mut padded, &batch), update(&mut packed, &batch));
                    for m in &want {
                        let mine = metric(&got, &m.key);
                        let diff = (mine - m.value).abs() / m.value.abs().max(1.0);
                        worst[1] = worst[1].max(diff);
                        assert!(
                            diff <= TOLERANCE,
                            "{model} {extra} {rows} update {step}: {} {mine} vs {}",
                            m.key,
                            m.value
                        );
                    }
                    let diff = weights_diff(&weights(&mut packed), &weights(&mut padded));
                    worst[2] = worst[2].max(diff);
                    assert!(
                        diff <= adamw_rounding_tolerance(1e-3),
                        "{model} {extra} {rows} weights after update {step}: {diff:e}"
                    );
                }
            }
        }
    }
    eprintln!(
        "largest |packed - padded|: scores {:e}, metrics {:e} (relative), weights {:e}",
        worst[0], worst[1], worst[2]
    );
}

/// A critic on packed batches: the values and the update equal the padded critic's.
#[test]
fn packed_critic_equals_padded() {
    let critic = |packed: bool| {
        engine(&json!({
            "role": "critic", "model": {"path": fixture("tiny-llama"), "use_remove_padding": packed},
            "optim": {"lr": 1e-3}, "ppo_mini_batch_size": 4, "cliprange_value": 0.2,
        }))
    };
    let (mut padded, mut packed) = (critic(false), critic(true));
    let (mut batch, _) = fixture_batch("tiny-llama");
    let want = values(&mut padded, &batch);
    let got = values(&mut packed, &batch);
    let diff = max_abs_diff(
        &got.to_vec::<f32>().unwrap(),
        &want.to_vec::<f32>().unwrap(),
    );
    assert!(diff <= 1e-5, "values {diff:e}");
    insert_values_and_returns(&mut batch, want);
    let (a, b) = (
        padded
            .update_critic(&batch)
            .unwrap()
            .into_iter()
            .collect::<Vec<_>>(),
        packed
            .update_critic(&batch)
            .unwrap()
            .into_iter()
            .collect::<Vec<_>>(),
    );
    for m in &a {
        let diff = (metric(&b, &m.key) - m.value).abs() / m.value.abs().max(1.0);
        assert!(diff <= 1e-5, "{}: {diff:e}", m.key);
    }
    let diff = weights_diff(&weights(&mut packed), &weights(&mut padded));
    eprintln!("critic weights: largest |packed - padded| {diff:e}");
    assert!(
        diff <= adamw_rounding_tolerance(1e-3),
        "critic weights {diff:e}"
    );
}

/// verl's `use_dynamic_bsz` (micro-batches by a token budget, regrouping the rows) against fixed
/// micro-batches of rows: the log-probs and entropy in the input order, and over 3 updates of 2
/// mini-batches each every loss value, the gradient norm and the weights, within 1e-5 — on the
/// whole model, the packed one (`use_remove_padding`) and the sharded one (offload), for both
/// fixtures.
#[test]
fn token_budget_micro_batches_equal_fixed_ones() {
    const TOLERANCE: f64 = 1e-5;
    let mut worst = [0.0f64; 3];
    for model in ["tiny-qwen2", "tiny-llama"] {
        let (batch, width) = varied_batch(model);
        // The budgets really regroup the rows: several micro-batches, not in row order.
        let lens = seqlens(&batch);
        let count =
            verl_seqlen_balancing::micro_batch_count(&lens, width as u64, width as u64).unwrap();
        let parts = verl_seqlen_balancing::micro_batches(&lens, count).unwrap();
        assert!(parts.len() >= 4, "{parts:?}");
        assert_ne!(parts.concat(), (0..lens.len()).collect::<Vec<_>>());
        for extra in [
            json!({}),
            json!({"model": {"use_remove_padding": true}}),
            json!({"fsdp_config": {"param_offload": true}}),
        ] {
            let config = |batching: serde_json::Value| {
                // lr 5e-4 (the fixtures' 1e-3 halved): AdamW amplifies fp32 summation-order
                // differences in proportion to lr (see `adamw_rounding_tolerance`).
                let mut config = actor_config(
                    model,
                    json!({"use_kl_loss": true, "entropy_coeff": 0.01, "ppo_epochs": 2,
                           "optim": {"lr": 5e-4}}),
                );
                merge(&mut config, batching);
                merge(&mut config, extra.clone());
                config
            };
            let mut fixed = engine(&config(json!({
                "ppo_micro_batch_size_per_gpu": 2, "log_prob_micro_batch_size_per_gpu": 3,
            })));
            let mut dynamic = engine(&config(json!({
                "use_dynamic_bsz": true, "ppo_max_token_len_per_gpu": width,
                "log_prob_max_token_len_per_gpu": width + 9,
            })));
            let mut batch = batch.clone();
            set_meta(&mut batch, json!({"temperature": 0.7}));
            let diff = scores_diff(&mut fixed, &mut dynamic, &batch);
            worst[0] = worst[0].max(diff);
            assert!(diff <= TOLERANCE, "{model} {extra}: scores {diff:e}");
            let batch = with_ppo_fields(&mut fixed, batch, 0);
            let before = weights(&mut fixed);
            for step in 0..3 {
                let (want, got) = (update(&mut fixed, &batch), update(&mut dynamic, &batch));
                let keys_of = |m: &[verl_plugin_api::Metric]| {
                    let mut k: Vec<String> = m.iter().map(|m| m.key.to_string()).collect();
                    k.sort();
                    k
                };
                assert_eq!(keys_of(&got), keys_of(&want));
                let diff = metrics_diff(&got, &want, &GROUPING_FREE_METRICS);
                worst[1] = worst[1].max(diff);
                assert!(
                    diff <= TOLERANCE,
                    "{model} {extra} update {step}: {diff:e} in {got:?} vs {want:?}"
                );
                let diff = weights_diff(&weights(&mut dynamic), &weights(&mut fixed));
                worst[2] = worst[2].max(diff);
                assert!(
                    diff <= adamw_rounding_tolerance(5e-4),
                    "{model} {extra} weights after update {step}: {diff:e}"
                );
            }
            let moved = weights_diff(&before, &weights(&mut fixed));
            assert!(
                moved > 100.0 * TOLERANCE,
                "{model} {extra}: moved {moved:e}"
            );
        }
    }
    eprintln!(
        "largest |token budget - fixed|: scores {:e}, metrics {:e} (relative), weights {:e}",
        worst[0], worst[1], worst[2]
    );
}

/// A critic by token budgets: the values in the input order and the update equal fixed
/// micro-batches'.
#[test]
fn token_budget_critic_equals_fixed() {
    let (mut batch, width) = varied_batch("tiny-llama");
    let critic = |batching: serde_json::Value| {
        let mut config = json!({
            "role": "critic", "model": {"path": fixture("tiny-llama")},
            "optim": {"lr": 1e-3}, "ppo_mini_batch_size": 4, "cliprange_value": 0.2,
        });
        merge(&mut config, batching);
        engine(&config)
    };
    let mut fixed = critic(json!({
        "ppo_micro_batch_size_per_gpu": 1, "forward_micro_batch_size_per_gpu": 3,
    }));
    let mut dynamic = critic(json!({
        "use_dynamic_bsz": true, "ppo_max_token_len_per_gpu": width,
        "forward_max_token_len_per_gpu": width + 5,
    }));
    let want = values(&mut fixed, &batch);
    let diff = max_abs_diff(
        &values(&mut dynamic, &batch).to_vec::<f32>().unwrap(),
        &want.to_vec::<f32>().unwrap(),
    );
    assert!(diff <= 1e-5, "values {diff:e}");
    insert_values_and_returns(&mut batch, want);
    for step in 0..2 {
        let (a, b): (Vec<_>, Vec<_>) = (
            fixed.update_critic(&batch).unwrap().into_iter().collect(),
            dynamic.update_critic(&batch).unwrap().into_iter().collect(),
        );
        for key in ["critic/vf_loss", "critic/grad_norm", "critic/lr"] {
            let diff = (metric(&b, key) - metric(&a, key)).abs() / metric(&a, key).abs().max(1.0);
            assert!(diff <= 1e-5, "update {step}: {key} {diff:e}");
        }
        let diff = weights_diff(&weights(&mut dynamic), &weights(&mut fixed));
        assert!(diff <= 1e-5, "critic weights after update {step}: {diff:e}");
    }
}

/// A budget smaller than one padded row is refused as verl refuses it (an assertion there),
/// naming the key.
#[test]
fn token_budget_below_one_row_is_an_error() {
    let (mut batch, width) = varied_batch("tiny-qwen2");
    let mut budgeted = engine(&actor_config(
        "tiny-qwen2",
        json!({"use_dynamic_bsz": true, "ppo_max_token_len_per_gpu": width - 1,
               "log_prob_max_token_len_per_gpu": width - 2}),
    ));
    let err = budgeted.compute_log_prob(&batch).unwrap_err();
    assert_eq!(err.kind, ErrorKind::INVALID_CONFIG);
    assert!(
        err.message.contains("`log_prob_max_token_len_per_gpu`")
            && err.message.contains(&format!(
                "budget of {} tokens is smaller than one sequence",
                width - 2
            ))
            && err.message.contains(&format!("{width} tokens wide")),
        "{}",
        err.message
    );
    let mut reference = engine(&json!({"role": "ref", "model": {"path": fixture("tiny-qwen2")}}));
    let old = log_probs(&mut reference, &batch);
    batch.insert(keys::ADVANTAGES, old.clone());
    batch.insert(keys::OLD_LOG_PROBS, old);
    let err = budgeted.update_actor(&batch).unwrap_err();
    assert!(
        err.message.contains("`ppo_max_token_len_per_gpu`"),
        "{}",
        err.message
    );
}
