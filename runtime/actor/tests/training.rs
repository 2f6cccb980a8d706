//! A PPO update end to end (log-probs → policy loss + KL → AdamW) and exact resumption from a
//! saved training state.

use tch::Tensor;
use verl_actor::losses::{
    AggScale, ClipConfig, KlPenalty, LossAggMode, PolicyBatch, PolicyLossMode, PolicyLossOptions,
    agg_loss, kl_penalty, policy_loss,
};
use verl_actor::{
    AdamW, AdamWConfig, LrDecay, LrSchedule, load_training_state, save_training_state,
};
use verl_model::testing::{MODELS, Padding, batch, load, sequence_ids};
use verl_model::{CausalLM, ModelOptions, Rng, ScoreOutputs};

struct Batch {
    ids: Tensor,
    mask: Tensor,
    response_len: i64,
    advantages: Tensor,
    old_log_prob: Tensor,
}

fn ppo_batch(model: &CausalLM) -> Batch {
    let seqs = sequence_ids("tiny-qwen2");
    let (ids, mask) = batch(&seqs, Padding::Left);
    let response_len = 5;
    let old_log_prob = tch::no_grad(|| {
        model
            .response_scores(&ids, &mask, response_len, 1.0, ScoreOutputs::NONE)
            .unwrap()
            .log_probs
    });
    let advantages = Tensor::from_slice(&[1.0f32, -0.5, 0.25, -1.0])
        .view([4, 1])
        .expand([4, response_len], false);
    Batch {
        ids,
        mask,
        response_len,
        advantages,
        old_log_prob,
    }
}

/// One actor update: vanilla PPO + low_var_kl loss against the batch's old log-probs.
fn update(model: &CausalLM, opt: &mut AdamW, schedule: &LrSchedule, b: &Batch) -> f64 {
    opt.zero_grad();
    let scores = model
        .response_scores(&b.ids, &b.mask, b.response_len, 1.0, ScoreOutputs::ENTROPY)
        .unwrap();
    let response_mask = b
        .mask
        .narrow(1, b.ids.size()[1] - b.response_len, b.response_len);
    let pg = policy_loss(
        PolicyLossMode::Vanilla,
        PolicyBatch {
            old_log_prob: &b.old_log_prob,
            log_prob: &scores.log_probs,
            advantages: &b.advantages,
            response_mask: &response_mask,
            rollout_is_weights: None,
        },
        &ClipConfig::default(),
        &PolicyLossOptions::default(),
        LossAggMode::TokenMean,
        &AggScale::default(),
    )
    .unwrap();
    let kl = kl_penalty(
        &scores.log_probs,
        &b.old_log_prob,
        "low_var_kl".parse::<KlPenalty>().unwrap(),
    );
    let kl_loss = agg_loss(
        &kl,
        &response_mask,
        LossAggMode::TokenMean,
        &AggScale::default(),
    );
    let entropy = agg_loss(
        &scores.entropy.unwrap(),
        &response_mask,
        LossAggMode::TokenMean,
        &AggScale::default(),
    );
    let loss = pg.pg_loss + kl_loss * 0.001 - entropy * 0.001;
    loss.backward();
    let grad_norm = opt.clip_grad_norm(1.0);
    assert!(
        opt.step(schedule.lr_at(opt.steps())),
        "a finite update is applied"
    );
    grad_norm
}

fn weights(model: &CausalLM) -> Vec<(String, Tensor)> {
    model
        .named_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.detach().copy()))
        .collect()
}

#[test]
fn resumed_update_is_bit_identical() {
    let schedule = LrSchedule {
        base_lr: 1e-2,
        warmup_steps: 1,
        total_steps: 10,
        decay: LrDecay::Cosine {
            min_lr_ratio: 0.1,
            num_cycles: 0.5,
        },
    };
    let config = AdamWConfig {
        weight_decay: 0.01,
        ..Default::default()
    };
    let model = load("tiny-qwen2");
    let b = ppo_batch(&model);
    let mut opt = AdamW::for_model(&model, config);
    let before = weights(&model);
    for _ in 0..3 {
        let norm = update(&model, &mut opt, &schedule, &b);
        assert!(norm.is_finite() && norm > 0.0);
    }
    assert!(
        !before[0].1.equal(&weights(&model)[0].1),
        "the updates moved the weights"
    );
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(42);
    rng.next_u64();
    save_training_state(dir.path(), &model, &opt, &schedule, &rng).unwrap();
    update(&model, &mut opt, &schedule, &b);
    let uninterrupted = weights(&model);

    // A fresh process: other weights, fresh optimizer, then restore.
    let resumed = CausalLM::random(
        model.config().clone(),
        &ModelOptions {
            seed: 5,
            ..Default::default()
        },
    )
    .unwrap();
    let mut resumed_opt = AdamW::for_model(&resumed, AdamWConfig::default());
    let state = load_training_state(dir.path(), &resumed, &mut resumed_opt).unwrap();
    assert_eq!(
        (state.step, state.schedule, state.optimizer, state.rng),
        (3, schedule, config, rng)
    );
    update(&resumed, &mut resumed_opt, &schedule, &b);
    for ((name, a), (_, b)) in uninterrupted.iter().zip(weights(&resumed)) {
        assert!(a.equal(&b), "{name} differs after resuming");
    }
    assert_eq!(
        opt.state_tensors()
            .iter()
            .map(|(n, t)| (n.clone(), t.kind()))
            .collect::<Vec<_>>(),
        resumed_opt
            .state_tensors()
            .iter()
            .map(|(n, t)| (n.clone(), t.kind()))
            .collect::<Vec<_>>()
    );
    for ((name, a), (_, b)) in opt.state_tensors().iter().zip(resumed_opt.state_tensors()) {
        assert!(a.equal(&b), "{name} differs after resuming");
    }

    // A checkpoint missing its optimizer moments names the file and the tensor.
    let moments: Vec<(String, Tensor)> = opt.state_tensors().into_iter().skip(1).collect();
    verl_model::write_safetensors(&dir.path().join("optimizer.safetensors"), &moments).unwrap();
    let err = load_training_state(dir.path(), &resumed, &mut resumed_opt)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("optimizer.safetensors") && err.contains("exp_avg."),
        "{err}"
    );
}

#[test]
fn checkpointed_backward_matches_plain_backward() {
    for name in MODELS {
        let model = load(name);
        let seqs = sequence_ids(name);
        let (ids, mask) = batch(&seqs, Padding::Left);
        let weights = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 3.0]).view([4, 1]);
        let loss_of = |scores: verl_model::ResponseScores| {
            (scores.log_probs * &weights).sum(tch::Kind::Float)
                + scores.entropy.unwrap().mean(tch::Kind::Float)
        };
        let grads = |model: &CausalLM| -> Vec<(String, Tensor)> {
            let out = model
                .named_tensors()
                .into_iter()
                .map(|(n, t)| (n, t.grad().copy()))
                .collect();
            AdamW::for_model(model, AdamWConfig::default()).zero_grad();
            out
        };

        let plain_loss = loss_of(
            model
                .response_scores(&ids, &mask, 5, 0.8, ScoreOutputs::ENTROPY)
                .unwrap(),
        );
        plain_loss.backward();
        let plain = grads(&model);
        let loss = model
            .backward_checkpointed(&ids, &mask, |hidden| {
                Ok(loss_of(model.response_scores_from_hidden(
                    hidden,
                    &ids,
                    &mask,
                    5,
                    0.8,
                    ScoreOutputs::ENTROPY,
                )?))
            })
            .unwrap();
        let checkpointed = grads(&model);
        assert!(loss.equal(&plain_loss.detach()), "{name}: same loss");
        let mut worst = 0.0f64;
        for ((param, a), (_, b)) in plain.iter().zip(&checkpointed) {
            let scale = f64::try_from(a.abs().max()).unwrap();
            assert!(scale > 0.0, "{name}: {param} has no gradient");
            let diff = f64::try_from((a - b).abs().max()).unwrap() / scale;
            assert!(
                diff < 1e-5,
                "{name}: {param} relative gradient difference {diff}"
            );
            worst = worst.max(diff);
        }
        println!("{name}: checkpointed vs plain gradients, max relative |Δ| {worst:.1e}");
    }
}

/// Running the model one block at a time (what a sharded engine does between gathers) gives
/// exactly the final hidden states of the whole forward pass.
#[test]
fn blocks_in_order_are_the_forward_pass() {
    for name in MODELS {
        let model = load(name);
        let seqs = sequence_ids(name);
        let (ids, mask) = batch(&seqs, Padding::Left);
        let whole = model.hidden_states(&ids, &mask).unwrap();
        let context = model.block_context(&ids, &mask).unwrap();
        let mut x = model.embed_block(&context);
        let layers = model.config().num_hidden_layers as usize;
        for layer in 0..layers {
            x = model.layer_block(layer, &x, &context).unwrap();
        }
        assert!(model.norm_block(&x).equal(&whole), "{name}");
        let err = model.layer_block(layers, &x, &context).unwrap_err();
        assert!(
            err.to_string().contains(&format!(
                "the model has {layers} layers, not {}",
                layers + 1
            )),
            "{err}"
        );
    }
}

/// The identity hooks: a tensor-parallel group of one.
struct Alone;

impl verl_model::TensorParallel for Alone {
    fn enter(&self, x: &Tensor) -> verl_model::Result<Tensor> {
        Ok(x.shallow_clone())
    }
    fn exit(&self, y: &Tensor) -> verl_model::Result<Tensor> {
        Ok(y.shallow_clone())
    }
}

/// The two tensor-parallel halves of a layer with identity hooks are the layer, exactly; a
/// vocabulary shard's context checks ids against the whole vocabulary.
#[test]
fn tensor_parallel_halves_are_the_layer() {
    for name in MODELS {
        let model = load(name);
        let seqs = sequence_ids(name);
        let (ids, mask) = batch(&seqs, Padding::Left);
        let vocab = model.config().vocab_size;
        let context = model.block_context_for_vocab(&ids, &mask, vocab).unwrap();
        let x = model.embed_block(&context);
        for layer in 0..model.config().num_hidden_layers as usize {
            let whole = model.layer_block(layer, &x, &context).unwrap();
            let half = model.attention_block(layer, &x, &context, &Alone).unwrap();
            let halves = model.mlp_block(layer, &half, &Alone).unwrap();
            assert!(halves.equal(&whole), "{name} layer {layer}");
        }
        // Every token named: the same context.
        let every = Tensor::arange(ids.size()[1], (tch::Kind::Int64, tch::Device::Cpu));
        let named = model
            .block_context_for_tokens(&ids, &mask, vocab, &every)
            .unwrap();
        assert!(named.input_ids().equal(&ids), "{name}");
        let a = model.attention_block(0, &x, &context, &Alone).unwrap();
        let b = model.attention_block(0, &x, &named, &Alone).unwrap();
        assert!(a.equal(&b), "{name}: a context of every token");
        let top = ids.max().int64_value(&[]);
        let err = model
            .block_context_for_vocab(&ids, &mask, top)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains(&format!("ids must lie in [0, {top})")),
            "{err}"
        );
        let beyond = ids.ones_like() * (vocab + 1);
        assert!(
            model
                .block_context_for_vocab(&beyond, &mask, vocab * 2)
                .is_ok()
        );
    }
}

#[test]
fn models_move_between_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<CausalLM>();
    assert_send::<AdamW>();
}
