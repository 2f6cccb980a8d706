//! `cargo bench -p verl-plugin-fsdp --bench compute`
//!
//! One tiny, fixed config on 2 threads (`VERL_BENCH_THREADS` changes it): Llama, hidden 256,
//! intermediate 768, 4 layers, 4 heads, vocab 8192, fp32, batch 8, random weights (seed 0).
//! - generation: 8 prompts of 64 tokens, 64 new tokens each, greedy, no EOS stop — verl-model's
//!   batched KV-cache decoder, which is what the `native` rollout runs;
//! - training: forward + backward of the mean token NLL over 8 × 128 tokens — verl-model's
//!   forward and log-probs, which is what the `fsdp` engine runs; and the engine's whole
//!   `update_actor` (PPO loss, backward, clipping, AdamW) on the same tokens.
//!
//! When a Python with torch 2.13 and transformers is available (`VERL_REF_PYTHON`, default
//! `/work/.venv-ref/bin/python` when it exists), the same weights are saved to a temporary model
//! directory and the same work runs, in the same bench run, through HF transformers (`generate`,
//! and eager forward + backward of `model(ids, labels=ids).loss`, default SDPA attention, the same
//! thread count); the ratios are printed. Goals: generation ≥ 3× HF `generate`, training ≥ 1.0×.
//! Rust and Python repetitions alternate (one Python process, driven over stdin), so that load
//! from other processes on a shared machine hits both sides alike; figures are medians.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use common::{Driven, load_average, median, threads};
use serde_json::json;
use tch::{Kind, Tensor};
use verl_actor::{AdamW, AdamWConfig};
use verl_model::{CausalLM, ModelConfig, ModelOptions, Rng, SamplingParams, ScoreOutputs};
use verl_plugin_api::{Batch, ComponentInit, Engine, RunContext, keys};
use verl_plugin_fsdp::FsdpEngine;

const BATCH: i64 = 8;
const SEQ: i64 = 128;
const PROMPT: i64 = 64;
const NEW_TOKENS: usize = 64;
const VOCAB: i64 = 8192;
const REPS: usize = 7;

fn secs(run: impl FnOnce()) -> f64 {
    let start = Instant::now();
    run();
    start.elapsed().as_secs_f64()
}

fn token_ids(rng: &mut Rng, n: i64) -> Vec<i64> {
    // Ids ≥ 3 so that no special token appears.
    (0..n)
        .map(|_| 3 + (rng.next_u64() % (VOCAB as u64 - 3)) as i64)
        .collect()
}

fn write_model(dir: &Path) -> CausalLM {
    let config = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false, "initializer_range": 0.02,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let model = CausalLM::random(
        ModelConfig::from_dir(dir).unwrap(),
        &ModelOptions::default(),
    )
    .unwrap();
    model.save_pretrained(dir, None).unwrap();
    model
}

/// The `fsdp` engine (its rlib, the code the plugin runs) with a batch for `update_actor`.
fn engine_with_batch(dir: &Path, input: &Tensor) -> (FsdpEngine, Batch) {
    let mut engine = FsdpEngine::default();
    let config = json!({"role": "actor", "model": {"path": dir}, "ppo_mini_batch_size": BATCH});
    // One process on the CPU.
    let run = RunContext::default();
    engine.init(&ComponentInit::new(config, run)).unwrap();
    let tensor = |t: &Tensor| verl_model::interop::from_tch("t", t).unwrap();
    let response_len = SEQ - 1;
    let ones = Tensor::ones([BATCH, response_len], (Kind::Float, tch::Device::Cpu));
    let mut batch = Batch::default();
    batch.insert(keys::INPUT_IDS, tensor(input));
    batch.insert(keys::ATTENTION_MASK, tensor(&input.ones_like()));
    batch.insert(keys::RESPONSES, tensor(&input.narrow(1, 1, response_len)));
    batch.insert(keys::RESPONSE_MASK, tensor(&ones));
    batch.insert(keys::ADVANTAGES, tensor(&ones));
    let old = engine.compute_log_prob(&batch).unwrap();
    batch.insert(
        keys::OLD_LOG_PROBS,
        old.require(keys::LOG_PROBS).unwrap().clone(),
    );
    (engine, batch)
}

/// Loads the model once, then times one run of `generate` or `train` per line read from stdin.
const REFERENCE: &str = r#"
import json, sys, time, torch, transformers
torch.set_num_threads(int(sys.argv[2]))
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
model.generation_config.eos_token_id = None
data = json.load(open(sys.argv[3]))
prompts, ids, new = torch.tensor(data["prompts"]), torch.tensor(data["ids"]), data["new_tokens"]
def generate():
    model.eval()
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                             max_new_tokens=new, pad_token_id=0)
    assert out.shape[1] == prompts.shape[1] + new
def train():
    model.train()
    model.zero_grad(set_to_none=False)
    model(ids, labels=ids).loss.backward()
work = {"generate": generate, "train": train}
print("ready", flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    work[line.strip()]()
    print(time.perf_counter() - start, flush=True)
"#;

/// The reference process: one timed run per request.
struct Reference(Driven);

impl Reference {
    fn start(
        python: &Path,
        dir: &Path,
        threads: i32,
        prompts: &[Vec<i64>],
        ids: &[i64],
    ) -> Result<Self, String> {
        let script = dir.join("reference.py");
        let data = dir.join("inputs.json");
        let rows: Vec<&[i64]> = ids.chunks(SEQ as usize).collect();
        let inputs = json!({"prompts": prompts, "ids": rows, "new_tokens": NEW_TOKENS});
        std::fs::write(&script, REFERENCE).map_err(|e| e.to_string())?;
        std::fs::write(&data, inputs.to_string()).map_err(|e| e.to_string())?;
        let mut command = Command::new(python);
        command
            .arg(&script)
            .arg(dir)
            .arg(threads.to_string())
            .arg(&data)
            .env("OMP_NUM_THREADS", threads.to_string());
        Driven::start(command).map(Self)
    }

    fn time(&mut self, work: &str) -> Result<f64, String> {
        let line = self.0.ask(work)?;
        line.parse()
            .map_err(|_| format!("unexpected output {line:?}"))
    }
}

fn reference_python() -> Option<PathBuf> {
    match std::env::var_os("VERL_REF_PYTHON") {
        Some(p) => Some(PathBuf::from(p)),
        None => Some(PathBuf::from("/work/.venv-ref/bin/python")).filter(|p| p.exists()),
    }
}

/// Median seconds of `rust` and (when there is a reference) of the reference's `work`, one
/// warm-up each, repetitions alternating.
fn measure(
    reference: &mut Option<Reference>,
    work: &str,
    mut rust: impl FnMut(),
) -> Result<(f64, Option<f64>), String> {
    rust();
    if let Some(r) = reference {
        r.time(work)?;
    }
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..REPS {
        ours.push(secs(&mut rust));
        if let Some(r) = reference {
            theirs.push(r.time(work)?);
        }
    }
    Ok((median(ours), (!theirs.is_empty()).then(|| median(theirs))))
}

fn report(what: &str, goal: f64, tokens: f64, (ours, theirs): (f64, Option<f64>)) {
    print!("{what:<11} ours {:>7.0} tokens/s", tokens / ours);
    match theirs {
        Some(theirs) => println!(
            " | HF {:>7.0} tokens/s | ratio {:.2}x (goal >= {goal})",
            tokens / theirs,
            theirs / ours
        ),
        None => println!(),
    }
}

fn main() {
    let threads = threads();
    tch::set_num_threads(threads);
    let dir = tempfile::tempdir().unwrap();
    let model = write_model(dir.path());
    let mut rng = Rng::new(0);
    let prompts: Vec<Vec<i64>> = (0..BATCH).map(|_| token_ids(&mut rng, PROMPT)).collect();
    let ids = token_ids(&mut rng, BATCH * SEQ);
    println!(
        "config: Llama hidden 256, intermediate 768, 4 layers, 4 heads, vocab {VOCAB}, fp32, {threads} threads"
    );
    println!(
        "generation: {BATCH} prompts x {PROMPT} tokens + {NEW_TOKENS} new (greedy); training: {BATCH} x {SEQ} tokens"
    );
    println!("load average before: {}", load_average());

    let mut reference = match reference_python() {
        None => {
            println!(
                "reference: not available (set VERL_REF_PYTHON to a Python with torch 2.13 + transformers)"
            );
            None
        }
        Some(python) => match Reference::start(&python, dir.path(), threads, &prompts, &ids) {
            Ok(r) => Some(r),
            Err(e) => {
                println!("reference: {} failed, not available: {e}", python.display());
                None
            }
        },
    };

    let params = SamplingParams {
        max_new_tokens: NEW_TOKENS,
        temperature: 0.0,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let generate = || {
        let out = model.generate(&prompts, &params, &[]).unwrap();
        assert!(out.iter().all(|c| c.response_ids.len() == NEW_TOKENS));
    };
    let input = Tensor::from_slice(&ids).view([BATCH, SEQ]);
    let mask = input.ones_like();
    let grads = AdamW::for_model(&model, AdamWConfig::default());
    let train = || {
        grads.zero_grad();
        let scores = model
            .response_scores(&input, &mask, SEQ - 1, 1.0, ScoreOutputs::NONE)
            .unwrap();
        scores.log_probs.mean(Kind::Float).neg().backward();
    };
    let generated = (BATCH as usize * NEW_TOKENS) as f64;
    let trained = (BATCH * SEQ) as f64;
    let result = measure(&mut reference, "generate", generate)
        .map(|g| report("generation", 3.0, generated, g))
        .and_then(|()| measure(&mut reference, "train", train))
        .map(|t| report("fwd+bwd", 1.0, trained, t));
    if let Err(e) = result {
        println!("reference failed: {e}");
    }
    let (mut engine, batch) = engine_with_batch(dir.path(), &input);
    let (update, _) = measure(&mut None, "", || {
        engine.update_actor(&batch).unwrap();
    })
    .expect("no reference");
    report("update_actor", 0.0, trained, (update, None));
    println!("load average after:  {}", load_average());
}
