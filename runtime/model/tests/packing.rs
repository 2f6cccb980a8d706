//! Packed (THD) batches, verl's `use_remove_padding`, against the padded forward pass on the
//! same weights: log-probs, entropy, values and parameter gradients within 1e-5 on the Qwen2
//! fixture (q/k/v biases, tied embeddings) and the Llama one (grouped-query attention), for
//! verl's layout (left-padded prompts, right-padded responses) with prompt and response lengths
//! of 1, odd, even, empty responses, and right-padded whole sequences. Likewise passes whose last
//! layer runs at the response predictors only, padded and packed, against full passes; and
//! packed passes sharing each GRPO group's prompt (verl's `use_prefix_grouper`) against padded
//! ones, whole, predictor-only and checkpointed.

use tch::{Kind, Tensor};
use verl_model::testing::{MODELS, fixture, load};
use verl_model::{BlockContext, CausalLM, Head, ModelOptions, ResponseScores, Rng, ScoreOutputs};

const TOLERANCE: f64 = 1e-5;

/// `(input_ids, attention_mask, response_len)`: each row a prompt of `prompts[i]` tokens,
/// left-padded to the longest, then a response of `responses[i]` tokens, right-padded.
fn verl_batch(prompts: &[i64], responses: &[i64], vocab: i64, seed: u64) -> (Tensor, Tensor, i64) {
    let (p, r) = (
        *prompts.iter().max().unwrap(),
        *responses.iter().max().unwrap(),
    );
    let mut rng = Rng::new(seed);
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for (&pl, &rl) in prompts.iter().zip(responses) {
        for c in 0..p + r {
            let real = (c >= p - pl && c < p) || (c >= p && c < p + rl);
            // Padding holds arbitrary ids: they must not matter.
            ids.push((rng.next_u64() % vocab as u64) as i64);
            mask.push(i64::from(real));
        }
    }
    let shape = [prompts.len() as i64, p + r];
    (
        Tensor::from_slice(&ids).view(shape),
        Tensor::from_slice(&mask).view(shape),
        r,
    )
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

/// The batches the tests run: lengths 1, odd and even, an empty response, mixed.
fn batches(vocab: i64) -> Vec<(Tensor, Tensor, i64)> {
    vec![
        verl_batch(&[1, 5, 3, 8], &[1, 7, 4, 0], vocab, 1),
        verl_batch(&[6, 1, 2], &[3, 1, 9], vocab, 2),
        verl_batch(&[1], &[1], vocab, 3),
    ]
}

const ALL: ScoreOutputs = ScoreOutputs {
    entropy: true,
    sum_pi_squared: true,
};

fn packed_scores(model: &CausalLM, ids: &Tensor, mask: &Tensor, r: i64, t: f64) -> ResponseScores {
    let context = model.packed_block_context(ids, mask, r).unwrap();
    let hidden = model.hidden_states_in(&context);
    model
        .response_scores_in(&hidden, &context, r, t, ALL)
        .unwrap()
}

/// The largest difference of log-probs, entropy and Σπ² between two scorings.
fn max_scores_diff(a: &ResponseScores, b: &ResponseScores) -> f64 {
    let lp = max_diff(&a.log_probs, &b.log_probs);
    let h = max_diff(a.entropy.as_ref().unwrap(), b.entropy.as_ref().unwrap());
    let spp = max_diff(
        a.sum_pi_squared.as_ref().unwrap(),
        b.sum_pi_squared.as_ref().unwrap(),
    );
    lp.max(h).max(spp)
}

#[test]
fn packed_log_probs_entropy_and_sum_pi_squared_equal_padded() {
    for name in MODELS {
        let model = load(name);
        let vocab = model.config().vocab_size;
        for (ids, mask, r) in batches(vocab) {
            tch::no_grad(|| {
                for temperature in [1.0, 0.7] {
                    let padded = model
                        .response_scores(&ids, &mask, r, temperature, ALL)
                        .unwrap();
                    let packed = packed_scores(&model, &ids, &mask, r, temperature);
                    let diff = max_scores_diff(&packed, &padded);
                    assert!(diff <= TOLERANCE, "{name}: {diff}");
                    // Scored positions are real, and padding scores zero in both.
                    let zero = mask.narrow(1, mask.size()[1] - r, r).eq(0);
                    for t in [&packed.log_probs, packed.sum_pi_squared.as_ref().unwrap()] {
                        assert!(
                            t.masked_select(&zero)
                                .abs()
                                .sum(Kind::Float)
                                .double_value(&[])
                                == 0.0
                        );
                    }
                }
            });
        }
    }
}

#[test]
fn packed_stream_holds_only_real_tokens() {
    let model = load("tiny-qwen2");
    let (ids, mask, r) = verl_batch(&[1, 5, 3, 8], &[1, 7, 4, 0], 320, 1);
    let context = model.packed_block_context(&ids, &mask, r).unwrap();
    let real = mask.sum(Kind::Int64).int64_value(&[]);
    assert_eq!(context.input_ids().size(), [1, real]);
    assert_eq!(context.packing().unwrap().cu_seqlens(), [0, 2, 14, 21, 29]);
    let expected: Vec<i64> = ids.masked_select(&mask.ne(0)).try_into().unwrap();
    let packed: Vec<i64> = context.input_ids().reshape([-1]).try_into().unwrap();
    assert_eq!(packed, expected);
}

#[test]
fn right_padded_sequences_pack_too() {
    // Whole sequences right-padded (no left padding), scoring the last columns.
    let model = load("tiny-llama");
    let (ids, mask, _) = verl_batch(&[9, 9, 9], &[2, 5, 1], 320, 4);
    tch::no_grad(|| {
        let padded = model.response_scores(&ids, &mask, 5, 1.0, ALL).unwrap();
        let packed = packed_scores(&model, &ids, &mask, 5, 1.0);
        assert!(max_scores_diff(&packed, &padded) <= TOLERANCE);
    });
}

/// The fixture `name` with a value head (seeded).
fn critic(name: &str) -> CausalLM {
    let options = ModelOptions {
        head: Head::Value,
        seed: 7,
        ..ModelOptions::default()
    };
    CausalLM::from_pretrained(&fixture(name), &options).unwrap()
}

#[test]
fn packed_values_equal_padded() {
    for name in MODELS {
        let critic = critic(name);
        for (ids, mask, r) in batches(critic.config().vocab_size) {
            tch::no_grad(|| {
                let padded = critic.response_values(&ids, &mask, r).unwrap();
                let context = critic.packed_block_context(&ids, &mask, r).unwrap();
                let hidden = critic.hidden_states_in(&context);
                let packed = critic.response_values_in(&hidden, &context, r).unwrap();
                assert!(max_diff(&packed, &padded) <= TOLERANCE, "{name}");
            });
        }
    }
}

/// The gradient of a weighted sum of log-probs and entropy with respect to every parameter.
fn gradients(model: &CausalLM, loss: Tensor) -> Vec<(String, Tensor)> {
    for (_, p) in model.named_tensors() {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    loss.backward();
    model
        .named_tensors()
        .into_iter()
        .map(|(n, p)| (n, p.grad().copy()))
        .collect()
}

#[test]
fn packed_gradients_equal_padded_with_and_without_checkpointing() {
    for name in MODELS {
        let model = load(name);
        let (ids, mask, r) = verl_batch(&[1, 5, 3, 8], &[1, 7, 4, 0], 320, 5);
        tch::manual_seed(0);
        let weights = Tensor::randn([4, r], (Kind::Float, tch::Device::Cpu));
        let loss_of = |lp: &Tensor, h: &Tensor| (lp * &weights + h * 0.1).sum(Kind::Float);
        let padded = {
            let s = model
                .response_scores(&ids, &mask, r, 0.7, ScoreOutputs::ENTROPY)
                .unwrap();
            gradients(&model, loss_of(&s.log_probs, s.entropy.as_ref().unwrap()))
        };
        let packed = {
            let s = packed_scores(&model, &ids, &mask, r, 0.7);
            gradients(&model, loss_of(&s.log_probs, s.entropy.as_ref().unwrap()))
        };
        let checkpointed = {
            let context = model.packed_block_context(&ids, &mask, r).unwrap();
            for (_, p) in model.named_tensors() {
                let _ = p.grad().zero_();
            }
            let _ = model
                .backward_checkpointed_in(&context, |hidden| {
                    let s = model.response_scores_in(
                        hidden,
                        &context,
                        r,
                        0.7,
                        ScoreOutputs::ENTROPY,
                    )?;
                    Ok(loss_of(&s.log_probs, s.entropy.as_ref().unwrap()))
                })
                .unwrap();
            model
                .named_tensors()
                .into_iter()
                .map(|(n, p)| (n, p.grad().copy()))
                .collect::<Vec<_>>()
        };
        for ((n, a), ((_, b), (_, c))) in padded.iter().zip(packed.iter().zip(&checkpointed)) {
            let scale = a.abs().max().double_value(&[]).max(1.0);
            let (d1, d2) = (max_diff(a, b) / scale, max_diff(a, c) / scale);
            assert!(d1 <= TOLERANCE && d2 <= TOLERANCE, "{name} {n}: {d1} {d2}");
        }
    }
}

/// Every parameter's gradient now (zero where none).
fn current_gradients(model: &CausalLM) -> Vec<(String, Tensor)> {
    model
        .named_tensors()
        .into_iter()
        .map(|(n, p)| {
            let g = p.grad();
            (
                n,
                if g.defined() {
                    g.copy()
                } else {
                    p.zeros_like()
                },
            )
        })
        .collect()
}

/// Each parameter's largest gradient difference, relative to its largest gradient (at least 1).
fn max_gradient_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> (f64, String) {
    a.iter()
        .zip(b)
        .map(|((n, x), (_, y))| {
            let scale = x.abs().max().double_value(&[]).max(1.0);
            (max_diff(x, y) / scale, n.clone())
        })
        .fold((0.0, String::new()), |m, d| if d.0 > m.0 { d } else { m })
}

/// The block context of a batch, padded or packed, with the last layer at the predictors only
/// when `tail`.
fn context_of(
    model: &CausalLM,
    (ids, mask, r): (&Tensor, &Tensor, i64),
    packed: bool,
    tail: bool,
) -> BlockContext {
    let mut context = if packed {
        model.packed_block_context(ids, mask, r).unwrap()
    } else {
        model.block_context(ids, mask).unwrap()
    };
    if tail {
        assert!(context.score_predictors_only(model, r).unwrap());
    }
    context
}

/// A loss over all three scores: the log-probs weighted at random (seeded), entropy and Σπ².
fn weighted_loss(rows: i64, r: i64, seed: i64) -> impl Fn(&ResponseScores) -> Tensor {
    tch::manual_seed(seed);
    let weights = Tensor::randn([rows, r], (Kind::Float, tch::Device::Cpu));
    move |s: &ResponseScores| {
        (&s.log_probs * &weights
            + s.entropy.as_ref().unwrap() * 0.1
            + s.sum_pi_squared.as_ref().unwrap() * 0.01)
            .sum(Kind::Float)
    }
}

/// A pass over `context` against the reference's scores and `loss_of` gradients (`want`): the
/// scores, the gradients, and the gradients recomputed under activation checkpointing, each
/// within [`TOLERANCE`].
fn assert_pass_matches(
    model: &CausalLM,
    context: &BlockContext,
    loss_of: &dyn Fn(&ResponseScores) -> Tensor,
    (want, want_grads): (&ResponseScores, &[(String, Tensor)]),
    label: &str,
) {
    let r = want.log_probs.size()[1];
    let scores = model
        .response_scores_in(&model.hidden_states_in(context), context, r, 0.7, ALL)
        .unwrap();
    let diff = max_scores_diff(&scores, want);
    assert!(diff <= TOLERANCE, "{label}: {diff}");
    let (d, n) = max_gradient_diff(want_grads, &gradients(model, loss_of(&scores)));
    assert!(d <= TOLERANCE, "{label} {n}: {d}");
    for (_, p) in model.named_tensors() {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    let _ = model
        .backward_checkpointed_in(context, |hidden| {
            Ok(loss_of(
                &model.response_scores_in(hidden, context, r, 0.7, ALL)?,
            ))
        })
        .unwrap();
    let (d, n) = max_gradient_diff(want_grads, &current_gradients(model));
    assert!(d <= TOLERANCE, "{label} checkpointed {n}: {d}");
}

#[test]
fn predictor_only_passes_equal_full_ones() {
    for name in MODELS {
        let model = load(name);
        let hidden_size = model.config().hidden_size;
        for (i, (ids, mask, r)) in batches(model.config().vocab_size).into_iter().enumerate() {
            let batch = (&ids, &mask, r);
            let loss_of = weighted_loss(ids.size()[0], r, i as i64);
            for packed in [false, true] {
                let full_context = context_of(&model, batch, packed, false);
                let full = model
                    .response_scores_in(
                        &model.hidden_states_in(&full_context),
                        &full_context,
                        r,
                        0.7,
                        ALL,
                    )
                    .unwrap();
                let full_grads = gradients(&model, loss_of(&full));

                let context = context_of(&model, batch, packed, true);
                let hidden = model.hidden_states_in(&context);
                // Only the predictors' states: padded the last R + 1 columns but the last, packed
                // one per scored response token.
                let scored = mask.narrow(1, mask.size()[1] - r, r).sum(Kind::Int64);
                let want = if packed {
                    vec![1, scored.int64_value(&[]), hidden_size]
                } else {
                    vec![ids.size()[0], r, hidden_size]
                };
                assert_eq!(hidden.size(), want, "{name} batch {i} packed {packed}");
                let label = format!("{name} batch {i} packed {packed}");
                assert_pass_matches(&model, &context, &loss_of, (&full, &full_grads), &label);
            }
        }
    }
}

#[test]
fn predictor_only_values_equal_full_ones() {
    for name in MODELS {
        let critic = critic(name);
        for (ids, mask, r) in batches(critic.config().vocab_size) {
            for packed in [false, true] {
                tch::no_grad(|| {
                    let values = |tail: bool| {
                        let context = context_of(&critic, (&ids, &mask, r), packed, tail);
                        let hidden = critic.hidden_states_in(&context);
                        critic.response_values_in(&hidden, &context, r).unwrap()
                    };
                    let diff = max_diff(&values(true), &values(false));
                    assert!(diff <= TOLERANCE, "{name} packed {packed}: {diff}");
                });
            }
        }
    }
}

#[test]
fn full_hidden_states_after_a_predictor_only_context_are_refused() {
    // A predictor-only context reads its hidden states as the predictors': a full pass's are the
    // wrong shape, and say so instead of scoring the wrong positions.
    let model = load("tiny-llama");
    let (ids, mask, r) = verl_batch(&[3, 5], &[4, 2], 320, 8);
    for packed in [false, true] {
        let full = context_of(&model, (&ids, &mask, r), packed, false);
        let hidden = tch::no_grad(|| model.hidden_states_in(&full));
        let tail = context_of(&model, (&ids, &mask, r), packed, true);
        let e = model
            .response_scores_in(&hidden, &tail, r, 1.0, ScoreOutputs::NONE)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden"), "{e}");
    }
}

#[test]
fn the_deterministic_mode_keeps_every_token_in_the_last_layer() {
    let model = load("tiny-qwen2");
    model.set_batch_invariant(true);
    let (ids, mask, r) = verl_batch(&[3, 5], &[4, 2], 320, 9);
    for packed in [false, true] {
        let mut context = context_of(&model, (&ids, &mask, r), packed, false);
        assert!(!context.score_predictors_only(&model, r).unwrap());
    }
}

#[test]
fn a_mismatched_response_length_is_an_error() {
    let model = load("tiny-qwen2");
    let (ids, mask, r) = verl_batch(&[2, 3], &[2, 1], 320, 6);
    let context = model.packed_block_context(&ids, &mask, r).unwrap();
    let hidden = tch::no_grad(|| model.hidden_states_in(&context));
    let e = model
        .response_scores_in(&hidden, &context, r - 1, 1.0, ScoreOutputs::NONE)
        .unwrap_err()
        .to_string();
    assert!(e.contains("response_len"), "{e}");
    let Err(e) = model.packed_block_context(&ids, &mask, 5) else {
        panic!("a response as long as the sequence is refused");
    };
    let e = e.to_string();
    assert!(e.contains("response_len"), "{e}");
}

/// A GRPO batch: `prompts[g]` tokens for each group `g`, each prompt repeated in `responses[g]`
/// rows (one per sample, of that many response tokens), the groups' rows interleaved (row `i`
/// of every group, then row `i + 1`), in verl's layout. Group `g + 1`'s prompt extends group
/// `g`'s when `nested` (an equal prefix is not an equal prompt).
fn grouped_batch(
    prompts: &[i64],
    responses: &[&[i64]],
    nested: bool,
    vocab: i64,
    seed: u64,
) -> (Tensor, Tensor, i64) {
    let mut rng = Rng::new(seed);
    let mut token = || (rng.next_u64() % vocab as u64) as i64;
    let mut tokens: Vec<Vec<i64>> = Vec::new();
    for (g, &len) in prompts.iter().enumerate() {
        let mut prompt: Vec<i64> = if nested && g > 0 {
            tokens[g - 1].clone()
        } else {
            Vec::new()
        };
        prompt.truncate(len as usize);
        while (prompt.len() as i64) < len {
            prompt.push(token());
        }
        tokens.push(prompt);
    }
    let width = *prompts.iter().max().unwrap();
    let r = responses
        .iter()
        .flat_map(|g| g.iter())
        .copied()
        .max()
        .unwrap();
    let samples = responses.iter().map(|g| g.len()).max().unwrap();
    let (mut ids, mut mask, mut rows) = (Vec::new(), Vec::new(), 0);
    for i in 0..samples {
        for (prompt, lens) in tokens.iter().zip(responses) {
            let Some(&rl) = lens.get(i) else { continue };
            let pad = width - prompt.len() as i64;
            for c in 0..width + r {
                let (id, real) = if c < pad {
                    (token(), false)
                } else if c < width {
                    (prompt[(c - pad) as usize], true)
                } else {
                    (token(), c < width + rl)
                };
                ids.push(id);
                mask.push(i64::from(real));
            }
            rows += 1;
        }
    }
    let shape = [rows, width + r];
    (
        Tensor::from_slice(&ids).view(shape),
        Tensor::from_slice(&mask).view(shape),
        r,
    )
}

/// GRPO batches: groups of 4, 3 and 1 sample with response lengths 0, 1, odd and even; nested
/// prompts; a prompt of one token.
fn grouped_batches(vocab: i64) -> Vec<((Tensor, Tensor, i64), usize)> {
    vec![
        (
            grouped_batch(
                &[5, 8, 3],
                &[&[4, 1, 6, 6], &[2, 0, 7], &[5]],
                false,
                vocab,
                11,
            ),
            5,
        ),
        (
            grouped_batch(&[4, 6], &[&[3, 3], &[1, 5]], true, vocab, 12),
            2,
        ),
        (grouped_batch(&[1], &[&[2, 3, 1]], false, vocab, 13), 2),
    ]
}

/// A packed context sharing prompts, with the last layer at the predictors only when `tail`.
fn sharing_context(
    model: &CausalLM,
    (ids, mask, r): (&Tensor, &Tensor, i64),
    tail: bool,
) -> BlockContext {
    let mut context = model.prompt_sharing_block_context(ids, mask, r).unwrap();
    if tail {
        assert!(context.score_predictors_only(model, r).unwrap());
    }
    context
}

#[test]
fn shared_prompt_passes_equal_padded_ones() {
    for name in MODELS {
        let model = load(name);
        for (i, ((ids, mask, r), sharing)) in grouped_batches(model.config().vocab_size)
            .into_iter()
            .enumerate()
        {
            let batch = (&ids, &mask, r);
            let loss_of = weighted_loss(ids.size()[0], r, i as i64);
            let padded = model.response_scores(&ids, &mask, r, 0.7, ALL).unwrap();
            let padded_grads = gradients(&model, loss_of(&padded));
            for tail in [false, true] {
                let context = sharing_context(&model, batch, tail);
                let packing = context.packing().unwrap();
                assert_eq!(packing.rows_sharing_a_prompt(), sharing, "{name} batch {i}");
                let unshared = model.packed_block_context(&ids, &mask, r).unwrap();
                assert!(packing.len() < unshared.packing().unwrap().len());
                let label = format!("{name} batch {i} tail {tail}");
                assert_pass_matches(&model, &context, &loss_of, (&padded, &padded_grads), &label);
            }
        }
    }
}

#[test]
fn shared_prompt_values_equal_padded_ones() {
    for name in MODELS {
        let critic = critic(name);
        for ((ids, mask, r), _) in grouped_batches(critic.config().vocab_size) {
            tch::no_grad(|| {
                let padded = critic.response_values(&ids, &mask, r).unwrap();
                for tail in [false, true] {
                    let context = sharing_context(&critic, (&ids, &mask, r), tail);
                    let hidden = critic.hidden_states_in(&context);
                    let shared = critic.response_values_in(&hidden, &context, r).unwrap();
                    let diff = max_diff(&shared, &padded);
                    assert!(diff <= TOLERANCE, "{name} tail {tail}: {diff}");
                }
            });
        }
    }
}

#[test]
fn the_deterministic_mode_does_not_share_prompts() {
    let model = load("tiny-qwen2");
    model.set_batch_invariant(true);
    let ((ids, mask, r), _) = grouped_batches(320).remove(0);
    let Err(e) = model.prompt_sharing_block_context(&ids, &mask, r) else {
        panic!("shared prompts in the deterministic mode");
    };
    assert!(e.to_string().contains("use_prefix_grouper"), "{e}");
}
