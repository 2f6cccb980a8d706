//! On-policy distillation end to end (`distillation.enabled`): the quickstart's warm-up model
//! trained for 30 SFT steps is the teacher of a student warmed up for 5; the student samples, the
//! teacher engine scores its samples (top-k log-probs), and the actor is trained on the top-k KL
//! alone (no task reward, no policy gradient). The KL to the teacher must fall.

use std::path::Path;

use crate::helpers::*;

fn plugins() -> tempfile::TempDir {
    bundled_plugins(&[
        "verl_plugin_native",
        "verl_plugin_fsdp",
        "verl_plugin_trackers",
        "verl_plugin_reward_http",
    ])
}

fn run(plugins: &Path, work: &Path, run_dir: &Path, steps: u64, overrides: &[&str]) {
    let mut args = vec!["--plugin-dir".to_string(), plugins.display().to_string()];
    args.extend(quickstart_run_args(work, run_dir, steps, 0, overrides));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = verl_core(&args, &[]);
    assert!(
        out.status.success(),
        "run failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The mean of `key` over `steps` of a run's metrics.
fn mean(
    metrics: &std::collections::BTreeMap<
        u64,
        std::collections::BTreeMap<String, serde_json::Value>,
    >,
    key: &str,
    steps: std::ops::RangeInclusive<u64>,
) -> f64 {
    let values: Vec<f64> = steps
        .map(|s| {
            metrics[&s][key]
                .as_f64()
                .unwrap_or_else(|| panic!("step {s} has no `{key}`"))
        })
        .collect();
    values.iter().sum::<f64>() / values.len() as f64
}

#[test]
fn the_students_kl_to_the_teacher_falls() {
    let plugins = plugins();
    let dir = tempfile::tempdir().unwrap();
    // The teacher: the quickstart's warm-up with 30 SFT steps (its own data and model dir).
    let teacher_work = dir.path().join("teacher");
    run(
        plugins.path(),
        &teacher_work,
        &dir.path().join("teacher-run"),
        1,
        &[
            "sft.steps=30",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        ],
    );
    let teacher = teacher_work.join("model-sft");
    // The student: 5 SFT steps, then distillation.
    let work = dir.path().join("student");
    let run_dir = dir.path().join("run");
    let teacher_path = format!(
        "distillation.teacher_model.model_path={}",
        teacher.display()
    );
    let steps = 16;
    run(
        plugins.path(),
        &work,
        &run_dir,
        steps,
        &[
            "distillation.enabled=true",
            &teacher_path,
            "distillation.distillation_loss.loss_mode=forward_kl_topk",
            "distillation.distillation_loss.topk=8",
            "distillation.distillation_loss.use_task_rewards=false",
            "distillation.distillation_loss.use_policy_gradient=false",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
        ],
    );
    let metrics = step_metrics(&run_dir);
    assert_eq!(metrics.len() as u64, steps, "{metrics:?}");
    for m in metrics.values() {
        // No task loss: the update is the distillation loss alone.
        assert!(!m.contains_key("actor/pg_loss"), "{m:?}");
        let mass = m["distillation/teacher_mass"].as_f64().unwrap();
        assert!(
            mass > 0.0 && mass <= 1.0 + 1e-5,
            "teacher top-k mass {mass}"
        );
    }
    let first = mean(&metrics, "distillation/token_loss", 1..=4);
    let last = mean(&metrics, "distillation/token_loss", steps - 3..=steps);
    println!("distillation/token_loss: steps 1-4 {first:.4}, last 4 {last:.4}");
    assert!(first > 0.0, "{first}");
    assert!(
        last < 0.7 * first,
        "the KL fell only from {first} to {last}"
    );
}
