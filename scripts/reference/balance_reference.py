#!/usr/bin/env python3
"""Reference partitions of verl's sequence-length balancing for verl-core's parity test.

    python scripts/reference/balance_reference.py VERL_CHECKOUT [OUT_JSON]

VERL_CHECKOUT is a local checkout of https://github.com/verl-project/verl (the directory that holds
the `verl` package). The script takes `calculate_workload`, `karmarkar_karp`,
`get_seqlen_balanced_partitions` and `log_seqlen_unbalance` from that checkout's
`verl/utils/seqlen_balancing.py` (by their syntax tree, so that neither torch nor the rest of verl
is imported), runs them on seeded sequence lengths (ties included: lengths drawn from small ranges
repeat) and writes the cases and verl's results as JSON (default:
core/algo/tests/data/verl_balance_reference.json). Each `balance_batch` case also holds the order
`RayPPOTrainer._balance_batch` (verl/trainer/ppo/ray_trainer.py) trains in: its in-partition
ordering — sort by (workload, index), then even positions followed by the odd ones reversed — is the
four lines below in `balance_order`, transcribed from that method. Standard library only.
`core/algo/tests/balance_parity.rs` replays the file without Python.
"""

import heapq
import json
import random
import sys
from pathlib import Path

import verl_source

SEED = 20261201
WANTED = ["calculate_workload", "karmarkar_karp", "get_seqlen_balanced_partitions", "log_seqlen_unbalance"]


def load_functions(verl_dir: Path) -> dict:
    relpath = "verl/utils/seqlen_balancing.py"
    namespace = {"heapq": heapq, "List": list, "Tuple": tuple}
    verl = verl_source.load(verl_dir, relpath, verl_source.functions(WANTED), namespace)
    verl_source.require(verl, WANTED, relpath)
    return verl


def balance_order(verl, seqlens, k):
    workloads = [verl["calculate_workload"](s) for s in seqlens]
    partitions = verl["get_seqlen_balanced_partitions"](workloads, k_partitions=k, equal_size=True)
    for idx, partition in enumerate(partitions):
        partition.sort(key=lambda x: (workloads[x], x))
        partitions[idx] = partition[::2] + partition[1::2][::-1]
    order = [j for partition in partitions for j in partition]
    metrics = verl["log_seqlen_unbalance"](seqlen_list=seqlens, partitions=partitions, prefix="global_seqlen")
    return order, metrics


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    verl_dir = Path(sys.argv[1])
    out_path = Path(sys.argv[2]) if len(sys.argv) == 3 else Path("core/algo/tests/data/verl_balance_reference.json")
    verl = load_functions(verl_dir)
    commit = verl_source.commit(verl_dir)
    rng = random.Random(SEED)
    cases = []

    def lengths(n):
        # Small ranges repeat lengths (ties); wide ones are a real batch's spread.
        high = rng.choice([3, 8, 64, 512, 4096])
        return [rng.randint(1, high) for _ in range(n)]

    for _ in range(200):
        k = rng.choice([1, 2, 3, 4, 8])
        equal_size = rng.random() < 0.5
        n = k * rng.randint(1, 12) if equal_size else rng.randint(k, 8 * k + 5)
        values = lengths(n)
        if rng.random() < 0.5:
            values = [verl["calculate_workload"](s) for s in values]
        partitions = verl["get_seqlen_balanced_partitions"](values, k_partitions=k, equal_size=equal_size)
        cases.append({"kind": "partitions", "values": values, "k": k, "equal_size": equal_size, "partitions": partitions})
    for _ in range(150):
        k = rng.choice([1, 2, 4, 8])
        seqlens = lengths(k * rng.randint(1, 16))
        order, metrics = balance_order(verl, seqlens, k)
        cases.append({"kind": "balance_batch", "seqlens": seqlens, "k": k, "order": order, "metrics": metrics})
    out_path.write_text(json.dumps({"verl_commit": commit, "seed": SEED, "cases": cases}, indent=None) + "\n")
    print(f"{len(cases)} cases from verl {commit} -> {out_path} ({out_path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
