//! The `native` rollout loaded from its built library and driven through the stable ABI, on
//! verl-model's committed fixtures (transformers' greedy continuations).

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{Value, json};
use verl_plugin_api::abi_stable::std_types::{ROption, RVec};
use verl_plugin_api::{
    Batch, ComponentInit, ComponentKind, EngineBox, ErrorKind, FinishReason, GenerateOutput,
    GenerateRequest, RolloutBox, RunContext, SamplingParams, Tensor, WeightBundle, keys,
};
use verl_testkit::{PluginHarness, built_plugin};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../model/fixtures")
        .join(name)
}

#[derive(Deserialize)]
struct Expected {
    temperature: f64,
    eos_token_ids: Vec<u32>,
    greedy: Vec<Greedy>,
}

#[derive(Deserialize)]
struct Greedy {
    prompt_ids: Vec<u32>,
    response_ids: Vec<u32>,
    logprobs: Vec<f32>,
}

fn expected(name: &str) -> Expected {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("expected.json")).unwrap())
        .unwrap()
}

fn init_for(config: &Value) -> ComponentInit {
    ComponentInit {
        config_json: config.to_string().into(),
        run: RunContext {
            device: "cpu".into(),
            world_size: 1,
            seed: 11,
            ..RunContext::default()
        },
    }
}

fn new_rollout() -> RolloutBox {
    let harness = PluginHarness::load_alone(built_plugin("verl_plugin_native"))
        .unwrap_or_else(|e| panic!("{e}"));
    harness.assert_registers(ComponentKind::ROLLOUT, "native", 100);
    harness
        .component(ComponentKind::ROLLOUT, "native")
        .create_rollout()
        .unwrap_or_else(|e| panic!("{e}"))
}

fn rollout_on(model: &str) -> RolloutBox {
    let mut rollout = new_rollout();
    // verl's rollout section carries many keys this backend ignores.
    let config = json!({"name": "native", "temperature": 1.0, "gpu_memory_utilization": 0.5, "model": {"path": fixture(model)}});
    rollout
        .init(&init_for(&config))
        .into_result()
        .unwrap_or_else(|e| panic!("init: {e}"));
    rollout
}

fn generate(
    rollout: &mut RolloutBox,
    prompts: &[Vec<u32>],
    sampling: SamplingParams,
) -> GenerateOutput {
    let request = GenerateRequest {
        prompts: prompts.iter().map(|p| RVec::from(p.clone())).collect(),
        sampling,
    };
    rollout
        .generate(&request)
        .into_result()
        .unwrap_or_else(|e| panic!("generate: {e}"))
}

fn greedy(max_new_tokens: u32) -> SamplingParams {
    SamplingParams {
        greedy: true,
        max_new_tokens,
        ..SamplingParams::default()
    }
}

/// Batched greedy decoding of prompts of different lengths equals transformers' one-at-a-time
/// greedy continuation; log-probs agree within 1e-5.
#[test]
fn greedy_matches_transformers() {
    for model in ["tiny-llama", "tiny-qwen2"] {
        let want = expected(model);
        let mut rollout = rollout_on(model);
        let prompts: Vec<Vec<u32>> = want.greedy.iter().map(|g| g.prompt_ids.clone()).collect();
        let max = want
            .greedy
            .iter()
            .map(|g| g.response_ids.len())
            .max()
            .unwrap() as u32;
        let out = generate(&mut rollout, &prompts, greedy(max));
        assert_eq!(out.completions.len(), prompts.len());
        assert_eq!(out.weight_version, ROption::RNone);
        for (c, g) in out.completions.iter().zip(&want.greedy) {
            let n = g.response_ids.len();
            assert_eq!(
                &c.response_ids[..n.min(c.response_ids.len())],
                &g.response_ids[..n.min(c.response_ids.len())],
                "{model}"
            );
            let stopped = c
                .response_ids
                .last()
                .is_some_and(|id| want.eos_token_ids.contains(id));
            assert_eq!(
                c.finish_reason,
                if stopped {
                    FinishReason::STOP
                } else {
                    FinishReason::LENGTH
                }
            );
            let diff = c
                .logprobs
                .iter()
                .zip(&g.logprobs)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(diff < 1e-5, "{model}: log-prob diff {diff}");
        }
    }
}

#[test]
fn seeded_sampling_is_reproducible() {
    let mut rollout = rollout_on("tiny-qwen2");
    let prompts = vec![
        expected("tiny-qwen2").greedy[0].prompt_ids.clone(),
        vec![5, 6, 7],
    ];
    let sampling = |seed| SamplingParams {
        n: 3,
        temperature: 0.9,
        top_p: 0.9,
        top_k: 50,
        max_new_tokens: 12,
        seed: ROption::RSome(seed),
        ..SamplingParams::default()
    };
    let a = generate(&mut rollout, &prompts, sampling(1));
    assert_eq!(a, generate(&mut rollout, &prompts, sampling(1)));
    assert_ne!(a, generate(&mut rollout, &prompts, sampling(2)));
    // n samples per prompt, grouped by prompt (verl's repeat_interleave order).
    let order: Vec<u32> = a.completions.iter().map(|c| c.prompt_index).collect();
    assert_eq!(order, [0, 0, 0, 1, 1, 1]);
    assert!(
        a.completions
            .iter()
            .all(|c| c.logprobs.len() == c.response_ids.len()
                && c.logprobs.iter().all(|l| *l <= 0.0))
    );
    // Without a seed successive calls differ, but a new rollout with the same run seed repeats them.
    let unseeded = SamplingParams {
        seed: ROption::RNone,
        ..sampling(0)
    };
    let first = generate(&mut rollout_on("tiny-qwen2"), &prompts, unseeded.clone());
    let mut again = rollout_on("tiny-qwen2");
    assert_eq!(first, generate(&mut again, &prompts, unseeded.clone()));
    assert_ne!(first, generate(&mut again, &prompts, unseeded));
}

#[test]
fn stop_tokens_and_length_limit_set_the_finish_reason() {
    let mut rollout = rollout_on("tiny-llama");
    let g = &expected("tiny-llama").greedy[0];
    // Stop on the third greedy token: the response ends with it.
    let stop = g.response_ids[2];
    let first = g.response_ids.iter().position(|&t| t == stop).unwrap();
    let out = generate(
        &mut rollout,
        std::slice::from_ref(&g.prompt_ids),
        SamplingParams {
            stop_token_ids: vec![stop].into(),
            ..greedy(16)
        },
    );
    let c = &out.completions[0];
    assert_eq!(
        (c.finish_reason, c.response_ids.as_slice()),
        (FinishReason::STOP, &g.response_ids[..=first])
    );
    let out = generate(&mut rollout, std::slice::from_ref(&g.prompt_ids), greedy(2));
    assert_eq!(
        (
            out.completions[0].finish_reason,
            out.completions[0].response_ids.len()
        ),
        (FinishReason::LENGTH, 2)
    );
}

fn engine(config: &Value) -> EngineBox {
    let harness = PluginHarness::load_alone(built_plugin("verl_plugin_fsdp"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut engine = harness
        .component(ComponentKind::ENGINE, "fsdp")
        .create_engine()
        .unwrap_or_else(|e| panic!("{e}"));
    engine
        .init(&init_for(config))
        .into_result()
        .unwrap_or_else(|e| panic!("engine init: {e}"));
    engine
}

/// Completions in verl's layout (left-padded prompts, right-padded responses), at `temperature`.
fn scoring_batch(prompts: &[Vec<u32>], out: &GenerateOutput, temperature: f64) -> Batch {
    let p = prompts.iter().map(Vec::len).max().unwrap();
    let r = out
        .completions
        .iter()
        .map(|c| c.response_ids.len())
        .max()
        .unwrap();
    let (mut ids, mut mask, mut responses) = (vec![], vec![], vec![]);
    for c in out.completions.iter() {
        let prompt = &prompts[c.prompt_index as usize];
        let (pad_p, pad_r) = (p - prompt.len(), r - c.response_ids.len());
        let row: Vec<i64> = prompt
            .iter()
            .chain(c.response_ids.iter())
            .map(|&t| i64::from(t))
            .collect();
        ids.extend(
            std::iter::repeat_n(0, pad_p)
                .chain(row.iter().copied())
                .chain(std::iter::repeat_n(0, pad_r)),
        );
        mask.extend(
            std::iter::repeat_n(0i64, pad_p)
                .chain(std::iter::repeat_n(1, row.len()))
                .chain(std::iter::repeat_n(0, pad_r)),
        );
        responses.extend(
            row[prompt.len()..]
                .iter()
                .copied()
                .chain(std::iter::repeat_n(0, pad_r)),
        );
    }
    let b = out.completions.len() as i64;
    let mut batch = Batch::default();
    batch.insert(
        keys::INPUT_IDS,
        Tensor::from_slice(&[b, (p + r) as i64], &ids).unwrap(),
    );
    batch.insert(
        keys::ATTENTION_MASK,
        Tensor::from_slice(&[b, (p + r) as i64], &mask).unwrap(),
    );
    batch.insert(
        keys::RESPONSES,
        Tensor::from_slice(&[b, r as i64], &responses).unwrap(),
    );
    batch.meta_json = json!({"temperature": temperature, "calculate_entropy": false})
        .to_string()
        .into();
    batch
}

/// Largest gap between the rollout's sampling log-probs and the engine's recomputed ones.
fn logprob_gap(
    engine: &mut EngineBox,
    prompts: &[Vec<u32>],
    out: &GenerateOutput,
    temperature: f64,
) -> f32 {
    let scored = engine
        .compute_log_prob(&scoring_batch(prompts, out, temperature))
        .into_result()
        .unwrap();
    let lp = scored.require(keys::LOG_PROBS).unwrap();
    let width = lp.shape[1] as usize;
    let lp = lp.to_vec::<f32>().unwrap();
    out.completions
        .iter()
        .enumerate()
        .flat_map(|(i, c)| {
            c.logprobs
                .iter()
                .zip(&lp[i * width..])
                .map(|(a, b)| (a - b).abs())
                .collect::<Vec<_>>()
        })
        .fold(0.0, f32::max)
}

/// Weight sync: after a training step the rollout disagrees with the engine; after
/// `export_weights` → `update_weights` its sampling log-probs equal the engine's recomputed ones
/// and outputs carry the weights' step.
#[test]
fn weight_sync_from_the_engine() {
    let model = "tiny-llama";
    let temperature = expected(model).temperature;
    let mut engine = engine(
        &json!({"role": "actor", "model": {"path": fixture(model)}, "optim": {"lr": 1e-2}, "ppo_mini_batch_size": 4}),
    );
    let mut rollout = rollout_on(model);
    let prompts: Vec<Vec<u32>> = expected(model)
        .greedy
        .iter()
        .map(|g| g.prompt_ids.clone())
        .collect();
    let sampling = SamplingParams {
        temperature: temperature as f32,
        max_new_tokens: 8,
        seed: ROption::RSome(3),
        ..SamplingParams::default()
    };

    // One SFT-style step on the rollout's own samples moves the engine away from the file.
    let out = generate(&mut rollout, &prompts, sampling.clone());
    let mut batch = scoring_batch(&prompts, &out, temperature);
    let old = engine
        .compute_log_prob(&batch)
        .into_result()
        .unwrap()
        .require(keys::LOG_PROBS)
        .unwrap()
        .clone();
    let response_mask: Vec<f32> = batch
        .require(keys::ATTENTION_MASK)
        .unwrap()
        .to_vec::<i64>()
        .unwrap()
        .chunks(batch.require(keys::INPUT_IDS).unwrap().shape[1] as usize)
        .flat_map(|row| {
            row[row.len() - old.shape[1] as usize..]
                .iter()
                .map(|&m| m as f32)
                .collect::<Vec<_>>()
        })
        .collect();
    batch.insert(
        keys::RESPONSE_MASK,
        Tensor::from_slice(&old.shape, &response_mask).unwrap(),
    );
    batch.insert(
        keys::ADVANTAGES,
        Tensor::from_slice(&old.shape, &response_mask).unwrap(),
    );
    batch.insert(keys::OLD_LOG_PROBS, old);
    engine.update_actor(&batch).into_result().unwrap();
    assert!(
        logprob_gap(&mut engine, &prompts, &out, temperature) > 1e-3,
        "the update must change log-probs"
    );

    let weights = engine.export_weights().into_result().unwrap();
    rollout
        .update_weights(&WeightBundle {
            tensors: weights,
            global_steps: ROption::RSome(3),
        })
        .into_result()
        .unwrap();
    let out = generate(&mut rollout, &prompts, sampling);
    assert_eq!(out.weight_version, ROption::RSome(3));
    let gap = logprob_gap(&mut engine, &prompts, &out, temperature);
    assert!(
        gap < 1e-5,
        "rollout and engine log-probs differ by {gap} after sync"
    );
}

#[test]
fn errors_name_the_problem() {
    let init_err = |config: Value| {
        new_rollout()
            .init(&init_for(&config))
            .into_result()
            .unwrap_err()
    };
    let err = init_err(json!({"ignore_eos": "yes", "model": {"path": fixture("tiny-llama")}}));
    assert_eq!(err.kind, ErrorKind::INVALID_CONFIG);
    assert!(err.message().contains("`ignore_eos`"), "{err}");
    let err = init_err(json!({"model": {"path": fixture("tiny-llama"), "dtype": "float8"}}));
    assert!(err.message().contains("`model.dtype`"), "{err}");
    assert!(init_err(json!({})).message().contains("model"));

    let request = GenerateRequest {
        prompts: vec![RVec::from(vec![1u32, 2])].into(),
        sampling: greedy(2),
    };
    assert!(
        new_rollout()
            .generate(&request)
            .into_result()
            .unwrap_err()
            .message()
            .contains("init")
    );
    let mut rollout = rollout_on("tiny-llama");
    let bad = GenerateRequest {
        prompts: vec![RVec::from(vec![100_000u32])].into(),
        sampling: greedy(2),
    };
    assert!(
        rollout
            .generate(&bad)
            .into_result()
            .unwrap_err()
            .message()
            .contains("prompts[0]")
    );
    let bundle = WeightBundle {
        tensors: vec![verl_plugin_api::NamedTensor::new(
            "model.nope.weight",
            Tensor::from_slice(&[1], &[0f32]).unwrap(),
        )]
        .into(),
        global_steps: ROption::RNone,
    };
    assert!(
        rollout
            .update_weights(&bundle)
            .into_result()
            .unwrap_err()
            .message()
            .contains("model.nope.weight")
    );
}
