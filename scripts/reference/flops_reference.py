#!/usr/bin/env python3
"""Reference FLOP estimates and device peaks of verl's MFU metrics for verl-core's parity test.

    python scripts/reference/flops_reference.py VERL_CHECKOUT [OUT_JSON]

VERL_CHECKOUT is a local checkout of https://github.com/verl-project/verl (the directory that holds
the `verl` package). The script takes `_DEVICE_FLOPS`, `get_device_flops`, every `_estimate_*`
function and `ESTIMATE_FUNC` from that checkout's `verl/utils/flops_counter.py` (by their syntax
tree, so that neither torch nor transformers is imported) and runs them on seeded model configs
(Llama / Qwen2 / Qwen3 / Mistral shapes, grouped-query attention, explicit `head_dim` or not, and
model types verl has no estimate for) with seeded sequence lengths, and on device names. It writes
the FLOPs of a forward and backward pass (verl's TFLOP/s over one second, × 1e12) and the peak
FLOP/s per device name as JSON (default: core/trainer/tests/data/verl_flops_reference.json);
`core/trainer/tests/flops_parity.rs` replays it without Python. Standard library only.
"""

import ast
import inspect
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import verl_source

SEED = 20261203
DENSE = ["qwen2", "llama", "qwen3", "mistral", "qwen2_vl", "qwen2_5_vl", "minicpmv", "minicpmo", "seed_oss", "glm4v", "mimo"]
DEVICES = ["CPU", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H20", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S",
           "NVIDIA L40", "NVIDIA A40", "NVIDIA L20", "AMD Instinct MI300X", "NVIDIA GB200", "NVIDIA B200",
           "Ascend910B2", "NVIDIA GeForce RTX 3070 Ti", "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB"]


def load(verl_dir: Path) -> dict:
    def wanted(node):
        if isinstance(node, ast.FunctionDef):
            return node.name == "get_device_flops" or node.name.startswith("_estimate_")
        return isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) in ("_DEVICE_FLOPS", "ESTIMATE_FUNC") for t in node.targets
        )

    relpath = "verl/utils/flops_counter.py"
    verl = verl_source.load(verl_dir, relpath, wanted, {"inspect": inspect})
    verl_source.require(verl, ["_DEVICE_FLOPS", "ESTIMATE_FUNC", "get_device_flops"], relpath)
    return verl


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    verl_dir = Path(sys.argv[1])
    out_path = Path(sys.argv[2]) if len(sys.argv) == 3 else Path("core/trainer/tests/data/verl_flops_reference.json")
    verl = load(verl_dir)
    commit = verl_source.commit(verl_dir)
    rng = random.Random(SEED)
    cases = []
    for i in range(200):
        heads = rng.choice([2, 4, 8, 14, 16, 28, 32, 40])
        kv_heads = rng.choice([h for h in (1, 2, 4, 8, heads) if heads % h == 0])
        head_dim = rng.choice([16, 64, 128])
        config = {
            "model_type": DENSE[i % len(DENSE)] if i % 20 else "deepseek_v2_lite_unknown",
            "hidden_size": heads * head_dim,
            "vocab_size": rng.choice([512, 32000, 151936]),
            "num_hidden_layers": rng.choice([1, 2, 4, 24, 36]),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "intermediate_size": rng.choice([256, 4864, 11008, 18944]),
        }
        if i % 3 == 0:
            config["head_dim"] = rng.choice([64, 128, 256])  # Qwen3 / Gemma style: not hidden / heads
        seqlens = [rng.randint(1, rng.choice([16, 512, 4096])) for _ in range(rng.randint(1, 64))]
        func = verl["ESTIMATE_FUNC"].get(config["model_type"], verl["_estimate_unknown_flops"])
        tflops = func(SimpleNamespace(**config), sum(seqlens), seqlens, 1.0)
        cases.append({"config": config, "seqlens": seqlens, "flops": tflops * 1e12})
    devices = [{"name": name, "flops": verl["get_device_flops"](unit="B", device_name=name)} for name in DEVICES]
    out = {
        "source": "verl/utils/flops_counter.py ESTIMATE_FUNC (FLOPs over one second), get_device_flops",
        "verl_commit": commit,
        "seed": SEED,
        "cases": cases,
        "devices": devices,
    }
    text = json.dumps(out, separators=(",", ":"), allow_nan=True)
    out_path.write_text(text.replace("Infinity", '"inf"') + "\n")
    print(f"{out_path}: {len(cases)} estimates, {len(devices)} devices, verl {commit}")


if __name__ == "__main__":
    main()
