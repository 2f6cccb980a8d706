"""What the reference scripts share: verl's functions taken from a checkout by their syntax tree
(so that the rest of verl and its dependencies are not imported), and the checkout's commit.
Standard library only."""

import __future__
import ast
import contextlib
import io
import json
import random
import subprocess
import sys
from pathlib import Path


def load(verl_dir: Path, relpath: str, wanted, namespace: dict) -> dict:
    """Runs the top-level statements of `verl_dir/relpath` that `wanted(node)` picks (function
    definitions, assignments) in `namespace`, with annotations left unevaluated, and returns it."""
    source_path = verl_dir / relpath
    if not source_path.is_file():
        sys.exit(f"{verl_dir} is not a verl checkout: no {relpath}")
    tree = ast.parse(source_path.read_text())
    module = ast.Module(body=[n for n in tree.body if wanted(n)], type_ignores=[])
    flags = __future__.annotations.compiler_flag
    exec(compile(module, str(source_path), "exec", flags=flags, dont_inherit=True), namespace)
    return namespace


def functions(names) -> "callable":
    """A `wanted` for `load`: the function definitions named `names`."""
    names = set(names)
    return lambda node: isinstance(node, ast.FunctionDef) and node.name in names


def require(namespace: dict, names, where: str):
    missing = set(names) - set(namespace)
    if missing:
        sys.exit(f"{where} lacks {sorted(missing)}")


def commit(verl_dir: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(verl_dir), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def reward_cases(reward_score, rules: dict, count, seed: int) -> list:
    """`count(rule)` distinct seeded cases of each rule of `rules` (name -> maker(rng) returning
    `(data_source, solution, ground_truth)`), each scored by verl's `default_compute_score` with
    its prints (errors, timeouts) silenced."""
    rng = random.Random(seed)
    cases = []
    for rule, make in rules.items():
        seen = set()
        while sum(c["rule"] == rule for c in cases) < count(rule):
            source, solution, truth = make(rng)
            key = (source, solution, json.dumps(truth))
            if key in seen:
                continue
            seen.add(key)
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                result = reward_score.default_compute_score(source, solution, truth)
            cases.append({"rule": rule, "data_source": source, "solution": solution,
                          "ground_truth": truth, "result": result})
    return cases
