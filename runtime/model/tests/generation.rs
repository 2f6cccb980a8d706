//! Sampling behaviour of the KV-cache generator: reproducibility, n samples, top-k/top-p limits,
//! stop tokens, and log-probs that agree with the trainer's recomputation.

use tch::Tensor;
use verl_model::testing::{Padding, batch, expected, fixture, load, max_abs_diff, row};
use verl_model::{
    CausalLM, Completion, FinishReason, ModelConfig, ModelOptions, SamplingParams, ScoreOutputs,
};

fn prompts(name: &str) -> Vec<Vec<i64>> {
    expected(name).prompts.into_iter().map(|p| p.ids).collect()
}

fn sampling(seed: u64) -> SamplingParams {
    SamplingParams {
        n: 3,
        max_new_tokens: 12,
        temperature: 0.9,
        top_p: 0.95,
        top_k: 50,
        seed,
        ..Default::default()
    }
}

#[test]
fn sampling_is_seeded_and_reproducible() {
    let model = load("tiny-llama");
    let prompts = prompts("tiny-llama");
    let a = model.generate(&prompts, &sampling(7), &[]).unwrap();
    let b = model.generate(&prompts, &sampling(7), &[]).unwrap();
    let c = model.generate(&prompts, &sampling(8), &[]).unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!(a.len(), prompts.len() * 3);
    assert_eq!(
        a.iter().map(|c| c.prompt_index).collect::<Vec<_>>(),
        [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    );
    // The samples of one prompt differ from each other.
    assert!(a[0].response_ids != a[1].response_ids || a[1].response_ids != a[2].response_ids);
    // A sequence's samples do not depend on the rest of the batch.
    let alone = model.generate(&prompts[..1], &sampling(7), &[]).unwrap();
    assert_eq!(
        alone[..]
            .iter()
            .map(|c| &c.response_ids)
            .collect::<Vec<_>>(),
        a[..3].iter().map(|c| &c.response_ids).collect::<Vec<_>>()
    );
}

#[test]
fn sampled_log_probs_match_the_trainer_recomputation() {
    let model = load("tiny-qwen2");
    let prompts = prompts("tiny-qwen2");
    let params = SamplingParams {
        top_p: 1.0,
        top_k: -1,
        ..sampling(1)
    };
    let out = model.generate(&prompts, &params, &[]).unwrap();
    // verl's layout: left-padded prompts, right-padded responses; old log-probs at the same
    // temperature.
    let prompt_rows: Vec<Vec<i64>> = out
        .iter()
        .map(|c| prompts[c.prompt_index].clone())
        .collect();
    let responses: Vec<Vec<i64>> = out.iter().map(|c| c.response_ids.clone()).collect();
    let (p_ids, p_mask) = batch(&prompt_rows, Padding::Left);
    let (r_ids, r_mask) = batch(&responses, Padding::Right);
    let ids = Tensor::cat(&[p_ids, r_ids.shallow_clone()], 1);
    let mask = Tensor::cat(&[p_mask, r_mask], 1);
    let scores = model
        .response_scores(
            &ids,
            &mask,
            r_ids.size()[1],
            params.temperature,
            ScoreOutputs::NONE,
        )
        .unwrap();
    let mut worst = 0.0f64;
    for (k, c) in out.iter().enumerate() {
        let rollout: Vec<f64> = c.logprobs.iter().map(|&x| x as f64).collect();
        worst = worst.max(max_abs_diff(
            &row(&scores.log_probs, k as i64)[..rollout.len()],
            &rollout,
        ));
    }
    println!("rollout vs recomputed log-probs max |Δ| {worst:.2e}");
    assert!(worst < 1e-5, "{worst}");
}

/// On CPU, `generate` keeps a transposed copy of the weights between calls; a write to the
/// parameters (weight sync, an optimizer step) must reach the next call.
#[test]
fn generation_follows_weights_written_between_calls() {
    let prompts = prompts("tiny-llama");
    let config = ModelConfig::from_dir(&fixture("tiny-llama")).unwrap();
    let other = |seed| {
        let options = ModelOptions {
            seed,
            ..ModelOptions::default()
        };
        CausalLM::random(config.clone(), &options).unwrap()
    };
    let params = SamplingParams {
        max_new_tokens: 8,
        temperature: 0.0,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let model = load("tiny-llama");
    let before = model.generate(&prompts, &params, &[]).unwrap();
    // Weight sync: copied in.
    let synced = other(3);
    model.load_named_tensors(&synced.named_tensors()).unwrap();
    let after = model.generate(&prompts, &params, &[]).unwrap();
    assert_ne!(before, after);
    assert_eq!(after, synced.generate(&prompts, &params, &[]).unwrap());
    // An in-place update of one parameter, as an optimizer step makes.
    let scale_down_proj = |m: &CausalLM| {
        let (_, mut t) = m
            .named_tensors()
            .into_iter()
            .find(|(name, _)| name == "model.layers.0.mlp.down_proj.weight")
            .unwrap();
        tch::no_grad(|| {
            let _ = t.g_mul_scalar_(3.0);
        });
    };
    scale_down_proj(&model);
    scale_down_proj(&synced);
    let updated = model.generate(&prompts, &params, &[]).unwrap();
    assert_ne!(updated, after);
    assert_eq!(updated, synced.generate(&prompts, &params, &[]).unwrap());
}

#[test]
fn top_k_one_is_greedy_and_greedy_ignores_the_seed() {
    let model = load("tiny-llama");
    let prompts = prompts("tiny-llama");
    let greedy = |seed| SamplingParams {
        temperature: 0.0,
        n: 2,
        seed,
        ..sampling(0)
    };
    let g = model.generate(&prompts, &greedy(1), &[]).unwrap();
    assert_eq!(g, model.generate(&prompts, &greedy(2), &[]).unwrap());
    assert_eq!(g[0].response_ids, g[1].response_ids);
    let k1 = model
        .generate(
            &prompts,
            &SamplingParams {
                top_k: 1,
                n: 2,
                ..sampling(5)
            },
            &[],
        )
        .unwrap();
    for (a, b) in g.iter().zip(&k1) {
        assert_eq!(a.response_ids, b.response_ids);
    }
}

#[test]
fn tiny_top_p_keeps_only_the_most_likely_token() {
    let model = load("tiny-llama");
    let prompts = prompts("tiny-llama");
    let greedy = model
        .generate(
            &prompts,
            &SamplingParams {
                temperature: 0.0,
                n: 1,
                ..sampling(0)
            },
            &[],
        )
        .unwrap();
    let nucleus = model
        .generate(
            &prompts,
            &SamplingParams {
                top_p: 1e-6,
                top_k: -1,
                n: 1,
                ..sampling(3)
            },
            &[],
        )
        .unwrap();
    for (a, b) in greedy.iter().zip(&nucleus) {
        assert_eq!(a.response_ids, b.response_ids);
    }
}

#[test]
fn stops_on_eos_and_stop_tokens() {
    let model = load("tiny-llama");
    let prompts = prompts("tiny-llama");
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: 16,
        ..Default::default()
    };
    let free = model.generate(&prompts, &params, &[]).unwrap();
    assert!(
        free.iter()
            .all(|c| c.finish_reason == FinishReason::Length && c.response_ids.len() == 16)
    );
    // Make the third greedy token of prompt 0 an EOS id: that sequence stops there, keeping the
    // token; the others run to the limit unless they meet it too.
    let eos = free[0].response_ids[2];
    let stopped = model.generate(&prompts, &params, &[eos]).unwrap();
    check_stops(&free, &stopped, eos);
    let via_stop_ids = SamplingParams {
        stop_token_ids: vec![eos],
        ..params.clone()
    };
    assert_eq!(
        model.generate(&prompts, &via_stop_ids, &[]).unwrap(),
        stopped
    );
    // ignore_eos disables EOS ids but not stop_token_ids.
    let ignoring = SamplingParams {
        ignore_eos: true,
        ..params
    };
    assert_eq!(model.generate(&prompts, &ignoring, &[eos]).unwrap(), free);
    assert_eq!(
        serde_json::to_value(&stopped[0]).unwrap()["finish_reason"],
        serde_json::json!("stop"),
        "serialised as vLLM/SGLang name it"
    );
}

fn check_stops(free: &[Completion], stopped: &[Completion], eos: i64) {
    for (f, s) in free.iter().zip(stopped) {
        match f.response_ids.iter().position(|&t| t == eos) {
            Some(at) => {
                assert_eq!(s.response_ids, f.response_ids[..=at]);
                assert_eq!(s.logprobs, f.logprobs[..=at]);
                assert_eq!(s.finish_reason, FinishReason::Stop);
            }
            None => assert_eq!(s, f),
        }
    }
}

#[test]
fn rejects_bad_requests() {
    let model = load("tiny-llama");
    let ok = vec![vec![5i64, 6]];
    let err = |prompts: &[Vec<i64>], params: SamplingParams| {
        model
            .generate(prompts, &params, &[])
            .unwrap_err()
            .to_string()
    };
    assert!(err(&[vec![]], SamplingParams::default()).contains("prompts[0]"));
    assert!(err(&[vec![1, 320]], SamplingParams::default()).contains("prompts[0]"));
    assert!(
        err(
            &ok,
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            }
        )
        .contains("top_p")
    );
    assert!(
        err(
            &ok,
            SamplingParams {
                n: 0,
                ..Default::default()
            }
        )
        .contains("\"n\"")
    );
    assert!(
        err(
            &ok,
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            }
        )
        .contains("temperature")
    );
    assert!(
        err(
            &ok,
            SamplingParams {
                stop_token_ids: vec![999],
                ..Default::default()
            }
        )
        .contains("stop_token_ids")
    );
    let none = model
        .generate(
            &ok,
            &SamplingParams {
                max_new_tokens: 0,
                n: 2,
                ..Default::default()
            },
            &[],
        )
        .unwrap();
    assert!(none.len() == 2 && none.iter().all(|c| c.response_ids.is_empty()));
}
