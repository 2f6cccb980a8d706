#!/usr/bin/env python3
"""Reference scores of verl's prime_math and geo3k rewards for verl-core's parity test.

    python scripts/reference/rewards2_reference.py VERL_CHECKOUT [OUT_JSON]

VERL_CHECKOUT is a local checkout of https://github.com/verl-project/verl (the directory that holds
the `verl` package). The script imports verl's `verl/utils/py_functional.py` (for the real
`timeout_limit`, standing in only for `verl.utils.metric`) and `verl/utils/reward_score/` by path,
builds seeded responses and ground truths for the `numina_*` sources (prime_math) and
`hiyouga/geometry3k` (geo3k) — numbers, thousands separators, decimals, fractions in every LaTeX
spelling, roots, pi, percentages, units, degrees, intervals, tuples, matrices, polynomials, choices,
equivalent and wrong answers, broken braces, answers found by `answer:`/`is`/`=`/boxed markers, the
think/boxed format — scores each with verl's own `default_compute_score` and writes the cases and
verl's results as JSON (default: core/rewards/tests/data/verl_rewards2_reference.json).

It needs verl's reward dependencies: `pip install sympy pylatexenc mathruler tqdm` (tqdm only because
mathruler imports it). `core/rewards/tests/rewards2_parity.rs` replays the file without Python.
"""

import importlib.util
import json
import sys
import types
from pathlib import Path

import verl_source

SEED = 20261202
CASES_PER_RULE = {"prime_math": 600, "geo3k": 400}

PRIME_SOURCES = ["numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                 "numina_cn_k12", "numina_olympiads"]


def load_reward_score(verl_dir: Path):
    pkg = verl_dir / "verl" / "utils" / "reward_score"
    if not (pkg / "__init__.py").is_file():
        sys.exit(f"{verl_dir} is not a verl checkout: no verl/utils/reward_score/__init__.py")
    for name in ["verl", "verl.utils"]:
        m = types.ModuleType(name)
        m.__path__ = []
        sys.modules[name] = m
    metric = types.ModuleType("verl.utils.metric")
    metric.Metric = type("Metric", (), {})
    sys.modules["verl.utils.metric"] = metric
    import_utils = types.ModuleType("verl.utils.import_utils")
    import_utils.deprecated = lambda _replacement=None: (lambda f: f)
    sys.modules["verl.utils.import_utils"] = import_utils

    def load(name, path, package=False):
        spec = importlib.util.spec_from_file_location(
            name, path, submodule_search_locations=[str(path.parent)] if package else None
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    load("verl.utils.py_functional", verl_dir / "verl" / "utils" / "py_functional.py")
    return load("verl.utils.reward_score", pkg / "__init__.py", package=True)


def pick(rng, items):
    return items[rng.randrange(len(items))]


# Ground truths with spellings a model might give for the same value (first: the data set's),
# as numina/MATH/gsm8k write them.
CLASSES = [
    ["42", "42.0", "42.00", "\\boxed{42}", "$42$", "42 \\text{ apples}", "forty-two", "042"],
    ["1000", "1,000", "1{,}000", "1\\,000", "10^3", "1e3", "1000.0", "999.99"],
    ["1,234,567", "1234567", "1,234,567.0", "1 234 567"],
    ["-3", "-3.0", "- 3", "−3", "-\\frac{6}{2}", "(-3)"],
    ["0", "0.0", "-0", "zero", "\\text{0}"],
    ["3.5", "3.50", "\\frac{7}{2}", "7/2", "3\\frac{1}{2}", "3 \\frac12", "3.499", "\\dfrac72"],
    ["\\frac{1}{2}", "\\frac12", "0.5", ".5", "1/2", "\\dfrac{1}{2}", "\\tfrac{1}{2}", "50\\%", "2/4",
     "\\frac{2}{4}", "0.50", "\\frac{1}{2}\\text{ hours}"],
    ["\\frac{3}{4}", "0.75", "3/4", "\\dfrac34", "75\\%", "75%", "6/8", "\\frac{6}{8}", "0.7499"],
    ["\\frac{1}{3}", "0.333", "0.3333", "1/3", "\\frac{2}{6}", "0.\\overline{3}", "\\dfrac{1}{3}"],
    ["-\\frac{2}{3}", "\\frac{-2}{3}", "-2/3", "-\\dfrac23", "\\frac{2}{-3}", "-0.6667", "-0.667"],
    ["\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", "\\sqrt{3}/2", "0.866", "0.8660", "\\frac{1}{2}\\sqrt{3}",
     "\\sqrt{\\frac{3}{4}}", "\\frac{3}{2\\sqrt{3}}"],
    ["\\sqrt{2}", "\\sqrt2", "2^{1/2}", "1.414", "1.4142", "\\frac{2}{\\sqrt{2}}", "\\sqrt{8}/2"],
    ["2\\sqrt{3}", "2\\sqrt3", "\\sqrt{12}", "2 \\sqrt{3}", "3.464", "3.4641", "2*\\sqrt{3}"],
    ["\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", "\\sqrt{2}/2", "0.7071", "\\frac{\\sqrt2}2"],
    ["1+\\sqrt{5}", "\\sqrt{5}+1", "1 + \\sqrt5", "3.236", "\\frac{2+2\\sqrt{5}}{2}"],
    ["\\pi", "3.14", "3.1416", "\\pi r^0", "180^\\circ"],
    ["2\\pi", "6.28", "6.2832", "2 \\pi", "\\frac{4\\pi}{2}", "\\pi \\cdot 2"],
    ["\\frac{\\pi}{4}", "0.785", "\\pi/4", "\\frac14\\pi", "45^\\circ", "0.7854"],
    ["10\\%", "10%", "10", "0.1", "0.10", "\\frac{1}{10}", "10 percent"],
    ["25", "25\\%", "0.25", "25%", "\\$25", "$25", "25 dollars", "25.00"],
    ["90^\\circ", "90", "90^{\\circ}", "90 degrees", "90°", "\\frac{\\pi}{2}", "90^\\circ C"],
    ["5 \\text{ cm}", "5", "5cm", "5 centimeters", "5\\text{cm}", "5 \\mbox{cm}", "50 mm"],
    ["12 \\text{ inches}", "12", "12 inches", "1 foot", "12\\text{in}"],
    ["x=5", "5", "x = 5", "k=5", "x=5.0", "y=5"],
    ["(1, 2)", "(1,2)", "\\left( 1, 2 \\right)", "(1.0, 2.0)", "(2, 1)", "[1, 2]", "1, 2", "(1, 2, 3)"],
    ["[0, 1)", "[0,1)", "[0, 1]", "(0, 1)", "\\left[0, 1\\right)", "Interval.Ropen(0, 1)", "[0, 1.0)"],
    ["(-\\infty, 3]", "(-\\infty,3]", "(-inf, 3]", "(-\\infty, 3)", "x \\le 3", "Interval(-oo, 3)"],
    ["\\{1, 2\\}", "1, 2", "\\{1,2\\}", "2, 1", "1 \\text{ and } 2", "1 or 2", "\\{2, 1\\}"],
    ["2, 3", "3, 2", "2,3", "x=2, x=3", "2 \\text{ and } 3", "(2, 3)"],
    ["x^2+1", "x^2 + 1", "1+x^2", "x**2+1", "(x^2+1)", "x^{2}+1", "x^2-1", "x \\cdot x + 1"],
    ["2x+3", "3+2x", "2 x + 3", "x+x+3", "2x + 3", "2(x+1)+1", "2x+4", "2*x+3"],
    ["(x+1)^2", "x^2+2x+1", "(x + 1)^2", "(1+x)^2", "x^2+2x+2", "(x+1)(x+1)"],
    ["\\text{(A)}", "A", "(A)", "\\textbf{(A)}", "\\text{A}", "B", "\\text{(B)}", "a"],
    ["C", "\\text{C}", "(C)", "c", "\\mathrm{C}", "D"],
    ["\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", "[1, 2]", "(1, 2)",
     "\\begin{pmatrix} 1 \\\\ 3 \\end{pmatrix}", "[[1], [2]]", "Matrix([1, 2])"],
    ["\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
     "[[1, 2], [3, 4]]", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 5 \\end{pmatrix}"],
    ["1010_2", "10", "1010", "1010_{2}", "1011_2"],
    ["3 \\frac{3}{4}", "3.75", "\\frac{15}{4}", "15/4", "3 3/4", "3\\frac34"],
    ["2.5 \\text{ hours}", "2.5", "2.5 hours", "150 minutes", "\\frac{5}{2}"],
    ["1.5 million", "1500000", "1,500,000", "1.5 \\times 10^6", "1.5*10^6"],
    ["\\infty", "infinity", "\\infty", "inf", "oo"],
    ["\\sqrt{x}", "x^{1/2}", "\\sqrt x", "x^0.5", "\\sqrt{y}"],
    ["\\frac{x}{2}", "x/2", "0.5x", "\\frac12 x", "\\frac{1}{2}x", "\\frac{x}{3}"],
    ["18", "18.0", "\\$18", "18 dollars", "eighteen", "17", "18.", "1 8"],
    ["7", "7.0", "\\boxed{7}", "seven", "7\\%", "7^\\circ", "\\frac{14}{2}", "6.9999999"],
    ["100", "100.0", "1e2", "10^2", "100\\%", "1", "99.99"],
    ["0.1", ".1", "\\frac{1}{10}", "10\\%", "1/10", "0.10", "0.11"],
    ["\\text{yes}", "yes", "Yes", "\\text{Yes}", "no", "YES"],
    ["-1, 1", "1, -1", "\\pm 1", "-1,1", "(-1, 1)", "1"],
    ["\\frac{4}{3}\\pi", "\\frac{4\\pi}{3}", "4.189", "4.19", "\\frac43 \\pi", "4\\pi/3"],
    # Algebra that reaches sympy: rational functions, factored forms, nested radicals, powers.
    ["\\frac{x+1}{x-1}", "(x+1)/(x-1)", "\\frac{1+x}{x-1}", "1+\\frac{2}{x-1}", "\\frac{x-1}{x+1}"],
    ["x^2-4", "(x-2)(x+2)", "(x+2)(x-2)", "x^2+4", "(x-2)^2", "x^2 - 4"],
    ["\\sqrt{3}+\\sqrt{2}", "\\sqrt2+\\sqrt3", "3.146", "\\sqrt{5+2\\sqrt{6}}", "\\sqrt{5}"],
    ["\\frac{1}{x}", "x^{-1}", "1/x", "\\frac{2}{2x}", "x^(-1)", "x^-1"],
    ["3x^2y", "3yx^2", "3x^2 y", "x^2y*3", "3xy^2"],
    ["2^{10}", "1024", "2^10", "1,024", "2^{11}"],
    ["\\frac{\\sqrt{6}}{3}", "\\sqrt{\\frac{2}{3}}", "\\frac{2}{\\sqrt{6}}", "0.8165", "\\frac{\\sqrt6}{2}"],
    ["e^2", "e^{2}", "7.389", "e*e", "2e"],
    ["a+b", "b+a", "a + b", "ab", "a-b"],
    ["5!", "120", "5 \\cdot 4 \\cdot 3 \\cdot 2", "\\frac{6!}{6}", "4!"],
    ["(2, -3)", "(2,-3)", "(2, - 3)", "(-3, 2)", "x=2, y=-3", "(2.0, -3.0)"],
    ["\\frac{9}{4}", "2.25", "2\\frac14", "\\left(\\frac{3}{2}\\right)^2", "9/4", "\\frac{18}{8}"],
    ["\\frac{\\sqrt{3}}{3}x", "\\frac{x}{\\sqrt{3}}", "\\frac{x\\sqrt3}{3}", "0.577x", "\\sqrt{3}x"],
    ["2\\sqrt{2}-1", "-1+2\\sqrt2", "\\sqrt{8}-1", "1.828", "2\\sqrt{2}+1"],
]


def numeric_truth(rng):
    """gsm8k-like integers and decimals, with a near answer."""
    n = rng.choice([rng.randrange(0, 100), rng.randrange(100, 100000), round(rng.uniform(0, 100), 2)])
    truth = str(n)
    near = [truth, f"{n:,}", str(n + 1), str(n) + ".0", "\\$" + str(n), str(n) + "\\%", "-" + str(n)]
    return truth, near


def mutate(rng, s):
    """A broken copy: a brace added or dropped, spaces, case."""
    r = rng.random()
    if r < 0.4:
        i = rng.randrange(len(s) + 1)
        return s[:i] + pick(rng, ["{", "}", "\\", "", "$"]) + s[i:]
    if r < 0.7:
        return s.replace(" ", pick(rng, ["", "  ", "\n", "\t"]))
    return s.upper() if rng.random() < 0.5 else " " + s + " "


def truth_and_answer(rng):
    if rng.random() < 0.2:
        truth, pool = numeric_truth(rng)
    else:
        cls = pick(rng, CLASSES)
        truth, pool = cls[0], cls
    r = rng.random()
    if r < 0.65:
        answer = pick(rng, pool)
    elif r < 0.85:
        answer = pick(rng, pick(rng, CLASSES))
    else:
        answer = mutate(rng, pick(rng, pool))
    return truth, answer


FILLER = ["Let me think step by step.", "First, we compute the sum.", "We have $x + y = 10$.",
          "Checking: 3 + 4 = 7.", "So", "Hence", "Note that {a} and {b} are sets.", "Step 1: set up.",
          "Step 2: solve.", "It follows that", "The area is large", "# Solution"]


def filler(rng, n):
    return " ".join(pick(rng, FILLER) for _ in range(n))


def prime_solution(rng, answer, other):
    """A response that states `answer` in one of the ways prime_math's extractor looks for."""
    layout = rng.randrange(16)
    pre = filler(rng, rng.randrange(3))
    if layout == 0:
        return f"{pre} The answer is {answer}."
    if layout == 1:
        return f"{pre}\nAnswer: {answer}"
    if layout == 2:
        return f"{pre} Step 1: x. Step 2: y. \\boxed{{{answer}}}"
    if layout == 3:
        return f"{pre} so $x = {answer}$"
    if layout == 4:
        return f"{pre} we get {answer}"
    if layout == 5:
        return f"{answer} is the answer"
    if layout == 6:
        return f"\\boxed{{{other}}} wait, actually \\boxed{{{answer}}}"
    if layout == 7:
        return f"The answer is {other}. Actually the answer is {answer}"
    if layout == 8:
        return f"{pre} \\boxed{{{answer}"
    if layout == 9:
        return f"{answer}"
    if layout == 10:
        return f"Final answer: \\fbox{{{answer}}}"
    if layout == 11:
        return f"The answers are {answer}\n"
    if layout == 12:
        return f"{pre}. Thus it must be\n{answer}"
    if layout == 13:
        return f"Answer: {answer}. So the answer is {other}"
    if layout == 14:
        return f"{pre} I get: {answer}\n\n"
    return f"{pre}"


def prime_math_case(rng):
    truth, answer = truth_and_answer(rng)
    other = pick(rng, pick(rng, CLASSES))
    return pick(rng, PRIME_SOURCES), prime_solution(rng, answer, other), truth


def geo3k_solution(rng, answer, other):
    think = pick(rng, ["<think>Angles sum to 180.</think>", "<think>\nuse Pythagoras\n</think>\n", "<think></think>",
                       "<think>x", "", "<Think>t</Think>", "</think>", " <think>a</think>"])
    box = pick(rng, ["\\boxed{%s}", "The answer is \\boxed{%s}.", "\\boxed{ %s }", "\\boxed{\\boxed{%s}}",
                     "\\boxed{%s", "%s", "\\boxed {%s}", "$\\boxed{%s}$\n"]) % answer
    layout = rng.randrange(5)
    if layout == 0:
        return think + box
    if layout == 1:
        return think + "\\boxed{" + other + "} then " + box
    if layout == 2:
        return box + think
    if layout == 3:
        return think + filler(rng, 2) + "\n" + box + pick(rng, ["", "\n", " done", "}"])
    return think + box + " \\boxed{" + other + "}"


GEO_TRUTHS = ["3", "12.5", "60", "\\frac{40}{3}", "2\\sqrt{221}", "8\\sqrt{3}", "45", "14.4", "\\frac{5}{2}",
              "25\\pi", "120", "7.5", "4\\sqrt{2}", "30", "0.5"]
GEO_ANSWERS = {
    "3": ["3", "3.0", "3.00", "\\frac{6}{2}", "4", "03"],
    "12.5": ["12.5", "12.50", "\\frac{25}{2}", "25/2", "12.4", "12 \\frac{1}{2}"],
    "60": ["60", "60^\\circ", "60^{\\circ}", "60 degrees", "\\frac{\\pi}{3}", "60.0", "61"],
    "\\frac{40}{3}": ["\\frac{40}{3}", "40/3", "13.33", "13.333", "\\dfrac{40}{3}", "\\frac{80}{6}", "13\\frac13"],
    "2\\sqrt{221}": ["2\\sqrt{221}", "2 \\sqrt{221}", "\\sqrt{884}", "29.73", "2\\sqrt221", "\\sqrt{221}"],
    "8\\sqrt{3}": ["8\\sqrt{3}", "8\\sqrt3", "\\sqrt{192}", "13.86", "8 \\sqrt{3}", "\\frac{24}{\\sqrt{3}}"],
    "45": ["45", "45^\\circ", "45.0", "\\frac{\\pi}{4}", "45 degrees", "44"],
    "14.4": ["14.4", "14.40", "\\frac{72}{5}", "72/5", "14"],
    "\\frac{5}{2}": ["\\frac{5}{2}", "2.5", "5/2", "\\frac52", "2\\frac{1}{2}", "\\frac{10}{4}", "3"],
    "25\\pi": ["25\\pi", "25 \\pi", "78.54", "\\pi 25", "25\\cdot\\pi", "25*\\pi", "50\\pi"],
    "120": ["120", "120^\\circ", "120.0", "\\frac{2\\pi}{3}", "1,20", "12"],
    "7.5": ["7.5", "\\frac{15}{2}", "15/2", "7.50", "7\\frac12", "7"],
    "4\\sqrt{2}": ["4\\sqrt{2}", "\\sqrt{32}", "5.657", "4\\sqrt2", "2\\sqrt{8}", "4 \\sqrt 2"],
    "30": ["30", "30^\\circ", "\\text{30}", "30.", "\\frac{\\pi}{6}", "31"],
    "0.5": ["0.5", ".5", "\\frac12", "1/2", "50\\%", "0.50"],
}


def geo3k_case(rng):
    if rng.random() < 0.7:
        truth = pick(rng, GEO_TRUTHS)
        pool = GEO_ANSWERS[truth]
    else:
        cls = pick(rng, CLASSES)
        truth, pool = cls[0], cls
    answer = pick(rng, pool) if rng.random() < 0.85 else mutate(rng, pick(rng, pool))
    other = pick(rng, GEO_TRUTHS)
    return "hiyouga/geometry3k", geo3k_solution(rng, answer, other), truth


RULES = {"prime_math": prime_math_case, "geo3k": geo3k_case}


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    verl_dir = Path(sys.argv[1]).resolve()
    out_path = Path(sys.argv[2]) if len(sys.argv) == 3 else (
        Path(__file__).resolve().parents[2] / "core" / "tests" / "data" / "verl_rewards2_reference.json"
    )
    commit = verl_source.commit(verl_dir)
    reward_score = load_reward_score(verl_dir)
    cases = verl_source.reward_cases(reward_score, RULES, CASES_PER_RULE.get, SEED)
    out = {
        "verl_commit": commit,
        "generated_by": "scripts/reference/rewards2_reference.py",
        "python": sys.version.split()[0],
        "packages": {name: importlib.metadata.version(name) for name in ["sympy", "pylatexenc", "mathruler"]},
        "seed": SEED,
        "cases": cases,
    }
    out_path.write_text(json.dumps(out, ensure_ascii=False, indent=0) + "\n")
    counts = {rule: sum(c["rule"] == rule for c in cases) for rule in RULES}
    ones = {rule: sum(c["rule"] == rule and c["result"] > 0 for c in cases) for rule in RULES}
    print(f"{len(cases)} cases {counts}, positive {ones} -> {out_path}", file=sys.stderr)


if __name__ == "__main__":
    import importlib.metadata

    main()
