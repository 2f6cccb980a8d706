#!/usr/bin/env python3
"""Reference values of the top-k distillation losses for verl-core's parity test.

    python scripts/reference/distill_reference.py [OUT_JSON]

verl b178a3c has no distillation; the losses are verl's later `verl/trainer/distillation`
(verl-project/verl 01dcf9f0: `forward_kl_topk`, `forward_kl_topk_tail` with `tail_kl.py`'s bucket),
plus the reverse-KL modes verl-core adds (`reverse_kl_topk`: both sides renormalised over the top-k;
`reverse_kl_topk_tail`: the tail-bucket sum with student and teacher swapped), written here by hand in plain PyTorch the naive way
(a full `log_softmax` of the student, then a gather). For seeded random student and teacher logits
it writes the teacher's top-k ids and log-probs, the per-token loss and masses, and the gradient of
`Σ w·loss` with respect to the student logits for a random weight `w` (default:
runtime/actor/tests/data/distill_reference.json). runtime/actor/tests/distill.rs
replays the file without Python. Needs torch only.
"""

import json
import sys
from pathlib import Path

import torch

SEED = 20261202
OUT = Path(__file__).resolve().parents[2] / "runtime/actor/tests/data/distill_reference.json"


def kl(log_a, log_b):
    """Σ a (log a − log b) over the last dimension (unnormalised a)."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def tail_term(mass_a, mass_b, eps):
    """verl's tail bucket: a's tail weights, b's tail (floored at eps) is inside the log."""
    tail_a = (1.0 - mass_a).clamp(0.0, 1.0)
    tail_b = (1.0 - mass_b).clamp(eps, 1.0)
    tail_a_log = tail_a.clamp_min(torch.finfo(torch.float32).tiny)
    return tail_a * (tail_a_log.log() - tail_b.log())


def loss(student_logits, teacher_lp, teacher_ids, mode, clamp, eps):
    student_all = torch.log_softmax(student_logits, dim=-1)
    student = torch.gather(student_all, -1, teacher_ids)
    student_mass = student.exp().sum(-1)
    teacher_mass = teacher_lp.exp().sum(-1)
    teacher = teacher_lp
    if clamp is not None:
        student = student.clamp_min(clamp)
        teacher = teacher.clamp_min(clamp)
    if mode == "forward_kl_topk":
        out = kl(teacher, student).clamp_min(0.0)
    elif mode == "forward_kl_topk_tail":
        out = kl(teacher, student) + tail_term(teacher_mass, student_mass, eps)
    elif mode == "reverse_kl_topk":
        # Both renormalised over the top-k: q_i / sum(q), p_i / sum(p).
        q = student.exp() / student.exp().sum(-1, keepdim=True)
        p = teacher.exp() / teacher.exp().sum(-1, keepdim=True)
        out = (q * (q.log() - p.log())).sum(-1)
    else:
        out = kl(student, teacher) + tail_term(student_mass, teacher_mass, eps)
    return out, student_mass, teacher_mass


def case(gen, mode, clamp, n, v, k, scale):
    student_logits = (torch.randn(n, v, generator=gen, dtype=torch.float64) * scale).float()
    teacher_logits = (torch.randn(n, v, generator=gen, dtype=torch.float64) * scale).float()
    labels = torch.randint(v, (n,), generator=gen)
    weight = torch.rand(n, generator=gen, dtype=torch.float64).float()
    teacher_all = torch.log_softmax(teacher_logits, dim=-1)
    teacher_lp, teacher_ids = torch.topk(teacher_all, k, dim=-1)
    x = student_logits.clone().requires_grad_(True)
    per_token, student_mass, teacher_mass = loss(x, teacher_lp, teacher_ids, mode, clamp, 1e-6)
    label_lp = torch.gather(torch.log_softmax(x, -1), -1, labels[:, None])[:, 0]
    (grad,) = torch.autograd.grad((per_token * weight).sum(), x)
    return {
        "mode": mode,
        "log_prob_min_clamp": clamp,
        "tail_mass_eps": 1e-6,
        "n": n,
        "v": v,
        "k": k,
        "student_logits": student_logits.flatten().tolist(),
        "teacher_logits": teacher_logits.flatten().tolist(),
        "labels": labels.tolist(),
        "weight": weight.tolist(),
        "teacher_ids": teacher_ids.flatten().tolist(),
        "teacher_log_probs": teacher_lp.flatten().tolist(),
        "label_log_probs": label_lp.detach().tolist(),
        "loss": per_token.detach().tolist(),
        "student_mass": student_mass.detach().tolist(),
        "teacher_mass": teacher_mass.detach().tolist(),
        "grad": grad.flatten().tolist(),
    }


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    gen = torch.Generator().manual_seed(SEED)
    cases = []
    for mode in ["forward_kl_topk", "forward_kl_topk_tail", "reverse_kl_topk", "reverse_kl_topk_tail"]:
        for clamp in [None, -10.0, -2.5]:
            # Peaked logits (scale 4) push the small probabilities below the -2.5 clamp.
            cases.append(case(gen, mode, clamp, 7, 23, 5, 4.0 if clamp == -2.5 else 1.5))
    out.write_text(json.dumps({"seed": SEED, "torch": torch.__version__, "cases": cases}) + "\n")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
