//! Multi-rank training through `verl-core launch`: N ranks train like one (same seed and global
//! batch: losses, grad-norms and weights within 1e-5) with the fsdp engine's sharded model
//! (ZeRO-3, verl's default `fsdp_size: -1`), its replicated one (`fsdp_size: 1`) and its CPU
//! offloading, checkpoints move between world sizes (sharded ↔ whole), and a rank killed
//! anywhere fails the job cleanly and resumes bit-identically.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::helpers::*;

/// Plugins and the warmed-up model and data, shared by every run here (made by the first).
fn shared() -> &'static (tempfile::TempDir, tempfile::TempDir) {
    static SHARED: OnceLock<(tempfile::TempDir, tempfile::TempDir)> = OnceLock::new();
    SHARED.get_or_init(|| {
        let plugins = bundled_plugins(&["verl_plugin_native", "verl_plugin_fsdp"]);
        let work = tempfile::tempdir().unwrap();
        // One single-rank step makes the data and the model once, before ranks share them.
        let dir = tempfile::tempdir().unwrap();
        let args = args(&plugins, &work, &dir.path().join("r"), 1, 1, 0);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = verl_core(&args, &[]);
        assert!(
            out.status.success(),
            "preparing: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        (plugins, work)
    })
}

/// The arguments of `[launch --nproc-per-node N --] run …`: the quickstart task shrunk to
/// seconds, one mini-batch per step (as verl, each rank's mini-batches are slices of its own
/// rows, so more would group the rows differently from one rank), sampling at temperature 1.
/// GAE with a critic, a KL loss against the reference and an entropy bonus, so that every engine
/// role computes data-parallel and the update moves the weights even before any answer is right.
fn args(
    plugins: &tempfile::TempDir,
    work: &tempfile::TempDir,
    run_dir: &Path,
    ranks: u32,
    steps: u64,
    save_freq: u64,
) -> Vec<String> {
    let mut args: Vec<String> = vec!["--plugin-dir".into(), plugins.path().display().to_string()];
    if ranks > 1 {
        args.extend(["launch", "--nproc-per-node", &ranks.to_string(), "--"].map(String::from));
    }
    let n_gpus = format!("trainer.n_gpus_per_node={ranks}");
    args.extend(quickstart_run_args(
        work.path(),
        run_dir,
        steps,
        save_freq,
        &[
            "quickstart.task.val_size=12",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "trainer.logger=[file]",
            "algorithm.adv_estimator=gae",
            "critic.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            // The parity is of the contiguous split verl makes without balancing; balancing moves
            // rows between ranks, which changes per-micro-batch metrics such as the entropy
            // (`balance_batch_moves_rows_between_ranks_not_the_update` covers it).
            "trainer.balance_batch=false",
            &n_gpus,
        ],
    ));
    args
}

fn shared_args(run_dir: &Path, ranks: u32, steps: u64, save_freq: u64) -> Vec<String> {
    let (plugins, work) = shared();
    args(plugins, work, run_dir, ranks, steps, save_freq)
}

fn run(run_dir: &Path, ranks: u32, steps: u64, save_freq: u64) {
    run_with(run_dir, ranks, steps, save_freq, &[]);
}

/// [`run`] with `extra` overrides.
fn run_with(run_dir: &Path, ranks: u32, steps: u64, save_freq: u64, extra: &[&str]) {
    let mut args = shared_args(run_dir, ranks, steps, save_freq);
    args.extend(extra.iter().map(|o| o.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = verl_core(&args, &[]);
    assert!(
        out.status.success(),
        "{ranks} rank(s) failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Each step's numeric metrics (timing and throughput left out), from rank 0's metrics file.
fn metrics(run_dir: &Path) -> BTreeMap<u64, BTreeMap<String, f64>> {
    step_metrics(run_dir)
        .into_iter()
        .map(|(step, data)| {
            let numbers = data
                .into_iter()
                .map(|(k, v)| (k, v.as_f64().unwrap_or(f64::NAN)))
                .collect();
            (step, numbers)
        })
        .collect()
}

/// The exported weights, by tensor name.
fn weights(run_dir: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(run_dir.join("huggingface/model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, values)
        })
        .collect()
}

/// Within `tol`, absolute or relative to the larger magnitude (NaN only equals NaN).
fn close(a: f64, b: f64, tol: f64) -> bool {
    (a.is_nan() && b.is_nan()) || (a - b).abs() <= tol * a.abs().max(b.abs()).max(1.0)
}

/// Every step's metrics and the final weights of `ours` within `tol` of `theirs`; the largest
/// differences are returned for the log.
fn assert_close(ours: &Path, theirs: &Path, tol: f64) -> (f64, f64) {
    let (a, b) = (metrics(ours), metrics(theirs));
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "steps"
    );
    let mut worst_metric = 0.0f64;
    for (step, ma) in &a {
        let mb = &b[step];
        assert_eq!(
            ma.keys().collect::<Vec<_>>(),
            mb.keys().collect::<Vec<_>>(),
            "metric names at step {step}"
        );
        for (key, &va) in ma {
            let vb = mb[key];
            assert!(
                close(va, vb, tol),
                "step {step} {key}: {va} vs {vb} ({} vs {})",
                ours.display(),
                theirs.display()
            );
            if va.is_finite() {
                worst_metric = worst_metric.max((va - vb).abs());
            }
        }
    }
    (worst_metric, assert_weights_close(ours, theirs, tol))
}

/// The weights of `ours` within `tol` of `theirs`; the largest difference.
fn assert_weights_close(ours: &Path, theirs: &Path, tol: f64) -> f64 {
    let (wa, wb) = (weights(ours), weights(theirs));
    assert_eq!(wa.keys().collect::<Vec<_>>(), wb.keys().collect::<Vec<_>>());
    let mut worst = 0.0f64;
    for (name, va) in &wa {
        for (x, y) in va.iter().zip(&wb[name]) {
            let d = f64::from((x - y).abs());
            assert!(d <= tol, "weight {name}: {x} vs {y}");
            worst = worst.max(d);
        }
    }
    worst
}

/// The one-rank reference: 3 GRPO steps, checkpoints at 2 and 3.
fn reference() -> &'static PathBuf {
    static REFERENCE: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &REFERENCE
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let run_dir = dir.path().join("run");
            run(&run_dir, 1, 3, 2);
            (dir, run_dir)
        })
        .1
}

/// The metrics the parity is about are there and moved: the run trained.
fn assert_trained(run_dir: &Path) {
    let m = metrics(run_dir);
    for key in [
        "actor/pg_loss",
        "critic/vf_loss",
        "actor/kl_loss",
        "critic/score/mean",
    ] {
        assert!(m[&1].contains_key(key), "{key} missing: {:?}", m[&1]);
    }
    assert!(m[&1]["actor/grad_norm"] > 0.0, "{:?}", m[&1]);
}

/// Every engine role's `fsdp_config` key set to `value`.
fn every_role(key: &str, value: &str) -> Vec<String> {
    ["actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"]
        .map(|role| format!("++{role}.fsdp_config.{key}={value}"))
        .to_vec()
}

/// verl's FSDP CPU offloading: every role's parameters, the trainable roles' optimizer state.
fn offload() -> Vec<String> {
    let mut overrides = every_role("param_offload", "true");
    overrides.extend(
        ["actor_rollout_ref.actor", "critic"]
            .map(|role| format!("++{role}.fsdp_config.optimizer_offload=true")),
    );
    overrides
}

/// The files under `prefix` in the manifest of the checkpoint at `step`.
fn manifest_files(run_dir: &Path, step: u64, prefix: &str) -> Vec<String> {
    let path = run_dir.join(format!("global_step_{step}/manifest.sha256.json"));
    let manifest: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut files: Vec<String> = manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["path"].as_str().unwrap().to_owned())
        .collect();
    files.retain(|f| f.starts_with(prefix));
    files.sort();
    files
}

/// Each of `ranks` wrote its shard of the actor's checkpoint at `step` (none wrote a whole model).
fn assert_sharded_checkpoint(run_dir: &Path, step: u64, ranks: u32) {
    let files = manifest_files(run_dir, step, "actor/");
    for rank in 0..ranks {
        let shard = format!("actor/fsdp_shard_{rank:05}_of_{ranks:05}.safetensors");
        assert!(files.contains(&shard), "{shard} not in {files:?}");
    }
    assert!(
        !files.contains(&"actor/model.safetensors".to_owned()),
        "{files:?}"
    );
}

#[test]
fn two_and_four_ranks_train_like_one() {
    let one = reference();
    assert_trained(one);
    let replicated = every_role("fsdp_size", "1");
    for (ranks, extra, what) in [
        (2, &[][..], "sharded"),
        (4, &[][..], "sharded"),
        (2, &replicated[..], "replicated"),
    ] {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        let t = Instant::now();
        run_with(&run_dir, ranks, 3, 2, &extra);
        let (metric, weight) = assert_close(&run_dir, one, 1e-5);
        eprintln!(
            "{ranks} ranks ({what}) vs 1: max |Δ| metric {metric:.2e}, weight {weight:.2e} ({:.1} s)",
            t.elapsed().as_secs_f64()
        );
        // Rank 0 committed the checkpoints once every rank had written its part, with every
        // file in the manifest.
        if what == "sharded" {
            assert_sharded_checkpoint(&run_dir, 2, ranks);
        } else {
            let files = manifest_files(&run_dir, 2, "actor/");
            assert!(
                files.contains(&"actor/model.safetensors".to_owned()),
                "{files:?}"
            );
        }
        assert!(!manifest_files(&run_dir, 2, "trainer_state.json").is_empty());
        assert_eq!(
            std::fs::read_to_string(run_dir.join("latest_checkpointed_iteration.txt")).unwrap(),
            "3"
        );
    }
}

/// `trainer.balance_batch` on two ranks: the rows move between ranks so that each holds about
/// the same work, but the losses are normalised by the global batch's tokens, so the update (and
/// with it every later step) is the unbalanced one-rank run's; what the whole batch measures too.
#[test]
fn balance_batch_moves_rows_between_ranks_not_the_update() {
    let one = reference();
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    run_with(&run_dir, 2, 3, 2, &["trainer.balance_batch=true"]);
    let weight = assert_weights_close(&run_dir, one, 1e-5);
    let (ours, theirs) = (metrics(&run_dir), metrics(one));
    let mut compared = 0;
    for (step, m) in &ours {
        for key in [
            "critic/score/mean",
            "response_length/mean",
            "actor/grad_norm",
        ] {
            // Validation records carry none of them.
            let Some(&a) = m.get(key) else { continue };
            let b = theirs[step][key];
            assert!(close(a, b, 1e-5), "step {step} {key}: {a} vs {b}");
            compared += 1;
        }
    }
    assert_eq!(compared, 3 * 3, "{ours:?}");
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let mut balanced_steps = 0;
    for line in text.lines() {
        let record: Value = serde_json::from_str(line).unwrap();
        let Some(max) = record["data"]["global_seqlen/max"].as_f64() else {
            continue;
        };
        let balanced = record["data"]["global_seqlen/balanced_max"]
            .as_f64()
            .unwrap();
        assert!(balanced <= max, "{line}");
        balanced_steps += 1;
    }
    assert_eq!(balanced_steps, 3, "{text}");
    eprintln!("2 ranks balanced vs 1: max |Δ| weight {weight:.2e}");
}

/// Sharded (more ranks) and whole (one rank) checkpoints resume at the other world size; with
/// CPU offloading every world size runs the sharded model.
#[test]
fn a_checkpoint_resumes_at_another_world_size() {
    let one = reference();
    let offload = offload();
    let offload: Vec<&str> = offload.iter().map(String::as_str).collect();
    for (first, then, extra, what) in [
        (2, 1, &[][..], ""),
        (1, 2, &[][..], ""),
        (2, 1, &offload[..], ", offloaded"),
        (1, 2, &offload[..], ", offloaded"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        run_with(&run_dir, first, 2, 2, extra);
        if first > 1 || !extra.is_empty() {
            assert_sharded_checkpoint(&run_dir, 2, first);
        }
        run_with(&run_dir, then, 3, 2, extra);
        let (metric, weight) = assert_close(&run_dir, one, 1e-5);
        eprintln!(
            "{first} → {then} ranks{what} vs uninterrupted one rank: max |Δ| metric {metric:.2e}, weight {weight:.2e}"
        );
    }
}

/// A `launch` whose stderr is read on a thread.
struct Launch {
    child: Child,
    stderr: Receiver<String>,
}

impl Launch {
    fn start(args: &[String]) -> Self {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut child = verl_core_command(&args, &[])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
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

    /// The pid of each rank the launcher has started (its children, by their `RANK`).
    fn rank_pids(&self) -> BTreeMap<usize, i32> {
        let pid = self.child.id();
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|child| {
                let environ = std::fs::read(format!("/proc/{child}/environ")).ok()?;
                let rank = environ
                    .split(|&b| b == 0)
                    .find_map(|var| var.strip_prefix(b"RANK="))?;
                Some((
                    std::str::from_utf8(rank).ok()?.parse().ok()?,
                    child.parse().ok()?,
                ))
            })
            .collect()
    }

    /// Waits for the launcher; its exit status and stderr.
    fn wait(mut self, bound: Duration) -> (std::process::ExitStatus, String, Duration) {
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if start.elapsed() > bound {
                let _ = self.child.kill();
                let lines: Vec<String> = self.stderr.try_iter().collect();
                panic!(
                    "the launch did not end within {bound:?}:\n{}",
                    lines.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let waited = start.elapsed();
        // The reader thread ends with the pipe.
        let mut lines = Vec::new();
        while let Ok(line) = self.stderr.recv_timeout(Duration::from_secs(5)) {
            lines.push(line);
        }
        (status, lines.join("\n"), waited)
    }
}

/// A small deterministic generator (xorshift64*), so the kills are reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Rank `rank` of a 2-rank run SIGKILLed at seeded random moments, ≥ 10 times: every time the
/// launch fails within a bound, a surviving rank names the lost one, no partial checkpoint is
/// visible, and `resume_mode=auto` (the default) then finishes the run bit-identical to an
/// uninterrupted 2-rank run. `VERL_SPMD_KILL_SEED` picks another seed.
#[test]
fn a_killed_rank_fails_the_job_cleanly_and_it_resumes_bit_identically() {
    const STEPS: u64 = 4;
    let started = Instant::now();
    let uninterrupted = tempfile::tempdir().unwrap();
    let reference = uninterrupted.path().join("run");
    let t = Instant::now();
    run(&reference, 2, STEPS, 1);
    // The kills land within the first 70% of a run; the estimate shrinks whenever an attempt
    // finishes before its kill (the machine got faster than when it was measured).
    let mut full = t.elapsed();
    let seed = std::env::var("VERL_SPMD_KILL_SEED").map_or(0x5bd1_e995, |s| {
        s.parse().expect("VERL_SPMD_KILL_SEED: a u64")
    });
    let mut rng = Rng(seed);
    let mut kills = Vec::new();
    let mut slowest = Duration::ZERO;
    while kills.len() < 10 {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        let args = shared_args(&run_dir, 2, STEPS, 1);
        loop {
            let launch = Launch::start(&args);
            std::thread::sleep(full.mul_f64(0.1 + 0.6 * rng.next_f64()));
            let victim = usize::from(rng.next_f64() >= 0.5);
            let pids = launch.rank_pids();
            let Some(&pid) = pids.get(&victim).filter(|_| pids.len() == 2) else {
                // Finished already: it must have succeeded.
                let (status, stderr, _) = launch.wait(Duration::from_secs(120));
                assert!(status.success(), "{stderr}");
                full = full.mul_f64(0.7);
                break;
            };
            // SAFETY: a positive pid of a child of our child; kill(2) has no memory effects.
            let killed = unsafe { libc::kill(pid, libc::SIGKILL) } == 0;
            let (status, stderr, waited) = launch.wait(Duration::from_secs(60));
            if !killed || status.success() {
                full = full.mul_f64(0.7);
                break;
            }
            slowest = slowest.max(waited);
            let latest = std::fs::read_to_string(run_dir.join("latest_checkpointed_iteration.txt"))
                .map_or(0, |s| s.trim().parse().unwrap());
            assert!(
                stderr.contains(&format!("error: rank {victim} failed (killed by SIGKILL")),
                "the launcher names the killed rank {victim}:\n{stderr}"
            );
            // The survivor's own error names the lost rank (a lost peer reads `rank R (pid …`).
            let survivor_named_it = stderr.contains(&format!("rank {victim} (pid "));
            kills.push((victim, latest, survivor_named_it, waited));
            // Only committed checkpoints are visible (a partial one is hidden and cleaned up).
            for entry in std::fs::read_dir(&run_dir).into_iter().flatten() {
                let name = entry.unwrap().file_name().to_string_lossy().into_owned();
                if let Some(step) = name.strip_prefix("global_step_") {
                    assert!(
                        step.parse::<u64>().unwrap() <= latest.max(1),
                        "{name} visible, latest {latest}"
                    );
                    assert!(
                        entry_has_manifest(&run_dir.join(&name)),
                        "{name} has no manifest"
                    );
                }
            }
        }
        assert_eq!(metrics(&run_dir), metrics(&reference));
        assert!(
            std::fs::read(run_dir.join("huggingface/model.safetensors")).unwrap()
                == std::fs::read(reference.join("huggingface/model.safetensors")).unwrap(),
            "final weights differ after the kills"
        );
    }
    let named = kills.iter().filter(|k| k.2).count();
    eprintln!(
        "seed {seed:#x}: {} kills (victim, latest checkpoint, survivor named it, launch ended after): {kills:?}; \
         {named} named by the survivor; slowest failure {slowest:?}; {:.1} s",
        kills.len(),
        started.elapsed().as_secs_f64()
    );
    // A survivor outside a collective when its peer dies (generating, say) meets the loss at
    // its next collective, which may come after the launcher has stopped it.
    assert!(
        named * 2 >= kills.len(),
        "the surviving rank should name the lost one most of the time: {kills:?}"
    );
    let progress: std::collections::BTreeSet<u64> = kills.iter().map(|k| k.1).collect();
    assert!(
        progress.len() >= 2,
        "kills landed at too few points: {kills:?}"
    );
}

fn entry_has_manifest(dir: &Path) -> bool {
    dir.join("manifest.sha256.json").is_file()
}

/// The quickstart's own config through `launch --nproc-per-node 2` (fewer steps than its 400:
/// the full run is a README figure, not a CI test): it trains and validates on both ranks.
#[test]
fn the_quickstart_runs_on_two_ranks() {
    let cwd = tempfile::tempdir().unwrap();
    let plugins = bundled_plugins(&["verl_plugin_native", "verl_plugin_fsdp"]);
    let out = Command::new(&release().binary)
        .current_dir(cwd.path())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("VERL_PLUGIN_DEFAULT_DIR", "")
        .args([
            "--plugin-dir",
            plugins.path().to_str().unwrap(),
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "run",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=4",
            "trainer.test_freq=4",
            "trainer.save_freq=4",
            "sft.steps=10",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // Rank 0 alone prepared the quickstart and reports the validation.
    assert!(stderr.contains("sft: model written to"), "{stderr}");
    assert!(!stderr.contains("[rank 1] sft:"), "{stderr}");
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("val-core/") && l.contains("(step 0) ->")),
        "{stderr}"
    );
    assert!(
        cwd.path()
            .join("checkpoints/verl-core-quickstart/grpo/huggingface/model.safetensors")
            .is_file()
    );
}
