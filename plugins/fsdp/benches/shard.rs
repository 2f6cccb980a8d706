//! The sharded model (`verl_plugin_fsdp::shard`) at 1 and 2 ranks (Gloo on CPU, local processes).
//!
//! `cargo bench -p verl-plugin-fsdp --bench shard [-- --ranks 4]`
//!
//! Model: Llama, hidden 256, intermediate 768, 4 layers, 4 heads, vocab 8192, untied head, fp32
//! (the `compute` bench's). One update = forward + backward of a token-mean NLL over a global
//! batch of 8 × 128 tokens, split over the ranks, then global clipping and AdamW.
//! - bytes per rank: parameters + gradients + AdamW moments held between steps, and the most a
//!   gathered stage adds (its parameters and their full gradients), N ranks ÷ 1 rank;
//! - collectives at the size of one decoder layer's flat buffer and at 64 MiB: all-gather
//!   (output size), reduce-scatter (input size) and a raw all-reduce of the same size;
//! - update time, median of 5 after a warm-up, N ranks vs 1.
//!
//! Ranks are this bench run again (VERL_SHARD_BENCH_RANK), one intra-op thread each.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};
use verl_actor::{AdamW, AdamWConfig};
use verl_distributed::{Backend, DistError, Options, ProcessGroup, ReduceOp, Rendezvous};
use verl_model::{Architecture, CausalLM, ModelConfig, ModelOptions, Rng, ScoreOutputs};
use verl_plugin_fsdp::shard::{ShardMemory, ShardOptions, ShardedModel};

const RANK_ENV: &str = "VERL_SHARD_BENCH_RANK";
const ROWS: i64 = 8;
const SEQ: i64 = 128;
const UPDATES: usize = 5;

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
    world: u32,
    persistent: u64,
    peak_gathered: u64,
    update_ms: f64,
    /// One rank only: the same update on the whole model (plain backward, no gathers, no
    /// recomputation) — the engine's unsharded path.
    whole_update_ms: Option<f64>,
    /// (label, bytes, all_gather ms, reduce_scatter ms, all_reduce ms)
    collectives: Vec<(String, u64, f64, f64, f64)>,
}

fn median(mut samples: Vec<Duration>) -> f64 {
    samples.sort();
    samples[samples.len() / 2].as_secs_f64() * 1e3
}

/// The slowest rank's median of `runs` timed calls of `op`, after a warm-up call.
fn time(
    group: &mut ProcessGroup,
    runs: usize,
    mut op: impl FnMut(&mut ProcessGroup) -> Result<(), DistError>,
) -> Result<f64, DistError> {
    op(group)?;
    let mut samples = Vec::with_capacity(runs);
    for _ in 0..runs {
        group.barrier()?;
        let start = Instant::now();
        op(group)?;
        samples.push(start.elapsed());
    }
    let all: Vec<f64> = group.all_gather_object(&median(samples))?;
    Ok(all.into_iter().fold(0.0, f64::max))
}

fn collectives(
    group: &mut ProcessGroup,
    label: &str,
    elements: i64,
) -> Result<(String, u64, f64, f64, f64), DistError> {
    let world = i64::from(group.world_size());
    let shard = (elements + world - 1) / world;
    let cpu = (Kind::Float, Device::Cpu);
    let part = Tensor::ones([shard], cpu);
    let mut full = Tensor::ones([shard * world], cpu);
    let mut out = Tensor::zeros([shard], cpu);
    let runs = 10;
    let gather = time(group, runs, |g| {
        let mut output = full.empty_like();
        g.all_gather_into(&mut output, &part)
    })?;
    let scatter = time(group, runs, |g| {
        g.reduce_scatter(&mut out, &full, ReduceOp::Sum)
    })?;
    let reduce = time(group, runs, |g| g.all_reduce(&mut full, ReduceOp::Sum))?;
    Ok((
        label.to_owned(),
        (shard * world * 4) as u64,
        gather,
        scatter,
        reduce,
    ))
}

fn rank_main(rank: u32) -> Result<(), Box<dyn std::error::Error>> {
    tch::set_num_threads(1);
    let rendezvous = Rendezvous {
        rank,
        world_size: std::env::var("WORLD_SIZE")?.parse()?,
        master_addr: "127.0.0.1".to_owned(),
        master_port: std::env::var("MASTER_PORT")?.parse()?,
    };
    let mut group = ProcessGroup::init(&rendezvous, Backend::Gloo, &Options::default())?;
    let world = group.world_size();
    let model = CausalLM::random(config(), &ModelOptions::default())?;
    let options = ShardOptions {
        optimizer: Some(AdamWConfig::default()),
        ..ShardOptions::default()
    };
    let mut sm = ShardedModel::new(model, &mut group, options)?;
    let mut rng = Rng::new(3);
    let ids: Vec<i64> = (0..ROWS * SEQ)
        .map(|_| (rng.next_u64() % 8192) as i64)
        .collect();
    let ids = Tensor::from_slice(&ids).view([ROWS, SEQ]);
    let rows = Tensor::arange_start_step(
        i64::from(rank),
        ROWS,
        i64::from(world),
        (Kind::Int64, Device::Cpu),
    );
    let (ids, mask) = (
        ids.index_select(0, &rows),
        ids.index_select(0, &rows).ones_like(),
    );
    let tokens = (ROWS * (SEQ - 1)) as f64;
    let update = |sm: &mut ShardedModel,
                  group: &mut ProcessGroup|
     -> Result<(), Box<dyn std::error::Error>> {
        sm.zero_grad();
        // The loss value is not needed.
        let context = sm.model().block_context(&ids, &mask)?;
        let _ = sm.forward_backward(group, &context, |model, hidden| {
            let scores = model.response_scores_from_hidden(
                hidden,
                &ids,
                &mask,
                SEQ - 1,
                1.0,
                ScoreOutputs::NONE,
            )?;
            Ok(-scores.log_probs.sum(Kind::Float) / tokens)
        })?;
        sm.clip_grad_norm_global(group, 1.0)?;
        sm.step(group, 1e-4)?;
        Ok(())
    };
    update(&mut sm, &mut group)?;
    let mut samples = Vec::with_capacity(UPDATES);
    for _ in 0..UPDATES {
        group.barrier()?;
        let start = Instant::now();
        update(&mut sm, &mut group)?;
        samples.push(start.elapsed());
    }
    let update_ms: Vec<f64> = group.all_gather_object(&median(samples))?;
    let whole_update_ms = if world == 1 {
        let model = CausalLM::random(config(), &ModelOptions::default())?;
        let mut optimizer = AdamW::for_model(&model, AdamWConfig::default());
        let mut update = || -> Result<(), Box<dyn std::error::Error>> {
            optimizer.zero_grad();
            let scores = model.response_scores(&ids, &mask, SEQ - 1, 1.0, ScoreOutputs::NONE)?;
            (-scores.log_probs.sum(Kind::Float) / tokens).f_backward()?;
            optimizer.clip_grad_norm(1.0);
            let _applied = optimizer.step(1e-4);
            Ok(())
        };
        update()?;
        let mut samples = Vec::with_capacity(UPDATES);
        for _ in 0..UPDATES {
            let start = Instant::now();
            update()?;
            samples.push(start.elapsed());
        }
        Some(median(samples))
    } else {
        None
    };
    let ShardMemory { peak_gathered, .. } = sm.memory();
    let layer = sm
        .layouts()
        .find(|l| l.name == "layers.0")
        .map_or(0, |l| l.numel);
    let collectives = vec![
        collectives(&mut group, "one layer", layer)?,
        collectives(&mut group, "64 MiB", 16 << 20)?,
    ];
    if rank == 0 {
        let report = Report {
            world,
            persistent: sm.memory().persistent(),
            peak_gathered,
            update_ms: update_ms.into_iter().fold(0.0, f64::max),
            whole_update_ms,
            collectives,
        };
        println!("REPORT {}", serde_json::to_string(&report)?);
    }
    group.barrier()?;
    Ok(())
}

/// Runs `world` ranks of this bench; rank 0's report.
fn job(world: u32) -> Report {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    // Every rank started before any is waited for: they meet at the rendezvous.
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(std::env::current_exe().expect("the bench binary"))
                .env(RANK_ENV, rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("a rank starts")
        })
        .collect();
    let mut report = None;
    for (rank, child) in children.into_iter().enumerate() {
        let output = child.wait_with_output().expect("a rank ends");
        assert!(
            output.status.success(),
            "rank {rank}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let stdout = String::from_utf8_lossy(&output.stdout);
        if let Some(line) = stdout.lines().find_map(|l| l.strip_prefix("REPORT ")) {
            report = Some(serde_json::from_str(line).expect("a report"));
        }
    }
    report.expect("rank 0 reports")
}

fn main() {
    if let Ok(rank) = std::env::var(RANK_ENV) {
        if let Err(e) = rank_main(rank.parse().expect("a rank")) {
            eprintln!("rank {rank}: {e}");
            std::process::exit(1);
        }
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let ranks: u32 = args
        .iter()
        .position(|a| a == "--ranks")
        .and_then(|i| args.get(i + 1))
        .map_or(2, |n| n.parse().expect("--ranks N"));
    let one = job(1);
    let many = job(ranks);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!("sharded model, {ranks} ranks vs 1 (gloo, CPU, 1 intra-op thread per rank)");
    println!(
        "bytes per rank held between steps (params + grads + AdamW): {:.2} MiB vs {:.2} MiB = {:.3}",
        mib(many.persistent),
        mib(one.persistent),
        many.persistent as f64 / one.persistent as f64
    );
    println!(
        "  plus the largest gathered stage (params + full grads): {:.2} MiB vs {:.2} MiB; with it {:.3}",
        mib(many.peak_gathered),
        mib(one.peak_gathered),
        (many.persistent + many.peak_gathered) as f64 / (one.persistent + one.peak_gathered) as f64
    );
    println!(
        "update (global batch {ROWS} × {SEQ} tokens): {:.1} ms vs {:.1} ms = {:.2}×",
        many.update_ms,
        one.update_ms,
        many.update_ms / one.update_ms
    );
    if let Some(whole) = one.whole_update_ms {
        println!(
            "  the whole model on 1 rank (no gathers, no recomputation): {whole:.1} ms; sharded 1 rank = {:.2}×",
            one.update_ms / whole
        );
    }
    println!(
        "collectives at {ranks} ranks, median ms (GB/s of the full size):\n{:<10} {:>9} {:>16} {:>16} {:>16}",
        "size", "MiB", "all_gather", "reduce_scatter", "all_reduce"
    );
    for (label, bytes, gather, scatter, reduce) in &many.collectives {
        let rate = |ms: f64| *bytes as f64 / (ms * 1e-3) / 1e9;
        println!(
            "{label:<10} {:>9.2} {:>8.2} ({:>5.2}) {:>8.2} ({:>5.2}) {:>8.2} ({:>5.2})",
            mib(*bytes),
            gather,
            rate(*gather),
            scatter,
            rate(*scatter),
            reduce,
            rate(*reduce)
        );
    }
}
