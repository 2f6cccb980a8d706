#!/usr/bin/env python3
"""Reference Σπ² per token for verl-core's engines, from transformers and verl's own formula.

    python scripts/reference/sum_pi_squared_reference.py VERL_CHECKOUT [OUT_JSON]

VERL_CHECKOUT is a local checkout of https://github.com/verl-project/verl. For each committed tiny
checkpoint (runtime/model/fixtures/tiny-llama, tiny-qwen2) and each sequence of its
`expected.json`, transformers computes the logits of tokens 1.. and verl's
`calculate_sum_pi_squared_from_logits` (verl/utils/torch_functional.py, loaded as
algos_reference.py loads it) turns them into Σ_v π(v)² at several temperatures. Writes
runtime/model/fixtures/sum_pi_squared.json by default. Needs torch and transformers.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algos_reference import load_core_algos  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "runtime" / "model" / "fixtures"
MODELS = ["tiny-llama", "tiny-qwen2"]
# 0.3 sharpens the tiny models' flat distributions, so Σπ² spans more than its 1/V floor.
TEMPERATURES = [1.0, 0.7, 0.3]


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    verl_dir = Path(sys.argv[1]).resolve()
    out_path = Path(sys.argv[2]) if len(sys.argv) == 3 else FIXTURES / "sum_pi_squared.json"
    _, verl_f, *_ = load_core_algos(verl_dir)
    try:
        commit = subprocess.run(
            ["git", "-C", str(verl_dir), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    models = {}
    for name in MODELS:
        model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype=torch.float32).eval()
        expected = json.loads((FIXTURES / name / "expected.json").read_text())
        cases = []
        for seq in expected["sequences"]:
            ids = seq["ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, :-1].float()
            for t in TEMPERATURES:
                spp = verl_f.calculate_sum_pi_squared_from_logits(logits / t)
                cases.append({"ids": ids, "temperature": t, "sum_pi_squared": [float(f"{v:.8g}") for v in spp.tolist()]})
        models[name] = cases
    out = {
        "verl_commit": commit,
        "generated_by": "scripts/reference/sum_pi_squared_reference.py",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "models": models,
    }
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    print(out_path, sum(len(c) for c in models.values()), "cases")


if __name__ == "__main__":
    main()
