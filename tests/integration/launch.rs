//! `verl-core launch` and rank placement through the release binary: what every rank is told,
//! commands that cannot run multi-rank yet failing fast in every rank, and a signal reaching the
//! ranks through the launcher.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::helpers::*;

/// The release binary in `cwd`, set up as [`verl_core_command`] sets it up.
fn verl_core_in(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = verl_core_command(args, env);
    cmd.current_dir(cwd);
    cmd
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn launch_gives_every_rank_torchruns_variables() {
    let out = verl_core(&["launch", "--nproc-per-node", "3", "--", "platform"], &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let rank0 = stdout
        .lines()
        .find(|l| l.starts_with("Rank: 0 of 3"))
        .unwrap_or_else(|| panic!("rank 0's line, without prefix:\n{stdout}"));
    let rendezvous = rank0
        .split(", rendezvous ")
        .nth(1)
        .expect("a rendezvous address");
    assert!(rendezvous.starts_with("127.0.0.1:"), "{rank0}");
    assert_eq!(
        rank0,
        format!(
            "Rank: 0 of 3 (local 0 of 3; RANK/WORLD_SIZE from torchrun or verl-core launch), device cpu, comm gloo, rendezvous {rendezvous}"
        )
    );
    for rank in 1..3 {
        let expected = format!(
            "[rank {rank}] Rank: {rank} of 3 (local {rank} of 3; RANK/WORLD_SIZE from torchrun or verl-core launch), device cpu, comm gloo, rendezvous {rendezvous}"
        );
        assert!(
            stdout.lines().any(|l| l == expected),
            "{expected}\nin\n{stdout}"
        );
        // The other ranks' device tables are prefixed too.
        assert!(
            stdout.contains(&format!("[rank {rank}] Platform: cpu")),
            "{stdout}"
        );
    }
}

#[test]
fn torchrun_and_slurm_variables_place_a_process() {
    let torchrun = [
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29400"),
    ];
    let placement = |env: &[(&str, &str)]| {
        let out = verl_core(&["platform", "--json"], env);
        assert!(out.status.success(), "{:?}", text(&out));
        stdout_json(&out)["placement"].clone()
    };
    let p = placement(&torchrun);
    assert_eq!(
        (
            &p["rank"],
            &p["world_size"],
            &p["local_rank"],
            &p["source"],
            &p["master_port"]
        ),
        (
            &3.into(),
            &4.into(),
            &1.into(),
            &"torchrun".into(),
            &29400.into()
        ),
        "{p:#}"
    );
    // An srun step: Slurm's variables, MASTER_PORT defaulting to torchrun's.
    let slurm = [
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_STEP_ID", "0"),
        ("MASTER_ADDR", "node-a"),
    ];
    let p = placement(&slurm);
    assert_eq!(
        (
            &p["rank"],
            &p["world_size"],
            &p["source"],
            &p["master_port"]
        ),
        (&2.into(), &4.into(), &"slurm".into(), &29500.into()),
        "{p:#}"
    );
    // Both: torchrun's win.
    let both: Vec<_> = slurm.iter().chain(&torchrun).copied().collect();
    assert_eq!(placement(&both)["source"], "torchrun");
}

/// A job sized for another world size, and `sft` (one process only) with several ranks, stop in
/// every rank before anything is written, and the launcher names a failed rank.
#[test]
fn mis_sized_and_single_rank_commands_fail_fast_in_every_rank() {
    let cwd = tempfile::tempdir().unwrap();
    let plugins = bundled_plugins(&["verl_plugin_native", "verl_plugin_fsdp"]);
    let plugins = plugins.path().to_str().unwrap();
    let launch = |overrides: &[&str]| {
        let mut args = vec![
            "--plugin-dir",
            plugins,
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "sft",
        ];
        args.extend(overrides);
        let started = Instant::now();
        let out = verl_core_in(cwd.path(), &args, &[]).output().unwrap();
        (out, started.elapsed())
    };

    // The default config sizes the job as 1 × 1.
    let (out, _) = launch(&[]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "error: trainer.nnodes=1 × trainer.n_gpus_per_node=1 = 1, but this run has 2 ranks (RANK/WORLD_SIZE from torchrun or verl-core launch)"
        ),
        "{stderr}"
    );

    let (out, elapsed) = launch(&["trainer.n_gpus_per_node=2"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "{stderr}");
    for (prefix, rank) in [("", 0), ("[rank 1] ", 1)] {
        let line = format!(
            "{prefix}error: multi-rank supervised fine-tuning is not supported by this build yet: this is rank {rank} of 2"
        );
        assert!(stderr.contains(&line), "{line}\nin\n{stderr}");
    }
    // Both ranks end by themselves (within launch's grace), so it names one and the other.
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last == "error: rank 0 failed (exit status 1); other ranks: rank 1: exit status 1"
            || last == "error: rank 1 failed (exit status 1); other ranks: rank 0: exit status 1",
        "{stderr}"
    );
    assert!(elapsed < Duration::from_secs(60), "{elapsed:?}");
    // Nothing was prepared: the quickstart writes under the working directory.
    let written: Vec<_> = std::fs::read_dir(cwd.path()).unwrap().collect();
    assert!(written.is_empty(), "{written:?}");
}

#[test]
fn launch_refuses_commands_that_do_not_place_themselves() {
    let out = verl_core(
        &["launch", "--nproc-per-node", "2", "--", "data", "gen"],
        &[],
    );
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains(
            "launch runs one of run, sft, score, generate, platform after `--` (got `data`)"
        ),
        "{stderr}"
    );
}

/// SIGINT to the launcher reaches its rank (a quickstart run, interrupted wherever it is),
/// and the launcher exits with 128 + SIGINT once the rank is gone.
#[test]
fn sigint_to_launch_is_forwarded_to_the_ranks() {
    let cwd = tempfile::tempdir().unwrap();
    let plugins = bundled_plugins(&["verl_plugin_native", "verl_plugin_fsdp"]);
    let plugins = plugins.path().to_str().unwrap();
    let mut child = verl_core_in(
        cwd.path(),
        &[
            "--plugin-dir",
            plugins,
            "launch",
            "--nproc-per-node",
            "1",
            "--",
            "run",
        ],
        &[],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // The rank is running once the quickstart says it wrote the task (its first line).
    let mut stderr = child.stderr.take().unwrap();
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !seen.ends_with(b"\n") {
        assert_eq!(stderr.read(&mut byte).unwrap(), 1, "the rank wrote nothing");
        seen.push(byte[0]);
    }
    let first = String::from_utf8_lossy(&seen);
    assert!(first.starts_with("quickstart: wrote "), "{first}");
    let interrupted = Instant::now();
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    let status = child.wait().unwrap();
    let elapsed = interrupted.elapsed();
    assert_eq!(status.code(), Some(130), "{rest}");
    let last = rest.lines().last().unwrap_or_default();
    // Killed by it during preparation, or stopped by the trainer's handler.
    assert!(
        last == "error: interrupted by SIGINT, forwarded to every rank; rank 0: killed by SIGINT (2)"
            || (last
                == "error: interrupted by SIGINT, forwarded to every rank; rank 0: exit status 1"
                && rest.contains("interrupt: stopping after this step")),
        "{rest}"
    );
    assert!(elapsed < Duration::from_secs(60), "{elapsed:?}");
}

/// `verl-core launch --nproc-per-node 2 -- score … <verl overrides>` gives the JSON of a one-rank
/// `score`: megatron at tensor-parallel size 2 (one model split over both ranks) and fsdp on two
/// data-parallel ranks, on the Qwen2 fixture (q/k/v biases, tied embeddings), three lines of
/// different lengths (an odd count: each rank's part is padded to equal size).
#[test]
fn score_on_two_ranks_with_verl_overrides_matches_one_rank() {
    let plugins = bundled_plugins(&["verl_plugin_fsdp", "verl_plugin_megatron"]);
    let plugins = plugins.path().to_str().unwrap();
    let model = workspace_root().join("runtime/model/fixtures/tiny-qwen2");
    let model = model.to_str().unwrap();
    let input = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        input.path(),
        "{\"prompt_ids\": [5, 6, 7], \"response_ids\": [8, 9, 10, 11]}\n\
         {\"prompt_ids\": [12], \"response_ids\": [13]}\n\
         {\"prompt_ids\": [14, 15, 16, 17, 18], \"response_ids\": [19, 20]}\n",
    )
    .unwrap();
    let input = input.path().to_str().unwrap();
    let score = |ranks: Option<&str>, overrides: &[&str]| -> Vec<Vec<f64>> {
        let mut args = vec!["--plugin-dir", plugins];
        if let Some(n) = ranks {
            args.extend(["launch", "--nproc-per-node", n, "--"]);
        }
        args.extend(["score", "--model", model, "--input", input, "--json"]);
        args.extend(overrides);
        let out = verl_core(&args, &[]);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{args:?}\n{stdout}\n{stderr}");
        let json: serde_json::Value =
            serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
        json["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r["logprobs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap())
                    .collect()
            })
            .collect()
    };
    let one = score(None, &[]);
    assert_eq!(
        one.iter().map(Vec::len).collect::<Vec<_>>(),
        [4, 1, 2],
        "{one:?}"
    );
    let megatron_tp2 = score(
        Some("2"),
        &[
            "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        ],
    );
    let fsdp_dp2 = score(Some("2"), &[]);
    for (name, other) in [
        ("megatron TP=2", &megatron_tp2),
        ("fsdp on 2 ranks", &fsdp_dp2),
    ] {
        assert_eq!(other.len(), one.len(), "{name}: {other:?}");
        for (a, b) in one.iter().zip(other.iter()) {
            assert_eq!(a.len(), b.len(), "{name}: {a:?} vs {b:?}");
            let worst = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(worst <= 1e-5, "{name}: {a:?} vs {b:?} (max diff {worst:e})");
        }
    }
}

/// `score` audits its overrides as `run` does: a key no component acts on that would change the
/// result stops it, naming the key.
#[test]
fn score_reports_unsupported_overrides() {
    let plugins = bundled_plugins(&["verl_plugin_megatron"]);
    let model = workspace_root().join("runtime/model/fixtures/tiny-qwen2");
    let input = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        input.path(),
        "{\"prompt_ids\": [5], \"response_ids\": [6]}\n",
    )
    .unwrap();
    let out = verl_core(
        &[
            "--plugin-dir",
            plugins.path().to_str().unwrap(),
            "score",
            "--model",
            model.to_str().unwrap(),
            "--input",
            input.path().to_str().unwrap(),
            "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        ],
        &[],
    );
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"),
        "{stderr}"
    );
}
