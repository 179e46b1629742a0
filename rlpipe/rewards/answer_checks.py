"""rlpipe's answer checks, the built-in verifiers: reward functions (TRL's batch signature) whose 1.0 means
correct. As functions ('rlpipe.rewards.answer_checks:exact_match') they read the ground truth from the
`reference` column; as reward types ({type: exact_match, answer_column: answer}) from the column named.
(Named rlpipe.rewards.verifiers before 2026-11-28: `verifiers` is the PyPI package of environments that
rlpipe.rewards.verifiers_tasks and rlpipe.environments.verifiers_env wrap.)"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from rlpipe.rewards.registry import RewardError, RewardFunction, register_reward_type
from rlpipe.rewards.shaping import options_of


def exact_match(prompts: list[str], completions: list[str], reference: list[str], **_: object) -> list[float]:
    """1.0 when the completion (stripped) is exactly the reference, else 0.0."""
    return [float(c.strip() == str(r)) for c, r in zip(completions, reference, strict=True)]


def math_equivalence(prompts: list[str], completions: list[str], reference: list[str], **_: object) -> list[float]:
    """1.0 when the completion's final answer equals the reference mathematically, else 0.0.

    The final answer (`final_answer`) is, in this order:
      1. the last `\\boxed{...}`;
      2. else the rest of the sentence after the last "answer is", "answer:" or "=";
      3. else the last `$...$` math span;
      4. else the last number, unless the last sentence lists several numbers;
    a value followed by words keeps the value ("= 18 pencils" gives 18).
    It must be one value: a list ("538, 539 or 540"), unevaluated arithmetic of numbers ("77 * 7",
    "$77 \\times 7$") or arithmetic cut off by the token budget ("The answer is 539 +") is no answer
    and scores 0. So restating the question ("To calculate 77 * 7, we need to ...") earns nothing,
    while "77 * 7 = 539", "The answer is 539." and "so it is $539$" do.
    math-verify (HF's Math-Verify) then compares it with the reference (read as LaTeX math) using
    sympy: 1/2 = 0.5 = \\frac{1}{2}, 2\\sqrt{2} = \\sqrt{8}, x^2+2x+1 = (x+1)^2. Its signal timeouts are
    off (they need the main thread); reward.timeout_s bounds the call.
    """
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    scores = []
    for completion, expected in zip(completions, reference, strict=True):
        expected = str(expected)
        gold = parse(expected if "$" in expected or "\\boxed" in expected else f"${expected}$", parsing_timeout=None)
        answer = final_answer(completion)
        parsed = parse(f"${answer}$", parsing_timeout=None) if answer else []
        scores.append(float(bool(gold) and bool(parsed) and verify(gold, parsed, timeout_seconds=None)))
    return scores


NUMBER = r"-?\d+(?:\.\d+)?"
ANCHOR = re.compile(r"answer\s+is\s*:?|answer\s*:|=", re.IGNORECASE)
SENTENCE_END = re.compile(r"\n|[.!?](?!\d)|;")
LIST_OF_NUMBERS = re.compile(rf"{NUMBER}\s*(?:,|\bor\b|\band\b|\s)\s*{NUMBER}")  # "538, 539 or 540"
VALUE_THEN_WORDS = re.compile(rf"^({NUMBER})(?:\s+[A-Za-z][A-Za-z ]*)\.?$")  # "18 pencils now"
ARITHMETIC = re.compile(r"\d\s*(?:[-+*^×÷]|\\times|\\cdot|\\div)\s*[-\d({\\]")  # "77*7", "77 \\times 7"
DANGLING_OPERATOR = re.compile(r"(?:[-+*/^×÷]|\\times|\\cdot|\\div)\s*$")  # "20 +": cut off by the token budget


def final_answer(completion: str) -> str | None:
    """The completion's final answer as math text (math_equivalence's rule), or None when it gives
    none: `answer_text` without the words after a leading value ("18 pencils now" -> "18"; math-verify
    would read the words as variables), unless it is arithmetic left for the reader to evaluate."""
    candidate = answer_text(completion)
    if candidate is None:
        return None
    candidate = VALUE_THEN_WORDS.sub(r"\1", candidate)
    is_numeric = not re.search(r"[A-Za-z]", re.sub(r"\\(d?frac|tfrac|sqrt|left|right|times|cdot|div)", "", candidate))
    if is_numeric and (ARITHMETIC.search(candidate) or DANGLING_OPERATOR.search(candidate)):
        return None  # an expression left for the reader to evaluate, or cut off mid-way, is not an answer
    return candidate


def answer_text(completion: str) -> str | None:
    """What the completion gives as its answer (rules 1-4 of math_equivalence), or None."""
    text = re.sub(r"(\d),(\d{3})\b", r"\1\2", completion)  # 1,234 -> 1234
    boxed = text.rfind("\\boxed{")
    if boxed >= 0:
        depth, start = 0, boxed + len("\\boxed{")
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth < 0:
                return text[start:end].strip() or None
        return None
    anchors = list(ANCHOR.finditer(text))
    if anchors:
        rest = text[anchors[-1].end() :]
        candidate = SENTENCE_END.split(rest, maxsplit=1)[0].strip().strip("$").strip()
    elif spans := re.findall(r"\$([^$]+)\$", text):
        candidate = spans[-1].strip()
    else:
        last_sentence = [part for part in SENTENCE_END.split(text) if part.strip()][-1:] or [""]
        numbers = re.findall(NUMBER, last_sentence[0])
        if not numbers or LIST_OF_NUMBERS.search(last_sentence[0]):
            return None
        candidate = numbers[-1]
    if not candidate or LIST_OF_NUMBERS.search(candidate) or "," in candidate and "\\{" not in candidate:
        return None
    return candidate


def strict_match(completion: str, reference: object) -> bool:
    """The strict companion of a verifier: the completion's final answer (`final_answer`) is the
    reference character for character. No evaluation, no equivalence: a metric a policy cannot
    satisfy by restating the question."""
    answer = final_answer(completion)
    return answer is not None and answer.strip() == str(reference).strip()


def _verifier_type(verify: RewardFunction, kind: str) -> Callable[[dict[str, Any], str], RewardFunction]:
    """{type: exact_match | math_equivalence, answer_column: answer}: the verifier reading the
    ground truth from `answer_column` (default `reference`)."""

    def build(options: dict[str, Any], key: str) -> RewardFunction:
        options_of(options, {"answer_column": str}, (), key, kind)
        column = options.get("answer_column", "reference")

        def verifier(prompts: list[str], completions: list[str], **columns: Any) -> Sequence[float]:
            if column not in columns:
                raise RewardError(f"{kind} needs the data column {column!r} (answer_column); have {sorted(columns)}")
            return verify(prompts, completions, columns[column])

        return verifier

    return build


register_reward_type("exact_match", _verifier_type(exact_match, "exact_match"))
register_reward_type("math_equivalence", _verifier_type(math_equivalence, "math_equivalence"))
