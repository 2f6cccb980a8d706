//! The `native` rollout loaded from its built library and driven through the stable ABI, on
//! verl-model's committed fixtures (transformers' greedy continuations).
use serde::Deserialize;
use serde_json::{Value, json};
use verl_model::testing::fixture;
use verl_plugin_api::{
    Batch, ComponentInit, ComponentKind, ErrorKind, FinishReason, GenerateOutput, GenerateRequest,
    Handover, NamedTensor, RunContext, SamplingParams, Tensor, WeightSource, keys,
};
use verl_plugin_host::{EngineHandle, RolloutHandle};
use verl_testkit::{PluginHarness, built_plugin};

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
    let mut run = RunContext::default();
    run.seed = 11;
    ComponentInit::new(config.clone(), run)
}

fn new_rollout() -> RolloutHandle {
    let harness = PluginHarness::load_alone(built_plugin("verl_plugin_native"))
        .unwrap_or_else(|e| panic!("{e}"));
    harness.assert_registers(ComponentKind::ROLLOUT, "native", 100);
    harness
        .component(ComponentKind::ROLLOUT, "native")
        .create_rollout()
        .unwrap_or_else(|e| panic!("{e}"))
}

fn rollout_on(model: &str) -> RolloutHandle {
    let mut rollout = new_rollout();
    // verl's rollout section carries many keys this backend ignores.
    let config = json!({"name": "native", "temperature": 1.0, "gpu_memory_utilization": 0.5, "model": {"path": fixture(model)}});
    rollout
        .init(&init_for(&config))
        .unwrap_or_else(|e| panic!("init: {e}"));
    rollout
}

fn generate(
    rollout: &mut RolloutHandle,
    prompts: &[Vec<u32>],
    sampling: SamplingParams,
) -> GenerateOutput {
    let request = GenerateRequest::new(prompts.to_vec(), sampling);
    rollout
        .generate(&request)
        .unwrap_or_else(|e| panic!("generate: {e}"))
}

fn greedy(max_new_tokens: u32) -> SamplingParams {
    let mut sampling = SamplingParams::default();
    sampling.greedy = true;
    sampling.max_new_tokens = max_new_tokens;
    sampling
}

fn sampled(temperature: f32, max_new_tokens: u32, seed: Option<u64>) -> SamplingParams {
    let mut sampling = SamplingParams::default();
    sampling.temperature = temperature;
    sampling.max_new_tokens = max_new_tokens;
    sampling.seed = seed;
    sampling
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
        assert_eq!(out.weight_version, None);
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
                    FinishReason::Stop
                } else {
                    FinishReason::Length
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
    let sampling = |seed| {
        let mut s = sampled(0.9, 12, Some(seed));
        s.n = 3;
        s.top_p = 0.9;
        s.top_k = 50;
        s
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
    let mut unseeded = sampling(0);
    unseeded.seed = None;
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
    let out = generate(&mut rollout, std::slice::from_ref(&g.prompt_ids), {
        let mut s = greedy(16);
        s.stop_token_ids = vec![stop];
        s
    });
    let c = &out.completions[0];
    assert_eq!(
        (c.finish_reason, c.response_ids.as_slice()),
        (FinishReason::Stop, &g.response_ids[..=first])
    );
    let out = generate(&mut rollout, std::slice::from_ref(&g.prompt_ids), greedy(2));
    assert_eq!(
        (
            out.completions[0].finish_reason,
            out.completions[0].response_ids.len()
        ),
        (FinishReason::Length, 2)
    );
}

fn engine(config: &Value) -> EngineHandle {
    let harness = PluginHarness::load_alone(built_plugin("verl_plugin_fsdp"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut engine = harness
        .component(ComponentKind::ENGINE, "fsdp")
        .create_engine()
        .unwrap_or_else(|e| panic!("{e}"));
    engine
        .init(&init_for(config))
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
    engine: &mut EngineHandle,
    prompts: &[Vec<u32>],
    out: &GenerateOutput,
    temperature: f64,
) -> f32 {
    let scored = engine
        .compute_log_prob(&scoring_batch(prompts, out, temperature))
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

/// Weight sync: after a training step the rollout disagrees with the engine; after the engine
/// lends its weights to `update_weights` — in memory, or as a safetensors directory — the
/// rollout's sampling log-probs equal the engine's recomputed ones and outputs carry the version.
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
    let sampling = sampled(temperature as f32, 8, Some(3));

    // One SFT-style step on the rollout's own samples moves the engine away from the file.
    let out = generate(&mut rollout, &prompts, sampling.clone());
    let mut batch = scoring_batch(&prompts, &out, temperature);
    let old = engine
        .compute_log_prob(&batch)
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
    engine.update_actor(&batch).unwrap();
    assert!(
        logprob_gap(&mut engine, &prompts, &out, temperature) > 1e-3,
        "the update must change log-probs"
    );

    let views = engine.weights().unwrap();
    rollout
        .update_weights(&WeightSource::memory(3, &views))
        .unwrap();
    let owned: Vec<NamedTensor> = views.iter().map(|v| v.to_named()).collect();
    let out = generate(&mut rollout, &prompts, sampling.clone());
    assert_eq!(out.weight_version, Some(3));
    let gap = logprob_gap(&mut engine, &prompts, &out, temperature);
    assert!(
        gap < 1e-5,
        "rollout and engine log-probs differ by {gap} after sync"
    );

    // The same weights as a safetensors directory, on a fresh rollout.
    let dir = tempfile::tempdir().unwrap();
    let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|t| {
            let shape = t.tensor.shape.iter().map(|&d| d as usize).collect();
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                shape,
                &t.tensor.data,
            )
            .unwrap();
            (t.name.to_string(), view)
        })
        .collect();
    safetensors::serialize_to_file(tensors, None, &dir.path().join("model.safetensors")).unwrap();
    let mut from_disk = rollout_on(model);
    let handover = WeightSource::encode_handover(&Handover::file(dir.path().to_string_lossy()));
    from_disk
        .update_weights(&WeightSource::from_handover(4, &[], &handover))
        .unwrap();
    let out_disk = generate(&mut from_disk, &prompts, sampling);
    assert_eq!(out_disk.weight_version, Some(4));
    assert_eq!(out_disk.completions, out.completions);
}

#[test]
fn errors_name_the_problem() {
    let init_err = |config: Value| new_rollout().init(&init_for(&config)).unwrap_err();
    let err = init_err(json!({"ignore_eos": "yes", "model": {"path": fixture("tiny-llama")}}));
    assert_eq!(err.kind, ErrorKind::INVALID_CONFIG);
    assert!(err.message().contains("`ignore_eos`"), "{err}");
    let err = init_err(json!({"model": {"path": fixture("tiny-llama"), "dtype": "float8"}}));
    assert!(err.message().contains("`model.dtype`"), "{err}");
    assert!(init_err(json!({})).message().contains("model"));

    let request = GenerateRequest::new(vec![vec![1u32, 2]], greedy(2));
    assert!(
        new_rollout()
            .generate(&request)
            .unwrap_err()
            .message()
            .contains("init")
    );
    let mut rollout = rollout_on("tiny-llama");
    let bad = GenerateRequest::new(vec![vec![100_000u32]], greedy(2));
    assert!(
        rollout
            .generate(&bad)
            .unwrap_err()
            .message()
            .contains("prompts[0]")
    );
    let stray = [NamedTensor::new(
        "model.nope.weight",
        Tensor::from_slice(&[1], &[0f32]).unwrap(),
    )];
    let views: Vec<_> = stray.iter().map(NamedTensor::as_ref).collect();
    assert!(
        rollout
            .update_weights(&WeightSource::memory(1, &views))
            .unwrap_err()
            .message()
            .contains("model.nope.weight")
    );
    let missing = WeightSource::encode_handover(&Handover::file("/nonexistent/weights"));
    let err = rollout
        .update_weights(&WeightSource::from_handover(1, &[], &missing))
        .unwrap_err();
    assert!(err.message().contains("/nonexistent/weights"), "{err}");
}
