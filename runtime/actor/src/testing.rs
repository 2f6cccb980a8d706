//! The engines' conformance suite (the idea of burn's backend tests): what every engine strategy
//! must agree on with a reference whatever its layout — the per-token outputs, the update's
//! metrics and the weights after it, for the same global batch of which it may hold only some
//! rows — as checks that each engine's tests call with its own engine under test, plus verl's
//! batch layout and the comparisons the checks make.
//!
//! A check measures differences and hands each to the caller's `check(what, difference)`, which
//! holds the engine's tolerance (and, in a multi-rank test, records the largest for rank 0 to
//! report).

use serde_json::Value;
use tch::Device;
use verl_model::interop::{from_tch, to_tch};
use verl_plugin_api::{Batch, ComponentKind, Metric, NamedTensor, Tensor, keys};
use verl_plugin_host::EngineHandle;
use verl_testkit::{PluginHarness, built_plugin};

use crate::{ActorWorker, Role, Strategy};

pub use verl_testkit::conformance::{layout, layout_split};

/// An engine role as the trainer drives it: verl's actor semantics on a [`Strategy`] in this
/// process ([`ActorWorker`]), or an engine plugin through the ABI ([`EngineHandle`]). Failures
/// panic with the engine's message.
pub trait Engine {
    /// `compute_values` for a critic, else `compute_log_prob`.
    fn forward(&mut self, role: Role, batch: &Batch) -> Batch;
    /// `update_critic` for a critic, else `update_actor`.
    fn update(&mut self, role: Role, batch: &Batch) -> Vec<Metric>;
    /// Owned copies of the weights the engine lends.
    fn named_weights(&mut self) -> Vec<NamedTensor>;
}

/// [`Engine`] for a type whose own methods of the same names return their own error type.
macro_rules! impl_engine {
    ($($generics:ident: $bound:path),* => $engine:ty) => {
        impl<$($generics: $bound),*> Engine for $engine {
            fn forward(&mut self, role: Role, batch: &Batch) -> Batch {
                match role {
                    Role::Critic => self.compute_values(batch),
                    _ => self.compute_log_prob(batch),
                }
                .unwrap_or_else(|e| panic!("forward: {e}"))
            }

            fn update(&mut self, role: Role, batch: &Batch) -> Vec<Metric> {
                match role {
                    Role::Critic => self.update_critic(batch),
                    _ => self.update_actor(batch),
                }
                .unwrap_or_else(|e| panic!("update: {e}"))
            }

            fn named_weights(&mut self) -> Vec<NamedTensor> {
                let views = self.weights().unwrap_or_else(|e| panic!("weights: {e}"));
                views.iter().map(|view| view.to_named()).collect()
            }
        }
    };
}

impl_engine!(S: Strategy => ActorWorker<S>);
impl_engine!( => EngineHandle);

/// A fresh, uninitialised engine `component` of the built plugin library `library` (e.g.
/// `verl_plugin_fsdp`), through the host's loader; the plugin must register it at `priority`.
pub fn plugin_engine(library: &str, component: &str, priority: i32) -> EngineHandle {
    let harness =
        PluginHarness::load_alone(built_plugin(library)).unwrap_or_else(|e| panic!("{e}"));
    harness.assert_registers(ComponentKind::ENGINE, component, priority);
    harness
        .component(ComponentKind::ENGINE, component)
        .create_engine()
        .unwrap_or_else(|e| panic!("{e}"))
}

// ---------------------------------------------------------------------------------------------
// The checks.

/// A global batch and the rows of it that the engine under test holds (on a data-parallel rank,
/// its share); the reference always gets the whole batch.
pub struct Share<'a> {
    pub batch: &'a Batch,
    pub rows: Vec<usize>,
}

impl<'a> Share<'a> {
    /// Every row.
    pub fn whole(batch: &'a Batch) -> Self {
        let rows = batch.tensors.first().map_or(0, |t| t.tensor.shape[0]);
        Self::rows(batch, (0..rows as usize).collect())
    }

    /// `rows`, in that order.
    pub fn rows(batch: &'a Batch, rows: Vec<usize>) -> Self {
        Self { batch, rows }
    }

    /// Rank `rank`'s contiguous rows of `world` data-parallel ranks, as the trainer splits a
    /// batch: the first `rows % world` ranks take one more.
    pub fn of_rank(batch: &'a Batch, rank: usize, world: usize) -> Self {
        let len = Self::whole(batch).rows.len();
        let (base, extra) = (len / world, len % world);
        let start = rank * base + rank.min(extra);
        Self::rows(
            batch,
            (start..start + base + usize::from(rank < extra)).collect(),
        )
    }

    /// The engine's part of the batch.
    pub fn local(&self) -> Batch {
        select_rows(self.batch, &self.rows)
    }
}

/// The per-token outputs `keys` of `engine` for its share against `reference`'s for the whole
/// batch: the largest difference of each (as `key`). Returns the reference's outputs.
pub fn check_outputs(
    engine: &mut impl Engine,
    reference: &mut impl Engine,
    role: Role,
    share: &Share<'_>,
    keys: &[&str],
    check: &mut dyn FnMut(&str, f64),
) -> Batch {
    let want = reference.forward(role, share.batch);
    let got = engine.forward(role, &share.local());
    let theirs = select_rows(&want, &share.rows);
    for &key in keys {
        let output = |batch: &Batch| floats(batch.require(key).unwrap_or_else(|e| panic!("{e}")));
        check(key, max_abs_diff(&output(&got), &output(&theirs)));
    }
    want
}

/// One update of `engine` on its share and of `reference` on the whole batch: each of the
/// reference's metrics (or only `keys`) relative to values above 1, as `"{key}: {mine} vs
/// {theirs}"`. Returns both updates' metrics (the engine's, the reference's).
pub fn check_update(
    engine: &mut impl Engine,
    reference: &mut impl Engine,
    role: Role,
    share: &Share<'_>,
    keys: Option<&[&str]>,
    check: &mut dyn FnMut(&str, f64),
) -> (Vec<Metric>, Vec<Metric>) {
    let got = engine.update(role, &share.local());
    let want = reference.update(role, share.batch);
    let compared: Vec<&str> = match keys {
        Some(keys) => keys.to_vec(),
        None => want.iter().map(|m| m.key.as_str()).collect(),
    };
    for key in compared {
        let (mine, theirs) = (metric(&got, key), metric(&want, key));
        check(
            &format!("{key}: {mine} vs {theirs}"),
            relative_diff(mine, theirs),
        );
    }
    (got, want)
}

/// Two weight sets: the same names in the same order, and the largest difference (`weights`).
pub fn check_weights(got: &[NamedTensor], want: &[NamedTensor], check: &mut dyn FnMut(&str, f64)) {
    let names = |w: &[NamedTensor]| w.iter().map(|t| t.name.to_string()).collect::<Vec<_>>();
    assert_eq!(names(got), names(want), "parameter names");
    check("weights", weights_diff(got, want));
}

// ---------------------------------------------------------------------------------------------
// verl's batches.

/// `meta` as the batch's meta (temperature, the outputs asked for, …).
pub fn set_meta(batch: &mut Batch, meta: Value) {
    batch.meta_json = meta.to_string().into();
}

/// `extra` merged into `base`, objects key by key (a config section with some keys changed).
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

/// The rows `rows` of every tensor of `batch`, in that order.
fn select_rows(batch: &Batch, rows: &[usize]) -> Batch {
    let index: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    let index = tch::Tensor::from_slice(&index);
    let mut out = Batch {
        meta_json: batch.meta_json.clone(),
        ..Batch::default()
    };
    for named in &batch.tensors {
        let name = named.name.as_str();
        let t = to_tch(name, &named.tensor, Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
        let picked = from_tch(name, &t.index_select(0, &index)).unwrap_or_else(|e| panic!("{e}"));
        out.insert(name, picked);
    }
    out
}

/// The real tokens of each row.
pub fn seqlens(batch: &Batch) -> Vec<u64> {
    let mask = batch
        .require(keys::ATTENTION_MASK)
        .unwrap_or_else(|e| panic!("{e}"));
    let width = mask.shape[1] as usize;
    mask.to_vec::<i64>()
        .unwrap_or_else(|e| panic!("{e}"))
        .chunks(width)
        .map(|row| row.iter().sum::<i64>() as u64)
        .collect()
}

/// `batch` made the PPO batch of update `step`: old log-probs from `engine` (so the first ratio
/// is 1), per-sequence advantages of both signs (shifted by `step`), the reference policy = old.
pub fn with_ppo_fields(engine: &mut impl Engine, mut batch: Batch, step: u64) -> Batch {
    let old = log_probs(engine, &batch);
    let shape = old.shape.to_vec();
    let (b, r) = (shape[0] as usize, shape[1] as usize);
    let adv: Vec<f32> = (0..b)
        .flat_map(|i| std::iter::repeat_n([1.0f32, -0.5, 0.25, -1.0][(i + step as usize) % 4], r))
        .collect();
    batch.insert(
        keys::ADVANTAGES,
        Tensor::from_slice(&shape, &adv).unwrap_or_else(|e| panic!("{e}")),
    );
    batch.insert(keys::REF_LOG_PROB, old.clone());
    batch.insert(keys::OLD_LOG_PROBS, old);
    batch
}

/// An actor's log-probs of `batch`.
pub fn log_probs(engine: &mut impl Engine, batch: &Batch) -> Tensor {
    output(engine.forward(Role::Actor, batch), keys::LOG_PROBS)
}

/// A critic's values of `batch`.
pub fn values(engine: &mut impl Engine, batch: &Batch) -> Tensor {
    output(engine.forward(Role::Critic, batch), keys::VALUES)
}

fn output(batch: Batch, key: &str) -> Tensor {
    batch.require(key).unwrap_or_else(|e| panic!("{e}")).clone()
}

/// An actor's update on `batch`.
pub fn update(engine: &mut impl Engine, batch: &Batch) -> Vec<Metric> {
    engine.update(Role::Actor, batch)
}

/// Owned copies of the weights `engine` lends.
pub fn weights(engine: &mut impl Engine) -> Vec<NamedTensor> {
    engine.named_weights()
}

// ---------------------------------------------------------------------------------------------
// Comparisons.

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

/// The value of `key` among `metrics`.
pub fn metric(metrics: &[Metric], key: &str) -> f64 {
    metrics
        .iter()
        .find(|m| m.key == key)
        .unwrap_or_else(|| panic!("no metric {key} in {metrics:?}"))
        .value
}

/// The largest difference of `keys` between two updates' metrics, relative to values above 1.
pub fn metrics_diff(got: &[Metric], want: &[Metric], keys: &[&str]) -> f64 {
    keys.iter()
        .map(|key| relative_diff(metric(got, key), metric(want, key)))
        .fold(0.0, f64::max)
}

/// `|mine - theirs|`, relative to `theirs` above 1.
fn relative_diff(mine: f64, theirs: f64) -> f64 {
    (mine - theirs).abs() / theirs.abs().max(1.0)
}

/// The largest `|a - b|` of two equally long lists.
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
            max_abs_diff(&floats(&x.tensor), &floats(&y.tensor))
        })
        .fold(0.0, f64::max)
}

/// An fp32 ABI tensor's values.
fn floats(tensor: &Tensor) -> Vec<f32> {
    tensor.to_vec::<f32>().unwrap_or_else(|e| panic!("{e}"))
}
