#!/usr/bin/env python3
"""Reference micro-batches of verl's `use_dynamic_bsz` for verl-core's parity test.

    python scripts/reference/micro_batches_reference.py VERL_CHECKOUT [OUT_JSON]

VERL_CHECKOUT is a local checkout of https://github.com/verl-project/verl (the directory that holds
the `verl` package). The script takes `calculate_workload`, `karmarkar_karp`,
`get_seqlen_balanced_partitions`, `ceildiv`, `roundup_divisible`, `rearrange_micro_batches`,
`get_reverse_idx` and `restore_dynamic_batch` from that checkout's
`verl/utils/seqlen_balancing.py` (by their syntax tree, so that the rest of verl — Ray,
tensordict, DataProto — is not imported), and runs verl's `rearrange_micro_batches` on seeded
padded batches (a TensorDict stand-in: a dict of tensors; torch.distributed is not initialised, as
on one rank): the micro-batches' row indices, or verl's error when the budget is smaller than
the padded width; and `restore_dynamic_batch` on the concatenated rows, which must give back the
input order. Needs torch (any CPU build). Writes
seqlen-balancing/tests/data/verl_micro_batches_reference.json by default;
`seqlen-balancing/tests/micro_batches_parity.rs` replays it without Python.
"""

import copy
import heapq
import json
import random
import sys
from itertools import chain
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import distributed as dist

import verl_source

SEED = 20261202
WANTED = [
    "calculate_workload",
    "karmarkar_karp",
    "get_seqlen_balanced_partitions",
    "ceildiv",
    "roundup_divisible",
    "rearrange_micro_batches",
    "get_reverse_idx",
    "restore_dynamic_batch",
]


def load_functions(verl_dir: Path) -> dict:
    # `tu.index_select_tensor_dict` on a plain dict of tensors, as verl's does on a TensorDict.
    tu = SimpleNamespace(index_select_tensor_dict=lambda batch, idx: {k: v[idx] for k, v in batch.items()})
    namespace = {
        "copy": copy,
        "heapq": heapq,
        "chain": chain,
        "torch": torch,
        "dist": dist,
        "tu": tu,
        "get_device_name": lambda: "cpu",
    }
    relpath = "verl/utils/seqlen_balancing.py"
    verl = verl_source.load(verl_dir, relpath, verl_source.functions(WANTED), namespace)
    verl_source.require(verl, WANTED, relpath)
    return verl


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    verl_dir = Path(sys.argv[1])
    out_path = (
        Path(sys.argv[2]) if len(sys.argv) == 3 else Path("seqlen-balancing/tests/data/verl_micro_batches_reference.json")
    )
    verl = load_functions(verl_dir)
    commit = verl_source.commit(verl_dir)
    rng = random.Random(SEED)
    cases = []
    for i in range(300):
        rows = rng.choice([1, 2, 3, 5, 8, 16, 32, 64, 128])
        width = rng.choice([4, 16, 48, 128, 1024])
        # Short ranges repeat lengths (ties between workloads); some rows may be all padding.
        low = rng.choice([0, 1, width // 2])
        seqlens = [rng.randint(low, width) for _ in range(rows)]
        if sum(seqlens) == 0:
            seqlens[0] = 1  # verl asks for 0 micro-batches then (an IndexError); verl-core runs one
        if i % 10 == 9:
            budget = rng.randint(1, width - 1)  # smaller than a padded row: verl's assertion
        else:
            budget = rng.choice([width, width + 1, 2 * width, 3 * width + 7, sum(seqlens) + 1, rng.randint(width, 4 * width)])
        mask = torch.zeros(rows, width, dtype=torch.int64)
        for r, n in enumerate(seqlens):
            start = rng.randint(0, width - n)  # the real tokens anywhere in the row, as left/right padding puts them
            mask[r, start : start + n] = 1
        batch = {"input_ids": torch.arange(rows * width).view(rows, width), "attention_mask": mask}
        case = {"seqlens": seqlens, "width": width, "max_token_len": budget}
        try:
            micro, partitions = verl["rearrange_micro_batches"](batch, max_token_len=budget)
        except AssertionError as e:
            case["error"] = str(e)
        else:
            case["partitions"] = partitions
            taken = torch.cat([m["input_ids"] for m in micro])
            restored = verl["restore_dynamic_batch"](taken, partitions)
            assert torch.equal(restored, batch["input_ids"]), "restore_dynamic_batch gives back the input order"
        cases.append(case)
    out = {
        "source": "verl/utils/seqlen_balancing.py rearrange_micro_batches (use_dynamic_bsz_balance=True, one rank)",
        "verl_commit": commit,
        "seed": SEED,
        "cases": cases,
    }
    out_path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    errors = sum("error" in c for c in cases)
    print(f"{out_path}: {len(cases)} cases ({errors} budget errors), verl {commit}")


if __name__ == "__main__":
    main()
