//! `cargo bench -p verl-plugin-native --bench grpo`
//!
//! One GRPO step of verl-core against one step of TRL's `GRPOTrainer`, in the same run, alternating
//! (issue 14, "Speed"). The model and batch are the issue's: a random Qwen2 (hidden 256, 4 layers,
//! 4 heads / 2 key-value heads, vocab 512, q/k/v biases, untied head), fp32, 2 threads
//! (`VERL_BENCH_THREADS`), 8 prompts (16–48 tokens, drawn from a seed) × n = 4 samples × 32 new
//! tokens at temperature 1 (EOS ignored, so both sides generate exactly 32 × 32 tokens), lr 1e-6,
//! no KL and no reference model, one mini-batch, one micro-batch, one epoch (one optimizer step).
//!
//! verl-core's step is the code the plugins run (their rlibs): the `native` rollout generates, a
//! rule reward and GRPO advantages are computed, the `fsdp` engine computes the old log-probs and
//! runs `update_actor` (PPO clip loss with entropy, backward, grad clipping, AdamW), then lends
//! its weights to the rollout (`naive` weight sync, by reference). Each phase is timed. Variants,
//! each its own engine + rollout pair on the same weights and prompts:
//! - `padded`: `model.use_remove_padding=false`;
//! - `packed`: `model.use_remove_padding=true` (no compute on padding),
//!   `actor.use_prefix_grouper=false`;
//! - `packed+on-policy`: and no old-log-prob pass. With one epoch and one mini-batch the engine
//!   takes the old log-probs from the update's own forward, detached (verl's on-policy shortcut
//!   in `dp_actor.update_policy`: `on_policy = len(mini_batches) == 1 and ppo_epochs == 1`; not
//!   an option, verl applies it whenever it holds), so the batch's `old_log_probs` are never
//!   read. verl's trainer still runs the pass (for `actor/entropy`); the only verl option that
//!   skips it is `algorithm.rollout_correction.bypass_mode=true`, under which the update is the
//!   same;
//! - `+shared-prompts`: and each prompt computed once for its `n` samples (verl's
//!   `actor.use_prefix_grouper`, on by default here with packing): verl-core's defaults.
//!
//! TRL (when `VERL_TRL_PYTHON`, or `~/.cache/verl-core/trl-venv/venv/bin/python` made by
//! `scripts/setup-trl.sh`, exists; else "TRL not available"): `GRPOTrainer` on the same weights
//! (saved here), the same prompt ids (a word-level tokenizer maps `t<i>` to id `i`), the same
//! sampling, `num_iterations=1`, `beta=0`, generation through HF `generate` (no vLLM), one
//! optimizer step per step, driven one step at a time over stdin. Its phases: generation (HF
//! `generate`), scoring (the rest of `_generate_and_score_completions`: reward, advantages, and
//! old log-probs — which TRL skips when `num_iterations=1`), update (forward, loss, backward,
//! clipping, AdamW). Figures are medians over `VERL_BENCH_REPS` (default 7) alternating steps,
//! after one warm-up step each.

#[path = "../../fsdp/benches/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use common::{Driven, ISSUE14_VOCAB, load_average, median, threads, write_issue14_model};
use serde_json::{Value, json};
use verl_actor::{AdamW, AdamWConfig};
use verl_model::{CausalLM, ModelOptions, Rng};
use verl_plugin_api::{
    Batch, ComponentInit, ComponentKind, GenerateOutput, GenerateRequest, Rollout, RunContext,
    SamplingParams, Tensor, WeightSource, keys,
};
use verl_plugin_host::EngineHandle;
use verl_plugin_native::NativeRollout;
use verl_testkit::{PluginHarness, built_plugin};

const PROMPTS: usize = 8;
const N: u32 = 4;
const NEW_TOKENS: u32 = 32;
const VOCAB: u32 = ISSUE14_VOCAB as u32;
const LR: f64 = 1e-6;
const REPS: usize = 7;
const PHASES: [&str; 5] = ["gen", "reward+adv", "old_log_prob", "update_actor", "sync"];

/// Prompts of 16–48 tokens with ids ≥ 3 (no special token).
fn prompts() -> Vec<Vec<u32>> {
    let mut rng = Rng::new(5);
    (0..PROMPTS)
        .map(|_| {
            let len = 16 + rng.next_u64() % 33;
            (0..len)
                .map(|_| 3 + (rng.next_u64() % u64::from(VOCAB - 3)) as u32)
                .collect()
        })
        .collect()
}

/// The rule reward both sides use: the share of even token ids in the response.
fn reward(response: &[u32]) -> f32 {
    response.iter().filter(|&&t| t % 2 == 0).count() as f32 / response.len().max(1) as f32
}

/// GRPO advantages as verl's `compute_grpo_outcome_advantage`: (r − mean_g) / (std_g + 1e-6),
/// unbiased std, over each prompt's `n` consecutive samples.
fn grpo_advantages(rewards: &[f32]) -> Vec<f32> {
    rewards
        .chunks(N as usize)
        .flat_map(|g| {
            let mean = g.iter().sum::<f32>() / g.len() as f32;
            let var = g.iter().map(|r| (r - mean).powi(2)).sum::<f32>() / (g.len() - 1) as f32;
            g.iter()
                .map(move |r| (r - mean) / (var.sqrt() + 1e-6))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// verl's layout: left-padded prompts, right-padded responses; advantages broadcast over each
/// response. Returns it with the rollout's sampling log-probs in the same layout (the trainer
/// keeps them beside the batch).
fn training_batch(
    prompts: &[Vec<u32>],
    out: &GenerateOutput,
    advantages: &[f32],
) -> (Batch, Tensor) {
    let p = prompts.iter().map(Vec::len).max().unwrap();
    let r = out
        .completions
        .iter()
        .map(|c| c.response_ids.len())
        .max()
        .unwrap();
    let (mut ids, mut mask, mut responses, mut response_mask, mut adv, mut rollout_lp) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for (c, &a) in out.completions.iter().zip(advantages) {
        let prompt = &prompts[c.prompt_index as usize];
        let (pad_p, pad_r) = (p - prompt.len(), r - c.response_ids.len());
        ids.extend(std::iter::repeat_n(0i64, pad_p));
        ids.extend(prompt.iter().chain(&c.response_ids).map(|&t| i64::from(t)));
        ids.extend(std::iter::repeat_n(0, pad_r));
        mask.extend(std::iter::repeat_n(0i64, pad_p));
        mask.extend(std::iter::repeat_n(1, prompt.len() + c.response_ids.len()));
        mask.extend(std::iter::repeat_n(0, pad_r));
        responses.extend(c.response_ids.iter().map(|&t| i64::from(t)));
        responses.extend(std::iter::repeat_n(0, pad_r));
        let real = c.response_ids.len();
        response_mask.extend((0..r).map(|i| f32::from(u8::from(i < real))));
        adv.extend((0..r).map(|i| if i < real { a } else { 0.0 }));
        rollout_lp.extend(c.logprobs.iter().copied());
        rollout_lp.extend(std::iter::repeat_n(0.0, pad_r));
    }
    let (b, w) = (out.completions.len() as i64, (p + r) as i64);
    let mut batch = Batch::default();
    batch.insert(keys::INPUT_IDS, Tensor::from_slice(&[b, w], &ids).unwrap());
    batch.insert(
        keys::ATTENTION_MASK,
        Tensor::from_slice(&[b, w], &mask).unwrap(),
    );
    let rs = [b, r as i64];
    batch.insert(
        keys::RESPONSES,
        Tensor::from_slice(&rs, &responses).unwrap(),
    );
    batch.insert(
        keys::RESPONSE_MASK,
        Tensor::from_slice(&rs, &response_mask).unwrap(),
    );
    batch.insert(keys::ADVANTAGES, Tensor::from_slice(&rs, &adv).unwrap());
    // What the trainer sends to both calls.
    batch.meta_json = json!({"temperature": 1.0, "calculate_entropy": true})
        .to_string()
        .into();
    (batch, Tensor::from_slice(&rs, &rollout_lp).unwrap())
}

/// The training batch of a generation: rule rewards, GRPO advantages, verl's layout.
fn scored_batch(prompts: &[Vec<u32>], out: &GenerateOutput) -> (Batch, Tensor) {
    let rewards: Vec<f32> = out
        .completions
        .iter()
        .map(|c| reward(&c.response_ids))
        .collect();
    training_batch(prompts, out, &grpo_advantages(&rewards))
}

/// One verl-core configuration: an engine and a rollout on the same model.
struct Verl {
    name: &'static str,
    /// Whether the step runs the old-log-prob pass.
    recompute: bool,
    /// The `fsdp` engine through its library (linking its rlib beside this crate's would export
    /// two plugin root modules from one binary); the ABI costs 1.0001× (`bench components`).
    engine: EngineHandle,
    rollout: NativeRollout,
    version: u64,
    /// Keeps the engine's library loaded; dropped after the engine.
    _fsdp: PluginHarness,
}

impl Verl {
    fn new(
        dir: &Path,
        name: &'static str,
        packed: bool,
        share_prompts: bool,
        recompute: bool,
    ) -> Self {
        let mut run = RunContext::default();
        run.seed = 1;
        let fsdp = PluginHarness::load_alone(built_plugin("verl_plugin_fsdp"))
            .unwrap_or_else(|e| panic!("{e}"));
        let mut engine = fsdp
            .component(ComponentKind::ENGINE, "fsdp")
            .create_engine()
            .unwrap_or_else(|e| panic!("{e}"));
        let config = json!({
            "role": "actor",
            "model": {"path": dir, "use_remove_padding": packed, "enable_gradient_checkpointing": false},
            "use_prefix_grouper": share_prompts,
            "optim": {"lr": LR},
            "ppo_mini_batch_size": PROMPTS * N as usize,
            "ppo_micro_batch_size_per_gpu": PROMPTS * N as usize,
            "log_prob_micro_batch_size_per_gpu": PROMPTS * N as usize,
        });
        engine
            .init(&ComponentInit::new(config, run.clone()))
            .unwrap();
        let mut rollout = NativeRollout::default();
        rollout
            .init(&ComponentInit::new(
                json!({"model": {"path": dir}, "ignore_eos": true}),
                run,
            ))
            .unwrap();
        Self {
            name,
            recompute,
            engine,
            rollout,
            version: 0,
            _fsdp: fsdp,
        }
    }

    fn generate(&mut self, prompts: &[Vec<u32>], seed: u64) -> GenerateOutput {
        let mut sampling = SamplingParams::default();
        sampling.n = N;
        sampling.temperature = 1.0;
        sampling.max_new_tokens = NEW_TOKENS;
        sampling.seed = Some(seed);
        self.rollout
            .generate(&GenerateRequest::new(prompts.to_vec(), sampling))
            .unwrap()
    }

    /// One GRPO step; returns the seconds of each phase of [`PHASES`] and the batch it trained on.
    fn step(&mut self, prompts: &[Vec<u32>], seed: u64) -> ([f64; 5], Batch) {
        let mut times = [0.0; 5];
        let mut t = Instant::now();
        let mut lap = |i: usize, t: &mut Instant| {
            times[i] = t.elapsed().as_secs_f64();
            *t = Instant::now();
        };
        let out = self.generate(prompts, seed);
        lap(0, &mut t);
        let (mut batch, _) = scored_batch(prompts, &out);
        lap(1, &mut t);
        if self.recompute {
            let old = self.engine.compute_log_prob(&batch).unwrap();
            batch.insert(
                keys::OLD_LOG_PROBS,
                old.require(keys::LOG_PROBS).unwrap().clone(),
            );
        }
        lap(2, &mut t);
        self.engine.update_actor(&batch).unwrap();
        lap(3, &mut t);
        self.version += 1;
        let views = self.engine.weights().unwrap();
        self.rollout
            .update_weights(&WeightSource::memory(self.version, &views))
            .unwrap();
        drop(views);
        lap(4, &mut t);
        (times, batch)
    }
}

/// The TRL process: one GRPO step per request, its phase times as a JSON line.
struct Trl(Driven);

const TRL_SCRIPT: &str = include_str!("grpo_trl.py");

impl Trl {
    fn start(python: &Path, dir: &Path, prompts: &[Vec<u32>]) -> Result<Self, String> {
        let script = dir.join("grpo_trl.py");
        std::fs::write(&script, TRL_SCRIPT).map_err(|e| e.to_string())?;
        let settings = json!({
            "model": dir, "prompts": prompts, "n": N, "new_tokens": NEW_TOKENS, "lr": LR,
            "threads": threads(), "vocab": VOCAB,
        });
        let mut command = Command::new(python);
        command
            .arg(&script)
            .arg(settings.to_string())
            .env("OMP_NUM_THREADS", threads().to_string());
        Driven::start(command).map(Self)
    }

    /// One step: (generation, scoring, update, whole step) seconds and the generated tokens.
    fn step(&mut self) -> Result<([f64; 4], u64), String> {
        let line = self.0.ask("step")?;
        let v: Value =
            serde_json::from_str(&line).map_err(|_| format!("unexpected output {line:?}"))?;
        let f = |k: &str| v[k].as_f64().ok_or(format!("no `{k}` in {line}"));
        Ok((
            [f("gen")?, f("score")?, f("update")?, f("step")?],
            v["tokens"].as_u64().unwrap_or(0),
        ))
    }
}

fn trl_python() -> Option<PathBuf> {
    match std::env::var_os("VERL_TRL_PYTHON") {
        Some(p) => Some(PathBuf::from(p)),
        None => std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(".cache/verl-core/trl-venv/venv/bin/python"))
            .filter(|p| p.exists()),
    }
}

/// Largest |a − b| between two same-shaped f32 tensors.
fn max_gap(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn main() {
    tch::set_num_threads(threads());
    let reps = std::env::var("VERL_BENCH_REPS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(REPS);
    let dir = tempfile::tempdir().unwrap();
    write_issue14_model(dir.path());
    let prompts = prompts();
    let mut variants = [
        Verl::new(dir.path(), "padded", false, false, true),
        Verl::new(dir.path(), "packed", true, false, true),
        Verl::new(dir.path(), "packed+on-policy", true, false, false),
        Verl::new(dir.path(), "+shared-prompts", true, true, false),
    ];

    // The levers keep the numerics: on one batch, packed old log-probs (each row's prompt its
    // own, or shared) equal padded ones; after a sync, the rollout's sampling log-probs (the old
    // log-probs under verl's bypass mode) equal the engine's.
    let (_, batch) = variants[0].step(&prompts, 0);
    let lp = |e: &mut EngineHandle, b: &Batch| {
        e.compute_log_prob(b)
            .unwrap()
            .require(keys::LOG_PROBS)
            .unwrap()
            .clone()
    };
    // Both at the initial weights (variant 0 has taken a step).
    let padded = lp(
        &mut Verl::new(dir.path(), "check", false, false, true).engine,
        &batch,
    );
    let packed = lp(&mut variants[1].engine, &batch);
    let shared = lp(&mut variants[3].engine, &batch);
    let out = variants[0].generate(&prompts, 1);
    let (synced, rollout_lp) = scored_batch(&prompts, &out);
    let recomputed = lp(&mut variants[0].engine, &synced);
    println!(
        "numerics: old log-probs vs padded max |Δ|: packed {:.1e}, shared prompts {:.1e}; after a sync, the rollout's sampling log-probs vs the engine's max |Δ| {:.1e}",
        max_gap(&padded, &packed),
        max_gap(&padded, &shared),
        max_gap(&rollout_lp, &recomputed)
    );

    let mut trl = match trl_python() {
        None => {
            println!(
                "TRL not available (run scripts/setup-trl.sh, or set VERL_TRL_PYTHON to a Python with trl 1.16)"
            );
            None
        }
        Some(python) => match Trl::start(&python, dir.path(), &prompts) {
            Ok(t) => Some(t),
            Err(e) => {
                println!("TRL not available: {} failed: {e}", python.display());
                None
            }
        },
    };
    println!(
        "GRPO step: {PROMPTS} prompts × n={N} × {NEW_TOKENS} new tokens, Qwen2 h256 L4 vocab {VOCAB}, fp32, {} threads, {reps} alternating reps, load before {}",
        threads(),
        load_average()
    );

    // Warm-up, then alternating repetitions.
    let mut verl_times: Vec<Vec<[f64; 5]>> = vec![Vec::new(); variants.len()];
    let mut trl_times: Vec<[f64; 4]> = Vec::new();
    let mut trl_tokens = 0;
    for rep in 0..=reps {
        let mut line = format!("rep {rep}{}:", if rep == 0 { " (warm-up)" } else { "" });
        for (v, times) in variants.iter_mut().zip(&mut verl_times) {
            let (t, _) = v.step(&prompts, 1000 + rep as u64);
            line += &format!(" {} {:.3} s,", v.name, t.iter().sum::<f64>());
            if rep > 0 {
                times.push(t);
            }
        }
        if let Some(t) = trl.as_mut() {
            match t.step() {
                Ok((times, tokens)) => {
                    line += &format!(" TRL {:.3} s", times[3]);
                    trl_tokens = tokens;
                    if rep > 0 {
                        trl_times.push(times);
                    }
                }
                Err(e) => {
                    println!("TRL step failed: {e}");
                    trl = None;
                }
            }
        }
        println!("{line}");
    }
    let adamw = adamw_step(dir.path(), reps);
    let phase = |times: &[[f64; 5]], i: usize| median(times.iter().map(|t| t[i]).collect());
    let total = |times: &[[f64; 5]]| median(times.iter().map(|t| t.iter().sum()).collect());
    let trl_step =
        (!trl_times.is_empty()).then(|| median(trl_times.iter().map(|t| t[3]).collect()));
    for (v, times) in variants.iter().zip(&verl_times) {
        let phases: Vec<String> = PHASES
            .iter()
            .enumerate()
            .map(|(i, name)| format!("{name} {:.3}", phase(times, i)))
            .collect();
        let step = total(times);
        let ratio = trl_step
            .map(|t| format!(", TRL / verl-core = {:.2}×", t / step))
            .unwrap_or_default();
        println!(
            "verl-core {:<16} step {step:.3} s ({}){ratio}",
            v.name,
            phases.join(", ")
        );
    }
    if !trl_times.is_empty() {
        let m = |i: usize| median(trl_times.iter().map(|t| t[i]).collect());
        println!(
            "TRL GRPOTrainer          step {:.3} s (gen {:.3}, score (reward, advantages; no old log-probs at num_iterations=1) {:.3}, update {:.3}); {trl_tokens} completion tokens per step",
            m(3),
            m(0),
            m(1),
            m(2)
        );
    }
    println!(
        "AdamW step alone (the engine's optimizer on the model's {} parameters): median {:.2} ms",
        adamw.0,
        adamw.1 * 1e3
    );
    println!("load after: {}", load_average());
}

/// The engine's AdamW alone on the bench model's parameters with gradients set: (parameter count,
/// median seconds per step).
fn adamw_step(dir: &Path, reps: usize) -> (i64, f64) {
    let model = CausalLM::from_pretrained(dir, &ModelOptions::default()).unwrap();
    let mut opt = AdamW::for_model(&model, AdamWConfig::default());
    let mut count = 0;
    for (_, p) in model.named_tensors() {
        if p.requires_grad() {
            count += p.numel() as i64;
            (&p * &p).sum(tch::Kind::Float).backward();
        }
    }
    assert!(count > 0, "the model has no trainable parameters");
    let times = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            assert!(opt.step(LR));
            t.elapsed().as_secs_f64()
        })
        .collect();
    (count, median(times))
}
