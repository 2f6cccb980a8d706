//! Driving the built `fsdp` plugin through the host and the stable ABI, on verl-model's committed
//! tiny fixtures (`runtime/model/fixtures`, made by `make_fixtures.py` with transformers).

use serde_json::{Value, json};
use verl_actor::testing::{layout, layout_split, merge, plugin_engine, with_ppo_fields};
use verl_model::testing::{fixture, sequence_ids};
use verl_plugin_api::{Batch, ComponentInit, RunContext, keys};
use verl_plugin_host::EngineHandle;

/// A fresh `fsdp` engine from the built library, through the host's loader.
pub fn new_engine() -> EngineHandle {
    plugin_engine("verl_plugin_fsdp", "fsdp", 100)
}

pub fn init_for(config: &Value) -> ComponentInit {
    let mut run = RunContext::default();
    run.seed = 7;
    ComponentInit::new(config.clone(), run)
}

/// `config` = the section (role, model, …); panics with the plugin's message on failure.
pub fn engine(config: &Value) -> EngineHandle {
    let mut engine = new_engine();
    engine
        .init(&init_for(config))
        .unwrap_or_else(|e| panic!("init: {e}"));
    engine
}

/// An actor section on a fixture with a learning rate big enough to move a tiny model.
pub fn actor_config(model: &str, extra: Value) -> Value {
    let mut config = json!({
        "role": "actor",
        "model": {"path": fixture(model)},
        "optim": {"lr": 1e-3},
        "ppo_mini_batch_size": 4,
    });
    merge(&mut config, extra);
    config
}

/// A GRPO batch of the fixture's tokens: two prompts (4 and 7 tokens of two fixture sequences),
/// three samples each (responses cut from the fixture sequences, 1 to 12 tokens), each group's
/// rows consecutive (as verl repeats a prompt for its `n` samples).
pub fn grouped_batch(model: &str) -> Batch {
    let seqs = sequence_ids(model);
    let prompts = [&seqs[0][..4], &seqs[1][..7]];
    let responses = [
        (1, 3, 12),
        (3, 1, 5),
        (0, 6, 1),
        (1, 8, 9),
        (3, 2, 7),
        (1, 20, 4),
    ];
    let (rows, splits): (Vec<Vec<i64>>, Vec<usize>) = responses
        .iter()
        .enumerate()
        .map(|(i, &(s, start, len))| {
            let prompt = prompts[i / 3];
            let row = [prompt, &seqs[s][start..start + len]].concat();
            (row, prompt.len())
        })
        .unzip();
    layout_split(&rows, &splits).0
}

pub fn fixture_batch(model: &str) -> (Batch, Vec<usize>) {
    layout(&sequence_ids(model))
}

/// `[B, R]` values of `key` as rows.
pub fn rows(batch: &Batch, key: &str) -> Vec<Vec<f32>> {
    let t = batch.require(key).unwrap();
    let width = t.shape[1] as usize;
    t.to_vec::<f32>()
        .unwrap()
        .chunks(width)
        .map(<[f32]>::to_vec)
        .collect()
}

/// A PPO batch of the fixture's sequences (see [`with_ppo_fields`]).
pub fn ppo_batch(engine: &mut EngineHandle, model: &str) -> Batch {
    with_ppo_fields(engine, fixture_batch(model).0, 0)
}

/// Eight rows of varied lengths for the token-budget tests: the fixture's four sequences and
/// four prefixes of them (verl's layout: prompts of 3..=10 tokens left-padded, responses of 3 to
/// 29 tokens right-padded). Returns the batch and its padded width.
pub fn varied_batch(model: &str) -> (Batch, usize) {
    let seqs = sequence_ids(model);
    let prefixes = [(1, 20), (1, 26), (0, 12), (1, 30)];
    let all: Vec<Vec<i64>> = seqs
        .iter()
        .cloned()
        .chain(prefixes.iter().map(|&(i, n)| seqs[i][..n].to_vec()))
        .collect();
    let (batch, _) = layout(&all);
    let width = batch.require(keys::INPUT_IDS).unwrap().shape[1] as usize;
    (batch, width)
}
