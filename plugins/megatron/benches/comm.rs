//! The `megatron` engine at tensor-parallel size 2 (with and without sequence parallelism)
//! against the `fsdp` engine on 2 ranks, same model and global batch (Gloo on CPU, local
//! processes, one intra-op thread per rank: both engines share the machine's cores, so this
//! compares schedules and communication, not scaling).
//!
//! `cargo bench -p verl-plugin-megatron --bench comm`
//!
//! Model: Llama, hidden 256, intermediate 768, 4 layers, 4 heads, vocab 8192, untied, fp32 (the
//! fsdp benches'). One update = `update_actor` on a global batch of 8 sequences × 128 tokens
//! (64 response tokens), one mini- and micro-batch, clipping and AdamW.
//! - tokens/s: global tokens ÷ the median update time of 3 after a warm-up;
//! - tensor-parallel bytes sent per rank per update (ring-algorithm count, [`Traffic`]) against
//!   the analytic Megatron-LM count: per micro-batch `(4·layers + 2)` all-reduces (or their
//!   all-gather + reduce-scatter halves with sequence parallelism) of the hidden states
//!   `b·s·h` (the layers' `f` and `g`, the embedding's `g`, the LM head's `f`), plus the
//!   vocab-parallel cross-entropy's row scalars, the batch rows the group shares, the gradient
//!   norm and, with sequence parallelism, the replicated norms' gradients.
//!
//! Ranks are this bench run again (VERL_MEGATRON_BENCH_CASE), one intra-op thread each.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use verl_model::{Architecture, CausalLM, ModelConfig, ModelOptions, Rng};
use verl_plugin_api::{Batch, ComponentInit, ComponentKind, RunContext, Tensor, keys};
use verl_plugin_megatron::{Comm, group_rows, new_worker};
use verl_testkit::{PluginHarness, built_plugin};

const CASE_ENV: &str = "VERL_MEGATRON_BENCH_CASE";
const MODEL_ENV: &str = "VERL_MEGATRON_BENCH_MODEL";
const ROWS: i64 = 8;
const SEQ: i64 = 128;
const RESPONSE: i64 = 64;
const UPDATES: usize = 3;
const WORLD: u32 = 2;

fn config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 8192,
        hidden_size: 256,
        intermediate_size: 768,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        num_key_value_heads: 4,
        head_dim: 64,
        rope_theta: 10000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 256,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        initializer_range: 0.02,
        bos_token_id: None,
        eos_token_ids: vec![],
        pad_token_id: None,
        qk_norm: false,
        moe: None,
    }
}

/// What rank 0 reports.
#[derive(Debug, Serialize, Deserialize)]
struct Report {
    update_ms: f64,
    /// Tensor-parallel bytes this rank sent in one update (megatron only).
    tp_bytes: Option<u64>,
}

fn median(mut samples: Vec<Duration>) -> f64 {
    samples.sort();
    samples[samples.len() / 2].as_secs_f64() * 1e3
}

/// This rank's rows of the global batch, with the PPO keys (old log-probs: zeros; the ratio
/// only scales the loss).
fn batch(rank: u32) -> Batch {
    let mut rng = Rng::stream(9, 0);
    let ids: Vec<i64> = (0..ROWS * SEQ)
        .map(|_| (rng.next_u64() % config().vocab_size as u64) as i64)
        .collect();
    let rows = ROWS / i64::from(WORLD);
    let mine = |all: &[i64], width: i64| {
        all[(i64::from(rank) * rows * width) as usize
            ..(i64::from(rank + 1) * rows * width) as usize]
            .to_vec()
    };
    let ids = mine(&ids, SEQ);
    let responses: Vec<i64> = ids
        .chunks(SEQ as usize)
        .flat_map(|row| row[(SEQ - RESPONSE) as usize..].to_vec())
        .collect();
    let ones = |n: i64| vec![1.0f32; n as usize];
    let mut batch = Batch::default();
    let t = |shape: &[i64], v: &[i64]| Tensor::from_slice(shape, v).unwrap();
    let f = |shape: &[i64], v: &[f32]| Tensor::from_slice(shape, v).unwrap();
    batch.insert(keys::INPUT_IDS, t(&[rows, SEQ], &ids));
    batch.insert(
        keys::ATTENTION_MASK,
        t(&[rows, SEQ], &vec![1; (rows * SEQ) as usize]),
    );
    batch.insert(keys::RESPONSES, t(&[rows, RESPONSE], &responses));
    let r = [rows, RESPONSE];
    batch.insert(keys::RESPONSE_MASK, f(&r, &ones(rows * RESPONSE)));
    batch.insert(
        keys::OLD_LOG_PROBS,
        f(&r, &vec![-9.0; (rows * RESPONSE) as usize]),
    );
    batch.insert(keys::ADVANTAGES, f(&r, &ones(rows * RESPONSE)));
    batch.meta_json = json!({"temperature": 1.0}).to_string().into();
    batch
}

fn init(model: &Path, parallel: Option<Value>) -> ComponentInit {
    let env = |name: &str| std::env::var(name).unwrap();
    let mut run = RunContext::default();
    run.seed = 1;
    run.rank = env("RANK").parse().unwrap();
    run.world_size = WORLD;
    run.master_addr = "127.0.0.1".into();
    run.master_port = env("MASTER_PORT").parse().unwrap();
    let mut config = json!({
        "role": "actor",
        "model": {"path": model},
        "optim": {"lr": 1e-4},
        "ppo_mini_batch_size": ROWS,
    });
    if let Some(section) = parallel {
        config["megatron"] = section;
    }
    ComponentInit::new(config, run)
}

fn timed(mut update: impl FnMut()) -> f64 {
    update(); // warm-up
    median(
        (0..UPDATES)
            .map(|_| {
                let start = Instant::now();
                update();
                start.elapsed()
            })
            .collect(),
    )
}

fn rank_main(case: &str, model: &Path) -> Report {
    let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
    let batch = batch(rank);
    if case == "fsdp" {
        // The fsdp engine as the host loads it (linking both plugin libraries into one binary
        // would export the plugin entry point twice).
        let harness = PluginHarness::load_alone(built_plugin("verl_plugin_fsdp")).unwrap();
        let mut engine = harness
            .component(ComponentKind::ENGINE, "fsdp")
            .create_engine()
            .unwrap();
        engine.init(&init(model, None)).unwrap();
        let update_ms = timed(|| {
            engine.update_actor(&batch).unwrap();
        });
        return Report {
            update_ms,
            tp_bytes: None,
        };
    }
    let sp = case == "megatron-sp";
    let section = json!({"tensor_model_parallel_size": WORLD, "sequence_parallel": sp});
    let (mut worker, comm): (_, Comm) = new_worker(&init(model, Some(section))).unwrap();
    let mut sent = Vec::new();
    let update_ms = timed(|| {
        let before = comm.traffic().model_parallel.load(Ordering::Relaxed);
        let (rows, _, _) = group_rows(&comm, &batch).unwrap();
        worker.update_actor(&rows).unwrap();
        sent.push(comm.traffic().model_parallel.load(Ordering::Relaxed) - before);
    });
    assert!(
        sent.windows(2).all(|w| w[0] == w[1]),
        "every update sends the same: {sent:?}"
    );
    Report {
        update_ms,
        tp_bytes: Some(sent[0]),
    }
}

fn job(case: &str, model: &Path) -> Report {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let children: Vec<_> = (0..WORLD)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .env(CASE_ENV, case)
                .env(MODEL_ENV, model)
                .env("RANK", rank.to_string())
                .env("MASTER_PORT", &port)
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (rank, o) in outputs.iter().enumerate() {
        assert!(o.status.success(), "{case}: rank {rank} failed");
    }
    serde_json::from_slice(&outputs[0].stdout).expect("rank 0's report")
}

/// The analytic tensor-parallel bytes per rank of one update (ring counts, fp32), and the part
/// of it that is the hidden states' `(4·layers + 2)` all-reduces.
fn analytic(sp: bool) -> (f64, f64) {
    let c = config();
    let n = f64::from(WORLD);
    let ring = (n - 1.0) / n;
    let (b, s, h) = (ROWS as f64, SEQ as f64, c.hidden_size as f64);
    let hidden = b * s * h * 4.0;
    let main = (4.0 * c.num_hidden_layers as f64 + 2.0) * 2.0 * ring * hidden;
    // Cross-entropy over vocabulary shards: row max, sum of exponentials, target logit.
    let scalars = 3.0 * 2.0 * ring * b * RESPONSE as f64 * 4.0;
    // The group's batch rows: 4 int64/f32 tensors [b, s] or [b, r] pairs, and the row counts.
    let rows = ring * (2.0 * b * s * 8.0 + b * RESPONSE as f64 * (8.0 + 3.0 * 4.0) + n * 8.0);
    // The global gradient norm (one f64).
    let norm = 2.0 * ring * 8.0;
    // Sequence parallelism: the norms' gradients (2 per layer + the final one) summed.
    let norms = if sp {
        2.0 * ring * (2.0 * c.num_hidden_layers as f64 + 1.0) * h * 4.0
    } else {
        0.0
    };
    (main + scalars + rows + norm + norms, main)
}

fn main() {
    if let Ok(case) = std::env::var(CASE_ENV) {
        let report = rank_main(&case, &PathBuf::from(std::env::var(MODEL_ENV).unwrap()));
        println!("{}", serde_json::to_string(&report).unwrap());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    CausalLM::random(config(), &ModelOptions::default())
        .unwrap()
        .save_pretrained(&model, None)
        .unwrap();
    let tokens = (ROWS * SEQ) as f64;
    println!(
        "update_actor on {ROWS} × {SEQ} tokens, 2 ranks (gloo, CPU, 1 intra-op thread per rank, 2 shared cores)"
    );
    for case in ["fsdp", "megatron", "megatron-sp"] {
        let report = job(case, &model);
        print!(
            "{case:>12}: {:7.1} ms per update, {:7.0} tokens/s",
            report.update_ms,
            tokens / (report.update_ms / 1e3)
        );
        if let Some(sent) = report.tp_bytes {
            let (expected, main) = analytic(case == "megatron-sp");
            print!(
                "; tensor-parallel bytes sent per rank {:.3} MiB vs analytic {:.3} MiB ({:.4}; hidden-state all-reduces {:.3} MiB)",
                sent as f64 / f64::from(1 << 20),
                expected / f64::from(1 << 20),
                sent as f64 / expected,
                main / f64::from(1 << 20)
            );
        }
        println!();
    }
}
