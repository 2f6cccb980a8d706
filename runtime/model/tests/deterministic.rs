//! Switch tests of the deterministic mode ([`CausalLM::set_batch_invariant`], verl's
//! `trainer.deterministic`). On: a sequence's logits, engine log-probs (padded and packed) and
//! greedy rollout (tokens and log-probs) are bit-identical alone and inside batches of 3 and 8
//! with mixed lengths, left, right or extra padding, at any row; and the rollout's KV-cache
//! log-probs equal the engine's full-forward log-probs bit for bit. Off: the fast kernels, which
//! the same compositions show to be batch-dependent. Models: the Llama fixture (grouped-query
//! attention), the Qwen2 one (biases, tied embeddings), the Qwen3-MoE one (experts, q/k norms)
//! and a random Llama wide enough (hidden 256, head_dim 64, vocab 2048) for MKL's blocked
//! kernels; sequences span several attention tiles (32 positions).

use tch::{Kind, Tensor};
use verl_model::testing::{fixture, load};
use verl_model::{
    Architecture, CausalLM, Completion, ModelConfig, ModelOptions, Rng, SamplingParams,
    ScoreOutputs,
};

/// The models the switch tests run.
fn models() -> Vec<(&'static str, CausalLM)> {
    let wide = ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 2048,
        hidden_size: 256,
        intermediate_size: 688,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 64,
        rope_theta: 10000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 512,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        initializer_range: 0.05,
        bos_token_id: None,
        eos_token_ids: vec![],
        pad_token_id: None,
        qk_norm: false,
        moe: None,
    };
    let options = ModelOptions {
        seed: 7,
        ..ModelOptions::default()
    };
    vec![
        ("tiny-llama", load("tiny-llama")),
        ("tiny-qwen2", load("tiny-qwen2")),
        (
            "tiny-qwen3-moe",
            CausalLM::from_pretrained(&fixture("tiny-qwen3-moe"), &ModelOptions::default())
                .unwrap(),
        ),
        ("wide-llama", CausalLM::random(wide, &options).unwrap()),
    ]
}

fn tokens(len: usize, vocab: i64, seed: u64) -> Vec<i64> {
    let mut rng = Rng::new(seed);
    (0..len)
        .map(|_| (rng.next_u64() % vocab as u64) as i64)
        .collect()
}

/// One row: a prompt and a response.
struct Row {
    prompt: Vec<i64>,
    response: Vec<i64>,
}

/// The target sequence every composition contains: 37 prompt and 29 response tokens (3 attention
/// tiles).
fn target(vocab: i64) -> Row {
    Row {
        prompt: tokens(37, vocab, 1),
        response: tokens(29, vocab, 2),
    }
}

/// Other rows of mixed lengths.
fn others(count: usize, vocab: i64, seed: u64) -> Vec<Row> {
    (0..count)
        .map(|i| {
            let s = seed * 100 + i as u64;
            Row {
                prompt: tokens(1 + (s as usize * 7) % 45, vocab, s),
                response: tokens(1 + (s as usize * 5) % 40, vocab, s + 50),
            }
        })
        .collect()
}

/// verl's layout: prompts left-padded to `width.0`, responses right-padded to `width.1` (at least
/// the longest). Padding holds arbitrary ids. `(input_ids, attention_mask, response_len)`.
fn verl_batch(rows: &[&Row], extra: (usize, usize), vocab: i64) -> (Tensor, Tensor, i64) {
    let p = rows.iter().map(|r| r.prompt.len()).max().unwrap() + extra.0;
    let r = rows.iter().map(|r| r.response.len()).max().unwrap() + extra.1;
    let noise = tokens(rows.len() * (p + r), vocab, 99);
    let (mut ids, mut mask) = (noise.clone(), vec![0i64; noise.len()]);
    for (i, row) in rows.iter().enumerate() {
        let base = i * (p + r);
        let start = base + p - row.prompt.len();
        ids[start..base + p].copy_from_slice(&row.prompt);
        ids[base + p..base + p + row.response.len()].copy_from_slice(&row.response);
        mask[start..base + p + row.response.len()].fill(1);
    }
    let shape = [rows.len() as i64, (p + r) as i64];
    (
        Tensor::from_slice(&ids).view(shape),
        Tensor::from_slice(&mask).view(shape),
        r as i64,
    )
}

/// Whole sequences (prompt + response) with `left` and `right` padding columns of arbitrary ids
/// around the longest: `(input_ids, attention_mask)` and each row's first real column.
fn padded_sequences(rows: &[&Row], left: usize, right: usize, vocab: i64) -> (Tensor, Tensor) {
    let len = |r: &Row| r.prompt.len() + r.response.len();
    let width = rows.iter().map(|r| len(r)).max().unwrap() + left + right;
    let noise = tokens(rows.len() * width, vocab, 77);
    let (mut ids, mut mask) = (noise.clone(), vec![0i64; noise.len()]);
    for (i, row) in rows.iter().enumerate() {
        // Alternate rows sit flush left after `left` columns or flush right before `right`.
        let start = if i % 2 == 0 {
            i * width + left
        } else {
            (i + 1) * width - right - len(row)
        };
        let seq: Vec<i64> = row.prompt.iter().chain(&row.response).copied().collect();
        ids[start..start + seq.len()].copy_from_slice(&seq);
        mask[start..start + seq.len()].fill(1);
    }
    let shape = [rows.len() as i64, width as i64];
    (
        Tensor::from_slice(&ids).view(shape),
        Tensor::from_slice(&mask).view(shape),
    )
}

/// A batch holding the target sequence.
struct Composition {
    name: &'static str,
    rows: Vec<Row>,
    /// The target's row.
    at: usize,
    /// Extra padding columns of the verl layout (prompt side, response side).
    extra: (usize, usize),
}

fn compositions(vocab: i64) -> Vec<Composition> {
    let place = |name, seed, count, at, extra| {
        let mut rows = others(count, vocab, seed);
        rows.insert(at, target(vocab));
        Composition {
            name,
            rows,
            at,
            extra,
        }
    };
    vec![
        place("batch 3, row 1", 1, 2, 1, (0, 0)),
        place("batch 3, row 0, extra padding", 2, 2, 0, (5, 9)),
        place("batch 8, row 7, mixed lengths", 3, 7, 7, (0, 0)),
        place("batch 8, row 4, extra padding", 4, 7, 4, (13, 2)),
    ]
}

/// The target's response log-probs from engine-style forwards: alone, then in every composition
/// padded, then packed. Returns (composition, log-probs) pairs, the first alone.
fn engine_log_probs(model: &CausalLM) -> Vec<(String, Tensor)> {
    let vocab = model.config().vocab_size;
    let t = target(vocab);
    let r = t.response.len() as i64;
    let mut out = Vec::new();
    tch::no_grad(|| {
        let (ids, mask, rl) = verl_batch(&[&t], (0, 0), vocab);
        let alone = model
            .response_scores(&ids, &mask, rl, 1.0, ScoreOutputs::NONE)
            .unwrap();
        out.push(("alone".to_string(), alone.log_probs.get(0).narrow(0, 0, r)));
        for Composition {
            name,
            rows,
            at,
            extra,
        } in compositions(vocab)
        {
            let refs: Vec<&Row> = rows.iter().collect();
            let (ids, mask, rl) = verl_batch(&refs, extra, vocab);
            let padded = model
                .response_scores(&ids, &mask, rl, 1.0, ScoreOutputs::NONE)
                .unwrap();
            out.push((
                format!("{name}, padded"),
                padded.log_probs.get(at as i64).narrow(0, 0, r),
            ));
            let context = model.packed_block_context(&ids, &mask, rl).unwrap();
            let hidden = model.hidden_states_in(&context);
            let packed = model
                .response_scores_in(&hidden, &context, rl, 1.0, ScoreOutputs::NONE)
                .unwrap();
            out.push((
                format!("{name}, packed"),
                packed.log_probs.get(at as i64).narrow(0, 0, r),
            ));
        }
    });
    out
}

/// The target's logits at its real tokens: alone, then with left, right and both-side padding in
/// batches of 3 and 8.
fn sequence_logits(model: &CausalLM) -> Vec<(String, Tensor)> {
    let vocab = model.config().vocab_size;
    let t = target(vocab);
    let logits_of = |rows: &[&Row], at: i64, left, right| {
        let (ids, mask) = padded_sequences(rows, left, right, vocab);
        let logits = model.forward(&ids, &mask).unwrap().get(at);
        let real = mask.get(at).nonzero().squeeze_dim(-1);
        logits.index_select(0, &real)
    };
    tch::no_grad(|| {
        let mut out = vec![("alone".to_string(), logits_of(&[&t], 0, 0, 0))];
        for Composition { name, rows, at, .. } in compositions(vocab) {
            let refs: Vec<&Row> = rows.iter().collect();
            for (left, right) in [(0, 0), (0, 11), (6, 6)] {
                out.push((
                    format!("{name}, padding {left} left {right} right"),
                    logits_of(&refs, at as i64, left, right),
                ));
            }
        }
        out
    })
}

/// Which of `results` (after the first) differ bitwise from the first, and by how much.
fn differences(results: &[(String, Tensor)]) -> Vec<(String, f64)> {
    let reference = &results[0].1;
    results[1..]
        .iter()
        .filter(|(_, t)| !t.equal(reference))
        .map(|(name, t)| {
            let diff = (t - reference).abs().max().double_value(&[]);
            (name.clone(), diff)
        })
        .collect()
}

#[test]
fn the_mode_makes_engine_logits_and_log_probs_batch_invariant() {
    let mut differing_off = 0;
    for (name, model) in models() {
        for on in [true, false] {
            model.set_batch_invariant(on);
            let logits = differences(&sequence_logits(&model));
            let log_probs = differences(&engine_log_probs(&model));
            if on {
                assert!(
                    logits.is_empty(),
                    "{name}, mode on, logits differ: {logits:?}"
                );
                assert!(
                    log_probs.is_empty(),
                    "{name}, mode on, log-probs differ: {log_probs:?}"
                );
            } else {
                println!("{name}, mode off: logits differ in {logits:?}");
                println!("{name}, mode off: log-probs differ in {log_probs:?}");
                differing_off += logits.len() + log_probs.len();
                // Off, every difference is rounding.
                for (composition, diff) in logits.iter().chain(&log_probs) {
                    assert!(*diff < 1e-4, "{name}, {composition}: {diff}");
                }
            }
        }
    }
    // The fast kernels are batch-dependent: without the mode some composition differs.
    assert!(
        differing_off > 0,
        "no composition differs with the mode off"
    );
}

/// The target's prompt, greedy, alone and inside batches (generate left-pads prompts), and the
/// index of its completion in each.
fn rollouts(model: &CausalLM, params: &SamplingParams) -> Vec<(String, Completion)> {
    let vocab = model.config().vocab_size;
    let t = target(vocab);
    let mut out = Vec::new();
    let alone = model
        .generate(std::slice::from_ref(&t.prompt), params, &[])
        .unwrap();
    out.push(("alone".to_string(), alone[0].clone()));
    for Composition { name, rows, at, .. } in compositions(vocab) {
        let prompts: Vec<Vec<i64>> = rows.iter().map(|r| r.prompt.clone()).collect();
        let completions = model.generate(&prompts, params, &[]).unwrap();
        out.push((name.to_string(), completions[at * params.n].clone()));
    }
    out
}

fn greedy(max_new_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_new_tokens,
        temperature: 0.0,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn bits(logprobs: &[f32]) -> Vec<u32> {
    logprobs.iter().map(|l| l.to_bits()).collect()
}

#[test]
fn the_mode_makes_greedy_rollouts_batch_invariant() {
    let params = greedy(40);
    let mut differing_off = 0;
    for (name, model) in models() {
        for on in [true, false] {
            model.set_batch_invariant(on);
            let results = rollouts(&model, &params);
            let (_, alone) = &results[0];
            assert_eq!(alone.response_ids.len(), 40);
            for (composition, c) in &results[1..] {
                let same_tokens = c.response_ids == alone.response_ids;
                let same_logprobs = bits(&c.logprobs) == bits(&alone.logprobs);
                if on {
                    assert!(
                        same_tokens && same_logprobs,
                        "{name}, mode on, {composition}: tokens equal {same_tokens}, \
                         log-probs equal {same_logprobs}"
                    );
                } else if !(same_tokens && same_logprobs) {
                    let diff = c
                        .logprobs
                        .iter()
                        .zip(&alone.logprobs)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    println!(
                        "{name}, mode off, {composition}: tokens equal {same_tokens}, \
                         log-probs max |Δ| {diff:e}"
                    );
                    differing_off += 1;
                }
            }
        }
    }
    println!("mode off: {differing_off} rollouts differ from the target alone");
}

/// The rollout's log-probs against the engine's full forward over prompt + response, every
/// completion of a batch of 8 scored together (verl's layout): bit-identical with the mode on,
/// greedy and sampled (temperature 0.7, n = 2).
#[test]
fn with_the_mode_rollout_log_probs_equal_engine_log_probs_bit_for_bit() {
    let sampled = SamplingParams {
        n: 2,
        max_new_tokens: 33,
        temperature: 0.7,
        seed: 11,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    for (name, model) in models() {
        let vocab = model.config().vocab_size;
        let mut prompts: Vec<Vec<i64>> =
            others(7, vocab, 5).into_iter().map(|r| r.prompt).collect();
        prompts.insert(3, target(vocab).prompt);
        for on in [true, false] {
            model.set_batch_invariant(on);
            for params in [greedy(35), sampled.clone()] {
                let completions = model.generate(&prompts, &params, &[]).unwrap();
                let rows: Vec<Row> = completions
                    .iter()
                    .map(|c| Row {
                        prompt: prompts[c.prompt_index].clone(),
                        response: c.response_ids.clone(),
                    })
                    .collect();
                let refs: Vec<&Row> = rows.iter().collect();
                let (ids, mask, r) = verl_batch(&refs, (0, 0), vocab);
                let temperature = if params.temperature == 0.0 {
                    1.0
                } else {
                    params.temperature
                };
                let engine = tch::no_grad(|| {
                    model
                        .response_scores(&ids, &mask, r, temperature, ScoreOutputs::NONE)
                        .unwrap()
                        .log_probs
                });
                let mut max_diff = 0f32;
                for (i, c) in completions.iter().enumerate() {
                    let scored = Vec::<f32>::try_from(
                        engine
                            .get(i as i64)
                            .narrow(0, 0, c.response_ids.len() as i64)
                            .to_kind(Kind::Float),
                    )
                    .unwrap();
                    if on {
                        assert_eq!(
                            bits(&scored),
                            bits(&c.logprobs),
                            "{name}, T={}: completion {i}",
                            params.temperature
                        );
                    }
                    for (a, b) in scored.iter().zip(&c.logprobs) {
                        max_diff = max_diff.max((a - b).abs());
                    }
                }
                println!(
                    "{name}, mode {}, T={}: rollout vs engine log-probs max |Δ| {max_diff:e}",
                    if on { "on" } else { "off" },
                    params.temperature
                );
                assert!(max_diff < 1e-4, "{name}: {max_diff}");
            }
        }
    }
}

/// MoE router replay with the mode (issue 15 item 7): replaying the rollout's recorded experts in
/// the training forward gives the rollout's log-probs bit for bit.
#[test]
fn with_the_mode_router_replay_reproduces_rollout_log_probs_bit_for_bit() {
    let model =
        CausalLM::from_pretrained(&fixture("tiny-qwen3-moe"), &ModelOptions::default()).unwrap();
    model.set_batch_invariant(true);
    let vocab = model.config().vocab_size;
    let prompt = target(vocab).prompt;
    let completion = &model
        .generate(std::slice::from_ref(&prompt), &greedy(30), &[])
        .unwrap()[0];
    let seq: Vec<i64> = prompt
        .iter()
        .chain(&completion.response_ids)
        .copied()
        .collect();
    let len = seq.len() as i64;
    let (layers, k) = (
        model.sparse_layers(),
        model.config().moe.as_ref().unwrap().num_experts_per_tok,
    );
    // The last token is never fed back: give it the experts of the one before (never scored).
    let recorded = Tensor::from_slice(&completion.routed_experts).view([len - 1, layers, k]);
    let experts = Tensor::cat(&[&recorded, &recorded.narrow(0, len - 2, 1)], 0).unsqueeze(0);
    let ids = Tensor::from_slice(&seq).view([1, len]);
    let mask = ids.ones_like();
    let r = completion.response_ids.len() as i64;
    let scored = tch::no_grad(|| {
        let mut context = model.block_context(&ids, &mask).unwrap();
        context.replay_experts(&model, &experts).unwrap();
        let hidden = model.hidden_states_in(&context);
        model
            .response_scores_in(&hidden, &context, r, 1.0, ScoreOutputs::NONE)
            .unwrap()
            .log_probs
    });
    let scored = Vec::<f32>::try_from(scored.get(0)).unwrap();
    assert_eq!(bits(&scored), bits(&completion.logprobs));
}

/// The mode is a switch: turning it off restores the fast path's results exactly.
#[test]
fn switching_the_mode_off_restores_the_fast_path() {
    let model = load("tiny-qwen2");
    let vocab = model.config().vocab_size;
    let rows = others(5, vocab, 8);
    let refs: Vec<&Row> = rows.iter().collect();
    let (ids, mask, r) = verl_batch(&refs, (0, 0), vocab);
    let scores = |m: &CausalLM| {
        tch::no_grad(|| {
            m.response_scores(&ids, &mask, r, 1.0, ScoreOutputs::NONE)
                .unwrap()
                .log_probs
        })
    };
    let fast = scores(&model);
    model.set_batch_invariant(true);
    assert!(model.batch_invariant());
    let invariant = scores(&model);
    let diff = (&invariant - &fast).abs().max().double_value(&[]);
    assert!(diff < 1e-5, "the modes compute the same function: {diff}");
    model.set_batch_invariant(false);
    assert!(scores(&model).equal(&fast));
    assert!(
        model
            .generate(&[rows[0].prompt.clone()], &greedy(8), &[])
            .is_ok()
    );
}

/// The engine trains in the mode: the update's forward and backward (with and without activation
/// checkpointing, padded and packed) give the fast path's gradients within fp32 rounding, and
/// the forward's log-probs are the batch-invariant ones.
#[test]
fn the_mode_trains_with_the_fast_paths_gradients() {
    let mut model = load("tiny-llama");
    model.set_trainable(true);
    let model = model;
    let vocab = model.config().vocab_size;
    let rows = others(5, vocab, 9);
    let refs: Vec<&Row> = rows.iter().collect();
    let (ids, mask, r) = verl_batch(&refs, (2, 3), vocab);
    let gradients = |on: bool, checkpointed: bool, packed: bool| -> Vec<Tensor> {
        model.set_batch_invariant(on);
        let context = if packed {
            model.packed_block_context(&ids, &mask, r).unwrap()
        } else {
            model.block_context(&ids, &mask).unwrap()
        };
        let loss = |hidden: &Tensor| {
            Ok(model
                .response_scores_in(hidden, &context, r, 1.0, ScoreOutputs::NONE)?
                .log_probs
                .sum(Kind::Float))
        };
        if checkpointed {
            // The returned (detached) loss is not needed: the gradients are.
            let _ = model.backward_checkpointed_in(&context, loss).unwrap();
        } else {
            loss(&model.hidden_states_in(&context)).unwrap().backward();
        }
        model
            .named_tensors()
            .into_iter()
            .map(|(_, t)| {
                let g = t.grad().copy();
                let _ = t.grad().zero_();
                g
            })
            .collect()
    };
    for packed in [false, true] {
        let fast = gradients(false, false, packed);
        for checkpointed in [false, true] {
            let invariant = gradients(true, checkpointed, packed);
            for (a, b) in invariant.iter().zip(&fast) {
                let scale = b.abs().max().double_value(&[]).max(1e-3);
                let diff = (a - b).abs().max().double_value(&[]) / scale;
                assert!(
                    diff < 1e-4,
                    "packed {packed}, checkpointed {checkpointed}: {diff}"
                );
            }
        }
    }
}
