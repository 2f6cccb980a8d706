//! Driving the built `fsdp` plugin through the host and the stable ABI, on verl-model's committed
//! tiny fixtures (`runtime/model/fixtures`, made by `make_fixtures.py` with transformers).

use serde::Deserialize;
use serde_json::{Value, json};
use verl_plugin_api::{
    Batch, ComponentInit, ComponentKind, Metric, NamedTensor, RunContext, Tensor, keys,
};
use verl_plugin_host::EngineHandle;
use verl_testkit::{PluginHarness, built_plugin};

pub use verl_model::testing::fixture;

#[derive(Deserialize)]
pub struct Expected {
    pub temperature: f64,
    pub sequences: Vec<Sequence>,
}

#[derive(Deserialize)]
pub struct Sequence {
    pub ids: Vec<i64>,
    pub logprobs: Vec<f64>,
    pub entropy: Vec<f64>,
    pub logprobs_temperature: Vec<f64>,
}

pub fn expected(name: &str) -> Expected {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("expected.json")).unwrap())
        .unwrap()
}

/// A fresh `fsdp` engine from the built library, through the host's loader.
pub fn new_engine() -> EngineHandle {
    let harness = PluginHarness::load_alone(built_plugin("verl_plugin_fsdp"))
        .unwrap_or_else(|e| panic!("{e}"));
    harness.assert_registers(ComponentKind::ENGINE, "fsdp", 100);
    harness
        .component(ComponentKind::ENGINE, "fsdp")
        .create_engine()
        .unwrap_or_else(|e| panic!("{e}"))
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

pub fn merge(base: &mut Value, extra: Value) {
    match (base, extra) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(Value::Null), v);
            }
        }
        (slot, v) => *slot = v,
    }
}

/// verl's layout for the fixture sequences: sequence `i` split after `3 + i` prompt tokens; prompts
/// left-padded, responses right-padded (pad id 0). Returns the batch and each row's response length.
pub fn layout(seqs: &[Vec<i64>]) -> (Batch, Vec<usize>) {
    let splits: Vec<usize> = (0..seqs.len()).map(|i| 3 + i).collect();
    layout_split(seqs, &splits)
}

/// [`layout`] with sequence `i` split after `splits[i]` prompt tokens.
pub fn layout_split(seqs: &[Vec<i64>], splits: &[usize]) -> (Batch, Vec<usize>) {
    let p = splits.iter().copied().max().unwrap();
    let r = seqs
        .iter()
        .zip(splits)
        .map(|(s, &k)| s.len() - k)
        .max()
        .unwrap();
    let b = seqs.len() as i64;
    let (mut ids, mut mask, mut responses, mut rmask) = (vec![], vec![], vec![], vec![]);
    for (s, &k) in seqs.iter().zip(splits) {
        let (prompt, response) = s.split_at(k);
        let pad_p = p - prompt.len();
        let pad_r = r - response.len();
        ids.extend(
            std::iter::repeat_n(0, pad_p)
                .chain(prompt.iter().copied())
                .chain(response.iter().copied())
                .chain(std::iter::repeat_n(0, pad_r)),
        );
        mask.extend(
            std::iter::repeat_n(0i64, pad_p)
                .chain(std::iter::repeat_n(1, prompt.len() + response.len()))
                .chain(std::iter::repeat_n(0, pad_r)),
        );
        responses.extend(
            response
                .iter()
                .copied()
                .chain(std::iter::repeat_n(0, pad_r)),
        );
        rmask.extend(
            std::iter::repeat_n(1f32, response.len()).chain(std::iter::repeat_n(0.0, pad_r)),
        );
    }
    let w = (p + r) as i64;
    let mut batch = Batch::default();
    batch.insert(keys::INPUT_IDS, Tensor::from_slice(&[b, w], &ids).unwrap());
    batch.insert(
        keys::ATTENTION_MASK,
        Tensor::from_slice(&[b, w], &mask).unwrap(),
    );
    batch.insert(
        keys::RESPONSES,
        Tensor::from_slice(&[b, r as i64], &responses).unwrap(),
    );
    batch.insert(
        keys::RESPONSE_MASK,
        Tensor::from_slice(&[b, r as i64], &rmask).unwrap(),
    );
    let lens = seqs.iter().zip(splits).map(|(s, &k)| s.len() - k).collect();
    (batch, lens)
}

/// A GRPO batch of the fixture's tokens: two prompts (4 and 7 tokens of two fixture sequences),
/// three samples each (responses cut from the fixture sequences, 1 to 12 tokens), each group's
/// rows consecutive (as verl repeats a prompt for its `n` samples).
pub fn grouped_batch(model: &str) -> Batch {
    let seqs: Vec<Vec<i64>> = expected(model)
        .sequences
        .into_iter()
        .map(|s| s.ids)
        .collect();
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
    let seqs: Vec<Vec<i64>> = expected(model)
        .sequences
        .into_iter()
        .map(|s| s.ids)
        .collect();
    layout(&seqs)
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

pub fn set_meta(batch: &mut Batch, meta: Value) {
    batch.meta_json = meta.to_string().into();
}

pub fn log_probs(engine: &mut EngineHandle, batch: &Batch) -> Tensor {
    engine
        .compute_log_prob(batch)
        .unwrap()
        .require(keys::LOG_PROBS)
        .unwrap()
        .clone()
}

/// A PPO batch of the fixture's sequences (see [`with_ppo_fields`]).
pub fn ppo_batch(engine: &mut EngineHandle, model: &str) -> Batch {
    with_ppo_fields(engine, fixture_batch(model).0)
}

/// Eight rows of varied lengths for the token-budget tests: the fixture's four sequences and
/// four prefixes of them (verl's layout: prompts of 3..=10 tokens left-padded, responses of 3 to
/// 29 tokens right-padded). Returns the batch and its padded width.
pub fn varied_batch(model: &str) -> (Batch, usize) {
    let seqs: Vec<Vec<i64>> = expected(model)
        .sequences
        .into_iter()
        .map(|s| s.ids)
        .collect();
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

/// The real tokens of each row.
pub fn seqlens(batch: &Batch) -> Vec<u64> {
    let mask = batch.require(keys::ATTENTION_MASK).unwrap();
    let width = mask.shape[1] as usize;
    mask.to_vec::<i64>()
        .unwrap()
        .chunks(width)
        .map(|row| row.iter().sum::<i64>() as u64)
        .collect()
}

/// `batch` made a PPO batch: old log-probs from the engine itself (so the first ratio is 1),
/// per-sequence advantages, and the reference = old log-probs.
pub fn with_ppo_fields(engine: &mut EngineHandle, mut batch: Batch) -> Batch {
    let old = log_probs(engine, &batch);
    let shape = old.shape.to_vec();
    let (b, r) = (shape[0] as usize, shape[1] as usize);
    let adv: Vec<f32> = (0..b)
        .flat_map(|i| std::iter::repeat_n([1.0f32, -0.5, 0.25, -1.0][i % 4], r))
        .collect();
    batch.insert(keys::ADVANTAGES, Tensor::from_slice(&shape, &adv).unwrap());
    batch.insert(keys::REF_LOG_PROB, old.clone());
    batch.insert(keys::OLD_LOG_PROBS, old);
    batch
}

pub fn update(engine: &mut EngineHandle, batch: &Batch) -> Vec<Metric> {
    engine
        .update_actor(batch)
        .unwrap_or_else(|e| panic!("update_actor: {e}"))
        .into_iter()
        .collect()
}

/// Owned copies of the weights the engine lends.
pub fn weights(engine: &mut EngineHandle) -> Vec<NamedTensor> {
    engine
        .weights()
        .unwrap()
        .iter()
        .map(|view| view.to_named())
        .collect()
}

/// The update metrics that do not depend on how rows are grouped into micro-batches: the
/// mini-batch's loss values, the gradient norm and the learning rate (the per-micro-batch means —
/// clip fractions, KL, entropy — do, in verl too).
pub const GROUPING_FREE_METRICS: [&str; 5] = [
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/loss",
    "actor/grad_norm",
    "actor/lr",
];

/// The largest difference of `keys` between two updates' metrics, relative to values above 1.
pub fn metrics_diff(got: &[Metric], want: &[Metric], keys: &[&str]) -> f64 {
    keys.iter()
        .map(|key| {
            let (mine, theirs) = (metric(got, key), metric(want, key));
            (mine - theirs).abs() / theirs.abs().max(1.0)
        })
        .fold(0.0, f64::max)
}

/// An engine's values of `batch`.
pub fn values(engine: &mut EngineHandle, batch: &Batch) -> Tensor {
    engine
        .compute_values(batch)
        .unwrap()
        .require(keys::VALUES)
        .unwrap()
        .clone()
}

pub fn metric(metrics: &[Metric], key: &str) -> f64 {
    metrics
        .iter()
        .find(|m| m.key == key)
        .unwrap_or_else(|| panic!("no metric {key} in {metrics:?}"))
        .value
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max)
}

/// Largest absolute difference between two weight sets with the same names.
pub fn weights_diff(a: &[NamedTensor], b: &[NamedTensor]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert_eq!(x.name, y.name);
            max_abs_diff(
                &x.tensor.to_vec::<f32>().unwrap(),
                &y.tensor.to_vec::<f32>().unwrap(),
            )
        })
        .fold(0.0, f64::max)
}
