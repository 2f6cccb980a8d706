#!/usr/bin/env bash
# Step time of trainer.training_mode=sync vs one_step_off vs fully_async on the quickstart, in one
# run each. fully_async runs with verl's async_training defaults (trigger_parameter_sync_step=4,
# staleness_threshold=0.1) and the rollout's log-probs as the old policy's (use_rollout_log_probs).
#
#   bash scripts/bench-training-modes.sh RELEASE_DIR [STEPS] [WORK_DIR] [ROLLOUT]
#
# RELEASE_DIR holds a release build: the `verl-core` binary and the native (or vllm), fsdp and
# trackers plugins (cargo build --release -p verl-core -p verl-plugin-native -p verl-plugin-fsdp
# -p verl-plugin-trackers [-p verl-plugin-vllm]). ROLLOUT is `native` (default) or `vllm`: a real
# vLLM server on this machine's CPU (scripts/setup-vllm.sh), fp32 like the engine, weights synced
# through the disk checkpoint engine, the quickstart model with head size 32 (vLLM's CPU attention
# takes no smaller). Both runs share the quickstart's data and warmed-up model (made by the
# first) and train STEPS steps (default 30) without validation or checkpoints; the mean and median
# of `timing_s/step` over steps 2.. (step 1 of the overlapped modes generates its batch up front)
# are printed per mode, with `timing_s/gen` (time spent waiting for generation).
set -euo pipefail
release=${1:?usage: bench-training-modes.sh RELEASE_DIR [STEPS] [WORK_DIR]}
steps=${2:-30}
work=${3:-$(mktemp -d)}
rollout=${4:-native}
plugins="$work/plugins"
mkdir -p "$plugins"
case "$rollout" in
  native) rollout_args=() ;;
  vllm)
    rollout_args=(actor_rollout_ref.rollout.name=vllm
      actor_rollout_ref.rollout.checkpoint_engine.backend=disk
      actor_rollout_ref.rollout.dtype=float32
      quickstart.model.num_attention_heads=2 quickstart.model.num_key_value_heads=1)
    ;;
  *)
    echo "bench-training-modes.sh: ROLLOUT must be native or vllm, got $rollout" >&2
    exit 2
    ;;
esac
for p in "$rollout" fsdp trackers; do
    cp "$release/libverl_plugin_$p.so" "$plugins/"
done
repo=$(cd "$(dirname "$0")/.." && pwd)
for mode in sync one_step_off fully_async; do
    extra=()
    if [[ $mode == fully_async ]]; then
        extra=(actor_rollout_ref.rollout.calculate_log_probs=true)
    fi
    "$release/verl-core" run --plugin-dir "$plugins" --config "$repo/examples/quickstart.yaml" \
        "quickstart.dir=$work/quickstart" \
        "data.train_files=[$work/quickstart/data/train.parquet]" \
        "data.val_files=[$work/quickstart/data/test.parquet]" \
        "actor_rollout_ref.model.path=$work/quickstart/model-sft" \
        "trainer.default_local_dir=$work/run-$mode" \
        "trainer.total_training_steps=$steps" trainer.test_freq=-1 trainer.save_freq=-1 \
        trainer.val_before_train=false "trainer.training_mode=$mode" 'trainer.logger=[file]' \
        "${rollout_args[@]}" "${extra[@]}" >"$work/$mode.log" 2>&1
done
python3 - "$work" <<'EOF'
import json, statistics, sys
work = sys.argv[1]
for mode in ["sync", "one_step_off", "fully_async"]:
    rows = [json.loads(l) for l in open(f"{work}/run-{mode}/metrics.jsonl")]
    data = [r["data"] for r in rows if isinstance(r.get("data"), dict) and r.get("step", 0) >= 2]
    step = [d["timing_s/step"] for d in data if "timing_s/step" in d]
    gen = [d["timing_s/gen"] for d in data if "timing_s/gen" in d]
    acc = [d[k] for d in data for k in d if k.startswith("critic/score/mean")]
    print(f"{mode:13s} steps 2..{len(step) + 1}: step mean {statistics.mean(step):.3f} s, "
          f"median {statistics.median(step):.3f} s; waiting for generation mean "
          f"{statistics.mean(gen):.3f} s; mean score {statistics.mean(acc):.3f}")
EOF
