//! A quickstart-style GRPO run on a tiny mixture-of-experts model (the quickstart's addition
//! task and character tokenizer, `quickstart.model.num_experts`: a Qwen3-MoE whose every layer
//! routes to 2 of 4 experts, warmed up by the quickstart's SFT) through the `native` rollout and
//! the `fsdp` engine, with rollout router replay (verl's R3): the rollout records each token's
//! experts, the trainer carries them in the batch, the engine's old-log-prob forward and updates
//! replay them.

use crate::helpers::*;

#[test]
fn an_moe_grpo_run_replays_the_rollouts_routing() {
    let plugins = bundled_plugins(&[
        "verl_plugin_native",
        "verl_plugin_fsdp",
        "verl_plugin_trackers",
        "verl_plugin_reward_http",
    ]);
    let work = tempfile::tempdir().unwrap();
    let run_dir = work.path().join("run");
    let steps = 4;
    let mut args = vec![
        "--plugin-dir".to_string(),
        plugins.path().display().to_string(),
    ];
    args.extend(quickstart_run_args(
        work.path(),
        &run_dir,
        steps,
        0,
        &[
            "quickstart.model.num_experts=4",
            "quickstart.model.num_experts_per_tok=2",
            "quickstart.task.val_size=16",
            // One record per training step.
            "trainer.val_before_train=false",
            // Enough warm-up that some answers score (else every advantage is 0 and nothing moves).
            "sft.steps=40",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.router_replay.mode=R3",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            // The rollout's log-probs, for verl's rollout-vs-actor metrics.
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "trainer.logger=[file]",
        ],
    ));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = verl_core(&args, &[]);
    assert!(
        out.status.success(),
        "run failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(work.path().join("model-sft/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["architectures"][0], "Qwen3MoeForCausalLM");

    let by_step = step_metrics(&run_dir);
    assert_eq!(by_step.len(), steps as usize);
    let series = |key: &str| -> Vec<f64> {
        by_step
            .values()
            .map(|m| {
                m.get(key)
                    .and_then(serde_json::Value::as_f64)
                    .unwrap_or_else(|| panic!("no {key} in {m:?}"))
            })
            .collect()
    };
    // With the rollout's experts replayed, the actor's old log-probs are the rollout's up to
    // fp32 rounding (the two run different kernel shapes; bit-identity needs the batch-invariant
    // mode): |p_actor − p_rollout| per token.
    let diff = series("training/rollout_probs_diff_max");
    println!("training/rollout_probs_diff_max by step: {diff:?}");
    assert!(diff.iter().all(|&d| d < 1e-5), "{diff:?}");
    let (score, pg_loss) = (series("critic/score/mean"), series("actor/pg_loss"));
    println!("critic/score/mean by step: {score:?}\nactor/pg_loss by step: {pg_loss:?}");
    assert!(pg_loss.iter().all(|v| v.is_finite()));
    assert!(
        pg_loss.windows(2).any(|w| w[0] != w[1]) || score.windows(2).any(|w| w[0] != w[1]),
        "neither the loss nor the score moved"
    );
}
