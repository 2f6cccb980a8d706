//! `cargo bench -p verl-plugin-fsdp --bench packing`
//!
//! Padded vs packed (`use_remove_padding`) batches through the `fsdp` engine (its rlib, the code
//! the plugin runs): `compute_log_prob` and `update_actor` (PPO loss, backward, clipping, AdamW)
//! on the same GRPO-shaped batch with mixed lengths — 32 rows (8 prompts × n = 4), prompts of
//! 8–64 tokens left-padded to 64, responses of 1–32 tokens right-padded to 32 — on issue 14's
//! model: a random Qwen2, hidden 256, 4 layers, 4 heads / 2 key-value heads, vocab 512, q/k/v
//! biases, fp32, 2 threads (`VERL_BENCH_THREADS` changes it; `VERL_BENCH_REPS` the 7
//! repetitions). Throughput counts real tokens
//! (the padding is not work). The two engines alternate, so that load from other processes on
//! a shared machine hits both alike; figures are medians. Before timing, the packed log-probs
//! are checked against the padded ones.

mod common;

use std::path::Path;
use std::time::Instant;

use common::{ISSUE14_VOCAB as VOCAB, load_average, median, threads, write_issue14_model};
use serde_json::json;
use tch::{Kind, Tensor};
use verl_model::Rng;
use verl_model::interop::{from_tch, to_tch};
use verl_plugin_api::{Batch, ComponentInit, Engine, RunContext, keys};
use verl_plugin_fsdp::FsdpEngine;

const ROWS: i64 = 32;
const PROMPT: i64 = 64;
const RESPONSE: i64 = 32;
const REPS: usize = 7;

/// The GRPO batch: row `i`'s prompt (shared by its group of 4) and response lengths drawn from
/// the seed. Returns it with its number of real tokens.
fn grpo_batch() -> (Batch, i64) {
    let mut rng = Rng::new(11);
    let width = PROMPT + RESPONSE;
    let (mut ids, mut mask, mut response_mask) = (Vec::new(), Vec::new(), Vec::new());
    let mut prompt = 0;
    for i in 0..ROWS {
        if i % 4 == 0 {
            prompt = 8 + (rng.next_u64() % (PROMPT as u64 - 7)) as i64;
        }
        let response = 1 + (rng.next_u64() % RESPONSE as u64) as i64;
        for c in 0..width {
            let real =
                (c >= PROMPT - prompt && c < PROMPT) || (c >= PROMPT && c < PROMPT + response);
            ids.push(3 + (rng.next_u64() % (VOCAB as u64 - 3)) as i64);
            mask.push(i64::from(real));
            if c >= PROMPT {
                response_mask.push(if real { 1f32 } else { 0.0 });
            }
        }
    }
    let ids = Tensor::from_slice(&ids).view([ROWS, width]);
    let mask = Tensor::from_slice(&mask).view([ROWS, width]);
    let response_mask = Tensor::from_slice(&response_mask).view([ROWS, RESPONSE]);
    let real = mask.sum(Kind::Int64).int64_value(&[]);
    let advantages = Tensor::from_slice(&[1.0f32, -1.0, 0.5, -0.5])
        .repeat([ROWS / 4])
        .view([ROWS, 1])
        .expand([ROWS, RESPONSE], false)
        * &response_mask;
    let tensor = |t: &Tensor| from_tch("t", t).unwrap();
    let mut batch = Batch::default();
    batch.insert(keys::INPUT_IDS, tensor(&ids));
    batch.insert(keys::ATTENTION_MASK, tensor(&mask));
    batch.insert(keys::RESPONSES, tensor(&ids.narrow(1, PROMPT, RESPONSE)));
    batch.insert(keys::RESPONSE_MASK, tensor(&response_mask));
    batch.insert(keys::ADVANTAGES, tensor(&advantages));
    batch.meta_json = json!({"temperature": 1.0, "calculate_entropy": true})
        .to_string()
        .into();
    (batch, real)
}

fn engine(dir: &Path, packed: bool) -> FsdpEngine {
    let mut engine = FsdpEngine::default();
    let config = json!({
        "role": "actor",
        "model": {"path": dir, "use_remove_padding": packed, "enable_gradient_checkpointing": false},
        "ppo_mini_batch_size": ROWS,
        "ppo_micro_batch_size_per_gpu": ROWS / 2,
        "log_prob_micro_batch_size_per_gpu": ROWS,
    });
    engine
        .init(&ComponentInit::new(config, RunContext::default()))
        .unwrap();
    engine
}

fn main() {
    tch::set_num_threads(threads());
    let dir = tempfile::tempdir().unwrap();
    write_issue14_model(dir.path());
    let (mut batch, real) = grpo_batch();
    let mut engines = [engine(dir.path(), false), engine(dir.path(), true)];
    let log_probs = |e: &mut FsdpEngine, b: &Batch| {
        let out = e.compute_log_prob(b).unwrap();
        to_tch(
            "log_probs",
            out.require(keys::LOG_PROBS).unwrap(),
            tch::Device::Cpu,
        )
        .unwrap()
    };
    let (padded, packed) = (
        log_probs(&mut engines[0], &batch),
        log_probs(&mut engines[1], &batch),
    );
    let diff = (&padded - &packed).abs().max().double_value(&[]);
    assert!(
        diff <= 1e-5,
        "packed log-probs differ from padded by {diff:e}"
    );
    batch.insert(keys::OLD_LOG_PROBS, from_tch("old", &padded).unwrap());
    let cells = ROWS * (PROMPT + RESPONSE);
    println!(
        "packing: {ROWS} rows × {} columns, {real} real tokens ({:.0}% padding), {} threads, load {}",
        PROMPT + RESPONSE,
        100.0 * (1.0 - real as f64 / cells as f64),
        threads(),
        load_average()
    );
    println!("packed log-probs vs padded: max |Δ| = {diff:.1e}");
    // Each work's repetitions alternate the layouts; each line is printed as soon as measured.
    let reps = std::env::var("VERL_BENCH_REPS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(REPS);
    for name in ["compute_log_prob", "update_actor"] {
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..reps {
            for (layout, engine) in engines.iter_mut().enumerate() {
                let start = Instant::now();
                if name == "update_actor" {
                    engine.update_actor(&batch).unwrap();
                } else {
                    let _ = log_probs(engine, &batch);
                }
                times[layout].push(start.elapsed().as_secs_f64());
            }
        }
        let [padded, packed] = times.map(median);
        println!(
            "{name:>16}: padded {:.1} ms ({:.0} tokens/s), packed {:.1} ms ({:.0} tokens/s): packed {:.2}× padded ({reps} reps)",
            padded * 1e3,
            real as f64 / padded,
            packed * 1e3,
            real as f64 / packed,
            padded / packed
        );
    }
    println!("load after: {}", load_average());
}
