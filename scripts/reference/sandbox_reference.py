#!/usr/bin/env python3
"""Reference scores of verl's SandboxFusion code reward for verl-core's parity test.

    python3 scripts/reference/sandbox_reference.py VERL_CHECKOUT URL [OUT_JSON]

VERL_CHECKOUT is a local checkout of https://github.com/verl-project/verl (the directory that holds
the `verl` package); URL is a SandboxFusion `/run_code` endpoint — the fake server
`scripts/fake_sandbox_fusion.py` (`python3 scripts/fake_sandbox_fusion.py --port 0` prints it,
append `/run_code`). The script imports verl's `verl/utils/reward_score/sandbox_fusion/` package by
path (it needs `requests`; nothing else of verl is imported), builds seeded code-generation cases —
stdin/stdout problems answered right, wrong, partly right, with trailing newlines or spaces,
runtime errors, exits, time-outs, memory exhaustion, syntax errors, no code block, several code
blocks, language tags; call-based (`fn_name`) problems with global functions and `Solution`
classes, every result type, missing functions, APPS-style argument lists; `assert_case` problems;
more than 10 test cases; malformed test cases; continuous and all-cases scores — and scores each
with verl's own `sandbox_fusion.compute_score` against URL. C++ cases (compile errors, a compile
error in one case's `assert_case` spreading to the later cases) go through verl's
`check_correctness(language="cpp")`, since `compute_score` always sends Python. It writes the
cases with verl's score and per-case statuses as JSON (default:
core/rewards/tests/data/verl_sandbox_reference.json). `core/rewards/tests/sandbox_parity.rs` starts the same
fake server and replays the file without verl.
"""

import concurrent.futures
import contextlib
import importlib.util
import io
import json
import logging
import random
import sys
import threading
import types
from pathlib import Path

import verl_source

SEED = 20261202
SAMPLES = 330
# Requests in flight at once (verl's `reward_model.sandbox_fusion.max_concurrent`), kept low so
# that time limits are not hit by load alone.
MAX_CONCURRENT = 6
MEMORY_LIMIT_MB = 1024
# The run time limit of cases that loop forever (verl's default, 10 s, for the rest).
SHORT_TIMEOUT = 2


def load_sandbox_fusion(verl_dir: Path):
    pkg = verl_dir / "verl" / "utils" / "reward_score" / "sandbox_fusion"
    if not (pkg / "__init__.py").is_file():
        sys.exit(f"{verl_dir} is not a verl checkout: no verl/utils/reward_score/sandbox_fusion/")
    for name in ["verl", "verl.utils", "verl.utils.reward_score"]:
        m = types.ModuleType(name)
        m.__path__ = []
        sys.modules[name] = m
    name = "verl.utils.reward_score.sandbox_fusion"
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --- stdin/stdout problems: (name, make input(rng), answer(input) -> str, right code, wrong code,
#     partly right code (right when the first number is even), code raising on odd first numbers,
#     code looping forever on odd first numbers)
def nums(rng, k=2):
    return [rng.randint(-50, 99) for _ in range(k)]


PROBLEMS = [
    ("sum",
     lambda rng: " ".join(map(str, nums(rng))) + "\n",
     lambda s: str(sum(map(int, s.split()))),
     "a, b = map(int, input().split())\nprint(a + b)",
     "a, b = map(int, input().split())\nprint(a - b)",
     "a, b = map(int, input().split())\nprint(a + b if a % 2 == 0 else a * b)",
     "a, b = map(int, input().split())\nif a % 2:\n    raise ValueError(a)\nprint(a + b)",
     "a, b = map(int, input().split())\nwhile a % 2:\n    pass\nprint(a + b)"),
    ("sorted",
     lambda rng: (lambda xs: f"{len(xs)}\n{' '.join(map(str, xs))}\n")(nums(rng, rng.randint(1, 6))),
     lambda s: " ".join(map(str, sorted(map(int, s.split("\n")[1].split())))),
     "input()\nxs = sorted(map(int, input().split()))\nprint(*xs)",
     "input()\nxs = sorted(map(int, input().split()), reverse=True)\nprint(*xs)",
     "input()\nxs = list(map(int, input().split()))\nprint(*(sorted(xs) if xs[0] % 2 == 0 else xs))",
     "input()\nxs = list(map(int, input().split()))\nprint(*sorted(xs), [][xs[0] % 2])",
     "import time\ninput()\nxs = list(map(int, input().split()))\nwhile xs[0] % 2:\n    time.sleep(0.05)\nprint(*sorted(xs))"),
    ("lines",
     lambda rng: (lambda n: f"{n}\n")(rng.randint(-9, 12)),
     lambda s: "\n".join(str(i * i) for i in range(int(s))),
     "n = int(input())\nfor i in range(n):\n    print(i * i)",
     "n = int(input())\nfor i in range(n + 1):\n    print(i * i)",
     "n = int(input())\nfor i in range(n if n % 2 == 0 else n - 1):\n    print(i * i)",
     "import sys\nn = int(input())\nfor i in range(n):\n    print(i * i)\nsys.exit(n % 2)",
     "n = int(input())\nwhile n % 2:\n    n += 2\nfor i in range(n):\n    print(i * i)"),
    ("upper",
     lambda rng: "".join(rng.choice("abcXYZ _") for _ in range(rng.randint(0, 8))) + str(rng.randint(0, 9)) + "\n",
     lambda s: s.rstrip("\n").upper(),
     "print(input().upper())",
     "print(input().lower())",
     "s = input()\nprint(s.upper() if int(s[-1]) % 2 == 0 else s)",
     "s = input()\nassert int(s[-1]) % 2 == 0, s\nprint(s.upper())",
     "s = input()\nwhile int(s[-1]) % 2:\n    pass\nprint(s.upper())"),
]

PROSE = ["Here is my solution.", "Let me think step by step.\n", "", "The answer:\n", "Solution:"]


def fence(rng, code, style):
    before, after = rng.choice(PROSE), rng.choice(PROSE)
    if style == "python":
        return f"{before}\n```python\n{code}\n```\n{after}"
    if style == "bare":
        return f"{before}\n```\n{code}\n```\n{after}"
    if style == "tagged":  # a generic block whose first line is a language name
        return f"{before}\n```{rng.choice(['py', 'Python', 'cpp', 'text'])}\n{code}\n```\n{after}"
    if style == "python3":  # ```python3: the split leaves "3" as the first line of code
        return f"{before}\n```python3\n{code}\n```"
    if style == "unclosed":
        return f"{before}\n```python\n{code}\n"
    raise ValueError(style)


def several_blocks(rng, right, wrong):
    kind = rng.randrange(4)
    if kind == 0:  # the last ```python block counts
        return f"First try:\n```python\n{wrong}\n```\nFixed:\n```python\n{right}\n```"
    if kind == 1:
        return f"```python\n{right}\n```\nor worse:\n```python\n{wrong}\n```"
    if kind == 2:  # without ```python, the first block counts
        return f"```\n{right}\n```\nand\n```\n{wrong}\n```"
    return f"```\n{wrong}\n```\nbut in Python:\n```python\n{right}\n```"


def io_case(rng):
    name, make, answer, right, wrong, partial, raising, looping = rng.choice(PROBLEMS)
    n = rng.choice([1, 2, 3, 4, 5, 8, 10, 11, 12, 15])
    inputs = [make(rng) for _ in range(n)]
    outputs = []
    for s in inputs:
        out = answer(s)
        style = rng.random()
        outputs.append(out + "\n" if style < 0.5 else out if style < 0.8 else out + "\n\n")
    if name == "sum" and rng.random() < 0.3:  # integer expected outputs: str(5) == "5"
        outputs = [int(o) for o in outputs]
    variant = rng.choice(["right", "right", "wrong", "partial", "partial", "raising", "looping",
                          "trailing_newlines", "trailing_space", "stderr", "syntax", "memory",
                          "no_block", "several", "exit_after"])
    timeout = None
    code = {"right": right, "wrong": wrong, "partial": partial, "raising": raising,
            "looping": looping}.get(variant, right)
    if variant == "looping":
        timeout = SHORT_TIMEOUT
    elif variant == "trailing_newlines":
        code = right + "\nprint()\nprint()"
    elif variant == "trailing_space":  # a line of spaces: rstrip("\n") keeps it
        code = right + "\nprint('  ')"
    elif variant == "stderr":
        code = "import sys\nsys.stderr.write('debug\\n')\n" + right
    elif variant == "syntax":
        code = right.replace(":", "", 1) if ":" in right else right + "\nprint(("
    elif variant == "memory":
        code = "blob = bytearray(3 * 1024 ** 3)\n" + right
    elif variant == "exit_after":
        code = right + "\nimport sys\nsys.exit(1)"
    if variant == "no_block":
        completion = rng.choice([code, f"Just run:\n{code}", "I cannot solve this."])
    elif variant == "several":
        completion = several_blocks(rng, right, wrong)
    else:
        completion = fence(rng, code, rng.choice(["python", "python", "bare", "tagged", "python3",
                                                  "unclosed"]))
    truth = {"inputs": inputs, "outputs": outputs}
    return f"io/{variant}", completion, truth, timeout


# --- call-based problems: fn_name, inputs as one JSON argument per line
CALL_PROBLEMS = [
    ("add", lambda rng: [rng.randint(-9, 9), rng.randint(-9, 9)], lambda a, b: a + b,
     "def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b"),
    ("twoSum", lambda rng: (lambda xs: [xs, xs[0] + xs[-1]])(rng.sample(range(-20, 20), rng.randint(2, 5))),
     lambda xs, t: next([i, j] for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[i] + xs[j] == t),
     "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
     "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n"
     "                return [seen[target - x], i]\n            seen[x] = i",
     "class Solution:\n    def twoSum(self, nums, target):\n        return [0, len(nums) - 1]"),
    ("isPalindrome", lambda rng: ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4)))],
     lambda s: s == s[::-1],
     "def isPalindrome(s):\n    return s == s[::-1]", "def isPalindrome(s):\n    return s[0] == s[-1]"),
    ("half", lambda rng: [rng.randint(-9, 9)], lambda x: x / 2,
     "def half(x):\n    return x / 2", "def half(x):\n    return x // 2"),
    ("hyp", lambda rng: [rng.randint(1, 9), rng.randint(1, 9)], lambda a, b: (a * a + b * b) ** 0.5,
     "def hyp(a, b):\n    return sqrt(a * a + b * b)", "def hyp(a, b):\n    return pow(a * a + b * b, 1, 7)"),
    ("counts", lambda rng: ["".join(rng.choice("xyz") for _ in range(rng.randint(0, 5)))],
     lambda s: {c: s.count(c) for c in dict.fromkeys(s)},
     "def counts(s):\n    return dict(Counter(s))", "def counts(s):\n    return sorted(Counter(s).items())"),
    ("firstTwo", lambda rng: [rng.sample(range(10), 3)], lambda xs: list(xs[:2]),
     "def firstTwo(xs):\n    return tuple(xs[:2])", "def firstTwo(xs):\n    return set(xs[:2])"),
    ("nothing", lambda rng: [], lambda: None,
     "def nothing():\n    pass", "def nothing():\n    return 0"),
    ("powmod", lambda rng: [rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 9)],
     lambda a, b, m: pow(a, b, m),
     "def powmod(a, b, m):\n    return pow(a, b, m)",  # the builtin pow: star imports of math come first
     "def powmod(a, b, m):\n    return math.pow(a, b) % m"),
]


def call_output(value, style):
    """An expected output as datasets spell it: the driver's rendering, or a list/number value."""
    rendered = json.dumps(value) if isinstance(value, (dict, list, tuple, bool)) or value is None else str(value)
    if style == 0:
        return rendered
    if style == 1:
        return rendered + "\n"
    if isinstance(value, dict):
        # Not as a dict: verl-core keeps JSON objects in sorted key order (see sandbox/mod.rs).
        return rendered
    return value  # verl compares str(value): Python's repr of lists, True, None, …


def call_case(rng):
    fn, make, answer, right, wrong = rng.choice(CALL_PROBLEMS)
    n = rng.choice([1, 2, 3, 5, 12])
    args = [make(rng) for _ in range(n)]
    style = rng.randrange(3)
    outputs = [call_output(answer(*a), style) for a in args]
    variant = rng.choice(["right", "right", "wrong", "partial", "missing", "raising", "exit", "unserialisable",
                          "apps_args", "trailing_newline", "star_names", "time_name", "solution_class"])
    code = {"wrong": wrong}.get(variant, right)
    inputs = ["\n".join(json.dumps(x) for x in a) for a in args]
    if variant == "partial":
        code = right + f"\n_real = {fn}\n" \
            f"def {fn}(*a):\n    return _real(*a) if len(str(a)) % 2 == 0 else None"
    elif variant == "missing":
        code = right.replace(f"def {fn}(", f"def {fn}_(", 1)
    elif variant == "raising":
        code = right + f"\n_real = {fn}\ndef {fn}(*a):\n    if len(str(a)) % 3 == 0:\n        raise KeyError(a)\n" \
            "    return _real(*a)"
    elif variant == "exit":
        code = right + f"\n_real = {fn}\ndef {fn}(*a):\n    if len(str(a)) % 2:\n        exit(3)\n    return _real(*a)"
    elif variant == "unserialisable":
        code = right + f"\n_real = {fn}\ndef {fn}(*a):\n    return [_real(*a), {{1}}]"
    elif variant == "apps_args":  # APPS/TACO keep each case's arguments as one list
        inputs = list(args) if rng.random() < 0.7 else [json.dumps(a) for a in args]
    elif variant == "trailing_newline":
        inputs = [s + "\n" for s in inputs]
    elif variant == "star_names":  # names the driver's star imports provide, unimported
        code = "_unused = [deque, heappush, bisect_left, reduce, accumulate, gcd, Optional, ascii_letters]\n" + code
    elif variant == "time_name":  # `time` is datetime.time after the star imports
        code = "_t = time.sleep\n" + code
    elif variant == "solution_class" and "class Solution" not in code:
        body = code.replace("\n", "\n    ").replace(f"def {fn}(", f"def {fn}(self, ", 1)
        code = "class Solution:\n    " + body
    completion = fence(rng, code, rng.choice(["python", "bare", "python3"]))
    truth = {"fn_name": fn, "inputs": inputs, "outputs": outputs}
    if rng.random() < 0.5:
        truth = json.dumps(truth)
    return f"call/{variant}", completion, truth, None


def assert_case(rng):
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    right = "def mul(a, b):\n    return a * b"
    code = rng.choice([right, "def mul(a, b):\n    return a + b"])
    n = rng.choice([1, 3, 4])
    cases = [f"assert mul({a + i}, {b}) == {(a + i) * b}" for i in range(n)]
    truth = {"assert_case": cases}
    kind = rng.randrange(3)
    if kind == 1:
        truth["inputs"] = [None] * n  # stdin None
    elif kind == 2:
        truth["outputs"] = [None] * (n - 1) + [""]
    return "assert", fence(rng, code, "python"), truth, None


def malformed_case(rng):
    good = "```python\nprint(input())\n```"
    kind = rng.randrange(8)
    truth = [
        "{not json",
        {"inputs": ["1\n"]},
        {"outputs": ["1\n"]},
        {"inputs": ["1\n", "2\n"], "outputs": ["1\n"]},
        {"inputs": [], "outputs": []},
        {"inputs": ["1\n"], "outputs": ["1"], "assert_case": ["", ""]},
        {},
        json.dumps({"inputs": ["7\n", None], "outputs": ["7", ""]}),
    ][kind]
    return f"malformed/{kind}", good, truth, None


KINDS = [(io_case, 0.55), (call_case, 0.3), (assert_case, 0.07), (malformed_case, 0.08)]

# C++ through check_correctness: (code, assert cases or None, inputs, outputs).
CPP_SUM = "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }"
CPP_CASES = [
    ("right", CPP_SUM, None),
    ("compile_error", CPP_SUM.replace("std::endl;", "std::endl"), None),
    ("wrong", CPP_SUM.replace("a + b", "a - b"), None),
    # The second case's appended code does not compile: verl marks every later case too.
    ("assert_compile_error", CPP_SUM, ["", "int broken(", "", ""]),
    ("runtime_error", CPP_SUM.replace("std::cout", "if (a > 0) return 3; std::cout"), None),
]


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    verl_dir = Path(sys.argv[1]).resolve()
    url = sys.argv[2]
    out_path = Path(sys.argv[3]) if len(sys.argv) == 4 else (
        Path(__file__).resolve().parents[2] / "core" / "tests" / "data" / "verl_sandbox_reference.json")
    sandbox_fusion = load_sandbox_fusion(verl_dir)
    logging.disable(logging.CRITICAL)
    rng = random.Random(SEED)
    semaphore = threading.Semaphore(MAX_CONCURRENT)
    samples = []
    seen = set()
    while len(samples) < SAMPLES:
        make = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
        kind, completion, truth, timeout = make(rng)
        key = (completion, json.dumps(truth))
        if key in seen:
            continue
        seen.add(key)
        samples.append({"kind": kind, "completion": completion, "test_cases": truth,
                        "continuous": rng.random() < 0.7, "timeout": timeout or 10})

    def score(sample):
        # compute_score mutates a dict's test cases (setdefault): give it a copy.
        truth = sample["test_cases"]
        truth = json.loads(json.dumps(truth)) if isinstance(truth, dict) else truth
        value, metadata = sandbox_fusion.compute_score(
            url, semaphore, MEMORY_LIMIT_MB, sample["completion"], truth,
            continuous=sample["continuous"], timeout=sample["timeout"])
        return {**sample, "score": value, "statuses": [m.get("status", m.get("error")) for m in metadata]}

    def check_cpp(case):
        name, code, asserts = case
        inputs = ["3 4\n", "-5 2\n", "10 0\n", "1 1\n"]
        in_outs = {"inputs": inputs, "outputs": ["7", "-3", "10", "2"]}
        if asserts is not None:
            in_outs["assert_case"] = asserts
        results, metadata = sandbox_fusion.utils.check_correctness(
            url, in_outs, code, timeout=10, memory_limit_mb=MEMORY_LIMIT_MB, language="cpp",
            concurrent_semaphore=semaphore)
        return {"kind": f"cpp/{name}", "code": code, "in_outs": in_outs, "results": results,
                "statuses": [m.get("status", m.get("error")) for m in metadata]}

    # verl prints tracebacks of failing cases: silenced (once, as redirection is process-wide).
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        scored = list(pool.map(score, samples))
        cpp = list(pool.map(check_cpp, CPP_CASES))
    out = {
        "verl_commit": verl_source.commit(verl_dir),
        "generated_by": "scripts/reference/sandbox_reference.py",
        "python": sys.version.split()[0],
        "seed": SEED,
        "memory_limit_mb": MEMORY_LIMIT_MB,
        "samples": scored,
        "cpp": cpp,
    }
    out_path.write_text(json.dumps(out, ensure_ascii=False, indent=0) + "\n")
    kinds = {}
    for s in scored:
        kinds.setdefault(s["kind"], []).append(s["score"])
    summary = ", ".join(f"{k} {len(v)} (mean {sum(v) / len(v):.2f})" for k, v in sorted(kinds.items()))
    print(f"{len(scored)} samples: {summary}; {len(cpp)} C++ checks -> {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
