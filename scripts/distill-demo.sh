#!/usr/bin/env bash
# On-policy distillation on the quickstart: a GRPO-trained teacher lifts an untrained student.
#
#   bash scripts/distill-demo.sh RELEASE_DIR [STUDENT_STEPS] [WORK_DIR] [LOSS_MODE...]
#
# RELEASE_DIR holds a release build: the `verl-core` binary and the native, fsdp and trackers
# plugins (cargo build --release -p verl-core -p verl-plugin-native -p verl-plugin-fsdp
# -p verl-plugin-trackers). 1) The teacher: the quickstart as it ships (warm-up, 400 GRPO steps),
# exported to WORK_DIR/teacher/huggingface. 2) The student: the quickstart's warm-up model (no
# reinforcement learning), trained STUDENT_STEPS steps (default 100) on the teacher's top-k KL
# alone (no task reward: use_task_rewards=false, use_policy_gradient=false), once per LOSS_MODE
# (default forward_kl_topk reverse_kl_topk), validated every 10 steps. Prints the validation
# accuracy per validated step of the teacher run and of each student run.
set -euo pipefail
release=${1:?usage: distill-demo.sh RELEASE_DIR [STUDENT_STEPS] [WORK_DIR] [LOSS_MODE...]}
steps=${2:-100}
work=${3:-$(mktemp -d)}
shift $(($# < 3 ? $# : 3))
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(forward_kl_topk reverse_kl_topk)
plugins="$work/plugins"
mkdir -p "$plugins"
for p in native fsdp trackers; do
    cp "$release/libverl_plugin_$p.so" "$plugins/"
done
repo=$(cd "$(dirname "$0")/.." && pwd)
common=(--plugin-dir "$plugins" --config "$repo/examples/quickstart.yaml"
    "quickstart.dir=$work/quickstart"
    "data.train_files=[$work/quickstart/data/train.parquet]"
    "data.val_files=[$work/quickstart/data/test.parquet]"
    "actor_rollout_ref.model.path=$work/quickstart/model-sft"
    trainer.save_freq=-1 'trainer.logger=[file]')
if [ ! -f "$work/teacher/huggingface/model.safetensors" ]; then
    "$release/verl-core" run "${common[@]}" "trainer.default_local_dir=$work/teacher" \
        >"$work/teacher.log" 2>&1
fi
for mode in "${modes[@]}"; do
    "$release/verl-core" run "${common[@]}" "trainer.default_local_dir=$work/student-$mode" \
        "trainer.total_training_steps=$steps" trainer.test_freq=10 \
        distillation.enabled=true "distillation.teacher_model.model_path=$work/teacher/huggingface" \
        "distillation.distillation_loss.loss_mode=$mode" distillation.distillation_loss.topk=8 \
        distillation.distillation_loss.use_task_rewards=false \
        distillation.distillation_loss.use_policy_gradient=false \
        >"$work/student-$mode.log" 2>&1
done
python3 - "$work" "${modes[@]}" <<'PY'
import json, sys
work, modes = sys.argv[1], sys.argv[2:]
def curve(run):
    out = []
    for line in open(f"{work}/{run}/metrics.jsonl"):
        r = json.loads(line)
        d = r.get("data")
        if isinstance(d, dict):
            acc = [v for k, v in d.items() if k.startswith("val-core/") and "/reward/mean@" in k]
            kl = d.get("distillation/token_loss")
            if acc or kl is not None:
                out.append((r["step"], acc[0] if acc else None, kl))
    return out
for run in ["teacher"] + [f"student-{m}" for m in modes]:
    points = curve(run)
    val = [(s, a) for s, a, _ in points if a is not None]
    print(f"{run}: validation accuracy " + ", ".join(f"{s}:{a:.3f}" for s, a in val))
    kl = [(s, k) for s, _, k in points if k is not None]
    if kl:
        pick = [kl[0]] + [p for p in kl if p[0] % 10 == 0]
        print(f"{run}: distillation/token_loss " + ", ".join(f"{s}:{k:.3f}" for s, k in pick))
PY
