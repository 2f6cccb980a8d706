#!/usr/bin/env python3
"""Reference scores of verl's rule rewards for verl-core's parity test.

    python scripts/reference/rewards_reference.py VERL_CHECKOUT [OUT_JSON]

VERL_CHECKOUT is a local checkout of https://github.com/verl-project/verl (the directory that holds
the `verl` package). The script imports `verl/utils/reward_score/__init__.py` from it (standing in
only for `verl.utils.import_utils.deprecated`), builds seeded adversarial responses and ground
truths for every data source verl-core scores with a built-in rule — boxed answers with nested and
unbalanced braces, `Answer:` lines, units, fractions, LaTeX, answer tags, whitespace, long
responses that are clipped, wrong answers — scores each with verl's own `default_compute_score`
and writes the cases and verl's results as JSON (default: core/rewards/tests/data/verl_rewards_reference.json).
It needs the Python standard library only. `core/rewards/tests/rewards_parity.rs` replays the file without
Python.
"""

import importlib.util
import json
import sys
import types
from pathlib import Path

import verl_source

SEED = 20261201
CASES_PER_RULE = 400


def load_reward_score(verl_dir: Path):
    pkg = verl_dir / "verl" / "utils" / "reward_score"
    if not (pkg / "__init__.py").is_file():
        sys.exit(f"{verl_dir} is not a verl checkout: no verl/utils/reward_score/__init__.py")
    for name in ["verl", "verl.utils"]:
        m = types.ModuleType(name)
        m.__path__ = []
        sys.modules[name] = m

    def deprecated(_replacement=None):
        return lambda f: f

    import_utils = types.ModuleType("verl.utils.import_utils")
    import_utils.deprecated = deprecated
    sys.modules["verl.utils.import_utils"] = import_utils
    spec = importlib.util.spec_from_file_location(
        "verl.utils.reward_score", pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["verl.utils.reward_score"] = module
    spec.loader.exec_module(module)
    return module


# Answers as a model or a data set writes them: plain numbers, thousands separators, decimals,
# LaTeX fractions and roots (with and without braces), units, degrees, percentages, dollars,
# tuples and intervals, text wrappers, multiple choice, an equation's right-hand side.
MATH_ANSWERS = [
    "42", "-3", "0", "7", "1000", "1,000", "1,234,567", "3.14", ".5", "0.5", "2.50", "10",
    "\\frac{1}{2}", "\\frac12", "\\dfrac{3}{4}", "\\tfrac{3}{4}", "\\frac{3}{4}", "3/4", "\\frac1{72}",
    "\\frac{\\sqrt{3}}{2}", "\\sqrt{2}", "\\sqrt2", "2\\sqrt{3}", "2\\sqrt3", "\\sqrt{x}+1",
    "x=5", "k = 7", "y = 2x + 1", "5 \\text{ cm}", "12 \\text{ inches}", "10\\%", "10%",
    "90^\\circ", "90^{\\circ}", "45 degrees", "\\$5", "5 dollars", "\\$1,000", "6 units",
    "(1, 2)", "(1,2)", "\\left( 1, 2 \\right)", "[0, 1)", "(-\\infty, 3]", "\\{1, 2\\}",
    "\\text{(A)}", "\\text{B}", "\\textbf{C}", "(D)", "\\overline{AB}", "\\mathrm{th}",
    "a triangle", "an ellipse", "\\pi", "2\\pi", "\\frac{\\pi}{4}", "x^2+1", "x^{2}",
    "1{,}000", "3,\\!000", "\\text{m}", "5\\;", "\\ldots", "12 \\text{ and } 13",
    "\\boxed{4}", "$\\frac{1}{3}$", "\\mbox{yes}", "1\\ 000", "4\\text{s}", "\"42\"",
    "2, 3", "-\\frac{2}{3}", "\\frac{-2}{3}", "1\\frac{1}{2}", "0.333", "1e3", "½", "²",
]

WHITESPACE = [" ", "  ", "\t", "\n", " \n", "\u00a0", "\u2003", "\u3000", "\x1c", "\r\n", ""]

FILLER = [
    "Let me think step by step.", "First, we compute the sum.", "So the result is",
    "We have $x + y = 10$ and $x - y = 2$.", "Therefore,", "Hence the answer:",
    "Note that $\\{a\\}$ and {b} are sets.", "Checking: 3 + 4 = 7.", "Answer is not obvious.",
    "answer", "The answer:", "# Solution", "<think>hmm</think>", "\\boxed{", "}", "$$",
]


def pick(rng, items):
    return items[rng.randrange(len(items))]


def filler(rng, n):
    return " ".join(pick(rng, FILLER) for _ in range(n))


def unbalanced(rng, s):
    """A copy of s with a brace added or dropped somewhere."""
    i = rng.randrange(len(s) + 1)
    return s[:i] + pick(rng, ["{", "}", ""]) + s[i:]


def math_truth_and_answer(rng):
    truth = pick(rng, MATH_ANSWERS)
    r = rng.random()
    if r < 0.5:
        answer = truth
    elif r < 0.75:
        answer = pick(rng, MATH_ANSWERS)
    elif r < 0.85:
        answer = truth.replace(" ", pick(rng, WHITESPACE))
    else:
        answer = unbalanced(rng, truth)
    return truth, answer


def boxed(rng, answer):
    return pick(rng, ["\\boxed{%s}", "\\boxed{ %s }", "$\\boxed{%s}$", "\\boxed %s$", "\\fbox{%s}",
                      "\\boxed{{%s}}", "\\boxed{\\text{%s}}", "\\boxed{%s"]) % answer


def answer_line(rng, answer):
    return pick(rng, ["Answer: %s", "answer:%s", "ANSWER : %s", "Answer:\n%s", "Answer:  %s  ",
                      "Final Answer: $%s$", "The answer is: %s.", "Anſwer: %s", "Answer：%s",
                      "Answer\t:\t%s", "answer: %s\nAnswer:", "Answer: %s Answer: 9"]) % answer


def math_solution(rng, answer, other):
    """A response in one of several layouts; `other` is a distractor answer."""
    layout = rng.randrange(12)
    pad = pick(rng, WHITESPACE)
    if layout == 0:
        return filler(rng, rng.randrange(4)) + pad + boxed(rng, answer)
    if layout == 1:
        return filler(rng, rng.randrange(4)) + pad + answer_line(rng, answer)
    if layout == 2:
        return boxed(rng, other) + pad + filler(rng, 2) + pad + boxed(rng, answer)
    if layout == 3:
        return answer_line(rng, other) + "\n" + filler(rng, 2) + "\n" + answer_line(rng, answer)
    if layout == 4:
        return boxed(rng, answer) + pad + answer_line(rng, other)
    if layout == 5:
        # The boxed answer far from the end: outside a 100-character window, inside 300.
        return boxed(rng, answer) + " " + "x" * rng.choice([50, 99, 120, 250, 320])
    if layout == 6:
        # A long preamble: only the tail counts.
        return "word " * rng.choice([40, 60, 100]) + boxed(rng, answer)
    if layout == 7:
        return answer + pad + filler(rng, 1)
    if layout == 8:
        return "#### " + answer + pad + boxed(rng, answer)
    if layout == 9:
        return "\\boxed{\\boxed{%s}}" % answer + pad + "{" * rng.randrange(3)
    if layout == 10:
        return answer_line(rng, answer) + pad + boxed(rng, other)
    return "$" + answer + "$ and $" + other + "$" + pad + answer_line(rng, "$" + answer + "$")


def gsm8k_case(rng):
    truth = str(pick(rng, [rng.randrange(-50, 2000), 72, 1234, 0, 5]))
    r = rng.random()
    answer = truth if r < 0.5 else pick(rng, [truth + ".0", f"{int(truth):,}", "-" + truth,
                                              truth + "0", "$" + truth, truth + ".", "x", ""])
    marker = pick(rng, ["#### ", "####", "##### ", "#### -", "### ", "#### $"])
    layout = rng.randrange(6)
    if layout == 0:
        sol = f"{filler(rng, 2)}\n{marker}{answer}"
    elif layout == 1:
        sol = f"#### {pick(rng, ['1', '2', '99'])}\n{marker}{answer}{pick(rng, WHITESPACE)}"
    elif layout == 2:
        sol = f"{marker}{answer}" + " pad" * rng.choice([10, 80, 100])
    elif layout == 3:
        sol = f"{marker}{answer}, then {marker}{pick(rng, ['1,000', '.', '-', '3.5.6'])}"
    elif layout == 4:
        sol = f"The answer is {answer}."
    else:
        sol = "é" * rng.choice([0, 280, 400]) + f"{marker}{answer}"
    return "openai/gsm8k", sol, truth


def math_case(rng):
    truth, answer = math_truth_and_answer(rng)
    sol = math_solution(rng, answer, pick(rng, MATH_ANSWERS))
    source = pick(rng, ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"])
    return source, sol, truth


def math_dapo_case(rng):
    truth, answer = math_truth_and_answer(rng)
    if rng.random() < 0.3:
        # DAPO-Math-17k's ground truths are plain integers.
        truth = str(rng.randrange(0, 1000))
        answer = pick(rng, [truth, truth + ".0", f"{int(truth):,}", str(int(truth) + 1), "\\frac{%s}{1}" % truth])
    sol = math_solution(rng, answer, pick(rng, MATH_ANSWERS))
    source = pick(rng, ["math_dapo", "math", "math_dapo_reasoning", "aime24", "aime25", "aime_2024", "aimeX"])
    return source, sol, truth


QA_TARGETS = [
    "Paris", "The Beatles", "an apple", "George Washington", "1984", "New York City", "the Nile",
    "Jean-Paul Sartre", "U.S.A.", "Mount Everest", "a", "The The", "Saint Petersburg", "3.14",
    "Ludwig van Beethoven", "Los Angeles", "H2O", "Harry Potter and the Philosopher's Stone",
    "ÉCOLE", "straße", "Σίσυφος", "", "  ", "rock 'n' roll",
]


def qa_variant(rng, target):
    r = rng.random()
    if r < 0.3:
        return target
    if r < 0.4:
        return target.upper()
    if r < 0.5:
        return "the " + target
    if r < 0.6:
        return target + pick(rng, [".", "!", "?", ",", " ", "\n"])
    if r < 0.7:
        return target.replace(" ", pick(rng, ["  ", "\t", "\n", "-", "_", ""]))
    if r < 0.8:
        return pick(rng, ["A ", "An ", "THE "]) + target
    return pick(rng, QA_TARGETS)


def search_r1_case(rng):
    n = rng.choice([1, 1, 2, 3])
    targets = [pick(rng, QA_TARGETS) for _ in range(n)]
    answer = qa_variant(rng, targets[rng.randrange(n)])
    tag = pick(rng, ["<answer>%s</answer>", "<answer> %s </answer>", "<answer>\n%s\n</answer>",
                     "<Answer>%s</Answer>", "<answer>%s", "%s</answer>", "<answer><answer>%s</answer>"])
    layout = rng.randrange(6)
    if layout == 0:
        sol = "<think>search</think>" + tag % answer
    elif layout == 1:
        sol = "<answer>wrong</answer> then " + tag % answer
    elif layout == 2:
        sol = tag % answer + " and <answer>" + pick(rng, QA_TARGETS) + "</answer>"
    elif layout == 3:
        # More than ten tags: a right answer earns a quarter.
        sol = "<answer>x</answer>" * rng.choice([9, 10, 11, 12]) + tag % answer
    elif layout == 4:
        sol = "<information>" + answer + "</information>"
    else:
        sol = tag % answer + pick(rng, ["</answer>" * rng.choice([5, 11]), "<answer>" * 11, ""])
    target = targets[0] if n == 1 and rng.random() < 0.3 else targets
    source = pick(rng, ["searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                        "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle"])
    return source, sol, {"target": target}


RULES = {
    "gsm8k": gsm8k_case,
    "math": math_case,
    "math_dapo": math_dapo_case,
    "search_r1": search_r1_case,
}


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    verl_dir = Path(sys.argv[1]).resolve()
    out_path = Path(sys.argv[2]) if len(sys.argv) == 3 else (
        Path(__file__).resolve().parents[2] / "core" / "tests" / "data" / "verl_rewards_reference.json"
    )
    commit = verl_source.commit(verl_dir)
    reward_score = load_reward_score(verl_dir)
    cases = verl_source.reward_cases(reward_score, RULES, lambda _rule: CASES_PER_RULE, SEED)
    out = {
        "verl_commit": commit,
        "generated_by": "scripts/reference/rewards_reference.py",
        "python": sys.version.split()[0],
        "seed": SEED,
        "cases": cases,
    }
    out_path.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n")
    counts = {rule: sum(c["rule"] == rule for c in cases) for rule in RULES}
    print(f"{len(cases)} cases {counts} -> {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
