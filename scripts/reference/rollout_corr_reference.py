#!/usr/bin/env python3
"""Reference values of verl's rollout correction for verl-core's parity test.

    python scripts/reference/rollout_corr_reference.py VERL_CHECKOUT [OUT_JSON]

Imports `verl/trainer/ppo/rollout_corr_helper.py` from a local verl checkout (with the stand-ins of
`algos_reference.py` for the heavy imports, plus small ones for DataProto and the config classes it
names only in annotations), runs `compute_rollout_correction_and_rejection_mask` — IS weights at token
and sequence level with and without batch normalisation, every rejection option alone and chained,
K1 bounds given as `lower_upper` — on seeded random log-probs, and writes the inputs, the weights,
the new response mask and every `rollout_corr/` metric as JSON (default:
core/algo/tests/data/verl_rollout_corr_reference.json). Needs torch, numpy and transformers (which verl's
torch_functional imports). core/algo/tests/rollout_corr_parity.rs replays the file without Python.
"""

import json
import subprocess
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algos_reference import load_core_algos, rows  # noqa: E402

SEED = 20261202


def load_helper(verl_dir: Path):
    # Installs verl.utils.torch_functional and the stand-ins; core_algos has the policy losses.
    core, _, _, ActorConfig, AttrDict = load_core_algos(verl_dir)

    class DataProto:
        def __init__(self, tensors):
            self.batch = tensors

        @classmethod
        def from_dict(cls, tensors):
            return cls(tensors)

    def module(name, **attrs):
        m = sys.modules.get(name) or types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    module("verl.protocol", DataProto=DataProto)
    module("verl.trainer.config.algorithm", RolloutCorrectionConfig=dict)
    module("verl.workers.config.actor", PolicyLossConfig=dict)
    import importlib.util

    path = verl_dir / "verl" / "trainer" / "ppo" / "rollout_corr_helper.py"
    spec = importlib.util.spec_from_file_location("verl.trainer.ppo.rollout_corr_helper", path)
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    return helper, core, ActorConfig, AttrDict


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    verl_dir = Path(sys.argv[1]).resolve()
    out_path = Path(sys.argv[2]) if len(sys.argv) == 3 else (
        Path(__file__).resolve().parents[2] / "core" / "tests" / "data" / "verl_rollout_corr_reference.json"
    )
    helper, core, ActorConfig, AttrDict = load_helper(verl_dir)
    try:
        commit = subprocess.run(
            ["git", "-C", str(verl_dir), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"

    gen = torch.Generator().manual_seed(SEED)
    inputs = []
    # (batch, length, off-policy scale, empty rows)
    shapes = [(4, 6, 0.05, False), (8, 10, 0.3, False), (6, 12, 1.0, True), (16, 5, 0.6, False), (3, 20, 0.02, True)]
    for batch, length, scale, empty in shapes:
        mask = torch.zeros(batch, length)
        for i in range(batch):
            n = int(torch.randint(1, length + 1, (1,), generator=gen))
            mask[i, :n] = 1.0
        if empty:
            mask[1] = 0.0
        rollout = -torch.rand(batch, length, generator=gen) * 3.0
        old = rollout + torch.randn(batch, length, generator=gen) * scale
        # Padding holds junk, as a batch's padded cells may.
        old = torch.where(mask > 0, old, torch.full_like(old, -7.5))
        inputs.append({"old_log_prob": rows(old), "rollout_log_prob": rows(rollout), "response_mask": rows(mask)})

    settings = []
    for level in ["token", "sequence"]:
        for threshold in [2.0, 1.2, 5.0]:
            for normalize in [False, True]:
                settings.append({"rollout_is": level, "rollout_is_threshold": threshold,
                                 "rollout_is_batch_normalize": normalize})
    for option in sorted(helper.SUPPORTED_ROLLOUT_RS_OPTIONS):
        for threshold in ["2.0", "0.05", "1.5"] + (["0.8_1.1"] if option.endswith("k1") else []):
            settings.append({"rollout_rs": option, "rollout_rs_threshold": threshold})
    settings += [
        {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1,seq_mean_k3",
         "rollout_rs_threshold": "0.7_1.5,0.02"},
        {"rollout_is": "sequence", "rollout_is_threshold": 3.0, "rollout_rs": "seq_max_k2,seq_sum_k1,token_k3",
         "rollout_rs_threshold": "0.5"},
        {"rollout_rs": "token_k2,token_k2,seq_mean_k1", "rollout_rs_threshold": "0.1"},
        {},
    ]

    cases = []
    for set_id, data in enumerate(inputs):
        tensors = {k: torch.tensor(v) for k, v in data.items()}
        for s in settings:
            weights, mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
                old_log_prob=tensors["old_log_prob"],
                rollout_log_prob=tensors["rollout_log_prob"],
                response_mask=tensors["response_mask"],
                rollout_is=s.get("rollout_is"),
                rollout_is_threshold=s.get("rollout_is_threshold", 2.0),
                rollout_is_batch_normalize=s.get("rollout_is_batch_normalize", False),
                rollout_rs=s.get("rollout_rs"),
                rollout_rs_threshold=s.get("rollout_rs_threshold"),
            )
            cases.append({
                "input": set_id,
                "settings": s,
                "weights": None if weights is None else rows(weights.batch["rollout_is_weights"]),
                "response_mask": rows(mask),
                "metrics": {k: float(f"{v:.8g}") for k, v in metrics.items()},
            })

    # The policy losses verl multiplies by the IS weights (`rollout_is_weights` of
    # compute_policy_loss_*), with weights from compute_rollout_correction_weights.
    loss_sets, loss_cases = [], []
    for batch, length, level in [(6, 7, "token"), (5, 9, "sequence")]:
        mask = torch.zeros(batch, length)
        for i in range(batch):
            mask[i, : int(torch.randint(1, length + 1, (1,), generator=gen))] = 1.0
        old = -torch.nn.functional.softplus(torch.randn(batch, length, generator=gen) * 1.5)
        new = torch.clamp(old + torch.randn(batch, length, generator=gen) * 0.3, max=-1e-4)
        rollout = old + torch.randn(batch, length, generator=gen) * 0.4
        advantages = torch.randn(batch, length, generator=gen)
        weights, _ = helper.compute_rollout_correction_weights(old - rollout, mask, level, 1.5)
        loss_sets.append({k: rows(v) for k, v in
                          {"old_log_prob": old, "log_prob": new, "advantages": advantages, "mask": mask,
                           "rollout_is_weights": weights}.items()})
    policy_defaults = {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0,
                       "kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0, "dro_beta": None}
    for set_id, data in enumerate(loss_sets):
        old, new, advantages, mask, weights = (torch.tensor(data[k]) for k in
                                               ["old_log_prob", "log_prob", "advantages", "mask",
                                                "rollout_is_weights"])
        for name in ["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo"]:
            modes = ["seq-mean-token-mean"] if name in ("gspo", "sapo") else ["token-mean", "seq-mean-token-sum"]
            for mode in modes:
                actor = {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0,
                         "tau_pos": 1.0, "tau_neg": 1.05, "global_batch_info": {}}
                policy = AttrDict(policy_defaults)
                config = ActorConfig({**actor, "policy_loss": policy})
                lp = new.clone().requires_grad_(True)
                pg_loss, metrics = core.get_policy_loss_fn(name)(
                    old, lp, advantages, mask, mode, config, rollout_is_weights=weights
                )
                pg_loss.backward()
                loss_cases.append({
                    "kind": "policy_loss", "name": name, "input": set_id, "mode": mode,
                    "config": {k: v for k, v in actor.items() if k != "global_batch_info"}
                    | {"policy_loss": dict(policy)},
                    "pg_loss": rows(pg_loss), "grad": rows(lp.grad),
                    "metrics": {k: float(f"{v:.8g}") for k, v in metrics.items()},
                })

    out = {
        "verl_commit": commit,
        "generated_by": "scripts/reference/rollout_corr_reference.py",
        "torch": torch.__version__,
        "seed": SEED,
        "inputs": inputs,
        "cases": cases,
        "loss_inputs": loss_sets,
        "loss_cases": loss_cases,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"{len(cases)} cases and {len(loss_cases)} weighted losses from verl {commit} -> {out_path} ({out_path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
