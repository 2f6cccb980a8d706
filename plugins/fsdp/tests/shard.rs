//! The sharded model (`verl_plugin_fsdp::shard`) against the unsharded one, with ranks as real
//! processes over Gloo. The test binary runs itself once per rank, with the case in
//! VERL_SHARD_TEST_CASE and torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on
//! a free port); each rank also trains the unsharded model on the whole batch and asserts that
//! the two agree. `harness = false`: `main` is both the runner and the rank.
//!
//! `cargo test -p verl-plugin-fsdp --test shard [NAME-FILTER]`

#[allow(dead_code, reason = "the helpers of the engine tests, some used here")]
mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tch::{Device, Kind, Tensor};
use verl_actor::testing::{
    Engine, Share, check_outputs, check_update, check_weights, merge, seqlens, weights,
    weights_diff, with_ppo_fields,
};
use verl_actor::{ActorConfig, ActorWorker, AdamW, AdamWConfig, Role};
use verl_distributed::{Backend, Options, ProcessGroup, ReduceOp, Rendezvous};
use verl_model::testing::fixture;
use verl_model::{
    Architecture, CausalLM, Head, ModelConfig, ModelOptions, Rng, ScoreOutputs, read_safetensors,
    write_safetensors,
};
use verl_plugin_api::keys;
use verl_plugin_fsdp::shard::strategy::ShardedStrategy;
use verl_plugin_fsdp::shard::{ShardOptions, ShardedModel};

const CASE: &str = "VERL_SHARD_TEST_CASE";
const VARIANT: &str = "VERL_SHARD_TEST_VARIANT";
const DIR: &str = "VERL_SHARD_TEST_DIR";

/// fp32 agreement asked of the sharded model.
const TOLERANCE: f64 = 1e-5;
const LR: f64 = 1e-2;
/// Below the gradients' norm, so that clipping scales every step.
const MAX_NORM: f64 = 0.05;
const ROWS: i64 = 8;
const SEQ: i64 = 9;
const RESPONSE: i64 = 4;
const EXPECTED_FILE: &str = "expected.safetensors";
/// How rank 0 reports the largest difference it checked (the runner prints it).
const WORST_LINE: &str = "largest |sharded - unsharded|:";

// ---------------------------------------------------------------------------------------------
// The rank side.

/// What a case varies.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Variant {
    tied: bool,
    head: Head,
    offload: bool,
    /// A different intermediate size: a checkpoint of the other shape must be refused.
    wide: bool,
}

impl Variant {
    fn parse(text: &str) -> Self {
        let has = |flag: &str| text.split(',').any(|f| f == flag);
        Self {
            tied: has("tied"),
            head: if has("value") { Head::Value } else { Head::Lm },
            offload: has("offload"),
            wide: has("wide"),
        }
    }
}

/// Odd sizes everywhere, so that every block needs padding at 2 and 4 ranks; grouped-query
/// attention; biases on q/k/v.
fn config(variant: Variant) -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Qwen2,
        vocab_size: 37,
        hidden_size: 12,
        intermediate_size: if variant.wide { 25 } else { 23 },
        num_hidden_layers: 3,
        num_attention_heads: 3,
        num_key_value_heads: 1,
        head_dim: 4,
        rope_theta: 10000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 64,
        tie_word_embeddings: variant.tied,
        qkv_bias: true,
        o_bias: false,
        mlp_bias: false,
        initializer_range: 0.2,
        bos_token_id: None,
        eos_token_ids: vec![],
        pad_token_id: None,
        qk_norm: false,
        moe: None,
    }
}

fn model(variant: Variant) -> CausalLM {
    let options = ModelOptions {
        head: variant.head,
        seed: 7,
        ..ModelOptions::default()
    };
    CausalLM::random(config(variant), &options).unwrap()
}

fn adamw() -> AdamWConfig {
    AdamWConfig::default()
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by the parent"))
}

fn join_group() -> ProcessGroup {
    let number = |name: &str| env(name).parse::<u32>().unwrap();
    let rendezvous = Rendezvous {
        rank: number("RANK"),
        world_size: number("WORLD_SIZE"),
        master_addr: env("MASTER_ADDR"),
        master_port: number("MASTER_PORT") as u16,
    };
    let options = Options {
        timeout: Duration::from_secs(60),
        ..Options::default()
    };
    ProcessGroup::init(&rendezvous, Backend::Gloo, &options).unwrap()
}

/// The global batch of update `step`: left padding of 0–2 tokens, some responses ending early,
/// advantages of both signs (for a value head: regression targets).
struct TrainBatch {
    ids: Tensor,
    mask: Tensor,
    /// `[rows, RESPONSE]`.
    weights: Tensor,
    /// Response tokens in the whole batch: losses are normalised by it, as verl's trainer does
    /// with global counts.
    tokens: f64,
}

fn batch(step: u64) -> TrainBatch {
    let mut rng = Rng::stream(11, step);
    let ids: Vec<i64> = (0..ROWS * SEQ)
        .map(|_| (rng.next_u64() % 37) as i64)
        .collect();
    let mut mask = vec![1i64; (ROWS * SEQ) as usize];
    for row in 0..ROWS {
        for col in 0..row % 3 {
            mask[(row * SEQ + col) as usize] = 0;
        }
        if row % 2 == 1 {
            mask[(row * SEQ + SEQ - 1) as usize] = 0;
        }
    }
    let weights: Vec<f32> = (0..ROWS * RESPONSE)
        .map(|_| (rng.uniform() * 2.0 - 1.0) as f32)
        .collect();
    let mask = Tensor::from_slice(&mask).view([ROWS, SEQ]);
    let tokens = mask
        .narrow(1, SEQ - RESPONSE, RESPONSE)
        .sum(Kind::Float)
        .double_value(&[]);
    TrainBatch {
        ids: Tensor::from_slice(&ids).view([ROWS, SEQ]),
        mask,
        weights: Tensor::from_slice(&weights).view([ROWS, RESPONSE]),
        tokens,
    }
}

impl TrainBatch {
    /// Rank `rank`'s rows (every `world`-th), in micro-batches of at most two rows.
    fn micro_batches(&self, rank: u32, world: u32) -> Vec<TrainBatch> {
        let rows: Vec<i64> = (i64::from(rank)..ROWS).step_by(world as usize).collect();
        rows.chunks(2)
            .map(|chunk| {
                let index = Tensor::from_slice(chunk);
                TrainBatch {
                    ids: self.ids.index_select(0, &index),
                    mask: self.mask.index_select(0, &index),
                    weights: self.weights.index_select(0, &index),
                    tokens: self.tokens,
                }
            })
            .collect()
    }

    /// A policy-gradient-like loss with an entropy bonus (LM head), or a squared error (value
    /// head), summed over response tokens and divided by the global token count.
    fn loss(&self, model: &CausalLM, hidden: &Tensor) -> verl_model::Result<Tensor> {
        let response_mask = self
            .mask
            .narrow(1, SEQ - RESPONSE, RESPONSE)
            .to_kind(Kind::Float);
        let total = if model.head() == Head::Value {
            let values = model.response_values_from_hidden(hidden, &self.mask, RESPONSE)?;
            ((values - &self.weights).square() * response_mask).sum(Kind::Float)
        } else {
            let scores = model.response_scores_from_hidden(
                hidden,
                &self.ids,
                &self.mask,
                RESPONSE,
                0.7,
                ScoreOutputs::ENTROPY,
            )?;
            let entropy = scores.entropy.expect("asked for").sum(Kind::Float);
            -(scores.log_probs * &self.weights).sum(Kind::Float) - entropy * 0.01
        };
        Ok(total / self.tokens)
    }

    /// What `compute_log_prob` / `compute_values` return for these rows.
    fn scores(&self, model: &CausalLM, hidden: &Tensor) -> verl_model::Result<Tensor> {
        if model.head() == Head::Value {
            model.response_values_from_hidden(hidden, &self.mask, RESPONSE)
        } else {
            Ok(model
                .response_scores_from_hidden(
                    hidden,
                    &self.ids,
                    &self.mask,
                    RESPONSE,
                    0.7,
                    ScoreOutputs::NONE,
                )?
                .log_probs)
        }
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

thread_local! {
    /// The largest difference any check of this rank saw.
    static WORST: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
}

fn assert_close_value(what: &str, diff: f64) {
    WORST.with(|w| w.set(w.get().max(diff)));
    assert!(diff <= TOLERANCE, "{what}: max |difference| {diff:e}");
}

fn assert_close(what: &str, a: &Tensor, b: &Tensor) {
    assert_close_value(what, max_diff(a, b));
}

/// The unsharded model and its optimizer, trained on whole batches.
struct Reference {
    model: CausalLM,
    optimizer: AdamW,
}

impl Reference {
    fn new(variant: Variant) -> Self {
        let model = model(variant);
        let optimizer = AdamW::for_model(&model, adamw());
        Self { model, optimizer }
    }

    /// Loss, gradients (by name, before clipping), norm before clipping.
    fn backward(&mut self, batch: &TrainBatch) -> (f64, Vec<(String, Tensor)>, f64) {
        self.optimizer.zero_grad();
        let hidden = self.model.hidden_states(&batch.ids, &batch.mask).unwrap();
        let loss = batch.loss(&self.model, &hidden).unwrap();
        loss.backward();
        let grads = self
            .model
            .named_tensors()
            .into_iter()
            .map(|(name, p)| (name, p.grad().copy()))
            .collect();
        let norm = self.optimizer.clip_grad_norm(MAX_NORM);
        (loss.double_value(&[]), grads, norm)
    }
}

fn sharded(variant: Variant, group: &mut ProcessGroup) -> ShardedModel {
    let options = ShardOptions {
        optimizer: Some(adamw()),
        param_offload: variant.offload,
        optimizer_offload: variant.offload,
    };
    ShardedModel::new(model(variant), group, options).unwrap()
}

/// One update of the sharded model on this rank's rows of `batch`: the global loss (summed over
/// ranks) and the norm before clipping.
fn sharded_update(
    sm: &mut ShardedModel,
    group: &mut ProcessGroup,
    batch: &TrainBatch,
) -> (f64, f64) {
    sm.zero_grad();
    let mut loss = 0.0;
    for micro in batch.micro_batches(group.rank(), group.world_size()) {
        let context = sm.model().block_context(&micro.ids, &micro.mask).unwrap();
        let l = sm
            .forward_backward(group, &context, |model, hidden| micro.loss(model, hidden))
            .unwrap();
        loss += l.double_value(&[]);
    }
    let mut total = Tensor::from_slice(&[loss]);
    group.all_reduce(&mut total, ReduceOp::Sum).unwrap();
    let norm = sm.clip_grad_norm_global(group, MAX_NORM).unwrap();
    (total.double_value(&[0]), norm)
}

/// Each gradient shard equals this rank's slice of the unsharded gradient, padding zero.
fn assert_grads(sm: &ShardedModel, grads: &[(String, Tensor)], norm: f64, coef_applied: bool) {
    let world = sm.world_size();
    for (layout, _, grad) in sm.shards() {
        let tensors: Vec<Tensor> = layout
            .params
            .iter()
            .map(|slot| {
                grads
                    .iter()
                    .find(|(n, _)| *n == slot.name)
                    .unwrap_or_else(|| panic!("no reference gradient for {}", slot.name))
                    .1
                    .shallow_clone()
            })
            .collect();
        let flat = layout.flatten(&tensors, world, &tensors[0]);
        let len = layout.shard_len(world);
        let mut mine = flat.narrow(0, i64::from(sm.rank()) * len, len);
        if coef_applied {
            mine *= (MAX_NORM / (norm + 1e-6)).min(1.0);
        }
        assert_close(
            &format!("gradient shard of {}", layout.name),
            grad.unwrap(),
            &mine,
        );
    }
}

fn assert_weights(sm: &mut ShardedModel, group: &mut ProcessGroup, expected: &[(String, Tensor)]) {
    let gathered = sm.gather_full_weights(group).unwrap();
    let names = |w: &[(String, Tensor)]| w.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&gathered), names(expected), "parameter names");
    for ((name, a), (_, b)) in gathered.iter().zip(expected) {
        assert_close(&format!("weight {name}"), a, b);
    }
}

/// Three updates, sharded and unsharded: forward outputs, losses, gradients, norms (clipping
/// active) and the weights after each update agree.
fn play_train(group: &mut ProcessGroup, variant: Variant) {
    let mut reference = Reference::new(variant);
    let mut sm = sharded(variant, group);
    if variant.offload {
        assert_eq!(
            sm.placement(),
            (Device::Cpu, Device::Cpu),
            "offloaded state is on the host"
        );
    }
    for step in 0..3 {
        let batch = batch(step);
        // Forward only, this rank's rows.
        for micro in batch.micro_batches(group.rank(), group.world_size()) {
            let context = sm.model().block_context(&micro.ids, &micro.mask).unwrap();
            let mine = sm
                .forward(group, &context, |model, hidden| micro.scores(model, hidden))
                .unwrap();
            let full = tch::no_grad(|| {
                let hidden = reference
                    .model
                    .hidden_states(&micro.ids, &micro.mask)
                    .unwrap();
                micro.scores(&reference.model, &hidden).unwrap()
            });
            assert_close(&format!("step {step} scores"), &mine, &full);
        }
        let (ref_loss, grads, ref_norm) = reference.backward(&batch);
        let (loss, norm) = sharded_update(&mut sm, group, &batch);
        assert_close_value(
            &format!("step {step} loss {loss} vs {ref_loss}"),
            (loss - ref_loss).abs(),
        );
        assert_close_value(
            &format!("step {step} grad norm {norm} vs {ref_norm}"),
            (norm - ref_norm).abs(),
        );
        assert!(ref_norm > MAX_NORM, "clipping is active (norm {ref_norm})");
        assert_grads(&sm, &grads, norm, true);
        assert!(reference.optimizer.step(LR));
        assert!(sm.step(group, LR).unwrap());
        assert_weights(&mut sm, group, &reference.model.named_tensors());
    }
    // An update that would overflow is refused by every rank, and changes nothing.
    assert!(
        !sm.step(group, 1e39).unwrap(),
        "a non-finite update is skipped"
    );
    assert_eq!(sm.steps(), 3);
    assert_weights(&mut sm, group, &reference.model.named_tensors());
    // Persistent bytes per rank: parameters, gradients and both moments, 1/N of the padded model.
    let memory = sm.memory();
    let padded: i64 = sm.layouts().map(|l| l.shard_len(group.world_size())).sum();
    assert_eq!(memory.persistent(), 4 * 4 * padded as u64);
    assert_eq!(sm.steps(), 3);
}

/// Two updates, then the state saved in DIR; a third update's weights saved for `play_load`.
fn play_save(group: &mut ProcessGroup, variant: Variant, dir: &Path) {
    let mut sm = sharded(variant, group);
    for step in 0..2 {
        sharded_update(&mut sm, group, &batch(step));
        assert!(sm.step(group, LR).unwrap());
    }
    sm.save_shard(dir).unwrap();
    sharded_update(&mut sm, group, &batch(2));
    assert!(sm.step(group, LR).unwrap());
    let weights = sm.gather_full_weights(group).unwrap();
    if group.rank() == 0 {
        write_safetensors(&dir.join(EXPECTED_FILE), &weights).unwrap();
    }
}

/// The state of `play_save` (any world size) loaded, the third update made: the same weights.
fn play_load(group: &mut ProcessGroup, variant: Variant, dir: &Path) {
    let mut sm = sharded(variant, group);
    if variant.wide {
        let err = sm.load_shards(dir).unwrap_err().to_string();
        let layout = dir.join("fsdp_layout.json");
        assert!(
            err.starts_with(&format!(
                "{}: block `layers.0` was saved with [",
                layout.display()
            )),
            "{err}"
        );
        assert!(
            err.contains("model.layers.0.mlp.down_proj.weight [12, 23]"),
            "{err}"
        );
        return;
    }
    sm.load_shards(dir).unwrap();
    assert_eq!(sm.steps(), 2);
    sharded_update(&mut sm, group, &batch(2));
    assert!(sm.step(group, LR).unwrap());
    let expected = read_safetensors(&dir.join(EXPECTED_FILE)).unwrap();
    assert_weights(&mut sm, group, &expected);
}

/// The log-probs of `engine`'s share of a batch against `reference`'s, labelled `what`.
fn check_log_probs(
    engine: &mut impl Engine,
    reference: &mut impl Engine,
    share: &Share<'_>,
    what: &str,
) {
    check_outputs(
        engine,
        reference,
        Role::Actor,
        share,
        &[keys::LOG_PROBS],
        &mut |_, diff| assert_close_value(what, diff),
    );
}

/// The weights' check after an update (the weights' difference within the tolerance).
fn after_an_update(what: &str, diff: f64) {
    assert_close_value(&format!("{what} after an update"), diff);
}

/// verl's actor semantics (`ActorWorker`) for the section `config` on the model sharded over
/// `group`.
fn sharded_worker(
    config: &serde_json::Value,
    group: &Arc<Mutex<ProcessGroup>>,
) -> ActorWorker<ShardedStrategy> {
    let settings = serde_json::from_value::<ActorConfig>(config.clone())
        .unwrap()
        .validate()
        .unwrap();
    let model = settings.model.load(Device::Cpu, Head::Lm, 7).unwrap();
    let options = ShardOptions {
        optimizer: Some(settings.optimizer),
        ..ShardOptions::default()
    };
    let sharded = ShardedModel::new(model, &mut group.lock().unwrap(), options).unwrap();
    let spec = settings.model.clone();
    ActorWorker::new(
        settings,
        ShardedStrategy::new(sharded, Arc::clone(group), spec),
        7,
    )
}

/// verl's actor semantics (`ActorWorker`) on the sharded model, every rank with the whole
/// batch, against the `fsdp` engine (one rank, unsharded) loaded through the ABI: the same
/// log-probs; on one rank also the same update (metrics, weights), a checkpoint that resumes
/// exactly, and an export that loads back as the trained weights.
fn play_worker(group: ProcessGroup, dir: &Path) {
    let (rank, world) = (group.rank(), group.world_size());
    let group = Arc::new(Mutex::new(group));
    let config = common::actor_config(
        "tiny-llama",
        json!({"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 1,
               "use_kl_loss": true, "entropy_coeff": 0.01}),
    );
    let mut engine = common::engine(&config);
    let batch = common::ppo_batch(&mut engine, "tiny-llama");
    let whole = Share::whole(&batch);
    let new_worker = || sharded_worker(&config, &group);
    let mut worker = new_worker();
    check_log_probs(&mut worker, &mut engine, &whole, "log-probs");
    if world > 1 {
        // Every rank had the whole batch: the sum over ranks is not the one-rank update (the
        // trainer's global normalisation does that), but the ranks stay in step.
        let metrics = worker.update_actor(&batch).unwrap();
        assert!(metrics.iter().all(|m| m.value.is_finite()), "{metrics:?}");
        return;
    }
    let (metrics, _) = check_update(
        &mut worker,
        &mut engine,
        Role::Actor,
        &whole,
        None,
        &mut assert_close_value,
    );
    assert!(metrics.iter().all(|m| m.value.is_finite()), "{metrics:?}");
    let trained = weights(&mut worker);
    check_weights(&trained, &weights(&mut engine), &mut after_an_update);
    // A checkpoint, one more update; a fresh worker resumed from it makes the same update.
    worker.save_checkpoint(&dir.join("ckpt"), 1).unwrap();
    worker.update_actor(&batch).unwrap();
    let uninterrupted = weights(&mut worker);
    let mut resumed = new_worker();
    assert_eq!(resumed.load_checkpoint(&dir.join("ckpt")).unwrap(), 1);
    resumed.update_actor(&batch).unwrap();
    assert_eq!(
        weights_diff(&uninterrupted, &weights(&mut resumed)),
        0.0,
        "resumed = uninterrupted, exactly"
    );
    worker.export_hf(&dir.join("hf")).unwrap();
    if rank == 0 {
        let exported =
            CausalLM::from_pretrained(&dir.join("hf"), &ModelOptions::default()).unwrap();
        for ((name, t), w) in exported.named_tensors().iter().zip(&uninterrupted) {
            assert_eq!(*name, w.name);
            let mine = verl_model::interop::to_tch(name, &w.tensor, Device::Cpu).unwrap();
            assert!(t.equal(&mine), "exported {name}");
        }
        assert!(
            dir.join("hf/tokenizer.json").exists(),
            "tokenizer files come along"
        );
    }
}

/// verl's `use_dynamic_bsz` on the sharded model over 2 ranks whose rows need different numbers
/// of token-budget micro-batches (the shorter half of the batch on rank 0): every rank runs as
/// many as the rank that needs most (verl's `same_micro_num_in_dp`; the per-block gathers pair up
/// only so), and the log-probs and the update equal one rank's — the `fsdp` engine, unsharded,
/// fixed micro-batches — on the whole batch.
fn play_dynamic(group: ProcessGroup) {
    let rank = group.rank() as usize;
    assert_eq!(group.world_size(), 2);
    let group = Arc::new(Mutex::new(group));
    let (batch, width) = common::varied_batch("tiny-llama");
    let lens = seqlens(&batch);
    let mut by_length: Vec<usize> = (0..lens.len()).collect();
    by_length.sort_by_key(|&i| (lens[i], i));
    let half = lens.len() / 2;
    let counts: Vec<usize> = by_length
        .chunks(half)
        .map(|rows| {
            let mine: Vec<u64> = rows.iter().map(|&i| lens[i]).collect();
            verl_seqlen_balancing::micro_batch_count(&mine, width as u64, width as u64).unwrap()
        })
        .collect();
    assert!(
        counts[0] < counts[1],
        "the ranks need {counts:?} micro-batches"
    );
    let mut mine = by_length[rank * half..(rank + 1) * half].to_vec();
    mine.sort_unstable();

    let whole_config = common::actor_config(
        "tiny-llama",
        json!({"ppo_mini_batch_size": 2 * half, "ppo_micro_batch_size_per_gpu": 2,
               "use_kl_loss": true, "entropy_coeff": 0.01}),
    );
    let mut whole = common::engine(&whole_config);
    let batch = with_ppo_fields(&mut whole, batch, 0);
    let mut config = whole_config.clone();
    merge(
        &mut config,
        json!({"ppo_mini_batch_size": half, "ppo_micro_batch_size_per_gpu": null,
               "use_dynamic_bsz": true, "ppo_max_token_len_per_gpu": width}),
    );
    let mut worker = sharded_worker(&config, &group);
    let share = Share::rows(&batch, mine);
    check_log_probs(&mut worker, &mut whole, &share, "log-probs");
    let keys = [
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/loss",
        "actor/grad_norm",
    ];
    check_update(
        &mut worker,
        &mut whole,
        Role::Actor,
        &share,
        Some(&keys),
        &mut assert_close_value,
    );
    let trained = weights(&mut worker);
    check_weights(&trained, &weights(&mut whole), &mut after_an_update);
}

/// Rank 0 reports the largest difference its checks saw.
fn report_worst(rank: u32) {
    if rank == 0 {
        eprintln!("{WORST_LINE} {:e}", WORST.with(std::cell::Cell::get));
    }
}

fn rank_main(case: &str) {
    let variant = Variant::parse(&std::env::var(VARIANT).unwrap_or_default());
    let mut group = join_group();
    match case {
        "train" => play_train(&mut group, variant),
        "save" => play_save(&mut group, variant, Path::new(&env(DIR))),
        "load" => play_load(&mut group, variant, Path::new(&env(DIR))),
        "worker" => {
            let rank = group.rank();
            play_worker(group, Path::new(&env(DIR)));
            return report_worst(rank);
        }
        "dynamic" => {
            let rank = group.rank();
            play_dynamic(group);
            return report_worst(rank);
        }
        other => panic!("unknown case {other}"),
    }
    group.barrier().unwrap();
    if matches!(case, "train" | "load") && !variant.wide {
        report_worst(group.rank());
    }
}

// ---------------------------------------------------------------------------------------------
// The runner side.

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `case` on `world` ranks and asserts that every rank succeeds.
fn run(case: &str, world: u32, variant: &str, dir: Option<&Path>) {
    let port = free_port().to_string();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            let mut command = Command::new(std::env::current_exe().unwrap());
            command
                .env(CASE, case)
                .env(VARIANT, variant)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                // Ranks share 2 cores: one thread each.
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            if let Some(dir) = dir {
                command.env(DIR, dir);
            }
            command.spawn().unwrap()
        })
        .collect();
    verl_testkit::join_ranks(
        &format!("{case} [{variant}] on {world} ranks"),
        children,
        WORST_LINE,
    );
}

fn train(world: u32, variant: &str) {
    run("train", world, variant, None);
}

/// `fsdp_config`'s offload keys run the engine on the sharded model (one rank here): through
/// the ABI, the same log-probs, update metrics and weights as the whole model's, for the actor
/// and the reference.
fn engine_offload() {
    let offload = json!({"fsdp_config": {"param_offload": true, "optimizer_offload": true}});
    for model in ["tiny-llama", "tiny-qwen2"] {
        let whole_config = common::actor_config(
            model,
            json!({"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 1,
                   "use_kl_loss": true, "entropy_coeff": 0.01}),
        );
        let mut offloaded_config = whole_config.clone();
        merge(&mut offloaded_config, offload.clone());
        let mut whole = common::engine(&whole_config);
        let mut offloaded = common::engine(&offloaded_config);
        let batch = common::ppo_batch(&mut whole, model);
        let share = Share::whole(&batch);
        let mut check = |what: &str, diff| assert_close_value(&format!("{model} {what}"), diff);
        check_log_probs(
            &mut offloaded,
            &mut whole,
            &share,
            &format!("{model} log-probs"),
        );
        check_update(
            &mut offloaded,
            &mut whole,
            Role::Actor,
            &share,
            None,
            &mut check,
        );
        check_weights(
            &weights(&mut offloaded),
            &weights(&mut whole),
            &mut |what, diff| check(&format!("{what} after an update"), diff),
        );
        // The offloaded engine's checkpoint is the sharded model's.
        let dir = tempfile::tempdir().unwrap();
        offloaded
            .save_checkpoint(dir.path().to_str().unwrap(), 1)
            .unwrap();
        for file in ["fsdp_layout.json", "fsdp_shard_00000_of_00001.safetensors"] {
            assert!(dir.path().join(file).exists(), "{model}: {file}");
        }
        let mut reference_config = json!({"role": "ref", "model": {"path": fixture(model)}});
        let mut reference = common::engine(&reference_config);
        merge(&mut reference_config, offload.clone());
        let mut offloaded_reference = common::engine(&reference_config);
        check_log_probs(
            &mut offloaded_reference,
            &mut reference,
            &share,
            &format!("{model} reference log-probs"),
        );
    }
    eprintln!("  {WORST_LINE} {:e}", WORST.with(std::cell::Cell::get));
}

/// Saved at `from` ranks, loaded at `to`.
fn reshard(from: u32, to: u32) {
    let dir = tempfile::tempdir().unwrap();
    run("save", from, "", Some(dir.path()));
    run("load", to, "", Some(dir.path()));
}

fn main() {
    if let Ok(case) = std::env::var(CASE) {
        rank_main(&case);
        return;
    }
    let tests: &[(&str, fn())] = &[
        ("train_1_rank", || train(1, "")),
        ("train_2_ranks", || train(2, "")),
        ("train_4_ranks", || train(4, "")),
        ("train_tied_2_ranks", || train(2, "tied")),
        ("train_tied_4_ranks", || train(4, "tied")),
        ("train_value_head_2_ranks", || train(2, "value")),
        ("train_offload_2_ranks", || train(2, "offload")),
        ("train_offload_tied_4_ranks", || train(4, "offload,tied")),
        ("reshard_2_to_1", || reshard(2, 1)),
        ("reshard_1_to_2", || reshard(1, 2)),
        ("reshard_4_to_2", || reshard(4, 2)),
        ("worker_1_rank", || {
            let dir = tempfile::tempdir().unwrap();
            run("worker", 1, "", Some(dir.path()));
        }),
        ("token_budget_2_ranks", || run("dynamic", 2, "", None)),
        ("worker_2_ranks", || {
            let dir = tempfile::tempdir().unwrap();
            run("worker", 2, "", Some(dir.path()));
        }),
        ("engine_offload_runs_the_sharded_model", engine_offload),
        ("load_refuses_another_shape", || {
            let dir = tempfile::tempdir().unwrap();
            run("save", 2, "", Some(dir.path()));
            run("load", 2, "wide", Some(dir.path()));
        }),
    ];
    verl_testkit::run_rank_tests(tests);
}
