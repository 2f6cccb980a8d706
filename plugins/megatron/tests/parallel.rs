//! The `megatron` engine through the plugin ABI, with ranks as real processes over Gloo, against
//! the `fsdp` engine on one rank with the whole batch. The test binary runs itself once per rank
//! (the case in VERL_MEGATRON_TEST_CASE, torchrun's variables on a free port); every rank gets
//! its contiguous slice of the global batch as the trainer hands it out, and checks per-token
//! log-probs and entropy, the update metrics (losses, grad-norm) and the weights after each of 3
//! AdamW updates against the one-rank engine's (verl-actor's conformance checks).
//! `harness = false`: `main` is both the runner and the rank.
//!
//! `cargo test -p verl-plugin-megatron --test parallel [NAME-FILTER]`

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};
use verl_actor::Role;
use verl_actor::testing::{
    GROUPING_FREE_METRICS, Share, check_outputs, check_update, check_weights, layout, merge,
    metric, plugin_engine, set_meta, update, weights, with_ppo_fields,
};
use verl_model::interop::{from_tch, to_tch};
use verl_model::testing::fixture;
use verl_model::{
    Architecture, CausalLM, ModelConfig, ModelOptions, Rng, read_safetensors, write_safetensors,
};
use verl_plugin_api::{Batch, ComponentInit, ComponentKind, NamedTensor, RunContext, Tensor, keys};
use verl_plugin_host::EngineHandle;
use verl_testkit::{PluginHarness, built_plugin};

const CASE: &str = "VERL_MEGATRON_TEST_CASE";
const MODEL: &str = "VERL_MEGATRON_TEST_MODEL";
const PARALLEL: &str = "VERL_MEGATRON_TEST_PARALLEL";
const DIR: &str = "VERL_MEGATRON_TEST_DIR";
/// Set: the megatron engine runs packed (THD) batches (`model.use_remove_padding`); the
/// one-rank reference stays padded.
const PACKED: &str = "VERL_MEGATRON_TEST_PACKED";
/// fp32 agreement asked of the tensor-parallel engine.
const TOLERANCE: f64 = 1e-5;
/// Global batch rows: they split evenly over 2 and 4 ranks, as the trainer requires of updates.
const ROWS: usize = 8;
const UPDATES: u64 = 3;
/// How rank 0 reports the largest difference it checked (the runner prints it).
const WORST_LINE: &str = "largest |megatron - fsdp|:";
const EXPECTED_FILE: &str = "expected.safetensors";

thread_local! {
    static WORST: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
}

fn assert_close(what: &str, diff: f64) {
    WORST.with(|w| w.set(w.get().max(diff)));
    assert!(diff <= TOLERANCE, "{what}: differs by {diff:e}");
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by the parent"))
}

// ---------------------------------------------------------------------------------------------
// Models: small, with every feature the layout must respect.

/// Qwen2 with q/k/v biases and grouped-query attention (`kv` key/value heads for 4 query heads;
/// 1 is replicated over 2 ranks), or Llama with tied embeddings and biases on o and the MLP;
/// `…-odd-vocab`: with 67 tokens, which no tensor-parallel size divides (the vocab-parallel
/// shards are padded).
fn model_config(name: &str) -> ModelConfig {
    if let Some(base) = name.strip_suffix("-odd-vocab") {
        return ModelConfig {
            vocab_size: 67,
            ..model_config(base)
        };
    }
    let qwen2 = |kv| ModelConfig {
        architecture: Architecture::Qwen2,
        vocab_size: 64,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: kv,
        head_dim: 4,
        rope_theta: 10000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
        qkv_bias: true,
        o_bias: false,
        mlp_bias: false,
        initializer_range: 0.2,
        bos_token_id: None,
        eos_token_ids: vec![],
        pad_token_id: None,
        qk_norm: false,
        moe: None,
    };
    match name {
        "qwen2-gqa" => qwen2(2),
        "qwen2-kv1" => qwen2(1),
        "llama-tied" => ModelConfig {
            architecture: Architecture::Llama,
            tie_word_embeddings: true,
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            ..qwen2(4)
        },
        other => panic!("unknown model {other}"),
    }
}

/// A Hugging Face directory for `name`: a generated model, or a committed fixture.
fn model_dir(name: &str, root: &Path) -> PathBuf {
    if name.starts_with("tiny-") {
        return fixture(name);
    }
    let dir = root.join(name);
    let options = ModelOptions {
        seed: 3,
        ..ModelOptions::default()
    };
    CausalLM::random(model_config(name), &options)
        .unwrap()
        .save_pretrained(&dir, None)
        .unwrap();
    dir
}

// ---------------------------------------------------------------------------------------------
// The rank side.

fn actor_config(model: &Path, megatron: Option<Value>) -> Value {
    role_config("actor", model, megatron)
}

fn role_config(role: &str, model: &Path, megatron: Option<Value>) -> Value {
    let mut config = json!({
        "role": role,
        "model": {"path": model},
        "optim": {"lr": 1e-3},
        "ppo_mini_batch_size": ROWS,
        "ppo_micro_batch_size_per_gpu": 2,
        "use_kl_loss": true,
        "entropy_coeff": 0.01,
        // Below the gradients' norm: clipping scales every update.
        "grad_clip": 0.05,
    });
    if let Some(section) = megatron {
        config["megatron"] = section;
    }
    config
}

fn vocab_of(model: &Path) -> i64 {
    ModelConfig::from_dir(model).unwrap().vocab_size
}

fn number(name: &str) -> u32 {
    env(name).parse().unwrap()
}

fn run_context() -> RunContext {
    let mut run = RunContext::default();
    run.seed = 7;
    run.rank = number("RANK");
    run.world_size = number("WORLD_SIZE");
    run.master_addr = env("MASTER_ADDR");
    run.master_port = number("MASTER_PORT") as u16;
    run
}

fn megatron_engine(config: &Value) -> EngineHandle {
    let mut config = config.clone();
    if std::env::var_os(PACKED).is_some() {
        config["model"]["use_remove_padding"] = json!(true);
    }
    let mut engine = plugin_engine("verl_plugin_megatron", "megatron", 100);
    engine
        .init(&ComponentInit::new(config, run_context()))
        .unwrap_or_else(|e| panic!("megatron init: {e}"));
    engine
}

/// The reference: the `fsdp` engine on one rank, given the whole batch.
fn fsdp_engine(config: &Value) -> EngineHandle {
    let mut run = RunContext::default();
    run.seed = 7;
    let mut engine = plugin_engine("verl_plugin_fsdp", "fsdp", 100);
    engine
        .init(&ComponentInit::new(config.clone(), run))
        .unwrap_or_else(|e| panic!("fsdp init: {e}"));
    engine
}

/// This rank's share of `batch`, as the trainer hands it out.
fn share(batch: &Batch) -> Share<'_> {
    Share::of_rank(
        batch,
        number("RANK") as usize,
        number("WORLD_SIZE") as usize,
    )
}

/// The actor's per-token outputs (log-probs, entropy, Σπ²) for this rank's share of `batch`
/// against the reference's, each labelled `"{key}{context}"`.
fn check_actor_outputs(
    engine: &mut EngineHandle,
    reference: &mut EngineHandle,
    batch: &Batch,
    context: &str,
) {
    check_outputs(
        engine,
        reference,
        Role::Actor,
        &share(batch),
        &[keys::LOG_PROBS, keys::ENTROPYS, keys::SUM_PI_SQUARED],
        &mut |key, diff| assert_close(&format!("{key}{context}"), diff),
    );
}

/// A global batch of `rows` sequences of 9–13 tokens (prompts left-padded, responses
/// right-padded to different lengths), the same on every rank.
fn global_batch(vocab: i64, rows: usize) -> Batch {
    let mut rng = Rng::stream(5, 0);
    let seqs: Vec<Vec<i64>> = (0..rows)
        .map(|i| {
            (0..9 + i % 5)
                .map(|_| (rng.next_u64() % vocab as u64) as i64)
                .collect()
        })
        .collect();
    let (mut batch, _) = layout(&seqs);
    set_meta(
        &mut batch,
        json!({"temperature": 0.7, "calculate_entropy": true, "calculate_sum_pi_squared": true}),
    );
    batch
}

/// The PPO batch of update `step`: old log-probs from the reference engine (so the ratio starts
/// at 1 and moves with later updates), advantages of both signs, the reference policy = old.
fn ppo_batch(reference: &mut EngineHandle, step: u64, vocab: i64) -> Batch {
    with_ppo_fields(reference, global_batch(vocab, ROWS), step)
}

/// The weights of `engine` and `reference` after update `step`.
fn compare_weights(step: u64, engine: &mut EngineHandle, reference: &mut EngineHandle) {
    check_weights(&weights(engine), &weights(reference), &mut |what, diff| {
        assert_close(&format!("{what} after update {step}"), diff)
    });
}

/// Log-probs, entropy, 3 updates (metrics and weights after each) and the export, against
/// the one-rank `fsdp` engine.
fn play_parity(model: &Path, megatron: Value, dir: &Path) {
    let rank = number("RANK");
    let vocab = vocab_of(model);
    let mut reference = fsdp_engine(&actor_config(model, None));
    let mut engine = megatron_engine(&actor_config(model, Some(megatron)));
    // Forward only, also with slices of different sizes (7 rows).
    for rows in [ROWS, ROWS - 1] {
        check_actor_outputs(&mut engine, &mut reference, &global_batch(vocab, rows), "");
    }
    for step in 0..UPDATES {
        let batch = ppo_batch(&mut reference, step, vocab);
        let (_, want) = check_update(
            &mut engine,
            &mut reference,
            Role::Actor,
            &share(&batch),
            None,
            &mut |what, diff| assert_close(&format!("update {step} {what}"), diff),
        );
        assert!(
            metric(&want, "actor/grad_norm") > 0.05,
            "clipping is active"
        );
        compare_weights(step, &mut engine, &mut reference);
    }
    // The export: what the fsdp engine writes for the same weights.
    engine
        .export_hf(dir.join("megatron").to_str().unwrap())
        .unwrap();
    if rank == 0 {
        reference
            .export_hf(dir.join("fsdp").to_str().unwrap())
            .unwrap();
        let read = |engine: &str| {
            let config = std::fs::read_to_string(dir.join(engine).join("config.json")).unwrap();
            (
                config,
                read_safetensors(&dir.join(engine).join("model.safetensors")).unwrap(),
            )
        };
        let ((config, got), (want_config, want)) = (read("megatron"), read("fsdp"));
        assert_eq!(config, want_config, "config.json");
        let names =
            |w: &[(String, tch::Tensor)]| w.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&got), names(&want), "exported names");
        for ((name, a), (_, b)) in got.iter().zip(&want) {
            let diff = (a - b).abs().max().double_value(&[]);
            assert_close(&format!("exported {name}"), diff);
        }
    }
}

/// A critic (value head, replicated): values and 3 updates against the one-rank engine's.
fn play_critic(model: &Path, megatron: Value) {
    let mut reference = fsdp_engine(&role_config("critic", model, None));
    let mut engine = megatron_engine(&role_config("critic", model, Some(megatron)));
    for step in 0..UPDATES {
        let mut batch = global_batch(vocab_of(model), ROWS);
        let values = check_outputs(
            &mut engine,
            &mut reference,
            Role::Critic,
            &share(&batch),
            &[keys::VALUES],
            &mut |_, diff| assert_close(&format!("values before update {step}"), diff),
        );
        let values = values.require(keys::VALUES).unwrap().clone();
        let returns: Vec<f32> = values
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, v)| v + [0.5f32, -1.0, 0.25][i % 3])
            .collect();
        let shape = values.shape.to_vec();
        batch.insert(keys::RETURNS, Tensor::from_slice(&shape, &returns).unwrap());
        batch.insert(keys::VALUES, values);
        check_update(
            &mut engine,
            &mut reference,
            Role::Critic,
            &share(&batch),
            None,
            &mut |what, diff| assert_close(&format!("critic update {step} {what}"), diff),
        );
        compare_weights(step, &mut engine, &mut reference);
    }
}

/// A batch of `rows` rows `width` tokens wide: prompts of `width / 2` tokens (row `i` with
/// `i % prompt` of them padding), responses of the rest (row `i` ending up to `i` tokens early).
fn batch_of_width(vocab: i64, rows: usize, width: usize) -> Batch {
    let prompt = (width / 2).max(1);
    let response = width - prompt;
    let real = |i: usize, c: usize| c >= i % prompt && c < width - i.min(response - 1);
    let mut rng = Rng::stream(13, width as u64);
    verl_batch(&mut rng, vocab, rows, prompt, width, real, 1.0)
}

/// `rows` rows of random ids `width` wide, the first `prompt` columns the prompt, `real(row,
/// column)` marking the real tokens, verl's keys, at `temperature`.
fn verl_batch(
    rng: &mut Rng,
    vocab: i64,
    rows: usize,
    prompt: usize,
    width: usize,
    real: impl Fn(usize, usize) -> bool,
    temperature: f64,
) -> Batch {
    let (mut ids, mut mask, mut responses) =
        (Vec::<i64>::new(), Vec::<i64>::new(), Vec::<i64>::new());
    let mut response_mask = Vec::<f32>::new();
    for i in 0..rows {
        let row: Vec<i64> = (0..width)
            .map(|_| (rng.next_u64() % vocab as u64) as i64)
            .collect();
        ids.extend(&row);
        mask.extend((0..width).map(|c| i64::from(real(i, c))));
        responses.extend(&row[prompt..]);
        response_mask.extend((prompt..width).map(|c| if real(i, c) { 1f32 } else { 0.0 }));
    }
    let (b, w, r) = (rows as i64, width as i64, (width - prompt) as i64);
    let mut batch = Batch::default();
    batch.insert(keys::INPUT_IDS, Tensor::from_slice(&[b, w], &ids).unwrap());
    batch.insert(
        keys::ATTENTION_MASK,
        Tensor::from_slice(&[b, w], &mask).unwrap(),
    );
    batch.insert(
        keys::RESPONSES,
        Tensor::from_slice(&[b, r], &responses).unwrap(),
    );
    batch.insert(
        keys::RESPONSE_MASK,
        Tensor::from_slice(&[b, r], &response_mask).unwrap(),
    );
    set_meta(
        &mut batch,
        json!({"temperature": temperature, "calculate_entropy": true,
               "calculate_sum_pi_squared": true}),
    );
    batch
}

/// Every sequence width from 2 to `2·tp·cp·2 + 1` tokens (each padded to the layout's
/// multiple inside the engine): the log-probs and entropy of the one-rank engine.
fn play_widths(model: &Path, megatron: Value) {
    let tp = megatron["tensor_model_parallel_size"].as_u64().unwrap_or(1) as usize;
    let cp = megatron["context_parallel_size"].as_u64().unwrap_or(1) as usize;
    let mut reference = fsdp_engine(&actor_config(model, None));
    let mut engine = megatron_engine(&actor_config(model, Some(megatron)));
    for width in 2..=2 * tp * cp * 2 + 1 {
        let batch = batch_of_width(vocab_of(model), ROWS, width);
        check_actor_outputs(
            &mut engine,
            &mut reference,
            &batch,
            &format!(" at width {width}"),
        );
    }
}

/// One row per real length in `lengths`: a prompt of half of it (at least one token, left-padded)
/// and a response of the rest (right-padded; none for a length of 1).
fn batch_of_lengths(vocab: i64, lengths: &[usize]) -> Batch {
    let prompt_of = |len: usize| len.div_ceil(2);
    let prompt = lengths.iter().map(|&l| prompt_of(l)).max().unwrap();
    let response = lengths.iter().map(|&l| l - prompt_of(l)).max().unwrap();
    let real = |i: usize, c: usize| {
        let (p, r) = (prompt_of(lengths[i]), lengths[i] - prompt_of(lengths[i]));
        c >= prompt - p && c < prompt + r
    };
    let mut rng = Rng::stream(17, lengths.len() as u64);
    let width = prompt + response.max(1);
    verl_batch(&mut rng, vocab, lengths.len(), prompt, width, real, 0.7)
}

/// verl's THD alignment: every sequence length from 1 to `2·tp·cp·2 + 1`, packed together (short
/// and long rows interleaved) into each rank's one micro-batch, against the one-rank engine on
/// the padded batch.
fn play_lengths(model: &Path, megatron: Value) {
    let tp = megatron["tensor_model_parallel_size"].as_u64().unwrap_or(1) as usize;
    let cp = megatron["context_parallel_size"].as_u64().unwrap_or(1) as usize;
    let longest = 2 * tp * cp * 2 + 1;
    let lengths: Vec<usize> = (0..longest)
        .map(|i| {
            if i % 2 == 0 {
                1 + i / 2
            } else {
                longest - i / 2
            }
        })
        .collect();
    let mut reference = fsdp_engine(&actor_config(model, None));
    let mut engine = megatron_engine(&actor_config(model, Some(megatron)));
    let batch = batch_of_lengths(vocab_of(model), &lengths);
    check_actor_outputs(
        &mut engine,
        &mut reference,
        &batch,
        &format!(" of lengths 1..={longest}"),
    );
}

/// Two updates, a checkpoint in DIR, then a third update whose weights rank 0 saves.
fn play_save(model: &Path, megatron: Value, dir: &Path) {
    let mut reference = fsdp_engine(&actor_config(model, None));
    let mut engine = megatron_engine(&actor_config(model, Some(megatron)));
    let vocab = vocab_of(model);
    for step in 0..UPDATES {
        if step == UPDATES - 1 {
            engine.save_checkpoint(dir.to_str().unwrap(), step).unwrap();
        }
        let batch = ppo_batch(&mut reference, step, vocab);
        update(&mut engine, &share(&batch).local());
    }
    let weights = weights(&mut engine);
    if number("RANK") == 0 {
        let tensors: Vec<(String, tch::Tensor)> = weights
            .iter()
            .map(|w| {
                let t = to_tch(&w.name, &w.tensor, tch::Device::Cpu).unwrap();
                (w.name.to_string(), t)
            })
            .collect();
        write_safetensors(&dir.join(EXPECTED_FILE), &tensors).unwrap();
    }
}

/// The checkpoint of `play_save` (any tensor-parallel size) loaded, the last update made: the
/// weights of the uninterrupted run.
fn play_load(model: &Path, megatron: Value, dir: &Path) {
    let mut reference = fsdp_engine(&actor_config(model, None));
    let mut engine = megatron_engine(&actor_config(model, Some(megatron)));
    assert_eq!(
        engine.load_checkpoint(dir.to_str().unwrap()).unwrap(),
        UPDATES - 1
    );
    let batch = ppo_batch(&mut reference, UPDATES - 1, vocab_of(model));
    update(&mut engine, &share(&batch).local());
    let got = weights(&mut engine);
    let want: Vec<NamedTensor> = read_safetensors(&dir.join(EXPECTED_FILE))
        .unwrap()
        .into_iter()
        .map(|(name, t)| NamedTensor::new(name.clone(), from_tch(&name, &t).unwrap()))
        .collect();
    check_weights(&got, &want, &mut |what, diff| {
        assert_close(&format!("{what} after resuming"), diff)
    });
}

/// `use_dynamic_bsz` on the megatron engine: log-probs and 3 updates with micro-batches by a
/// token budget — per rank the smallest verl accepts, which verl's Megatron worker multiplies by
/// the context-parallel size — equal the one-rank `fsdp` engine's with fixed micro-batches.
fn play_token_budget(model: &Path, megatron: Value) {
    let vocab = vocab_of(model);
    let cp = megatron["context_parallel_size"].as_u64().unwrap_or(1) as usize;
    // AdamW amplifies fp32 summation-order differences in proportion to lr (see the fsdp
    // engine's token-budget test): half the parity tests' lr keeps them below the tolerance.
    let lr = json!({"optim": {"lr": 5e-4}});
    let mut reference_config = actor_config(model, None);
    merge(&mut reference_config, lr.clone());
    let mut reference = fsdp_engine(&reference_config);
    let width = global_batch(vocab, ROWS)
        .require(keys::INPUT_IDS)
        .unwrap()
        .shape[1] as usize;
    let mut config = actor_config(model, Some(megatron));
    merge(&mut config, lr);
    merge(
        &mut config,
        json!({"use_dynamic_bsz": true, "ppo_micro_batch_size_per_gpu": null,
               "ppo_max_token_len_per_gpu": width.div_ceil(cp)}),
    );
    let mut engine = megatron_engine(&config);
    for step in 0..UPDATES {
        let batch = ppo_batch(&mut reference, step, vocab);
        check_actor_outputs(
            &mut engine,
            &mut reference,
            &batch,
            &format!(" before update {step}"),
        );
        check_update(
            &mut engine,
            &mut reference,
            Role::Actor,
            &share(&batch),
            Some(&GROUPING_FREE_METRICS),
            &mut |what, diff| assert_close(&format!("update {step} {what}"), diff),
        );
        compare_weights(step, &mut engine, &mut reference);
    }
}

fn rank_main(case: &str) {
    let model = PathBuf::from(env(MODEL));
    let megatron: Value = serde_json::from_str(&env(PARALLEL)).unwrap();
    let dir = PathBuf::from(env(DIR));
    match case {
        "parity" => play_parity(&model, megatron, &dir),
        "critic" => play_critic(&model, megatron),
        "widths" => play_widths(&model, megatron),
        "lengths" => play_lengths(&model, megatron),
        "token_budget" => play_token_budget(&model, megatron),
        "save" => play_save(&model, megatron, &dir),
        "load" => play_load(&model, megatron, &dir),
        other => panic!("unknown case {other}"),
    }
    if number("RANK") == 0 {
        eprintln!("{WORST_LINE} {:e}", WORST.with(std::cell::Cell::get));
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

/// Runs `case` on `world` ranks with the `megatron` section `parallel` and asserts that every
/// rank succeeds.
fn run(case: &str, world: u32, model: &Path, parallel: &Value, dir: &Path) {
    run_layout(case, world, model, parallel, dir, false);
}

/// [`run`], with the megatron engine on packed batches when `packed`.
fn run_layout(case: &str, world: u32, model: &Path, parallel: &Value, dir: &Path, packed: bool) {
    let port = free_port().to_string();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            let mut command = Command::new(std::env::current_exe().unwrap());
            if packed {
                command.env(PACKED, "1");
            }
            command
                .env(CASE, case)
                .env(MODEL, model)
                .env(PARALLEL, parallel.to_string())
                .env(DIR, dir)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                // Ranks share 2 cores: one thread each.
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let layout = if packed { "packed " } else { "" };
    verl_testkit::join_ranks(
        &format!("{layout}{case} {parallel} on {world} ranks"),
        children,
        WORST_LINE,
    );
}

fn parity(model: &str, world: u32, tp: u32, sp: bool) {
    let parallel = json!({"tensor_model_parallel_size": tp, "sequence_parallel": sp});
    parity_with(model, world, &parallel);
}

fn parity_with(model: &str, world: u32, parallel: &Value) {
    let dir = tempfile::tempdir().unwrap();
    let path = model_dir(model, dir.path());
    run("parity", world, &path, parallel, dir.path());
}

/// Context parallelism `cp` with tensor parallelism `tp` (sequence parallel) on `world` ranks.
fn context(model: &str, world: u32, tp: u32, cp: u32) {
    let parallel = json!({"tensor_model_parallel_size": tp, "context_parallel_size": cp});
    parity_with(model, world, &parallel);
}

fn critic(model: &str, world: u32, parallel: Value) {
    let dir = tempfile::tempdir().unwrap();
    let path = model_dir(model, dir.path());
    run("critic", world, &path, &parallel, dir.path());
}

/// `case` on packed batches (`model.use_remove_padding`) on `world` ranks.
fn packed(case: &str, model: &str, world: u32, parallel: Value) {
    let dir = tempfile::tempdir().unwrap();
    let path = model_dir(model, dir.path());
    run_layout(case, world, &path, &parallel, dir.path(), true);
}

/// Layouts the engine does not build are refused at `init`, naming the key (one process).
fn unbuilt_layouts_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir("qwen2-gqa", dir.path());
    let harness = PluginHarness::load_alone(built_plugin("verl_plugin_megatron")).unwrap();
    let path = "actor_rollout_ref.actor.megatron";
    for (section, key) in [
        (
            json!({"pipeline_model_parallel_size": 2}),
            "pipeline_model_parallel_size",
        ),
        (json!({"context_parallel_size": 0}), "context_parallel_size"),
        (json!({"optimizer_offload": true}), "optimizer_offload"),
        (
            json!({"tensor_model_parallel_size": 0}),
            "tensor_model_parallel_size",
        ),
        (
            json!({"tensor_model_parallel_size": 1, "sequence_paralel": true}),
            "sequence_paralel",
        ),
    ] {
        let mut engine = harness
            .component(ComponentKind::ENGINE, "megatron")
            .create_engine()
            .unwrap();
        let init = ComponentInit::new(actor_config(&model, Some(section)), RunContext::default());
        let err = engine.init(&init).unwrap_err().to_string();
        assert!(err.contains(&format!("`{path}.{key}`")), "{err}");
    }
}

/// `model` saved at tensor-parallel size `from` (2 ranks), loaded at `to`.
fn reshard(model: &str, from: u32, to: u32) {
    let dir = tempfile::tempdir().unwrap();
    let path = model_dir(model, dir.path());
    // Made by the engine, as the trainer expects.
    let ckpt = dir.path().join("ckpt");
    let section = |tp: u32| json!({"tensor_model_parallel_size": tp});
    run("save", from, &path, &section(from), &ckpt);
    run("load", to, &path, &section(to), &ckpt);
}

fn main() {
    if let Ok(case) = std::env::var(CASE) {
        rank_main(&case);
        return;
    }
    let tests: &[(&str, fn())] = &[
        ("tp2_qwen2_gqa_bias", || parity("qwen2-gqa", 2, 2, false)),
        ("tp2_sp_qwen2_gqa_bias", || parity("qwen2-gqa", 2, 2, true)),
        ("tp2_qwen2_kv_heads_replicated", || {
            parity("qwen2-kv1", 2, 2, false)
        }),
        ("tp2_sp_qwen2_kv_heads_replicated", || {
            parity("qwen2-kv1", 2, 2, true)
        }),
        ("tp2_llama_tied", || parity("llama-tied", 2, 2, false)),
        ("tp2_sp_llama_tied", || parity("llama-tied", 2, 2, true)),
        ("tp2_sp_fixture_tiny_qwen2", || {
            parity("tiny-qwen2", 2, 2, true)
        }),
        ("tp2_sp_fixture_tiny_llama", || {
            parity("tiny-llama", 2, 2, true)
        }),
        ("dp2_tp2_sp_qwen2_gqa", || parity("qwen2-gqa", 4, 2, true)),
        ("tp1_one_rank", || parity("llama-tied", 1, 1, true)),
        ("tp2_critic_qwen2_gqa", || {
            critic(
                "qwen2-gqa",
                2,
                json!({"tensor_model_parallel_size": 2, "sequence_parallel": false}),
            )
        }),
        ("tp2_sp_critic_llama_tied", || {
            critic("llama-tied", 2, json!({"tensor_model_parallel_size": 2}))
        }),
        ("cp2_qwen2_gqa_bias", || context("qwen2-gqa", 2, 1, 2)),
        ("token_budget_cp2_qwen2_gqa", || {
            let dir = tempfile::tempdir().unwrap();
            let path = model_dir("qwen2-gqa", dir.path());
            let parallel = json!({"context_parallel_size": 2});
            run("token_budget", 2, &path, &parallel, dir.path());
        }),
        ("token_budget_dp2_tp2_sp_llama_tied", || {
            let dir = tempfile::tempdir().unwrap();
            let path = model_dir("llama-tied", dir.path());
            let parallel = json!({"tensor_model_parallel_size": 2, "sequence_parallel": true});
            run("token_budget", 4, &path, &parallel, dir.path());
        }),
        ("cp2_llama_tied", || context("llama-tied", 2, 1, 2)),
        ("tp2_sp_cp2_qwen2_gqa_4_ranks", || {
            context("qwen2-gqa", 4, 2, 2)
        }),
        ("tp2_sp_cp2_llama_tied_4_ranks", || {
            context("llama-tied", 4, 2, 2)
        }),
        ("cp2_critic_qwen2_gqa", || {
            critic("qwen2-gqa", 2, json!({"context_parallel_size": 2}))
        }),
        ("every_width_tp2_sp_cp2_4_ranks", || {
            let dir = tempfile::tempdir().unwrap();
            let path = model_dir("qwen2-gqa", dir.path());
            let parallel = json!({"tensor_model_parallel_size": 2, "context_parallel_size": 2});
            run("widths", 4, &path, &parallel, dir.path());
        }),
        ("packed_every_length_tp2_sp", || {
            let parallel = json!({"tensor_model_parallel_size": 2, "sequence_parallel": true});
            packed("lengths", "qwen2-gqa", 2, parallel);
        }),
        ("packed_every_length_cp2", || {
            packed(
                "lengths",
                "qwen2-gqa",
                2,
                json!({"context_parallel_size": 2}),
            );
        }),
        ("packed_every_length_tp2_sp_cp2_4_ranks", || {
            let parallel = json!({"tensor_model_parallel_size": 2, "context_parallel_size": 2});
            packed("lengths", "llama-tied", 4, parallel);
        }),
        ("packed_tp2_sp_qwen2_gqa_bias", || {
            let parallel = json!({"tensor_model_parallel_size": 2, "sequence_parallel": true});
            packed("parity", "qwen2-gqa", 2, parallel);
        }),
        ("packed_cp2_llama_tied", || {
            packed(
                "parity",
                "llama-tied",
                2,
                json!({"context_parallel_size": 2}),
            );
        }),
        ("packed_tp2_sp_cp2_qwen2_gqa_4_ranks", || {
            let parallel = json!({"tensor_model_parallel_size": 2, "context_parallel_size": 2});
            packed("parity", "qwen2-gqa", 4, parallel);
        }),
        ("packed_cp2_critic_qwen2_gqa", || {
            packed(
                "critic",
                "qwen2-gqa",
                2,
                json!({"context_parallel_size": 2}),
            );
        }),
        ("unbuilt_layouts_are_errors", unbuilt_layouts_are_errors),
        ("reshard_tp2_to_tp1", || reshard("qwen2-gqa", 2, 1)),
        ("reshard_tp1_to_tp2", || reshard("qwen2-gqa", 1, 2)),
        ("tp2_qwen2_odd_vocab", || {
            parity("qwen2-gqa-odd-vocab", 2, 2, false)
        }),
        ("tp2_sp_llama_tied_odd_vocab", || {
            parity("llama-tied-odd-vocab", 2, 2, true)
        }),
        ("dp2_tp2_sp_qwen2_odd_vocab", || {
            parity("qwen2-gqa-odd-vocab", 4, 2, true)
        }),
        ("reshard_odd_vocab_tp2_to_tp1", || {
            reshard("qwen2-gqa-odd-vocab", 2, 1)
        }),
        ("reshard_odd_vocab_tp1_to_tp2", || {
            reshard("qwen2-gqa-odd-vocab", 1, 2)
        }),
    ];
    verl_testkit::run_rank_tests(tests);
}
