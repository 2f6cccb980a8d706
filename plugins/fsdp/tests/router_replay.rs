//! Router replay (verl's `router_replay.mode`) through the `fsdp` engine's ABI, on the tiny
//! Qwen3-MoE fixture with a near-tied router: the rollout (verl-model's KV-cache decoder,
//! which the `native` rollout runs) records each token's experts; with R3 the engine's training
//! forward uses exactly those experts and reproduces the rollout's log-probs up to fp32 rounding,
//! without replay a flipped expert moves them by far more; R2 replays what `compute_log_prob`
//! recorded.

// Shared with `engine.rs`, which uses the rest of it.
#[allow(dead_code)]
mod common;

use common::*;
use serde_json::json;
use tch::Tensor as TchTensor;
use verl_actor::testing::{max_abs_diff, metric, set_meta, update, weights};
use verl_model::testing::fixture;
use verl_model::{CausalLM, Completion, ModelOptions, SamplingParams, write_safetensors};
use verl_plugin_api::{Batch, Tensor, keys};

/// fp32 rounding between the rollout's decode kernels and the training forward's: both compute
/// the same function over different shapes (`[rows, 1]` queries over a KV cache vs the whole
/// sequence), which libtorch's CPU kernels round differently.
const FP32_ROUNDING: f64 = 1e-5;

/// The tiny Qwen3-MoE with experts 1 and 2 of layer 0 nearly tied (router row 2 = row 1 +
/// δ·row 3), written as a checkpoint the engine loads.
fn near_tie_checkpoint(delta: f64) -> tempfile::TempDir {
    let source = fixture("tiny-qwen3-moe");
    let model = CausalLM::from_pretrained(&source, &ModelOptions::default()).unwrap();
    let named = model.named_tensors();
    let gate = &named
        .iter()
        .find(|(n, _)| n == "model.layers.0.mlp.gate.weight")
        .unwrap()
        .1;
    tch::no_grad(|| {
        let tied = gate.get(1) + gate.get(3) * delta;
        gate.get(2).copy_(&tied);
    });
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &named).unwrap();
    for file in ["config.json", "generation_config.json"] {
        std::fs::copy(source.join(file), dir.path().join(file)).unwrap();
    }
    dir
}

/// A rollout of the checkpoint in `dir`: sampled (T = 1, two per prompt) continuations of the
/// fixture's sequences, as the `native` rollout generates them (with the batch-invariant kernels
/// when `deterministic`).
fn rollout(dir: &std::path::Path, deterministic: bool) -> (Vec<Vec<i64>>, Vec<Completion>) {
    let model = CausalLM::from_pretrained(dir, &ModelOptions::default()).unwrap();
    model.set_batch_invariant(deterministic);
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tiny-qwen3-moe").join("expected.json")).unwrap(),
    )
    .unwrap();
    let prompts: Vec<Vec<i64>> = expected["sequences"]
        .as_array()
        .unwrap()
        .iter()
        // Prompts of 7, 11 and 4 tokens: the batch has left padding.
        .map(|s| serde_json::from_value(s["ids"].clone()).unwrap())
        .collect();
    let params = SamplingParams {
        n: 2,
        max_new_tokens: 12,
        ignore_eos: true,
        seed: 7,
        ..SamplingParams::default()
    };
    let completions = tch::no_grad(|| model.generate(&prompts, &params, &[])).unwrap();
    (prompts, completions)
}

/// verl's layout of the completions: prompts left-padded, responses right-padded, the rollout's
/// experts where `input_ids` holds their tokens (`[B, P+R, L, k]`), and its log-probs `[B, R]`.
struct Rolled {
    batch: Batch,
    rollout_log_probs: Vec<Vec<f32>>,
    /// Per row: where its fed tokens (prompt and response but the last) start and end.
    fed: Vec<(usize, usize)>,
}

fn lay_out(prompts: &[Vec<i64>], completions: &[Completion], layers: i64, k: i64) -> Rolled {
    let p = prompts.iter().map(Vec::len).max().unwrap();
    let r = completions
        .iter()
        .map(|c| c.response_ids.len())
        .max()
        .unwrap();
    let (b, w, per_token) = (completions.len(), p + r, (layers * k) as usize);
    let (mut ids, mut mask) = (vec![0i64; b * w], vec![0i64; b * w]);
    let (mut responses, mut rmask) = (vec![0i64; b * r], vec![0f32; b * r]);
    let mut experts = vec![0i64; b * w * per_token];
    let (mut rollout_log_probs, mut fed) = (Vec::new(), Vec::new());
    for (row, c) in completions.iter().enumerate() {
        let prompt = &prompts[c.prompt_index];
        let start = p - prompt.len();
        for (i, &t) in prompt.iter().chain(&c.response_ids).enumerate() {
            ids[row * w + start + i] = t;
            mask[row * w + start + i] = 1;
        }
        for (i, &t) in c.response_ids.iter().enumerate() {
            responses[row * r + i] = t;
            rmask[row * r + i] = 1.0;
        }
        let at = (row * w + start) * per_token;
        experts[at..at + c.routed_experts.len()].copy_from_slice(&c.routed_experts);
        let tokens = c.routed_experts.len() / per_token;
        assert_eq!(tokens, prompt.len() + c.response_ids.len() - 1);
        fed.push((start, start + tokens));
        let mut lp = c.logprobs.clone();
        lp.resize(r, 0.0);
        rollout_log_probs.push(lp);
    }
    let (b, w, r) = (b as i64, w as i64, r as i64);
    let mut batch = Batch::default();
    batch.insert(keys::INPUT_IDS, Tensor::from_slice(&[b, w], &ids).unwrap());
    batch.insert(
        keys::ATTENTION_MASK,
        Tensor::from_slice(&[b, w], &mask).unwrap(),
    );
    batch.insert(
        keys::RESPONSES,
        Tensor::from_slice(&[b, r], &responses).unwrap(),
    );
    batch.insert(
        keys::RESPONSE_MASK,
        Tensor::from_slice(&[b, r], &rmask).unwrap(),
    );
    batch.insert(
        keys::ROUTED_EXPERTS,
        Tensor::from_slice(&[b, w, layers, k], &experts).unwrap(),
    );
    Rolled {
        batch,
        rollout_log_probs,
        fed,
    }
}

fn actor(dir: &std::path::Path, mode: &str) -> verl_plugin_host::EngineHandle {
    placed_actor(dir, mode, &PLACEMENTS[0])
}

/// Where the model lives and how a micro-batch is laid out: whole in the process (padded rows, or
/// one packed stream: `use_remove_padding`), whole with activation checkpointing, or the sharded
/// model (CPU offloading places it there on one rank).
type Placement = (&'static str, bool, bool, bool);
const PLACEMENTS: [Placement; 4] = [
    ("whole", false, false, false),
    ("whole, packed", false, false, true),
    ("whole, checkpointed", true, false, false),
    ("sharded, packed", true, true, true),
];

fn placed_actor(
    dir: &std::path::Path,
    mode: &str,
    placement: &Placement,
) -> verl_plugin_host::EngineHandle {
    section_actor(dir, mode, placement, json!({}))
}

/// The actor's section, with `overrides` set on top.
fn section_actor(
    dir: &std::path::Path,
    mode: &str,
    &(_, checkpointing, sharded, packed): &Placement,
    overrides: serde_json::Value,
) -> verl_plugin_host::EngineHandle {
    let mut section = json!({
        "role": "actor",
        "model": {"path": dir, "enable_gradient_checkpointing": checkpointing, "use_remove_padding": packed},
        "optim": {"lr": 1e-3},
        "ppo_mini_batch_size": 64,
        "router_replay": {"mode": mode},
        "fsdp_config": {"param_offload": sharded},
    });
    for (key, value) in overrides.as_object().unwrap() {
        section[key] = value.clone();
    }
    engine(&section)
}

/// An actor whose updates are not on-policy (two mini-batches of the six rows, so verl's
/// on-policy shortcut does not take the old log-probs from the update's forward) and leave the
/// weights as they are (lr 0: the second mini-batch's forward is the first's model), with its
/// `compute_log_prob` on the update's micro-batches, so an update's `ppo_kl` is exactly 0 when its
/// forwards reproduce the old log-probs.
fn replaying_updater(
    dir: &std::path::Path,
    mode: &str,
    placement: &Placement,
) -> verl_plugin_host::EngineHandle {
    section_actor(
        dir,
        mode,
        placement,
        json!({
            "ppo_mini_batch_size": 3,
            // The old-log-prob forward on the update's shapes: rounding as the update's forwards.
            "ppo_micro_batch_size_per_gpu": 3,
            "log_prob_micro_batch_size_per_gpu": 3,
            "optim": {"lr": 0.0},
        }),
    )
}

/// The largest |Δ| between the engine's and the rollout's log-probs over the response tokens.
fn vs_rollout(out: &Batch, rolled: &Rolled) -> f64 {
    rows(out, keys::LOG_PROBS)
        .iter()
        .zip(&rolled.rollout_log_probs)
        .map(|(mine, theirs)| max_abs_diff(mine, theirs))
        .fold(0.0, f64::max)
}

fn tch_of(tensor: &Tensor) -> TchTensor {
    verl_model::interop::to_tch("t", tensor, tch::Device::Cpu).unwrap()
}

/// Whether some fed token's expert set (order within the top-k changes nothing) differs.
fn expert_sets_differ(a: &Tensor, b: &Tensor, fed: &[(usize, usize)]) -> bool {
    let (a, b) = (tch_of(a).sort(-1, false).0, tch_of(b).sort(-1, false).0);
    fed.iter().enumerate().any(|(row, &(start, end))| {
        let n = (end - start) as i64;
        let cut = |t: &TchTensor| t.get(row as i64).narrow(0, start as i64, n);
        !cut(&a).equal(&cut(&b))
    })
}

/// A near-tied checkpoint whose rollout routes some token differently from the engine's own
/// forward (searching δ as the model crate's test does), its rollout and the engine's free
/// (`disabled`) log-probs.
fn flipping_case() -> (tempfile::TempDir, Rolled, Batch) {
    for delta in [
        1e-7, -1e-7, 3e-7, -3e-7, 1e-6, -1e-6, 3e-6, -3e-6, 1e-5, -1e-5, 3e-5, -3e-5,
    ] {
        let dir = near_tie_checkpoint(delta);
        let (prompts, completions) = rollout(dir.path(), false);
        let rolled = lay_out(&prompts, &completions, 2, 2);
        // R2 records the engine's own routing; its log-probs are the free forward's.
        let own = actor(dir.path(), "R2")
            .compute_log_prob(&rolled.batch)
            .unwrap();
        let routed = own.require(keys::ROUTED_EXPERTS).unwrap();
        if expert_sets_differ(
            routed,
            rolled.batch.require(keys::ROUTED_EXPERTS).unwrap(),
            &rolled.fed,
        ) {
            println!("δ = {delta:e} flips an expert between the rollout and the engine");
            return (dir, rolled, own);
        }
    }
    panic!("no δ made the rollout and the engine's forward route differently");
}

/// R3 end to end at the engine: the experts the engine's forward used are the rollout's, its
/// log-probs are the rollout's within fp32 rounding, while the same engine without replay (whose
/// own router flips an expert on this near-tied model) differs by more than 1e-3.
///
/// Not bit for bit: the rollout decodes one token per step over a KV cache, the engine scores the
/// whole sequence, and libtorch's fast CPU kernels round those shapes differently (bit for bit is
/// the deterministic mode's, next test).
#[test]
fn r3_replays_the_rollouts_experts_and_reproduces_its_log_probs() {
    let (dir, rolled, free) = flipping_case();
    let unreplayed = vs_rollout(&free, &rolled);
    println!("max |Δ log-prob| vs the rollout without replay: {unreplayed:.2e}");
    assert!(unreplayed > 1e-3, "{unreplayed:e}");
    for placement in &PLACEMENTS {
        let out = placed_actor(dir.path(), "R3", placement)
            .compute_log_prob(&rolled.batch)
            .unwrap();
        // The routing the engine's forward used, as it recorded it: the rollout's, every entry.
        assert_eq!(
            out.require(keys::ROUTED_EXPERTS).unwrap(),
            rolled.batch.require(keys::ROUTED_EXPERTS).unwrap(),
            "{}",
            placement.0
        );
        let replayed = vs_rollout(&out, &rolled);
        println!(
            "{}: max |Δ log-prob| vs the rollout with R3 {replayed:.2e}",
            placement.0
        );
        assert!(replayed < FP32_ROUNDING, "{}: {replayed:e}", placement.0);
    }
    // Without replay the engine's forward ignores the batch's routed_experts.
    let disabled = actor(dir.path(), "disabled")
        .compute_log_prob(&rolled.batch)
        .unwrap();
    assert_eq!(
        disabled.require(keys::LOG_PROBS).unwrap(),
        free.require(keys::LOG_PROBS).unwrap()
    );
    assert!(disabled.get(keys::ROUTED_EXPERTS).is_none());
}

/// With the batch-invariant kernels on both sides (`trainer.deterministic`, which verl-core copies
/// into the rollout's and the engine's sections), R3's training log-probs are the rollout's bit for
/// bit, whole, checkpointed and sharded, and the engine used the rollout's experts.
#[test]
fn r3_in_the_deterministic_mode_reproduces_the_rollouts_log_probs_bit_for_bit() {
    let dir = near_tie_checkpoint(1e-7);
    let (prompts, completions) = rollout(dir.path(), true);
    let rolled = lay_out(&prompts, &completions, 2, 2);
    for placement in &PLACEMENTS {
        // verl-core copies `trainer.deterministic` into the section.
        let out = section_actor(dir.path(), "R3", placement, json!({"deterministic": true}))
            .compute_log_prob(&rolled.batch)
            .unwrap();
        assert_eq!(
            out.require(keys::ROUTED_EXPERTS).unwrap(),
            rolled.batch.require(keys::ROUTED_EXPERTS).unwrap(),
            "{}",
            placement.0
        );
        assert_eq!(vs_rollout(&out, &rolled), 0.0, "{}", placement.0);
    }
}

/// `batch` with `old`'s log-probs as the old policy's and alternating advantages.
fn ppo(mut batch: Batch, old: &Batch) -> Batch {
    let lp = old.require(keys::LOG_PROBS).unwrap().clone();
    let shape = lp.shape.to_vec();
    let n = (shape[0] * shape[1]) as usize;
    let adv: Vec<f32> = (0..n).map(|i| [1.0f32, -0.5][i % 2]).collect();
    batch.insert(keys::ADVANTAGES, Tensor::from_slice(&shape, &adv).unwrap());
    batch.insert(keys::OLD_LOG_PROBS, lp);
    set_meta(&mut batch, json!({"temperature": 1.0}));
    batch
}

/// The update replays too: with R3 (old log-probs from the R3 forward) and with R2 (old log-probs
/// and routing from the R2 forward) the update's forwards reproduce the old log-probs bit for bit
/// (same kernels, same experts, unchanged weights), so `ppo_kl` and the clip fraction are exactly
/// 0; an update without replay, fed R3's old log-probs, routes the flipped token its own way and
/// sees a non-zero KL.
#[test]
fn updates_replay_the_batchs_routing() {
    let (dir, rolled, _) = flipping_case();
    let old_r3 = actor(dir.path(), "R3")
        .compute_log_prob(&rolled.batch)
        .unwrap();
    for placement in &PLACEMENTS {
        let mut r3 = replaying_updater(dir.path(), "R3", placement);
        let old = r3.compute_log_prob(&rolled.batch).unwrap();
        let metrics = update(&mut r3, &ppo(rolled.batch.clone(), &old));
        assert_eq!(metric(&metrics, "actor/ppo_kl"), 0.0, "{}", placement.0);
        assert_eq!(
            metric(&metrics, "actor/pg_clipfrac"),
            0.0,
            "{}",
            placement.0
        );
    }

    let mut free = replaying_updater(dir.path(), "disabled", &PLACEMENTS[0]);
    let metrics = update(&mut free, &ppo(rolled.batch.clone(), &old_r3));
    let kl = metric(&metrics, "actor/ppo_kl");
    println!("ppo_kl of an update without replay on R3's old log-probs: {kl:e}");
    assert!(kl.abs() > 0.0);

    // R2: the batch's routing is what compute_log_prob recorded (packed: in the padded layout,
    // zero at padding like a rollout's), not the rollout's.
    for placement in &PLACEMENTS[..2] {
        let mut r2 = replaying_updater(dir.path(), "R2", placement);
        let old_r2 = r2.compute_log_prob(&rolled.batch).unwrap();
        let mut batch = ppo(rolled.batch.clone(), &old_r2);
        batch.insert(
            keys::ROUTED_EXPERTS,
            old_r2.require(keys::ROUTED_EXPERTS).unwrap().clone(),
        );
        let metrics = update(&mut r2, &batch);
        assert_eq!(metric(&metrics, "actor/ppo_kl"), 0.0, "{}", placement.0);
    }
}

/// What cannot be replayed is refused naming the key: a replaying update without
/// `routed_experts`, replay in the reference, an unknown mode.
#[test]
fn replay_errors_name_the_key() {
    let dir = near_tie_checkpoint(0.0);
    let (prompts, completions) = rollout(dir.path(), false);
    let rolled = lay_out(&prompts, &completions, 2, 2);
    let mut without = rolled.batch.clone();
    without.tensors = without
        .tensors
        .iter()
        .filter(|t| t.name.as_str() != keys::ROUTED_EXPERTS)
        .cloned()
        .collect();
    let err = actor(dir.path(), "R3")
        .compute_log_prob(&without)
        .unwrap_err()
        .to_string();
    assert!(err.contains("routed_experts"), "{err}");

    for (config, words) in [
        (
            json!({"role": "ref", "model": {"path": dir.path()}, "router_replay": {"mode": "R2"}}),
            &["router_replay.mode", "only the actor"][..],
        ),
        (
            json!({"role": "actor", "model": {"path": dir.path()}, "router_replay": {"mode": "R4"}}),
            &["router_replay", "R4"][..],
        ),
    ] {
        let err = new_engine()
            .init(&init_for(&config))
            .unwrap_err()
            .to_string();
        assert!(words.iter().all(|w| err.contains(w)), "{err}");
    }
}

/// With `output_router_logits` in the model's config the actor's loss gains
/// `router_aux_loss_coef` × the load-balancing loss (transformers' mixture-of-experts loss),
/// reported as `actor/moe_aux_loss`: the metric is the batch's loss as the model crate computes
/// it (one micro-batch), and the router's update differs from the one without it. Without the
/// key nothing is added or reported (verl's RL losses carry none).
#[test]
fn the_aux_loss_joins_the_actor_loss_when_the_config_asks() {
    let source = fixture("tiny-qwen3-moe");
    let dir = tempfile::tempdir().unwrap();
    for file in ["model.safetensors", "generation_config.json"] {
        std::fs::copy(source.join(file), dir.path().join(file)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap())
            .unwrap();
    config["output_router_logits"] = json!(true);
    config["router_aux_loss_coef"] = json!(10.0);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();

    let (prompts, completions) = rollout(&source, false);
    let rolled = lay_out(&prompts, &completions, 2, 2);
    let old = actor(&source, "disabled")
        .compute_log_prob(&rolled.batch)
        .unwrap();
    let trained = |path: &std::path::Path, placement| {
        let mut actor = placed_actor(path, "disabled", placement);
        let metrics = update(&mut actor, &ppo(rolled.batch.clone(), &old));
        let gate = weights(&mut actor)
            .into_iter()
            .find(|w| w.name.as_str() == "model.layers.0.mlp.gate.weight")
            .unwrap()
            .tensor
            .to_vec::<f32>()
            .unwrap();
        (metrics, gate)
    };
    let (with_aux, gate_aux) = trained(dir.path(), &PLACEMENTS[0]);
    let (without, gate) = trained(&source, &PLACEMENTS[0]);
    assert!(without.iter().all(|m| m.key != "actor/moe_aux_loss"));
    let moved = max_abs_diff(&gate_aux, &gate);
    println!("router weights with vs without the aux loss: max |Δ| {moved:.2e}");
    assert!(moved > 1e-6);
    // Checkpointed and sharded backward passes split the loss by layer: the same update.
    for placement in &PLACEMENTS[1..] {
        let (metrics, gate) = trained(dir.path(), placement);
        let diff = max_abs_diff(&gate, &gate_aux);
        assert!(
            diff < 1e-6,
            "{}: router weights differ by {diff:e}",
            placement.0
        );
        let (got, want) = (
            metric(&metrics, "actor/moe_aux_loss"),
            metric(&with_aux, "actor/moe_aux_loss"),
        );
        assert!(
            (got - want).abs() < 1e-6,
            "{}: {got} vs {want}",
            placement.0
        );
    }

    let model = CausalLM::from_pretrained(&source, &ModelOptions::default()).unwrap();
    let (ids, mask) = (
        tch_of(rolled.batch.require(keys::INPUT_IDS).unwrap()),
        tch_of(rolled.batch.require(keys::ATTENTION_MASK).unwrap()),
    );
    let (_, router) = tch::no_grad(|| model.forward_routed(&ids, &mask, None)).unwrap();
    let want = verl_model::load_balancing_loss(&router.logits, 4, 2, Some(&mask))
        .unwrap()
        .double_value(&[]);
    let got = metric(&with_aux, "actor/moe_aux_loss");
    println!("actor/moe_aux_loss {got} (model crate: {want})");
    assert!((got - want).abs() < 1e-6, "{got} vs {want}");
}
