#!/usr/bin/env python3
"""Reference values of verl's algorithms for verl-core's parity tests.

    python scripts/reference/algos_reference.py VERL_CHECKOUT [OUT_JSON]

VERL_CHECKOUT is a local checkout of https://github.com/verl-project/verl (the directory that holds
the `verl` package). The script imports `verl/trainer/ppo/core_algos.py` from it with small stand-ins
for the heavy imports around it (omegaconf, tensordict, the config dataclasses, the device helpers;
`verl/utils/torch_functional.py`, `groupwise.py` and `import_utils.py` are verl's own), runs every
advantage estimator, policy loss, aggregation mode, KL estimator, the KL controllers, the value and
entropy losses and `compute_variance_proxy_metrics` (from `verl/trainer/ppo/metric_utils.py`, taken
by its syntax tree) on seeded random inputs and writes the inputs and verl's outputs as JSON
(default: core/algo/tests/data/verl_algos_reference.json). It needs torch and numpy only. The Rust tests
(core/algo/tests/algos_parity.rs, runtime/actor/tests/algos_parity.rs) replay the file without
Python.
"""

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import torch

import verl_source

SEED = 20260822
VOCAB = 7


def load_core_algos(verl_dir: Path):
    """Imports verl's core_algos.py, standing in for what it imports besides torch and numpy."""
    pkg = verl_dir / "verl"
    if not (pkg / "trainer" / "ppo" / "core_algos.py").is_file():
        sys.exit(f"{verl_dir} is not a verl checkout: no verl/trainer/ppo/core_algos.py")

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    def from_file(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        m = importlib.util.module_from_spec(spec)
        sys.modules[name] = m
        spec.loader.exec_module(m)
        return m

    class AttrDict(dict):
        """A dict read with attributes, as omegaconf's DictConfig and verl's BaseConfig are."""

        def __getattr__(self, key):
            try:
                return self[key]
            except KeyError as e:
                raise AttributeError(key) from e

    class AlgoConfig(AttrDict):
        pass

    class ActorConfig(AttrDict):
        pass

    module("omegaconf", DictConfig=AttrDict)
    module("tensordict", TensorDict=dict)
    for name in ["verl", "verl.utils", "verl.trainer", "verl.workers"]:
        module(name, __path__=[])
    module("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu)
    module("verl.trainer.config", AlgoConfig=AlgoConfig)
    module("verl.workers.config", ActorConfig=ActorConfig)
    verl_f = from_file("verl.utils.torch_functional", pkg / "utils" / "torch_functional.py")
    groupwise = from_file("verl.utils.groupwise", pkg / "utils" / "groupwise.py")
    from_file("verl.utils.import_utils", pkg / "utils" / "import_utils.py")
    utils = sys.modules["verl.utils"]
    utils.torch_functional = verl_f
    utils.as_torch_index = groupwise.as_torch_index
    utils.group_mean_std = groupwise.group_mean_std
    core = from_file("verl.trainer.ppo.core_algos", pkg / "trainer" / "ppo" / "core_algos.py")
    return core, verl_f, AlgoConfig, ActorConfig, AttrDict


def rows(t):
    """A tensor as nested lists of floats, 8 significant digits (well inside the 1e-5 tolerance)."""
    if isinstance(t, torch.Tensor):
        t = t.detach().double().tolist()
    if isinstance(t, list):
        return [rows(x) for x in t]
    return float(f"{t:.8g}")


class Inputs:
    """Seeded inputs: masks (left-aligned, or with interior zeros as multi-turn observations),
    groups of several sizes, rewards of several kinds."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(SEED)
        self.np = np.random.default_rng(SEED)
        self.sets = []

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    def rand(self, *shape):
        return torch.rand(*shape, generator=self.gen)

    def mask(self, batch, length, interior):
        m = torch.zeros(batch, length)
        for i in range(batch):
            n = int(self.np.integers(1, length + 1))
            m[i, :n] = 1.0
            if interior and n > 2:
                # An observation span strictly inside the response.
                start = int(self.np.integers(1, n - 1))
                stop = int(self.np.integers(start + 1, n))
                m[i, start:stop] = 0.0
        return m

    def add(self, tensors, **meta):
        self.sets.append({"id": len(self.sets), **meta, **{k: rows(v) for k, v in tensors.items()}})
        return len(self.sets) - 1


def last_valid(mask):
    """Index of each row's last response token."""
    idx = torch.arange(mask.shape[1]).expand_as(mask)
    return torch.where(mask > 0, idx, torch.full_like(idx, -1)).max(dim=-1).values


def outcome(scores, mask):
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0]), last_valid(mask)] = scores
    return out


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    verl_dir = Path(sys.argv[1]).resolve()
    out_path = Path(sys.argv[2]) if len(sys.argv) == 3 else (
        Path(__file__).resolve().parents[2] / "core" / "tests" / "data" / "verl_algos_reference.json"
    )
    core, verl_f, AlgoConfig, ActorConfig, AttrDict = load_core_algos(verl_dir)
    torch.manual_seed(SEED)
    try:
        commit = subprocess.run(
            ["git", "-C", str(verl_dir), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"

    inputs = Inputs()
    cases = []

    # ---------------------------------------------------------------- advantage estimators
    layouts = [  # (group sizes, response length, interior zeros)
        ([1, 1, 1, 1], 5, False),
        ([2, 2, 2], 6, False),
        ([4, 4], 8, True),
        ([5, 3, 1], 7, True),
        ([8], 12, False),
        ([4, 4, 4, 4], 10, True),
        ([3, 1, 6], 9, False),
    ]
    for layout, (sizes, length, interior) in enumerate(layouts):
        batch = sum(sizes)
        index = [g for g, n in enumerate(sizes) for _ in range(n)]
        perm = inputs.np.permutation(batch).tolist()  # groups need not be contiguous
        index = [index[p] * 7 + 3 for p in perm]
        for kind in ["binary", "normal", "dense"]:
            mask = inputs.mask(batch, length, interior)
            if kind == "binary":
                rewards = outcome((inputs.rand(batch) > 0.5).float(), mask)
            elif kind == "normal":
                rewards = outcome(inputs.randn(batch), mask)
            else:
                rewards = inputs.randn(batch, length) * mask
            values = inputs.randn(batch, length)
            baselines = inputs.randn(batch)
            old_log_probs = -torch.nn.functional.softplus(inputs.randn(batch, length))
            pi = old_log_probs.exp()
            # Σπ² over a vocabulary that holds the token: between π² and 1.
            sum_pi_squared = pi**2 + (1 - pi) ** 2 * inputs.rand(batch, length)
            is_weights = 0.5 + inputs.rand(batch, length)
            components = [
                outcome((inputs.rand(batch) > 0.5).float(), mask),
                outcome(inputs.randn(batch) * 3, mask),
            ]
            set_id = inputs.add(
                {
                    "rewards": rewards,
                    "mask": mask,
                    "values": values,
                    "reward_baselines": baselines,
                    "old_log_probs": old_log_probs,
                    "sum_pi_squared": sum_pi_squared,
                    "rollout_is_weights": is_weights,
                    "components": components,
                },
                index=index,
                label=f"layout{layout}-{kind}",
            )
            if mask.sum() < 2:
                continue

            def adv(name, params, a, r):
                cases.append(
                    {"kind": "advantage", "name": name, "input": set_id, "params": params,
                     "advantages": rows(a), "returns": rows(r)}
                )

            idx = np.array(index)
            for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.5, 0.8)]:
                a, r = core.compute_gae_advantage_return(rewards.clone(), values, mask, gamma, lam)
                adv("gae", {"gamma": gamma, "lam": lam}, a, r)
            for norm in [True, False]:
                cfg = AlgoConfig(norm_adv_by_std_in_grpo=norm, gamma=1.0)
                p = {"norm_adv_by_std_in_grpo": norm}
                a, r = core.compute_grpo_outcome_advantage(rewards.clone(), mask, idx, norm_adv_by_std_in_grpo=norm)
                adv("grpo", p, a, r)
                a, r = core.compute_grpo_vectorized_outcome_advantage(
                    rewards.clone(), mask, idx, norm_adv_by_std_in_grpo=norm
                )
                adv("grpo_vectorized", p, a, r)
                # GDPO on the total reward (verl's path without reward keys) ...
                a, r = core.compute_gdpo_outcome_advantage(rewards.clone(), mask, idx, norm_adv_by_std_in_grpo=norm)
                adv("gdpo", p, a, r)
                # ... and on two reward components with weights, placed by verl from the batch.
                prompt_len = 3
                response_attention = (torch.arange(length).expand(batch, length) <= last_valid(mask)[:, None]).long()
                gdpo_batch = {
                    "prompts": torch.zeros(batch, prompt_len, dtype=torch.long),
                    "attention_mask": torch.cat(
                        [torch.ones(batch, prompt_len, dtype=torch.long), response_attention], dim=1
                    ),
                }
                non_tensor = {
                    "format": components[0].sum(-1).numpy(),
                    "accuracy": components[1].sum(-1).numpy(),
                }
                for weights in [None, [1.0, 0.5]]:
                    # With two responses per group any two distinct scores normalise to ±1/√2, so
                    # equal weights can cancel to rounding noise on every row, which whitening then
                    # blows up: such a case tests f32 rounding, not the algorithm.
                    total = sum(
                        w * core.compute_grpo_outcome_advantage(c_, mask, idx, norm_adv_by_std_in_grpo=norm)[0]
                        for w, c_ in zip(weights or [1.0, 1.0], components)
                    )
                    if total.abs().max() < 1e-3:
                        continue
                    gcfg = AlgoConfig(
                        norm_adv_by_std_in_grpo=norm,
                        gdpo_reward_keys=["format", "accuracy"],
                        gdpo_reward_weights=weights,
                    )
                    a, r = core.compute_gdpo_outcome_advantage(
                        rewards.clone(), mask, idx, norm_adv_by_std_in_grpo=norm, config=gcfg,
                        non_tensor_batch=non_tensor, batch=gdpo_batch,
                    )
                    adv("gdpo", {**p, "components": True, "weights": weights}, a, r)
                if min(sizes) >= 2:
                    a, r = core.compute_grpo_passk_outcome_advantage(rewards.clone(), mask, idx, config=cfg)
                    adv("grpo_passk", p, a, r)
            cfg = AlgoConfig(gamma=1.0)
            for name, fn in [
                ("rloo", core.compute_rloo_outcome_advantage),
                ("rloo_vectorized", core.compute_rloo_vectorized_outcome_advantage),
                ("opo", core.compute_opo_outcome_advantage),
                ("gpg", core.compute_gpg_outcome_advantage),
                ("reinforce_plus_plus_baseline", core.compute_reinforce_plus_plus_baseline_outcome_advantage),
            ]:
                a, r = fn(token_level_rewards=rewards.clone(), response_mask=mask, index=idx, config=cfg)
                adv(name, {}, a, r)
            for gamma in [1.0, 0.9]:
                a, r = core.compute_reinforce_plus_plus_outcome_advantage(
                    rewards.clone(), mask, config=AlgoConfig(gamma=gamma)
                )
                adv("reinforce_plus_plus", {"gamma": gamma}, a, r)
            a, r = core.compute_remax_outcome_advantage(rewards.clone(), baselines, mask, config=cfg)
            adv("remax", {}, a, r)
            for name, fn in [
                ("optimal_token_baseline", core.compute_optimal_token_baseline_advantage),
                ("tir_optimal_token_baseline", core.compute_multi_turn_optimal_token_baseline_advantage),
            ]:
                for weighted in [False, True]:
                    a, r = fn(
                        rewards.clone(), mask, idx, old_log_probs, sum_pi_squared,
                        rollout_is_weights=is_weights if weighted else None,
                    )
                    adv(name, {"rollout_is_weights": weighted}, a, r)

    # Examples from verl-core's issue 14, by hand.
    rf_set = inputs.add(
        {"rewards": torch.tensor([[0.0, 0.0, 0.0, 1.0]]), "mask": torch.tensor([[1.0, 1.0, 0.0, 1.0]])},
        index=[0],
        label="issue14-reinforce++",
    )
    a, r = core.compute_reinforce_plus_plus_outcome_advantage(
        torch.tensor([[0.0, 0.0, 0.0, 1.0]]), torch.tensor([[1.0, 1.0, 0.0, 1.0]]), config=AlgoConfig(gamma=1.0)
    )
    cases.append({"kind": "advantage", "name": "reinforce_plus_plus", "input": rf_set,
                  "params": {"gamma": 1.0}, "advantages": rows(a), "returns": rows(r)})

    # ---------------------------------------------------------------- KL estimators and controllers
    logprob = -torch.nn.functional.softplus(inputs.randn(64))
    ref = -torch.nn.functional.softplus(inputs.randn(64))
    logprob[:4] = torch.tensor([-30.0, -0.01, -5.0, -25.0])
    ref[:4] = torch.tensor([-0.01, -30.0, -5.0, -1.0])
    kl_set = inputs.add({"logprob": logprob, "ref": ref}, label="kl")
    for name in ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                 "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]:
        lp = logprob.clone().requires_grad_(True)
        value = core.kl_penalty(lp, ref, name)
        value.sum().backward()
        cases.append({"kind": "kl", "name": name, "input": kl_set, "value": rows(value), "grad": rows(lp.grad)})
    for target, horizon, kls in [(0.1, 100, [0.05, 0.5, 0.11, 0.0]), (0.02, 5000, [0.03, 0.01, 1.0])]:
        c = core.AdaptiveKLController(init_kl_coef=0.2, target_kl=target, horizon=horizon)
        values = []
        for i, kl in enumerate(kls):
            c.update(kl, n_steps=8 * (i + 1))
            values.append(float(c.value))
        cases.append({"kind": "kl_ctrl", "params": {"init_kl_coef": 0.2, "target_kl": target, "horizon": horizon},
                      "current_kl": kls, "values": values})

    # ---------------------------------------------------------------- losses
    modes = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    infos = [
        {},
        {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 12, "loss_scale_factor": 16},
    ]
    # Tiny values keep the agg cases' own issue-14 example: [[1, 2], [3, 4]], all-ones mask.
    agg_sets = [
        inputs.add({"loss": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "mask": torch.ones(2, 2)}, label="issue14-agg")
    ]
    for batch, length, interior in [(6, 5, False), (8, 9, True)]:
        mask = inputs.mask(batch, length, interior)
        mask[-1] = 0.0  # a fully masked row (an aborted response) must not count
        agg_sets.append(inputs.add({"loss": inputs.randn(batch, length), "mask": mask}, label="agg"))
    for set_id in agg_sets:
        s = inputs.sets[set_id]
        loss, mask = torch.tensor(s["loss"]), torch.tensor(s["mask"])
        for mode in modes:
            for info in infos:
                value = core.agg_loss(loss, mask, mode, **info)
                cases.append({"kind": "agg", "input": set_id, "mode": mode, "info": info, "value": rows(value)})

    loss_specs = [  # (loss, loss_agg_modes, actor config overrides)
        ("vanilla", modes, {}),
        ("vanilla", ["token-mean"], {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28, "clip_ratio_c": 2.0}),
        ("dppo_tv", modes, {"clip_ratio": 0.15, "clip_ratio_c": 3.0}),
        ("dppo_tv", ["token-mean"], {"clip_ratio_low": 0.05, "clip_ratio_high": 0.2, "clip_ratio_c": 1.5}),
        ("dppo_kl", modes, {"clip_ratio": 0.05, "clip_ratio_c": 3.0}),
        ("dppo_kl", ["token-mean"], {"clip_ratio_low": 0.02, "clip_ratio_high": 0.1, "clip_ratio_c": 20.0}),
        ("gspo", ["seq-mean-token-mean"], {"clip_ratio_low": 0.0003, "clip_ratio_high": 0.0004}),
        ("gspo", ["token-mean"], {"clip_ratio": 0.2}),
        ("sapo", ["seq-mean-token-mean"], {}),
        ("sapo", ["token-mean"], {"tau_pos": 2.0, "tau_neg": 3.5}),
        ("gpg", modes, {}),
        # Every candidate token is chosen (clip_cov_ratio 1), so verl's random draw picks them all.
        ("clip_cov", modes, {"policy_loss": {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0}}),
        ("clip_cov", ["token-mean"], {"policy_loss": {"clip_cov_ratio": 1.0, "clip_cov_lb": -1.0, "clip_cov_ub": 0.3}}),
        ("kl_cov", modes, {"policy_loss": {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}}),
        ("kl_cov", ["token-mean"], {"policy_loss": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0}}),
        ("geo_mean", ["token-mean"], {}),
        ("geo_mean", ["token-mean"], {"clip_ratio_low": 0.05, "clip_ratio_high": 0.1}),
        ("dro", modes, {"policy_loss": {"dro_beta": 0.1}}),
        ("dro", ["token-mean"], {"policy_loss": {"dro_beta": 2.0}}),
        ("cispo", modes, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}),
    ]
    policy_defaults = {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
                       "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1, "dro_beta": None}
    loss_sets = []
    for batch, length, interior, advantage_kind in [(6, 7, False, "token"), (8, 10, True, "sequence"),
                                                    (5, 4, False, "sequence")]:
        mask = inputs.mask(batch, length, interior)
        old = -torch.nn.functional.softplus(inputs.randn(batch, length) * 1.5)
        new = torch.clamp(old + inputs.randn(batch, length) * 0.3, max=-1e-4)
        if advantage_kind == "token":
            advantages = inputs.randn(batch, length)
        else:
            advantages = inputs.randn(batch, 1).expand(batch, length).clone()
        advantages[0, 0] = 0.0  # a zero advantage takes the "otherwise" side of every branch
        loss_sets.append(inputs.add(
            {"old_log_prob": old, "log_prob": new, "advantages": advantages, "mask": mask},
            label=f"loss-{advantage_kind}",
        ))
    for set_id in loss_sets:
        s = inputs.sets[set_id]
        old, new, advantages, mask = (torch.tensor(s[k]) for k in ["old_log_prob", "log_prob", "advantages", "mask"])
        for name, agg_modes, overrides in loss_specs:
            for mode in agg_modes:
                actor = {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0,
                         "tau_pos": 1.0, "tau_neg": 1.05, "global_batch_info": {}}
                actor.update({k: v for k, v in overrides.items() if k != "policy_loss"})
                policy = AttrDict({**policy_defaults, **overrides.get("policy_loss", {})})
                config = ActorConfig({**actor, "policy_loss": policy})
                lp = new.clone().requires_grad_(True)
                pg_loss, metrics = core.get_policy_loss_fn(name)(old, lp, advantages, mask, mode, config)
                pg_loss.backward()
                cases.append({
                    "kind": "policy_loss", "name": name, "input": set_id, "mode": mode,
                    "config": {k: v for k, v in actor.items() if k != "global_batch_info"}
                    | {"policy_loss": dict(policy)},
                    "pg_loss": rows(pg_loss), "grad": rows(lp.grad),
                    "metrics": {k: float(f"{v:.8g}") for k, v in metrics.items()},
                })

    for batch, length, interior in [(6, 5, False), (7, 8, True)]:
        mask = inputs.mask(batch, length, interior)
        values = inputs.randn(batch, length)
        vpreds = values + inputs.randn(batch, length) * 0.5
        returns = inputs.randn(batch, length)
        logits = inputs.randn(batch, length, VOCAB) * 2
        set_id = inputs.add({"vpreds": vpreds, "values": values, "returns": returns, "mask": mask,
                             "logits": logits}, label="value-entropy")
        for mode in modes:
            for cliprange in [0.2, 0.5]:
                vf_loss, clipfrac = core.compute_value_loss(vpreds, returns, values, mask, cliprange, mode)
                cases.append({"kind": "value_loss", "input": set_id, "mode": mode, "cliprange_value": cliprange,
                              "vf_loss": rows(vf_loss), "vf_clipfrac": rows(clipfrac)})
            entropy = core.compute_entropy_loss(logits, mask, mode)
            cases.append({"kind": "entropy_loss", "input": set_id, "mode": mode, "value": rows(entropy)})

    # ---------------------------------------------------------------- GDPO from reward result dicts
    # verl's path from compute_score's dicts to the estimator: the reward manager collects every
    # key of each result dict into reward_extra_info (key -> one value per response; verl's
    # naive/gdpo managers do exactly this), the trainer puts it in non_tensor_batch, and
    # compute_gdpo_outcome_advantage reads gdpo_reward_keys from there, placing each value on the
    # response's last token by the attention mask. A generator of its own keeps the cases above
    # unchanged.
    gdpo_gen = torch.Generator().manual_seed(SEED + 1)
    for sizes, width in [([4, 4, 3, 5], 6), ([2, 6, 3], 9)]:
        batch = sum(sizes)
        index = [g for g, n in enumerate(sizes) for _ in range(n)]
        perm = torch.randperm(batch, generator=gdpo_gen).tolist()
        index = [index[p] * 5 + 1 for p in perm]
        lengths = torch.randint(1, width + 1, (batch,), generator=gdpo_gen).tolist()
        results = [
            {
                "score": round(float(torch.randn(1, generator=gdpo_gen)), 4),
                "format": bool(torch.rand(1, generator=gdpo_gen) > 0.4),
                "accuracy": float(torch.randint(0, 5, (1,), generator=gdpo_gen)) / 4,
            }
            for _ in range(batch)
        ]
        reward_extra_info = {k: [r[k] for r in results] for k in results[0]}
        non_tensor = {k: np.array(v) for k, v in reward_extra_info.items()}
        prompt_len = 2
        response_attention = (torch.arange(width).expand(batch, width) < torch.tensor(lengths)[:, None]).long()
        gdpo_batch = {
            "prompts": torch.zeros(batch, prompt_len, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(batch, prompt_len, dtype=torch.long), response_attention], 1),
        }
        mask = response_attention.float()
        for keys, weights in [(["format", "accuracy"], None), (["accuracy"], None),
                              (["score", "format", "accuracy"], [1.0, 0.5, 2.0])]:
            for norm in [True, False]:
                gcfg = AlgoConfig(norm_adv_by_std_in_grpo=norm, gdpo_reward_keys=keys, gdpo_reward_weights=weights)
                a, _ = core.compute_gdpo_outcome_advantage(
                    torch.zeros(batch, width), mask, np.array(index), norm_adv_by_std_in_grpo=norm, config=gcfg,
                    non_tensor_batch=non_tensor, batch=gdpo_batch,
                )
                cases.append({
                    "kind": "gdpo_rewards", "name": "+".join(keys), "results": results, "lengths": lengths,
                    "width": width, "index": index, "keys": keys, "weights": weights,
                    "norm_adv_by_std_in_grpo": norm, "advantages": rows(a),
                })

    # ---------------------------------------------------------------- variance proxy metrics
    # verl's compute_variance_proxy_metrics (metric_utils.py, taken by its syntax tree: the module
    # imports transformers and the DataProto machinery) on a stand-in batch with a `.batch` dict.
    # The inputs go to verl already rounded as the JSON holds them, so both sides read the same f32
    # values. A generator of its own keeps the cases above unchanged.
    proxy = verl_source.load(
        verl_dir, "verl/trainer/ppo/metric_utils.py", verl_source.functions(["compute_variance_proxy_metrics"]),
        {"torch": torch, "verl_F": verl_f},
    )["compute_variance_proxy_metrics"]
    proxy_gen = torch.Generator().manual_seed(SEED + 2)

    def proxy_rand(*shape):
        return torch.rand(*shape, generator=proxy_gen)

    def proxy_randn(*shape):
        return torch.randn(*shape, generator=proxy_gen)

    for batch, length, layout in [(1, 6, "left"), (1, 5, "interior"), (2, 4, "left"), (4, 8, "empty"),
                                  (5, 7, "interior"), (8, 12, "left"), (8, 10, "empty"), (16, 9, "interior"),
                                  (6, 6, "negative"), (7, 11, "negative"), (3, 5, "tiny_weights")]:
        lengths = torch.randint(1, length + 1, (batch,), generator=proxy_gen)
        mask = (torch.arange(length).expand(batch, length) < lengths[:, None]).float()
        if layout == "interior":
            for i in range(batch):
                if lengths[i] > 2:  # an observation span strictly inside the response
                    start = int(torch.randint(1, int(lengths[i]) - 1, (1,), generator=proxy_gen))
                    mask[i, start:int(lengths[i]) - 1] = 0.0
        if layout == "empty":
            mask[1] = 0.0  # aborted responses: no tokens
            mask[-1] = 0.0
        if layout == "tiny_weights":
            mask[:2, :3] = 1.0  # room for a tiny weight beside ordinary ones
        if layout == "negative":
            # π near 1 and Σπ² below π² (inconsistent, as a bad engine could send): W < 0 on some rows.
            old_log_probs = -torch.nn.functional.softplus(proxy_randn(batch, length) - 2.5)
            pi = old_log_probs.exp()
            sum_pi_squared = pi**2 * proxy_rand(batch, length)
        else:
            old_log_probs = -torch.nn.functional.softplus(proxy_randn(batch, length))
            pi = old_log_probs.exp()
            sum_pi_squared = pi**2 + (1 - pi) ** 2 * proxy_rand(batch, length)
        if batch % 2:
            advantages = proxy_randn(batch, length)  # token-level, junk on masked tokens too
        else:
            advantages = proxy_randn(batch, 1).expand(batch, length) * mask  # one per response, as GRPO
        if batch % 3 == 0:
            # Sequence-level IS: one weight per response, zero on padding.
            weights = (0.2 + 1.8 * proxy_rand(batch, 1)).expand(batch, length) * mask
        else:
            weights = (0.5 + proxy_rand(batch, length)) * mask
        if layout == "tiny_weights":
            # ρ² = 1e-12 and 0, under the 1e-10 clamp, beside ordinary weights (so that the
            # response's mean weight, which scales its power, stays ordinary).
            weights[0, 0] = 1e-6
            weights[1, 1] = 0.0
        tensors = {"old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared, "advantages": advantages,
                   "response_mask": mask, "rollout_is_weights": weights}
        set_id = inputs.add(tensors, label=f"variance_proxy-{layout}-{batch}x{length}")
        stored = {k: torch.tensor(inputs.sets[set_id][k]) for k in tensors}
        for with_weights in [False, True]:
            class Batch:  # DataProto's `.batch`, with the keys verl reads
                batch = {k: v for k, v in stored.items() if with_weights or k != "rollout_is_weights"}

            # No actor update (None), a small norm, and one whose square exceeds the total power.
            for grad_norm in [None, float(f"{0.3 * float(proxy_rand(1)):.8g}"), 25.0]:
                metrics = proxy(Batch, gradient_norm=None if grad_norm is None else np.float64(grad_norm))
                cases.append({
                    "kind": "variance_proxy", "name": layout, "input": set_id,
                    "params": {"rollout_is_weights": with_weights, "grad_norm": grad_norm},
                    "metrics": {k: float(v) for k, v in metrics.items()},
                })

    out = {
        "verl_commit": commit,
        "generated_by": "scripts/reference/algos_reference.py",
        "torch": torch.__version__,
        "seed": SEED,
        "inputs": inputs.sets,
        "cases": cases,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    kinds = {}
    for c in cases:
        kinds[c["kind"]] = kinds.get(c["kind"], 0) + 1
    print(f"{len(cases)} cases {kinds} from verl {commit} -> {out_path} ({out_path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
