//! `verl-core run` end to end through the loaded plugins (fsdp engine, native rollout, built-in
//! trackers and weight sync) on the quickstart's synthetic task, shrunk to seconds.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::helpers::*;

/// Data and warmed-up model shared by every run (made once by the first run's quickstart step).
fn shared() -> &'static (tempfile::TempDir, tempfile::TempDir) {
    static SHARED: OnceLock<(tempfile::TempDir, tempfile::TempDir)> = OnceLock::new();
    SHARED.get_or_init(|| {
        let plugins = bundled_plugins(&[
            "verl_plugin_native",
            "verl_plugin_fsdp",
            "verl_plugin_trackers",
            "verl_plugin_reward_http",
        ]);
        let work = tempfile::tempdir().unwrap();
        (plugins, work)
    })
}

fn args(run_dir: &Path, steps: u64, save_freq: u64) -> Vec<String> {
    let (plugins, work) = shared();
    let mut args = vec![
        "--plugin-dir".to_string(),
        plugins.path().display().to_string(),
    ];
    args.extend(quickstart_run_args(
        work.path(),
        run_dir,
        steps,
        save_freq,
        &[
            "quickstart.task.val_size=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.logger=[file,tensorboard]",
        ],
    ));
    args
}

fn run(run_dir: &Path, steps: u64, save_freq: u64) -> Output {
    let args = args(run_dir, steps, save_freq);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = verl_core(&args, &[]);
    assert!(
        out.status.success(),
        "run failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn final_weights(run_dir: &Path) -> Vec<u8> {
    std::fs::read(run_dir.join("huggingface/model.safetensors")).unwrap()
}

/// The uninterrupted reference run: 6 steps, checkpoints at 2, 4 and 6.
pub(crate) fn reference() -> &'static PathBuf {
    static REFERENCE: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &REFERENCE
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let run_dir = dir.path().join("run");
            run(&run_dir, 6, 2);
            (dir, run_dir)
        })
        .1
}

#[test]
fn a_short_run_logs_verl_metrics_and_writes_checkpoints() {
    let run_dir = reference();
    let by_step = step_metrics(run_dir);
    assert_eq!(
        by_step.keys().copied().collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4, 5, 6]
    );
    let val_key = "val-core/verl-core/addition/reward/mean@1";
    for step in [0, 2, 4, 6] {
        assert!(
            by_step[&step][val_key].is_f64(),
            "validation at step {step}: {:?}",
            by_step[&step]
        );
    }
    for step in 1..=6 {
        let m = &by_step[&step];
        for key in [
            "critic/score/mean",
            "critic/advantages/mean",
            "actor/pg_loss",
            "actor/pg_clipfrac",
            "actor/ppo_kl",
            "actor/entropy",
            "actor/grad_norm",
            "actor/lr",
            "response_length/mean",
            "prompt_length/mean",
            "training/global_step",
        ] {
            let value = m
                .get(key)
                .and_then(Value::as_f64)
                .unwrap_or_else(|| panic!("step {step}: `{key}` missing or not finite in {m:?}"));
            assert!(value.is_finite());
        }
        assert_eq!(m["training/global_step"], step as f64);
    }
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    assert!(text.contains("\"timing_s/gen\"") && text.contains("\"perf/throughput\""));
    assert!(
        text.contains("\"timing_per_token_ms/update_actor\"")
            && text.contains("\"global_seqlen/balanced_max\"")
            && text.contains("\"response_length_non_aborted/mean\"")
    );
    // verl's engine perf metrics (the quickstart's Llama has verl's dense FLOP estimate; CPU:
    // 448 GFLOP/s, the peak RSS for the allocator peaks) and the update's loss, every step.
    let mut keys = std::collections::BTreeSet::new();
    for line in text.lines() {
        let record: Value = serde_json::from_str(line).unwrap();
        let data = record["data"].as_object().unwrap();
        keys.extend(data.keys().cloned());
        if !data.contains_key("actor/pg_loss") {
            continue; // validation before training
        }
        for key in [
            "perf/mfu/actor",
            "perf/mfu/actor_infer",
            "perf/max_memory_allocated_gb",
            "perf/max_memory_reserved_gb",
            "perf/cpu_memory_used_gb",
            "actor/loss",
        ] {
            let value = data[key].as_f64().unwrap_or(f64::NAN);
            assert!(value.is_finite(), "{key} = {value} in {line}");
            if key != "actor/loss" {
                assert!(value > 0.0, "{key} = {value} in {line}");
            }
        }
        assert!(data["perf/mfu/actor"].as_f64().unwrap() < 1.0);
    }
    eprintln!("{} keys logged: {keys:?}", keys.len());
    for step in [2, 4, 6] {
        let dir = run_dir.join(format!("global_step_{step}"));
        assert!(
            dir.join("actor").is_dir() && dir.join("trainer_state.json").is_file(),
            "{}",
            dir.display()
        );
    }
    assert_eq!(
        std::fs::read_to_string(run_dir.join("latest_checkpointed_iteration.txt"))
            .unwrap()
            .trim(),
        "6"
    );
    assert!(run_dir.join("huggingface/config.json").is_file());
    // The tracker plugin was driven by the run too (its own tests read the files back with
    // TensorBoard).
    let events = run_dir.join("tensorboard/verl-core-quickstart/grpo-addition");
    let files: Vec<_> = std::fs::read_dir(&events)
        .unwrap_or_else(|e| panic!("{}: {e}", events.display()))
        .collect();
    assert_eq!(files.len(), 1, "one tfevents file in {}", events.display());
    assert!(files[0].as_ref().unwrap().metadata().unwrap().len() > 1000);
}

#[test]
fn a_resumed_run_matches_the_uninterrupted_one() {
    reference(); // made first: it also prepares the shared data and model
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    run(&run_dir, 2, 2);
    run(&run_dir, 6, 2);
    // Every step once (the resumed run's validation before training is not a second record of
    // step 2), and the same as without the interruption.
    let (ours, theirs) = (step_metrics(&run_dir), step_metrics(reference()));
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>()
    );
    for step in 0..=6 {
        let differing: Vec<&String> = ours[&step]
            .keys()
            .chain(theirs[&step].keys())
            .filter(|k| ours[&step].get(*k) != theirs[&step].get(*k))
            .collect();
        assert!(
            differing.is_empty(),
            "step {step} differs after resume in {differing:?}:\n{:?}\n{:?}",
            ours[&step],
            theirs[&step]
        );
    }
    assert!(
        final_weights(&run_dir) == final_weights(reference()),
        "final weights differ after resume"
    );
}

/// One `verl-core run` of the kill harness; its stderr is read on a thread.
struct Attempt {
    child: std::process::Child,
    stderr: std::sync::mpsc::Receiver<String>,
}

impl Attempt {
    /// Starts the run; `pause_at` sets the test-only `VERL_TEST_PAUSE_AT`, which stops the run at
    /// that point until it is killed.
    fn start(args: &[String], pause_at: Option<&str>) -> Self {
        use std::io::BufRead;
        let mut cmd = std::process::Command::new(&release().binary);
        cmd.args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("VERL_PLUGIN_DEFAULT_DIR", "")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        if let Some(point) = pause_at {
            cmd.env("VERL_TEST_PAUSE_AT", point);
        }
        let mut child = cmd.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, stderr: rx }
    }

    /// Waits until the run says it paused at `point`.
    fn wait_for_pause(&mut self, point: &str) {
        let marker = format!("VERL_TEST_PAUSE_AT: paused at {point}");
        let deadline = Instant::now() + Duration::from_secs(300);
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stderr.recv_timeout(left) {
                Ok(line) if line == marker => return,
                Ok(line) => seen.push(line),
                Err(e) => panic!(
                    "the run never paused at {point} ({e}; {:?}):\n{}",
                    self.child.try_wait(),
                    seen.join("\n")
                ),
            }
        }
    }

    /// SIGKILL; whether it landed (false: the run had already finished, successfully).
    fn kill(mut self) -> bool {
        use std::os::unix::process::ExitStatusExt;
        let _ = self.child.kill();
        let status = self.child.wait().unwrap();
        if status.signal() == Some(9) {
            return true;
        }
        let stderr: Vec<String> = self.stderr.try_iter().collect();
        assert!(
            status.success(),
            "the run failed ({status}):\n{}",
            stderr.join("\n")
        );
        false
    }

    fn finish(self) {
        let status = self.child.wait_with_output().unwrap().status;
        let stderr: Vec<String> = self.stderr.try_iter().collect();
        assert!(
            status.success(),
            "the run failed ({status}):\n{}",
            stderr.join("\n")
        );
    }
}

/// A small deterministic generator (xorshift64*): the kill delays are reproducible from the seed.
struct Rng(u64);

impl Rng {
    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn latest_checkpoint(run_dir: &Path) -> u64 {
    std::fs::read_to_string(run_dir.join("latest_checkpointed_iteration.txt"))
        .map_or(0, |s| s.trim().parse().unwrap())
}

/// The run equals the uninterrupted one (every step's record once, in order, the same values;
/// the final weights bit for bit), and nothing is left over from the killed attempts.
fn assert_like_the_reference(run_dir: &Path) {
    assert_eq!(step_metrics(run_dir), step_metrics(reference()));
    assert!(
        final_weights(run_dir) == final_weights(reference()),
        "final weights differ"
    );
    let hidden: Vec<String> = std::fs::read_dir(run_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with('.'))
        .collect();
    assert!(hidden.is_empty(), "left over: {hidden:?}");
}

/// The kill harness: runs of 6 steps with a checkpoint per step, SIGKILLed at seeded random
/// moments and at the exact points where a record or the export could be lost or doubled, each
/// time resumed with `resume_mode=auto`. Every step's record ends up in the metrics file exactly
/// once and equal to an uninterrupted run's, the final weights bit-identical, nothing left over.
/// `VERL_KILL_HARNESS_SEED` picks another seed.
#[test]
fn killed_anywhere_a_run_resumes_with_every_step_recorded_once() {
    reference(); // first: it also makes the shared data and model
    let started = Instant::now();
    // Placed kills: between a checkpoint's commit and its record's log (twice), after the final
    // export was written aside, and, on a finished run exporting again, while the previous export
    // is set aside. Returns how long the run took to get there.
    let kill_at = |args: &[String], point: &str| -> Duration {
        let t = Instant::now();
        let mut attempt = Attempt::start(args, Some(point));
        attempt.wait_for_pause(point);
        let elapsed = t.elapsed();
        assert!(attempt.kill(), "{point}");
        elapsed
    };
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let placed_args = args(&run_dir, 6, 1);
    // From scratch to step 2, then from step 2 to step 5: about one whole run, start-ups included.
    let full = kill_at(&placed_args, "committed:2") + kill_at(&placed_args, "committed:5");
    // Step 5's record is in its checkpoint only.
    let logged = step_metrics(&run_dir);
    assert!(
        logged.contains_key(&4) && !logged.contains_key(&5),
        "{logged:?}"
    );
    kill_at(&placed_args, "exported");
    assert!(run_dir.join(".huggingface.partial").exists() && !run_dir.join("huggingface").exists());
    Attempt::start(&placed_args, None).finish();
    assert_like_the_reference(&run_dir);
    kill_at(&placed_args, "swapping");
    assert!(!run_dir.join("huggingface").exists() && run_dir.join(".huggingface.old").exists());
    Attempt::start(&placed_args, None).finish();
    assert_like_the_reference(&run_dir);

    // Random kills, each at a delay drawn over the first 60% of an uninterrupted run's duration
    // (the rest would mostly find a resumed attempt finished). A round
    // resumes its run after every kill until an attempt finishes first; the run is then checked
    // and the next round starts from scratch, until 10 kills have landed.
    let kills = random_kills(
        |run_dir| args(run_dir, 6, 1),
        full.mul_f64(0.6),
        0x5eed_0fc0_ffee,
        |_, run_dir| assert_like_the_reference(run_dir),
    );
    eprintln!(
        "kill harness: {} kills in {:.1} s",
        kills + 4,
        started.elapsed().as_secs_f64()
    );
}

/// Rounds of seeded random kills: a round starts a run from scratch and SIGKILLs it after a
/// delay drawn over `spread`, resuming it (`resume_mode=auto`) after every kill until an attempt
/// finishes first; `check(round, run_dir)` then judges the run. Rounds go on until 10 kills have
/// landed, at 3 or more points of training (the latest checkpoint when killed). Returns how many
/// landed. `VERL_KILL_HARNESS_SEED` picks another seed than `seed`.
fn random_kills(
    args: impl Fn(&Path) -> Vec<String>,
    spread: Duration,
    seed: u64,
    check: impl Fn(usize, &Path),
) -> usize {
    let seed = std::env::var("VERL_KILL_HARNESS_SEED")
        .map_or(seed, |s| s.parse().expect("VERL_KILL_HARNESS_SEED: a u64"));
    let mut rng = Rng(seed.max(1));
    // (round, delay, latest checkpoint when killed)
    let mut kills = Vec::new();
    for round in 0.. {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        let round_args = args(&run_dir);
        loop {
            let delay = spread.mul_f64(rng.next_f64());
            let attempt = Attempt::start(&round_args, None);
            std::thread::sleep(delay);
            if !attempt.kill() {
                break;
            }
            kills.push((round, delay, latest_checkpoint(&run_dir)));
        }
        check(round, &run_dir);
        if kills.len() >= 10 {
            break;
        }
    }
    eprintln!("seed {seed:#x}: kills (round, delay, latest checkpoint): {kills:?}");
    let progress: std::collections::BTreeSet<u64> = kills.iter().map(|k| k.2).collect();
    assert!(
        progress.len() >= 3,
        "the kills landed at too few points of training to prove anything: {kills:?}"
    );
    kills.len()
}

/// `trainer.training_mode=one_step_off` runs of 6 steps with a checkpoint per step and
/// `trainer.rollout_data_dir` (one file per trained step: the step's samples with their prompt
/// indices).
fn one_step_off_args(run_dir: &Path) -> Vec<String> {
    let mut args = args(run_dir, 6, 1);
    args.push("trainer.training_mode=one_step_off".to_owned());
    // Rollout correction on the lagging samples: IS weights reach the fsdp engine's loss.
    args.push("actor_rollout_ref.rollout.calculate_log_probs=true".to_owned());
    args.push("algorithm.rollout_correction.rollout_is=token".to_owned());
    args.push(format!(
        "trainer.rollout_data_dir={}",
        run_dir.join("rollouts").display()
    ));
    args
}

/// The prompt indices a run trained on (a multiset, sorted), and every dumped line by step.
fn consumed(run_dir: &Path) -> (Vec<u64>, std::collections::BTreeMap<String, String>) {
    let mut indices = Vec::new();
    let mut files = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(run_dir.join("rollouts")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for line in text.lines() {
            let sample: Value = serde_json::from_str(line).unwrap();
            indices.push(sample["index"].as_u64().unwrap());
        }
        files.insert(
            path.file_name().unwrap().to_string_lossy().into_owned(),
            text,
        );
    }
    indices.sort_unstable();
    (indices, files)
}

/// The check of a killed-and-resumed run against the uninterrupted `whole` one: the same multiset
/// of consumed prompt indices, every dumped sample line, every record, and the final weights bit
/// for bit.
fn trains_like(whole: &Path) -> impl Fn(usize, &Path) + '_ {
    let (whole_indices, whole_files) = consumed(whole);
    move |round, run_dir| {
        let (indices, files) = consumed(run_dir);
        assert_eq!(
            indices, whole_indices,
            "round {round}: prompts skipped or repeated"
        );
        assert!(
            files == whole_files,
            "round {round}: other samples than the uninterrupted run's"
        );
        assert_eq!(step_metrics(run_dir), step_metrics(whole), "round {round}");
        assert!(
            final_weights(run_dir) == final_weights(whole),
            "round {round}: final weights differ"
        );
    }
}

/// Exact resume of a one-step-off run under the kill harness: SIGKILLed at seeded random moments
/// (at least 10 kills), each time resumed with `resume_mode=auto`, a run trains on the multiset
/// of prompt indices an uninterrupted one-step-off run trains on — in fact on the same samples,
/// step by step, since a checkpoint carries the batch generated ahead — and ends with its records
/// and its final weights, bit for bit.
#[test]
fn killed_anywhere_a_one_step_off_run_trains_on_every_prompt_once() {
    reference(); // makes the shared data and model
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole");
    let started = Instant::now();
    Attempt::start(&one_step_off_args(&whole), None).finish();
    let full = started.elapsed();
    let (whole_indices, whole_files) = consumed(&whole);
    // 6 steps × 8 prompts × n = 4.
    assert_eq!(whole_indices.len(), 6 * 8 * 4);
    assert_eq!(whole_files.len(), 6);
    let by_step = step_metrics(&whole);
    assert_eq!(by_step[&1]["training/staleness_mean"], 0.0);
    assert_eq!(by_step[&2]["training/staleness_mean"], 1.0);
    assert!(by_step[&2].contains_key("rollout_corr/rollout_is_mean"));

    let kills = random_kills(
        one_step_off_args,
        full.mul_f64(0.8),
        0x0ff_5eed,
        trains_like(&whole),
    );
    eprintln!(
        "one-step-off kill harness: {} kills in {:.1} s (uninterrupted run {:.1} s)",
        kills,
        started.elapsed().as_secs_f64(),
        full.as_secs_f64()
    );
}

/// `trainer.training_mode=fully_async` runs of 6 steps with a checkpoint per step, in verl's
/// layout (`data.train_batch_size=0`; a step trains on ppo_mini_batch_size 4 × require_batches 2
/// prompts), weights published every 2 steps, a staleness threshold of 0.5 (3 batches per
/// version), old log-probs recomputed and the lagging samples corrected by token IS weights.
fn fully_async_args(run_dir: &Path) -> Vec<String> {
    let mut args = args(run_dir, 6, 1);
    args.extend(
        [
            "trainer.training_mode=fully_async",
            "data.train_batch_size=0",
            "async_training.require_batches=2",
            "async_training.trigger_parameter_sync_step=2",
            "async_training.staleness_threshold=0.5",
            "async_training.use_rollout_log_probs=false",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "algorithm.rollout_correction.rollout_is=token",
        ]
        .map(str::to_owned),
    );
    args.push(format!(
        "trainer.rollout_data_dir={}",
        run_dir.join("rollouts").display()
    ));
    args
}

/// Exact resume of a fully-async run under the kill harness: SIGKILLed at seeded random moments
/// (at least 10 kills), each time resumed with `resume_mode=auto`, a run trains on the multiset of
/// prompt indices an uninterrupted fully-async run trains on — the same samples, step by step,
/// since a checkpoint carries every batch generated ahead and the schedule fixes each batch's
/// weight version — and ends with its records (timings and queue sizes aside) and its final
/// weights, bit for bit.
#[test]
fn killed_anywhere_a_fully_async_run_trains_on_every_prompt_once() {
    reference(); // makes the shared data and model
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole");
    let started = Instant::now();
    Attempt::start(&fully_async_args(&whole), None).finish();
    let full = started.elapsed();
    let (whole_indices, whole_files) = consumed(&whole);
    // 6 steps × 8 prompts × n = 4.
    assert_eq!(whole_indices.len(), 6 * 8 * 4);
    assert_eq!(whole_files.len(), 6);
    let by_step = step_metrics(&whole);
    // Batches 1–3 by the initial weights, 4–5 by step 2's, 6 by step 4's.
    let staleness: Vec<f64> = (1..=6)
        .map(|step| by_step[&step]["training/staleness_mean"].as_f64().unwrap())
        .collect();
    assert_eq!(staleness, [0.0, 1.0, 2.0, 1.0, 2.0, 1.0]);
    assert!(by_step[&3].contains_key("rollout_corr/rollout_is_mean"));
    assert_eq!(
        by_step[&6]["fully_async/count/current_param_version"].as_f64(),
        Some(2.0)
    );

    let kills = random_kills(
        fully_async_args,
        full.mul_f64(0.8),
        0xfa57_5eed,
        trains_like(&whole),
    );
    eprintln!(
        "fully-async kill harness: {} kills in {:.1} s (uninterrupted run {:.1} s)",
        kills,
        started.elapsed().as_secs_f64(),
        full.as_secs_f64()
    );
}

/// Data and a model that exist outside the quickstart's directory are used as given: nothing is
/// generated, written over or warmed up, and the quickstart's own directory stays unmade.
#[test]
fn the_quickstart_uses_existing_paths_elsewhere_as_given() {
    reference();
    let (_, work) = shared();
    let files = [
        "data/train.parquet",
        "data/test.parquet",
        "model-sft/model.safetensors",
    ];
    let snapshot = || {
        files.map(|f| {
            let path = work.path().join(f);
            let meta = std::fs::metadata(&path).unwrap();
            (std::fs::read(&path).unwrap(), meta.modified().unwrap())
        })
    };
    let before = snapshot();
    let elsewhere = tempfile::tempdir().unwrap();
    let own = elsewhere.path().join("quickstart");
    let mut args = args(&elsewhere.path().join("run"), 1, 1);
    args.push(format!("quickstart.dir={}", own.display()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = verl_core(&args, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        !stderr.contains("quickstart: wrote") && !stderr.contains("sft:"),
        "{stderr}"
    );
    assert!(snapshot() == before, "the data or model changed");
    assert!(!own.exists());
}

#[test]
fn every_example_config_is_valid() {
    let examples = workspace_root().join("examples");
    let mut checked = 0;
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let out = verl_core(
                &[
                    "config",
                    "show",
                    "--json",
                    "--config",
                    path.to_str().unwrap(),
                ],
                &[],
            );
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(stdout_json(&out)["trainer"]["project_name"].is_string());
            checked += 1;
        }
    }
    assert!(
        checked >= 3,
        "examples/quickstart.yaml, gsm8k_grpo.yaml and ppo_gae.yaml at least"
    );
}

/// Runs with `extra` overrides appended; returns the output whatever the exit status.
pub(crate) fn run_with(run_dir: &Path, steps: u64, save_freq: u64, extra: &[&str]) -> Output {
    let mut args = args(run_dir, steps, save_freq);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    verl_core(&args, &[])
}

pub(crate) fn assert_no_panic(out: &Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("panicked") && !stderr.contains("stack backtrace"),
        "{stderr}"
    );
}

fn latest(run_dir: &Path) -> String {
    std::fs::read_to_string(run_dir.join("latest_checkpointed_iteration.txt"))
        .unwrap()
        .trim()
        .to_owned()
}

/// An entropy bonus of 1e300 is infinite in the f32 loss: from step 3 on every gradient is NaN.
const NON_FINITE_FROM_HERE: &str = "actor_rollout_ref.actor.entropy_coeff=1e300";

#[test]
fn a_non_finite_step_stops_the_run_and_keeps_the_last_checkpoint() {
    reference(); // the shared data and model
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    run(&run_dir, 2, 1);
    let export = final_weights(&run_dir);

    let out = run_with(&run_dir, 4, 1, &[NON_FINITE_FROM_HERE]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_no_panic(&out);
    let kept = run_dir.join("global_step_2");
    for part in [
        "step 3: actor/grad_norm is ",
        "nothing of step 3 was saved or exported",
        &format!("{} stays the latest checkpoint", kept.display()),
        "trainer.nan_policy=skip",
    ] {
        assert!(stderr.contains(part), "{part:?} in {stderr}");
    }
    assert_eq!(latest(&run_dir), "2");
    assert!(!run_dir.join("global_step_3").exists());
    assert!(
        final_weights(&run_dir) == export,
        "the export is the one of the good run"
    );
    assert!(
        !step_metrics(&run_dir).contains_key(&3),
        "step 3 was logged"
    );

    // trainer.nan_policy=skip: steps 3 and 4 leave the weights as step 2 left them.
    let out = run_with(
        &run_dir,
        4,
        1,
        &[NON_FINITE_FROM_HERE, "trainer.nan_policy=skip"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    for step in [3, 4] {
        assert!(
            stderr.contains(&format!("step {step}: actor/grad_norm is "))
                && stderr.contains("the actor update was not applied (trainer.nan_policy=skip)"),
            "{stderr}"
        );
    }
    let by_step = step_metrics(&run_dir);
    assert_eq!(by_step[&4]["training/skipped_steps"], 2.0);
    assert_eq!(
        by_step[&4]["actor/skipped_updates"], 2.0,
        "two mini-batches"
    );
    assert_eq!(by_step[&2]["actor/skipped_updates"], 0.0);
    assert!(
        final_weights(&run_dir) == std::fs::read(kept.join("actor/model.safetensors")).unwrap(),
        "skipped steps changed the weights"
    );
}

/// Flips one bit in the middle of `path`.
fn flip_byte(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_corrupt_checkpoint_is_refused_by_resume_path_and_passed_over_by_auto() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    copy_dir(reference(), &run_dir);
    let latest_dir = run_dir.join("global_step_6");
    flip_byte(&latest_dir.join("actor/model.safetensors"));

    let out = run_with(
        &run_dir,
        6,
        2,
        &[
            "trainer.resume_mode=resume_path",
            &format!("trainer.resume_from_path={}", latest_dir.display()),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_no_panic(&out);
    assert!(
        stderr.contains(&format!("checkpoint {} is corrupt", latest_dir.display()))
            && stderr.contains("actor/model.safetensors: sha256"),
        "{stderr}"
    );

    // auto: step 6 is passed over, the run resumes from step 4 and ends where the reference did.
    let out = run(&run_dir, 6, 2);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("actor/model.safetensors: sha256")
            && stderr.contains(&format!(
                "resuming from step 4 ({}), the newest intact checkpoint",
                run_dir.join("global_step_4").display()
            )),
        "{stderr}"
    );
    assert_eq!(step_metrics(&run_dir)[&6], step_metrics(reference())[&6]);
    assert!(
        final_weights(&run_dir) == final_weights(reference()),
        "final weights differ after falling back"
    );
    assert_eq!(latest(&run_dir), "6");
    let model =
        |run: &Path| std::fs::read(run.join("global_step_6/actor/model.safetensors")).unwrap();
    assert!(
        model(&run_dir) == model(reference()),
        "the corrupt step 6 is replaced by a good one"
    );
}
