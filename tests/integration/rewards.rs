//! Rewards end to end on the quickstart's synthetic task: a DAPO run (the `dapo` reward manager
//! with the overlong penalty, dynamic sampling over `data.gen_batch_size` rounds, filtered on
//! `seq_reward`), a run scored
//! by a Python reward function through the `http` reward plugin, and the error for a `.py` path.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

use crate::helpers::{step_metrics, workspace_root};
use crate::train::{assert_no_panic, reference, run_with};

fn value(m: &std::collections::BTreeMap<String, Value>, key: &str) -> f64 {
    m.get(key)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("`{key}` missing in {m:?}"))
}

#[test]
fn a_dapo_run_penalises_overlong_responses_and_samples_dynamically() {
    reference(); // made first: it also prepares the shared data and model
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    // Responses run to 8 tokens (data.max_response_length); with a buffer of 4 every response
    // past 4 tokens loses up to 0.5, so a wrong full-length answer scores -0.5.
    let out = run_with(
        &run_dir,
        3,
        100,
        &[
            "reward_model.reward_manager=dapo",
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=4",
            "reward_model.overlong_buffer.penalty_factor=0.5",
            "reward_model.overlong_buffer.log=true",
            "algorithm.filter_groups.enable=true",
            // The 5-step warm-up model is rarely right, so `acc` groups are nearly all 0: filter
            // on the shaped reward (score plus penalty), DAPO's `seq_reward`.
            "algorithm.filter_groups.metric=seq_reward",
            "algorithm.filter_groups.max_num_gen_batches=20",
            // Fewer prompts a round than a step trains on: at least two rounds a step.
            "data.gen_batch_size=6",
            "actor_rollout_ref.rollout.n=8",
            "trainer.test_freq=0",
        ],
    );
    assert_no_panic(&out);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let by_step = step_metrics(&run_dir);
    // Validation before training: the dapo manager records `acc`, so it is the core metric.
    let before = &by_step[&0];
    let acc = value(before, "val-core/verl-core/addition/acc/mean@1");
    let reward = value(before, "val-aux/verl-core/addition/reward/mean@1");
    assert!((0.0..=1.0).contains(&acc) && reward <= acc, "{before:?}");
    eprintln!("DAPO validation before training: acc {acc}, reward {reward}");
    let mut lowest = f64::INFINITY;
    for step in 1..=3 {
        let m = &by_step[&step];
        let rounds = value(m, "train/num_gen_batches");
        assert!(rounds >= 2.0, "step {step}: {m:?}");
        let (min, max) = (value(m, "critic/score/min"), value(m, "critic/score/max"));
        // Rule scores are 0 or 1; the penalty takes at most 0.5 off.
        assert!(
            (-0.5..=1.0).contains(&min) && min <= max && max <= 1.0,
            "step {step}: {m:?}"
        );
        lowest = lowest.min(min);
        eprintln!(
            "DAPO step {step}: train/num_gen_batches={rounds} critic/score/mean={:.4} min={min} max={max} response_length/mean={:.2}",
            value(m, "critic/score/mean"),
            value(m, "response_length/mean")
        );
    }
    assert!(lowest < 0.0, "no response was penalised: {by_step:?}");
}

/// `reward_server.py` serving a Python function, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const PYTHON_REWARD: &str = r#"
import json

def compute_score(data_source, solution_str, ground_truth, extra_info=None, log_path=None, right=1.0):
    with open(log_path, "a") as f:
        f.write(json.dumps({"data_source": data_source, "ground_truth": ground_truth}) + "\n")
    return {"score": right if solution_str.strip().endswith(str(ground_truth)) else 0.25, "acc": False}
"#;

#[test]
fn a_python_reward_function_scores_a_run_through_the_http_plugin() {
    reference(); // made first: it also prepares the shared data and model
    let dir = tempfile::tempdir().unwrap();
    let reward_py = dir.path().join("reward.py");
    std::fs::write(&reward_py, PYTHON_REWARD).unwrap();
    let log = dir.path().join("calls.jsonl");
    let mut child = Command::new("python3")
        .arg(workspace_root().join("plugins/reward-http/reward_server.py"))
        .args([reward_py.to_str().unwrap(), "--port", "0"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs the reward server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _server = Server(child);
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .expect(&line)
        .to_owned();

    let run_dir = dir.path().join("run");
    let out = run_with(
        &run_dir,
        2,
        100,
        &[
            &format!("custom_reward_function.path={url}"),
            &format!(
                "+custom_reward_function.reward_kwargs.log_path={}",
                log.display()
            ),
            "+custom_reward_function.reward_kwargs.right=0.75",
            "+custom_reward_function.reward_kwargs.batch_size=5",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
        ],
    );
    assert_no_panic(&out);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (step, m) in step_metrics(&run_dir).range(1..) {
        // Every score came from the Python function: 0.75 or 0.25, nothing else.
        for key in ["critic/score/min", "critic/score/max"] {
            let v = value(m, key);
            assert!(v == 0.25 || v == 0.75, "step {step}: {key}={v}");
        }
    }
    // 2 steps × 8 prompts × 4 responses, with the dataset's fields.
    let calls = std::fs::read_to_string(&log).unwrap();
    assert_eq!(calls.lines().count(), 64, "{calls}");
    let first: Value = serde_json::from_str(calls.lines().next().unwrap()).unwrap();
    assert_eq!(first["data_source"], "verl-core/addition");
    assert!(
        first["ground_truth"]
            .as_str()
            .unwrap()
            .parse::<u32>()
            .is_ok(),
        "{first}"
    );
}

#[test]
fn a_python_file_as_the_reward_path_says_how_to_serve_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_with(
        &dir.path().join("run"),
        1,
        100,
        &["custom_reward_function.path=/srv/my_reward.py"],
    );
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("/srv/my_reward.py")
            && stderr.contains("reward_server.py")
            && stderr.contains("custom_reward_function.path=http://"),
        "{stderr}"
    );
}
