//! Mixture-of-experts decoders (Qwen2-MoE, Qwen3-MoE) against Hugging Face transformers on the
//! committed tiny checkpoints (`fixtures/make_moe_fixtures.py`), and router replay: the training
//! forward using the experts the rollout recorded.

use serde::Deserialize;
use tch::{Kind, Tensor};
use verl_model::testing::{fixture, load, max_abs_diff, row};
use verl_model::{
    CausalLM, Completion, LoadBalance, ModelOptions, SamplingParams, load_balancing_loss,
    log_probs_from_logits, write_safetensors,
};

const MODELS: [&str; 2] = ["tiny-qwen2-moe", "tiny-qwen3-moe"];
const TOL: f64 = 1e-5;

#[derive(Deserialize)]
struct Expected {
    sequences: Vec<Sequence>,
    padded: Padded,
    greedy: Vec<Greedy>,
}

#[derive(Deserialize)]
struct Sequence {
    ids: Vec<i64>,
    logprobs: Vec<f64>,
    aux_loss: f64,
    /// Per sparse layer, per token: the top-k experts, most probable first.
    routing: Vec<Vec<Vec<i64>>>,
}

#[derive(Deserialize)]
struct Padded {
    input_ids: Vec<Vec<i64>>,
    attention_mask: Vec<Vec<i64>>,
    /// Per row, the logits of its real tokens.
    logits: Vec<Vec<Vec<f64>>>,
    aux_loss: f64,
}

#[derive(Deserialize)]
struct Greedy {
    prompt_ids: Vec<i64>,
    response_ids: Vec<i64>,
    logprobs: Vec<f64>,
}

fn expected(name: &str) -> Expected {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn tensor2(rows: &[Vec<i64>]) -> Tensor {
    let flat: Vec<i64> = rows.concat();
    Tensor::from_slice(&flat).view([rows.len() as i64, -1])
}

fn aux_loss(model: &CausalLM, logits: &[Tensor], mask: Option<&Tensor>) -> f64 {
    let moe = model.config().moe.as_ref().unwrap();
    load_balancing_loss(logits, moe.num_experts, moe.num_experts_per_tok, mask)
        .unwrap()
        .double_value(&[])
}

#[test]
fn logits_log_probs_routing_and_aux_loss_match_transformers() {
    for name in MODELS {
        let model = load(name);
        let exp = expected(name);
        let (mut worst_lp, mut worst_aux) = (0.0f64, 0.0f64);
        for seq in &exp.sequences {
            let n = seq.ids.len() as i64;
            let ids = Tensor::from_slice(&seq.ids).view([1, n]);
            let (logits, router) = model.forward_routed(&ids, &ids.ones_like(), None).unwrap();
            let lp = log_probs_from_logits(&logits.narrow(1, 0, n - 1), &ids.narrow(1, 1, n - 1));
            worst_lp = worst_lp.max(max_abs_diff(&row(&lp, 0), &seq.logprobs));
            worst_aux =
                worst_aux.max((aux_loss(&model, &router.logits, None) - seq.aux_loss).abs());
            // [1, T, layers, k] → per layer, per token.
            let experts = router.experts.get(0).permute([1, 0, 2]);
            let got: Vec<Vec<Vec<i64>>> = (0..experts.size()[0])
                .map(|l| {
                    let layer = experts.get(l);
                    (0..n)
                        .map(|t| Vec::<i64>::try_from(&layer.get(t)).unwrap())
                        .collect()
                })
                .collect();
            assert_eq!(got, seq.routing, "{name}: experts of {:?}", seq.ids);
        }
        // A left-padded batch: the real tokens' logits, and the aux loss without the padding.
        let p = &exp.padded;
        let (ids, mask) = (tensor2(&p.input_ids), tensor2(&p.attention_mask));
        let (logits, router) = model.forward_routed(&ids, &mask, None).unwrap();
        let width = ids.size()[1];
        let mut worst_padded = 0.0f64;
        for (i, want) in p.logits.iter().enumerate() {
            let real = want.len() as i64;
            let got = logits
                .get(i as i64)
                .narrow(0, width - real, real)
                .reshape([-1]);
            let got = Vec::<f64>::try_from(&got.to_kind(Kind::Double)).unwrap();
            worst_padded = worst_padded.max(max_abs_diff(&got, &want.concat()));
        }
        let padded_aux = (aux_loss(&model, &router.logits, Some(&mask)) - p.aux_loss).abs();
        println!(
            "{name}: max |Δ| log-probs {worst_lp:.2e}, aux loss {worst_aux:.2e}, padded logits {worst_padded:.2e}, padded aux loss {padded_aux:.2e}"
        );
        assert!(worst_lp < TOL && worst_aux < TOL && worst_padded < TOL && padded_aux < TOL);
    }
}

#[test]
fn greedy_generation_matches_transformers_and_records_routing() {
    for name in MODELS {
        let model = load(name);
        let sparse = model.sparse_layers();
        let k = model.config().moe.as_ref().unwrap().num_experts_per_tok;
        for g in expected(name).greedy {
            let params = SamplingParams {
                temperature: 0.0,
                max_new_tokens: g.response_ids.len(),
                ignore_eos: true,
                ..SamplingParams::default()
            };
            let out = model
                .generate(std::slice::from_ref(&g.prompt_ids), &params, &[])
                .unwrap();
            assert_eq!(out[0].response_ids, g.response_ids, "{name}");
            let lp: Vec<f64> = out[0].logprobs.iter().map(|&x| f64::from(x)).collect();
            assert!(max_abs_diff(&lp, &g.logprobs) < TOL, "{name}");
            let fed = (g.prompt_ids.len() + g.response_ids.len() - 1) as i64;
            assert_eq!(
                out[0].routed_experts.len() as i64,
                fed * sparse * k,
                "{name}"
            );
        }
    }
}

#[test]
fn exported_checkpoints_load_back_with_expert_names() {
    for name in MODELS {
        let model = load(name);
        let names: Vec<String> = model.named_tensors().into_iter().map(|(n, _)| n).collect();
        assert!(
            names
                .iter()
                .any(|n| n == "model.layers.0.mlp.experts.3.down_proj.weight")
        );
        assert!(names.iter().any(|n| n == "model.layers.0.mlp.gate.weight"));
        let dir = tempfile::tempdir().unwrap();
        write_safetensors(
            &dir.path().join("model.safetensors"),
            &model.named_tensors(),
        )
        .unwrap();
        let config = serde_json::to_string(&model.config().to_hf_json()).unwrap();
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let back = CausalLM::from_pretrained(dir.path(), &ModelOptions::default()).unwrap();
        assert_eq!(back.config(), model.config(), "{name}");
        let ids = Tensor::from_slice(&expected(name).sequences[0].ids).view([1, -1]);
        let a = model.forward(&ids, &ids.ones_like()).unwrap();
        let b = back.forward(&ids, &ids.ones_like()).unwrap();
        assert!(a.equal(&b), "{name}");
    }
}

/// The batch a trainer builds from a rollout: `[1, prompt + response]` ids and the recorded
/// experts laid out like them. The last token was never fed to the rollout's model; its experts
/// are a filler (`0..k`), which only its own output — scored by nothing — depends on.
fn training_batch(model: &CausalLM, prompt: &[i64], c: &Completion) -> (Tensor, Tensor) {
    let ids: Vec<i64> = prompt.iter().chain(&c.response_ids).copied().collect();
    let (sparse, k) = (
        model.sparse_layers(),
        model.config().moe.as_ref().unwrap().num_experts_per_tok,
    );
    let mut experts = c.routed_experts.clone();
    for _ in 0..sparse {
        experts.extend(0..k);
    }
    let len = ids.len() as i64;
    (
        Tensor::from_slice(&ids).view([1, len]),
        Tensor::from_slice(&experts).view([1, len, sparse, k]),
    )
}

/// The response log-probs the training forward computes, with or without replaying `experts`.
fn training_log_probs(
    model: &CausalLM,
    ids: &Tensor,
    prompt_len: i64,
    replay: Option<&Tensor>,
) -> Vec<f64> {
    let len = ids.size()[1];
    let (logits, _) = tch::no_grad(|| model.forward_routed(ids, &ids.ones_like(), replay)).unwrap();
    let r = len - prompt_len;
    row(
        &log_probs_from_logits(
            &logits.narrow(1, prompt_len - 1, r),
            &ids.narrow(1, prompt_len, r),
        ),
        0,
    )
}

/// Rollout (KV cache, one token per step) vs training forward (the whole sequence at once), with
/// and without replaying the rollout's experts. Returns the largest |Δ log-prob| of each, and
/// whether the training forward's own top-k differed from the rollout's on any token.
fn rollout_vs_training(model: &CausalLM, params: &SamplingParams) -> (f64, f64, bool) {
    let prompts = expected("tiny-qwen3-moe")
        .sequences
        .iter()
        .map(|s| s.ids.clone())
        .collect::<Vec<_>>();
    let out = model.generate(&prompts, params, &[]).unwrap();
    let (mut replayed, mut free, mut flipped) = (0.0f64, 0.0f64, false);
    for c in &out {
        let prompt = &prompts[c.prompt_index];
        let (ids, experts) = training_batch(model, prompt, c);
        let rollout: Vec<f64> = c.logprobs.iter().map(|&x| f64::from(x)).collect();
        let p = prompt.len() as i64;
        replayed = replayed.max(max_abs_diff(
            &training_log_probs(model, &ids, p, Some(&experts)),
            &rollout,
        ));
        free = free.max(max_abs_diff(
            &training_log_probs(model, &ids, p, None),
            &rollout,
        ));
        // Expert sets (order within the top-k does not change the output) of the fed tokens.
        let (_, own) = tch::no_grad(|| model.forward_routed(&ids, &ids.ones_like(), None)).unwrap();
        let fed = ids.size()[1] - 1;
        let sets = |t: &Tensor| t.narrow(1, 0, fed).sort(-1, false).0;
        flipped |= !sets(&own.experts).equal(&sets(&experts));
    }
    (replayed, free, flipped)
}

fn greedy_and_sampled() -> [SamplingParams; 2] {
    let base = SamplingParams {
        n: 2,
        max_new_tokens: 12,
        ignore_eos: true,
        seed: 7,
        ..SamplingParams::default()
    };
    [
        SamplingParams {
            temperature: 0.0,
            n: 1,
            ..base.clone()
        },
        base,
    ]
}

#[test]
fn replaying_the_rollouts_experts_reproduces_its_log_probs() {
    let model = load("tiny-qwen3-moe");
    for params in greedy_and_sampled() {
        let (replayed, free, flipped) = rollout_vs_training(&model, &params);
        println!(
            "T={}: max |Δ| with replay {replayed:.2e}, without {free:.2e}, flipped {flipped}",
            params.temperature
        );
        // No near-tie in this model's router: the same experts either way, and the two forwards
        // differ only by the rounding of their different kernel shapes.
        assert!(!flipped && replayed < TOL && free < TOL);
    }
}

/// Makes experts 1 and 2 of layer 0 nearly tied: router row 2 = row 1 + δ·row 3.
fn near_tie(model: &CausalLM, delta: f64) {
    let gate = model
        .named_tensors()
        .into_iter()
        .find(|(n, _)| n == "model.layers.0.mlp.gate.weight")
        .unwrap()
        .1;
    tch::no_grad(|| {
        let tied = gate.get(1) + gate.get(3) * delta;
        gate.get(2).copy_(&tied);
    });
}

#[test]
fn a_near_tie_flips_an_expert_without_replay_and_replay_removes_the_difference() {
    // Search δ for a router whose near-tie the two forwards' rounding breaks differently.
    let params = &greedy_and_sampled()[0];
    let found = [
        1e-7, -1e-7, 3e-7, -3e-7, 1e-6, -1e-6, 3e-6, -3e-6, 1e-5, -1e-5, 3e-5, -3e-5,
    ]
    .into_iter()
    .find_map(|delta| {
        let model = load("tiny-qwen3-moe");
        near_tie(&model, delta);
        let (replayed, free, flipped) = rollout_vs_training(&model, params);
        flipped.then_some((delta, replayed, free))
    });
    let (delta, replayed, free) =
        found.expect("no δ made the rollout and the training forward route differently");
    println!("δ = {delta:e}: max |Δ| with replay {replayed:.2e}, without {free:.2e}");
    assert!(
        free > 100.0 * TOL,
        "an expert flip should move the log-probs: {free:e}"
    );
    assert!(replayed < TOL, "{replayed:e}");
}

#[test]
fn replaying_a_forwards_own_routing_is_bit_identical() {
    // verl's R2: the old-log-prob forward records, the update replays; same kernels, same shapes.
    let model = load("tiny-qwen2-moe");
    near_tie(&model, 1e-6);
    let p = &expected("tiny-qwen2-moe").padded;
    let (ids, mask) = (tensor2(&p.input_ids), tensor2(&p.attention_mask));
    let (logits, router) = model.forward_routed(&ids, &mask, None).unwrap();
    let (again, replayed) = model
        .forward_routed(&ids, &mask, Some(&router.experts))
        .unwrap();
    assert!(logits.equal(&again));
    assert!(router.experts.equal(&replayed.experts));
}

#[test]
fn bad_replay_input_is_refused_naming_the_key() {
    let model = load("tiny-qwen2-moe");
    let ids = Tensor::from_slice(&[5i64, 6, 7]).view([1, 3]);
    for bad in [
        Tensor::zeros([1, 3, 1, 3], (Kind::Int64, tch::Device::Cpu)),
        Tensor::full([1, 3, 1, 2], 4i64, (Kind::Int64, tch::Device::Cpu)),
    ] {
        let err = model
            .forward_routed(&ids, &ids.ones_like(), Some(&bad))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("routed_experts"), "{err}");
    }
    let dense = load("tiny-qwen2");
    let err = dense
        .forward_routed(
            &ids,
            &ids.ones_like(),
            Some(&Tensor::zeros(
                [1, 3, 1, 2],
                (Kind::Int64, tch::Device::Cpu),
            )),
        )
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no experts"), "{err}");
}

#[test]
fn the_router_trains_under_replay_and_the_aux_loss_has_a_gradient() {
    let model = load("tiny-qwen3-moe");
    let ids = Tensor::from_slice(&expected("tiny-qwen3-moe").sequences[1].ids).view([1, -1]);
    let n = ids.size()[1];
    let mask = ids.ones_like();
    let (_, recorded) = tch::no_grad(|| model.forward_routed(&ids, &mask, None)).unwrap();
    let grads = |aux_coef: f64| {
        model.named_tensors().iter().for_each(|(_, t)| {
            let mut g = t.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        });
        let (logits, router) = model
            .forward_routed(&ids, &mask, Some(&recorded.experts))
            .unwrap();
        let lp = log_probs_from_logits(&logits.narrow(1, 0, n - 1), &ids.narrow(1, 1, n - 1));
        let moe = model.config().moe.as_ref().unwrap();
        let aux = load_balancing_loss(
            &router.logits,
            moe.num_experts,
            moe.num_experts_per_tok,
            None,
        )
        .unwrap();
        (lp.mean(Kind::Float).neg() + aux * aux_coef).backward();
        let named = model.named_tensors();
        let norm = |name: &str| {
            named
                .iter()
                .find(|(n, _)| n == name)
                .unwrap()
                .1
                .grad()
                .norm()
                .double_value(&[])
        };
        (
            norm("model.layers.0.mlp.gate.weight"),
            norm("model.layers.1.mlp.experts.0.up_proj.weight"),
        )
    };
    // Replayed experts keep the router in the graph through their weights.
    let (router, expert) = grads(0.0);
    assert!(router > 0.0 && expert > 0.0, "{router} {expert}");
    // The aux loss adds its own gradient to the router.
    let (with_aux, _) = grads(10.0);
    assert!(
        (with_aux - router).abs() > 1e-6 * router,
        "{with_aux} vs {router}"
    );
}

/// The aux loss taken layer by layer (what a backward pass that recomputes one layer at a time
/// adds, `LoadBalance`) sums to transformers' loss and has its gradient with respect to every
/// layer's router logits, on a padded batch.
#[test]
fn the_layer_split_aux_loss_equals_the_whole_one_in_value_and_gradient() {
    let model = load("tiny-qwen3-moe");
    let moe = model.config().moe.as_ref().unwrap();
    let padded = expected("tiny-qwen3-moe").padded;
    let (ids, mask) = (tensor2(&padded.input_ids), tensor2(&padded.attention_mask));
    let (_, router) = tch::no_grad(|| model.forward_routed(&ids, &mask, None)).unwrap();
    let (e, k) = (moe.num_experts, moe.num_experts_per_tok);
    let leaves: Vec<Tensor> = router
        .logits
        .iter()
        .map(|l| l.detach().set_requires_grad(true))
        .collect();
    let whole = load_balancing_loss(&leaves, e, k, Some(&mask)).unwrap();
    let want = Tensor::run_backward(&[&whole], &leaves, false, false);
    let split = LoadBalance::new(&router.logits, e, k, Some(&mask)).unwrap();
    let terms: Vec<Tensor> = leaves.iter().map(|l| split.layer_term(l)).collect();
    let total = terms.iter().fold(
        Tensor::zeros([], (Kind::Float, tch::Device::Cpu)),
        |a, t| a + t,
    );
    assert!((total.double_value(&[]) - whole.double_value(&[])).abs() < 1e-6);
    assert!((split.value - whole.double_value(&[])).abs() < 1e-6);
    let got = Tensor::run_backward(&[&total], &leaves, false, false);
    for (g, w) in got.iter().zip(&want) {
        let diff = (g - w).abs().max().double_value(&[]);
        assert!(diff < 1e-7, "gradient differs by {diff:e}");
        assert!(
            w.abs().max().double_value(&[]) > 0.0,
            "a gradient to compare"
        );
    }
}
