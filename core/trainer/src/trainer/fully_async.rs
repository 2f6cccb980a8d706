//! `trainer.training_mode=fully_async`: verl's fully-async policy
//! (`verl/experimental/fully_async_policy`), with a schedule the trainer decides.
//!
//! A rollouter thread owns the rollout and the reward ([`Generation`]) and generates training
//! batches ahead of the trainer, which takes them from a queue, trains, and publishes its weights
//! every `async_training.trigger_parameter_sync_step` (T) steps. verl bounds how far generation
//! runs ahead by pausing the rollouter once it has generated `max_required_samples =
//! required_samples × (staleness_threshold + 1) × T` prompts since the last publication; here the
//! same bound is counted in whole batches, K = max_required_samples / required_samples, so the
//! rollouter generates batch b (trained at step b+1) with the weights of version
//! v(b) = ⌈(b + 1 − K) / T⌉ (0 at the start), the oldest version the bound allows.
//!
//! verl lets timing decide the version of a sample; here it is decided by the schedule, so a run
//! is reproducible and a resumed run equals an uninterrupted one, weights included. The cost: at a
//! publication the trainer waits for the batches still due with the old weights (the rollouter
//! never runs behind the schedule). No sample is older than the bound allows, so none is dropped;
//! lagging samples are corrected by `algorithm.rollout_correction` (with
//! `async_training.use_rollout_log_probs=false`).
//!
//! Exact resume: a checkpoint waits for the rollouter to finish the batches the current version
//! allows and carries every generated batch not trained on yet; the loader state saved is the one
//! after the last batch drawn. A resumed run trains on the carried batches, then generates the
//! next ones from the same prompts, seeds (which follow the batch's step and the prompt's position
//! in it, never the rollouter's progress) and weight versions.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use verl_plugin_api::{Metric, SamplingParams};

use super::{Collected, Generation, TrainError, Trained, Trainer};
use verl_config::{Config, TrainingMode};

/// Which weight version generates each batch, and when weights are published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Schedule {
    /// `trigger_parameter_sync_step`: steps between two publications.
    pub trigger: u64,
    /// Batches the rollouter may generate per published version (verl's
    /// `max_required_samples / required_samples`, rounded down).
    pub per_version: u64,
    /// Prompts a step trains on: `ppo_mini_batch_size × require_batches`.
    pub required_samples: usize,
    /// verl's `max_required_samples`, the bound in prompts.
    pub max_required_samples: usize,
}

impl Schedule {
    fn new(config: &Config, required_samples: usize) -> Self {
        let a = &config.async_training;
        // verl: int(required_samples × (staleness_threshold + 1) × trigger_parameter_sync_step).
        let max_required_samples = (required_samples as f64
            * (a.staleness_threshold + 1.0)
            * a.trigger_parameter_sync_step as f64) as usize;
        Self {
            trigger: a.trigger_parameter_sync_step,
            per_version: (max_required_samples / required_samples) as u64,
            required_samples,
            max_required_samples,
        }
    }

    /// The version (publications so far) that generates batch `batch` (0-based: step `batch + 1`
    /// trains on it): the oldest one whose bound allows it.
    pub fn version_of(&self, batch: u64) -> u64 {
        (batch + 1)
            .saturating_sub(self.per_version)
            .div_ceil(self.trigger)
    }

    /// The first batch that version `version` may not generate.
    pub fn end(&self, version: u64) -> u64 {
        version * self.trigger + self.per_version
    }

    /// The global step whose weights are version `version`.
    pub fn weight_step(&self, version: u64) -> u64 {
        version * self.trigger
    }

    /// Weights are published after every T-th step, and after the last (verl's final sync).
    pub fn publishes_after(&self, step: u64, total_steps: u64) -> bool {
        step.is_multiple_of(self.trigger) || step == total_steps
    }

    /// The version the trainer has published when it trains step `step`.
    pub fn current_version(&self, step: u64) -> u64 {
        (step - 1) / self.trigger
    }
}

/// Checks and completes a `fully_async` config as verl's recipe lays it out: a step trains on
/// `ppo_mini_batch_size × require_batches` prompts (verl sets `data.train_batch_size=0` and
/// `data.gen_batch_size=1`), and the rollout returns its log-probs. Returns the schedule.
pub(super) fn prepare(config: &mut Config) -> Result<Schedule, TrainError> {
    let invalid = |m: String| {
        Err(TrainError::Invalid(format!(
            "trainer.training_mode=fully_async: {m}"
        )))
    };
    let a = &config.async_training;
    if !(a.staleness_threshold.is_finite() && a.staleness_threshold >= 0.0) {
        return invalid(format!(
            "async_training.staleness_threshold={} must be a number ≥ 0",
            a.staleness_threshold
        ));
    }
    if a.trigger_parameter_sync_step == 0 {
        return invalid("async_training.trigger_parameter_sync_step must be at least 1".to_owned());
    }
    if a.require_batches == 0 {
        return invalid("async_training.require_batches must be at least 1".to_owned());
    }
    let mini = config.actor_rollout_ref.actor.ppo_mini_batch_size;
    let required = mini * a.require_batches as usize;
    let data = &mut config.data;
    if data.train_batch_size != 0 && data.train_batch_size != required {
        return invalid(format!(
            "data.train_batch_size={} must be 0 (verl's setting) or the prompts a step trains on, \
             actor_rollout_ref.actor.ppo_mini_batch_size × async_training.require_batches = {mini} × {} = {required}",
            data.train_batch_size, a.require_batches
        ));
    }
    data.train_batch_size = required;
    match data.gen_batch_size {
        // verl's rollouter takes prompts one at a time; here it generates a step's in one request.
        None | Some(1) => data.gen_batch_size = None,
        Some(other) => {
            return invalid(format!(
                "data.gen_batch_size={other}: the rollouter generates one step's prompts at a time; \
                 leave it unset or 1 (verl's setting)"
            ));
        }
    }
    if !config.actor_rollout_ref.rollout.calculate_log_probs {
        // As verl's rollouter asserts.
        return invalid(
            "the rollout's log-probs are needed: set actor_rollout_ref.rollout.calculate_log_probs=true"
                .to_owned(),
        );
    }
    let test_freq = config.trainer.test_freq;
    let trigger = a.trigger_parameter_sync_step;
    if test_freq > 0 && !(test_freq as u64).is_multiple_of(trigger) {
        // The rollout holds the published weights: validation follows a publication, as verl's
        // rollouter validates every `test_freq` versions.
        return invalid(format!(
            "trainer.test_freq={test_freq} must be a multiple of async_training.trigger_parameter_sync_step={trigger}: \
             validation runs on the weights just published"
        ));
    }
    if a.use_rollout_log_probs && config.algorithm.rollout_correction.settings()?.corrects() {
        return invalid(
            "async_training.use_rollout_log_probs=true makes the rollout's log-probs the old policy's, \
             which leaves nothing for algorithm.rollout_correction (rollout_is, rollout_rs) to correct; \
             set async_training.use_rollout_log_probs=false to recompute them and correct"
                .to_owned(),
        );
    }
    Ok(Schedule::new(config, required))
}

/// Whether the rollout's log-probs serve as the old policy's (no recomputation by the actor):
/// verl's bypass mode, or `async_training.use_rollout_log_probs` in fully-async mode.
pub(super) fn old_log_probs_from_rollout(config: &Config) -> bool {
    config.algorithm.rollout_correction.bypass_mode
        || (config.trainer.training_mode == TrainingMode::FullyAsync
            && config.async_training.use_rollout_log_probs)
}

/// A generated batch, with the seconds its scoring took.
struct Ready {
    collected: Collected,
    reward_seconds: f64,
}

/// The rollouter thread at work: it returns the rollout when it has generated its batches.
struct Running {
    thread: JoinHandle<(Generation, Result<(), TrainError>)>,
    batches: mpsc::Receiver<Ready>,
}

/// The trainer's side of the fully-async mode.
pub(super) struct Rollouter {
    schedule: Schedule,
    /// Generated batches not trained on yet, the next step's first.
    queue: VecDeque<Ready>,
    running: Option<Running>,
    /// Versions published so far.
    published: u64,
    /// Batches drawn from the loader (generated, or being generated).
    drawn: u64,
}

impl Rollouter {
    pub fn new(schedule: Schedule) -> Self {
        Self {
            schedule,
            queue: VecDeque::new(),
            running: None,
            published: 0,
            drawn: 0,
        }
    }

    /// The batches a checkpoint carries (call after [`Trainer::async_settle`]).
    pub fn queued(&self) -> Vec<Collected> {
        self.queue.iter().map(|r| r.collected.clone()).collect()
    }

    /// The state after a checkpoint of step `step` that carried `queued`.
    pub fn restore(&mut self, step: u64, queued: Vec<Collected>) {
        self.drawn = step + queued.len() as u64;
        self.published = step / self.schedule.trigger;
        self.queue = queued
            .into_iter()
            .map(|collected| Ready {
                collected,
                reward_seconds: 0.0,
            })
            .collect();
    }

    /// Batches that arrived while the trainer was busy, into the queue.
    fn drain(&mut self) {
        if let Some(running) = &self.running {
            self.queue.extend(running.batches.try_iter());
        }
    }
}

impl Trainer {
    fn rollouter(&mut self) -> &mut Rollouter {
        self.fully_async
            .as_mut()
            .expect("fully_async mode has a rollouter")
    }

    /// Starts the rollouter on the batches the published version allows that are not drawn yet
    /// (none once it reached the bound: it waits for the next publication).
    fn async_start(&mut self) -> Result<(), TrainError> {
        let total = self.total_steps;
        let r = self.rollouter();
        let limit = r.schedule.end(r.published).min(total);
        if r.running.is_some() || r.drawn >= limit {
            return Ok(());
        }
        let (first, version) = (r.drawn, r.schedule.weight_step(r.published));
        debug_assert!((first..limit).all(|b| r.schedule.version_of(b) == r.published));
        let jobs: Vec<(Vec<usize>, SamplingParams)> = (first..limit)
            .map(|b| (self.next_indices(), self.sampling(b + 1, false)))
            .collect();
        let r = self.rollouter();
        r.drawn = limit;
        let mut generation = self
            .generation
            .take()
            .expect("generation is back between the rollouter's runs");
        let data = Arc::clone(&self.train);
        let gdpo_keys = self.gdpo_keys().to_vec();
        let (sender, batches) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("rollouter".to_owned())
            .spawn(move || {
                for (indices, sampling) in jobs {
                    generation.reward_seconds = 0.0;
                    match generation.generate(&data, &indices, 0, sampling, 0, version) {
                        Ok((rows, rewards)) => {
                            let components = match rewards.components(&gdpo_keys) {
                                Ok(components) => components,
                                Err(e) => return (generation, Err(e.into())),
                            };
                            let ready = Ready {
                                collected: Collected::new(rows, &rewards.rewards, &components, 1),
                                reward_seconds: std::mem::take(&mut generation.reward_seconds),
                            };
                            // The trainer stopped (it failed): nothing more to generate for.
                            if sender.send(ready).is_err() {
                                break;
                            }
                        }
                        Err(e) => return (generation, Err(e)),
                    }
                }
                (generation, Ok(()))
            })
            .map_err(|e| TrainError::Invalid(format!("starting the rollouter thread: {e}")))?;
        self.rollouter().running = Some(Running { thread, batches });
        Ok(())
    }

    /// Waits for the rollouter to generate its batches and takes the rollout back: before a
    /// publication, a checkpoint, and at the end. Its error, if it failed, is the run's.
    pub(super) fn async_settle(&mut self) -> Result<(), TrainError> {
        let r = self.rollouter();
        let Some(running) = r.running.take() else {
            return Ok(());
        };
        let (generation, outcome) = running
            .thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        r.queue.extend(running.batches.try_iter());
        self.generation = Some(generation);
        outcome
    }

    /// The batch step `step` trains on, with the seconds the trainer waited for it and the
    /// seconds its scoring took; verl's queue metrics go to `metrics`.
    fn async_batch(
        &mut self,
        step: u64,
        metrics: &mut Vec<Metric>,
    ) -> Result<(Collected, f64, f64), TrainError> {
        self.async_start()?;
        let started = Instant::now();
        let r = self.rollouter();
        let ready = match r.queue.pop_front() {
            Some(ready) => ready,
            None => {
                let received = r.running.as_ref().and_then(|run| run.batches.recv().ok());
                match received {
                    Some(ready) => ready,
                    None => {
                        // The rollouter ended without this batch: its error says why.
                        self.async_settle()?;
                        self.rollouter().queue.pop_front().ok_or_else(|| {
                            TrainError::Invalid(format!(
                                "fully_async: the rollouter generated no batch for step {step}"
                            ))
                        })?
                    }
                }
            }
        };
        let waited = started.elapsed().as_secs_f64();
        let staleness_threshold = self.config.async_training.staleness_threshold;
        let r = self.rollouter();
        r.drain();
        let (s, queued) = (r.schedule, r.queue.len());
        let current = s.current_version(step);
        // verl's counters of samples (prompts) and trajectories (responses) trained on that were
        // generated by an older version than the current one, from the start of the run.
        let stale_batches = (0..step)
            .filter(|&b| s.current_version(b + 1) > s.version_of(b))
            .count();
        let trajectories = ready.collected.rows.len() / s.required_samples.max(1);
        let count = |key: &str, value: f64| Metric::new(format!("fully_async/count/{key}"), value);
        metrics.extend([
            count("current_param_version", current as f64),
            count(
                "stale_samples_processed",
                (stale_batches * s.required_samples) as f64,
            ),
            count(
                "stale_trajectory_processed",
                (stale_batches * s.required_samples * trajectories) as f64,
            ),
            // The schedule keeps every sample within the bound: none is ever dropped.
            count("dropped_stale_samples", 0.0),
            Metric::new(
                "fully_async/static/required_samples",
                s.required_samples as f64,
            ),
            Metric::new(
                "fully_async/static/max_required_samples",
                s.max_required_samples as f64,
            ),
            Metric::new(
                "fully_async/static/max_queue_size",
                s.max_required_samples as f64,
            ),
            Metric::new(
                "fully_async/static/staleness_threshold",
                staleness_threshold,
            ),
            // Timing-dependent: how far the rollouter was ahead when the batch was taken.
            Metric::new(
                "fully_async/monitor/queue/mq_queue_size",
                (queued * s.required_samples) as f64,
            ),
            Metric::new("fully_async/total_wait_time", waited),
        ]);
        Ok((ready.collected, waited, ready.reward_seconds))
    }

    /// A fully-async step: the batch from the queue, the training half, and the weight
    /// publication when one is due (verl's `_trigger_parameter_sync_after_step`).
    pub(super) fn async_step(&mut self, step: u64) -> Result<Vec<Metric>, TrainError> {
        let step_start = Instant::now();
        let mut timing: Vec<(&str, f64)> = Vec::new();
        let mut metrics: Vec<Metric> = Vec::new();
        let (collected, waited, reward) = self.async_batch(step, &mut metrics)?;
        timing.push(("gen", waited));
        timing.push(("reward", reward));
        let trained: Trained = self.train_on(step, collected, false, &mut timing, &mut metrics)?;
        let schedule = self.rollouter().schedule;
        if schedule.publishes_after(step, self.total_steps) {
            let t = Instant::now();
            // The batches due with the old weights first: the rollouter never runs behind.
            self.async_settle()?;
            timing.push(("wait_last_valid", t.elapsed().as_secs_f64()));
            let t = Instant::now();
            if step > self.config.trainer.critic_warmup {
                self.sync_after_update(step)?;
            }
            self.rollouter().published = step / schedule.trigger;
            timing.push(("param_sync", t.elapsed().as_secs_f64()));
        }
        self.finish_step(step, step_start, timing, metrics, trained)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(required: usize, staleness: f64, trigger: u64) -> Schedule {
        let mut c = Config::default();
        c.async_training.staleness_threshold = staleness;
        c.async_training.trigger_parameter_sync_step = trigger;
        Schedule::new(&c, required)
    }

    /// The bound and the versions, computed by hand from verl's formula.
    #[test]
    fn the_schedule_follows_verls_bound() {
        // verl's defaults: int(4 × 1.1 × 4) = 17 prompts → 4 whole batches per version.
        let s = schedule(4, 0.1, 4);
        assert_eq!((s.max_required_samples, s.per_version), (17, 4));
        // Batches 0..3 by version 0, 4..7 by version 1: never a whole version behind.
        let versions: Vec<u64> = (0..10).map(|b| s.version_of(b)).collect();
        assert_eq!(versions, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]);
        // No staleness, one publication per step: a synchronous run.
        let sync = schedule(8, 0.0, 1);
        assert_eq!(
            (0..5).map(|b| sync.version_of(b)).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4]
        );
        // One version of staleness, one publication per step: one step off.
        let off = schedule(8, 1.0, 1);
        assert_eq!(off.per_version, 2);
        assert_eq!(
            (0..5).map(|b| off.version_of(b)).collect::<Vec<_>>(),
            [0, 0, 1, 2, 3]
        );
        // T = 2, K = int(4 × 1.5 × 2) / 4 = 3: batch 3 (step 4) by version 1 (step 2's weights).
        let s = schedule(4, 0.5, 2);
        assert_eq!(s.per_version, 3);
        let versions: Vec<u64> = (0..7).map(|b| s.version_of(b)).collect();
        assert_eq!(versions, [0, 0, 0, 1, 1, 2, 2]);
        assert_eq!((s.end(0), s.end(1), s.weight_step(1)), (3, 5, 2));
        // Every batch is within the bound of the version it was generated by, and the
        // trainer's version when it trains it is at most ⌈K/T⌉ ahead.
        for b in 0..50 {
            let v = s.version_of(b);
            assert!(b < s.end(v) && (v == 0 || b >= s.end(v - 1)), "batch {b}");
            assert!(s.current_version(b + 1) - v <= s.per_version.div_ceil(s.trigger));
        }
        assert!(s.publishes_after(4, 7) && !s.publishes_after(5, 7) && s.publishes_after(7, 7));
    }

    #[test]
    fn bad_settings_name_their_keys() {
        let check = |edit: &dyn Fn(&mut Config), wanted: &str| {
            let mut c = Config::default();
            c.trainer.training_mode = TrainingMode::FullyAsync;
            c.actor_rollout_ref.rollout.calculate_log_probs = true;
            c.actor_rollout_ref.actor.ppo_mini_batch_size = 4;
            c.data.train_batch_size = 0;
            edit(&mut c);
            let err = prepare(&mut c).unwrap_err().to_string();
            assert!(err.contains(wanted), "{err}");
        };
        check(
            &|c| c.async_training.staleness_threshold = -0.5,
            "async_training.staleness_threshold",
        );
        check(
            &|c| c.async_training.trigger_parameter_sync_step = 0,
            "trigger_parameter_sync_step",
        );
        check(
            &|c| c.async_training.require_batches = 0,
            "async_training.require_batches",
        );
        check(&|c| c.data.train_batch_size = 6, "data.train_batch_size=6");
        check(
            &|c| c.data.gen_batch_size = Some(4),
            "data.gen_batch_size=4",
        );
        check(
            &|c| c.actor_rollout_ref.rollout.calculate_log_probs = false,
            "actor_rollout_ref.rollout.calculate_log_probs=true",
        );
        check(&|c| c.trainer.test_freq = 3, "trainer.test_freq=3");
        check(
            &|c| c.algorithm.rollout_correction.rollout_is = Some(verl_algo::IsLevel::Token),
            "async_training.use_rollout_log_probs=false",
        );
        // verl's layout is completed: 4 × 2 prompts a step, gen_batch_size 1 dropped.
        let mut c = Config::default();
        c.trainer.training_mode = TrainingMode::FullyAsync;
        c.actor_rollout_ref.rollout.calculate_log_probs = true;
        c.actor_rollout_ref.actor.ppo_mini_batch_size = 4;
        c.async_training.require_batches = 2;
        c.data.train_batch_size = 0;
        c.data.gen_batch_size = Some(1);
        let s = prepare(&mut c).unwrap();
        assert_eq!((c.data.train_batch_size, c.data.gen_batch_size), (8, None));
        assert_eq!(s.required_samples, 8);
    }
}
