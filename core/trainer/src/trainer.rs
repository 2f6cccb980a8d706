//! The RL training loop, in verl's order: generate → reward → old log-probs → ref → values →
//! advantages → critic update → actor update → weight sync → validate (`test_freq`) → checkpoint
//! (`save_freq`) → log. Every component is taken from the registry by name, so the loop drives
//! whatever engine, rollout, weight sync and trackers the plugins provide. With several ranks
//! every rank runs this loop on its share of the batch (module `spmd`).

mod distill;
mod fully_async;
mod guard;
pub mod perf;
mod records;
mod spmd;
#[cfg(test)]
mod tests;
mod trackers;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use verl_plugin_api::{
    Batch, ComponentInit, ComponentKind, EngineCapabilities, GenerateRequest, Metric, PluginError,
    RolloutCapabilities, RoutedExperts, RunContext, SamplingParams, Table, keys,
};
use verl_plugin_host::{CheckpointHandle, Component, LookupError, Registry, RewardHandle};

use crate::batch;
use crate::checkpoint::{CheckpointError, CheckpointManager, Integrity, MANIFEST_FILE};
use crate::placement::Placement;
use verl_algo::{
    AdvEstimator, AdvantageInput, AdvantageParams, AlgoError, DataMetricsInput, DynamicSampler,
    KlController, Matrix, SamplerProgress, VarianceProxyInput, apply_kl_penalty, balance_batch,
    compute_advantage, compute_data_metrics, filter_groups, place_scores, rollout_correction,
    timing_metrics, variance_proxy_metrics,
};
use verl_config::{
    Config, EngineRole, NanPolicy, ResumeMode, RouterReplayMode, Slot, TrainingMode,
};
use verl_data::{
    ChatTemplate, DataError, DataLoader, LoaderState, PromptProcessor, Sample, TokenizedPrompt,
    expand_home, load_samples,
};
use verl_rewards::manager::{RewardManager, Rewards};
use verl_rewards::{self as reward, RewardError};

use crate::reward_select;
use crate::workers::{EngineWorker, RolloutWorker, SyncError, sync_weights};
use records::{StepRecord, test_pause_point};
use spmd::{
    MatrixRows, Outcome, Ranks, check_data_parallel, failures, prompt_seed, score_bits, scores_of,
};

pub use guard::{NonFinite, SKIPPED_UPDATES, apply_policy, check_update};
pub use trackers::Trackers;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{context}: {error}")]
    Plugin { context: String, error: PluginError },
    #[error(transparent)]
    Lookup(#[from] LookupError),
    /// A role's strategy that resolves to no engine on the selected platform.
    #[error("{key}: {source}")]
    Engine {
        key: &'static str,
        source: LookupError,
    },
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Reward(#[from] RewardError),
    #[error(transparent)]
    Algo(#[from] AlgoError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Sync(#[from] SyncError),
    /// The config asks a component for something it declares it cannot do.
    #[error("{0}")]
    Capability(String),
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("cannot write {what} at {}: {error}; nothing was trained", path.display())]
    Output {
        path: PathBuf,
        what: String,
        error: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error(
        "interrupted after step {0}; rerun with trainer.resume_mode=auto to continue from the last checkpoint"
    )]
    Interrupted(u64),
    /// A step's loss, gradient norm or weights were not finite (under `trainer.nan_policy=error`,
    /// or weights an engine already updated): training stops before anything of the step is kept.
    #[error(
        "step {step}: {what}; training stopped: nothing of step {step} was saved or exported, {kept}"
    )]
    NonFinite {
        step: u64,
        what: NonFinite,
        /// What is kept, and what else the user can do.
        kept: String,
    },
    #[error("checkpoint {}: the actor's weights hold non-finite values (tensor `{tensor}`)", dir.display())]
    NonFiniteCheckpoint { dir: PathBuf, tensor: String },
    /// The exchange between ranks failed (a lost rank is named), or another rank failed a step
    /// every rank takes part in.
    #[error("{what}: {reason}")]
    Ranks { what: String, reason: String },
}

/// Set by the Ctrl-C handler: the loop stops between steps, and trackers are flushed.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Ctrl-C once stops training after the current step (trackers flushed, run marked failed);
/// twice exits at once.
pub fn install_interrupt_handler() -> Result<(), ctrlc::Error> {
    ctrlc::set_handler(|| {
        if INTERRUPTED.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("\ninterrupt: stopping after this step (Ctrl-C again to exit now)");
    })
}

/// Adds what was being done to a plugin error.
trait Context<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T, TrainError>;
}

impl<T> Context<T> for Result<T, PluginError> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T, TrainError> {
        self.map_err(|error| TrainError::Plugin {
            context: what(),
            error,
        })
    }
}

/// What a checkpoint holds besides the engines' own state.
#[derive(Debug, Serialize, Deserialize)]
struct TrainerState {
    global_step: u64,
    loader: LoaderState,
    kl_coef: f64,
    /// Steps skipped by `trainer.nan_policy=skip` so far (absent in older checkpoints).
    #[serde(default)]
    skipped_steps: u64,
    /// The records of the steps since the previous checkpoint, this one's included (without its
    /// `timing_s/save_checkpoint`, unknown until the commit), logged again on resume; absent from
    /// checkpoints of earlier versions.
    #[serde(default)]
    records: Vec<StepRecord>,
    /// `one_step_off`: the next step's batch, already generated (with the weights of the step
    /// before this one), so a resumed run trains on it as the interrupted one would have.
    #[serde(default)]
    pending: Option<Collected>,
    /// `fully_async`: the batches generated ahead and not trained on yet, the next step's first.
    #[serde(default)]
    queued: Vec<Collected>,
}

const TRAINER_STATE_FILE: &str = "trainer_state.json";
/// verl's batch key for the truncated rollout-correction IS weights, which multiply the per-token
/// policy loss in the actor.
const ROLLOUT_IS_WEIGHTS: &str = "rollout_is_weights";

/// The rollout's log-probs as a `[rows × width]` matrix aligned with the response tokens, when it
/// returned one per token of every response (`None` when it returned none).
fn rollout_log_probs(rows: &[Row], width: usize) -> Result<Option<Matrix>, TrainError> {
    if rows.iter().all(|r| r.rollout_log_probs.is_empty()) {
        return Ok(None);
    }
    let mut matrix = Matrix::zeros(rows.len(), width);
    for (i, row) in rows.iter().enumerate() {
        if row.rollout_log_probs.len() != row.response.len() || row.response.len() > width {
            return Err(TrainError::Invalid(format!(
                "the rollout returned {} log-probs for a response of {} tokens",
                row.rollout_log_probs.len(),
                row.response.len()
            )));
        }
        matrix.row_mut(i)[..row.response.len()].copy_from_slice(&row.rollout_log_probs);
    }
    Ok(Some(matrix))
}

/// One generated response and where it came from.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Row {
    /// Index into the dataset.
    sample: usize,
    /// Prompt group: the `n` responses to one prompt share it.
    group: u64,
    response: Vec<u32>,
    /// The rollout's log-prob of each response token (empty when it returned none).
    rollout_log_probs: Vec<f32>,
    /// The weight version (the global step whose weights) the rollout generated it with.
    weight_version: u64,
    /// The experts each token was routed through, when the rollout recorded them
    /// (`enable_rollout_routing_replay`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    routed_experts: Option<RoutedExperts>,
}

/// A training batch, generated and scored: what a step trains on. In `one_step_off` mode the
/// next step's is generated while this one trains, and a checkpoint carries it, so a resumed
/// run trains on exactly the batch the interrupted one would have.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Collected {
    rows: Vec<Row>,
    /// The rows' scores as bits (exact through JSON, NaN included).
    scores: Vec<u64>,
    /// Generation rounds it took (`algorithm.filter_groups`).
    gen_batches: usize,
    /// GDPO's reward components (`algorithm.gdpo_reward_keys`) per row, one per key, as bits;
    /// empty without keys.
    #[serde(default)]
    components: Vec<Vec<u64>>,
}

impl Collected {
    fn new(rows: Vec<Row>, scores: &[f64], components: &[Vec<f64>], gen_batches: usize) -> Self {
        Self {
            rows,
            scores: score_bits(scores),
            gen_batches,
            components: components.iter().map(|c| score_bits(c)).collect(),
        }
    }
}

/// What the end of a step reports on, from the training half of it.
struct Trained {
    token_level_scores: Matrix,
    token_level_rewards: Matrix,
    advantages: Matrix,
    returns: Matrix,
    mask: Matrix,
    values: Option<Matrix>,
    prompt_lengths: Vec<usize>,
    response_lengths: Vec<usize>,
}

/// A step's rows in the order the engines see them, with their scores.
struct OrderedRows {
    rows: Vec<Row>,
    scores: Vec<f64>,
    /// GDPO's reward components per row (empty without `algorithm.gdpo_reward_keys`).
    components: Vec<Vec<f64>>,
}

/// A step's training batch and what every phase after it reads.
struct StepBatch {
    batch: Batch,
    mask: Matrix,
    /// This rank's rows of the batch.
    mine: Range<usize>,
    prompts: Vec<Vec<u32>>,
    responses: Vec<Vec<u32>>,
    /// The rollout's log-probs of the responses, when it returned them.
    rollout_lp: Option<Matrix>,
    /// The update computes the old log-probs itself: the old-log-prob pass is skipped.
    own_old: bool,
}

/// The forward passes' outputs, gathered over the ranks (`None` where a pass did not run).
struct Forward {
    old_log_probs: Option<Matrix>,
    sum_pi_squared: Option<Matrix>,
    ref_log_probs: Option<Matrix>,
    values: Option<Matrix>,
    teacher_outputs: Vec<(&'static str, verl_plugin_api::Tensor)>,
}

impl Forward {
    /// The old log-probs for `reader`, which runs only where the pass ran (see
    /// `update_takes_own_old_log_probs`).
    fn old(&self, reader: &str) -> Result<&Matrix, TrainError> {
        self.old_log_probs.as_ref().ok_or_else(|| {
            TrainError::Invalid(format!(
                "{reader} needs the old log-probs, but the old-log-prob pass was skipped"
            ))
        })
    }
}

/// The advantage phase's results.
struct Advantages {
    token_level_scores: Matrix,
    token_level_rewards: Matrix,
    /// The response mask after rollout correction's rejections.
    train_mask: Matrix,
    is_weights: Option<Matrix>,
    advantages: Matrix,
    returns: Matrix,
}

/// What generating and scoring takes: the rollout, the reward and the tokenizer. In
/// `one_step_off` mode it moves to a thread that generates the next batch while the engines
/// train on this one.
struct Generation {
    rollout: Box<dyn RolloutWorker + Send>,
    rollout_name: String,
    reward: RewardHandle,
    /// The reward component's name, for errors.
    reward_name: String,
    reward_manager: RewardManager,
    tokenizer: tokenizers::Tokenizer,
    /// Seconds spent scoring since the trainer last took them (`timing_s/reward`).
    reward_seconds: f64,
}

impl Generation {
    /// Generates `sampling.n` responses for each prompt of `mine` (indices into `data`), which
    /// sit at positions `offset..` of the step's prompts (their seeds and group ids follow the
    /// position), and scores them. Rows come back grouped by prompt.
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &mut self,
        data: &[(Sample, TokenizedPrompt)],
        mine: &[usize],
        offset: usize,
        sampling: SamplingParams,
        first_group: u64,
        weight_version: u64,
    ) -> Result<(Vec<Row>, Rewards), TrainError> {
        let mut rows: Vec<Row> = Vec::new();
        if !mine.is_empty() {
            let prompts = mine.iter().map(|&i| data[i].1.ids.clone()).collect();
            let request_seed = sampling.seed.unwrap_or_default();
            let seeds = (offset..offset + mine.len())
                .map(|i| prompt_seed(request_seed, i as u64))
                .collect();
            let request = GenerateRequest::new(prompts, sampling).with_seeds(seeds);
            let name = &self.rollout_name;
            let output = self
                .rollout
                .generate(&request)
                .context(|| format!("generating with `{name}`"))?;
            for c in &output.completions {
                let index = c.prompt_index as usize;
                let &sample = mine.get(index).ok_or_else(|| {
                    TrainError::Invalid(format!(
                        "rollout `{name}` returned a completion of prompt {index}, but the request had {} prompts",
                        mine.len()
                    ))
                })?;
                rows.push(Row {
                    sample,
                    group: first_group + (offset + index) as u64,
                    response: c.response_ids.clone(),
                    rollout_log_probs: c.logprobs.clone(),
                    weight_version,
                    routed_experts: c.routed_experts.clone(),
                });
            }
            rows.sort_by_key(|r| r.group);
        }
        let started = Instant::now();
        let rewards = self.score(data, &rows);
        self.reward_seconds += started.elapsed().as_secs_f64();
        Ok((rows, rewards?))
    }

    /// The rows' rewards: the reward component's scores through the reward manager.
    fn score(
        &mut self,
        data: &[(Sample, TokenizedPrompt)],
        rows: &[Row],
    ) -> Result<Rewards, TrainError> {
        let items = rows
            .iter()
            .map(|row| {
                let sample = &data[row.sample].0;
                let text = self
                    .tokenizer
                    .decode(&row.response, true)
                    .map_err(|e| TrainError::Invalid(format!("decoding a response: {e}")))?;
                Ok(verl_plugin_api::RewardItem::new(
                    sample.data_source.clone(),
                    text,
                    reward::ground_truth_value(&sample.reward_model.ground_truth),
                )
                .extra_info(sample.extra_info.clone()))
            })
            .collect::<Result<Vec<_>, TrainError>>()?;
        if items.is_empty() {
            return Ok(Rewards::default());
        }
        let name = &self.reward_name;
        let output = self
            .reward
            .compute(&verl_plugin_api::RewardRequest::new(items))
            .context(|| format!("scoring with the reward `{name}`"))?;
        let lengths: Vec<usize> = rows.iter().map(|r| r.response.len()).collect();
        Ok(self.reward_manager.apply(&output.scores, &lengths))
    }
}

/// Generated rows with their rewards and the reward's extra information, row by row.
struct Generated {
    rows: Vec<Row>,
    rewards: Rewards,
}

/// What a finished run reports.
#[derive(Debug, Default)]
pub struct RunSummary {
    pub global_step: u64,
    /// Validation metrics by the step they were taken at.
    pub validations: Vec<(u64, BTreeMap<String, f64>)>,
    pub final_model: Option<PathBuf>,
}

pub struct Trainer {
    config: Config,
    actor: Box<dyn EngineWorker>,
    reference: Option<Box<dyn EngineWorker>>,
    critic: Option<Box<dyn EngineWorker>>,
    /// The distillation teacher (`distillation.enabled`).
    teacher: Option<Box<dyn EngineWorker>>,
    /// Away only while a `one_step_off` step generates the next batch on its own thread.
    generation: Option<Generation>,
    weight_sync: CheckpointHandle,
    trackers: Trackers,
    tokenizer: tokenizers::Tokenizer,
    /// Shared with the thread that generates the next batch (`one_step_off`).
    train: Arc<Vec<(Sample, TokenizedPrompt)>>,
    val: Vec<(Sample, TokenizedPrompt)>,
    loader: DataLoader,
    kl_ctrl: KlController,
    checkpoints: CheckpointManager,
    run_dir: PathBuf,
    global_step: u64,
    total_steps: u64,
    /// Steps whose update `trainer.nan_policy=skip` left out.
    skipped_steps: u64,
    /// The records logged since the last checkpoint (after a resume: that checkpoint's, until
    /// they are logged again).
    records: Vec<StepRecord>,
    ranks: Ranks,
    /// `rollout.free_cache_engine` on a rollout that can sleep: it sleeps between generating a
    /// step's batch and the weight sync that follows the update.
    free_cache_engine: bool,
    /// The rollout was put to sleep and not woken yet.
    rollout_asleep: bool,
    perf: perf::EnginePerf,
    /// The weight version the rollout holds: the global step whose weights it was last given.
    rollout_version: u64,
    /// `one_step_off`: the next step's batch, generated while this one trained.
    pending: Option<Collected>,
    /// `fully_async`: the rollouter, its queue and schedule.
    fully_async: Option<fully_async::Rollouter>,
    /// The actor engine takes an on-policy update's old log-probs from its own forward
    /// (`EngineCapabilities::on_policy_updates`).
    on_policy_updates: bool,
}

/// The run's tokenizer and data: the prompts of both splits through the chat template, and the
/// loader over the training split.
struct RunData {
    tokenizer: tokenizers::Tokenizer,
    train: Vec<(Sample, TokenizedPrompt)>,
    val: Vec<(Sample, TokenizedPrompt)>,
    loader: DataLoader,
}

impl RunData {
    /// Reads and templates the data; no split may be empty where files were given, and the
    /// training split must fill a batch.
    fn load(config: &Config) -> Result<Self, TrainError> {
        let tokenizer_dir = tokenizer_dir(config);
        let tokenizer_json = tokenizer_dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_json)
            .map_err(|e| TrainError::Invalid(format!("{}: {e}", tokenizer_json.display())))?;
        let template = match &config.actor_rollout_ref.model.custom_chat_template {
            Some(source) => ChatTemplate::from_source(source, "", "")?,
            None => ChatTemplate::from_model_dir(&tokenizer_dir)?,
        };
        let data = &config.data;
        let mut processor = PromptProcessor::new(
            template,
            &tokenizer_json,
            data.max_prompt_length,
            data.filter_overlong_prompts,
            data.truncation,
        )?;
        processor.template_kwargs = config
            .chat_template_kwargs()
            .map_err(|e| TrainError::Invalid(e.to_string()))?;
        let train = load_split(
            &processor,
            &data.train_files,
            &data.prompt_key,
            data.train_max_samples,
        )?;
        let val = load_split(
            &processor,
            &data.val_files,
            &data.prompt_key,
            data.val_max_samples,
        )?;
        let sources = train
            .iter()
            .chain(&val)
            .map(|(s, _)| s.data_source.as_str());
        reward::check_sources(
            &config.reward_model,
            &config.custom_reward_function,
            sources,
        )?;
        if !data.val_files.is_empty() && val.is_empty() {
            return Err(TrainError::Invalid(format!(
                "data.val_files ({}) hold no prompts (after filtering); give files with prompts or none",
                data.val_files.join(", ")
            )));
        }
        let loader = DataLoader::new(
            train.len(),
            data.gen_batch_size.unwrap_or(data.train_batch_size),
            data.shuffle,
            data.seed.unwrap_or(config.trainer.seed),
            true,
        );
        if loader.batches_per_epoch() == 0 {
            let files = data.train_files.join(", ");
            return Err(TrainError::Invalid(if data.train_files.is_empty() {
                "data.train_files is empty: give the training data (.parquet, .jsonl or .json files)"
                    .to_owned()
            } else if train.is_empty() {
                format!("data.train_files ({files}) hold no prompts (after filtering)")
            } else {
                let (key, size) = match data.gen_batch_size {
                    Some(size) => ("gen_batch_size", size),
                    None => ("train_batch_size", data.train_batch_size),
                };
                format!(
                    "data.train_files ({files}) hold {} prompts (after filtering), fewer than \
                     data.{key}={size}",
                    train.len(),
                )
            }));
        }
        Ok(Self {
            tokenizer,
            train,
            val,
            loader,
        })
    }
}

/// The engines of a run, initialised with their sections.
struct Engines {
    actor: Box<dyn EngineWorker>,
    reference: Option<Box<dyn EngineWorker>>,
    critic: Option<Box<dyn EngineWorker>>,
    teacher: Option<Box<dyn EngineWorker>>,
}

impl Engines {
    fn create(
        config: &Config,
        components: &Components,
        run: &RunContext,
        total_steps: u64,
    ) -> Result<Self, TrainError> {
        let engine = |role: EngineRole,
                      component: &Component|
         -> Result<Box<dyn EngineWorker>, TrainError> {
            let mut engine = component.create_engine()?;
            let mut section = config.engine_json(role);
            section["optim"]["total_training_steps"] = json!(total_steps);
            // verl's bound on a collective of the engines' process group.
            section["nccl_timeout"] = json!(config.actor_rollout_ref.nccl_timeout);
            let init = plugin_init(config, Slot::Engine(role), component, section, run);
            engine.init(&init).context(|| {
                format!(
                    "initialising the {} engine `{}`",
                    role.as_str(),
                    component.name
                )
            })?;
            Ok(Box::new(engine))
        };
        let actor = engine(EngineRole::Actor, &components.actor)?;
        let reference = components
            .reference
            .as_ref()
            .map(|c| engine(EngineRole::Ref, c))
            .transpose()?;
        let critic = components
            .critic
            .as_ref()
            .map(|c| engine(EngineRole::Critic, c))
            .transpose()?;
        let teacher = components
            .teacher
            .as_ref()
            .map(|c| engine(EngineRole::Teacher, c))
            .transpose()?;
        Ok(Self {
            actor,
            reference,
            critic,
            teacher,
        })
    }
}

impl Generation {
    /// The rollout, the weight sync that feeds it and the reward, initialised.
    fn create(
        config: &Config,
        registry: &Registry,
        components: &Components,
        run: &RunContext,
        tokenizer: &tokenizers::Tokenizer,
    ) -> Result<(Self, CheckpointHandle), TrainError> {
        let mut rollout = components.rollout.create_rollout()?;
        let rollout_section = config.rollout_json();
        rollout
            .init(&plugin_init(
                config,
                Slot::Rollout,
                &components.rollout,
                rollout_section,
                run,
            ))
            .context(|| format!("initialising the rollout `{}`", components.rollout.name))?;

        // verl hands a checkpoint engine its own entry of `engine_kwargs`.
        let sync = &components.weight_sync;
        let kwargs = sync.config_section.as_ref().map_or(json!({}), |name| {
            config.plugin_section(Slot::Checkpoint, name).value
        });
        let mut weight_sync = sync.create_checkpoint()?;
        weight_sync
            .init(&plugin_init(config, Slot::Checkpoint, sync, kwargs, run))
            .context(|| format!("initialising the weight sync `{}`", sync.name))?;

        let reward_component = reward_select::resolve(registry, config)?;
        let mut reward = reward_component.create_reward()?;
        reward
            .init(&reward_select::init(config, run))
            .context(|| format!("initialising the reward `{}`", reward_component.name))?;
        let reward_manager = RewardManager::new(
            &config.reward_model.reward_manager,
            &config.reward_model.overlong_buffer,
            config.data.max_response_length,
        )?;
        let generation = Self {
            rollout: Box::new(rollout),
            rollout_name: components.rollout.name.clone(),
            reward,
            reward_name: reward_component.name,
            reward_manager,
            tokenizer: tokenizer.clone(),
            reward_seconds: 0.0,
        };
        Ok((generation, weight_sync))
    }
}

/// `trainer.logger`'s trackers, on rank 0 only (its metrics are every rank's).
fn create_trackers(
    config: &Config,
    registry: &Registry,
    run: &RunContext,
    ranks: Ranks,
    total_steps: u64,
) -> Result<Trackers, TrainError> {
    let mut tracker_config = config.to_json();
    tracker_config["trainer"]["total_training_steps"] = json!(total_steps);
    // Rank 0 alone logs (its metrics are every rank's).
    let loggers: &[String] = if ranks.leader() {
        &config.trainer.logger
    } else {
        &[]
    };
    let trackers = Trackers::create(registry, loggers, |tracker| {
        plugin_init(config, Slot::Tracker, tracker, tracker_config.clone(), run)
    })?;
    Ok(trackers)
}

/// The tokenizer directory: `data.tokenizer`, else `model.tokenizer_path`, else the model.
fn tokenizer_dir(config: &Config) -> PathBuf {
    let model = &config.actor_rollout_ref.model;
    expand_home(
        config
            .data
            .tokenizer
            .as_deref()
            .or(model.tokenizer_path.as_deref())
            .unwrap_or(&model.path),
    )
}

fn load_split(
    processor: &PromptProcessor,
    files: &[String],
    key: &str,
    max: i64,
) -> Result<Vec<(Sample, TokenizedPrompt)>, TrainError> {
    let mut samples = load_samples(files, key)?;
    if let Ok(max) = usize::try_from(max)
        && max > 0
    {
        samples.truncate(max);
    }
    Ok(processor.prepare(samples)?)
}

impl Trainer {
    /// Loads the data, checks the config against the components' declared capabilities, then
    /// creates and initialises every component where `placement` says (trackers are initialised
    /// by `fit`, once it knows the step a resumed run continues after).
    pub fn new(
        mut config: Config,
        registry: &Registry,
        placement: &Placement,
    ) -> Result<Self, TrainError> {
        let schedule = if config.trainer.training_mode == TrainingMode::FullyAsync {
            Some(fully_async::prepare(&mut config)?)
        } else {
            None
        };
        check_batch_sizes(&config)?;
        crate::limits::check_rl(&config).map_err(|e| TrainError::Invalid(e.to_string()))?;
        let run_dir = expand_home(&config.trainer.default_local_dir);
        check_outputs(&config, &run_dir)?;
        let data = RunData::load(&config)?;
        let total_steps = config
            .trainer
            .total_training_steps
            .filter(|&s| s > 0)
            .unwrap_or(config.trainer.total_epochs * data.loader.batches_per_epoch());

        let run = placement.for_run(
            &config.trainer.project_name,
            &config.trainer.experiment_name,
            &run_dir.to_string_lossy(),
        );
        let ranks = Ranks {
            rank: run.rank,
            world_size: run.world_size,
        };
        check_data_parallel(&config, ranks)?;
        distill::check(&config)?;
        let components = Components::resolve(&config, registry, &run.device_type)?;
        components.check(&config, &run)?;
        let engines = Engines::create(&config, &components, &run, total_steps)?;
        let (generation, weight_sync) =
            Generation::create(&config, registry, &components, &run, &data.tokenizer)?;
        // The rollout generates while the engines train in `one_step_off`: it never sleeps.
        let free_cache_engine = config.actor_rollout_ref.rollout.free_cache_engine
            && config.trainer.training_mode == TrainingMode::Sync
            && components
                .rollout
                .capabilities::<RolloutCapabilities>()
                .sleep_wake;
        let trackers = create_trackers(&config, registry, &run, ranks, total_steps)?;

        let kl = &config.algorithm.kl_ctrl;
        let kl_ctrl = KlController::new(kl.kind, kl.kl_coef, kl.target_kl, kl.horizon)?;
        let perf = perf::EnginePerf::new(
            &config,
            &run.device_type,
            placement.device_name(),
            run.world_size as usize,
        );
        let checkpoints = CheckpointManager::new(&run_dir, config.trainer.max_actor_ckpt_to_keep);
        // The run directory is rank 0's to tidy: the others only write into checkpoints it
        // prepares.
        if ranks.leader() {
            for path in checkpoints
                .clean_leftovers()?
                .into_iter()
                .chain(clean_export_leftovers(&run_dir)?)
            {
                tracing::warn!("removed {}, left by an interrupted run", path.display());
            }
        }
        let on_policy_updates = components
            .actor
            .capabilities::<EngineCapabilities>()
            .on_policy_updates;
        Ok(Self {
            config,
            actor: engines.actor,
            reference: engines.reference,
            critic: engines.critic,
            teacher: engines.teacher,
            generation: Some(generation),
            weight_sync,
            trackers,
            tokenizer: data.tokenizer,
            train: Arc::new(data.train),
            val: data.val,
            loader: data.loader,
            kl_ctrl,
            checkpoints,
            run_dir,
            global_step: 0,
            total_steps,
            skipped_steps: 0,
            records: Vec::new(),
            ranks,
            free_cache_engine,
            rollout_asleep: false,
            perf,
            rollout_version: 0,
            pending: None,
            fully_async: schedule.map(fully_async::Rollouter::new),
            on_policy_updates,
        })
    }

    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }

    /// Runs to `total_steps`, then exports the policy as a Hugging Face directory. Trackers are
    /// finished either way, marked failed on error.
    pub fn fit(mut self) -> Result<RunSummary, TrainError> {
        let result = self.fit_inner();
        self.trackers.finish(if result.is_ok() { 0 } else { 1 });
        result
    }

    fn fit_inner(&mut self) -> Result<RunSummary, TrainError> {
        let mut summary = RunSummary::default();
        // Trackers start once the checkpoint is restored: they are told the step it holds.
        let resumed = self.resume()?;
        self.trackers
            .start(resumed)
            .map_err(|(name, error)| TrainError::Plugin {
                context: format!("tracker `{name}` (trainer.logger)"),
                error,
            })?;
        if let Some(step) = resumed {
            tracing::info!("resumed from step {step}");
            for record in std::mem::take(&mut self.records) {
                self.trackers.log(record.step, &record.to_metrics());
            }
        }
        let trainer = &self.config.trainer;
        if trainer.val_before_train && !self.val.is_empty() {
            let (metrics, table) = self.validate()?;
            summary.validations.push((
                self.global_step,
                metrics
                    .iter()
                    .map(|m| (m.key.to_string(), m.value))
                    .collect(),
            ));
            // After a resume, the step's record came from its checkpoint: as a resumed W&B run
            // (verl's main tracker) refuses a step below its current one, this validation is not
            // logged as a second record of the step. It is in the summary.
            match resumed {
                None => {
                    if let Some(table) = &table {
                        self.trackers.log_table(self.global_step, table);
                    }
                    self.keep_record(self.global_step, &metrics);
                    self.trackers.log(self.global_step, &metrics);
                }
                Some(step) => tracing::info!(
                    "validation at the resumed step {step} (not logged again): {}",
                    metrics
                        .iter()
                        .map(|m| format!("{}={}", m.key, m.value))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }
        }
        if self.config.trainer.val_only {
            summary.global_step = self.global_step;
            return Ok(summary);
        }
        while self.global_step < self.total_steps {
            // Every rank stops at the same step, whichever saw the signal.
            let interrupted = INTERRUPTED.load(Ordering::SeqCst);
            if self
                .all_gather("checking for an interrupt", interrupted)?
                .contains(&true)
            {
                return Err(TrainError::Interrupted(self.global_step));
            }
            let step = self.global_step + 1;
            let mut metrics = self.train_step(step)?;
            // From here on the step is done: validation and the checkpoint belong to it.
            self.global_step = step;
            let is_last = step == self.total_steps;
            let (test_freq, save_freq) =
                (self.config.trainer.test_freq, self.config.trainer.save_freq);
            if test_freq > 0
                && !self.val.is_empty()
                && (is_last || step.is_multiple_of(test_freq as u64))
            {
                let t = Instant::now();
                let (val, table) = self.validate()?;
                if let Some(table) = &table {
                    self.trackers.log_table(step, table);
                }
                summary.validations.push((
                    step,
                    val.iter().map(|m| (m.key.to_string(), m.value)).collect(),
                ));
                metrics.extend(val);
                metrics.push(Metric::new("timing_s/testing", t.elapsed().as_secs_f64()));
            }
            // Kept for the next checkpoint before it is logged: a crash between that checkpoint's
            // commit and the log loses no step (see `records`).
            self.keep_record(step, &metrics);
            if save_freq > 0 && (is_last || step.is_multiple_of(save_freq as u64)) {
                let t = Instant::now();
                self.save_checkpoint()?;
                self.records.clear();
                test_pause_point(&format!("committed:{step}"));
                metrics.push(Metric::new(
                    "timing_s/save_checkpoint",
                    t.elapsed().as_secs_f64(),
                ));
            }
            self.trackers.log(step, &metrics);
        }
        let final_dir = self.export_final()?;
        tracing::info!("final model written to {}", final_dir.display());
        summary.global_step = self.global_step;
        summary.final_model = Some(final_dir);
        Ok(summary)
    }

    /// Every rank's `value`, in rank order: a collective, which every rank calls at the same
    /// point of the loop. On one rank nothing is exchanged.
    fn all_gather<T: Serialize + DeserializeOwned>(
        &mut self,
        what: &str,
        value: T,
    ) -> Result<Vec<T>, TrainError> {
        if self.ranks.single() {
            return Ok(vec![value]);
        }
        let failed = |reason: String| TrainError::Ranks {
            what: what.to_owned(),
            reason,
        };
        let bytes = serde_json::to_vec(&value).map_err(|e| failed(e.to_string()))?;
        self.actor
            .all_gather_object(&bytes)
            .map_err(|e| failed(e.to_string()))?
            .iter()
            .enumerate()
            .map(|(rank, part)| {
                serde_json::from_slice(part).map_err(|e| failed(format!("rank {rank}'s part: {e}")))
            })
            .collect()
    }

    /// Shares each rank's outcome of `what`, a step every rank takes: when any rank failed,
    /// every rank fails, naming the ranks that did and why (a rank's own error comes back as is).
    fn agree(&mut self, what: &str, outcome: Result<(), TrainError>) -> Result<(), TrainError> {
        if self.ranks.single() {
            return outcome;
        }
        let mine: Outcome = outcome.as_ref().err().map(ToString::to_string);
        let all = self.all_gather(what, mine)?;
        outcome?;
        match failures(&all) {
            None => Ok(()),
            Some(reason) => Err(TrainError::Ranks {
                what: what.to_owned(),
                reason,
            }),
        }
    }

    /// An engine's per-token output for this rank's rows, with every rank's rows after it: the
    /// global batch's matrix.
    fn gather_matrix(&mut self, name: &str, part: Matrix) -> Result<Matrix, TrainError> {
        if self.ranks.single() {
            return Ok(part);
        }
        let what = format!("gathering `{name}`");
        let parts = self.all_gather(&what, MatrixRows::of(&part))?;
        MatrixRows::concat(parts, name).map_err(|reason| TrainError::Ranks { what, reason })
    }

    /// Every rank's rows of an int64 batch tensor (`routed_experts`), in rank order.
    fn gather_rows(
        &mut self,
        name: &str,
        part: &verl_plugin_api::Tensor,
    ) -> Result<verl_plugin_api::Tensor, TrainError> {
        if self.ranks.single() {
            return Ok(part.clone());
        }
        let what = format!("gathering `{name}`");
        let values = part
            .to_vec::<i64>()
            .map_err(|e| TrainError::Invalid(format!("`{name}`: {e}")))?;
        let parts = self.all_gather(&what, (part.shape.to_vec(), values))?;
        let mut shape = parts[0].0.clone();
        if parts.iter().any(|(s, _)| s[1..] != shape[1..]) {
            return Err(TrainError::Ranks {
                what,
                reason: "the ranks' parts differ in shape beyond the rows".to_owned(),
            });
        }
        shape[0] = parts.iter().map(|(s, _)| s[0]).sum();
        let data: Vec<i64> = parts.into_iter().flat_map(|(_, v)| v).collect();
        verl_plugin_api::Tensor::from_slice(&shape, &data).context(|| what.clone())
    }

    /// The rollout's `routed_experts` of `rows` laid out like their batch (router replay R3).
    fn rollout_routing(
        &self,
        rows: &[Row],
        prompts: &[Vec<u32>],
        responses: &[Vec<u32>],
    ) -> Result<verl_plugin_api::Tensor, TrainError> {
        let name = &self.config.actor_rollout_ref.rollout.name;
        let routed = rows
            .iter()
            .map(|r| {
                r.routed_experts.as_ref().ok_or_else(|| {
                    TrainError::Invalid(format!(
                        "actor_rollout_ref.actor.router_replay.mode=R3: rollout `{name}` returned a completion without routed_experts"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        batch::routed_experts(prompts, responses, &routed)
            .context(|| format!("the routed_experts of rollout `{name}`"))
    }

    /// This rank's rows of the global batch (all of it on one rank).
    fn local<'a>(
        &self,
        batch: &'a Batch,
        rows: &Range<usize>,
    ) -> Result<Cow<'a, Batch>, TrainError> {
        if self.ranks.single() {
            return Ok(Cow::Borrowed(batch));
        }
        batch::slice_rows(batch, rows.clone())
            .map(Cow::Owned)
            .context(|| "this rank's rows of the batch".to_owned())
    }

    /// Keeps a step's record for the next checkpoint (none are kept without checkpoints).
    fn keep_record(&mut self, step: u64, metrics: &[Metric]) {
        if self.config.trainer.save_freq > 0 {
            self.records.push(StepRecord::new(step, metrics));
        }
    }

    /// Exports the policy into `<run_dir>/.huggingface.partial`, then swaps it in for
    /// `huggingface`, so a kill at any point leaves either the previous export or the new one,
    /// never half a model (see [`clean_export_leftovers`]).
    /// With several ranks every rank takes part in the export (an engine may gather its shards
    /// to rank 0), and rank 0 alone moves the directories.
    fn export_final(&mut self) -> Result<PathBuf, TrainError> {
        let (final_dir, partial, old) = export_dirs(&self.run_dir);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |error| TrainError::Io { path, error }
        };
        let leader = self.ranks.leader();
        let cleared = if leader && partial.exists() {
            std::fs::remove_dir_all(&partial).map_err(io(&partial))
        } else {
            Ok(())
        };
        self.agree("preparing the final export", cleared)?;
        let exported = self
            .actor
            .export_hf(&partial.to_string_lossy())
            .context(|| format!("exporting {}", partial.display()));
        self.agree("exporting the final model", exported)?;
        if leader {
            test_pause_point("exported");
            if final_dir.exists() {
                std::fs::rename(&final_dir, &old).map_err(io(&old))?;
                test_pause_point("swapping");
            }
            std::fs::rename(&partial, &final_dir).map_err(io(&final_dir))?;
            if old.exists() {
                std::fs::remove_dir_all(&old).map_err(io(&old))?;
            }
        }
        Ok(final_dir)
    }

    /// The next batch of dataset indices, moving to the next epoch when one is used up.
    fn next_indices(&mut self) -> Vec<usize> {
        loop {
            if let Some(batch) = self.loader.next_batch() {
                return batch;
            }
        }
    }

    fn sampling(&self, step: u64, validation: bool) -> SamplingParams {
        let rollout = &self.config.actor_rollout_ref.rollout;
        let (n, do_sample, temperature, top_p, top_k) = if validation {
            let v = &rollout.val_kwargs;
            (v.n, v.do_sample, v.temperature, v.top_p, v.top_k)
        } else {
            (
                rollout.n,
                rollout.do_sample,
                rollout.temperature,
                rollout.top_p,
                rollout.top_k,
            )
        };
        let mut params = SamplingParams::default();
        params.n = n as u32;
        params.greedy = !do_sample || temperature <= 0.0;
        params.temperature = temperature as f32;
        params.top_p = top_p as f32;
        params.top_k = top_k as i32;
        params.max_new_tokens = self.config.response_length() as u32;
        // A seed per step (not a running generator) keeps a resumed run identical to an
        // uninterrupted one.
        params.seed = Some(
            self.config
                .trainer
                .seed
                .wrapping_mul(0x9E37_79B9)
                .wrapping_add(step * 2 + u64::from(validation)),
        );
        params
    }

    /// Generates `n` responses per prompt of `indices` (into `data`) and scores them; rows come
    /// back grouped by prompt, with group ids `first_group..`, with their rewards and the
    /// reward's extra information. Each rank generates and scores its
    /// slice of the prompts, each prompt sampled from its own seed (so the samples do not depend
    /// on the number of ranks), and every rank gets every rank's rows.
    fn generate(
        &mut self,
        val: bool,
        indices: &[usize],
        sampling: SamplingParams,
        first_group: u64,
    ) -> Result<Generated, TrainError> {
        let part = self.ranks.part(indices.len());
        let mine = &indices[part.clone()];
        let data = if val { &self.val } else { &*self.train };
        let (rows, rewards) = self
            .generation
            .as_mut()
            .expect("generation is back after each step")
            .generate(
                data,
                mine,
                part.start,
                sampling,
                first_group,
                self.rollout_version,
            )?;
        if self.ranks.single() {
            return Ok(Generated { rows, rewards });
        }
        let parts = self.all_gather(
            "gathering the generated responses",
            (rows, score_bits(&rewards.rewards), rewards.extra),
        )?;
        let mut all = Generated {
            rows: Vec::new(),
            rewards: Rewards::default(),
        };
        for (part_rows, part_scores, part_extra) in parts {
            all.rows.extend(part_rows);
            all.rewards.append(Rewards {
                rewards: scores_of(&part_scores),
                extra: part_extra,
            });
        }
        Ok(all)
    }

    /// `algorithm.gdpo_reward_keys` when the estimator is GDPO (verl reads them only there).
    /// Whether this step's actor update takes its old log-probs from its own forward (verl's
    /// on-policy shortcut: one mini-batch of all `rows`, one epoch, an engine that declares it)
    /// while nothing else reads them: `rollout.calculate_log_probs` off (rollout correction and
    /// verl's rollout-vs-actor metrics, which verl logs only then), no KL in the reward, no Σπ² (optimal token baselines, the
    /// variance proxies), no R2 recording, an estimator that reads none. Then the old-log-prob
    /// pass, which verl's trainer always runs, is skipped: the update is the same.
    fn update_takes_own_old_log_probs(&self, step: u64, rows: usize) -> bool {
        let c = &self.config;
        let actor = &c.actor_rollout_ref.actor;
        let one_mini_batch = actor.ppo_mini_batch_size * c.actor_rollout_ref.rollout.n >= rows;
        self.on_policy_updates
            && step > c.trainer.critic_warmup
            && actor.ppo_epochs == 1
            && one_mini_batch
            && !c.actor_rollout_ref.rollout.calculate_log_probs
            && !fully_async::old_log_probs_from_rollout(c)
            && !(c.algorithm.use_kl_in_reward && self.reference.is_some())
            && !actor.calculate_sum_pi_squared
            && !c.algorithm.adv_estimator.needs_sum_pi_squared()
            && actor.router_replay.mode != RouterReplayMode::R2
    }

    fn gdpo_keys(&self) -> &[String] {
        match (
            self.config.algorithm.adv_estimator,
            &self.config.algorithm.gdpo_reward_keys,
        ) {
            (AdvEstimator::Gdpo, Some(keys)) => keys,
            _ => &[],
        }
    }

    /// GDPO's component rewards as verl places them (each response's value on its last token),
    /// one matrix per key, with verl's `gdpo/<key>/{mean,std,max,min}` metrics; `None` without
    /// keys.
    fn gdpo_components(
        &self,
        components: &[Vec<f64>],
        mask: &Matrix,
        metrics: &mut Vec<Metric>,
    ) -> Result<Option<Vec<Matrix>>, TrainError> {
        let keys = self.gdpo_keys();
        if keys.is_empty() {
            return Ok(None);
        }
        if components.len() != mask.rows() {
            return Err(TrainError::Invalid(format!(
                "algorithm.gdpo_reward_keys: {} rows of reward components for {} responses",
                components.len(),
                mask.rows()
            )));
        }
        let mut matrices = Vec::with_capacity(keys.len());
        for (k, key) in keys.iter().enumerate() {
            let values: Vec<f64> = components.iter().map(|row| row[k]).collect();
            let n = values.len().max(1) as f64;
            let mean = values.iter().sum::<f64>() / n;
            // numpy's std (population), as verl logs it.
            let std = (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n).sqrt();
            let fold = |init: f64, f: fn(f64, f64) -> f64| values.iter().copied().fold(init, f);
            for (stat, value) in [
                ("mean", mean),
                ("std", std),
                ("max", fold(f64::NEG_INFINITY, f64::max)),
                ("min", fold(f64::INFINITY, f64::min)),
            ] {
                metrics.push(Metric::new(format!("gdpo/{key}/{stat}"), value));
            }
            let scores: Vec<f32> = values.iter().map(|&v| v as f32).collect();
            matrices.push(place_scores(&scores, mask)?);
        }
        Ok(Some(matrices))
    }

    /// Generates and scores a training batch, `data.gen_batch_size` prompts a round; with DAPO's
    /// `filter_groups` keeps generating until `train_batch_size` prompts have responses whose
    /// metric differs (verl's `ray_dapo_trainer`).
    fn collect_batch(&mut self, step: u64) -> Result<Collected, TrainError> {
        let filter = self.config.algorithm.filter_groups.clone();
        let target = self.config.data.train_batch_size;
        let round = self.config.data.gen_batch_size.unwrap_or(target);
        let mut sampler = DynamicSampler::new(target, filter.max_num_gen_batches);
        let (mut rows, mut scores, mut components, mut gen_batches) =
            (Vec::new(), Vec::new(), Vec::new(), 0usize);
        loop {
            let indices = self.next_indices();
            let mut sampling = self.sampling(step, false);
            sampling.seed = sampling
                .seed
                .map(|s| s.wrapping_add(gen_batches as u64 * 1_000_003));
            let first_group = (gen_batches * round) as u64;
            let Generated {
                rows: new_rows,
                rewards,
            } = self.generate(false, &indices, sampling, first_group)?;
            gen_batches += 1;
            let new_components = rewards.components(self.gdpo_keys())?;
            if !filter.enable {
                return Ok(Collected::new(
                    new_rows,
                    &rewards.rewards,
                    &new_components,
                    gen_batches,
                ));
            }
            let metric = rewards.filter_metric(filter.metric.as_deref())?;
            let new_scores = rewards.rewards;
            let groups: Vec<u64> = new_rows.iter().map(|r| r.group).collect();
            let (kept, kept_groups) = filter_groups(&groups, &metric)?;
            let kept: std::collections::HashSet<usize> = kept.into_iter().collect();
            for (i, (row, score)) in new_rows.into_iter().zip(new_scores).enumerate() {
                if kept.contains(&i) {
                    rows.push(row);
                    scores.push(score);
                    components.extend(new_components.get(i).cloned());
                }
            }
            if sampler.record(kept_groups)? == SamplerProgress::Full {
                // Exactly `train_batch_size` prompt groups, the first ones kept.
                let mut first_groups: Vec<u64> = Vec::with_capacity(target);
                for row in &rows {
                    if first_groups.len() < target && !first_groups.contains(&row.group) {
                        first_groups.push(row.group);
                    }
                }
                let keep: Vec<bool> = rows
                    .iter()
                    .map(|row| first_groups.contains(&row.group))
                    .collect();
                let components = if components.is_empty() {
                    components
                } else {
                    keep_marked(components, &keep)
                };
                return Ok(Collected::new(
                    keep_marked(rows, &keep),
                    &keep_marked(scores, &keep),
                    &components,
                    gen_batches,
                ));
            }
        }
    }

    fn train_step(&mut self, step: u64) -> Result<Vec<Metric>, TrainError> {
        if self.fully_async.is_some() {
            return self.async_step(step);
        }
        let step_start = Instant::now();
        let mut timing: Vec<(&str, f64)> = Vec::new();
        let mut metrics: Vec<Metric> = Vec::new();

        // The batch generated while the previous step trained (`one_step_off`, or from the
        // checkpoint a run resumed from), else generated now.
        let t = Instant::now();
        self.generation_mut().reward_seconds = 0.0;
        let collected = match self.pending.take() {
            Some(pending) => pending,
            None => self.collect_batch(step)?,
        };
        // verl times scoring apart from generation.
        let mut reward = std::mem::take(&mut self.generation_mut().reward_seconds);
        let mut gen_wait = t.elapsed().as_secs_f64() - reward;
        let one_step_off = self.config.trainer.training_mode == TrainingMode::OneStepOff;
        let trained = if one_step_off && step < self.total_steps {
            // verl's one-step-off policy: step k+1's prompts are generated with the weights the
            // rollout holds (the previous step's) while the engines train on step k's, so the
            // rollout is one weight version behind the policy it feeds.
            let indices = self.next_indices();
            let sampling = self.sampling(step + 1, false);
            let mut generation = self
                .generation
                .take()
                .expect("generation is back after each step");
            let data = Arc::clone(&self.train);
            let version = self.rollout_version;
            let (trained, joined, waited) = std::thread::scope(|scope| {
                let next = scope.spawn(move || {
                    let t = Instant::now();
                    let out = generation.generate(&data, &indices, 0, sampling, 0, version);
                    (generation, out, t.elapsed().as_secs_f64())
                });
                let trained = self.train_on(step, collected, false, &mut timing, &mut metrics);
                let t = Instant::now();
                let joined = next.join();
                (trained, joined, t.elapsed().as_secs_f64())
            });
            let (mut generation, next, generated_in) =
                joined.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            reward += std::mem::take(&mut generation.reward_seconds);
            self.generation = Some(generation);
            gen_wait += waited;
            let trained = trained?;
            let (rows, rewards) = next?;
            let components = rewards.components(self.gdpo_keys())?;
            self.pending = Some(Collected::new(rows, &rewards.rewards, &components, 1));
            timing.push(("generate_async", generated_in));
            if step > self.config.trainer.critic_warmup {
                let t = Instant::now();
                self.sync_after_update(step)?;
                timing.push(("sync_rollout_weights", t.elapsed().as_secs_f64()));
            }
            trained
        } else {
            self.train_on(step, collected, true, &mut timing, &mut metrics)?
        };
        timing.insert(0, ("gen", gen_wait));
        timing.insert(1, ("reward", reward));

        // Awake for validation and the next step (a step without an update synced nothing).
        self.rollout_wake()?;
        self.finish_step(step, step_start, timing, metrics, trained)
    }

    /// The end of a step: the data, timing and throughput metrics of what it trained on.
    fn finish_step(
        &mut self,
        step: u64,
        step_start: Instant,
        mut timing: Vec<(&'static str, f64)>,
        mut metrics: Vec<Metric>,
        trained: Trained,
    ) -> Result<Vec<Metric>, TrainError> {
        let Trained {
            token_level_scores,
            token_level_rewards,
            advantages,
            returns,
            mask,
            values,
            prompt_lengths,
            response_lengths,
        } = trained;
        let data_metrics = compute_data_metrics(&DataMetricsInput {
            token_level_scores: &token_level_scores,
            token_level_rewards: &token_level_rewards,
            advantages: &advantages,
            returns: &returns,
            response_mask: &mask,
            values: values.as_ref(),
            prompt_lengths: &prompt_lengths,
            max_prompt_length: self.config.data.max_prompt_length,
            max_response_length: self.config.response_length(),
        })?;
        metrics.extend(data_metrics.into_iter().map(|(k, v)| Metric::new(k, v)));

        let world = self.ranks.world_size.max(1) as usize;
        let step_time = step_start.elapsed().as_secs_f64();
        let prompt_tokens: usize = prompt_lengths.iter().sum();
        let response_tokens: usize = response_lengths.iter().sum();
        let tokens = prompt_tokens + response_tokens;
        timing.push(("step", step_time));
        metrics.extend(
            timing_metrics(&timing, prompt_tokens, response_tokens)
                .into_iter()
                .map(|(k, v)| Metric::new(k, v)),
        );
        let seqlens: Vec<u64> = prompt_lengths
            .iter()
            .zip(&response_lengths)
            .map(|(p, r)| (p + r) as u64)
            .collect();
        metrics.extend(self.perf.metrics(&seqlens, &timing));
        metrics.push(Metric::new("perf/total_num_tokens", tokens as f64));
        metrics.push(Metric::new("perf/time_per_step", step_time));
        // verl's throughput is per device: tokens / (time × devices).
        metrics.push(Metric::new(
            "perf/throughput",
            tokens as f64 / (step_time * world as f64),
        ));
        metrics.push(Metric::new("training/global_step", step as f64));
        metrics.push(Metric::new(
            "training/epoch",
            self.loader.state().epoch as f64,
        ));
        Ok(metrics)
    }

    /// verl's `trainer.rollout_data_dir`: the step's samples as `<dir>/<step>.jsonl`, one line
    /// each with verl's `input`, `output`, `gts`, `score` and `step`, plus `index`, the prompt's
    /// row in the training data (ours). Written whole (a step redone after a resume writes it
    /// again), so the directory holds one file per trained step.
    fn dump_generations(
        &self,
        step: u64,
        dir: &Path,
        rows: &[Row],
        scores: &[f64],
    ) -> Result<(), TrainError> {
        let decode = |ids: &[u32]| {
            self.tokenizer
                .decode(ids, true)
                .map_err(|e| TrainError::Invalid(format!("decoding a sample: {e}")))
        };
        let mut text = String::new();
        for (row, score) in rows.iter().zip(scores) {
            let (sample, prompt) = &self.train[row.sample];
            let line = json!({
                "input": decode(&prompt.ids)?,
                "output": decode(&row.response)?,
                "gts": reward::ground_truth_value(&sample.reward_model.ground_truth),
                "score": score,
                "step": step,
                "index": row.sample,
            });
            text.push_str(&line.to_string());
            text.push('\n');
        }
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |error| TrainError::Io { path, error }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let path = dir.join(format!("{step}.jsonl"));
        let partial = dir.join(format!(".{step}.jsonl.partial"));
        std::fs::write(&partial, text).map_err(io(&partial))?;
        std::fs::rename(&partial, &path).map_err(io(&path))
    }

    /// Actor weights → rollout after step `step`'s update; non-finite weights stop the run.
    fn sync_after_update(&mut self, step: u64) -> Result<(), TrainError> {
        self.sync_weights(step).map_err(|e| match e {
            TrainError::Sync(SyncError::NonFinite { tensor }) => {
                self.non_finite(step, NonFinite::Weights { tensor })
            }
            e => e,
        })
    }

    /// One step's training half on the collected rows, phase by phase in verl's order: the rows'
    /// order, the batch, the forward passes (old, reference, teacher, values), the advantages,
    /// the updates.
    fn train_on(
        &mut self,
        step: u64,
        collected: Collected,
        sync: bool,
        timing: &mut Vec<(&'static str, f64)>,
        metrics: &mut Vec<Metric>,
    ) -> Result<Trained, TrainError> {
        let ordered = self.order_rows(step, collected, metrics)?;
        let mut step_batch = self.step_batch(step, &ordered)?;
        let mut forward = self.forward_passes(&mut step_batch, timing, metrics)?;
        let advantages =
            self.advantages(step, &ordered, &mut step_batch, &forward, timing, metrics)?;
        let teacher_outputs = std::mem::take(&mut forward.teacher_outputs);
        self.update(
            step,
            sync,
            &mut step_batch,
            teacher_outputs,
            timing,
            metrics,
        )?;
        self.variance_proxies(&forward, &advantages, metrics)?;
        Ok(Trained {
            token_level_scores: advantages.token_level_scores,
            token_level_rewards: advantages.token_level_rewards,
            advantages: advantages.advantages,
            returns: advantages.returns,
            mask: step_batch.mask,
            values: forward.values,
            prompt_lengths: step_batch.prompts.iter().map(Vec::len).collect(),
            response_lengths: step_batch.responses.iter().map(Vec::len).collect(),
        })
    }

    /// The rows in the order the engines see them (`trainer.balance_batch`), checked to split
    /// over the data-parallel ranks, with the staleness and generation-round metrics.
    fn order_rows(
        &mut self,
        step: u64,
        collected: Collected,
        metrics: &mut Vec<Metric>,
    ) -> Result<OrderedRows, TrainError> {
        let Collected {
            mut rows,
            scores,
            gen_batches,
            components,
        } = collected;
        let mut scores = scores_of(&scores);
        let mut components: Vec<Vec<f64>> = components.iter().map(|c| scores_of(c)).collect();
        self.rollout_sleep()?;
        if self.config.trainer.training_mode != TrainingMode::Sync {
            // How many versions behind the policy being updated (step − 1) each sample is.
            let behind: Vec<f64> = rows
                .iter()
                .map(|r| (step - 1).saturating_sub(r.weight_version) as f64)
                .collect();
            let n = behind.len().max(1) as f64;
            metrics.push(Metric::new(
                "training/staleness_mean",
                behind.iter().sum::<f64>() / n,
            ));
            metrics.push(Metric::new(
                "training/staleness_max",
                behind.iter().copied().fold(0.0, f64::max),
            ));
        }
        if self.config.algorithm.filter_groups.enable {
            metrics.push(Metric::new("train/num_gen_batches", gen_batches as f64));
        }
        // The engines compute on this rank's rows; their per-token outputs are gathered back.
        let world = self.ranks.world_size.max(1) as usize;
        if !rows.len().is_multiple_of(world) {
            return Err(TrainError::Invalid(format!(
                "step {step}: {} responses do not split evenly over {world} data-parallel ranks",
                rows.len(),
            )));
        }
        if self.config.trainer.balance_batch {
            let seqlens: Vec<u64> = rows
                .iter()
                .map(|r| (self.train[r.sample].1.ids.len() + r.response.len()) as u64)
                .collect();
            let balanced = balance_batch(&seqlens, world).map_err(|e| {
                TrainError::Invalid(format!("step {step}: trainer.balance_batch: {e}"))
            })?;
            rows = permute(rows, &balanced.order);
            scores = permute(scores, &balanced.order);
            if !components.is_empty() {
                components = permute(components, &balanced.order);
            }
            metrics.extend(balanced.metrics.into_iter().map(|(k, v)| Metric::new(k, v)));
        }
        if let Some(dir) = &self.config.trainer.rollout_data_dir
            && self.ranks.leader()
        {
            self.dump_generations(step, &expand_home(dir), &rows, &scores)?;
        }
        Ok(OrderedRows {
            rows,
            scores,
            components,
        })
    }

    /// The batch meta every engine call of `step` reads.
    fn batch_meta(
        &self,
        step: u64,
        calculate_entropy: bool,
    ) -> verl_plugin_api::abi_stable::std_types::RString {
        json!({
            "temperature": self.config.actor_rollout_ref.rollout.temperature,
            "global_steps": step,
            "calculate_entropy": calculate_entropy,
            "calculate_sum_pi_squared": self.config.actor_rollout_ref.actor.calculate_sum_pi_squared,
        })
        .to_string()
        .into()
    }

    /// The step's training batch (prompts, responses, masks; R3's rollout routing) and what the
    /// phases after it share.
    fn step_batch(&mut self, step: u64, ordered: &OrderedRows) -> Result<StepBatch, TrainError> {
        let rows = &ordered.rows;
        let prompts: Vec<Vec<u32>> = rows
            .iter()
            .map(|r| self.train[r.sample].1.ids.clone())
            .collect();
        let responses: Vec<Vec<u32>> = rows.iter().map(|r| r.response.clone()).collect();
        let mut batch = batch::build(&prompts, &responses, 0)
            .context(|| "building the training batch".to_owned())?;
        if self.config.actor_rollout_ref.actor.router_replay.mode == RouterReplayMode::R3 {
            batch.insert(
                keys::ROUTED_EXPERTS,
                self.rollout_routing(rows, &prompts, &responses)?,
            );
        }
        batch.meta_json = self.batch_meta(step, true);
        let mask = batch::matrix(
            keys::RESPONSE_MASK,
            batch
                .require(keys::RESPONSE_MASK)
                .context(|| "batch".to_owned())?,
        )
        .context(|| "batch".to_owned())?;
        let rollout_lp = rollout_log_probs(rows, mask.cols())?;
        // The update takes the old log-probs from its own forward and nothing else reads them: the
        // old-log-prob pass is skipped (its `actor/entropy` comes from the update).
        let own_old = self.update_takes_own_old_log_probs(step, rows.len());
        Ok(StepBatch {
            batch,
            mask,
            mine: self.ranks.part(rows.len()),
            prompts,
            responses,
            rollout_lp,
            own_old,
        })
    }

    /// The forward passes before the advantages: old log-probs (unless skipped or the rollout's
    /// stand in), reference log-probs, the teacher's outputs and the critic's values, each
    /// gathered over the ranks and added to the batch.
    fn forward_passes(
        &mut self,
        sb: &mut StepBatch,
        timing: &mut Vec<(&'static str, f64)>,
        metrics: &mut Vec<Metric>,
    ) -> Result<Forward, TrainError> {
        let (old_log_probs, sum_pi_squared) = if sb.own_old {
            (None, None)
        } else if fully_async::old_log_probs_from_rollout(&self.config) {
            // verl's bypass mode: the rollout's log-probs are the old policy's, and the actor's
            // recomputation is skipped.
            let old = sb.rollout_lp.clone().ok_or_else(|| {
                TrainError::Invalid(format!(
                    "algorithm.rollout_correction.bypass_mode: rollout `{}` returned no log-probs",
                    self.config.actor_rollout_ref.rollout.name
                ))
            })?;
            (Some(old), None)
        } else {
            let t = Instant::now();
            let pass = self.old_log_prob_pass(sb, metrics)?;
            timing.push(("old_log_prob", t.elapsed().as_secs_f64()));
            pass
        };
        if let Some(old) = &old_log_probs {
            sb.batch.insert(keys::OLD_LOG_PROBS, batch::tensor(old));
        }

        let mut ref_log_probs = None;
        if self.reference.is_some() {
            let t = Instant::now();
            let local = self.local(&sb.batch, &sb.mine)?;
            let out = self
                .reference
                .as_mut()
                .expect("checked above")
                .compute_log_prob(&local)
                .context(|| "computing reference log-probs".to_owned())?;
            let m = batch::matrix(
                keys::LOG_PROBS,
                out.require(keys::LOG_PROBS)
                    .context(|| "ref output".to_owned())?,
            )
            .context(|| "ref output".to_owned())?;
            let m = self.gather_matrix(keys::REF_LOG_PROB, m)?;
            sb.batch.insert(keys::REF_LOG_PROB, batch::tensor(&m));
            ref_log_probs = Some(m);
            timing.push(("ref", t.elapsed().as_secs_f64()));
        }

        let mut teacher_outputs = Vec::new();
        let t = Instant::now();
        let local = self
            .teacher
            .is_some()
            .then(|| self.local(&sb.batch, &sb.mine))
            .transpose()?;
        if let (Some(teacher), Some(local)) = (&mut self.teacher, local) {
            teacher_outputs = distill::teacher_outputs(teacher.as_mut(), &local, &self.config)?;
            timing.push(("teacher", t.elapsed().as_secs_f64()));
        }

        let mut values = None;
        if self.critic.is_some() {
            let t = Instant::now();
            let local = self.local(&sb.batch, &sb.mine)?;
            let out = self
                .critic
                .as_mut()
                .expect("checked above")
                .compute_values(&local)
                .context(|| "computing values".to_owned())?;
            let m = batch::matrix(
                keys::VALUES,
                out.require(keys::VALUES)
                    .context(|| "critic output".to_owned())?,
            )
            .context(|| "critic output".to_owned())?;
            let m = self.gather_matrix(keys::VALUES, m)?;
            sb.batch.insert(keys::VALUES, batch::tensor(&m));
            values = Some(m);
            timing.push(("values", t.elapsed().as_secs_f64()));
        }
        Ok(Forward {
            old_log_probs,
            sum_pi_squared,
            ref_log_probs,
            values,
            teacher_outputs,
        })
    }

    /// The actor's old-log-prob pass: the log-probs, R2's routing, `actor/entropy`, Σπ² when
    /// asked for, and the rollout-vs-actor probability metrics.
    fn old_log_prob_pass(
        &mut self,
        sb: &mut StepBatch,
        metrics: &mut Vec<Metric>,
    ) -> Result<(Option<Matrix>, Option<Matrix>), TrainError> {
        let local = self.local(&sb.batch, &sb.mine)?;
        let old = self
            .actor
            .compute_log_prob(&local)
            .context(|| "computing old log-probs".to_owned())?;
        let old_log_probs = batch::matrix(
            keys::LOG_PROBS,
            old.require(keys::LOG_PROBS)
                .context(|| "actor output".to_owned())?,
        )
        .context(|| "actor output".to_owned())?;
        let old_log_probs = self.gather_matrix(keys::LOG_PROBS, old_log_probs)?;
        // R2: the experts this forward routed, for the update to replay (verl keeps them in
        // place of any rollout's).
        if let Some(routed) = old.get(keys::ROUTED_EXPERTS)
            && self.config.actor_rollout_ref.actor.router_replay.mode == RouterReplayMode::R2
        {
            let routed = self.gather_rows(keys::ROUTED_EXPERTS, routed)?;
            sb.batch.insert(keys::ROUTED_EXPERTS, routed);
        }
        if let Some(entropy) = old.get(keys::ENTROPYS) {
            let entropy =
                batch::matrix(keys::ENTROPYS, entropy).context(|| "actor output".to_owned())?;
            let entropy = self.gather_matrix(keys::ENTROPYS, entropy)?;
            metrics.push(Metric::new(
                "actor/entropy",
                verl_algo::masked_mean(&entropy, &sb.mask)?,
            ));
        }
        // Σπ² per token, for the optimal token baselines and the variance_proxy/* metrics
        // (asked for in the batch meta).
        let sum_pi_squared = match old.get(keys::SUM_PI_SQUARED) {
            Some(t) => {
                let m =
                    batch::matrix(keys::SUM_PI_SQUARED, t).context(|| "actor output".to_owned())?;
                Some(self.gather_matrix(keys::SUM_PI_SQUARED, m)?)
            }
            None if self.config.actor_rollout_ref.actor.calculate_sum_pi_squared => {
                return Err(TrainError::Invalid(format!(
                    "actor_rollout_ref.actor.calculate_sum_pi_squared=True (algorithm.adv_estimator={}): actor \
                         engine `{}` returned no `{}` from compute_log_prob; an engine must compute it when the \
                         batch meta has \"calculate_sum_pi_squared\": true",
                    self.config.algorithm.adv_estimator.name(),
                    self.config.actor_rollout_ref.actor.strategy,
                    keys::SUM_PI_SQUARED
                )));
            }
            None => None,
        };
        if let Some(rollout_log_probs) = &sb.rollout_lp {
            let diff = verl_algo::rollout_probs_diff(rollout_log_probs, &old_log_probs, &sb.mask)?;
            metrics.extend(diff.into_iter().map(|(k, v)| Metric::new(k, v)));
        }
        Ok((Some(old_log_probs), sum_pi_squared))
    }

    /// Token-level rewards (KL in the reward), rollout correction, and the advantages and
    /// returns of `algorithm.adv_estimator`, added to the batch.
    fn advantages(
        &mut self,
        step: u64,
        ordered: &OrderedRows,
        sb: &mut StepBatch,
        forward: &Forward,
        timing: &mut Vec<(&'static str, f64)>,
        metrics: &mut Vec<Metric>,
    ) -> Result<Advantages, TrainError> {
        let t = Instant::now();
        let mask = &sb.mask;
        let scores_f32: Vec<f32> = ordered.scores.iter().map(|&s| s as f32).collect();
        let token_level_scores = place_scores(&scores_f32, mask)?;
        let token_level_rewards = match (
            &forward.ref_log_probs,
            self.config.algorithm.use_kl_in_reward,
        ) {
            (Some(ref_lp), true) => {
                let out = apply_kl_penalty(
                    &token_level_scores,
                    forward.old("algorithm.use_kl_in_reward")?,
                    ref_lp,
                    mask,
                    self.config.algorithm.kl_penalty,
                    &mut self.kl_ctrl,
                )?;
                metrics.extend(out.metrics().iter().map(|(k, v)| Metric::new(*k, *v)));
                out.token_level_rewards
            }
            _ => token_level_scores.clone(),
        };
        // Rollout correction (verl's decoupled mode: π_old recomputed, weighed against the
        // rollout's π): IS weights for the loss and the rejection mask, after the rewards.
        let mut train_mask = mask.clone();
        let mut is_weights = None;
        if !fully_async::old_log_probs_from_rollout(&self.config)
            && self.config.actor_rollout_ref.rollout.calculate_log_probs
            && let Some(rollout_lp) = &sb.rollout_lp
        {
            let settings = self.config.algorithm.rollout_correction.settings()?;
            let out = rollout_correction(
                forward.old("algorithm.rollout_correction")?,
                rollout_lp,
                mask,
                &settings,
            )?;
            metrics.extend(out.metrics.into_iter().map(|(k, v)| Metric::new(k, v)));
            if out.response_mask != *mask {
                sb.batch
                    .insert(keys::RESPONSE_MASK, batch::tensor(&out.response_mask));
            }
            train_mask = out.response_mask;
            if let Some(w) = out.is_weights {
                sb.batch.insert(ROLLOUT_IS_WEIGHTS, batch::tensor(&w));
                is_weights = Some(w);
            }
        }
        let groups: Vec<u64> = ordered.rows.iter().map(|r| r.group).collect();
        let baselines = if self.config.algorithm.adv_estimator.needs_greedy_baseline() {
            Some(self.greedy_baselines(step, &ordered.rows)?)
        } else {
            None
        };
        let reward_components = self.gdpo_components(&ordered.components, &sb.mask, metrics)?;
        let algorithm = &self.config.algorithm;
        let params = AdvantageParams {
            gamma: algorithm.gamma as f32,
            lam: algorithm.lam as f32,
            norm_adv_by_std_in_grpo: algorithm.norm_adv_by_std_in_grpo,
            ..AdvantageParams::default()
        };
        let reward_weights: Option<Vec<f32>> = algorithm
            .gdpo_reward_weights
            .as_ref()
            .map(|w| w.iter().map(|&x| x as f32).collect());
        let input = AdvantageInput {
            values: forward.values.as_ref(),
            reward_baselines: baselines.as_deref(),
            old_log_probs: forward.old_log_probs.as_ref(),
            sum_pi_squared: forward.sum_pi_squared.as_ref(),
            rollout_is_weights: is_weights.as_ref(),
            reward_components: reward_components.as_deref(),
            reward_weights: reward_weights.as_deref(),
            ..AdvantageInput::new(&token_level_rewards, &train_mask, &groups)
        };
        let (advantages, returns) = compute_advantage(algorithm.adv_estimator, &params, &input)?;
        sb.batch
            .insert(keys::ADVANTAGES, batch::tensor(&advantages));
        sb.batch.insert(keys::RETURNS, batch::tensor(&returns));
        timing.push(("adv", t.elapsed().as_secs_f64()));
        Ok(Advantages {
            token_level_scores,
            token_level_rewards,
            train_mask,
            is_weights,
            advantages,
            returns,
        })
    }

    /// The critic's and the actor's updates (the actor's after `trainer.critic_warmup`), the
    /// weight sync after them when `sync`, and `trainer.nan_policy`'s skipped-step count.
    fn update(
        &mut self,
        step: u64,
        sync: bool,
        sb: &mut StepBatch,
        teacher_outputs: Vec<(&'static str, verl_plugin_api::Tensor)>,
        timing: &mut Vec<(&'static str, f64)>,
        metrics: &mut Vec<Metric>,
    ) -> Result<(), TrainError> {
        let mut skipped = false;
        // The update measures `actor/entropy` only when no old-log-prob pass did.
        sb.batch.meta_json = self.batch_meta(step, sb.own_old);
        let mut update = self.local(&sb.batch, &sb.mine)?;
        for (name, tensor) in teacher_outputs {
            update.to_mut().insert(name, tensor);
        }
        if let Some(critic) = &mut self.critic {
            let t = Instant::now();
            let out = critic
                .update_critic(&update)
                .context(|| "updating the critic".to_owned())?;
            skipped |= self.guard(step, "critic", &out)?;
            metrics.extend(out.iter().cloned());
            timing.push(("update_critic", t.elapsed().as_secs_f64()));
        }
        if step > self.config.trainer.critic_warmup {
            let t = Instant::now();
            let out = self
                .actor
                .update_actor(&update)
                .context(|| "updating the actor".to_owned())?;
            skipped |= self.guard(step, "actor", &out)?;
            // The engine's own entropy (from the update) supersedes the one measured above.
            if out.iter().any(|m| m.key == "actor/entropy") {
                metrics.retain(|m| m.key != "actor/entropy");
            }
            metrics.extend(out.iter().cloned());
            timing.push(("update_actor", t.elapsed().as_secs_f64()));
            if sync {
                let t = Instant::now();
                self.sync_after_update(step)?;
                timing.push(("update_weights", t.elapsed().as_secs_f64()));
            }
        }
        if skipped {
            self.skipped_steps += 1;
        }
        if self.config.trainer.nan_policy == NanPolicy::Skip {
            metrics.push(Metric::new(
                "training/skipped_steps",
                self.skipped_steps as f64,
            ));
        }
        Ok(())
    }

    /// verl's variance_proxy/* metrics whenever the actor computed Σπ², with this step's
    /// actor/grad_norm (the mean over the update's mini-batches, as verl's reduce_metrics gives
    /// it; none before critic_warmup ends).
    fn variance_proxies(
        &self,
        forward: &Forward,
        adv: &Advantages,
        metrics: &mut Vec<Metric>,
    ) -> Result<(), TrainError> {
        let Some(sum_pi_squared) = &forward.sum_pi_squared else {
            return Ok(());
        };
        let proxies = variance_proxy_metrics(&VarianceProxyInput {
            old_log_probs: forward.old("the variance_proxy metrics")?,
            sum_pi_squared,
            advantages: &adv.advantages,
            response_mask: &adv.train_mask,
            rollout_is_weights: adv.is_weights.as_ref(),
            grad_norm: metrics
                .iter()
                .find(|m| m.key == "actor/grad_norm")
                .map(|m| m.value),
        })?;
        metrics.extend(proxies.into_iter().map(|(k, v)| Metric::new(k, v)));
        Ok(())
    }

    /// `trainer.nan_policy` on `role`'s update: `Ok(true)` when it was skipped.
    fn guard(&self, step: u64, role: &str, metrics: &[Metric]) -> Result<bool, TrainError> {
        apply_policy(self.config.trainer.nan_policy, step, role, metrics)
            .map_err(|what| self.non_finite(step, what))
    }

    /// The error that stops training at `step`, saying which checkpoint remains.
    fn non_finite(&self, step: u64, what: NonFinite) -> TrainError {
        let mut kept = match self.checkpoints.latest() {
            Ok(Some((_, dir))) => format!("{} stays the latest checkpoint", dir.display()),
            _ => "and there is no checkpoint to resume from".to_owned(),
        };
        if what.skippable() {
            kept.push_str("; trainer.nan_policy=skip skips such steps instead");
        }
        TrainError::NonFinite { step, what, kept }
    }

    /// ReMax: the score of one greedy response per row's prompt.
    fn greedy_baselines(&mut self, step: u64, rows: &[Row]) -> Result<Vec<f32>, TrainError> {
        let mut unique: Vec<usize> = rows.iter().map(|r| r.sample).collect();
        unique.dedup();
        let mut sampling = self.sampling(step, false);
        sampling.n = 1;
        sampling.greedy = true;
        let greedy = self.generate(false, &unique, sampling, 0)?;
        let by_sample: BTreeMap<usize, f64> = greedy
            .rows
            .iter()
            .zip(greedy.rewards.rewards)
            .map(|(r, s)| (r.sample, s))
            .collect();
        Ok(rows.iter().map(|r| by_sample[&r.sample] as f32).collect())
    }

    /// Actor weights → weight sync → rollout, by reference, tagged with the step.
    /// With `rollout.free_cache_engine` the rollout frees its memory while the engines train:
    /// sleep level 1 (KV cache dropped, weights kept off the device and restored on waking, verl's
    /// colocated mode), which stays right in a step that syncs no weights (`critic_warmup`).
    fn generation_mut(&mut self) -> &mut Generation {
        self.generation
            .as_mut()
            .expect("generation is back after each step")
    }

    fn rollout_sleep(&mut self) -> Result<(), TrainError> {
        if self.free_cache_engine && !self.rollout_asleep {
            self.generation_mut().rollout.sleep(1).context(|| {
                "putting the rollout to sleep (actor_rollout_ref.rollout.free_cache_engine)"
                    .to_owned()
            })?;
            self.rollout_asleep = true;
        }
        Ok(())
    }

    fn rollout_wake(&mut self) -> Result<(), TrainError> {
        if self.rollout_asleep {
            self.generation_mut().rollout.wake_up().context(|| {
                "waking the rollout (actor_rollout_ref.rollout.free_cache_engine)".to_owned()
            })?;
            self.rollout_asleep = false;
        }
        Ok(())
    }

    fn sync_weights(&mut self, step: u64) -> Result<(), TrainError> {
        self.rollout_wake()?;
        let backend = &self
            .config
            .actor_rollout_ref
            .rollout
            .checkpoint_engine
            .backend;
        let rollout = self
            .generation
            .as_mut()
            .expect("generation is back after each step");
        sync_weights(
            self.actor.as_mut(),
            &mut self.weight_sync,
            backend,
            rollout.rollout.as_mut(),
            step,
        )?;
        self.rollout_version = step;
        Ok(())
    }

    /// Means per data source over the validation set, as verl names them: the reward, and each
    /// numeric key of the reward's extra information (`val-core/<source>/reward/mean@N`, or
    /// `val-core/<source>/acc/mean@N` and `val-aux/<source>/reward/mean@N` when there is an
    /// `acc`), plus a table of the first `log_val_generations` samples, for the caller to log.
    fn validate(&mut self) -> Result<(Vec<Metric>, Option<Table>), TrainError> {
        let sampling = self.sampling(0, true);
        let n = sampling.n;
        let chunk = self
            .config
            .data
            .val_batch_size
            .unwrap_or(self.val.len())
            .max(1);
        let indices: Vec<usize> = (0..self.val.len()).collect();
        let mut rows = Vec::new();
        let mut rewards = Rewards::default();
        for (i, part) in indices.chunks(chunk).enumerate() {
            let part = self.generate(true, part, sampling.clone(), (i * chunk) as u64)?;
            rows.extend(part.rows);
            rewards.append(part.rewards);
        }
        let sources: Vec<&str> = rows
            .iter()
            .map(|row| self.val[row.sample].0.data_source.as_str())
            .collect();
        let metrics: Vec<Metric> = rewards
            .validation_means(&sources)
            .into_iter()
            .map(|(section, source, var, mean)| {
                Metric::new(format!("{section}/{source}/{var}/mean@{n}"), mean)
            })
            .collect();
        let scores = rewards.rewards;
        let shown = self.config.trainer.log_val_generations.min(rows.len());
        let table = (shown > 0).then(|| {
            let table_rows = rows[..shown]
                .iter()
                .zip(&scores)
                .map(|(row, score)| {
                    let response = self
                        .tokenizer
                        .decode(&row.response, true)
                        .unwrap_or_default();
                    vec![
                        self.val[row.sample].1.text.clone(),
                        response,
                        format!("{score}"),
                    ]
                })
                .collect();
            Table::new(
                "val/generations",
                vec!["input".into(), "output".into(), "score".into()],
                table_rows,
            )
        });
        Ok((metrics, table))
    }

    /// Rank 0 prepares the checkpoint's temporary directory; every rank writes its files into
    /// it (the engines decide which: replicated state once, shards per rank) and fsyncs them;
    /// once every rank has reported success, rank 0 writes the manifest over all of them and
    /// commits. A rank that fails or is lost leaves the checkpoint uncommitted, never visible.
    fn save_checkpoint(&mut self) -> Result<(), TrainError> {
        if self.fully_async.is_some() {
            // The checkpoint carries what the rollouter generated ahead: all it may generate
            // with the weights it holds, which a resumed run could not regenerate.
            self.async_settle()?;
        }
        let step = self.global_step;
        let (pending, began) = if self.ranks.leader() {
            match self.checkpoints.begin(step) {
                Ok(pending) => (Some(pending), Ok(())),
                Err(e) => (None, Err(e.into())),
            }
        } else {
            (None, Ok(()))
        };
        self.agree("preparing the checkpoint", began)?;
        let dir = self.checkpoints.partial_dir(step);
        let written = self.write_checkpoint_files(&dir, step);
        self.agree(&format!("writing checkpoint {}", dir.display()), written)?;
        let committed = match pending {
            Some(pending) => self.checkpoints.commit(pending).map(|dir| {
                tracing::info!("checkpoint written to {}", dir.display());
            }),
            None => Ok(()),
        };
        self.agree("committing the checkpoint", committed.map_err(Into::into))
    }

    /// This rank's files of the checkpoint in `dir`: the engines' and, on rank 0, the trainer's
    /// state; synced to disk before the rank reports them written.
    fn write_checkpoint_files(&mut self, dir: &Path, step: u64) -> Result<(), TrainError> {
        let actor_dir = dir.join("actor");
        self.actor
            .save_checkpoint(&actor_dir.to_string_lossy(), step)
            .context(|| format!("saving {}", actor_dir.display()))?;
        if let Some(critic) = &mut self.critic {
            let dir = dir.join("critic");
            critic
                .save_checkpoint(&dir.to_string_lossy(), step)
                .context(|| format!("saving {}", dir.display()))?;
        }
        if self.ranks.leader() {
            let state = TrainerState {
                global_step: step,
                loader: self.loader.state(),
                kl_coef: self.kl_ctrl.value,
                skipped_steps: self.skipped_steps,
                records: self.records.clone(),
                pending: self.pending.clone(),
                queued: self
                    .fully_async
                    .as_ref()
                    .map(fully_async::Rollouter::queued)
                    .unwrap_or_default(),
            };
            let path = dir.join(TRAINER_STATE_FILE);
            std::fs::write(
                &path,
                serde_json::to_vec_pretty(&state).expect("trainer state serialises"),
            )
            .map_err(|error| TrainError::Io { path, error })?;
        } else {
            // Rank 0's commit syncs the whole checkpoint; the others sync what they wrote first.
            CheckpointManager::sync(dir)?;
        }
        Ok(())
    }

    /// Restores the latest checkpoint as `trainer.resume_mode` says, after verifying its files
    /// against its manifest; returns its step. Under `auto` a corrupt checkpoint is passed over
    /// for the newest intact one; a corrupt `resume_from_path` is an error.
    fn resume(&mut self) -> Result<Option<u64>, TrainError> {
        let started = Instant::now();
        // Rank 0 chooses (and verifies) the checkpoint; every rank loads it.
        let found = if self.ranks.leader() {
            self.find_checkpoint()
        } else {
            Ok(None)
        };
        let chosen = if self.ranks.single() {
            found?.map(|(step, dir, integrity)| (step, dir, Some(integrity)))
        } else {
            const WHAT: &str = "choosing the checkpoint to resume from";
            let mine: Result<Option<(u64, PathBuf)>, String> = match &found {
                Ok(f) => Ok(f.as_ref().map(|(step, dir, _)| (*step, dir.clone()))),
                Err(e) => Err(e.to_string()),
            };
            let leaders = self.all_gather(WHAT, mine)?.swap_remove(0);
            let integrity = found?.map(|(_, _, integrity)| integrity);
            match leaders {
                Ok(choice) => choice.map(|(step, dir)| (step, dir, integrity)),
                Err(reason) => {
                    return Err(TrainError::Ranks {
                        what: WHAT.to_owned(),
                        reason: format!("rank 0: {reason}"),
                    });
                }
            }
        };
        let Some((step, dir, integrity)) = chosen else {
            return Ok(None);
        };
        match integrity {
            Some(Integrity::Verified { files, bytes }) => tracing::info!(
                "{}: {files} files ({bytes} bytes) match its manifest ({:.3} s)",
                dir.display(),
                started.elapsed().as_secs_f64()
            ),
            Some(Integrity::Unverified) => tracing::warn!(
                "{} has no {MANIFEST_FILE} (written before checkpoints carried one): loading it unverified",
                dir.display()
            ),
            // Verified by rank 0.
            None => {}
        }
        self.load_from(&dir)?;
        debug_assert_eq!(self.global_step, step);
        Ok(Some(step))
    }

    /// The checkpoint `trainer.resume_mode` says to resume from, verified against its manifest.
    fn find_checkpoint(&self) -> Result<Option<(u64, PathBuf, Integrity)>, TrainError> {
        let found = match self.config.trainer.resume_mode {
            ResumeMode::Disable => None,
            ResumeMode::Auto => self.checkpoints.latest_intact()?.map(|found| {
                for corrupt in &found.passed_over {
                    tracing::warn!("{corrupt}; passing over it");
                }
                if !found.passed_over.is_empty() {
                    tracing::warn!(
                        "resuming from step {} ({}), the newest intact checkpoint",
                        found.step,
                        found.dir.display()
                    );
                }
                (found.step, found.dir, found.integrity)
            }),
            ResumeMode::ResumePath => {
                let path = self
                    .config
                    .trainer
                    .resume_from_path
                    .as_deref()
                    .ok_or_else(|| {
                        TrainError::Invalid(
                            "trainer.resume_mode=resume_path needs trainer.resume_from_path"
                                .to_owned(),
                        )
                    })?;
                let (step, dir) = CheckpointManager::resolve_path(&expand_home(path))?;
                let integrity = CheckpointManager::verify(&dir)?;
                Some((step, dir, integrity))
            }
        };
        Ok(found)
    }

    fn load_from(&mut self, dir: &Path) -> Result<(), TrainError> {
        let path = dir.join(TRAINER_STATE_FILE);
        let text = std::fs::read_to_string(&path).map_err(|error| TrainError::Io {
            path: path.clone(),
            error,
        })?;
        let state: TrainerState = serde_json::from_str(&text)
            .map_err(|e| TrainError::Invalid(format!("{}: {e}", path.display())))?;
        let actor_dir = dir.join("actor");
        self.actor
            .load_checkpoint(&actor_dir.to_string_lossy())
            .context(|| format!("loading {}", actor_dir.display()))?;
        if let Some(critic) = &mut self.critic {
            let critic_dir = dir.join("critic");
            critic
                .load_checkpoint(&critic_dir.to_string_lossy())
                .context(|| format!("loading {}", critic_dir.display()))?;
        }
        self.loader.restore(state.loader);
        self.kl_ctrl.value = state.kl_coef;
        self.global_step = state.global_step;
        self.records = state.records;
        self.skipped_steps = state.skipped_steps;
        self.pending = state.pending;
        if let Some(rollouter) = &mut self.fully_async {
            rollouter.restore(state.global_step, state.queued);
        }
        self.sync_weights(state.global_step).map_err(|e| match e {
            TrainError::Sync(SyncError::NonFinite { tensor }) => TrainError::NonFiniteCheckpoint {
                dir: dir.to_path_buf(),
                tensor,
            },
            e => e,
        })
    }
}

/// Runs a whole training job: the trainer's entry point for `verl-core run`.
pub fn run(
    config: Config,
    registry: &Registry,
    placement: &Placement,
) -> Result<RunSummary, TrainError> {
    Trainer::new(config, registry, placement)?.fit()
}

/// The final export, its in-progress copy and the previous export while it is being replaced.
fn export_dirs(run_dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    (
        run_dir.join("huggingface"),
        run_dir.join(".huggingface.partial"),
        run_dir.join(".huggingface.old"),
    )
}

/// Undoes an interrupted [`Trainer::export_final`]: the in-progress copy is dropped, and a
/// previous export set aside is put back when no new one replaced it. Returns what was removed.
fn clean_export_leftovers(run_dir: &Path) -> Result<Vec<PathBuf>, TrainError> {
    let (final_dir, partial, old) = export_dirs(run_dir);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |error| TrainError::Io { path, error }
    };
    let mut removed = Vec::new();
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(io(&partial))?;
        removed.push(partial);
    }
    if old.exists() {
        if final_dir.exists() {
            std::fs::remove_dir_all(&old).map_err(io(&old))?;
            removed.push(old);
        } else {
            std::fs::rename(&old, &final_dir).map_err(io(&final_dir))?;
        }
    }
    Ok(removed)
}

/// The config's values, checked as a run checks them but before anything is made (the
/// quickstart's data and warm-up, the run directory): the batch sizes, the fully-async schedule,
/// the split over `world_size` data-parallel ranks, distillation and the algorithm's settings.
/// `verl-core run` stops on them first, and `verl-core config check` reports them.
pub fn check_values(config: &Config, world_size: u32) -> Result<(), TrainError> {
    let mut config = config.clone();
    if config.trainer.training_mode == TrainingMode::FullyAsync {
        fully_async::prepare(&mut config)?;
    }
    check_batch_sizes(&config)?;
    check_data_parallel(
        &config,
        Ranks {
            rank: 0,
            world_size,
        },
    )?;
    distill::check(&config)?;
    check_algorithm(&config, world_size)
}

/// verl's batch-size checks, before anything is loaded: sizes that would otherwise be replaced
/// silently (a zero batch trained as one) or fail deep inside an engine.
fn check_batch_sizes(config: &Config) -> Result<(), TrainError> {
    let invalid = |message: String| Err(TrainError::Invalid(message));
    let data = &config.data;
    let arr = &config.actor_rollout_ref;
    if data.train_batch_size == 0 {
        return invalid("data.train_batch_size must be at least 1".to_owned());
    }
    match data.gen_batch_size {
        Some(0) => return invalid("data.gen_batch_size must be at least 1 (or unset)".to_owned()),
        // verl's trainer trains on the whole generation batch when nothing is filtered.
        Some(size) if size != data.train_batch_size && !config.algorithm.filter_groups.enable => {
            return invalid(format!(
                "data.gen_batch_size={size} differs from data.train_batch_size={} without \
                 algorithm.filter_groups.enable=true: each step would train on gen_batch_size \
                 prompts; set data.train_batch_size={size}, or enable filter_groups (DAPO)",
                data.train_batch_size
            ));
        }
        _ => {}
    }
    let filter = &config.algorithm.filter_groups;
    if filter.enable
        && filter.metric.as_deref() == Some("seq_final_reward")
        && config.algorithm.use_kl_in_reward
    {
        return invalid(
            "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: \
             groups are filtered before the KL penalty is known here; use seq_reward or acc"
                .to_owned(),
        );
    }
    if data.val_batch_size == Some(0) {
        return invalid(
            "data.val_batch_size must be at least 1 (or unset: the whole validation set)"
                .to_owned(),
        );
    }
    if arr.rollout.n == 0 {
        return invalid(
            "actor_rollout_ref.rollout.n (responses per prompt) must be at least 1".to_owned(),
        );
    }
    // As verl: the older global micro-batch sizes and the per-GPU ones exclude each other.
    let micro_batches = [
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size",
            arr.actor.ppo_micro_batch_size,
            arr.actor.ppo_micro_batch_size_per_gpu,
        ),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size",
            arr.rollout.log_prob_micro_batch_size,
            arr.rollout.log_prob_micro_batch_size_per_gpu,
        ),
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size",
            arr.reference.log_prob_micro_batch_size,
            arr.reference.log_prob_micro_batch_size_per_gpu,
        ),
        (
            "critic.ppo_micro_batch_size",
            config.critic.ppo_micro_batch_size,
            config.critic.ppo_micro_batch_size_per_gpu,
        ),
        (
            "critic.forward_micro_batch_size",
            config.critic.forward_micro_batch_size,
            config.critic.forward_micro_batch_size_per_gpu,
        ),
    ];
    for (key, global, per_gpu) in micro_batches {
        if global.is_some() && per_gpu.is_some() {
            return invalid(format!(
                "{key} and {key}_per_gpu are both set; set one (the per-GPU size is preferred)"
            ));
        }
    }
    let mini_batches = [
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            Some(arr.actor.ppo_mini_batch_size),
        ),
        (
            "critic.ppo_mini_batch_size",
            config.critic_enabled().then(|| {
                config
                    .critic
                    .ppo_mini_batch_size
                    .unwrap_or(arr.actor.ppo_mini_batch_size)
            }),
        ),
    ];
    // verl asserts at the first batch that a micro-batch's token budget holds one padded
    // sequence (its prompt and response columns); say so before anything runs.
    let width = data.max_prompt_length + config.response_length();
    for (role, used) in [
        (EngineRole::Actor, true),
        (EngineRole::Ref, config.ref_enabled()),
        (EngineRole::Critic, config.critic_enabled()),
    ] {
        let budgets = config.token_budgets(role);
        for (key, tokens) in budgets.into_iter().flatten().filter(|_| used) {
            if tokens < width {
                return invalid(format!(
                    "{key}={tokens} is smaller than one sequence: data.max_prompt_length + the \
                     response length = {width} tokens (verl asserts max_token_len >= the padded \
                     sequence length)"
                ));
            }
        }
    }
    for (key, size) in mini_batches {
        match size {
            Some(0) => return invalid(format!("{key} must be at least 1")),
            // As verl: mini-batches count prompts, so one cannot exceed the batch.
            Some(size) if size > data.train_batch_size => {
                return invalid(format!(
                    "{key}={size} exceeds data.train_batch_size={} (both count prompts)",
                    data.train_batch_size
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Writes a probe file in `dir` (created if missing), so an output location that cannot be
/// written fails before step 1 instead of at the first checkpoint or the final export. The probe
/// has no name (`O_TMPFILE` on Linux; elsewhere it is unlinked as soon as it is created): the same
/// permission check as a named file, and nothing left behind when the run is killed meanwhile.
fn probe_writable(dir: &Path, what: &str) -> Result<(), TrainError> {
    use std::io::Write;
    let unwritable = |error: std::io::Error| TrainError::Output {
        path: dir.to_path_buf(),
        what: what.to_owned(),
        error,
    };
    std::fs::create_dir_all(dir).map_err(unwritable)?;
    tempfile::tempfile_in(dir)
        .and_then(|mut probe| probe.write_all(b"probe"))
        .map_err(unwritable)
}

/// Every place the run writes to: checkpoints and the run's files (`trainer.default_local_dir`),
/// the final export (`<default_local_dir>/huggingface`) and the `file` logger's path.
fn check_outputs(config: &Config, run_dir: &Path) -> Result<(), TrainError> {
    probe_writable(run_dir, "trainer.default_local_dir (checkpoints)")?;
    let export = run_dir.join("huggingface");
    if export.exists() {
        if !export.is_dir() {
            return Err(TrainError::Output {
                path: export,
                what: "the final export".to_owned(),
                error: std::io::Error::other("exists and is not a directory"),
            });
        }
        probe_writable(&export, "the final export")?;
    }
    if config.trainer.logger.iter().any(|l| l == "file")
        && let Some(path) =
            std::env::var_os(crate::builtin::FILE_LOGGER_PATH_ENV).filter(|p| !p.is_empty())
        && let Some(dir) = Path::new(&path)
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
    {
        probe_writable(dir, crate::builtin::FILE_LOGGER_PATH_ENV)?;
    }
    Ok(())
}

/// The init record of `component`, with the path and key origins of its plugin-owned section (if
/// it declares one) so the plugin's own checks name where a bad key came from.
pub fn plugin_init(
    config: &Config,
    slot: Slot,
    component: &Component,
    value: Value,
    run: &RunContext,
) -> ComponentInit {
    let mut init = ComponentInit::new(value, run.clone());
    if let Some(name) = &component.config_section {
        let section = config.plugin_section(slot, name);
        init.section_path = section.path;
        init.config_origins = section.origins;
    }
    init
}

/// The components a run uses, resolved by name before any is created.
struct Components {
    actor: Component,
    reference: Option<Component>,
    critic: Option<Component>,
    teacher: Option<Component>,
    rollout: Component,
    weight_sync: Component,
}

impl Components {
    /// Engines by strategy on `device_type` (the selected platform's), the rest by name.
    fn resolve(
        config: &Config,
        registry: &Registry,
        device_type: &str,
    ) -> Result<Self, TrainError> {
        let engine = |role: EngineRole| {
            registry
                .resolve_engine(config.engine_strategy(role), device_type)
                .map_err(|source| TrainError::Engine {
                    key: config.strategy_key(role),
                    source,
                })
        };
        let rollout = &config.actor_rollout_ref.rollout;
        Ok(Self {
            actor: engine(EngineRole::Actor)?,
            reference: config
                .ref_enabled()
                .then(|| engine(EngineRole::Ref))
                .transpose()?,
            critic: config
                .critic_enabled()
                .then(|| engine(EngineRole::Critic))
                .transpose()?,
            teacher: config
                .teacher_enabled()
                .then(|| engine(EngineRole::Teacher))
                .transpose()?,
            rollout: registry.resolve(ComponentKind::ROLLOUT, &rollout.name)?,
            weight_sync: registry.resolve(
                ComponentKind::CHECKPOINT,
                &rollout.checkpoint_engine.backend,
            )?,
        })
    }

    /// Checks the run against what each component declares it can do, before any is created:
    /// a mismatch names the component, the capability and the config key that asks for it.
    fn check(&self, config: &Config, run: &RunContext) -> Result<(), TrainError> {
        self.check_engines(config, run)?;
        self.check_rollout(config, run)?;
        check_algorithm(config, run.world_size)
    }

    /// Each engine can hold its role on this run's ranks and device.
    fn check_engines(&self, config: &Config, run: &RunContext) -> Result<(), TrainError> {
        let roles = [
            (EngineRole::Actor, Some(&self.actor)),
            (EngineRole::Ref, self.reference.as_ref()),
            (EngineRole::Critic, self.critic.as_ref()),
            (EngineRole::Teacher, self.teacher.as_ref()),
        ];
        for (role, component) in roles {
            let Some(component) = component else { continue };
            let caps: EngineCapabilities = component.capabilities();
            let name = &component.name;
            let key = config.strategy_key(role);
            if !caps.supports_role(role.as_str()) {
                return Err(TrainError::Capability(format!(
                    "engine `{name}` ({key}) cannot hold the {} role; it declares roles [{}]",
                    role.as_str(),
                    caps.roles.join(", ")
                )));
            }
            if run.world_size > caps.max_world_size {
                return Err(TrainError::Capability(format!(
                    "engine `{name}` ({key}) runs on at most {} rank(s), but this run has WORLD_SIZE={}",
                    caps.max_world_size, run.world_size
                )));
            }
            if role == EngineRole::Actor && run.world_size > 1 && !caps.object_exchange {
                return Err(TrainError::Capability(format!(
                    "engine `{name}` ({key}) has no object exchange (all_gather_object, plugin API 2.1), \
                     which the trainer's ranks share scores, metrics and checkpoints through; this run has WORLD_SIZE={}",
                    run.world_size
                )));
            }
            if !caps.supports_device(&run.device_type) {
                return Err(TrainError::Capability(format!(
                    "engine `{name}` ({key}) does not run on `{}` devices (trainer.device / the selected platform); it supports [{}]",
                    run.device_type,
                    caps.devices.join(", ")
                )));
            }
        }
        Ok(())
    }

    /// The rollout takes the weight sync's handover and returns what the config asks of it.
    fn check_rollout(&self, config: &Config, run: &RunContext) -> Result<(), TrainError> {
        let rollout_caps: RolloutCapabilities = self.rollout.capabilities();
        let handover = self
            .weight_sync
            .capabilities::<verl_plugin_api::CheckpointCapabilities>()
            .handover;
        if !rollout_caps.accepts(handover) {
            let accepted: Vec<&str> = rollout_caps
                .weight_sources
                .iter()
                .map(|k| k.as_str())
                .collect();
            return Err(TrainError::Capability(format!(
                "rollout `{}` (actor_rollout_ref.rollout.name) cannot take weights from {}, which weight sync `{}` \
                 (actor_rollout_ref.rollout.checkpoint_engine.backend) hands over; it accepts [{}]",
                self.rollout.name,
                handover.as_str(),
                self.weight_sync.name,
                accepted.join(", ")
            )));
        }
        let settings = &config.actor_rollout_ref.rollout;
        if run.world_size > 1 && !rollout_caps.prompt_seeds {
            tracing::warn!(
                "rollout `{}` does not seed each prompt on its own: with {} ranks the samples differ from a one-rank run's (training is still correct)",
                self.rollout.name,
                run.world_size
            );
        }
        if settings.enable_rollout_routing_replay && !rollout_caps.routed_experts {
            return Err(TrainError::Capability(format!(
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=true, but rollout `{}` cannot return each token's experts (routed_experts)",
                self.rollout.name
            )));
        }
        if config.actor_rollout_ref.actor.router_replay.mode == RouterReplayMode::R3
            && !settings.enable_rollout_routing_replay
        {
            return Err(TrainError::Capability(
                "actor_rollout_ref.actor.router_replay.mode=R3 replays the rollout's experts: set actor_rollout_ref.rollout.enable_rollout_routing_replay=true".to_owned(),
            ));
        }
        if settings.calculate_log_probs && !rollout_caps.logprobs {
            return Err(TrainError::Capability(format!(
                "actor_rollout_ref.rollout.calculate_log_probs=true, but rollout `{}` does not return log-probs",
                self.rollout.name
            )));
        }
        if settings.free_cache_engine && !rollout_caps.sleep_wake {
            tracing::info!(
                "actor_rollout_ref.rollout.free_cache_engine: rollout `{}` has no sleep/wake-up; it keeps no cache between generate calls",
                self.rollout.name
            );
        }
        Ok(())
    }
}

/// The training mode and the algorithm's settings go together, as verl asserts.
fn check_algorithm(config: &Config, world_size: u32) -> Result<(), TrainError> {
    let settings = &config.actor_rollout_ref.rollout;
    let mode = config.trainer.training_mode;
    if mode != TrainingMode::Sync {
        // The next batch is generated on a thread of its own, by this process's rollout in
        // one request: the rank exchange, DAPO's extra rounds and ReMax's greedy rollouts
        // (which need the rollout during the update) are not done there.
        let refused = if world_size > 1 {
            Some(format!("{world_size} ranks (one rank only)"))
        } else if config.algorithm.filter_groups.enable {
            Some("algorithm.filter_groups.enable=true".to_owned())
        } else if config.algorithm.adv_estimator.needs_greedy_baseline() {
            Some("algorithm.adv_estimator=remax (its greedy baseline needs the rollout during the update)".to_owned())
        } else {
            None
        };
        if let Some(what) = refused {
            return Err(TrainError::Invalid(format!(
                "trainer.training_mode={} does not support {what}",
                mode.as_str()
            )));
        }
    }
    let algorithm = &config.algorithm;
    match (algorithm.adv_estimator, &algorithm.gdpo_reward_keys) {
        (AdvEstimator::Gdpo, None) => {
            return Err(TrainError::Invalid(
                "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the keys of the reward's \
                 result dict to normalise one by one (as verl asserts)"
                    .to_owned(),
            ));
        }
        (AdvEstimator::Gdpo, Some(keys)) => {
            if keys.is_empty() {
                return Err(TrainError::Invalid(
                    "algorithm.gdpo_reward_keys is empty: name at least one key of the reward's result dict"
                        .to_owned(),
                ));
            }
            if let Some(weights) = &algorithm.gdpo_reward_weights
                && weights.len() != keys.len()
            {
                return Err(TrainError::Invalid(format!(
                    "algorithm.gdpo_reward_weights has {} weights for {} algorithm.gdpo_reward_keys",
                    weights.len(),
                    keys.len()
                )));
            }
        }
        (_, Some(_)) => tracing::warn!(
            "algorithm.gdpo_reward_keys: only algorithm.adv_estimator=gdpo reads them (it is {})",
            algorithm.adv_estimator.name()
        ),
        (_, None) => {}
    }
    let wants_sum_pi_squared = config.actor_rollout_ref.actor.calculate_sum_pi_squared;
    if algorithm.adv_estimator.needs_sum_pi_squared() && !wants_sum_pi_squared {
        return Err(TrainError::Invalid(format!(
            "algorithm.adv_estimator={} needs Σπ² per token from the actor: set \
             actor_rollout_ref.actor.calculate_sum_pi_squared=True (as verl asks)",
            algorithm.adv_estimator.name()
        )));
    }
    if wants_sum_pi_squared
        && fully_async::old_log_probs_from_rollout(config)
        && !algorithm.adv_estimator.needs_sum_pi_squared()
    {
        tracing::warn!(
            "actor_rollout_ref.actor.calculate_sum_pi_squared=True: the actor's log-prob pass, which computes \
             Σπ², is skipped (the rollout's log-probs are the old policy's), so no variance_proxy/* metrics \
             are logged"
        );
    }
    if algorithm.adv_estimator.needs_sum_pi_squared() && algorithm.rollout_correction.bypass_mode {
        // Bypass mode skips the actor's log-prob pass, which is what computes Σπ².
        return Err(TrainError::Invalid(format!(
            "algorithm.adv_estimator={} needs Σπ² from the actor's log-prob pass, which \
             algorithm.rollout_correction.bypass_mode=true skips",
            algorithm.adv_estimator.name()
        )));
    }
    let correction = &config.algorithm.rollout_correction;
    let checked = correction.settings()?;
    if (checked.corrects() || correction.bypass_mode) && !settings.calculate_log_probs {
        return Err(TrainError::Invalid(
            "algorithm.rollout_correction (rollout_is, rollout_rs or bypass_mode) needs the rollout's \
             log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true"
                .to_owned(),
        ));
    }
    if correction.bypass_mode && checked.corrects() {
        // verl's bypass loss recomputes the weights and the rejection mask from the current
        // policy inside the loss, which the engines here do not do.
        return Err(TrainError::Invalid(
            "algorithm.rollout_correction.bypass_mode=true with rollout_is or rollout_rs is not \
             supported: use bypass_mode=false (decoupled mode) for importance weights and rejection"
                .to_owned(),
        ));
    }
    Ok(())
}

/// The `items` whose `keep` is set, in order.
fn keep_marked<T>(items: Vec<T>, keep: &[bool]) -> Vec<T> {
    items
        .into_iter()
        .zip(keep)
        .filter_map(|(item, &k)| k.then_some(item))
        .collect()
}

/// `items` in `order`: item `i` of the result is `items[order[i]]` (`order` a permutation).
fn permute<T>(items: Vec<T>, order: &[usize]) -> Vec<T> {
    let mut slots: Vec<Option<T>> = items.into_iter().map(Some).collect();
    order
        .iter()
        .map(|&i| slots[i].take().expect("a permutation takes each item once"))
        .collect()
}
