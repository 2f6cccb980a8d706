//! The loop driven through fake components registered as built-ins: every call lands in one
//! shared event log, so the tests check verl's order, the weight versions the rollout sees, the
//! validation / checkpoint cadence, resuming, and the capability checks before start.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::json;
use verl_plugin_api::{
    Batch, CheckpointCapabilities, CheckpointEngine, Completion, ComponentInit, DType, Engine,
    EngineCapabilities, FinishReason, GenerateOutput, GenerateRequest, Handover, Metric,
    PluginBuilder, PluginError, Rollout, RolloutCapabilities, RoutedExperts, Table, Tensor,
    TensorRef, Tracker, TrackerCapabilities, WeightSource, WeightSourceKind, keys,
};
use verl_plugin_host::{DeviceReport, Registry};

use super::{NonFinite, RunSummary, TrainError, Trainer};
use crate::checkpoint::{CheckpointError, MANIFEST_FILE};
use crate::placement::Placement;
use verl_algo::{AdvEstimator, IsLevel, Matrix};
use verl_config::{Config, NanPolicy, ResumeMode, RouterReplayMode, RsThreshold, TrainingMode};
use verl_data::synthetic::{self, ALPHABET, AdditionTask, SPECIAL_TOKENS};

/// Everything a fake component did, in call order.
#[derive(Debug, Clone, PartialEq)]
enum Event {
    /// A component object was constructed (by the registry's factory).
    Created(&'static str),
    /// `init`; engines say their role.
    Init(String),
    Generate {
        /// `sampling.n` (the tests give training and validation different `n`).
        n: u32,
        /// The weight version the rollout generated with (the last it received).
        version: Option<u64>,
        prompts: Vec<String>,
        seed: Option<u64>,
        max_new_tokens: u32,
    },
    LogProb {
        role: String,
        keys: Vec<String>,
    },
    Values {
        role: String,
        keys: Vec<String>,
    },
    UpdateActor {
        role: String,
        keys: Vec<String>,
        step: u64,
        /// `[B, R]` and the F32 tensors of [`RECORDED`] the update got, row-major.
        shape: [i64; 2],
        floats: BTreeMap<String, Vec<f32>>,
    },
    UpdateCritic {
        role: String,
        keys: Vec<String>,
    },
    /// The `routed_experts` an engine call received (`[B, T, L, k]` values and shape) with the
    /// batch's attention mask.
    Routed {
        op: &'static str,
        experts: Vec<i64>,
        shape: Vec<i64>,
        mask: Vec<i64>,
    },
    /// The engine lent its weights.
    Weights(String),
    Send(u64),
    /// What the rollout received: the version, and the value of the weight tensor it read.
    UpdateWeights {
        version: u64,
        value: f32,
    },
    Finalize,
    /// The rollout was put to sleep (at this level) / woken.
    Sleep(u32),
    WakeUp,
    Save {
        role: String,
        dir: PathBuf,
        step: u64,
    },
    Load {
        role: String,
        dir: PathBuf,
    },
    Export(String),
    Log {
        step: u64,
        metrics: BTreeMap<String, f64>,
    },
    Table(u64),
    Finish(i32),
}

#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<Event>>>);

impl Log {
    fn push(&self, event: Event) {
        self.0.lock().unwrap().push(event);
    }
    fn events(&self) -> Vec<Event> {
        self.0.lock().unwrap().clone()
    }
}

/// Failures the fakes inject.
#[derive(Clone, Copy, Default)]
struct Faults {
    /// `update_actor` fails at this global step.
    fail_update_at: Option<u64>,
    /// `update_actor` goes non-finite at this global step.
    non_finite_at: Option<(u64, Bad)>,
    /// `compute_log_prob` ignores the meta's `calculate_sum_pi_squared`.
    no_sum_pi_squared: bool,
}

/// How the fake actor's update goes non-finite.
#[derive(Clone, Copy)]
enum Bad {
    /// It reports a NaN gradient norm and leaves its weight alone, as a guarded engine does.
    GradNorm,
    /// It reports a finite update, but its weight becomes NaN, as an unguarded engine's would.
    Weights,
}

fn batch_keys(batch: &Batch) -> Vec<String> {
    let mut keys: Vec<String> = batch.tensors.iter().map(|t| t.name.to_string()).collect();
    keys.sort();
    keys
}

/// `[B, R]` of the batch's responses.
fn response_shape(batch: &Batch) -> Result<[i64; 2], PluginError> {
    match batch.require(keys::RESPONSES)?.shape.as_slice() {
        &[b, r] => Ok([b, r]),
        other => Err(PluginError::other(format!("responses of shape {other:?}"))),
    }
}

/// The update batch's tensors the fake actor records.
const RECORDED: [&str; 5] = [
    keys::ADVANTAGES,
    keys::RETURNS,
    keys::RESPONSE_MASK,
    keys::OLD_LOG_PROBS,
    super::ROLLOUT_IS_WEIGHTS,
];

/// The gradient norm the fake actor reports for the update of `step`.
fn fake_grad_norm(step: u64) -> f64 {
    0.25 * step as f64
}

/// The fake Σπ² of row `i`, token `t`: varied over rows and tokens, so that the optimal token
/// baseline's weights differ between the responses of a group.
fn fake_sum_pi_squared(i: i64, t: i64) -> f32 {
    0.1 + 0.2 * ((3 * i + t) % 4) as f32
}

/// The fake actor's Σπ² of a `(rows, cols)` batch.
fn fake_sum_pi_squared_matrix((rows, cols): (usize, usize)) -> Matrix {
    let values = (0..rows as i64)
        .flat_map(|i| (0..cols as i64).map(move |t| fake_sum_pi_squared(i, t)))
        .collect();
    Matrix::new(rows, cols, values).unwrap()
}

fn filled(batch: &Batch, value: f32) -> Result<Tensor, PluginError> {
    let [b, r] = response_shape(batch)?;
    Tensor::from_slice(&[b, r], &vec![value; (b * r) as usize])
}

/// Records the batch's `routed_experts`, when it has them.
fn log_routing(log: &Log, op: &'static str, batch: &Batch) -> Result<(), PluginError> {
    if let Some(routed) = batch.get(keys::ROUTED_EXPERTS) {
        log.push(Event::Routed {
            op,
            experts: routed.to_vec::<i64>()?,
            shape: routed.shape.to_vec(),
            mask: batch.require(keys::ATTENTION_MASK)?.to_vec::<i64>()?,
        });
    }
    Ok(())
}

fn global_steps(batch: &Batch) -> u64 {
    serde_json::from_str::<serde_json::Value>(batch.meta_json.as_str())
        .ok()
        .and_then(|m| m["global_steps"].as_u64())
        .unwrap_or(0)
}

const ENGINE_STATE: &str = "fake_engine.json";

/// An engine for every role. Its one weight is a scalar that each actor update raises by one, so
/// after step k it is k: the rollout reading it checks that the views are the engine's own.
/// `ON_POLICY`: it declares verl's on-policy shortcut, and its update reports `actor/entropy`
/// (0.75, unlike `compute_log_prob`'s 0.25) when the meta asks.
struct FakeEngine<const ON_POLICY: bool = false> {
    log: Log,
    faults: Faults,
    role: String,
    /// `router_replay.mode` of its section.
    router_replay: String,
    shape: Vec<i64>,
    weight: Vec<u8>,
}

impl<const ON_POLICY: bool> FakeEngine<ON_POLICY> {
    fn new(log: Log, faults: Faults) -> Self {
        Self {
            log,
            faults,
            role: String::new(),
            router_replay: String::new(),
            shape: vec![1],
            weight: 0f32.to_le_bytes().to_vec(),
        }
    }
    fn value(&self) -> f32 {
        f32::from_le_bytes(self.weight[..4].try_into().unwrap())
    }
    fn set_value(&mut self, value: f32) {
        self.weight = value.to_le_bytes().to_vec();
    }
}

impl<const ON_POLICY: bool> Engine for FakeEngine<ON_POLICY> {
    fn capabilities() -> EngineCapabilities {
        EngineCapabilities::default()
            .roles(["actor", "ref", "critic"])
            .on_policy_updates(ON_POLICY)
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        self.role = init.config["role"].as_str().unwrap_or("?").to_owned();
        self.router_replay = init.config["router_replay"]["mode"]
            .as_str()
            .unwrap_or("?")
            .to_owned();
        self.log.push(Event::Init(format!("engine:{}", self.role)));
        Ok(())
    }
    fn compute_log_prob(&mut self, batch: &Batch) -> Result<Batch, PluginError> {
        self.log.push(Event::LogProb {
            role: self.role.clone(),
            keys: batch_keys(batch),
        });
        log_routing(&self.log, "compute_log_prob", batch)?;
        let mut out = Batch::default();
        out.insert(keys::LOG_PROBS, filled(batch, -0.5)?);
        out.insert(keys::ENTROPYS, filled(batch, 0.25)?);
        let meta: serde_json::Value =
            serde_json::from_str(batch.meta_json.as_str()).unwrap_or_default();
        if meta["calculate_sum_pi_squared"] == true && !self.faults.no_sum_pi_squared {
            let [b, r] = response_shape(batch)?;
            let values: Vec<f32> = (0..b)
                .flat_map(|i| (0..r).map(move |t| fake_sum_pi_squared(i, t)))
                .collect();
            out.insert(keys::SUM_PI_SQUARED, Tensor::from_slice(&[b, r], &values)?);
        }
        if self.router_replay == "R2" {
            // A recording: expert 3 (and 2) for every token of the `[B, P+R]` batch, 1 layer.
            let ids = batch.require(keys::INPUT_IDS)?;
            let (b, w) = (ids.shape[0], ids.shape[1]);
            let experts: Vec<i64> = (0..b * w).flat_map(|_| [3, 2]).collect();
            out.insert(
                keys::ROUTED_EXPERTS,
                Tensor::from_slice(&[b, w, 1, 2], &experts)?,
            );
        }
        Ok(out)
    }
    fn compute_values(&mut self, batch: &Batch) -> Result<Batch, PluginError> {
        self.log.push(Event::Values {
            role: self.role.clone(),
            keys: batch_keys(batch),
        });
        let mut out = Batch::default();
        out.insert(keys::VALUES, filled(batch, 0.1)?);
        Ok(out)
    }
    fn update_actor(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        let step = global_steps(batch);
        let mut floats = BTreeMap::new();
        for key in RECORDED {
            if let Some(t) = batch.get(key) {
                floats.insert(key.to_owned(), t.to_vec::<f32>()?);
            }
        }
        self.log.push(Event::UpdateActor {
            role: self.role.clone(),
            keys: batch_keys(batch),
            step,
            shape: response_shape(batch)?,
            floats,
        });
        log_routing(&self.log, "update_actor", batch)?;
        if self.faults.fail_update_at == Some(step) {
            return Err(PluginError::other(format!(
                "injected failure at step {step}"
            )));
        }
        match self.faults.non_finite_at {
            Some((at, Bad::GradNorm)) if at == step => {
                return Ok(vec![
                    Metric::new("actor/pg_loss", 0.5),
                    Metric::new("actor/grad_norm", f64::NAN),
                    Metric::new("actor/skipped_updates", 1.0),
                ]);
            }
            Some((at, Bad::Weights)) if at == step => {
                self.set_value(f32::NAN);
                return Ok(vec![Metric::new("actor/pg_loss", 0.5)]);
            }
            _ => {}
        }
        self.set_value(self.value() + 1.0);
        let mut metrics = vec![
            Metric::new("actor/pg_loss", 0.5),
            Metric::new("actor/grad_norm", fake_grad_norm(step)),
        ];
        let meta: serde_json::Value =
            serde_json::from_str(batch.meta_json.as_str()).unwrap_or_default();
        if ON_POLICY && meta["calculate_entropy"] == true {
            metrics.push(Metric::new("actor/entropy", 0.75));
        }
        Ok(metrics)
    }
    fn update_critic(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        self.log.push(Event::UpdateCritic {
            role: self.role.clone(),
            keys: batch_keys(batch),
        });
        Ok(vec![Metric::new("critic/vf_loss", 0.25)])
    }
    fn save_checkpoint(&mut self, dir: &str, global_step: u64) -> Result<(), PluginError> {
        self.log.push(Event::Save {
            role: self.role.clone(),
            dir: dir.into(),
            step: global_step,
        });
        std::fs::create_dir_all(dir).map_err(|e| PluginError::other(e.to_string()))?;
        let state = json!({"value": self.value(), "step": global_step});
        std::fs::write(Path::new(dir).join(ENGINE_STATE), state.to_string())
            .map_err(|e| PluginError::other(e.to_string()))
    }
    fn load_checkpoint(&mut self, dir: &str) -> Result<u64, PluginError> {
        self.log.push(Event::Load {
            role: self.role.clone(),
            dir: dir.into(),
        });
        let text = std::fs::read_to_string(Path::new(dir).join(ENGINE_STATE))
            .map_err(|e| PluginError::other(format!("{dir}: {e}")))?;
        let state: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| PluginError::other(e.to_string()))?;
        self.set_value(state["value"].as_f64().unwrap_or(f64::NAN) as f32);
        Ok(state["step"].as_u64().unwrap_or(0))
    }
    fn weights(&mut self) -> Result<Vec<TensorRef<'_>>, PluginError> {
        self.log.push(Event::Weights(self.role.clone()));
        Ok(vec![TensorRef::new(
            "w",
            DType::F32,
            &self.shape,
            &self.weight,
        )?])
    }
    fn export_hf(&mut self, dir: &str) -> Result<(), PluginError> {
        self.log.push(Event::Export(self.role.clone()));
        std::fs::create_dir_all(dir)?;
        std::fs::write(Path::new(dir).join("weight.txt"), self.value().to_string())?;
        Ok(())
    }
}

/// An engine that can only be an actor or a reference.
struct NoCriticEngine;

impl Engine for NoCriticEngine {
    fn capabilities() -> EngineCapabilities {
        EngineCapabilities::default().roles(["actor", "ref"])
    }
    fn init(&mut self, _init: &ComponentInit) -> Result<(), PluginError> {
        Ok(())
    }
}

fn char_id(c: char) -> u32 {
    (SPECIAL_TOKENS.len() + ALPHABET.find(c).expect("a task character")) as u32
}

fn decode(ids: &[u32]) -> String {
    ids.iter()
        .filter_map(|&id| {
            let i = (id as usize).checked_sub(SPECIAL_TOKENS.len())?;
            ALPHABET.chars().nth(i)
        })
        .collect()
}

/// The sum an addition prompt (`3+5=`) asks for.
fn answer(prompt: &str) -> u64 {
    prompt
        .trim_end_matches('=')
        .split('+')
        .map(|n| n.parse::<u64>().unwrap())
        .sum()
}

/// Answers the addition task: the first of each prompt's `n` responses is right, the others
/// wrong, so training scores average 1/n·… and validation (n = 1) scores 1.
struct FakeRollout {
    log: Log,
    version: Option<u64>,
}

impl Rollout for FakeRollout {
    fn capabilities() -> RolloutCapabilities {
        RolloutCapabilities::default().weight_sources([WeightSourceKind::Memory])
    }
    fn init(&mut self, _init: &ComponentInit) -> Result<(), PluginError> {
        self.log.push(Event::Init("rollout".into()));
        Ok(())
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        let prompts: Vec<String> = request.prompts.iter().map(|p| decode(p)).collect();
        self.log.push(Event::Generate {
            n: request.sampling.n,
            version: self.version,
            prompts: prompts.clone(),
            seed: request.sampling.seed,
            max_new_tokens: request.sampling.max_new_tokens,
        });
        let mut completions = Vec::new();
        for (i, prompt) in prompts.iter().enumerate() {
            let sum = answer(prompt);
            for j in 0..request.sampling.n {
                let text = format!("#### {}", if j == 0 { sum } else { sum + 1 });
                let ids: Vec<u32> = text.chars().map(char_id).collect();
                // The right answer at the fake engine's log-prob, the others at ln 0.5.
                let logprob = if j == 0 { -0.5 } else { 0.5f32.ln() };
                let logprobs = vec![logprob; ids.len()];
                completions.push(Completion::new(i as u32, ids, logprobs, FinishReason::Stop));
            }
        }
        Ok(GenerateOutput::new(completions, self.version))
    }
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        if source.kind()? != WeightSourceKind::Memory {
            return Err(PluginError::other("expected a memory handover"));
        }
        let data = source
            .tensors
            .first()
            .ok_or_else(|| PluginError::other("no tensors"))?
            .data;
        let value = f32::from_le_bytes(data.as_slice()[..4].try_into().unwrap());
        self.log.push(Event::UpdateWeights {
            version: source.version,
            value,
        });
        self.version = Some(source.version);
        Ok(())
    }
}

/// The fake rollout with sleep/wake-up, which refuses to work asleep.
struct SleepyRollout {
    inner: FakeRollout,
    asleep: bool,
}

impl SleepyRollout {
    fn awake(&self, what: &str) -> Result<(), PluginError> {
        if self.asleep {
            return Err(PluginError::other(format!("{what} while asleep")));
        }
        Ok(())
    }
}

impl Rollout for SleepyRollout {
    fn capabilities() -> RolloutCapabilities {
        FakeRollout::capabilities().sleep_wake(true)
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        self.inner.init(init)
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        self.awake("generate")?;
        self.inner.generate(request)
    }
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        self.awake("update_weights")?;
        self.inner.update_weights(source)
    }
    fn sleep(&mut self, level: u32) -> Result<(), PluginError> {
        self.awake("sleep")?;
        self.inner.log.push(Event::Sleep(level));
        self.asleep = true;
        Ok(())
    }
    fn wake_up(&mut self) -> Result<(), PluginError> {
        if !self.asleep {
            return Err(PluginError::other("wake_up while awake"));
        }
        self.inner.log.push(Event::WakeUp);
        self.asleep = false;
        Ok(())
    }
}

/// The fake rollout, declaring its log-probs (for `rollout.calculate_log_probs`).
struct LogProbRollout(FakeRollout);

impl Rollout for LogProbRollout {
    fn capabilities() -> RolloutCapabilities {
        FakeRollout::capabilities().logprobs(true)
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        self.0.init(init)
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        self.0.generate(request)
    }
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        self.0.update_weights(source)
    }
}

/// The fake rollout, recording routing: one sparse layer, top-2, token `t` of the fed sequence
/// (prompt, then response but its last token) routed to experts `1 + t % 3` and `4`.
struct RoutingRollout(FakeRollout);

impl Rollout for RoutingRollout {
    fn capabilities() -> RolloutCapabilities {
        FakeRollout::capabilities().routed_experts(true)
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        self.0.init(init)
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        let mut out = self.0.generate(request)?;
        out.completions = out
            .completions
            .into_iter()
            .map(|c| {
                let fed = request.prompts[c.prompt_index as usize].len() + c.response_ids.len() - 1;
                let experts = (0..fed as u32).flat_map(|t| [1 + t % 3, 4]).collect();
                c.with_routed_experts(RoutedExperts::new(1, 2, experts))
            })
            .collect();
        Ok(out)
    }
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        self.0.update_weights(source)
    }
}

/// A rollout that only reloads weights from files.
struct FileOnlyRollout;

impl Rollout for FileOnlyRollout {
    fn capabilities() -> RolloutCapabilities {
        RolloutCapabilities::default().weight_sources([WeightSourceKind::File])
    }
    fn init(&mut self, _init: &ComponentInit) -> Result<(), PluginError> {
        Ok(())
    }
    fn generate(&mut self, _request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        Ok(GenerateOutput::default())
    }
}

/// The fake rollout, taking its weights from the double-buffered disk store: each load checks
/// that the handover is a slot the sync holds (a writer's exclusive lock on it fails) and reads
/// the actor's tensor from the slot's file.
struct SlotRollout {
    inner: FakeRollout,
}

impl Rollout for SlotRollout {
    fn capabilities() -> RolloutCapabilities {
        RolloutCapabilities::default().weight_sources([WeightSourceKind::File])
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        self.inner.init(init)
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        self.inner.generate(request)
    }
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        use std::os::fd::AsRawFd;
        let handover = source.handover()?;
        let dir = PathBuf::from(&handover.path);
        let lock = std::fs::File::open(dir.with_extension("lock")).map_err(|e| {
            PluginError::other(format!("no slot lock beside {}: {e}", dir.display()))
        })?;
        // SAFETY: a non-blocking flock on a descriptor this function owns.
        let taken = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
        if taken {
            return Err(PluginError::other(
                "the slot is not held while the rollout loads it",
            ));
        }
        let bytes = std::fs::read(dir.join(crate::builtin::weight_sync::WEIGHTS_FILE))
            .map_err(|e| PluginError::other(e.to_string()))?;
        let file = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| PluginError::other(e.to_string()))?;
        // The fake engine lends one tensor, `w`; a file handover carries no views.
        let data = file
            .tensor("w")
            .map_err(|e| PluginError::other(e.to_string()))?;
        let value = f32::from_le_bytes(data.data()[..4].try_into().unwrap());
        self.inner.log.push(Event::UpdateWeights {
            version: source.version,
            value,
        });
        self.inner.version = Some(source.version);
        Ok(())
    }
}

struct FakeSync {
    log: Log,
}

impl CheckpointEngine for FakeSync {
    fn capabilities() -> CheckpointCapabilities {
        CheckpointCapabilities::default().handover(WeightSourceKind::Memory)
    }
    fn init(&mut self, _init: &ComponentInit) -> Result<(), PluginError> {
        self.log.push(Event::Init("sync".into()));
        Ok(())
    }
    fn send_weights(&mut self, weights: &WeightSource<'_>) -> Result<Handover, PluginError> {
        self.log.push(Event::Send(weights.version));
        Ok(Handover::memory())
    }
    fn finalize(&mut self) -> Result<(), PluginError> {
        self.log.push(Event::Finalize);
        Ok(())
    }
}

struct FakeTracker {
    log: Log,
}

impl Tracker for FakeTracker {
    fn capabilities() -> TrackerCapabilities {
        TrackerCapabilities::default().tables(true)
    }
    fn init(&mut self, _init: &ComponentInit) -> Result<(), PluginError> {
        self.log.push(Event::Init("tracker".into()));
        Ok(())
    }
    fn log(&mut self, step: u64, metrics: &[Metric]) -> Result<(), PluginError> {
        self.log.push(Event::Log {
            step,
            metrics: metrics
                .iter()
                .map(|m| (m.key.to_string(), m.value))
                .collect(),
        });
        Ok(())
    }
    fn log_table(&mut self, step: u64, _table: &Table) -> Result<(), PluginError> {
        self.log.push(Event::Table(step));
        Ok(())
    }
    fn finish(&mut self, exit_code: i32) -> Result<(), PluginError> {
        self.log.push(Event::Finish(exit_code));
        Ok(())
    }
}

/// A fresh registry holding only the fakes (all named `fake`, plus `no-critic` and `file-only`)
/// and the real `file` tracker.
fn registry(log: &Log, faults: Faults) -> Registry {
    let l8 = log.clone();
    let (l1, l2, l3, l4, l5, l6, l7) = (
        log.clone(),
        log.clone(),
        log.clone(),
        log.clone(),
        log.clone(),
        log.clone(),
        log.clone(),
    );
    let mut registry = Registry::default();
    registry.add_builtin(
        PluginBuilder::new("fakes", "0.0.0", "trainer test fakes")
            .engine("fake", 0, "records calls", move || {
                l1.push(Event::Created("engine"));
                FakeEngine::<false>::new(l1.clone(), faults)
            })
            .engine(
                "on-policy",
                0,
                "records calls; takes on-policy old log-probs itself",
                {
                    let log = log.clone();
                    move || FakeEngine::<true>::new(log.clone(), faults)
                },
            )
            .engine("no-critic", 0, "actor and ref only", move || {
                l2.push(Event::Created("engine"));
                NoCriticEngine
            })
            .rollout("fake", 0, "answers the addition task", move || {
                l3.push(Event::Created("rollout"));
                FakeRollout {
                    log: l3.clone(),
                    version: None,
                }
            })
            .rollout(
                "sleepy",
                0,
                "the fake rollout, with sleep/wake-up",
                move || {
                    l7.push(Event::Created("rollout"));
                    SleepyRollout {
                        inner: FakeRollout {
                            log: l7.clone(),
                            version: None,
                        },
                        asleep: false,
                    }
                },
            )
            .rollout("slots", 0, "the fake rollout, from the slot store", {
                let log = log.clone();
                move || SlotRollout {
                    inner: FakeRollout {
                        log: log.clone(),
                        version: None,
                    },
                }
            })
            .checkpoint(
                "disk",
                0,
                "the built-in disk weight sync",
                crate::builtin::DiskWeightSync::default,
            )
            .config_section("disk")
            .rollout(
                "logprobs",
                0,
                "the fake rollout, with log-probs",
                move || {
                    l8.push(Event::Created("rollout"));
                    LogProbRollout(FakeRollout {
                        log: l8.clone(),
                        version: None,
                    })
                },
            )
            .rollout("routing", 0, "the fake rollout, with routing", {
                let log = log.clone();
                move || {
                    RoutingRollout(FakeRollout {
                        log: log.clone(),
                        version: None,
                    })
                }
            })
            .rollout("file-only", 0, "takes weights from files", move || {
                l4.push(Event::Created("rollout"));
                FileOnlyRollout
            })
            .checkpoint("fake", 0, "memory handover", move || {
                l5.push(Event::Created("checkpoint"));
                FakeSync { log: l5.clone() }
            })
            .tracker("fake", 0, "records logs", move || {
                l6.push(Event::Created("tracker"));
                FakeTracker { log: l6.clone() }
            })
            .tracker(
                "file",
                0,
                "the built-in file logger",
                crate::builtin::FileTracker::default,
            )
            .reward(
                verl_rewards::RULE_REWARD,
                0,
                "the built-in rule rewards",
                verl_rewards::RuleReward::default,
            ),
    );
    registry
}

fn cpu() -> DeviceReport {
    serde_json::from_value(json!({
        "name": "cpu", "available": true, "count": 1, "reason": "", "priority": 0, "plugin": "",
        "origin": "", "vendor": "", "device_type": "cpu", "comm_backend": "gloo",
        "visible_devices_env": [], "device_names": [], "env_updates": [],
    }))
    .unwrap()
}

fn placement(vars: &[(&str, &str)]) -> Placement {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Placement::with_env(&cpu(), 0, move |k| vars.get(k).cloned()).unwrap()
}

/// The addition task (8 training prompts, 3 validation prompts) and a tokenizer in a temporary
/// directory.
struct Setup {
    dir: tempfile::TempDir,
    train: PathBuf,
    val: PathBuf,
    model: PathBuf,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let task = AdditionTask {
        train_size: 8,
        val_size: 3,
        ..Default::default()
    };
    let (train, val) = task.write(&dir.path().join("data")).unwrap();
    let model = dir.path().join("model");
    synthetic::write_tokenizer(&model).unwrap();
    Setup {
        dir,
        train,
        val,
        model,
    }
}

impl Setup {
    fn run_dir(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// GRPO on the fakes: 4 prompts × 2 responses per step, 2 batches per epoch, 5 steps; no
    /// validation, no checkpoints unless a test asks.
    fn config(&self, run: &str) -> Config {
        let mut c = Config::default();
        c.data.train_files = vec![self.train.to_string_lossy().into_owned()];
        c.data.val_files = vec![self.val.to_string_lossy().into_owned()];
        c.data.train_batch_size = 4;
        c.data.max_prompt_length = 16;
        c.data.max_response_length = 8;
        let arr = &mut c.actor_rollout_ref;
        arr.model.path = self.model.to_string_lossy().into_owned();
        arr.actor.strategy = "fake".into();
        arr.actor.ppo_mini_batch_size = 4;
        arr.actor.use_kl_loss = false;
        arr.rollout.name = "fake".into();
        arr.rollout.n = 2;
        arr.rollout.val_kwargs.n = 1;
        arr.rollout.checkpoint_engine.backend = "fake".into();
        c.critic.strategy = "fake".into();
        c.algorithm.adv_estimator = AdvEstimator::Grpo;
        let t = &mut c.trainer;
        t.logger = vec!["fake".into()];
        t.default_local_dir = self.run_dir(run).to_string_lossy().into_owned();
        t.total_training_steps = Some(5);
        t.save_freq = -1;
        t.test_freq = -1;
        t.val_before_train = false;
        t.resume_mode = ResumeMode::Auto;
        t.seed = 0;
        c
    }
}

fn fit(config: Config, log: &Log, faults: Faults) -> Result<RunSummary, TrainError> {
    Trainer::new(config, &registry(log, faults), &placement(&[]))?.fit()
}

/// The event as a short label; `None` for what the order tests leave out.
fn label(event: &Event) -> Option<String> {
    Some(match event {
        Event::Created(_) | Event::Init(_) | Event::Table(_) | Event::Routed { .. } => {
            return None;
        }
        Event::Generate { n: 1, version, .. } => format!("gen(val)@{version:?}"),
        Event::Generate { version, .. } => format!("gen@{version:?}"),
        Event::LogProb { role, .. } => format!("{role}.log_prob"),
        Event::Values { role, .. } => format!("{role}.values"),
        Event::UpdateActor { role, .. } => format!("{role}.update_actor"),
        Event::UpdateCritic { role, .. } => format!("{role}.update_critic"),
        Event::Weights(role) => format!("{role}.weights"),
        Event::Send(v) => format!("sync.send@{v}"),
        Event::UpdateWeights { version, .. } => format!("rollout.update_weights@{version}"),
        Event::Finalize => "sync.finalize".into(),
        Event::Sleep(level) => format!("rollout.sleep({level})"),
        Event::WakeUp => "rollout.wake_up".into(),
        Event::Save { role, step, .. } => format!("{role}.save@{step}"),
        Event::Load { role, .. } => format!("{role}.load"),
        Event::Export(role) => format!("{role}.export"),
        Event::Log { step, .. } => format!("log@{step}"),
        Event::Finish(code) => format!("finish({code})"),
    })
}

fn labels(events: &[Event]) -> Vec<String> {
    events.iter().filter_map(label).collect()
}

/// One training step's calls in verl's order.
fn step_labels(step: u64, reference: bool, critic: bool) -> Vec<String> {
    let previous = if step == 1 {
        "None".to_owned()
    } else {
        format!("Some({})", step - 1)
    };
    let mut out = vec![format!("gen@{previous}"), "actor.log_prob".into()];
    if reference {
        out.push("ref.log_prob".into());
    }
    if critic {
        out.push("critic.values".into());
        out.push("critic.update_critic".into());
    }
    out.extend([
        "actor.update_actor".into(),
        "actor.weights".into(),
        format!("sync.send@{step}"),
        format!("rollout.update_weights@{step}"),
        "sync.finalize".into(),
        format!("log@{step}"),
    ]);
    out
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn logs(events: &[Event]) -> Vec<(u64, &BTreeMap<String, f64>)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Log { step, metrics } => Some((*step, metrics)),
            _ => None,
        })
        .collect()
}

#[test]
fn each_step_runs_in_verls_order() {
    let s = setup();
    // (adv_estimator, use_kl_loss): GRPO alone; GRPO with a KL loss (ref); GAE (critic) with both.
    let cases = [
        (AdvEstimator::Grpo, false, false, false),
        (AdvEstimator::Grpo, true, true, false),
        (AdvEstimator::Gae, true, true, true),
    ];
    for (i, (estimator, kl_loss, reference, critic)) in cases.into_iter().enumerate() {
        let mut c = s.config(&format!("order{i}"));
        c.algorithm.adv_estimator = estimator;
        c.actor_rollout_ref.actor.use_kl_loss = kl_loss;
        c.trainer.total_training_steps = Some(3);
        let log = Log::default();
        let summary = fit(c, &log, Faults::default()).unwrap();
        assert_eq!(summary.global_step, 3);
        let events = log.events();

        // Components are created and initialised in order, each once, before any call.
        let mut setup: Vec<String> = vec!["engine:actor".into()];
        if reference {
            setup.push("engine:ref".into());
        }
        if critic {
            setup.push("engine:critic".into());
        }
        setup.extend(strings(&["rollout", "sync", "tracker"]));
        let inits: Vec<String> = events
            .iter()
            .filter_map(|e| match e {
                Event::Init(what) => Some(what.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(inits, setup, "case {i}");
        let first_call = events.iter().position(|e| label(e).is_some()).unwrap();
        assert!(
            events[first_call..]
                .iter()
                .all(|e| !matches!(e, Event::Init(_) | Event::Created(_))),
            "case {i}: a component was created after the loop started"
        );

        let mut expected: Vec<String> = (1..=3)
            .flat_map(|step| step_labels(step, reference, critic))
            .collect();
        expected.extend(strings(&["actor.export", "finish(0)"]));
        assert_eq!(labels(&events), expected, "case {i}");

        // Each call sees what the previous stages added to the batch.
        let base = strings(&[
            keys::ATTENTION_MASK,
            keys::INPUT_IDS,
            keys::RESPONSE_MASK,
            keys::RESPONSES,
        ]);
        let with = |extra: &[&str]| {
            let mut k = base.clone();
            k.extend(strings(extra));
            k.sort();
            k
        };
        let mut after_values = vec![keys::OLD_LOG_PROBS];
        if reference {
            after_values.push(keys::REF_LOG_PROB);
        }
        if critic {
            after_values.push(keys::VALUES);
        }
        let mut update_keys = after_values.clone();
        update_keys.extend([keys::ADVANTAGES, keys::RETURNS]);
        for e in &events {
            match e {
                Event::LogProb { role, keys: k } if role == "actor" => {
                    assert_eq!(k, &base, "case {i}: old log-probs")
                }
                Event::LogProb { role, keys: k } => {
                    assert_eq!(role, "ref");
                    assert_eq!(k, &with(&[keys::OLD_LOG_PROBS]), "case {i}: ref")
                }
                Event::Values { keys: k, .. } => {
                    let mut expected = vec![keys::OLD_LOG_PROBS];
                    if reference {
                        expected.push(keys::REF_LOG_PROB);
                    }
                    assert_eq!(k, &with(&expected), "case {i}: values")
                }
                Event::UpdateCritic { keys: k, .. } | Event::UpdateActor { keys: k, .. } => {
                    assert_eq!(k, &with(&update_keys), "case {i}: update")
                }
                _ => {}
            }
        }

        // The reward was computed from the rollout's text: one right answer of two per prompt.
        for (step, metrics) in logs(&events) {
            assert_eq!(metrics["critic/score/mean"], 0.5, "case {i}, step {step}");
            assert_eq!(metrics["training/global_step"], step as f64);
            assert_eq!(metrics["actor/pg_loss"], 0.5);
            assert_eq!(metrics.contains_key("critic/vf_loss"), critic);
            assert!(metrics.contains_key("timing_s/update_weights"));
            // Scoring is timed apart from generation, as in verl.
            assert!(metrics["timing_s/reward"] > 0.0 && metrics["timing_s/gen"] > 0.0);
            // verl's rollout-vs-actor metrics: |e^-0.5 − 0.5| on the wrong answers' tokens, 0 on
            // the right ones'.
            let diff = (-0.5f64).exp() - 0.5;
            assert_eq!(metrics["training/rollout_probs_diff_valid"], 1.0);
            let max = metrics["training/rollout_probs_diff_max"];
            assert!((max - diff).abs() < 1e-6, "case {i}: {max}");
            let mean = metrics["training/rollout_probs_diff_mean"];
            assert!(mean > 0.0 && mean < diff, "case {i}: {mean}");
        }
        // A response is clipped when it used all of `data.max_response_length` (8 tokens), not
        // when it is merely the batch's longest.
        let generations = train_generations(&events);
        assert_eq!(generations.len(), 3);
        for ((step, metrics), (prompts, _)) in logs(&events).into_iter().zip(&generations) {
            let lengths: Vec<usize> = prompts
                .iter()
                .flat_map(|p| [answer(p), answer(p) + 1])
                .map(|sum| format!("#### {sum}").len())
                .collect();
            let clipped = lengths.iter().filter(|&&l| l == 8).count() as f64 / lengths.len() as f64;
            assert_eq!(
                metrics["response_length/clip_ratio"], clipped,
                "case {i}, step {step}: {lengths:?}"
            );
        }
    }
}

#[test]
fn the_rollout_generates_with_the_previous_steps_weights() {
    let s = setup();
    let mut c = s.config("versions");
    c.trainer.total_training_steps = Some(4);
    c.trainer.test_freq = 1;
    let log = Log::default();
    fit(c, &log, Faults::default()).unwrap();
    let events = log.events();

    let synced: Vec<(u64, f32)> = events
        .iter()
        .filter_map(|e| match e {
            Event::UpdateWeights { version, value } => Some((*version, *value)),
            _ => None,
        })
        .collect();
    // After step k the rollout gets version k, holding the actor's weights after k updates.
    assert_eq!(synced, vec![(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]);
    let sent: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            Event::Send(v) => Some(*v),
            _ => None,
        })
        .collect();
    assert_eq!(sent, vec![1, 2, 3, 4]);

    let generated: Vec<(u32, Option<u64>)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Generate { n, version, .. } => Some((*n, *version)),
            _ => None,
        })
        .collect();
    // Step k+1 generates with version k (step 1 with the rollout's own initial weights), and
    // validation after step k with version k.
    assert_eq!(
        generated,
        vec![
            (2, None),
            (1, Some(1)),
            (2, Some(1)),
            (1, Some(2)),
            (2, Some(2)),
            (1, Some(3)),
            (2, Some(3)),
            (1, Some(4)),
        ]
    );
    // The engine batch says which step it belongs to.
    let steps: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            Event::UpdateActor { step, .. } => Some(*step),
            _ => None,
        })
        .collect();
    assert_eq!(steps, vec![1, 2, 3, 4]);
}

#[test]
fn critic_warmup_holds_the_actor_and_the_rollouts_weights() {
    // critic_warmup=2: steps 1 and 2 train only the critic (verl's documented meaning, "iterations
    // to train the critic before actual policy learning"; verl's code, `critic_warmup <=
    // global_steps`, already updates the actor at step 2).
    let s = setup();
    let mut c = s.config("warmup");
    c.algorithm.adv_estimator = AdvEstimator::Gae;
    c.trainer.critic_warmup = 2;
    c.trainer.total_training_steps = Some(3);
    let log = Log::default();
    fit(c, &log, Faults::default()).unwrap();
    let mut expected = strings(&[
        "gen@None",
        "actor.log_prob",
        "critic.values",
        "critic.update_critic",
        "log@1",
        "gen@None",
        "actor.log_prob",
        "critic.values",
        "critic.update_critic",
        "log@2",
    ]);
    expected.extend(step_labels(3, false, true).into_iter().map(|l| {
        // Step 3 is the first update: it generates with the initial weights.
        if l.starts_with("gen@") {
            "gen@None".to_owned()
        } else {
            l
        }
    }));
    expected.extend(strings(&["actor.export", "finish(0)"]));
    assert_eq!(labels(&log.events()), expected);
}

#[test]
fn free_cache_engine_sleeps_the_rollout_while_the_engines_train() {
    // Asleep from the end of generation to the weight sync; awake for validation and the next
    // step, also after a warm-up step that syncs nothing (the rollout refuses work asleep).
    let s = setup();
    let mut c = s.config("sleepy");
    c.actor_rollout_ref.rollout.name = "sleepy".into();
    c.algorithm.adv_estimator = AdvEstimator::Gae;
    c.trainer.critic_warmup = 1;
    c.trainer.total_training_steps = Some(2);
    let log = Log::default();
    fit(c.clone(), &log, Faults::default()).unwrap();
    let sleepy: Vec<String> = labels(&log.events())
        .into_iter()
        .filter(|l| l.starts_with("rollout.") || l.starts_with("gen") || l.starts_with("log@"))
        .collect();
    assert_eq!(
        sleepy,
        strings(&[
            "gen@None",
            "rollout.sleep(1)",
            "rollout.wake_up",
            "log@1",
            "gen@None",
            "rollout.sleep(1)",
            "rollout.wake_up",
            "rollout.update_weights@2",
            "log@2",
        ])
    );

    // Without free_cache_engine the rollout is never put to sleep.
    c.actor_rollout_ref.rollout.free_cache_engine = false;
    c.trainer.default_local_dir = s.run_dir("awake").to_string_lossy().into_owned();
    let log = Log::default();
    fit(c, &log, Faults::default()).unwrap();
    assert!(
        !log.events()
            .iter()
            .any(|e| matches!(e, Event::Sleep(_) | Event::WakeUp))
    );
}

fn checkpoint_steps(run_dir: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(run_dir)
        .unwrap()
        .filter_map(|e| crate::checkpoint::step_of(&e.unwrap().path()))
        .collect();
    steps.sort_unstable();
    steps
}

#[test]
fn validation_and_checkpoints_follow_their_frequencies_and_the_last_step() {
    let s = setup();
    let mut c = s.config("cadence");
    c.trainer.save_freq = 2;
    c.trainer.test_freq = 2;
    c.trainer.val_before_train = true;
    c.trainer.log_val_generations = 1;
    c.algorithm.adv_estimator = AdvEstimator::Gae;
    let log = Log::default();
    let summary = fit(c, &log, Faults::default()).unwrap();
    let events = log.events();

    let val_steps: Vec<u64> = summary.validations.iter().map(|(s, _)| *s).collect();
    assert_eq!(val_steps, vec![0, 2, 4, 5]);
    for (step, metrics) in &summary.validations {
        assert_eq!(
            metrics["val-core/verl-core/addition/reward/mean@1"], 1.0,
            "step {step}"
        );
    }
    // The validation samples are logged at the step the validation belongs to.
    let tables: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            Event::Table(step) => Some(*step),
            _ => None,
        })
        .collect();
    assert_eq!(tables, vec![0, 2, 4, 5]);

    // Validation, then checkpoint, then the step's log; each checkpoint holds actor and critic.
    let mut expected = strings(&["gen(val)@None", "log@0"]);
    for step in 1..=5u64 {
        let mut labels = step_labels(step, false, true);
        let log = labels.pop().unwrap();
        if step % 2 == 0 || step == 5 {
            labels.push(format!("gen(val)@Some({step})"));
            labels.push(format!("actor.save@{step}"));
            labels.push(format!("critic.save@{step}"));
        }
        labels.push(log);
        expected.extend(labels);
    }
    expected.extend(strings(&["actor.export", "finish(0)"]));
    assert_eq!(labels(&events), expected);

    // The validation metrics are in their step's log, and only there.
    for (step, metrics) in logs(&events) {
        let has_val = metrics.contains_key("val-core/verl-core/addition/reward/mean@1");
        assert_eq!(has_val, [0, 2, 4, 5].contains(&step), "step {step}");
        assert_eq!(
            metrics.contains_key("timing_s/save_checkpoint"),
            [2, 4, 5].contains(&step),
            "step {step}"
        );
    }

    let run_dir = s.run_dir("cadence");
    assert_eq!(checkpoint_steps(&run_dir), vec![2, 4, 5]);
    assert_eq!(
        std::fs::read_to_string(run_dir.join(crate::checkpoint::LATEST_FILE)).unwrap(),
        "5"
    );
    for step in [2, 4, 5] {
        let dir = run_dir.join(format!("global_step_{step}"));
        for role in ["actor", "critic"] {
            assert!(dir.join(role).join(ENGINE_STATE).is_file(), "{step} {role}");
        }
        assert!(dir.join(super::TRAINER_STATE_FILE).is_file());
    }

    // Both off: neither happens.
    let mut c = s.config("never");
    c.trainer.save_freq = -1;
    c.trainer.test_freq = -1;
    c.trainer.val_before_train = false;
    let log = Log::default();
    let summary = fit(c, &log, Faults::default()).unwrap();
    assert!(summary.validations.is_empty());
    assert!(log.events().iter().all(|e| !matches!(
        e,
        Event::Save { .. } | Event::Generate { n: 1, .. } | Event::Table(_)
    )));
    assert!(checkpoint_steps(&s.run_dir("never")).is_empty());

    // A frequency that does not divide the run: its multiples and the last step.
    let mut c = s.config("every3");
    c.trainer.save_freq = 3;
    c.trainer.test_freq = 4;
    let log = Log::default();
    let summary = fit(c, &log, Faults::default()).unwrap();
    let val_steps: Vec<u64> = summary.validations.iter().map(|(s, _)| *s).collect();
    assert_eq!(val_steps, vec![4, 5]);
    assert_eq!(checkpoint_steps(&s.run_dir("every3")), vec![3, 5]);
}

/// `(step, metrics without timings and measurements of the machine)` of every log.
fn comparable_logs(events: &[Event]) -> Vec<(u64, BTreeMap<String, f64>)> {
    logs(events)
        .into_iter()
        .map(|(step, metrics)| {
            let kept = metrics
                .iter()
                .filter(|(k, _)| {
                    !k.starts_with("timing_s/")
                        && !k.starts_with("timing_per_token_ms/")
                        // How far the rollouter was ahead, and the wait: timing, not results.
                        && !k.starts_with("fully_async/monitor/")
                        && k.as_str() != "fully_async/total_wait_time"
                        && (!k.starts_with("perf/") || k.as_str() == "perf/total_num_tokens")
                })
                .map(|(k, v)| (k.clone(), *v))
                .collect();
            (step, kept)
        })
        .collect()
}

/// `(prompts, seed)` of every training generation.
fn train_generations(events: &[Event]) -> Vec<(Vec<String>, Option<u64>)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Generate {
                n: 2,
                prompts,
                seed,
                ..
            } => Some((prompts.clone(), *seed)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_resumed_run_continues_where_the_checkpoint_left_off() {
    let s = setup();
    let configure = |run: &str| {
        let mut c = s.config(run);
        c.algorithm.adv_estimator = AdvEstimator::Gae;
        c.actor_rollout_ref.actor.use_kl_loss = true;
        c.trainer.save_freq = 2;
        c
    };

    // The reference: five steps without interruption.
    let log = Log::default();
    fit(configure("whole"), &log, Faults::default()).unwrap();
    let whole = log.events();
    let whole_logs = comparable_logs(&whole);
    assert_eq!(
        whole_logs.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5]
    );
    // Five steps over two batches per epoch: the resumed run must pick up mid-epoch and cross one.
    assert_eq!(whole_logs[4].1["training/epoch"], 2.0);

    // The same run failing in step 4: the last checkpoint is step 2.
    let log = Log::default();
    let err = fit(
        configure("resumed"),
        &log,
        Faults {
            fail_update_at: Some(4),
            ..Faults::default()
        },
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("injected failure at step 4"),
        "{err}"
    );
    let first = log.events();
    assert_eq!(first.last(), Some(&Event::Finish(1)));
    let run_dir = s.run_dir("resumed");
    assert_eq!(checkpoint_steps(&run_dir), vec![2]);
    let first_logs = comparable_logs(&first);
    assert_eq!(first_logs[..], whole_logs[..3]);

    // Resumed: state and weights from step 2, the records of steps 1 and 2 logged again from the
    // checkpoint (for trackers that lost them), then steps 3..=5 exactly as the whole run did them.
    let log = Log::default();
    let summary = fit(configure("resumed"), &log, Faults::default()).unwrap();
    assert_eq!(summary.global_step, 5);
    let resumed = log.events();
    let checkpoint = run_dir.join("global_step_2");
    let calls: Vec<&Event> = resumed
        .iter()
        .filter(|e| label(e).is_some() && !matches!(e, Event::Log { .. }))
        .take(7)
        .collect();
    assert_eq!(
        calls,
        vec![
            &Event::Load {
                role: "actor".into(),
                dir: checkpoint.join("actor"),
            },
            &Event::Load {
                role: "critic".into(),
                dir: checkpoint.join("critic"),
            },
            &Event::Weights("actor".into()),
            &Event::Send(2),
            &Event::UpdateWeights {
                version: 2,
                value: 2.0
            },
            &Event::Finalize,
            calls[6],
        ]
    );
    assert!(
        matches!(
            calls[6],
            Event::Generate {
                n: 2,
                version: Some(2),
                ..
            }
        ),
        "{:?}",
        calls[6]
    );
    // The checkpoint's records first, then no step skipped, every one the same as without the
    // interruption.
    let resumed_logs = comparable_logs(&resumed);
    assert_eq!(resumed_logs[..], whole_logs[..]);
    assert!(
        resumed
            .iter()
            .position(|e| matches!(e, Event::Log { step: 2, .. }))
            < resumed
                .iter()
                .position(|e| matches!(e, Event::Generate { .. })),
        "the checkpoint's records come before training goes on"
    );
    assert_eq!(
        train_generations(&resumed)[..],
        train_generations(&whole)[2..],
        "the loader (and the sampling seeds) continue where step 2 left them"
    );
    assert_eq!(
        synced(&resumed),
        vec![(2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0)]
    );
    assert_eq!(checkpoint_steps(&run_dir), vec![2, 4, 5]);

    // Resuming a finished run trains no further; validation before training (verl: at the
    // resumed step) sees the resumed weights, and is not logged as a second record of step 5,
    // whose record comes from its checkpoint.
    let mut c = configure("resumed");
    c.trainer.val_before_train = true;
    let log = Log::default();
    let summary = fit(c, &log, Faults::default()).unwrap();
    assert_eq!(summary.global_step, 5);
    let events = log.events();
    assert_eq!(
        labels(&events),
        strings(&[
            "actor.load",
            "critic.load",
            "actor.weights",
            "sync.send@5",
            "rollout.update_weights@5",
            "sync.finalize",
            "log@5",
            "gen(val)@Some(5)",
            "actor.export",
            "finish(0)",
        ])
    );
    assert_eq!(comparable_logs(&events)[..], whole_logs[4..]);
    assert_eq!(summary.validations[0].0, 5);

    // resume_mode=resume_path: from the named checkpoint, into a new directory.
    let mut c = configure("from-path");
    c.trainer.resume_mode = ResumeMode::ResumePath;
    c.trainer.resume_from_path = Some(checkpoint.to_string_lossy().into_owned());
    c.trainer.total_training_steps = Some(3);
    let log = Log::default();
    fit(c, &log, Faults::default()).unwrap();
    let events = log.events();
    assert_eq!(
        events.iter().find(|e| matches!(e, Event::Load { .. })),
        Some(&Event::Load {
            role: "actor".into(),
            dir: checkpoint.join("actor"),
        })
    );
    assert_eq!(comparable_logs(&events)[..], whole_logs[..3]);
    assert_eq!(checkpoint_steps(&s.run_dir("from-path")), vec![3]);
    let mut c = configure("from-path");
    c.trainer.resume_mode = ResumeMode::ResumePath;
    let err = fit(c, &Log::default(), Faults::default()).unwrap_err();
    assert!(
        err.to_string().contains("trainer.resume_from_path"),
        "{err}"
    );

    // resume_mode=disable starts over in the same directory.
    let mut c = configure("resumed");
    c.trainer.resume_mode = ResumeMode::Disable;
    c.trainer.total_training_steps = Some(1);
    let log = Log::default();
    fit(c, &log, Faults::default()).unwrap();
    assert!(
        log.events()
            .iter()
            .all(|e| !matches!(e, Event::Load { .. }))
    );
    assert_eq!(
        logs(&log.events())
            .iter()
            .map(|(s, _)| *s)
            .collect::<Vec<_>>(),
        vec![1]
    );
}

/// The lines of `<run>/metrics.jsonl`: `(step, data without timings)` or `(step, "table …")`.
fn file_records(run_dir: &Path) -> Vec<(u64, String)> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            let step = record["step"].as_u64().unwrap();
            let Some(data) = record["data"].as_object() else {
                return (step, format!("table {}", record["table"]));
            };
            let kept: BTreeMap<&String, &serde_json::Value> = data
                .iter()
                .filter(|(k, _)| {
                    !k.starts_with("timing_s/")
                        && !k.starts_with("timing_per_token_ms/")
                        && !k.starts_with("perf/")
                })
                .collect();
            (step, serde_json::to_string(&kept).unwrap())
        })
        .collect()
}

/// With the `file` logger, every step's record (and validation table) is in the file exactly
/// once and equal to an uninterrupted run's, wherever the crash came: between a checkpoint's
/// commit and its log (that step's record then lives only in the checkpoint), mid-write (a torn
/// line), or after a step that no checkpoint holds yet; and a resumed run's validation before
/// training adds no second record of the resumed step.
#[test]
fn every_step_is_recorded_once_whatever_the_crash() {
    let s = setup();
    let configure = |run: &str, save_freq: i64| {
        let mut c = s.config(run);
        c.trainer.logger = vec!["file".into()];
        c.trainer.save_freq = save_freq;
        c.trainer.test_freq = 2;
        c.trainer.val_before_train = true;
        c.trainer.log_val_generations = 1;
        c
    };
    fit(configure("whole", 1), &Log::default(), Faults::default()).unwrap();
    let whole = file_records(&s.run_dir("whole"));
    let steps: Vec<u64> = whole.iter().map(|(s, _)| *s).collect();
    // Validation (a table, then the record) before training and at steps 2, 4 and the last.
    assert_eq!(steps, [0, 0, 1, 2, 2, 3, 4, 4, 5, 5]);
    assert!(whole[0].1.starts_with("table") && !whole[1].1.starts_with("table"));

    let failing = Faults {
        fail_update_at: Some(4),
        ..Faults::default()
    };
    // Killed between checkpoint 3's commit and its log, in the middle of writing that line.
    let run_dir = s.run_dir("between-commit-and-log");
    fit(
        configure("between-commit-and-log", 1),
        &Log::default(),
        failing,
    )
    .unwrap_err();
    let file = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&file).unwrap();
    let last = text.trim_end().rfind('\n').unwrap() + 1;
    assert!(text[last..].starts_with("{\"data\""), "{}", &text[last..]);
    std::fs::write(&file, format!("{}{{\"data\":{{\"actor", &text[..last])).unwrap();
    assert_eq!(checkpoint_steps(&run_dir), [1, 2, 3]);
    fit(
        configure("between-commit-and-log", 1),
        &Log::default(),
        Faults::default(),
    )
    .unwrap();
    assert_eq!(file_records(&run_dir), whole);

    // Step 3 logged, but checkpoint 2 the latest: step 3 is trained and logged again, once.
    let run_dir = s.run_dir("after-an-unsaved-step");
    fit(
        configure("after-an-unsaved-step", 2),
        &Log::default(),
        failing,
    )
    .unwrap_err();
    assert_eq!(checkpoint_steps(&run_dir), [2]);
    assert_eq!(file_records(&run_dir).last().unwrap().0, 3);
    fit(
        configure("after-an-unsaved-step", 2),
        &Log::default(),
        Faults::default(),
    )
    .unwrap();
    assert_eq!(file_records(&run_dir), whole);

    // Killed before the first checkpoint: the next run starts from scratch, and so does the file.
    let run_dir = s.run_dir("before-any-checkpoint");
    // (Four steps, so that the only checkpoint is the last step's.)
    let mut c = configure("before-any-checkpoint", 5);
    c.trainer.total_training_steps = Some(4);
    fit(
        c.clone(),
        &Log::default(),
        Faults {
            fail_update_at: Some(3),
            ..Faults::default()
        },
    )
    .unwrap_err();
    assert_eq!(checkpoint_steps(&run_dir), Vec::<u64>::new());
    fit(c, &Log::default(), Faults::default()).unwrap();
    assert_eq!(file_records(&run_dir), whole[..8]);
}

#[test]
fn capability_mismatches_fail_before_any_component_is_created() {
    let s = setup();
    let check = |c: Config, vars: &[(&str, &str)], wanted: &[&str]| {
        let log = Log::default();
        let err = match Trainer::new(c, &registry(&log, Faults::default()), &placement(vars)) {
            Ok(_) => panic!("expected a capability error"),
            Err(err) => err,
        };
        assert!(matches!(err, TrainError::Capability(_)), "{err:?}");
        let message = err.to_string();
        for part in wanted {
            assert!(message.contains(part), "`{part}` missing from: {message}");
        }
        assert_eq!(log.events(), vec![], "{message}");
    };

    // The weight sync hands over memory; the rollout only reads files.
    let mut c = s.config("caps");
    c.actor_rollout_ref.rollout.name = "file-only".into();
    check(
        c,
        &[],
        &[
            "rollout `file-only`",
            "actor_rollout_ref.rollout.name",
            "weight sync `fake`",
            "actor_rollout_ref.rollout.checkpoint_engine.backend",
            "memory",
            "[file]",
        ],
    );

    // A single-rank engine in a two-rank run.
    check(
        s.config("caps"),
        &[("WORLD_SIZE", "2"), ("RANK", "1")],
        &[
            "engine `fake`",
            "actor_rollout_ref.actor.strategy",
            "at most 1 rank",
            "WORLD_SIZE=2",
        ],
    );

    // GAE needs a critic the engine cannot be.
    let mut c = s.config("caps");
    c.algorithm.adv_estimator = AdvEstimator::Gae;
    c.critic.strategy = "no-critic".into();
    check(
        c,
        &[],
        &["engine `no-critic`", "critic.strategy", "critic role"],
    );

    // Rollout log-probs asked of a rollout without them.
    let mut c = s.config("caps");
    c.actor_rollout_ref.rollout.calculate_log_probs = true;
    check(
        c,
        &[],
        &[
            "actor_rollout_ref.rollout.calculate_log_probs",
            "rollout `fake`",
        ],
    );
}

/// Output locations that cannot be written fail before any component exists (issue: an
/// unwritable export directory used to surface only after every step had trained).
#[test]
fn unwritable_outputs_fail_before_step_one() {
    let s = setup();
    let check = |c: Config, wanted: &[&str]| {
        let log = Log::default();
        let err = match Trainer::new(c, &registry(&log, Faults::default()), &placement(&[])) {
            Ok(_) => panic!("expected an output error"),
            Err(err) => err,
        };
        assert!(matches!(err, TrainError::Output { .. }), "{err:?}");
        let message = err.to_string();
        for part in wanted {
            assert!(message.contains(part), "`{part}` missing from: {message}");
        }
        assert_eq!(log.events(), vec![], "{message}");
    };

    // The final export's place is taken by a file.
    let c = s.config("export-blocked");
    let run_dir = PathBuf::from(&c.trainer.default_local_dir);
    std::fs::create_dir_all(&run_dir).unwrap();
    std::fs::write(run_dir.join("huggingface"), b"not a directory").unwrap();
    check(
        c,
        &[
            "the final export",
            "huggingface",
            "not a directory",
            "nothing was trained",
        ],
    );

    // The checkpoint directory lies under a regular file.
    let mut c = s.config("under-a-file");
    let blocker = s.run_dir("blocker-file");
    std::fs::create_dir_all(blocker.parent().unwrap()).unwrap();
    std::fs::write(&blocker, b"x").unwrap();
    c.trainer.default_local_dir = blocker.join("run").to_string_lossy().into_owned();
    check(c, &["trainer.default_local_dir", "blocker-file"]);

    // A writable run leaves no probe file behind.
    let c = s.config("writable");
    let run_dir = PathBuf::from(&c.trainer.default_local_dir);
    let log = Log::default();
    Trainer::new(c, &registry(&log, Faults::default()), &placement(&[])).unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(&run_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// What an interrupted run left is cleaned at start, and the final export replaces the previous
/// one whole: a kill mid-export leaves the old export or the new one, never a half-written model.
#[test]
fn leftovers_are_cleaned_and_the_export_is_swapped_in_whole() {
    let s = setup();
    let mut c = s.config("leftovers");
    c.trainer.total_training_steps = Some(2);
    let run_dir = PathBuf::from(&c.trainer.default_local_dir);
    let leftovers = [".global_step_7.partial", ".huggingface.partial"];
    for dir in leftovers {
        std::fs::create_dir_all(run_dir.join(dir)).unwrap();
        std::fs::write(run_dir.join(dir).join("half.bin"), b"half").unwrap();
    }
    std::fs::write(run_dir.join(".latest_checkpointed_iteration.txt.tmp"), b"7").unwrap();
    std::fs::create_dir_all(run_dir.join("huggingface")).unwrap();
    std::fs::write(run_dir.join("huggingface/previous.txt"), b"old export").unwrap();

    let log = Log::default();
    let trainer = Trainer::new(
        c.clone(),
        &registry(&log, Faults::default()),
        &placement(&[]),
    )
    .unwrap();
    for dir in leftovers {
        assert!(!run_dir.join(dir).exists(), "{dir}");
    }
    assert!(
        !run_dir
            .join(".latest_checkpointed_iteration.txt.tmp")
            .exists()
    );
    // The previous export stays until a new one replaces it.
    assert!(run_dir.join("huggingface/previous.txt").is_file());
    let summary = trainer.fit().unwrap();
    assert_eq!(
        summary.final_model.as_deref(),
        Some(run_dir.join("huggingface").as_path())
    );
    assert_eq!(
        std::fs::read_to_string(run_dir.join("huggingface/weight.txt")).unwrap(),
        "2"
    );
    assert!(!run_dir.join("huggingface/previous.txt").exists());
    let hidden: Vec<_> = std::fs::read_dir(&run_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".huggingface"))
        .collect();
    assert!(hidden.is_empty(), "{hidden:?}");

    // Killed between setting the previous export aside and moving the new one in: the previous
    // one comes back.
    std::fs::rename(
        run_dir.join("huggingface"),
        run_dir.join(".huggingface.old"),
    )
    .unwrap();
    std::fs::create_dir_all(run_dir.join(".huggingface.partial")).unwrap();
    Trainer::new(
        c,
        &registry(&Log::default(), Faults::default()),
        &placement(&[]),
    )
    .unwrap();
    assert_eq!(
        std::fs::read_to_string(run_dir.join("huggingface/weight.txt")).unwrap(),
        "2"
    );
    assert!(
        !run_dir.join(".huggingface.old").exists()
            && !run_dir.join(".huggingface.partial").exists()
    );
}

/// verl's batch-size checks stop a run before anything is created, naming the key.
#[test]
fn bad_batch_sizes_are_named_before_anything_runs() {
    let s = setup();
    type Change = fn(&mut Config);
    let cases: [(&str, Change); 10] = [
        ("data.train_batch_size must be at least 1", |c| {
            c.data.train_batch_size = 0
        }),
        (
            "data.gen_batch_size=6 differs from data.train_batch_size=4",
            |c| c.data.gen_batch_size = Some(6),
        ),
        ("data.gen_batch_size must be at least 1", |c| {
            c.algorithm.filter_groups.enable = true;
            c.data.gen_batch_size = Some(0);
        }),
        ("data.val_batch_size must be at least 1", |c| {
            c.data.val_batch_size = Some(0)
        }),
        (
            "actor_rollout_ref.rollout.n (responses per prompt) must be at least 1",
            |c| c.actor_rollout_ref.rollout.n = 0,
        ),
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size=8 exceeds data.train_batch_size=4",
            |c| c.actor_rollout_ref.actor.ppo_mini_batch_size = 8,
        ),
        (
            "critic.ppo_mini_batch_size=6 exceeds data.train_batch_size=4",
            |c| {
                c.algorithm.adv_estimator = AdvEstimator::Gae;
                c.critic.ppo_mini_batch_size = Some(6);
            },
        ),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size and actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu are both set",
            |c| {
                let rollout = &mut c.actor_rollout_ref.rollout;
                (
                    rollout.log_prob_micro_batch_size,
                    rollout.log_prob_micro_batch_size_per_gpu,
                ) = (Some(4), Some(2));
            },
        ),
        (
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2 is smaller than one sequence",
            |c| {
                c.actor_rollout_ref.actor.use_dynamic_bsz = true;
                c.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = 2;
            },
        ),
        (
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=3 is smaller than one sequence",
            |c| {
                let rollout = &mut c.actor_rollout_ref.rollout;
                rollout.log_prob_use_dynamic_bsz = Some(true);
                rollout.log_prob_max_token_len_per_gpu = Some(3);
            },
        ),
    ];
    for (wanted, change) in cases {
        let mut c = s.config("batch-sizes");
        change(&mut c);
        let log = Log::default();
        let err = match Trainer::new(c, &registry(&log, Faults::default()), &placement(&[])) {
            Ok(_) => panic!("expected an error containing `{wanted}`"),
            Err(err) => err.to_string(),
        };
        assert!(err.contains(wanted), "`{wanted}` missing from: {err}");
        assert_eq!(log.events(), vec![], "{err}");
    }

    // A validation file without prompts is an error, not a run that silently never validates.
    let mut c = s.config("empty-val");
    let empty = s.run_dir("empty-val-data").with_extension("jsonl");
    std::fs::create_dir_all(empty.parent().unwrap()).unwrap();
    std::fs::write(&empty, "").unwrap();
    c.data.val_files = vec![empty.to_string_lossy().into_owned()];
    let log = Log::default();
    let err = match Trainer::new(c, &registry(&log, Faults::default()), &placement(&[])) {
        Ok(_) => panic!("expected an error for an empty validation file"),
        Err(err) => err.to_string(),
    };
    assert!(
        err.contains("data.val_files") && err.contains("empty-val-data"),
        "{err}"
    );
    assert_eq!(log.events(), vec![], "{err}");
}

/// DAPO: rounds of `gen_batch_size` prompts until `train_batch_size` groups with differing `acc`
/// are kept, and the `dapo` manager's overlong penalty in the scores. The fake rollout answers
/// `#### <sum>` (right) and `#### <sum + 1>` (wrong) to each prompt: every group differs.
#[test]
fn dapo_samples_gen_batch_size_prompts_a_round_and_penalises_length() {
    let s = setup();
    let mut c = s.config("dapo");
    c.data.gen_batch_size = Some(2);
    c.algorithm.filter_groups.enable = true;
    c.algorithm.filter_groups.metric = Some("acc".into());
    c.reward_model.reward_manager = "dapo".into();
    let buffer = &mut c.reward_model.overlong_buffer;
    (buffer.enable, buffer.len, buffer.penalty_factor) = (true, 4, 1.0);
    c.trainer.total_training_steps = Some(2);
    let log = Log::default();
    fit(c, &log, Faults::default()).unwrap();
    let events = log.events();
    let rounds = train_generations(&events);
    assert_eq!(rounds.len(), 4, "two rounds a step: {rounds:?}");
    assert!(
        rounds.iter().all(|(prompts, _)| prompts.len() == 2),
        "{rounds:?}"
    );
    let steps = logs(&events);
    assert_eq!(steps.len(), 2);
    for (step, m) in steps {
        assert_eq!(m["train/num_gen_batches"], 2.0, "step {step}");
        // Half the responses are right (1), half wrong (0); each of L > 4 tokens loses
        // (L - 4) / 4: the mean score is 0.5 - (mean L - 4) / 4.
        let expected = 0.5 - (m["response_length/mean"] - 4.0) / 4.0;
        assert!(
            (m["critic/score/mean"] - expected).abs() < 1e-9,
            "step {step}: {m:?}"
        );
        assert!(
            m["critic/score/max"] < 1.0 && m["critic/score/min"] < 0.0,
            "step {step}: {m:?}"
        );
    }
}

/// `(version, value)` of every weight update the rollout received.
fn synced(events: &[Event]) -> Vec<(u64, f32)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::UpdateWeights { version, value } => Some((*version, *value)),
            _ => None,
        })
        .collect()
}

fn grad_norm_at(step: u64) -> Faults {
    Faults {
        non_finite_at: Some((step, Bad::GradNorm)),
        ..Faults::default()
    }
}

#[test]
fn a_non_finite_update_stops_the_run_and_keeps_the_last_checkpoint() {
    let s = setup();
    let mut c = s.config("nan-stop");
    c.trainer.save_freq = 2;
    let log = Log::default();
    let err = fit(c, &log, grad_norm_at(3)).unwrap_err();
    assert!(
        matches!(&err, TrainError::NonFinite { step: 3, what: NonFinite::Metric { key, value }, .. }
            if key == "actor/grad_norm" && value.is_nan()),
        "{err:?}"
    );
    let run_dir = s.run_dir("nan-stop");
    let message = err.to_string();
    for part in [
        "step 3: actor/grad_norm is NaN",
        "nothing of step 3 was saved or exported",
        &format!(
            "{} stays the latest checkpoint",
            run_dir.join("global_step_2").display()
        ),
        "trainer.nan_policy=skip",
    ] {
        assert!(message.contains(part), "{part:?} in {message}");
    }
    // Step 3 is neither synced, saved, logged nor exported; the run is marked failed.
    let mut expected = step_labels(1, false, false);
    let mut step2 = step_labels(2, false, false);
    step2.insert(step2.len() - 1, "actor.save@2".into());
    expected.extend(step2);
    expected.extend(strings(&[
        "gen@Some(2)",
        "actor.log_prob",
        "actor.update_actor",
        "finish(1)",
    ]));
    assert_eq!(labels(&log.events()), expected);
    assert_eq!(checkpoint_steps(&run_dir), vec![2]);
    assert_eq!(
        std::fs::read_to_string(run_dir.join(crate::checkpoint::LATEST_FILE)).unwrap(),
        "2"
    );
    assert!(!run_dir.join("huggingface").exists());

    // Without a checkpoint yet, the message says there is none.
    let c = s.config("nan-first");
    let err = fit(c, &Log::default(), grad_norm_at(1)).unwrap_err();
    assert!(
        err.to_string().contains("no checkpoint to resume from"),
        "{err}"
    );
}

#[test]
fn the_skip_policy_leaves_the_step_out_and_goes_on() {
    let s = setup();
    let configure = |steps: u64| {
        let mut c = s.config("nan-skip");
        c.trainer.nan_policy = NanPolicy::Skip;
        c.trainer.save_freq = 2;
        c.trainer.total_training_steps = Some(steps);
        c
    };
    let log = Log::default();
    let summary = fit(configure(5), &log, grad_norm_at(3)).unwrap();
    assert_eq!(summary.global_step, 5);
    let events = log.events();
    // Step 3's update was left out: the rollout sees the same weights after it as before.
    assert_eq!(
        synced(&events),
        vec![(1, 1.0), (2, 2.0), (3, 2.0), (4, 3.0), (5, 4.0)]
    );
    let skipped: Vec<(u64, f64)> = logs(&events)
        .iter()
        .map(|(step, m)| (*step, m["training/skipped_steps"]))
        .collect();
    assert_eq!(
        skipped,
        vec![(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0), (5, 1.0)]
    );
    assert!(logs(&events)[2].1["actor/grad_norm"].is_nan());
    let run_dir = s.run_dir("nan-skip");
    assert_eq!(checkpoint_steps(&run_dir), vec![2, 4, 5]);
    assert_eq!(
        std::fs::read_to_string(run_dir.join("huggingface/weight.txt")).unwrap(),
        "4"
    );

    // The count is part of the checkpoint: a resumed run continues it.
    let log = Log::default();
    fit(configure(6), &log, Faults::default()).unwrap();
    let events = log.events();
    // (The resume first replays step 5's record from its checkpoint.)
    let step6 = logs(&events)
        .into_iter()
        .find(|(step, _)| *step == 6)
        .unwrap();
    assert_eq!(step6.1["training/skipped_steps"], 1.0);
}

#[test]
fn non_finite_weights_never_reach_the_rollout_and_cannot_be_skipped() {
    let s = setup();
    for policy in [NanPolicy::Error, NanPolicy::Skip] {
        let name = format!("nan-weights-{policy:?}");
        let mut c = s.config(&name);
        c.trainer.nan_policy = policy;
        c.trainer.save_freq = 1;
        let log = Log::default();
        let faults = Faults {
            non_finite_at: Some((2, Bad::Weights)),
            ..Faults::default()
        };
        let err = fit(c, &log, faults).unwrap_err();
        assert!(
            matches!(&err, TrainError::NonFinite { step: 2, what: NonFinite::Weights { tensor }, .. } if tensor == "w"),
            "{policy:?}: {err:?}"
        );
        let message = err.to_string();
        assert!(
            message.contains(
                "the actor's weights hold non-finite values after its update (tensor `w`)"
            ),
            "{message}"
        );
        assert!(!message.contains("nan_policy=skip"), "{message}");
        let events = log.events();
        assert_eq!(synced(&events), vec![(1, 1.0)], "{policy:?}");
        assert!(!events.iter().any(|e| matches!(e, Event::Send(2))));
        let run_dir = s.run_dir(&name);
        assert_eq!(checkpoint_steps(&run_dir), vec![1]);
        assert!(!run_dir.join("huggingface").exists());
    }
}

/// Flips one bit in the middle of `path`.
fn flip_byte(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

fn loaded_from(events: &[Event]) -> Vec<PathBuf> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Load { dir, .. } => Some(dir.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_corrupt_checkpoint_is_passed_over_by_auto_and_refused_by_resume_path() {
    let s = setup();
    let configure = |run: &str, steps: u64| {
        let mut c = s.config(run);
        c.trainer.save_freq = 2;
        c.trainer.total_training_steps = Some(steps);
        c
    };
    fit(configure("corrupt", 5), &Log::default(), Faults::default()).unwrap();
    let run_dir = s.run_dir("corrupt");
    let step_dir = |step: u64| run_dir.join(format!("global_step_{step}"));
    assert_eq!(checkpoint_steps(&run_dir), vec![2, 4, 5]);
    for step in [2, 4, 5] {
        assert!(step_dir(step).join(MANIFEST_FILE).is_file());
    }

    // A flipped byte in the latest: auto resumes from the newest intact one.
    flip_byte(&step_dir(5).join("actor").join(ENGINE_STATE));
    let log = Log::default();
    let summary = fit(configure("corrupt", 6), &log, Faults::default()).unwrap();
    assert_eq!(summary.global_step, 6);
    let events = log.events();
    assert_eq!(loaded_from(&events), vec![step_dir(4).join("actor")]);
    assert_eq!(synced(&events), vec![(4, 4.0), (5, 5.0), (6, 6.0)]);

    // resume_path to a corrupt checkpoint is an error naming the file, before anything loads.
    let from_path = |path: PathBuf| {
        let mut c = configure("from-corrupt", 6);
        c.trainer.resume_mode = ResumeMode::ResumePath;
        c.trainer.resume_from_path = Some(path.to_string_lossy().into_owned());
        c
    };
    let log = Log::default();
    let err = fit(from_path(step_dir(5)), &log, Faults::default()).unwrap_err();
    assert!(
        matches!(&err, TrainError::Checkpoint(CheckpointError::Corrupt { file, .. }) if file == "actor/fake_engine.json"),
        "{err:?}"
    );
    assert!(err.to_string().contains("sha256"), "{err}");
    assert!(loaded_from(&log.events()).is_empty());

    // A truncated file, likewise.
    let state = step_dir(6).join(super::TRAINER_STATE_FILE);
    let text = std::fs::read(&state).unwrap();
    std::fs::write(&state, &text[..text.len() / 2]).unwrap();
    let err = fit(from_path(step_dir(6)), &Log::default(), Faults::default()).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("trainer_state.json") && message.contains("truncated"),
        "{message}"
    );

    // All corrupt: auto stops instead of starting over.
    flip_byte(&step_dir(2).join("actor").join(ENGINE_STATE));
    std::fs::remove_file(step_dir(4).join(super::TRAINER_STATE_FILE)).unwrap();
    let log = Log::default();
    let err = fit(configure("corrupt", 7), &log, Faults::default()).unwrap_err();
    assert!(
        matches!(&err, TrainError::Checkpoint(CheckpointError::NoneIntact { corrupt, .. }) if corrupt.len() == 4),
        "{err:?}"
    );
    assert!(loaded_from(&log.events()).is_empty());
}

#[test]
fn a_checkpoint_without_a_manifest_loads_and_its_weights_are_still_checked() {
    let s = setup();
    let mut c = s.config("legacy");
    c.trainer.save_freq = 2;
    c.trainer.total_training_steps = Some(2);
    fit(c.clone(), &Log::default(), Faults::default()).unwrap();
    let dir = s.run_dir("legacy").join("global_step_2");
    std::fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();

    c.trainer.total_training_steps = Some(3);
    let log = Log::default();
    fit(c.clone(), &log, Faults::default()).unwrap();
    assert_eq!(loaded_from(&log.events()), vec![dir.join("actor")]);

    // Written before manifests, with NaN weights: loaded, but never handed to the rollout.
    let legacy = s.run_dir("legacy").join("global_step_3");
    std::fs::remove_file(legacy.join(MANIFEST_FILE)).unwrap();
    std::fs::write(
        legacy.join("actor").join(ENGINE_STATE),
        r#"{"value": null, "step": 3}"#,
    )
    .unwrap();
    c.trainer.total_training_steps = Some(4);
    let log = Log::default();
    let err = fit(c, &log, Faults::default()).unwrap_err();
    assert!(
        matches!(&err, TrainError::NonFiniteCheckpoint { dir, tensor } if dir == &legacy && tensor == "w"),
        "{err:?}"
    );
    assert!(synced(&log.events()).is_empty());
}

/// `data.apply_chat_template_kwargs` reaches the chat template: its variables shape every prompt.
#[test]
fn chat_template_kwargs_reach_the_prompts() {
    let s = setup();
    let mut c = s.config("template-kwargs");
    c.trainer.total_training_steps = Some(1);
    c.actor_rollout_ref.model.custom_chat_template =
        Some("{{ lead }}{{ messages[0]['content'] }}".into());
    c.data.apply_chat_template_kwargs = serde_json::json!({"lead": "0+"});
    let log = Log::default();
    fit(c, &log, Faults::default()).unwrap();
    let prompts: Vec<String> = log
        .events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Generate { prompts, .. } => Some(prompts),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(!prompts.is_empty());
    assert!(prompts.iter().all(|p| p.starts_with("0+")), "{prompts:?}");

    let mut c = s.config("template-kwargs-bad");
    c.data.apply_chat_template_kwargs = serde_json::json!(3);
    let err = match fit(c, &Log::default(), Faults::default()) {
        Ok(_) => panic!("a non-mapping is an error"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("data.apply_chat_template_kwargs") && err.contains("mapping"),
        "{err}"
    );
}

/// Generation is bounded by `actor_rollout_ref.rollout.response_length`, else by
/// `data.max_response_length` (verl's interpolation).
#[test]
fn rollout_response_length_bounds_generation() {
    let s = setup();
    let lengths = |response_length: Option<usize>| {
        let mut c = s.config("response-length");
        c.trainer.total_training_steps = Some(1);
        c.actor_rollout_ref.rollout.response_length = response_length;
        let log = Log::default();
        fit(c, &log, Faults::default()).unwrap();
        let mut lengths: Vec<u32> = log
            .events()
            .into_iter()
            .filter_map(|e| match e {
                Event::Generate { max_new_tokens, .. } => Some(max_new_tokens),
                _ => None,
            })
            .collect();
        lengths.dedup();
        lengths
    };
    assert_eq!(lengths(None), [8]);
    assert_eq!(lengths(Some(5)), [5]);
}

/// With the disk weight sync double-buffered, the rollout loads every version from a slot held
/// against the writer, and gets the same weights at the same versions as by memory.
#[test]
fn double_buffered_disk_sync_hands_over_every_version_from_a_held_slot() {
    let s = setup();
    let updates = |log: &Log| -> Vec<(u64, f32)> {
        log.events()
            .into_iter()
            .filter_map(|e| match e {
                Event::UpdateWeights { version, value } => Some((version, value)),
                _ => None,
            })
            .collect()
    };
    let memory_log = Log::default();
    fit(s.config("memory"), &memory_log, Faults::default()).unwrap();
    let mut c = s.config("slots");
    c.actor_rollout_ref.rollout.name = "slots".into();
    let engine = &mut c.actor_rollout_ref.rollout.checkpoint_engine;
    engine.backend = "disk".into();
    engine.engine_kwargs = json!({"disk": {"double_buffer": true}});
    let slot_log = Log::default();
    fit(c, &slot_log, Faults::default()).unwrap();
    let expected = updates(&memory_log);
    assert!(expected.len() >= 5, "{expected:?}");
    assert_eq!(updates(&slot_log), expected);
    let store = s.run_dir("slots").join("weight_sync");
    assert!(store.join(crate::weight_slots::CURRENT).is_file());
}

/// verl's engine perf metrics on every step: the MFU of the old log-probs, the critic and the
/// actor from one FLOP count of the step's sequences (so each × its call's time × the peak gives
/// the same FLOPs, ⅓ for the forward pass, × ppo_epochs for updates), and the memory metrics.
#[test]
fn perf_metrics_follow_verls_flop_count() {
    let s = setup();
    std::fs::write(
        s.model.join("config.json"),
        r#"{"model_type": "llama", "hidden_size": 64, "vocab_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256}"#,
    )
    .unwrap();
    let mut c = s.config("perf");
    c.algorithm.adv_estimator = AdvEstimator::Gae;
    c.actor_rollout_ref.actor.ppo_epochs = 2;
    c.critic.ppo_epochs = Some(3);
    c.trainer.total_training_steps = Some(2);
    c.trainer.device_peak_flops = Some(1e9);
    let log = Log::default();
    fit(c, &log, Faults::default()).unwrap();
    let events = log.events();
    for (step, m) in logs(&events) {
        let flops = |mfu: &str, time: &str, passes: f64| {
            m[&format!("perf/mfu/{mfu}")] * m[&format!("timing_s/{time}")] * 1e9 / passes
        };
        let actor = flops("actor", "update_actor", 2.0);
        assert!(actor > 0.0, "step {step}: {m:?}");
        for (other, what) in [
            (
                flops("actor_infer", "old_log_prob", 1.0 / 3.0),
                "actor_infer",
            ),
            (flops("critic", "update_critic", 3.0), "critic"),
        ] {
            assert!(
                (other - actor).abs() <= 1e-9 * actor,
                "step {step}: {what} {other} vs actor {actor}"
            );
        }
        for key in [
            "perf/max_memory_allocated_gb",
            "perf/max_memory_reserved_gb",
            "perf/cpu_memory_used_gb",
        ] {
            assert!(m[key] > 0.0, "step {step}: {key}");
        }
    }
}
/// The training generations' weight versions, in order.
fn train_versions(events: &[Event]) -> Vec<Option<u64>> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Generate { n: 2, version, .. } => Some(*version),
            _ => None,
        })
        .collect()
}

fn one_step_off(s: &Setup, run: &str) -> Config {
    let mut c = s.config(run);
    c.trainer.training_mode = TrainingMode::OneStepOff;
    c.trainer.rollout_data_dir = Some(s.run_dir(run).join("rollouts").display().to_string());
    c
}

/// Every `<step>.jsonl` of `trainer.rollout_data_dir`: the dataset indices each step trained on,
/// and the lines as written.
fn dumped(dir: &Path) -> BTreeMap<u64, (Vec<u64>, String)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let step: u64 = name
                .strip_suffix(".jsonl")
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("unexpected file {name}"));
            let text = std::fs::read_to_string(&path).unwrap();
            let mut indices: Vec<u64> = text
                .lines()
                .map(|line| {
                    let v: serde_json::Value = serde_json::from_str(line).unwrap();
                    assert_eq!(v["step"], step);
                    assert!(v["input"].is_string() && v["output"].is_string());
                    v["index"].as_u64().unwrap()
                })
                .collect();
            indices.sort_unstable();
            (step, (indices, text))
        })
        .collect()
}

/// `trainer.training_mode=one_step_off` (verl's one-step-off policy): batch k+1 is generated
/// while step k trains, with the weights the rollout holds then (step k−1's), from the same
/// prompts and seeds a synchronous run uses; the weights of step k reach the rollout after that
/// generation; each step reports its samples' staleness and verl's one-step-off timings.
#[test]
fn one_step_off_generates_the_next_batch_one_version_behind() {
    let s = setup();
    let sync = Log::default();
    fit(s.config("sync"), &sync, Faults::default()).unwrap();
    let log = Log::default();
    let summary = fit(one_step_off(&s, "off"), &log, Faults::default()).unwrap();
    assert_eq!(summary.global_step, 5);
    let events = log.events();
    assert_eq!(
        train_generations(&events),
        train_generations(&sync.events()),
        "the same prompts and seeds, in the same order"
    );
    // Synchronous: batch k by step k−1's weights. One step off: by step k−2's.
    assert_eq!(
        train_versions(&sync.events()),
        [None, Some(1), Some(2), Some(3), Some(4)]
    );
    assert_eq!(
        train_versions(&events),
        [None, None, Some(1), Some(2), Some(3)]
    );
    let position = |wanted: &dyn Fn(&Event) -> bool, nth: usize| {
        events
            .iter()
            .enumerate()
            .filter(|(_, e)| wanted(e))
            .nth(nth)
            .map(|(i, _)| i)
            .unwrap()
    };
    for step in 1..5u64 {
        let next_generated = position(
            &|e| matches!(e, Event::Generate { n: 2, .. }),
            step as usize,
        );
        let trained = position(
            &|e| matches!(e, Event::UpdateActor { .. }),
            step as usize - 1,
        );
        let synced = position(
            &|e| matches!(e, Event::UpdateWeights { version, .. } if *version == step),
            0,
        );
        let logged = position(
            &|e| matches!(e, Event::Log { step: s, .. } if *s == step),
            0,
        );
        assert!(
            next_generated < synced && trained < synced && synced < logged,
            "step {step}: batch {} generated at {next_generated}, update at {trained}, sync at \
             {synced}, log at {logged}",
            step + 1
        );
    }
    let logged = logs(&events);
    let staleness: Vec<f64> = logged
        .iter()
        .map(|(_, m)| m["training/staleness_mean"])
        .collect();
    assert_eq!(staleness, [0.0, 1.0, 1.0, 1.0, 1.0]);
    for (step, m) in &logged {
        assert!(m.contains_key("timing_s/gen"), "step {step}");
        let overlapped = *step < 5;
        assert_eq!(
            m.contains_key("timing_s/generate_async"),
            overlapped,
            "{step}"
        );
        assert_eq!(
            m.contains_key("timing_s/sync_rollout_weights"),
            overlapped,
            "{step}"
        );
    }
    assert!(
        logs(&sync.events())
            .iter()
            .all(|(_, m)| !m.contains_key("training/staleness_mean")),
        "a synchronous run logs no staleness"
    );
    // The dump has one file per step, the prompts of a synchronous run's batches.
    let dumps = dumped(&s.run_dir("off").join("rollouts"));
    assert_eq!(dumps.keys().copied().collect::<Vec<_>>(), [1, 2, 3, 4, 5]);
}

/// Exact resume of a one-step-off run: a checkpoint carries the batch generated for the next
/// step, so a run stopped by a failure in any step and resumed (`resume_mode=auto`) trains on
/// exactly the batches of an uninterrupted run — no prompt skipped, none trained twice, the same
/// samples — and logs the same records; the carried batch is not generated again.
#[test]
fn a_resumed_one_step_off_run_trains_on_exactly_the_uninterrupted_batches() {
    let s = setup();
    let configure = |run: &str, save_freq: i64| {
        let mut c = one_step_off(&s, run);
        c.trainer.save_freq = save_freq;
        c
    };
    let whole = Log::default();
    fit(configure("whole", 1), &whole, Faults::default()).unwrap();
    let whole_logs = comparable_logs(&whole.events());
    let whole_dump = dumped(&s.run_dir("whole").join("rollouts"));
    let consumed = |dump: &BTreeMap<u64, (Vec<u64>, String)>| {
        let mut all: Vec<u64> = dump.values().flat_map(|(i, _)| i.clone()).collect();
        all.sort_unstable();
        all
    };
    // 5 steps × 4 prompts × 2 responses over 8 prompts: each prompt's n responses, 2.5 epochs.
    assert_eq!(consumed(&whole_dump).len(), 40);
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(s.run_dir("whole").join("global_step_2/trainer_state.json"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        state["pending"]["rows"].as_array().map(Vec::len),
        Some(8),
        "checkpoint 2 carries batch 3"
    );

    for save_freq in [1, 2] {
        for fail_at in 1..=5u64 {
            let run = format!("failed{fail_at}-every{save_freq}");
            let faults = Faults {
                fail_update_at: Some(fail_at),
                ..Faults::default()
            };
            fit(configure(&run, save_freq), &Log::default(), faults).unwrap_err();
            let resumed = Log::default();
            fit(configure(&run, save_freq), &resumed, Faults::default()).unwrap();
            let events = resumed.events();
            // The checkpoint's own records first (those since the previous checkpoint), then
            // every later step's, each as the uninterrupted run logged it.
            let checkpoint = (fail_at - 1) / save_freq as u64 * save_freq as u64;
            let resumed_logs = comparable_logs(&events);
            let first = resumed_logs[0].0;
            assert!(first <= checkpoint + 1, "{run}: first record {first}");
            assert_eq!(
                resumed_logs[..],
                whole_logs[first as usize - 1..],
                "{run}: the records differ from the uninterrupted run's"
            );
            let dump = dumped(&s.run_dir(&run).join("rollouts"));
            assert_eq!(consumed(&dump), consumed(&whole_dump), "{run}");
            assert_eq!(dump, whole_dump, "{run}: the same samples, step by step");
            // The resumed run generates only the batches after the one its checkpoint carries.
            let generated = train_generations(&events);
            let from = if checkpoint == 0 {
                0
            } else {
                checkpoint as usize + 1
            };
            assert_eq!(
                generated[..],
                train_generations(&whole.events())[from..],
                "{run}: resumed after checkpoint {checkpoint}"
            );
        }
    }
}

/// Rollout correction in the trainer (verl's decoupled mode): with the rollout's log-probs, the
/// IS weights go to the actor's update as `rollout_is_weights`, rejected tokens leave the
/// response mask, and the `rollout_corr/` metrics are logged; asked without the rollout's
/// log-probs, or in bypass mode with weights, the run is refused before it starts.
#[test]
fn rollout_correction_reaches_the_update() {
    let s = setup();
    let mut c = s.config("corrected");
    c.trainer.total_training_steps = Some(2);
    c.actor_rollout_ref.rollout.name = "logprobs".into();
    c.actor_rollout_ref.rollout.calculate_log_probs = true;
    let rc = &mut c.algorithm.rollout_correction;
    rc.rollout_is = Some(IsLevel::Token);
    // The fake rollout's wrong answers are at ln ½ against the engine's −½: a log-ratio of
    // 0.19, outside ±ln 1.1, so their tokens are rejected; the right ones (ratio 1) stay.
    rc.rollout_rs = Some("token_k1".into());
    rc.rollout_rs_threshold = Some(RsThreshold::Number(1.1));
    let log = Log::default();
    fit(c.clone(), &log, Faults::default()).unwrap();
    let events = log.events();
    let update_keys: Vec<&Vec<String>> = events
        .iter()
        .filter_map(|e| match e {
            Event::UpdateActor { keys, .. } => Some(keys),
            _ => None,
        })
        .collect();
    assert_eq!(update_keys.len(), 2);
    assert!(
        update_keys
            .iter()
            .all(|k| k.contains(&"rollout_is_weights".to_owned()))
    );
    for (step, m) in logs(&events) {
        let fraction = m["rollout_corr/rollout_rs_masked_fraction"];
        assert!(fraction > 0.4 && fraction < 0.6, "step {step}: {fraction}");
        assert_eq!(m["rollout_corr/rollout_rs_seq_masked_fraction"], 0.5);
        // The largest weight is the wrong answers' e^0.19 (below the threshold of 2).
        assert!((m["rollout_corr/rollout_is_max"] - (-0.5 - 0.5f64.ln()).exp()).abs() < 1e-5);
        assert!(m.contains_key("rollout_corr/kl") && m.contains_key("rollout_corr/chi2_seq"));
    }

    // Bypass mode: the rollout's log-probs are the old policy's; the actor computes none.
    let mut bypass = s.config("bypass");
    bypass.trainer.total_training_steps = Some(2);
    bypass.actor_rollout_ref.rollout.name = "logprobs".into();
    bypass.actor_rollout_ref.rollout.calculate_log_probs = true;
    bypass.algorithm.rollout_correction.bypass_mode = true;
    let log = Log::default();
    fit(bypass.clone(), &log, Faults::default()).unwrap();
    let events = log.events();
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, Event::LogProb { role, .. } if role == "actor"))
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, Event::UpdateActor { .. }))
            .count(),
        2
    );

    let refused = |c: Config, wanted: &str| {
        let err = match Trainer::new(
            c,
            &registry(&Log::default(), Faults::default()),
            &placement(&[]),
        ) {
            Ok(_) => panic!("expected {wanted}"),
            Err(err) => err.to_string(),
        };
        assert!(err.contains(wanted), "{err}");
    };
    let mut without = c.clone();
    without.actor_rollout_ref.rollout.calculate_log_probs = false;
    refused(
        without,
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    );
    let mut both = bypass.clone();
    both.algorithm.rollout_correction.rollout_is = Some(IsLevel::Sequence);
    refused(both, "bypass_mode=true with rollout_is or rollout_rs");
    let mut bad = c.clone();
    bad.algorithm.rollout_correction.rollout_rs = Some("seq_k9".into());
    refused(
        bad,
        "algorithm.rollout_correction.rollout_rs: unknown option `seq_k9`",
    );
    let mut two_ranks_off = one_step_off(&s, "refused");
    two_ranks_off.algorithm.filter_groups.enable = true;
    refused(
        two_ranks_off,
        "one_step_off does not support algorithm.filter_groups.enable=true",
    );
}

/// `trainer.training_mode=fully_async` on the fake rollout with log-probs, with verl's layout
/// (`data.train_batch_size=0`: a step trains on `ppo_mini_batch_size × require_batches` = 4
/// prompts), publishing every `trigger` steps with `staleness_threshold`.
fn fully_async(s: &Setup, run: &str, trigger: u64, staleness: f64) -> Config {
    let mut c = s.config(run);
    c.trainer.training_mode = TrainingMode::FullyAsync;
    c.data.train_batch_size = 0;
    c.async_training.trigger_parameter_sync_step = trigger;
    c.async_training.staleness_threshold = staleness;
    c.actor_rollout_ref.rollout.name = "logprobs".into();
    c.actor_rollout_ref.rollout.calculate_log_probs = true;
    c.trainer.rollout_data_dir = Some(s.run_dir(run).join("rollouts").display().to_string());
    c
}

/// The weight versions the rollout was given, in order.
fn synced_versions(events: &[Event]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::UpdateWeights { version, .. } => Some(*version),
            _ => None,
        })
        .collect()
}

/// verl's fully-async policy with the schedule decided by the trainer: T = 2 and a staleness
/// threshold of 0.5 allow K = int(4 × 1.5 × 2) / 4 = 3 batches per published version, so batches
/// 1–3 are generated with the initial weights and 4–5 with step 2's; weights are published after
/// steps 2, 4 and the last; the prompts and seeds are a synchronous run's. With T = 1 and no
/// staleness it is a synchronous run, record for record; with T = 1 and a staleness of 1 it
/// generates with one-step-off's versions.
#[test]
fn fully_async_generates_each_batch_with_the_version_the_schedule_gives() {
    let s = setup();
    let sync = Log::default();
    let mut sync_config = s.config("sync");
    sync_config.actor_rollout_ref.rollout.name = "logprobs".into();
    sync_config.actor_rollout_ref.rollout.calculate_log_probs = true;
    fit(sync_config, &sync, Faults::default()).unwrap();

    let log = Log::default();
    let summary = fit(fully_async(&s, "async", 2, 0.5), &log, Faults::default()).unwrap();
    assert_eq!(summary.global_step, 5);
    let events = log.events();
    assert_eq!(
        train_generations(&events),
        train_generations(&sync.events()),
        "the same prompts and seeds, in the same order"
    );
    assert_eq!(
        train_versions(&events),
        [None, None, None, Some(2), Some(2)]
    );
    assert_eq!(synced_versions(&events), [2, 4, 5]);
    let logged = logs(&events);
    let series = |key: &str| -> Vec<f64> { logged.iter().map(|(_, m)| m[key]).collect() };
    // Versions behind the policy being updated (step − 1).
    assert_eq!(series("training/staleness_mean"), [0.0, 1.0, 2.0, 1.0, 2.0]);
    assert_eq!(
        series("fully_async/count/current_param_version"),
        [0.0, 0.0, 1.0, 1.0, 2.0]
    );
    // Batches 3 and 5 are a published version behind when trained: 4 prompts, 8 responses each.
    assert_eq!(
        series("fully_async/count/stale_samples_processed"),
        [0.0, 0.0, 4.0, 4.0, 8.0]
    );
    assert_eq!(
        series("fully_async/count/stale_trajectory_processed"),
        [0.0, 0.0, 8.0, 8.0, 16.0]
    );
    assert_eq!(series("fully_async/static/max_required_samples"), [12.0; 5]);
    for (step, m) in &logged {
        assert!(
            m.contains_key("fully_async/monitor/queue/mq_queue_size"),
            "{step}"
        );
        assert!(m["fully_async/total_wait_time"] >= 0.0);
        assert_eq!(
            m.contains_key("timing_s/param_sync"),
            *step != 1 && *step != 3,
            "{step}"
        );
        // use_rollout_log_probs (verl's default): the actor recomputes no log-probs.
        assert!(!m.contains_key("timing_s/old_log_prob"), "{step}");
    }
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, Event::LogProb { role, .. } if role == "actor"))
    );

    // No staleness, a publication per step, old log-probs recomputed: a synchronous run.
    let log = Log::default();
    let mut c = fully_async(&s, "as-sync", 1, 0.0);
    c.async_training.use_rollout_log_probs = false;
    fit(c, &log, Faults::default()).unwrap();
    let without_async = |logs: Vec<(u64, BTreeMap<String, f64>)>| {
        logs.into_iter()
            .map(|(step, mut m)| {
                m.retain(|k, _| {
                    !k.starts_with("fully_async/") && !k.starts_with("training/staleness")
                });
                (step, m)
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        without_async(comparable_logs(&log.events())),
        without_async(comparable_logs(&sync.events()))
    );
    assert_eq!(
        train_versions(&log.events()),
        train_versions(&sync.events())
    );

    // A staleness of one version, a publication per step: one-step-off's versions.
    let log = Log::default();
    fit(fully_async(&s, "as-off", 1, 1.0), &log, Faults::default()).unwrap();
    assert_eq!(
        train_versions(&log.events()),
        [None, None, Some(1), Some(2), Some(3)]
    );
}

/// Exact resume of a fully-async run: a checkpoint carries the batches generated ahead, so a run
/// that fails in any step and resumes (`resume_mode=auto`) trains on exactly the uninterrupted
/// run's batches (no prompt skipped or trained twice, the same samples), generates only the
/// batches after those carried, with the same versions, and logs the same records.
#[test]
fn a_resumed_fully_async_run_trains_on_exactly_the_uninterrupted_batches() {
    let s = setup();
    let configure = |run: &str, save_freq: i64| {
        let mut c = fully_async(&s, run, 2, 0.5);
        c.trainer.save_freq = save_freq;
        c
    };
    let whole = Log::default();
    fit(configure("whole", 1), &whole, Faults::default()).unwrap();
    let whole_events = whole.events();
    let whole_logs = comparable_logs(&whole_events);
    let whole_dump = dumped(&s.run_dir("whole").join("rollouts"));
    assert_eq!(whole_dump.len(), 5);
    // Carried per checkpoint: after step 1, batches 2–3 (K = 3 with the initial weights); after
    // the publication at 2, batch 3; after 3, batches 4–5; after 4, batch 5; after 5, none.
    let carried: Vec<usize> = (1..=5)
        .map(|step| {
            let path = s
                .run_dir("whole")
                .join(format!("global_step_{step}/trainer_state.json"));
            let state: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
            state["queued"].as_array().unwrap().len()
        })
        .collect();
    assert_eq!(carried, [2, 1, 2, 1, 0]);
    let final_weight = |events: &[Event]| {
        events.iter().rev().find_map(|e| match e {
            Event::UpdateWeights { value, .. } => Some(*value),
            _ => None,
        })
    };

    for save_freq in [1, 2] {
        for fail_at in 1..=5u64 {
            let run = format!("failed{fail_at}-every{save_freq}");
            let faults = Faults {
                fail_update_at: Some(fail_at),
                ..Faults::default()
            };
            fit(configure(&run, save_freq), &Log::default(), faults).unwrap_err();
            let resumed = Log::default();
            fit(configure(&run, save_freq), &resumed, Faults::default()).unwrap();
            let events = resumed.events();
            let checkpoint = (fail_at - 1) / save_freq as u64 * save_freq as u64;
            let resumed_logs = comparable_logs(&events);
            let first = resumed_logs[0].0;
            assert!(first <= checkpoint + 1, "{run}: first record {first}");
            assert_eq!(
                resumed_logs[..],
                whole_logs[first as usize - 1..],
                "{run}: the records differ from the uninterrupted run's"
            );
            let dump = dumped(&s.run_dir(&run).join("rollouts"));
            assert_eq!(dump, whole_dump, "{run}: the same samples, step by step");
            // Only the batches after those the checkpoint carried are generated again, each
            // with the weights the uninterrupted run generated it with.
            let carried_to = if checkpoint == 0 {
                0
            } else {
                checkpoint as usize + carried[checkpoint as usize - 1]
            };
            assert_eq!(
                train_generations(&events)[..],
                train_generations(&whole_events)[carried_to..],
                "{run}: resumed after checkpoint {checkpoint}"
            );
            assert_eq!(
                train_versions(&events)[..],
                train_versions(&whole_events)[carried_to..],
                "{run}"
            );
            assert_eq!(final_weight(&events), final_weight(&whole_events), "{run}");
        }
    }
}

/// One engine call's `routed_experts`: the call, the values, the shape and the attention mask.
type RoutedCall = (&'static str, Vec<i64>, Vec<i64>, Vec<i64>);

/// The `routed_experts` the engine calls of a run received, by call.
fn routed(log: &Log) -> Vec<RoutedCall> {
    log.events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Routed {
                op,
                experts,
                shape,
                mask,
            } => Some((op, experts, shape, mask)),
            _ => None,
        })
        .collect()
}

/// R3: the rollout's experts reach the old-log-prob forward and the update laid out like
/// `input_ids` (verl's `[B, P+R, layers, k]`): row `i`'s fed tokens (its prompt from the first
/// real column, then its response but the last token) carry the rollout's experts in order,
/// every other column zeros.
#[test]
fn r3_carries_the_rollouts_experts_to_the_engine() {
    let setup = setup();
    let mut c = setup.config("r3");
    c.trainer.total_training_steps = Some(1);
    c.actor_rollout_ref.rollout.name = "routing".into();
    c.actor_rollout_ref.rollout.enable_rollout_routing_replay = true;
    c.actor_rollout_ref.actor.router_replay.mode = RouterReplayMode::R3;
    let log = Log::default();
    fit(c, &log, Faults::default()).unwrap();
    let calls = routed(&log);
    let ops: Vec<&str> = calls.iter().map(|c| c.0).collect();
    assert_eq!(ops, ["compute_log_prob", "update_actor"]);
    for (op, experts, shape, mask) in &calls {
        let [b, w, layers, k] = shape[..] else {
            panic!("{op}: shape {shape:?}")
        };
        assert_eq!((b, layers, k), (8, 1, 2), "{op}");
        for row in 0..b as usize {
            let real = &mask[row * w as usize..(row + 1) * w as usize];
            let first = real.iter().position(|&m| m == 1).unwrap();
            let fed = real.iter().sum::<i64>() as usize - 1;
            for col in 0..w as usize {
                let at = (row * w as usize + col) * 2;
                let want = if (first..first + fed).contains(&col) {
                    let t = (col - first) as i64;
                    [1 + t % 3, 4]
                } else {
                    [0, 0]
                };
                assert_eq!(experts[at..at + 2], want, "{op} row {row} column {col}");
            }
        }
    }
}

/// R2: the old-log-prob forward's recording (not any rollout's) is what the update replays.
#[test]
fn r2_carries_the_old_log_prob_forwards_routing_to_the_update() {
    let setup = setup();
    let mut c = setup.config("r2");
    c.trainer.total_training_steps = Some(1);
    c.actor_rollout_ref.actor.router_replay.mode = RouterReplayMode::R2;
    let log = Log::default();
    fit(c, &log, Faults::default()).unwrap();
    let calls = routed(&log);
    let ops: Vec<&str> = calls.iter().map(|c| c.0).collect();
    assert_eq!(ops, ["update_actor"]);
    assert!(calls[0].1.chunks(2).all(|e| e == [3, 2]));
}

/// A mode the run's components cannot serve stops it before step 1, naming the key and the
/// rollout.
#[test]
fn router_replay_needs_a_recording_rollout() {
    let setup = setup();
    let mut c = setup.config("r3-without");
    c.actor_rollout_ref.actor.router_replay.mode = RouterReplayMode::R3;
    c.actor_rollout_ref.rollout.name = "routing".into();
    let err = fit(c, &Log::default(), Faults::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("actor_rollout_ref.actor.router_replay.mode=R3")
            && err.contains("enable_rollout_routing_replay=true"),
        "{err}"
    );
    let mut c = setup.config("r3-fake");
    c.actor_rollout_ref.rollout.enable_rollout_routing_replay = true;
    let err = fit(c, &Log::default(), Faults::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("enable_rollout_routing_replay=true") && err.contains("rollout `fake`"),
        "{err}"
    );
}

/// The F32 tensors of every recorded actor update, as `[B, R]` matrices.
fn updates(events: &[Event]) -> Vec<BTreeMap<String, Matrix>> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::UpdateActor { shape, floats, .. } => Some(
                floats
                    .iter()
                    .map(|(k, v)| {
                        let m =
                            Matrix::new(shape[0] as usize, shape[1] as usize, v.clone()).unwrap();
                        (k.clone(), m)
                    })
                    .collect(),
            ),
            _ => None,
        })
        .collect()
}

fn refused(c: Config, faults: Faults, wanted: &str) {
    let err = match Trainer::new(c, &registry(&Log::default(), faults), &placement(&[]))
        .and_then(|t| t.fit())
    {
        Ok(_) => panic!("expected {wanted}"),
        Err(err) => err.to_string(),
    };
    assert!(err.contains(wanted), "{err}");
}

#[test]
fn optimal_token_baseline_takes_sum_pi_squared_from_the_actor() {
    use verl_algo::{AdvantageInput, AdvantageParams, compute_advantage, place_scores};
    let s = setup();
    let mut c = s.config("otb");
    c.trainer.total_training_steps = Some(2);
    // Rows stay in generation order: the two responses of prompt g are rows 2g and 2g + 1.
    c.trainer.balance_batch = false;
    c.algorithm.adv_estimator = AdvEstimator::OptimalTokenBaseline;
    c.actor_rollout_ref.actor.calculate_sum_pi_squared = true;
    let log = Log::default();
    fit(c.clone(), &log, Faults::default()).unwrap();
    let updates = updates(&log.events());
    assert_eq!(updates.len(), 2);
    for update in &updates {
        let (mask, returns) = (&update[keys::RESPONSE_MASK], &update[keys::RETURNS]);
        let rows = mask.rows();
        // The outcome reward is the return at the first token (γ = 1).
        let scores: Vec<f32> = (0..rows).map(|i| returns.row(i)[0]).collect();
        let rewards = place_scores(&scores, mask).unwrap();
        let spp = fake_sum_pi_squared_matrix(mask.shape());
        let groups: Vec<u64> = (0..rows as u64).map(|i| i / 2).collect();
        let input = AdvantageInput {
            old_log_probs: Some(&update[keys::OLD_LOG_PROBS]),
            sum_pi_squared: Some(&spp),
            ..AdvantageInput::new(&rewards, mask, &groups)
        };
        let (want, _) = compute_advantage(
            AdvEstimator::OptimalTokenBaseline,
            &AdvantageParams::default(),
            &input,
        )
        .unwrap();
        let got = &update[keys::ADVANTAGES];
        assert!(got.data().iter().any(|&a| a.abs() > 0.1), "{got:?}");
        for (a, b) in got.data().iter().zip(want.data()) {
            assert!((a - b).abs() < 1e-6, "{got:?} vs {want:?}");
        }
    }

    // As verl: the actor must be asked for Σπ², and must deliver it.
    let mut unasked = c.clone();
    unasked.actor_rollout_ref.actor.calculate_sum_pi_squared = false;
    refused(
        unasked,
        Faults::default(),
        "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
    );
    refused(
        c.clone(),
        Faults {
            no_sum_pi_squared: true,
            ..Faults::default()
        },
        "returned no `sum_pi_squared`",
    );
    let mut bypass = c;
    bypass.actor_rollout_ref.rollout.name = "logprobs".into();
    bypass.actor_rollout_ref.rollout.calculate_log_probs = true;
    bypass.algorithm.rollout_correction.bypass_mode = true;
    refused(bypass, Faults::default(), "bypass_mode=true skips");
}

/// verl's `variance_proxy/*` metrics: logged every step exactly when the actor is asked for Σπ²
/// (with an estimator that does not need it too), equal to `variance_proxy_metrics` on the
/// tensors the update received with the update's grad norm; with rollout correction, over its IS
/// weights and the mask rejection leaves; before critic_warmup ends, without a signal; not in
/// bypass mode, which skips the log-prob pass.
#[test]
fn variance_proxy_metrics_come_with_sum_pi_squared() {
    use verl_algo::{VarianceProxyInput, variance_proxy_metrics};
    let s = setup();
    let run = |name: &str, edit: &dyn Fn(&mut Config)| {
        let mut c = s.config(name);
        c.trainer.total_training_steps = Some(2);
        // Rows stay in generation order, the order the fake actor gave Σπ² in.
        c.trainer.balance_batch = false;
        c.actor_rollout_ref.actor.calculate_sum_pi_squared = true;
        edit(&mut c);
        let log = Log::default();
        fit(c, &log, Faults::default()).unwrap();
        log.events()
    };
    let proxies = |m: &BTreeMap<String, f64>| -> BTreeMap<String, f64> {
        m.iter()
            .filter(|(k, _)| k.starts_with("variance_proxy/"))
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    };
    let with_logprobs = |c: &mut Config| {
        c.actor_rollout_ref.rollout.name = "logprobs".into();
        c.actor_rollout_ref.rollout.calculate_log_probs = true;
    };
    // Each step's logged proxies against the function on what the update received.
    let check = |events: &[Event], weighted: bool| {
        let logged = logs(events);
        let updates = updates(events);
        assert_eq!((logged.len(), updates.len()), (2, 2));
        let mut noise = 0.0;
        for ((step, m), update) in logged.iter().zip(&updates) {
            let mask = &update[keys::RESPONSE_MASK];
            let spp = fake_sum_pi_squared_matrix(mask.shape());
            assert_eq!(update.contains_key(super::ROLLOUT_IS_WEIGHTS), weighted);
            let want = variance_proxy_metrics(&VarianceProxyInput {
                old_log_probs: &update[keys::OLD_LOG_PROBS],
                sum_pi_squared: &spp,
                advantages: &update[keys::ADVANTAGES],
                response_mask: mask,
                rollout_is_weights: update.get(super::ROLLOUT_IS_WEIGHTS),
                grad_norm: Some(fake_grad_norm(*step)),
            })
            .unwrap();
            assert_eq!(proxies(m), want, "step {step}");
            assert_eq!(
                want["variance_proxy/proxy1_signal_strength"],
                fake_grad_norm(*step).powi(2)
            );
            assert!(want["variance_proxy/proxy2_total_power"] > 0.0, "{want:?}");
            noise += want["variance_proxy/proxy3_pure_noise"];
        }
        // The signal stays below the total power on some step: the noise is not clamped to 0.
        assert!(noise > 0.0);
    };
    check(&run("vproxy", &|_| {}), false);

    // Token IS weights, and rejection of the wrong answers' tokens (see
    // rollout_correction_reaches_the_update): the mask the update trains on has fewer tokens.
    let corrected = run("vproxy-is", &|c| {
        with_logprobs(c);
        let rc = &mut c.algorithm.rollout_correction;
        rc.rollout_is = Some(IsLevel::Token);
        rc.rollout_rs = Some("token_k1".into());
        rc.rollout_rs_threshold = Some(RsThreshold::Number(1.1));
    });
    check(&corrected, true);
    for (_, m) in logs(&corrected) {
        assert!(m["rollout_corr/rollout_rs_masked_fraction"] > 0.0);
    }

    // Not asked, or asked in bypass mode: no Σπ², no proxies.
    let unasked = run("vproxy-unasked", &|c| {
        c.actor_rollout_ref.actor.calculate_sum_pi_squared = false;
    });
    let bypass = run("vproxy-bypass", &|c| {
        with_logprobs(c);
        c.algorithm.rollout_correction.bypass_mode = true;
    });
    for events in [&unasked, &bypass] {
        let logged = logs(events);
        assert_eq!(logged.len(), 2);
        assert!(logged.iter().all(|(_, m)| proxies(m).is_empty()));
    }

    // Asked for, an engine that does not deliver Σπ² stops the run (no metric silently missing).
    let mut c = s.config("vproxy-missing");
    c.actor_rollout_ref.actor.calculate_sum_pi_squared = true;
    refused(
        c,
        Faults {
            no_sum_pi_squared: true,
            ..Faults::default()
        },
        "algorithm.adv_estimator=grpo): actor engine `fake` returned no `sum_pi_squared`",
    );

    // Step 1 of a critic warm-up updates no actor: no grad norm, so no signal and no noise.
    let warmup = run("vproxy-warmup", &|c| {
        c.algorithm.adv_estimator = AdvEstimator::Gae;
        c.trainer.critic_warmup = 1;
    });
    let logged = logs(&warmup);
    let first = proxies(logged[0].1);
    assert_eq!(first.len(), 5, "{first:?}");
    assert_eq!(first["variance_proxy/proxy1_signal_strength"], 0.0);
    assert_eq!(first["variance_proxy/proxy3_pure_noise"], 0.0);
    assert_eq!(
        logged[1].1["variance_proxy/proxy1_signal_strength"],
        fake_grad_norm(2).powi(2)
    );
}

#[test]
fn gdpo_normalises_the_reward_components_the_keys_name() {
    use verl_algo::masked_whiten;
    let s = setup();
    let run = |name: &str, edit: &dyn Fn(&mut Config)| {
        let mut c = s.config(name);
        c.trainer.total_training_steps = Some(2);
        // `dapo` records each score as `acc`: a component equal to the score.
        c.reward_model.reward_manager = "dapo".into();
        edit(&mut c);
        let log = Log::default();
        fit(c, &log, Faults::default()).unwrap();
        log.events()
    };
    let grpo = run("grpo", &|_| {});
    let gdpo = run("gdpo", &|c| {
        c.algorithm.adv_estimator = AdvEstimator::Gdpo;
        c.algorithm.gdpo_reward_keys = Some(vec!["acc".into()]);
        c.algorithm.gdpo_reward_weights = Some(vec![2.0]);
    });
    // One component equal to the score, through balance_batch's reordering: GDPO is the
    // whitened GRPO advantage (the weight scales out) on the same rows.
    for (g, d) in updates(&grpo).iter().zip(&updates(&gdpo)) {
        let mask = &g[keys::RESPONSE_MASK];
        let want = masked_whiten(&g[keys::ADVANTAGES], mask).unwrap();
        let got = &d[keys::ADVANTAGES];
        for ((a, b), m) in got.data().iter().zip(want.data()).zip(mask.data()) {
            assert!((a - b * m).abs() < 1e-4, "{got:?} vs {want:?}");
        }
    }
    // verl's per-component metrics: the fake rollout answers one of the two responses right.
    for (step, m) in logs(&gdpo) {
        assert_eq!(m["gdpo/acc/mean"], 0.5, "step {step}");
        assert_eq!(m["gdpo/acc/std"], 0.5);
        assert_eq!((m["gdpo/acc/max"], m["gdpo/acc/min"]), (1.0, 0.0));
    }

    let mut c = s.config("gdpo-bad");
    c.algorithm.adv_estimator = AdvEstimator::Gdpo;
    refused(
        c.clone(),
        Faults::default(),
        "needs algorithm.gdpo_reward_keys",
    );
    c.algorithm.gdpo_reward_keys = Some(vec!["format".into()]);
    refused(
        c.clone(),
        Faults::default(),
        "algorithm.gdpo_reward_keys: the reward gave no `format` (it gave: a score only)",
    );
    c.algorithm.gdpo_reward_weights = Some(vec![1.0, 2.0]);
    refused(
        c,
        Faults::default(),
        "2 weights for 1 algorithm.gdpo_reward_keys",
    );
}

/// A code data source needs `reward_model.sandbox_fusion.url`: the run fails before any
/// component is created, naming the data source and the key.
#[test]
fn a_code_data_source_without_a_sandbox_fails_before_the_run() {
    let s = setup();
    let train = s.dir.path().join("code.jsonl");
    let row = json!({"data_source": "codecontests", "prompt": "1+2=",
        "reward_model": {"ground_truth": "{\"inputs\": [\"1\\n\"], \"outputs\": [\"1\"]}"}});
    std::fs::write(&train, format!("{row}\n").repeat(4)).unwrap();
    let mut config = s.config("code");
    config.data.train_files = vec![train.to_string_lossy().into_owned()];
    let log = Log::default();
    let err = Trainer::new(
        config.clone(),
        &registry(&log, Faults::default()),
        &placement(&[]),
    )
    .err()
    .expect("an error")
    .to_string();
    assert!(
        err.contains("data_source `codecontests`")
            && err.contains("reward_model.sandbox_fusion.url")
            && err.contains("unsandboxed"),
        "{err}"
    );
    assert!(log.events().is_empty(), "{:?}", log.events().len());
    // With a sandbox (none need answer before the first step) the run is set up.
    config.reward_model.sandbox_fusion.url = Some("http://127.0.0.1:9/run_code".into());
    assert!(Trainer::new(config, &registry(&log, Faults::default()), &placement(&[])).is_ok());
}

/// A change to a test's config.
type ConfigEdit<'a> = &'a dyn Fn(&mut Config);

/// verl's on-policy shortcut, taken by the trainer: with an engine that declares it
/// (`on_policy_updates`), one mini-batch and one epoch, the actor's old-log-prob pass is skipped
/// (no actor `compute_log_prob`, no `old_log_probs` in the update), the update is asked for
/// `actor/entropy`, and that is what the step logs. Whatever reads the old log-probs, or a
/// second mini-batch or epoch, or an engine without the shortcut, brings the pass back.
#[test]
fn an_on_policy_update_skips_the_old_log_prob_pass() {
    let s = setup();
    let run = |name: &str, edit: &dyn Fn(&mut Config)| {
        let mut c = s.config(name);
        c.actor_rollout_ref.actor.strategy = "on-policy".into();
        c.trainer.total_training_steps = Some(2);
        edit(&mut c);
        let log = Log::default();
        fit(c, &log, Faults::default()).unwrap();
        log.events()
    };
    let actor_passes = |events: &[Event]| {
        events
            .iter()
            .filter(|e| matches!(e, Event::LogProb { role, .. } if role == "actor"))
            .count()
    };
    let entropy = |events: &[Event]| -> Vec<f64> {
        logs(events)
            .iter()
            .map(|(_, m)| m["actor/entropy"])
            .collect()
    };

    let events = run("skip", &|_| {});
    assert_eq!(actor_passes(&events), 0);
    for e in &events {
        if let Event::UpdateActor { keys, .. } = e {
            assert!(!keys.iter().any(|k| k == keys::OLD_LOG_PROBS), "{keys:?}");
        }
    }
    assert_eq!(entropy(&events), [0.75, 0.75]);
    assert!(
        logs(&events)
            .iter()
            .all(|(_, m)| !m.contains_key("timing_s/old_log_prob"))
    );

    let cases: [(&str, ConfigEdit); 4] = [
        ("two-mini-batches", &|c| {
            c.actor_rollout_ref.actor.ppo_mini_batch_size = c.data.train_batch_size / 2;
        }),
        ("two-epochs", &|c| c.actor_rollout_ref.actor.ppo_epochs = 2),
        ("rollout-log-probs", &|c| {
            c.actor_rollout_ref.rollout.name = "logprobs".into();
            c.actor_rollout_ref.rollout.calculate_log_probs = true;
        }),
        ("no-shortcut", &|c| {
            c.actor_rollout_ref.actor.strategy = "fake".into()
        }),
    ];
    for (name, edit) in cases {
        let events = run(name, edit);
        assert_eq!(actor_passes(&events), 2, "{name}");
        // The pass measured the entropy; the update was not asked to.
        assert_eq!(entropy(&events), [0.25, 0.25], "{name}");
    }
}
